// charts.js: sparklines on canvas, in the page's palette (light or dark).

let palette = {};
function readPalette() {
  const css = getComputedStyle(document.documentElement);
  for (const name of ["blue", "green", "red", "orange", "amber", "violet", "teal", "slate", "grid", "faint", "muted"]) {
    palette[name] = css.getPropertyValue(`--${name}`).trim();
  }
}

/** A pleasant axis top at or above v: 1, 2, 2.5 or 5 times a power of ten. */
function niceCeil(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v * 0.999) return m * p;
  return 10 * p;
}

/**
 * Draws lines (or, with `stack`, bands stacked bottom-up) against time on a canvas sized by
 * CSS, sharp on high-density screens. lines: [{data: [[t, v|null]...], color}]. A null
 * value leaves a gap. The top of the scale is written in the corner, and the canvas's
 * accessible label says the latest values.
 */
function spark(canvas, lines, { t0, t1, floor = 1, fmt = fmtCount, stack = false, label, windowLabel = "" }) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight - 10; // the top padding holds nothing but breathing room
  if (w === 0 || h <= 0) return;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round((h + 10) * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round((h + 10) * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 10 * dpr);
  ctx.clearRect(0, -10, w, h + 10);

  // stacked: every band's top is the sum of it and the bands below (same timestamps)
  let tops = lines.map((l) => l.data);
  if (stack) {
    tops = lines.map((_, k) => lines[0].data.map(([t], i) =>
      [t, lines.slice(0, k + 1).reduce((sum, l) => sum + (l.data[i]?.[1] ?? 0), 0)]));
  }
  let peak = 0;
  for (const data of tops) for (const [, v] of data) if (v !== null && v > peak) peak = v;
  const top = niceCeil(Math.max(peak, floor));
  const span = Math.max(t1 - t0, 1e-3);
  const x = (t) => ((t - t0) / span) * (w - 4) + 1;
  const y = (v) => h - 1 - (v / top) * (h - 3);

  // scale: a faint line at the top value, labelled; and the baseline
  ctx.strokeStyle = palette.grid;
  ctx.lineWidth = 1;
  ctx.setLineDash([3, 3]);
  ctx.beginPath(); ctx.moveTo(0, y(top) + 0.5); ctx.lineTo(w, y(top) + 0.5); ctx.stroke();
  ctx.setLineDash([]);
  ctx.beginPath(); ctx.moveTo(0, h - 0.5); ctx.lineTo(w, h - 0.5); ctx.stroke();
  ctx.fillStyle = palette.faint;
  ctx.font = "10px -apple-system, 'Segoe UI', Roboto, Arial, 'Liberation Sans', sans-serif";
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(joinFmt(fmt(top)), 1, y(top) - 9);

  tops.forEach((data, k) => {
    const color = lines[k].color;
    const below = stack && k > 0 ? tops[k - 1] : null;
    // contiguous runs of known values (a null breaks the line)
    const runs = [];
    let run = [];
    data.forEach((p, i) => {
      if (p[1] === null || p[0] < t0) { if (run.length) runs.push(run); run = []; } else run.push(i);
    });
    if (run.length) runs.push(run);
    for (const idx of runs) {
      // area under the line (or between this band and the one below)
      ctx.beginPath();
      idx.forEach((i, n) => (n ? ctx.lineTo : ctx.moveTo).call(ctx, x(data[i][0]), y(data[i][1])));
      for (let n = idx.length - 1; n >= 0; n--) {
        const i = idx[n];
        ctx.lineTo(x(data[i][0]), below ? y(below[i][1]) : h);
      }
      ctx.closePath();
      ctx.globalAlpha = stack ? 0.55 : 0.13;
      ctx.fillStyle = color;
      ctx.fill();
      ctx.globalAlpha = 1;
      if (stack && k < tops.length - 1 && tops.length > 1) continue; // only the total gets a line
      ctx.beginPath();
      idx.forEach((i, n) => (n ? ctx.lineTo : ctx.moveTo).call(ctx, x(data[i][0]), y(data[i][1])));
      ctx.strokeStyle = stack ? palette.muted : color;
      ctx.lineWidth = 1.6;
      ctx.lineJoin = "round";
      ctx.stroke();
    }
    const last = data[data.length - 1];
    if (last && last[1] !== null && !(stack && k < tops.length - 1)) {
      ctx.beginPath();
      ctx.arc(x(last[0]), y(last[1]), 2.6, 0, 2 * Math.PI);
      ctx.fillStyle = stack ? palette.muted : color;
      ctx.fill();
    }
  });

  const latest = lines.map((l) => `${l.name ?? ""} ${joinFmt(fmt(l.data[l.data.length - 1]?.[1]))}`.trim());
  canvas.setAttribute("aria-label", `${label}, ${windowLabel}: now ${latest.join(", ")}; scale up to ${joinFmt(fmt(top))}`);
}
