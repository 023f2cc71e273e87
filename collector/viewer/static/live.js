// tracecar viewer: trajectories still running (api/live), polled every few seconds while on
// screen. #/live is the page; a step's trajectory list (#/list?step=N) shows the same panel on
// top. Registered here and drawn by app.js's router with its helpers (kit).
"use strict";
window.tracecarLive = (() => {
  const POLL_MS = 2000;
  const STUCK_S = 60; // a trajectory with nothing new for this long is flagged

  function age(s) {
    if (s === null || s === undefined) return "—";
    if (s < 120) return s.toFixed(s < 10 ? 1 : 0) + " s";
    if (s < 7200) return (s / 60).toFixed(0) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  function spanList(kit, t, now) {
    const { h, fmt } = kit;
    return h("tr", { class: "live-spans", "data-testid": "live-spans" }, h("td", { colspan: "11" },
      h("ol", null, t.span_list.map((s) => h("li", { class: s.has_error ? "bad" : "" },
        h("code", null, s.name), " ", h("span", { class: "muted" },
          fmt.dur(s.end_time !== null && s.start_time !== null ? s.end_time - s.start_time : null) + ", ended " + age(now - s.end_time) + " ago"),
        s.has_error ? " (error)" : ""))),
      t.open_calls.length ? h("p", { "data-testid": "live-open-calls" }, "Still running: ", t.open_calls.map((c, i) =>
        h("span", null, i ? " › " : "", h("code", { class: c.span_id === (t.stuck_call && t.stuck_call.span_id) ? "bad" : "" }, c.name), h("span", { class: "muted" }, " " + age(c.running_s))))) : null,
      h("p", { class: "muted" }, t.spans > t.span_list.length ? "… " + (t.spans - t.span_list.length) + " more spans. " : "",
        t.open_calls.length ? "A call's span arrives when it ends; the workers report the calls still running."
          : t.last_span ? ["The call running now is the one after ", h("code", null, t.last_span.name), ": its span arrives when it ends."] : "")));
  }

  function table(kit, page, open, redraw) {
    const { h, fmt } = kit;
    if (!page.trajectories.length) return h("p", { class: "muted", "data-testid": "live-empty" }, "Nothing running.");
    const rows = [];
    for (const t of page.trajectories) {
      const stuck = t.idle_s >= STUCK_S;
      const tr = h("tr", { "data-testid": "live-row", "data-trace-id": t.trace_id, class: "live-row" + (stuck ? " stuck" : ""),
        title: "click for its spans so far; the id opens it",
        onclick: (e) => { if (e.target.closest("a")) return; if (open.has(t.trace_id)) open.delete(t.trace_id); else open.add(t.trace_id); redraw(); } },
        h("td", null, h("a", { href: "#/t/" + encodeURIComponent(t.trace_id), title: "open " + t.trace_id + " (its spans so far)",
          "data-testid": "live-link", class: "mono" }, fmt.id(t.trace_id))),
        h("td", { "data-testid": "live-experiment" }, fmt.exp(t.experiment)),
        h("td", { class: "num" }, t.step ?? "—"), h("td", { class: "num" }, t.sample_index ?? "—"), h("td", { class: "num" }, t.rollout_n ?? "—"),
        h("td", null, t.worker || "—"),
        h("td", { class: "num", "data-testid": "live-span-count" }, fmt.int(t.spans), t.errors ? h("span", { class: "bad" }, " (" + t.errors + " failed)") : ""),
        h("td", { class: "num" }, age(t.age_s)),
        h("td", { class: "num" + (stuck ? " bad" : ""), "data-testid": "live-idle" }, age(t.idle_s), stuck ? " ⚠" : ""),
        h("td", { "data-testid": "live-waiting" }, t.stuck_call ? [h("code", null, t.stuck_call.name), h("span", { class: "muted" }, " running " + age(t.stuck_call.running_s))] : h("span", { class: "muted" }, "—")),
        h("td", null, t.last_span ? [h("code", { "data-testid": "live-last-span" }, t.last_span.name), t.last_span.has_error ? h("span", { class: "bad" }, " error") : ""] : h("span", { class: "muted" }, "none yet")));
      rows.push(tr);
      if (open.has(t.trace_id)) rows.push(spanList(kit, t, page.now));
    }
    return h("table", { class: "live-table" },
      h("thead", null, h("tr", null, ["trajectory", "experiment", "step", "sample", "rollout", "worker", "spans so far", "running for", "idle", "waiting on", "last span"]
        .map((c, i) => h("th", { class: i >= 2 && i <= 4 || i >= 6 && i <= 8 ? "num" : "" }, c)))),
      h("tbody", null, rows));
  }

  // Per step of the running trajectories: n of m done (root stored or sampled out), as a bar.
  function progress(kit, page) {
    const { h, fmt, href } = kit;
    if (!page.steps || !page.steps.length) return null;
    return h("div", { class: "live-progress" }, page.steps.map((s) =>
      h("div", { "data-testid": "live-step-progress", "data-step": String(s.step) },
        h("a", { href: href("/list", { experiment: s.experiment === null ? "" : s.experiment, step: s.step }) }, "step " + s.step),
        h("span", { class: "muted" }, " " + fmt.exp(s.experiment) + " "),
        h("progress", { max: String(s.total), value: String(s.done) }),
        h("span", { "data-testid": "live-step-done" }, " " + s.done + " of " + s.total + " trajectories done"),
        h("span", { class: "muted" }, ", " + s.running + " running"))));
  }

  // The panel: fetches at once, then every POLL_MS while it is in the page (and the tab visible).
  function panel(params, kit, opts) {
    const { h, api, expParam } = kit;
    const query = { experiment: params.experiment === undefined ? undefined : expParam(params.experiment), step: params.step,
      validate: params.validate, limit: 200 };
    const heading = h("h3", null, "Running now");
    const note = h("span", { class: "muted", "data-testid": "live-updated" }, "loading…");
    const body = h("div", null);
    const section = h("section", { class: "card live-panel", "data-testid": "live-panel" },
      h("header", { class: "live-head" }, heading, " ", note), body);
    const open = new Set();
    let page = null;
    let first = true;
    let seen = new Set();
    const redraw = () => { if (page) body.replaceChildren(...[progress(kit, page), table(kit, page, open, redraw)].filter(Boolean)); };
    async function tick() {
      if (!first && !section.isConnected) return; // the page moved on: stop polling
      first = false;
      if (!document.hidden) {
        try {
          page = await api("live", query, query.experiment === "" ? ["experiment"] : []);
          heading.textContent = "Running now: " + page.total + " trajector" + (page.total === 1 ? "y" : "ies") +
            (params.step !== undefined ? " of step " + params.step : "");
          note.textContent = "updated " + new Date(page.now * 1000).toISOString().slice(11, 19) + "Z, every " + POLL_MS / 1000 + " s" +
            (page.truncated ? " · showing the " + page.trajectories.length + " longest idle" : "") +
            (page.scan_capped ? " · only the newest spans were scanned" : "");
          if (opts && opts.hideEmpty) section.hidden = page.total === 0;
          redraw();
          const ids = new Set(page.trajectories.map((t) => t.trace_id));
          const finished = [...seen].some((id) => !ids.has(id));
          seen = ids;
          if (finished && opts && opts.onFinished) opts.onFinished(); // e.g. the list re-reads, showing it whole
        } catch (err) {
          note.textContent = "could not refresh: " + (err.message || err);
        }
      }
      setTimeout(tick, POLL_MS);
    }
    setTimeout(tick, 0);
    return section;
  }

  async function view(params, kit) {
    const { h } = kit;
    return h("div", null,
      h("h2", null, "Live rollouts"),
      h("p", { class: "muted" }, "Trajectories whose root span has not arrived yet, the longest idle first. A call's span is sent when it ends, ",
        "and the workers report the calls still running, so a stuck tool call is named (\"waiting on\"). Nothing here is forwarded until the trajectory is whole."),
      panel(params, kit));
  }

  return { view, panel };
})();
