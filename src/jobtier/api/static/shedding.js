// shedding.js: the load-shedding tile of the overview. The frame's submits_refused holds,
// per reason, the jobs refused per priority since the API processes started (api/admission.py).

function renderShedding(f) {
  const refused = f.submits_refused || {};
  const shed = refused.shed || {};
  const total = PRIORITIES.reduce((sum, p) => sum + (shed[p] || 0), 0);
  figure("shed-total", total, fmtCount);
  $("shed-split").replaceChildren(
    ...PRIORITIES.flatMap((p, i) => [
      ...(i ? [" · "] : []),
      h("span", { class: "value", id: `shed-${p}`, "data-value": String(shed[p] || 0) }, `${p} ${fmtCount(shed[p] || 0)[0]}`),
    ]),
  );
  let other = 0;
  for (const [reason, byPriority] of Object.entries(refused)) {
    if (reason !== "shed") other += Object.values(byPriority).reduce((a, b) => a + b, 0);
  }
  figure("refused-other", other, fmtCount);
}
