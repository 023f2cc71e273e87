// tracecar viewer: training truth (issue 29), drawn by app.js with its helpers (kit). Loaded before app.js.
// Drift at each turn (does its prompt extend the previous turn's prompt + response?), the reward panel
// (the reward's components and the ground truth), the list's truth filters and columns, the per-step
// health items, and a group's separating component. Everything from spans goes into the page as text.
"use strict";
window.tracecarTruth = (() => {
  const idList = (ids) => (ids || []).join(" ");

  // at a turn: nothing when it extends the previous turn exactly; else where it parts and what each side holds
  function turnDrift(kit, turn) {
    const { h, fmt } = kit;
    const d = turn.drift;
    if (!d) return null;
    if (d.extends) {
      return h("div", { class: "drift ok muted", "data-testid": "turn-drift-ok", title: "its prompt starts with the previous turn's prompt + response, id for id" },
        "✓ extends turn " + (turn.index - 1) + " exactly");
    }
    const side = (label, text, ids, testid) => h("div", { class: "drift-side" }, h("div", { class: "label" }, label),
      text !== undefined && text !== null ? h("pre", { class: "text drift-text", "data-testid": testid }, text) : null,
      h("div", { class: "mono muted drift-ids", "data-testid": testid + "-ids" }, "ids: " + idList(ids)));
    return h("div", { class: "drift bad-box", "data-testid": "turn-drift" },
      h("div", null, h("strong", { class: "bad" }, "Drift: "),
        "this prompt does not extend turn " + (turn.index - 1) + "'s prompt + response. First difference at token " + fmt.int(d.at) +
        " of " + fmt.int(d.context_len) + "; " + fmt.int(d.differing) + (d.capped ? "+" : "") + " of its ids not reproduced" +
        (d.inserted ? ", " + fmt.int(d.inserted) + " in their place" : "") + ". The trainer's mask and the generated tokens part ways here."),
      h("div", { class: "drift-grid" },
        side("shared, just before the cut", d.before_text, d.before, "drift-before"),
        side("turn " + (turn.index - 1) + " had (prompt + generated)", d.was_text, d.was, "drift-was"),
        side("turn " + turn.index + "'s prompt has", d.now_text, d.now, "drift-now")));
  }

  // the reward and its parts: VERL's reward_extra_info (or annotate(acc=..)), and the ground truth
  function rewardPanel(kit, t) {
    const { h, fmt } = kit;
    const truth = t.truth || {};
    const parts = Object.entries(truth.reward_components || {});
    if (!parts.length && (truth.ground_truth === null || truth.ground_truth === undefined)) return null;
    return h("section", { class: "card reward-panel", "data-testid": "reward-panel" },
      h("h3", null, "Reward ", h("span", { class: "mono" }, fmt.reward(t.reward))),
      parts.length ? h("table", { "data-testid": "reward-components" },
        h("thead", null, h("tr", null, h("th", null, "component"), h("th", { class: "num" }, "value"))),
        h("tbody", null, parts.map(([k, v]) => h("tr", { "data-testid": "reward-component", "data-key": k },
          h("td", null, k), h("td", { class: "num mono" + (v === 0 ? " bad" : "") }, fmt.value(v)))))) : null,
      truth.ground_truth !== null && truth.ground_truth !== undefined
        ? h("div", null, h("div", { class: "label" }, "ground truth"), h("pre", { class: "text", "data-testid": "ground-truth" }, truth.ground_truth)) : null);
  }

  // the list: drift select, component conditions; the columns show drift and the chosen components
  function listFilters(kit, params, facets) {
    const { h } = kit;
    const keys = (facets.reward_components || []).map((c) => c.key);
    return [
      h("label", null, "turn drift", h("select", { name: "drift", "data-testid": "filter-drift" },
        [["", "any"], ["true", "a turn drifted"], ["false", "multi-turn, no drift"]].map(([v, l]) => h("option", { value: v, selected: (params.drift || "") === v }, l)))),
      h("label", null, "reward parts", h("input", { type: "text", name: "where", maxlength: "1024", value: params.where || "", "data-testid": "filter-where",
        placeholder: keys.length ? keys.slice(0, 2).map((k, i) => k + (i ? "<1" : "=0")).join(",") : "acc=0,format<1",
        title: "reward components: KEY OP NUMBER, comma-separated (OP: = != < <= > >=)" + (keys.length ? "; known: " + keys.join(", ") : "") })),
      keys.length ? h("label", null, "columns", h("input", { type: "text", name: "cols", value: params.cols || "", "data-testid": "filter-cols",
        placeholder: keys.slice(0, 3).join(","), title: "reward components to show as columns; known: " + keys.join(", ") })) : null,
    ];
  }

  function columns(params) { return (params.cols || "").split(",").map((c) => c.trim()).filter(Boolean); }

  function listHeads(kit, params) {
    const { h } = kit;
    return [h("th", null, "drift"), ...columns(params).map((c) => h("th", { class: "num", "data-testid": "component-head" }, c))];
  }

  function listCells(kit, t, params) {
    const { h, fmt } = kit;
    const drift = t.drift_turns
      ? h("span", { class: "badge bad", "data-testid": "drift-badge", title: t.drift_turns + " of " + t.drift_checked + " turns do not extend the turn before" },
        "drift " + t.drift_turns + "/" + t.drift_checked)
      : "";
    const parts = t.reward_components || {};
    return [h("td", null, drift), ...columns(params).map((c) => h("td", { class: "num mono", "data-testid": "component-cell", "data-key": c },
      parts[c] === undefined ? "—" : fmt.value(parts[c])))];
  }

  // per-step health: how many multi-turn trajectories drifted
  function healthItems(kit, st) {
    const { h, fmt } = kit;
    const d = st && st.drift;
    if (!d || !d.multi_turn) return [];
    return [h("span", { class: "health-item" + (d.with_drift ? " bad" : ""), "data-testid": "health-step-drift",
      title: fmt.int(d.turns_drifted) + " of " + fmt.int(d.turns_compared) + " turns compared did not extend the turn before" },
      fmt.int(d.with_drift) + " of " + fmt.int(d.multi_turn) + " multi-turn drifted (" + (100 * (d.share || 0)).toFixed(1) + "%)")];
  }

  // a group: which reward component separates its best rollouts from its worst
  function groupSeparation(kit, g) {
    const { h, fmt } = kit;
    const s = g.separation;
    if (!s || !s.components || !s.components.length) return null;
    const top = s.components[0];
    return h("div", { class: "muted separation", "data-testid": "group-separation", title: s.components.map((c) => c.key + ": best " + fmt.value(c.best) + " vs worst " + fmt.value(c.worst)).join("; ") },
      "separates best from worst: ", h("strong", null, top.key), " (" + fmt.value(top.best) + " vs " + fmt.value(top.worst) + ")");
  }

  return { turnDrift, rewardPanel, listFilters, listHeads, listCells, healthItems, groupSeparation };
})();
