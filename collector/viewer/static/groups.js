// tracecar viewer: #/groups, the GRPO group view of one step (api/groups). Registered here and
// drawn by app.js's router with its helpers (kit), so this file holds only this page.
"use strict";
window.tracecarGroups = (() => {
  const SORTS = [["spread", "widest spread first"], ["zero_spread", "zero spread first"], ["mean", "best mean first"], ["sample_index", "by sample index"]];
  const PER_PAGE = 20;

  function turnChips(kit, rollout) {
    const { h } = kit;
    if (rollout.is_best) return h("span", { class: "badge good" }, "best");
    const diff = rollout.diff;
    if (!diff) return h("span", { class: "muted" }, "—");
    if (diff.identical) return h("span", { class: "badge", "data-testid": "same-as-best" }, "same as best");
    return h("span", { class: "turn-chips" }, diff.turns.map((t) => {
      const what = t.status === "missing" ? "only the best has this turn" : t.status === "extra" ? "the best has no such turn"
        : ["response", "tool_calls", "tool_results"].filter((k) => t[k] === "different").map((k) => k.replace("_", " ") + " differ" + (k === "response" ? "s" : "")).join(", ") || "same";
      const at = t.response === "different" && t.common_prefix_chars !== undefined ? " (departs at char " + t.common_prefix_chars + ")" : "";
      return h("span", { class: "chip " + t.status, title: "turn " + t.turn + ": " + what + at, "data-testid": "turn-chip" },
        (t.turn === diff.first_differing_turn ? "▸" : "") + t.turn);
    }));
  }

  function groupCard(kit, g, validate) {
    const { h, fmt, href } = kit;
    const stat = (label, value) => h("span", { class: "stat" }, h("span", { class: "muted" }, label + " "), value);
    const ids = g.rollouts.map((r) => r.trace_id);
    const rows = g.rollouts.map((r) => h("tr", { "data-testid": "rollout-row", class: r.is_best ? "best-row" : "" },
      h("td", { class: "num" }, r.rank),
      h("td", { class: "num" }, r.rollout_n === null ? "—" : r.rollout_n),
      h("td", { class: "num " + (r.is_best ? "good" : "") }, fmt.reward(r.reward)),
      h("td", { class: "num", title: r.advantage === null ? "as GRPO would compute it from these rewards" : "annotated by the trainer" },
        r.advantage !== null ? fmt.reward(r.advantage) : r.group_advantage !== null ? h("span", { class: "muted" }, fmt.reward(r.group_advantage)) : "—"),
      h("td", { class: "num" }, fmt.int(r.turns)),
      h("td", { class: "num" }, fmt.int(r.tool_calls) + (r.tool_errors ? " (" + r.tool_errors + " failed)" : "")),
      h("td", null, r.has_error ? h("span", { class: "bad" }, "error") : ""),
      h("td", null, turnChips(kit, r)),
      h("td", null, h("a", { href: "#/t/" + encodeURIComponent(r.trace_id) }, "open"), " ",
        !r.is_best && g.best ? h("a", { href: href("/compare", { ids: g.best + "," + r.trace_id }), "data-testid": "compare-with-best" }, "vs best") : null)));
    return h("section", { class: "group-card" + (g.all_equal ? " zero" : ""), "data-testid": "group", "data-sample-index": String(g.sample_index) },
      h("header", null,
        h("strong", null, "sample " + g.sample_index),
        g.all_equal ? h("span", { class: "badge bad", "data-testid": "zero-spread", title: "every rollout has the same reward: zero advantage, GRPO learns nothing from this group" }, "zero spread") : null,
        g.partial ? h("span", { class: "badge partial", "data-testid": "partial-group",
          title: g.sampled_out + " rollout" + (g.sampled_out === 1 ? " was" : "s were") + " sampled out by a budget: statistics are of the kept ones only; no std, no advantage, never flagged zero spread" },
          g.n + " of " + g.total + " kept") : null,
        g.scored === 0 ? h("span", { class: "badge" }, "no reward yet") : null,
        stat("n", g.n + (g.scored !== g.n ? " (" + g.scored + " scored)" : "")),
        stat("mean", fmt.reward(g.mean)), stat("std", fmt.reward(g.std)),
        stat("min–max", fmt.reward(g.min) + " – " + fmt.reward(g.max)), stat("spread", fmt.reward(g.spread)),
        ids.length > 1 ? h("a", { class: "button", href: href("/compare", { ids: ids.join(",") }) }, "Compare all " + ids.length) : null),
      g.prompt_question ? h("div", { class: "prompt-question", "data-testid": "group-question" }, h("span", { class: "muted" }, "asked: "), g.prompt_question) : null,
      g.prompt_preview ? h("details", { class: "prompt", open: !g.prompt_question, "data-testid": "group-prompt" },
        h("summary", { class: "muted" }, g.prompt_question ? "the whole prompt (system prompt and chat template)" : "prompt"), h("pre", { class: "text" }, g.prompt_preview)) : null,
      window.tracecarTruth ? [window.tracecarTruth.groupSeparation(kit, g), window.tracecarTruth.groupFates(kit, g)] : null,
      h("table", null,
        h("thead", null, h("tr", null, ["rank", "rollout", "reward", "advantage", "turns", "tools", "", "turns vs best", ""].map((c, i) =>
          h("th", { class: i <= 5 ? "num" : "" }, c)))),
        h("tbody", null, rows)));
  }

  async function view(params, kit) {
    const { h, api, href, go, expParam } = kit;
    if (params.step === undefined || params.step === "") {
      return h("p", null, "Pick a step on the ", h("a", { href: "#/" }, "steps overview"), " (its group links), or add ?step=N.");
    }
    const sort = params.sort || "spread";
    const offset = Number(params.offset || 0);
    const query = { experiment: params.experiment === undefined ? undefined : expParam(params.experiment), step: params.step,
      validate: params.validate, sort, sample_index: params.sample_index, limit: PER_PAGE, offset,
      // training truth (static/truth.js): groups with a matching rollout, whole
      drift: params.drift, where: params.where, fate: params.fate, refill: params.refill, trained_other: params.trained_other, lp_delta_min: params.lp_delta_min };
    const page = await api("groups", query, ["experiment"]);
    const here = (extra) => href("/groups", { ...params, ...extra });
    const controls = h("div", { class: "controls" },
      h("label", null, "step", h("input", { type: "number", value: params.step, "data-testid": "groups-step",
        onchange: (e) => go("/groups", { ...params, step: e.target.value, offset: undefined, sample_index: undefined }) })),
      h("label", null, "order", h("select", { "data-testid": "groups-sort", onchange: (e) => go("/groups", { ...params, sort: e.target.value, offset: undefined }) },
        SORTS.map(([v, label]) => h("option", { value: v, selected: v === sort }, label)))),
      params.sample_index !== undefined ? h("a", { class: "button", href: here({ sample_index: undefined }) }, "All groups of step " + page.step) : null,
      h("a", { class: "button", href: href("/list", { experiment: params.experiment, step: page.step, sort: "reward", order: "asc" }) }, "List this step's trajectories"));
    const pager = h("div", { class: "pager" });
    if (page.total_groups > PER_PAGE) {
      pager.append(
        h("a", { class: "button", href: offset > 0 ? here({ offset: Math.max(0, offset - PER_PAGE) }) : null }, "← previous"),
        h("span", { class: "muted" }, "groups " + (offset + 1) + "–" + Math.min(page.total_groups, offset + PER_PAGE) + " of " + page.total_groups),
        h("a", { class: "button", href: offset + PER_PAGE < page.total_groups ? here({ offset: offset + PER_PAGE }) : null }, "next →"));
    }
    return h("div", { "data-testid": "groups" },
      h("h1", null, "Groups of step " + page.step + " ", h("span", { class: "muted" }, kit.fmt.exp(page.experiment) + (page.validate ? " · validation" : ""))),
      controls,
      page.scope ? h("p", { class: "bad", "data-testid": "groups-scope" }, "Node " + page.scope.node + ": " + page.scope.note +
        " (" + page.scope.gateway + "/ui/#/groups)" + (page.scope.partial_groups_on_page ? "; " + page.scope.partial_groups_on_page +
        " group(s) on this page miss rollouts that ran elsewhere." : ".")) : null,
      h("p", { "data-testid": "groups-summary" }, page.total_groups + " groups, " + page.trajectories + " rollouts; ",
        h("span", { class: page.all_equal_groups ? "bad" : "" }, page.all_equal_groups + " with zero spread"),
        " (every rollout rewarded the same: GRPO learns nothing from them)" + (page.unscored_groups ? "; " + page.unscored_groups + " without rewards" : "")
          + (page.partial_groups ? "; " + page.partial_groups + " partial (rollouts sampled out: not flagged or scored as whole)" : "") + "."),
      h("p", { class: "legend" }, "Rollouts ranked by reward (ties: advantage). Turn chips compare each rollout with the group's best: ",
        h("span", { class: "chip same" }, "1"), " same, ", h("span", { class: "chip different" }, "▸2"), " first differing turn, ",
        h("span", { class: "chip extra" }, "3"), " a turn the best does not have, ", h("span", { class: "chip missing" }, "3"), " a turn only the best has. Advantage in grey: as GRPO would compute it from these rewards."),
      page.groups.length ? page.groups.map((g) => groupCard(kit, g, page.validate)) : h("p", { class: "muted" }, "No trajectories in this step."),
      pager);
  }

  return { view };
})();
