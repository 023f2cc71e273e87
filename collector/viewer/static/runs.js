// tracecar viewer: #/runs?a=EXP&step_a=N&b=EXP&step_b=M — two runs (experiments) or two checkpoints
// (steps) side by side, joined on the sample index: the same prompts' groups, their mean and best
// rewards, and the change; each pair opens in #/compare (best rollout against best rollout).
// Read from api/groups of each side (the group view's statistics: partial groups are said).
"use strict";
window.tracecarRuns = (() => {
  const MAX_GROUPS = 1000;

  function sideForm(kit, params, facets, side) {
    const { h, fmt, expKey } = kit;
    const exp = params[side];
    return h("fieldset", { class: "runs-side" }, h("legend", null, side.toUpperCase()),
      h("label", null, "experiment", h("select", { name: side, "data-testid": "runs-" + side },
        facets.experiments.map((e) => h("option", { value: expKey(e.experiment), selected: expKey(e.experiment) === exp },
          fmt.exp(e.experiment) + " (steps " + (e.step_min ?? "—") + "–" + (e.step_max ?? "—") + ")")))),
      h("label", null, "step", h("input", { type: "number", name: "step_" + side, value: params["step_" + side] ?? "", "data-testid": "runs-step-" + side })));
  }

  async function side(kit, exp, step) {
    const { api, expParam } = kit;
    const page = await api("groups", { experiment: expParam(exp), step, sort: "sample_index", diff: "false", limit: MAX_GROUPS }, ["experiment"]);
    return new Map(page.groups.map((g) => [String(g.sample_index), g]));
  }

  function delta(kit, a, b) {
    const { h, fmt } = kit;
    if (a === null || b === null || a === undefined || b === undefined) return h("span", { class: "muted" }, "—");
    const d = b - a;
    return h("span", { class: d > 0 ? "good" : d < 0 ? "bad" : "muted" }, (d > 0 ? "+" : "") + fmt.reward(d));
  }

  async function view(params, kit) {
    const { h, api, fmt, href, go, expKey } = kit;
    const facets = await api("facets");
    if (!facets.experiments.length) return h("p", null, "No trajectories yet.");
    const first = expKey(facets.experiments[0].experiment);
    const p = { a: params.a ?? first, b: params.b ?? params.a ?? first, step_a: params.step_a, step_b: params.step_b };
    const form = h("form", { class: "controls runs-form", "data-testid": "runs-form",
      onsubmit: (e) => { e.preventDefault(); const f = new FormData(e.target); go("/runs", Object.fromEntries(f.entries())); } },
      sideForm(kit, p, facets, "a"), sideForm(kit, p, facets, "b"), h("button", { type: "submit", class: "primary" }, "Compare runs"));
    const intro = h("p", { class: "muted" }, "Two runs, or two checkpoints of one run, joined on the sample index: the same prompts' GRPO groups side by side. ",
      "Pick an experiment and a step for each side.");
    if (p.step_a === undefined || p.step_a === "" || p.step_b === undefined || p.step_b === "") return h("div", { "data-testid": "runs" }, h("h1", null, "Run against run"), intro, form);
    const [ga, gb] = await Promise.all([side(kit, p.a, p.step_a), side(kit, p.b, p.step_b)]);
    const keys = [...ga.keys()].filter((k) => gb.has(k)).sort((x, y) => (Number(x) - Number(y)) || (x < y ? -1 : x > y ? 1 : 0));
    const mean = (xs) => (xs.length ? xs.reduce((s, x) => s + x, 0) / xs.length : null);
    const ma = mean(keys.map((k) => ga.get(k).mean).filter((x) => x !== null));
    const mb = mean(keys.map((k) => gb.get(k).mean).filter((x) => x !== null));
    const better = keys.filter((k) => ga.get(k).mean !== null && gb.get(k).mean !== null && gb.get(k).mean > ga.get(k).mean).length;
    const worse = keys.filter((k) => ga.get(k).mean !== null && gb.get(k).mean !== null && gb.get(k).mean < ga.get(k).mean).length;
    const label = (exp, step) => fmt.exp(kit.expParam(exp) === "" ? null : exp) + " step " + step;
    const stat = (g) => (g.partial ? h("span", { class: "badge partial", title: "rollouts sampled out" }, g.n + " of " + g.total) : g.n);
    const rows = keys.map((k) => {
      const a = ga.get(k);
      const b = gb.get(k);
      return h("tr", { "data-testid": "runs-row", "data-sample-index": k },
        h("td", { class: "num" }, k),
        h("td", { class: "num" }, stat(a)), h("td", { class: "num", "data-testid": "runs-mean-a" }, fmt.reward(a.mean)), h("td", { class: "num" }, fmt.reward(a.max)),
        h("td", { class: "num" }, stat(b)), h("td", { class: "num", "data-testid": "runs-mean-b" }, fmt.reward(b.mean)), h("td", { class: "num" }, fmt.reward(b.max)),
        h("td", { class: "num", "data-testid": "runs-delta" }, delta(kit, a.mean, b.mean)),
        h("td", null, a.best && b.best ? h("a", { href: href("/compare", { ids: a.best + "," + b.best }), "data-testid": "runs-compare",
          title: "the best rollout of each side, side by side" }, "best vs best") : h("span", { class: "muted" }, "—")));
    });
    return h("div", { "data-testid": "runs" },
      h("h1", null, "Run against run"), intro, form,
      h("p", { "data-testid": "runs-summary" }, "A = " + label(p.a, p.step_a) + ", B = " + label(p.b, p.step_b) + ": " + keys.length + " sample indices in both (",
        ga.size - keys.length + " only in A, " + (gb.size - keys.length) + " only in B); mean reward " + fmt.reward(ma) + " → " + fmt.reward(mb) + " (",
        delta(kit, ma, mb), "); B better on " + better + ", worse on " + worse + "."),
      keys.length ? h("table", { "data-testid": "runs-table" },
        h("thead", null, h("tr", null, ["sample", "A rollouts", "A mean", "A best", "B rollouts", "B mean", "B best", "B − A (mean)", ""].map((c, i) =>
          h("th", { class: i < 8 ? "num" : "" }, c)))),
        h("tbody", null, rows)) : h("p", { class: "muted" }, "No sample index is in both."));
  }

  return { view };
})();
