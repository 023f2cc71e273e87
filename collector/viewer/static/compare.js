// tracecar viewer: #/compare?ids=A,B,... — trajectories side by side, aligned by turn (loaded before app.js).
// What a reader must see first is whether the columns answer the same prompt; then only what
// really differs is highlighted: content (reward, turns, texts, tool calls), never timings, and
// words are marked only where two texts are mostly alike (two unrelated texts are one change).
// Everything from spans goes into the page as text (textContent), never as HTML.
"use strict";
window.tracecarCompare = (() => {
  const MARK_MIN_SIMILARITY = 0.4; // below this share of common words, a text is "rewritten": no word marks

  function tokenize(text) { return text.match(/\s+|[A-Za-z0-9_]+|[^\sA-Za-z0-9_]/g) || []; }

  // {nodes, similarity}: the text with the words not in `ref` marked (longest common subsequence of words).
  function diff(h, text, ref) {
    if (ref === null || ref === undefined || text === ref) return { nodes: [text], similarity: 1 };
    const a = tokenize(text);
    const b = tokenize(ref);
    const n = a.length;
    const m = b.length;
    if (n * m > 400000) return { nodes: [text], similarity: 0 };
    const w = m + 1;
    const dp = new Int32Array((n + 1) * w);
    for (let i = n - 1; i >= 0; i--) {
      for (let j = m - 1; j >= 0; j--) dp[i * w + j] = a[i] === b[j] ? dp[(i + 1) * w + j + 1] + 1 : Math.max(dp[(i + 1) * w + j], dp[i * w + j + 1]);
    }
    const words = (tokens) => tokens.filter((t) => /\S/.test(t)).length || 1;
    let common = 0;
    const out = [];
    let plain = "";
    let marked = "";
    const flush = () => {
      if (plain) { out.push(plain); plain = ""; }
      if (marked) { out.push(/\S/.test(marked) ? h("mark", { class: "chg" }, marked) : marked); marked = ""; }
    };
    let i = 0;
    let j = 0;
    while (i < n) {
      if (j < m && a[i] === b[j]) { if (marked) flush(); plain += a[i]; if (/\S/.test(a[i])) common++; i++; j++; }
      else if (j < m && dp[(i + 1) * w + j] < dp[i * w + j + 1]) j++;
      else { if (plain) flush(); marked += a[i]; i++; }
    }
    flush();
    const similarity = (2 * common) / (words(a) + words(b));
    return similarity >= MARK_MIN_SIMILARITY ? { nodes: out, similarity } : { nodes: [text], similarity };
  }

  function toolText(e) {
    const args = e.arguments === undefined ? "" : JSON.stringify(e.arguments);
    return e.name + " " + args + (e.error ? "  ✗ " + e.error : "  → " + JSON.stringify(e.result));
  }

  // The error the list shows (any span raised), said as what raised.
  function errorText(t) {
    if (!t.has_error) return "—";
    if (t.error) return t.error;
    if (t.tool_errors) return t.tool_errors + " failed tool call" + (t.tool_errors === 1 ? "" : "s");
    return "a span raised (see its span tree)";
  }

  function firstPrompt(t) { return t.turns.length ? t.turns[0].prompt_text : null; }

  // Each column's advantage: the trainer's when annotated, else as GRPO computes it from its whole group
  // (api/groups of its step and sample index; none for a partial group). One request per distinct group.
  async function groupAdvantages(ts, api) {
    const asked = new Map();
    const out = [];
    for (const t of ts) {
      const a = t.attributes || {};
      const trainer = t.summary && t.summary.advantage !== null && t.summary.advantage !== undefined ? t.summary.advantage : null;
      if (trainer !== null || a.step === undefined || a.step === null || a.sample_index === undefined || a.sample_index === null) {
        out.push({ value: trainer, source: trainer !== null ? "trainer" : null });
        continue;
      }
      const key = JSON.stringify([a.experiment_name ?? null, a.step, a.validate ?? false, a.sample_index]);
      if (!asked.has(key)) {
        asked.set(key, api("groups", { experiment: a.experiment_name ?? "", step: a.step, validate: a.validate ? "true" : "false",
          sample_index: String(a.sample_index), diff: "false", limit: 1 }, ["experiment"]).catch(() => null));
      }
      const page = await asked.get(key);
      const group = page && page.groups && page.groups[0];
      const mine = group ? group.rollouts.find((r) => r.trace_id === t.trace_id) : null;
      out.push(mine && mine.group_advantage !== null ? { value: mine.group_advantage, source: "group" }
        : { value: null, source: group && group.partial ? "partial" : null });
    }
    return out;
  }

  async function view(ids, kit) {
    const { h, api, fmt } = kit;
    if (ids.length < 2) return h("p", null, "Pick two or more trajectories to compare (tick them in the ", h("a", { href: "#/list" }, "list"), ").");
    const ts = await Promise.all(ids.map((id) => api("trajectories/" + encodeURIComponent(id), { tree: "false" })));
    const advantages = await groupAdvantages(ts, api);
    const letters = ts.map((_, i) => String.fromCharCode(65 + (i % 26)) + (i >= 26 ? String(Math.floor(i / 26)) : ""));
    const rewards = ts.map((t) => t.reward).filter((r) => r !== null);
    const top = rewards.length ? Math.max(...rewards) : null;
    const bottom = rewards.length ? Math.min(...rewards) : null;
    // Each column is compared with the first other column that answers the same prompt (a rollout of
    // the same sample), else with A (A with B): two answers to different questions differ everywhere.
    const prompts = ts.map(firstPrompt);
    const refs = prompts.map((p, i) => {
      const same = prompts.findIndex((q, j) => j !== i && q === p && p !== null);
      return same >= 0 ? same : i === 0 ? 1 : 0;
    });
    const refOf = (i) => refs[i];
    const grid = h("div", { class: "compare-grid", "data-testid": "compare-grid", "data-columns": String(ts.length) });
    const column = ts.length > 3 ? 17 : 20; // em; wider than the frame: the frame scrolls sideways, texts wrap in their column
    grid.style.gridTemplateColumns = "8.5em repeat(" + ts.length + ", minmax(" + column + "em, 1fr))";
    grid.style.minWidth = "calc(8.5em + " + ts.length * column + "em)";

    grid.append(h("div", { class: "rowhead colhead corner" }, ""));
    ts.forEach((t, i) => {
      const a = t.attributes || {};
      const tag = top !== bottom && t.reward === top ? h("span", { class: "badge good" }, "best") : top !== bottom && t.reward === bottom ? h("span", { class: "badge bad" }, "worst") : null;
      grid.append(h("div", { class: "colhead", "data-testid": "compare-col", "data-trace-id": t.trace_id },
        h("div", { class: "row" }, h("strong", null, letters[i]), h("a", { class: "mono", href: "#/t/" + encodeURIComponent(t.trace_id), title: t.trace_id }, fmt.id(t.trace_id)), tag),
        h("div", { class: "muted" }, "step " + (a.step ?? "—") + " · sample " + (a.sample_index ?? "—") + " · rollout " + (a.rollout_n ?? "—")),
        h("div", null, "reward ", h("strong", { "data-testid": "compare-reward" }, fmt.reward(t.reward)),
          h("span", { class: "muted small", "data-testid": "compare-ref" }, " · compared with " + letters[refOf(i)]))));
    });

    // the prompts first: are these answers to the same question?
    const distinct = new Set(prompts.map((p) => (p === null ? "\u0000none" : p))).size;
    grid.append(h("div", { class: "rowhead" }, "prompt", h("div", { class: "muted small" }, distinct === 1 ? "the same in all" : distinct + " different")));
    prompts.forEach((p, i) => {
      const same = p === prompts[refOf(i)];
      const body = p === null ? h("p", { class: "muted" }, "no decoded text") : h("pre", { class: "text" }, same ? p : diff(h, p, prompts[refOf(i)]).nodes);
      grid.append(h("div", { class: same ? "" : "differs", "data-testid": "compare-prompt" },
        distinct === 1 && i > 0 ? h("details", null, h("summary", { class: "muted" }, "same prompt as A"), body) : body));
    });

    // content rows are compared; measurements (duration) are shown, never highlighted
    const fields = [
      ["reward", (t) => fmt.reward(t.reward), true], ["turns", (t) => t.turn_count, true], ["tool calls", (t) => t.tool_calls, true],
      ["failed tool calls", (t) => t.tool_errors, true], ["response tokens", (t) => fmt.int(t.response_tokens), true],
      ["error", errorText, true, "compare-error"], ["kept because", (t) => (t.kept_because ? fmt.value(t.kept_because) : "—"), true],
      ["duration", (t) => fmt.dur(t.duration), false], ["experiment", (t) => fmt.exp((t.attributes || {}).experiment_name), true],
    ];
    grid.append(h("div", { class: "rowhead", title: "the trainer's advantage when annotated; in grey, as GRPO computes it from the group's rewards" }, "advantage"));
    advantages.forEach((adv) => grid.append(h("div", { "data-testid": "compare-advantage",
      title: adv.source === "trainer" ? "annotated by the trainer" : adv.source === "group" ? "(r − mean) / (std + 1e-6) over its GRPO group"
        : adv.source === "partial" ? "its group is partial (rollouts sampled out): not scored" : "" },
      adv.value === null ? h("span", { class: "muted" }, adv.source === "partial" ? "— (partial group)" : "—")
        : adv.source === "trainer" ? fmt.reward(adv.value) : h("span", { class: "muted" }, fmt.reward(adv.value)))));
    for (const [label, get, compared, testid] of fields) {
      const values = ts.map(get);
      grid.append(h("div", { class: "rowhead" }, label));
      values.forEach((v, i) => grid.append(h("div", {
        class: (compared && String(v) !== String(values[refOf(i)]) ? "differs" : "") + (label === "error" && v !== "—" ? " bad" : ""),
        "data-testid": testid || null }, String(v))));
    }

    const maxTurns = Math.max(...ts.map((t) => t.turns.length));
    for (let k = 0; k < maxTurns; k++) {
      grid.append(h("div", { class: "rowhead" }, "turn " + (k + 1)));
      ts.forEach((t, i) => {
        const turn = t.turns[k];
        if (!turn) { grid.append(h("div", { class: "missing", "data-testid": "compare-cell" }, "no turn " + (k + 1))); return; }
        const ref = ts[refOf(i)].turns[k];
        const calls = turn.after.filter((e) => e.type === "tool");
        const tools = calls.map(toolText);
        const refTools = ref ? ref.after.filter((e) => e.type === "tool").map(toolText) : [];
        const response = turn.response_text;
        const refResponse = ref ? ref.response_text : null;
        const differs = !ref || response !== refResponse || tools.join("\n") !== refTools.join("\n");
        const shown = response === null ? null : ref ? diff(h, response, refResponse) : { nodes: [response], similarity: 1 };
        grid.append(h("div", { class: differs ? "differs" : "", "data-testid": "compare-cell", "data-differs": differs ? "1" : "0" },
          h("div", { class: "muted" }, fmt.dur(turn.duration) + " · " + fmt.int(turn.response_tokens) + " tokens" + (turn.error ? " · error" : ""),
            shown && shown.similarity < MARK_MIN_SIMILARITY ? h("span", { class: "badge", title: "too unlike the reference to mark word by word" }, "rewritten") : null),
          k === 0 || !turn.new_context ? null : h("details", null, h("summary", { class: "muted" }, "context added"), h("pre", { class: "text" }, turn.new_context)),
          shown === null ? h("p", { class: "muted" }, "no decoded text") : h("pre", { class: "text response" }, shown.nodes),
          tools.map((line, j) => h("div", { class: "tool" + (calls[j].error ? " error" : ""), "data-testid": "compare-tool" },
            h("pre", { class: "tool-line" }, ref ? diff(h, line, refTools[j] === undefined ? "" : refTools[j]).nodes : line)))));
      });
    }
    const summary = distinct === 1 ? "All " + ts.length + " answer the same prompt." :
      distinct + " different prompts: these trajectories answer different questions, so their texts differ by design.";
    return h("div", { "data-testid": "compare" },
      h("h1", null, "Compare " + ts.length + " trajectories"),
      h("p", { "data-testid": "compare-summary" }, summary),
      h("p", { class: "legend" }, h("span", { class: "swatch" }, "cell"), " differs in content from the column it is compared with (the first other one with the same prompt, else A; B for A); ",
        h("mark", { class: "chg" }, "marked"), " words are not in the reference (only where the texts are mostly alike). Turns are aligned by number; durations are not compared."),
      h("div", { class: "compare-scroll", "data-testid": "compare-scroll" }, grid));
  }

  return { view };
})();
