// tracecar viewer: a trajectory's span timeline (where the time went): one bar per span on the
// trajectory's clock, and the split generation / tools / the rest (waiting, the agent loop's own
// work). Drawn by app.js's trajectory page with its helpers (kit); loaded before app.js.
"use strict";
window.tracecarTimeline = (() => {
  // The union of [start, end) intervals, in seconds: overlapping calls (parallel tools) count once.
  function covered(intervals) {
    const sorted = intervals.filter(([s, e]) => e > s).sort((a, b) => a[0] - b[0]);
    let total = 0;
    let end = -Infinity;
    let start = null;
    for (const [s, e] of sorted) {
      if (start === null || s > end) { if (start !== null) total += end - start; start = s; end = e; }
      else end = Math.max(end, e);
    }
    return start === null ? 0 : total + end - start;
  }

  function flatten(span, depth, out) {
    out.push({ span, depth });
    for (const child of span.children || []) flatten(child, depth + 1, out);
    return out;
  }

  // generation (the LLM calls, their engine spans with them), tool (tool calls), other
  function categories(t) {
    const kind = new Map();
    for (const turn of t.turns) {
      kind.set(turn.span_id, "generation");
      for (const e of turn.after) if (e.type === "tool") kind.set(e.span_id, "tool");
    }
    for (const e of t.before_first_turn || []) if (e.type === "tool") kind.set(e.span_id, "tool");
    return kind;
  }

  function view(t, kit) {
    const { h, fmt } = kit;
    if (!t.tree) return null;
    const rows = flatten(t.tree, 0, []).filter(({ span }) => typeof span.start_time === "number" && typeof span.end_time === "number");
    if (!rows.length) return h("p", { class: "muted" }, "No timed spans.");
    const t0 = Math.min(...rows.map((r) => r.span.start_time));
    const t1 = Math.max(...rows.map((r) => r.span.end_time));
    const total = Math.max(t1 - t0, 1e-9);
    const kind = categories(t);
    const spansOf = (k) => rows.filter((r) => kind.get(r.span.span_id) === k).map((r) => [r.span.start_time, r.span.end_time]);
    const generation = covered(spansOf("generation"));
    const tools = covered(spansOf("tool"));
    const busy = covered([...spansOf("generation"), ...spansOf("tool")]);
    const rest = Math.max(0, total - busy);
    const pct = (x) => (100 * x / total).toFixed(0) + " %";
    const part = (cls, label, x, testid) => h("span", { class: "tl-part", "data-testid": testid, "data-seconds": x.toFixed(6) },
      h("span", { class: "tl-swatch tl-" + cls }), label + " " + fmt.dur(x) + " (" + pct(x) + ")");
    const summary = h("p", { class: "tl-summary", "data-testid": "timeline-summary" },
      part("generation", "generation", generation, "timeline-generation"), " · ",
      part("tool", "tools", tools, "timeline-tools"), " · ",
      part("other", "the rest (waiting, the loop's own work)", rest, "timeline-rest"),
      h("span", { class: "muted" }, " of " + fmt.dur(total)));
    const bars = rows.map(({ span, depth }) => {
      const k = kind.get(span.span_id) || "other";
      const left = 100 * (span.start_time - t0) / total;
      const width = Math.max(0.3, 100 * (span.end_time - span.start_time) / total);
      const label = h("div", { class: "tl-label", title: span.name }, span.name);
      label.style.paddingLeft = depth * 0.9 + "em"; // CSSOM: the page's CSP allows no inline style attribute
      const bar = h("div", { class: "tl-bar tl-" + k + (span.exception ? " error" : ""), "data-testid": "timeline-bar",
        title: span.name + ": " + fmt.dur(span.end_time - span.start_time) + ", from +" + fmt.dur(span.start_time - t0) });
      bar.style.left = left.toFixed(3) + "%";
      bar.style.width = Math.min(width, 100 - left).toFixed(3) + "%";
      return h("div", { class: "tl-row", "data-testid": "timeline-row", "data-kind": k, "data-span-id": span.span_id },
        label, h("div", { class: "tl-track" }, bar), h("div", { class: "tl-dur num" }, fmt.dur(span.end_time - span.start_time)));
    });
    return h("div", { class: "timeline", "data-testid": "timeline" }, summary, bars);
  }

  return { view, covered };
})();
