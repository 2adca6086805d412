"""Make docs/img/inspect-lanes.png and docs/img/inspect-collectives.png: the HTML viewer on
the replicated step of `graphdist demo --devices 4` (per-device lanes, collectives between
them), and docs/img/inspect-cnn.png: the same for `graphdist demo --model cnn --devices 4`
(a conv layer's nodes), photographed by headless Chromium.

    .venv/bin/python tools/viewer_screenshots.py            # needs the `chromium` command
    .venv/bin/python tools/viewer_screenshots.py inspect-cnn.png    # only the shots named

Each shot is the page `g.to_html()` writes, with a few lines of script appended that do
what a user would (search, zoom with the wheel, hover a node) before the screenshot.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZE = "1400,900"

# what the page does before the shot, as a user would: type a search and press Enter
# (centres the first match), zoom out with the wheel, drag the view by `pan` pixels, and
# hover the node whose tooltip shows `hover` (found by moving the mouse over the lanes);
# `model` names the example whose 4-device step is drawn
SHOTS = {
    "inspect-lanes.png": {"model": "mlp", "query": "", "zoom_out": 0, "pan": [0, 0],
                          "hover": "out f@0:"},     # dense1's matmul_bias_act on cpu:0
    "inspect-collectives.png": {"model": "mlp", "query": "host_", "zoom_out": 2,
                                "pan": [150, -160], "hover": ""},
    "inspect-cnn.png": {"model": "cnn", "query": "", "zoom_out": 0, "pan": [0, 0],
                        "hover": "out m@0:"},     # conv2d_1's conv2d_bias_act_pool, cpu:0
}

ACTIONS = """
<script>
(function (shot) {
  var canvas = document.getElementById("view"), search = document.getElementById("search");
  var tip = document.getElementById("tip"), r = canvas.getBoundingClientRect();
  function at(x, y, extra) {
    var ev = {clientX: r.left + x, clientY: r.top + y, bubbles: true};
    for (var k in extra || {}) ev[k] = extra[k];
    return ev;
  }
  if (shot.query) {
    search.value = shot.query;
    search.dispatchEvent(new KeyboardEvent("keydown", {key: "Enter"}));
  }
  for (var k = 0; k < shot.zoom_out; k++)
    canvas.dispatchEvent(new WheelEvent("wheel", at(r.width / 2, r.height / 2, {deltaY: 200})));
  if (shot.pan[0] || shot.pan[1]) {
    canvas.dispatchEvent(new MouseEvent("mousedown", at(r.width / 2, r.height / 2)));
    canvas.dispatchEvent(new MouseEvent("mousemove", at(r.width / 2 + shot.pan[0] / 2,
                                                        r.height / 2 + shot.pan[1] / 2)));
    canvas.dispatchEvent(new MouseEvent("mousemove", at(r.width / 2 + shot.pan[0],
                                                        r.height / 2 + shot.pan[1])));
    window.dispatchEvent(new MouseEvent("mouseup", at(r.width / 2 + shot.pan[0],
                                                      r.height / 2 + shot.pan[1])));
  }
  canvas.dispatchEvent(new MouseEvent("mouseleave", {}));
  if (shot.hover) {
    for (var y = 4; y < r.height; y += 5)
      for (var x = 4; x < r.width; x += 10) {
        canvas.dispatchEvent(new MouseEvent("mousemove", at(x, y)));
        if (!tip.hidden && tip.textContent.indexOf(shot.hover) >= 0) return;
      }
    canvas.dispatchEvent(new MouseEvent("mouseleave", {}));
  }
})(%s);
</script>
</body>"""


def shrink(png: Path) -> None:
    """256 colours, no dithering: the same picture at a third of the bytes (Pillow comes
    with matplotlib; without it the PNG stays as Chromium wrote it)."""
    try:
        from PIL import Image
    except ImportError:
        return
    image = Image.open(png).convert("RGB")
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        png, optimize=True)


def main(names=None) -> int:
    names = list(names or SHOTS)
    unknown = [n for n in names if n not in SHOTS]
    if unknown:
        print(f"unknown shot(s) {unknown}; choose from {list(SHOTS)}", file=sys.stderr)
        return 2
    chromium = shutil.which("chromium")
    if chromium is None:
        print("needs the `chromium` command (Debian: apt-get install chromium)", file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    from graphdist.examples import cnn_digits, mlp_digits

    examples = {"mlp": mlp_digits, "cnn": cnn_digits}
    pages: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            shot = dict(SHOTS[name])
            model = shot.pop("model")
            if model not in pages:      # what `graphdist demo [--model cnn] --devices 4` draws
                step = examples[model].train(4, steps=1)["train_step"]
                pages[model] = Path(step.replicated_graph.to_html(
                    Path(tmp) / "step.html")).read_text()
            page = pages[model]
            html = Path(tmp) / name.replace(".png", ".html")
            html.write_text(page.replace("</body>", ACTIONS % json.dumps(shot), 1))
            out = ROOT / "docs" / "img" / name
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                            "--hide-scrollbars", f"--user-data-dir={tmp}/profile",
                            "--virtual-time-budget=3000", f"--window-size={SIZE}",
                            f"--screenshot={out}", f"file://{html}"],
                           check=True, capture_output=True, timeout=120)
            shrink(out)
            print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
