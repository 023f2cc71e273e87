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
      h("label", null, "fate", h("select", { name: "fate", "data-testid": "filter-fate" },
        [["", "any"], ["trained", "trained"], ["filtered", "filtered by the trainer"], ["evicted", "evicted"], ["not_reached", "never reached the trainer"]]
          .map(([v, l]) => h("option", { value: v, selected: (params.fate || "") === v }, l)))),
      h("label", null, "refill", h("select", { name: "refill", "data-testid": "filter-refill" },
        [["", "any"], ["true", "refills of evicted groups"], ["false", "not refills"]].map(([v, l]) => h("option", { value: v, selected: (params.refill || "") === v }, l)))),
      h("label", null, "trained on", h("select", { name: "trained_other", "data-testid": "filter-trained-other" },
        [["", "any"], ["true", "other tokens than generated"], ["false", "exactly the generated tokens"]].map(([v, l]) => h("option", { value: v, selected: (params.trained_other || "") === v }, l)))),
      h("label", null, "|Δ logprob| ≥", h("input", { type: "number", name: "lp_delta_min", step: "any", min: "0", value: params.lp_delta_min || "", "data-testid": "filter-lp-delta" })),
      keys.length ? h("label", null, "columns", h("input", { type: "text", name: "cols", value: params.cols || "", "data-testid": "filter-cols",
        placeholder: keys.slice(0, 3).join(","), title: "reward components to show as columns; known: " + keys.join(", ") })) : null,
    ];
  }

  function columns(params) { return (params.cols || "").split(",").map((c) => c.trim()).filter(Boolean); }

  function listHeads(kit, params) {
    const { h } = kit;
    return [h("th", null, "drift"), h("th", null, "fate"), ...columns(params).map((c) => h("th", { class: "num", "data-testid": "component-head" }, c))];
  }

  function listCells(kit, t, params) {
    const { h, fmt } = kit;
    const drift = t.drift_turns
      ? h("span", { class: "badge bad", "data-testid": "drift-badge", title: t.drift_turns + " of " + t.drift_checked + " turns do not extend the turn before" },
        "drift " + t.drift_turns + "/" + t.drift_checked)
      : "";
    const parts = t.reward_components || {};
    const fate = [t.fate === "evicted" || t.refill_of ? [fateBadge(kit, t), t.refill_of ? h("span", { class: "badge rule", "data-testid": "refill" }, "refill") : null] : null,
      t.tt_mismatch ? h("span", { class: "badge bad", "data-testid": "other-tokens-badge", title: "the trainer trained on other tokens than the rollout generated" }, "other tokens") : null,
      t.lp_max !== null && t.lp_max !== undefined && t.lp_max >= 0.1 ? h("span", { class: "badge bad", "data-testid": "lp-badge", title: "max |Δ logprob| rollout vs trainer" }, "Δlp " + t.lp_max.toFixed(2)) : null];
    return [h("td", null, drift), h("td", null, fate), ...columns(params).map((c) => h("td", { class: "num mono", "data-testid": "component-cell", "data-key": c },
      parts[c] === undefined ? "—" : fmt.value(parts[c])))];
  }

  // per-step health: how many multi-turn trajectories drifted
  function healthItems(kit, st) {
    const { h, fmt } = kit;
    const d = st && st.drift;
    const f = st && st.fates;
    const fates = f && (f.evicted || f.refills || f.trained || f.filtered) ? [h("span", { class: "health-item" + (f.evicted ? " warn" : ""), "data-testid": "health-step-fates",
      title: "evicted by: " + Object.entries(f.evicted_by || {}).map(([k, v]) => k + " " + v).join(", ") }, "fate: " + fmt.int(f.trained) + " trained, " + fmt.int(f.filtered) + " filtered, " +
      fmt.int(f.evicted) + " evicted, " + fmt.int(f.not_reached) + " never reached the trainer, " + fmt.int(f.refills) + " refills" +
      (f.staleness_max !== null && f.staleness_max !== undefined ? "; staleness max " + f.staleness_max : ""))] : [];
    const tv = st && st.trainer_vs_rollout;
    if (tv && tv.compared) {
      fates.push(h("span", { class: "health-item" + (tv.with_token_mismatch ? " bad" : ""), "data-testid": "health-step-trainer-tokens" },
        fmt.int(tv.with_token_mismatch) + " of " + fmt.int(tv.compared) + " trained on other tokens" +
        (tv.logprob_diff_max !== null ? "; |Δ logprob| mean " + tv.logprob_diff_mean.toPrecision(3) + ", p99 ≤ " + tv.logprob_diff_p99.toPrecision(2) + ", max " + tv.logprob_diff_max.toPrecision(3) : "")));
    }
    if (!d || !d.multi_turn) return fates;
    return [...fates, h("span", { class: "health-item" + (d.with_drift ? " bad" : ""), "data-testid": "health-step-drift",
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

  // what became of it: trained / filtered / evicted (why) / never reached the trainer; policy versions; refill
  const FATE = { trained: "trained", filtered: "filtered by the trainer", evicted: "evicted from the replay buffer", not_reached: "never reached the trainer" };

  function versions(s) {
    if (s.min_global_steps === null || s.min_global_steps === undefined) return null;
    const span = s.max_global_steps !== null && s.max_global_steps !== undefined && s.max_global_steps !== s.min_global_steps;
    return "policy v" + s.min_global_steps + (span ? "–v" + s.max_global_steps + " (" + (s.max_global_steps - s.min_global_steps + 1) + " versions)" : "");
  }

  function fateBadge(kit, s) {
    const { h } = kit;
    if (!s || !s.fate) return null;
    const cls = s.fate === "trained" ? "badge good" : s.fate === "not_reached" ? "badge" : "badge bad";
    return h("span", { class: cls, "data-testid": "fate", "data-fate": s.fate },
      FATE[s.fate] + (s.fate_reason && s.fate !== "trained" ? ": " + s.fate_reason : ""));
  }

  function fateLine(kit, t) {
    const { h } = kit;
    const s = t.summary;
    // "never reached the trainer" is the absence of any note: said only where a trainer hook reported something else
    if (!s || !s.fate || (s.fate === "not_reached" && !s.refill_of && (s.min_global_steps === null || s.min_global_steps === undefined))) return null;
    const bits = [versions(s), s.staleness !== null && s.staleness !== undefined ? "staleness " + s.staleness + " when trained" : null,
      s.evicted_at_step !== null && s.evicted_at_step !== undefined ? "evicted at step " + s.evicted_at_step : null].filter(Boolean);
    return h("div", { class: "fate-line", "data-testid": "fate-line" }, h("strong", null, "Fate: "), fateBadge(kit, s),
      bits.length ? h("span", { class: "muted", "data-testid": "fate-versions" }, " " + bits.join(" · ")) : null,
      s.refill_of ? h("span", { class: "badge rule", "data-testid": "refill", title: "this group replaces a group the replay buffer evicted" }, "refill of evicted group " + s.refill_of) : null);
  }

  function groupFates(kit, g) {
    const { h } = kit;
    const counts = {};
    for (const r of g.rollouts || []) if (r.fate) counts[r.fate] = (counts[r.fate] || 0) + 1;
    const refill = (g.rollouts || []).find((r) => r.refill_of);
    const reasons = [...new Set((g.rollouts || []).filter((r) => r.fate === "evicted" && r.fate_reason).map((r) => r.fate_reason))];
    const spans = (g.rollouts || []).filter((r) => r.min_global_steps !== null && r.min_global_steps !== undefined);
    const other = (g.rollouts || []).filter((r) => r.tt_mismatch);
    if (!other.length && !Object.keys(counts).some((f) => f !== "not_reached")) return null;  // no trainer note in this group

    return h("div", { class: "muted", "data-testid": "group-fates" }, "fate: " + Object.entries(counts).map(([f, n]) => n + " " + FATE[f]).join(", ") +
      (reasons.length ? " (" + reasons.join(", ") + ")" : "") +
      (spans.length ? " · policy v" + Math.min(...spans.map((r) => r.min_global_steps)) + "–v" + Math.max(...spans.map((r) => r.max_global_steps ?? r.min_global_steps)) : ""),
      refill ? h("span", { class: "badge rule", "data-testid": "group-refill" }, " refill of evicted group " + refill.refill_of) : null,
      other.length ? h("span", { class: "badge bad", "data-testid": "group-other-tokens", title: "rollouts the trainer trained on other tokens than generated" },
        other.length + " trained on other tokens") : null);
  }

  // what the trainer trained on vs what the rollout generated (ids, mask, |Δ logprob|)
  function trainerPanel(kit, t) {
    const { h, fmt } = kit;
    const tr = t.truth && t.truth.trainer;
    if (!tr) return null;
    const items = [];
    if (tr.tt_ids_equal === false) {
      items.push(h("li", { class: "bad", "data-testid": "trainer-ids" }, "the trained ids differ from the rollout's from token " + fmt.int(tr.tt_first_diff) +
        " (" + fmt.int(tr.tt_ids_differing) + " ids): rollout ", h("code", null, tr.was_text ?? idList(tr.was)), " · trainer ", h("code", null, tr.now_text ?? idList(tr.now))));
    }
    if (tr.tt_mask_extra) items.push(h("li", { class: "bad", "data-testid": "trainer-mask-extra" }, fmt.int(tr.tt_mask_extra) + " trained tokens the policy did not generate there (tool output, a mask off by one, a re-rendered turn)"));
    if (tr.tt_mask_missing) items.push(h("li", { class: "bad", "data-testid": "trainer-mask-missing" }, fmt.int(tr.tt_mask_missing) + " generated tokens outside the loss mask"));
    if (tr.tt_absent) items.push(h("li", { class: "bad", "data-testid": "trainer-absent" }, fmt.int(tr.tt_absent) + " generated tokens absent from the trained sequence"));
    if (!items.length) items.push(h("li", { class: "good", "data-testid": "trainer-exact" }, "trained on exactly the generated tokens"));
    if (tr.lp_compared) {
      items.push(h("li", { class: tr.lp_max >= 0.5 ? "bad" : "", "data-testid": "trainer-logprob" },
        "|Δ logprob| rollout vs trainer over " + fmt.int(tr.lp_compared) + " tokens: mean " + tr.lp_mean.toPrecision(3) + ", p99 " + tr.lp_p99.toPrecision(3) + ", max " + tr.lp_max.toPrecision(3) + " (shaded in the token view)"));
    }
    return h("section", { class: "card trainer-compare", "data-testid": "trainer-compare" }, h("h3", null, "What the trainer trained on"), h("ul", null, items));
  }

  // the token view: the trainer's logprob beside the rollout's, shaded by |Δ|
  function tokenClass(tok) {
    if (tok.logprob_diff === undefined) return "";
    const d = Math.abs(tok.logprob_diff);
    return " dlp" + (d < 0.01 ? 0 : d < 0.1 ? 1 : d < 0.5 ? 2 : 3);
  }

  function tokenTitle(tok) {
    if (tok.trainer_logprob === undefined) return "";
    return " · trainer logprob " + tok.trainer_logprob.toFixed(4) + (tok.logprob_diff !== undefined ? " (Δ " + (tok.logprob_diff >= 0 ? "+" : "") + tok.logprob_diff.toFixed(4) + ")" : "");
  }

  function tokenLegend(kit, view) {
    const { h } = kit;
    if (!view || !view.trainer || !view.trainer.lp_compared) return null;
    const tr = view.trainer;
    return h("div", { class: "legend", "data-testid": "token-trainer-legend" }, "trainer vs rollout |Δ logprob| (underline): ",
      [0, 1, 2, 3].map((b) => h("span", { class: "tok dlp" + b }, ["<.01", "<.1", "<.5", "≥.5"][b])),
      " — max " + tr.lp_max.toPrecision(3) + " over " + tr.lp_compared + " tokens; hover a token for both log-probabilities");
  }

  return { turnDrift, rewardPanel, listFilters, listHeads, listCells, healthItems, groupSeparation, fateLine, fateBadge, groupFates,
    trainerPanel, tokenClass, tokenTitle, tokenLegend };
})();
