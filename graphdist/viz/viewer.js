/* graphdist graph viewer: draws a layout computed by graphdist.viz.layout on a canvas.
 * Our own code (Apache-2.0, part of graphdist); no dependencies, no network.
 * Items are nodes (0..N-1) then name-scope groups (N..N+G-1). Python gives each item its
 * column and its row within the column at its level; here columns get widths and rows
 * stack, which depends on the groups that are open. */
window.addEventListener("error", function (ev) {
  var el = document.getElementById("error"); el.hidden = false; el.textContent = "viewer error: " + ev.message;
  document.body.setAttribute("data-error", ev.message);
});
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("graph-data").textContent);
  var N = D.nodes, G = D.g.label.length, I = N + G, S = D.strings, nd = D.n, it = D.item;
  var K = {}; D.kinds.forEach(function (k, i) { K[k] = i; });
  var W = 150, H = 40, GX = 46, GY = 10, PAD = 10, HEAD = 24, LPAD = 18, LEFT = 150;
  var canvas = document.getElementById("view"), ctx = canvas.getContext("2d");
  var mini = document.getElementById("mini"), mctx = mini.getContext("2d");
  var tip = document.getElementById("tip"), search = document.getElementById("search");
  var open = Uint8Array.from(D.g.open);
  var kids = []; for (var i = 0; i <= I; i++) kids.push([]);
  for (i = 0; i < I; i++) kids[it.parent[i] + 1].push(i);
  kids.forEach(function (l) { l.sort(function (a, b) { return it.col[a] - it.col[b] || it.row[a] - it.row[b]; }); });
  var spanning = function (i) { return i < N && it.lane[i] !== it.lane_end[i]; };
  var names = nd.name.map(function (s) { return s.split(" "); });
  var E = D.edges, preds = [], succs = [];
  for (i = 0; i < N; i++) { preds.push([]); succs.push([]); }
  for (var e = 0; e < E.length; e += 3) { preds[E[e + 1]].push(e); succs[E[e]].push(E[e + 1]); }
  var gflops = new Float64Array(G), gbytes = new Float64Array(G);
  for (i = 0; i < N; i++) for (var p = it.parent[i]; p >= 0; p = it.parent[p]) {
    gflops[p - N] += nd.flops[i]; gbytes[p - N] += nd.bytes[i];
  }
  // ---------------------------------------------------------------- layout in pixels
  var X = new Float64Array(I), Y = new Float64Array(I), Wd = new Float64Array(I),
      Ht = new Float64Array(I), vis = new Uint8Array(I), rep = new Int32Array(N);
  var laneY = [], laneH = [], worldW = 0, worldH = 0, order = [], edges = [];
  function measure(i) {           // sets Wd, Ht and children's positions relative to i
    if (i < N || !open[i - N]) { Wd[i] = W; Ht[i] = H; return; }
    var cs = kids[i + 1], colW = [], stack = [];
    cs.forEach(function (c) {
      measure(c); var k = it.col[c];
      colW[k] = Math.max(colW[k] || 0, Wd[c]);
    });
    var colX = [], x = PAD;
    for (var k = 0; k < colW.length; k++) { colX[k] = x; x += (colW[k] || 0) + GX; }
    cs.forEach(function (c) {
      var k = it.col[c], y = stack[k] || HEAD;
      X[c] = colX[k] + ((colW[k] || 0) - Wd[c]) / 2; Y[c] = y; stack[k] = y + Ht[c] + GY;
    });
    Wd[i] = Math.max(W + 40, x - GX + PAD);
    Ht[i] = stack.reduce(function (a, b) { return Math.max(a, b || 0); }, HEAD + H + GY) - GY + PAD;
  }
  function place(i, ox, oy) {
    X[i] += ox; Y[i] += oy; vis[i] = 1; order.push(i);
    if (i >= N && open[i - N]) kids[i + 1].forEach(function (c) { place(c, X[i], Y[i]); });
  }
  function relayout() {
    var top = kids[0], L = D.lanes.length, colW = [], stack = [];
    for (var l = 0; l < L; l++) stack.push([]);
    top.forEach(function (c) { measure(c); var k = it.col[c]; colW[k] = Math.max(colW[k] || 0, Wd[c]); });
    var colX = [], x = LEFT;
    for (var k = 0; k < colW.length; k++) { colX[k] = x; x += (colW[k] || 0) + GX; }
    top.forEach(function (c) {
      if (spanning(c)) return;
      var k = it.col[c], s = stack[it.lane[c]], y = s[k] || 0;
      X[c] = colX[k] + ((colW[k] || 0) - Wd[c]) / 2; Y[c] = y; s[k] = y + Ht[c] + GY;
    });
    laneY = []; laneH = []; var y = 0;
    for (l = 0; l < L; l++) {
      var m = H + GY; stack[l].forEach(function (v) { if (v > m) m = v; });
      laneY.push(y); laneH.push(m - GY + 2 * LPAD); y += laneH[l];
    }
    worldW = x - GX + 60; worldH = y;
    vis.fill(0); order = [];
    top.forEach(function (c) {
      if (spanning(c)) {
        var a = it.lane[c], b = it.lane_end[c];
        X[c] = colX[it.col[c]] + ((colW[it.col[c]] || 0) - W) / 2;
        Y[c] = laneY[a] + LPAD / 2; Ht[c] = laneY[b] + laneH[b] - LPAD / 2 - Y[c];
        vis[c] = 1; order.push(c);
      } else place(c, 0, laneY[it.lane[c]] + LPAD);
    });
    for (var n = 0; n < N; n++) {  // nearest visible item: the node or its collapsed scope
      var r = n;
      for (var q = it.parent[n]; q >= 0; q = it.parent[q]) if (!open[q - N]) r = q;
      rep[n] = r;
    }
    var seen = new Set(); edges = [];
    for (var e = 0; e < E.length; e += 3) {
      var a = rep[E[e]], b = rep[E[e + 1]];
      if (a === b || seen.has(a * I + b)) continue;
      seen.add(a * I + b);
      var cross = nd.dev[E[e]] !== nd.dev[E[e + 1]];
      var coll = kindOf(E[e]) >= K.collective || kindOf(E[e + 1]) >= K.collective;
      edges.push([a, b, cross ? 2 : coll ? 1 : 0]);
    }
    drawMiniBase();
  }
  function kindOf(i) { return nd.kind[i]; }
  // ---------------------------------------------------------------- drawing
  var T = { s: 1, x: 0, y: 0 }, dpr = window.devicePixelRatio || 1, cw = 0, ch = 0;
  var hits = [], hitSet = new Uint8Array(I), hitIdx = -1, selected = -1, flash = -1, hover = -1;
  var near = new Uint8Array(I);
  var FILL = ["#e3f9e5", "#eae2f8", "#ffffff", "#c2255c", "#e8590c"];
  var LINE = ["#57ae5b", "#8662c7", "#9fb3c8", "#a61e4d", "#c2410c"];
  function resize() {
    cw = canvas.clientWidth; ch = canvas.clientHeight;
    canvas.width = Math.round(cw * dpr); canvas.height = Math.round(ch * dpr);
    var r = mini.getBoundingClientRect();
    mini.width = Math.round(r.width * dpr); mini.height = Math.round(r.height * dpr);
    drawMiniBase(); draw();
  }
  function text(s, max) {          // cut to fit `max` px (in the current font)
    if (ctx.measureText(s).width <= max) return s;
    var lo = 0, hi = s.length;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (ctx.measureText(s.slice(0, mid) + "…").width <= max) lo = mid; else hi = mid - 1; }
    return s.slice(0, lo) + "…";
  }
  var cut = {};
  function label(i, line, font, max, s) {
    var key = i + ":" + line; if (cut[key] === undefined) { ctx.font = font; cut[key] = text(s, max); }
    return cut[key];
  }
  function roundRect(x, y, w, h, r) {
    ctx.beginPath(); ctx.moveTo(x + r, y); ctx.arcTo(x + w, y, x + w, y + h, r);
    ctx.arcTo(x + w, y + h, x, y + h, r); ctx.arcTo(x, y + h, x, y, r); ctx.arcTo(x, y, x + w, y, r);
    ctx.closePath();
  }
  function endY(i, other) { return spanning(i) ? Math.min(Math.max(other, Y[i] + 12), Y[i] + Ht[i] - 12) : Y[i] + Ht[i] / 2; }
  function draw() {
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0); ctx.clearRect(0, 0, cw, ch);
    ctx.setTransform(dpr * T.s, 0, 0, dpr * T.s, dpr * T.x, dpr * T.y);
    var x0 = -T.x / T.s, y0 = -T.y / T.s, x1 = x0 + cw / T.s, y1 = y0 + ch / T.s, s = T.s;
    var detail = s >= 0.42, lw = 1 / s;
    for (var l = 0; l < laneY.length; l++) {
      ctx.fillStyle = l % 2 ? "#eef2f7" : "#f8fafc"; ctx.fillRect(x0, laneY[l], x1 - x0, laneH[l]);
      ctx.fillStyle = "#d9e2ec"; ctx.fillRect(x0, laneY[l] + laneH[l] - lw, x1 - x0, lw);
    }
    var inView = function (i) { return X[i] < x1 && X[i] + Wd[i] > x0 && Y[i] < y1 && Y[i] + Ht[i] > y0; };
    var fonts = ["600 12.5px system-ui, sans-serif", "11px ui-monospace, 'DejaVu Sans Mono', monospace"];
    order.forEach(function (i) {   // open scopes: frames under their contents
      if (i < N || !open[i - N] || !inView(i)) return;
      roundRect(X[i], Y[i], Wd[i], Ht[i], 8); ctx.fillStyle = "rgba(64,152,215,0.07)"; ctx.fill();
      ctx.lineWidth = Math.max(lw, 1.2); ctx.strokeStyle = hitSet[i] ? "#f0b429" : "#4098d7";
      ctx.setLineDash([5, 3]); ctx.stroke(); ctx.setLineDash([]);
      if (detail) {
        ctx.fillStyle = "#186faf"; ctx.font = fonts[0];
        ctx.fillText(label(i, 9, fonts[0], Wd[i] - 20, "▾ " + D.g.label[i - N]), X[i] + 8, Y[i] + 16);
      }
    });
    ctx.lineWidth = Math.max(lw, 1); var groupsE = [[], [], [], []];
    edges.forEach(function (ed) {
      var a = ed[0], b = ed[1], xa = X[a] + Wd[a], xb = X[b];
      if (Math.max(xa, xb) < x0 || Math.min(xa, xb) > x1) return;
      var ya = endY(a, Y[b] + Ht[b] / 2), yb = endY(b, ya);
      if (Math.max(ya, yb) < y0 || Math.min(ya, yb) > y1) return;
      groupsE[selected >= 0 && (a === selected || b === selected) ? 3 : ed[2]].push([xa, ya, xb, yb]);
    });
    var estyle = [["#9fb3c8", 1], ["#d6336c", 1.4], ["#e8590c", 2], ["#102a43", 2.4]];
    groupsE.forEach(function (list, k) {
      if (!list.length) return;
      ctx.strokeStyle = estyle[k][0]; ctx.lineWidth = Math.max(lw * 0.8, estyle[k][1]);
      ctx.globalAlpha = selected >= 0 && k < 3 ? 0.35 : 1;
      ctx.beginPath();
      list.forEach(function (q) {
        var dx = Math.max(18, (q[2] - q[0]) / 2);
        ctx.moveTo(q[0], q[1]); ctx.bezierCurveTo(q[0] + dx, q[1], q[2] - dx, q[3], q[2], q[3]);
      });
      ctx.stroke(); ctx.globalAlpha = 1;
    });
    order.forEach(function (i) {   // nodes and collapsed scopes
      if ((i >= N && open[i - N]) || !inView(i)) return;
      var x = X[i], y = Y[i], w = Wd[i], h = Ht[i], k = i < N ? nd.kind[i] : -1;
      var dim = selected >= 0 && !near[i];
      ctx.globalAlpha = dim ? 0.35 : 1;
      if (i === flash || hitSet[i]) {
        roundRect(x - 4, y - 4, w + 8, h + 8, 9); ctx.fillStyle = i === flash ? "#f0b429" : "#fce588"; ctx.fill();
      }
      if (!detail && s < 0.15) { ctx.fillStyle = k < 0 ? "#9fd1f5" : k === K.op ? "#bcccdc" : FILL[k]; ctx.fillRect(x, y, w, h); ctx.globalAlpha = 1; return; }
      roundRect(x, y, w, h, k < 0 ? 7 : 5);
      ctx.fillStyle = k < 0 ? "#dceefb" : (k === K.op && nd.view[i] ? "#f5f7fa" : FILL[k]); ctx.fill();
      ctx.lineWidth = Math.max(lw, i === selected || i === hover ? 2.4 : k < 0 ? 2 : 1);
      ctx.strokeStyle = i === selected ? "#102a43" : k < 0 ? "#4098d7" : LINE[k];
      if (k === K.op && nd.view[i]) ctx.setLineDash([4, 3]);
      ctx.stroke(); ctx.setLineDash([]);
      if (exposed(i)) {   // a profiled collective that compute did not hide: red outline
        roundRect(x - 3, y - 3, w + 6, h + 6, 7); ctx.lineWidth = Math.max(lw, 2.5);
        ctx.strokeStyle = "#d64545"; ctx.stroke();
      }
      if (detail) {
        var light = k === K.collective || k === K.copy;
        ctx.fillStyle = light ? "#ffffff" : "#102a43"; ctx.font = fonts[0];
        if (k < 0) {
          var g = i - N;
          ctx.fillStyle = "#0b4f82";
          ctx.fillText(label(i, 0, fonts[0], w - 14, (D.g.stack[g] ? "≡ " : "▸ ") + D.g.label[g]), x + 7, y + 17);
          ctx.font = fonts[1]; ctx.fillStyle = "#486581";
          ctx.fillText(label(i, 1, fonts[1], w - 14, D.g.size[g] + " ops · " + fmt(gflops[g]) + " FLOPs"), x + 7, y + 33);
        } else if (spanning(i)) {
          for (var l2 = it.lane[i]; l2 <= it.lane_end[i]; l2++) {
            var cy = laneY[l2] + laneH[l2] / 2;
            ctx.font = fonts[0]; ctx.fillStyle = "#fff";
            ctx.fillText(label(i, 0, fonts[0], w - 14, S[nd.op[i]]), x + 7, cy - 2);
            ctx.font = fonts[1];
            var own = D.lane_names[i];     // this lane's device's first output
            ctx.fillText(label(i, 10 + l2, fonts[1], w - 14, own ? own[l2] : names[i][l2 - it.lane[i]] || ""), x + 7, cy + 11);
          }
        } else {
          ctx.fillText(label(i, 0, fonts[0], w - 14, S[nd.op[i]]), x + 7, y + 17);
          ctx.font = fonts[1]; ctx.fillStyle = light ? "#ffe8f0" : "#486581";
          ctx.fillText(label(i, 1, fonts[1], w - 14, names[i][0] + " " + S[nd.type[i]].split(" ")[0]), x + 7, y + 33);
        }
      }
      ctx.globalAlpha = 1;
    });
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);   // lane names stay at the left edge
    for (l = 0; l < laneY.length; l++) {
      var top = Math.max(laneY[l] * s + T.y, 0), bot = Math.min((laneY[l] + laneH[l]) * s + T.y, ch);
      if (bot - top < 14) continue;
      var mid = (top + bot) / 2, lab = D.lanes[l], tw;
      ctx.font = "600 13px system-ui, sans-serif"; tw = ctx.measureText(lab).width;
      ctx.fillStyle = "rgba(36,59,83,0.9)"; roundRect(6, mid - 12, tw + 18, 24, 12); ctx.fill();
      ctx.fillStyle = "#fff"; ctx.fillText(lab, 15, mid + 4.5);
    }
    drawMini();
  }
  function fmt(v) {
    var u = ["", "K", "M", "G", "T", "P"], k = 0;
    while (Math.abs(v) >= 1000 && k < u.length - 1) { v /= 1000; k++; }
    return (k ? v.toFixed(1) : v.toFixed(0)) + u[k];
  }
  function exposed(i) {   // ms of a profiled collective no compute covered (page_data)
    return i < N && nd.exposed ? nd.exposed[i] > 0 : false;
  }
  function fmtB(v) {
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], k = 0;
    while (Math.abs(v) >= 1024 && k < u.length - 1) { v /= 1024; k++; }
    return (k ? v.toFixed(1) : v.toFixed(0)) + " " + u[k];
  }
  // ---------------------------------------------------------------- overview
  var miniBase = document.createElement("canvas"), msx = 1, msy = 1;
  function drawMiniBase() {
    if (!worldW || !mini.width) return;
    miniBase.width = mini.width; miniBase.height = mini.height;
    var c = miniBase.getContext("2d");   // stretched to fill: lanes stay visible for long graphs
    msx = Math.min(mini.width / worldW, 0.15 * dpr); msy = Math.min(mini.height / worldH, 0.15 * dpr);
    for (var l = 0; l < laneY.length; l++) { c.fillStyle = l % 2 ? "#e4ebf3" : "#f4f7fb"; c.fillRect(0, laneY[l] * msy, mini.width, laneH[l] * msy); }
    order.forEach(function (i) {
      if (i >= N && open[i - N]) return;
      var k = i < N ? nd.kind[i] : -1;
      c.fillStyle = k < 0 ? "#4098d7" : k === K.op ? "#829ab1" : LINE[k];
      c.fillRect(X[i] * msx, Y[i] * msy, Math.max(1, Wd[i] * msx), Math.max(1, Ht[i] * msy));
    });
  }
  function drawMini() {
    mctx.setTransform(1, 0, 0, 1, 0, 0); mctx.clearRect(0, 0, mini.width, mini.height);
    mctx.drawImage(miniBase, 0, 0);
    mctx.strokeStyle = "#d64545"; mctx.lineWidth = 1.5 * dpr;
    mctx.strokeRect(-T.x / T.s * msx, -T.y / T.s * msy, Math.max(2, cw / T.s * msx), ch / T.s * msy);
  }
  // ---------------------------------------------------------------- view control
  function minScale() { return Math.min(0.02, cw / (worldW + 20)); }
  function setView(s, x, y) { T.s = Math.min(4, Math.max(minScale(), s)); T.x = x; T.y = y; draw(); }
  function fit() {   // the whole graph; a very long one fits its height, from its start
    var s = Math.min(cw / (worldW + 20), ch / (worldH + 20), 1.5);
    if (s >= 0.05) return setView(s, (cw - worldW * s) / 2, Math.max(10, (ch - worldH * s) / 2));
    s = Math.min(1, Math.max(0.2, (ch - 20) / worldH));
    setView(s, 10, worldH * s < ch ? (ch - worldH * s) / 2 : 10);
  }
  function initial() {
    var s = Math.min(cw / (worldW + 20), ch / (worldH + 20));
    if (s >= 0.45) return fit();
    s = Math.min(1, Math.max(0.45, (ch - 20) / worldH));
    setView(s, 10, worldH * s < ch ? (ch - worldH * s) / 2 : 10);
  }
  function centerOn(i, s) {
    s = s || Math.max(T.s, 0.9);
    var tall = Ht[i] * s > ch;   // a collective across many lanes: keep the height in view
    setView(s, cw / 2 - (X[i] + Wd[i] / 2) * s, tall ? T.y : ch / 2 - (Y[i] + Ht[i] / 2) * s);
  }
  var samePath = {};   // a scope opens and closes in every lane at once (replicas match)
  D.g.path.forEach(function (p, g) { (samePath[p] = samePath[p] || []).push(g); });
  function toggle(g, anchor, alone) {
    var sx = X[anchor] * T.s + T.x, sy = Y[anchor] * T.s + T.y, v = open[g] ? 0 : 1;
    (alone ? [g] : samePath[D.g.path[g]]).forEach(function (h) { open[h] = v; });
    cut = {}; relayout(); markNear(); tip.hidden = true;
    T.x = sx - X[anchor] * T.s; T.y = sy - Y[anchor] * T.s; draw();
  }
  function setAll(v) { open.fill(v); cut = {}; relayout(); markNear(); tip.hidden = true; fit(); }
  function reveal(n) {             // open every scope around node n
    var changed = false;
    for (var q = it.parent[n]; q >= 0; q = it.parent[q]) if (!open[q - N]) { open[q - N] = 1; changed = true; }
    if (changed) { cut = {}; relayout(); markNear(); }
  }
  function markNear() {
    near.fill(0); if (selected < 0) return;
    if (selected < N && !vis[selected]) { selected = -1; return; }
    near[selected] = 1;
    edges.forEach(function (e) { if (e[0] === selected) near[e[1]] = 1; if (e[1] === selected) near[e[0]] = 1; });
  }
  function pick(mx, my) {          // the item under a screen point: nodes first, then scopes
    var wx = (mx - T.x) / T.s, wy = (my - T.y) / T.s, best = -1;
    for (var k = order.length - 1; k >= 0; k--) {
      var i = order[k];
      if (wx < X[i] || wx > X[i] + Wd[i] || wy < Y[i] || wy > Y[i] + Ht[i]) continue;
      if (i >= N && open[i - N]) { if (best < 0) best = i; continue; }
      return i;
    }
    return best;
  }
  // ---------------------------------------------------------------- hover details
  function esc(s) { return String(s).replace(/[&<>"]/g, function (c) { return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]; }); }
  function details(i) {
    if (i >= N) {
      var g = i - N;
      if (D.g.stack[g]) return "<b>" + esc(D.g.label[g]) + "</b><span class=badge>" + esc(D.lanes[it.lane[i]]) + "</span><br>" +
        D.g.size[g] + " nodes of one op in one column, folded · " + fmt(gflops[g]) + " FLOPs · " + fmtB(gbytes[g]) + " touched<br>" +
        "<span class=k>click to " + (open[g] ? "fold" : "unfold") + "</span>";
      return "<b>scope " + esc(D.g.path[g]) + "</b><span class=badge>" + esc(D.lanes[it.lane[i]]) + "</span><br>" +
        D.g.size[g] + " ops · " + fmt(gflops[g]) + " FLOPs · " + fmtB(gbytes[g]) + " touched<br>" +
        "<span class=k>click to " + (open[g] ? "collapse" : "open") + "</span>";
    }
    var k = D.kinds[nd.kind[i]], op = S[nd.op[i]], params = S[nd.params[i]];
    var types = S[nd.type[i]].split(" "), out = names[i].map(function (n, j) { return "<code>" + esc(n) + ":" + esc(types[j] || "") + "</code>"; });
    var ins = preds[i].map(function (e) { return esc(names[E[e]][E[e + 2]]); });
    var rows = ["<b>" + esc(op) + (params ? "[" + esc(params) + "]" : "") + "</b><span class='badge " + k + "'>" + k + "</span>",
      "<span class=k>out </span>" + out.slice(0, 8).join(" ") + (out.length > 8 ? " …" : ""),
      "<span class=k>device </span>" + esc(S[nd.dev[i]] || "(not placed)") + (S[nd.scope[i]] ? "  <span class=k>scope </span>" + esc(S[nd.scope[i]]) : "")];
    if (k !== "arg" && k !== "state") rows.push("<span class=k>FLOPs </span>" + fmt(nd.flops[i]) + " (" + nd.flops[i].toLocaleString("en-US") + ")  <span class=k>bytes </span>" + fmtB(nd.bytes[i]));
    if (nd.moved[i]) rows.push("<span class=k>moved across devices </span>" + fmtB(nd.moved[i]));
    if (exposed(i)) rows.push("<span class=exposed>exposed " + nd.exposed[i].toFixed(3) + " ms</span> <span class=k>(collective time no compute hid)</span>");
    if (ins.length) rows.push("<span class=k>in </span><code>" + ins.slice(0, 12).join(" ") + (ins.length > 12 ? " …" : "") + "</code>");
    rows.push("<span class=k>used by </span>" + succs[i].length + " node" + (succs[i].length === 1 ? "" : "s"));
    if (S[nd.src[i]]) rows.push("<span class=k>source </span><code>" + esc(S[nd.src[i]]) + "</code>");
    return rows.join("<br>");
  }
  function showTip(i, mx, my) {
    if (i < 0) { tip.hidden = true; return; }
    tip.innerHTML = details(i); tip.hidden = false;
    var r = tip.getBoundingClientRect(), x = mx + 16, y = my + 84;
    if (x + r.width > window.innerWidth - 8) x = mx - r.width - 16;
    if (y + r.height > window.innerHeight - 8) y = Math.max(8, window.innerHeight - r.height - 8);
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  // ---------------------------------------------------------------- search
  var hitsEl = document.getElementById("hits"), timer = 0;
  function runSearch() {
    var q = search.value.trim().toLowerCase(); hits = []; hitSet.fill(0); hitIdx = -1; flash = -1;
    if (q) for (var i = 0; i < N; i++) {
      if (nd.name[i].toLowerCase().indexOf(q) >= 0 || S[nd.op[i]].toLowerCase().indexOf(q) >= 0 ||
          S[nd.scope[i]].toLowerCase().indexOf(q) >= 0) {
        hits.push(i); hitSet[i] = 1;
        for (var p = it.parent[i]; p >= 0; p = it.parent[p]) hitSet[p] = 1;
      }
    }
    hitsEl.textContent = q ? (hits.length ? hits.length + " found" : "no match") : "";
    draw();
  }
  function step(d) {
    if (!hits.length) return;
    hitIdx = (hitIdx + d + hits.length) % hits.length; flash = hits[hitIdx]; tip.hidden = true;
    reveal(flash); centerOn(flash);
    hitsEl.textContent = (hitIdx + 1) + " / " + hits.length;
  }
  search.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(runSearch, 120); });
  search.addEventListener("keydown", function (ev) {
    if (ev.key === "Enter") { clearTimeout(timer); if (hitIdx < 0) runSearch(); step(ev.shiftKey ? -1 : 1); }
    if (ev.key === "Escape") { search.value = ""; runSearch(); search.blur(); }
  });
  document.getElementById("next").onclick = function () { step(1); };
  document.getElementById("prev").onclick = function () { step(-1); };
  document.getElementById("fit").onclick = fit;
  document.getElementById("expand").onclick = function () { setAll(1); };
  document.getElementById("collapse").onclick = function () { setAll(0); };
  // ---------------------------------------------------------------- mouse and keys
  var drag = null;
  canvas.addEventListener("mousedown", function (ev) { drag = { x: ev.clientX, y: ev.clientY, tx: T.x, ty: T.y, moved: false }; canvas.classList.add("drag"); });
  window.addEventListener("mouseup", function (ev) {
    if (!drag) return; canvas.classList.remove("drag");
    var d = drag; drag = null; if (d.moved || ev.target !== canvas) return;
    var r = canvas.getBoundingClientRect(), i = pick(ev.clientX - r.left, ev.clientY - r.top);
    if (i >= N) {
      var wy = (ev.clientY - r.top - T.y) / T.s;
      if (!open[i - N] || wy < Y[i] + HEAD) { toggle(i - N, i, ev.shiftKey); return; }
    }
    selected = i >= 0 && i < N ? (selected === i ? -1 : i) : -1; markNear(); draw();
  });
  canvas.addEventListener("mousemove", function (ev) {
    var r = canvas.getBoundingClientRect(), mx = ev.clientX - r.left, my = ev.clientY - r.top;
    if (drag) {
      if (Math.abs(ev.clientX - drag.x) + Math.abs(ev.clientY - drag.y) > 3) drag.moved = true;
      if (drag.moved) { tip.hidden = true; T.x = drag.tx + ev.clientX - drag.x; T.y = drag.ty + ev.clientY - drag.y; draw(); }
      return;
    }
    var i = pick(mx, my);
    if (i !== hover) { hover = i; draw(); }
    showTip(i, mx, my);
  });
  canvas.addEventListener("mouseleave", function () { hover = -1; tip.hidden = true; draw(); });
  canvas.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    var r = canvas.getBoundingClientRect(), mx = ev.clientX - r.left, my = ev.clientY - r.top;
    var s = Math.min(4, Math.max(minScale(), T.s * Math.exp(-ev.deltaY * (ev.deltaMode ? 0.05 : 0.0015))));
    setView(s, mx - (mx - T.x) * s / T.s, my - (my - T.y) * s / T.s);
    hover = pick(mx, my); showTip(hover, mx, my);
  }, { passive: false });
  var miniDrag = false;
  function miniMove(ev) {
    var r = mini.getBoundingClientRect(), wx = (ev.clientX - r.left) * dpr / msx, wy = (ev.clientY - r.top) * dpr / msy;
    setView(T.s, cw / 2 - wx * T.s, ch / 2 - wy * T.s);
  }
  mini.addEventListener("mousedown", function (ev) { miniDrag = true; miniMove(ev); ev.stopPropagation(); });
  window.addEventListener("mousemove", function (ev) { if (miniDrag) miniMove(ev); });
  window.addEventListener("mouseup", function () { miniDrag = false; });
  window.addEventListener("keydown", function (ev) {
    if (ev.target === search) return;
    if (ev.key === "/") { ev.preventDefault(); search.focus(); search.select(); }
    else if (ev.key === "f" || ev.key === "F") fit();
    else if (ev.key === "Escape") { selected = -1; markNear(); draw(); }
    else if (ev.key === "+" || ev.key === "=") setView(T.s * 1.25, cw / 2 - (cw / 2 - T.x) * 1.25, ch / 2 - (ch / 2 - T.y) * 1.25);
    else if (ev.key === "-") setView(T.s / 1.25, cw / 2 - (cw / 2 - T.x) / 1.25, ch / 2 - (ch / 2 - T.y) / 1.25);
  });
  window.addEventListener("resize", resize);
  // ---------------------------------------------------------------- start
  document.getElementById("title").textContent = D.title;
  document.getElementById("stats").textContent = D.stats;
  if (D.banner) {                       // the replicas run merged: say so plainly
    var banner = document.getElementById("banner");
    banner.textContent = D.banner; banner.title = D.banner; banner.hidden = false;
  }
  relayout(); cw = canvas.clientWidth; ch = canvas.clientHeight; resize(); initial();
  var hash = decodeURIComponent(location.hash.slice(1));   // page.html#q=all_reduce
  if (hash.indexOf("q=") === 0) { search.value = hash.slice(2); runSearch(); step(1); }
  document.body.setAttribute("data-ready", "1");
  document.body.setAttribute("data-visible", String(order.length));
})();
