#!/bin/sh
# The package as users install it: build the wheel, install it into a fresh virtualenv
# (never editable: an editable install hides a module left out of the wheel), import
# every module it ships, and train the demo's first steps from it, outside the source tree
# so nothing is imported from the checkout.
#     sh tools/wheel_check.sh [python3]
set -eu
PY=${1:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# build from a copy of the files git would commit: a build/ folder left in the checkout
# would put stale modules into the wheel, and the check must not leave one either
mkdir "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf - --ignore-failed-read 2>/dev/null) |
  (cd "$WORK/src" && tar xf -)
"$PY" -m pip wheel -q --no-deps --disable-pip-version-check -w "$WORK/dist" "$WORK/src"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$WORK"/dist/graphdist-*.whl

cd "$WORK"
"$WORK/venv/bin/python" - <<'PY'
import importlib, pkgutil, sys
import graphdist
assert "site-packages" in graphdist.__file__, graphdist.__file__
names = [m.name for m in pkgutil.walk_packages(graphdist.__path__, "graphdist.")
         if not m.name.endswith("__main__")]   # __main__ runs the command line
for name in names:
    importlib.import_module(name)
print(f"wheel: imported {len(names) + 1} modules from {graphdist.__file__}")
PY
if ! "$WORK/venv/bin/graphdist" demo --devices 2 --steps 5 --html "$WORK/step.html" \
    >"$WORK/demo.log" 2>&1 || ! test -s "$WORK/step.html"; then
  cat "$WORK/demo.log"
  echo "wheel: the installed demo failed" >&2
  exit 1
fi
echo "wheel: the installed demo trained 5 steps on 2 devices: $(grep '^final loss' "$WORK/demo.log")"
