// tracecar viewer: vanilla JS, one file, no build step. Talks only to this collector (api/...).
// Views (hash routes): #/ steps overview, #/list trajectories, #/t/ID one trajectory,
// #/compare?ids=A,B side by side (static/compare.js), #/groups?step=N GRPO groups (static/groups.js), #/live running trajectories (static/live.js). Every piece of span data is put in the page as text
// (textContent), never parsed as HTML.
"use strict";
(() => {
  const app = document.getElementById("app");
  const statusEl = document.getElementById("index-status");
  const NONE = "\u2205"; // how the page names "no experiment_name" in its own addresses
  const selected = new Set(); // trajectories ticked in the list, for "compare selected"
  let charts = [];
  let renderSeq = 0;
  let refreshTimer = null;

  // ---- small helpers -------------------------------------------------------------------
  function h(tag, props, ...children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") el.className = value;
      else if (key === "text") el.textContent = value;
      else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else el.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  const fmt = {
    reward: (v) => (v === null || v === undefined ? "—" : Number(v).toFixed(3)),
    dur: (s) => (s === null || s === undefined ? "—" : s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(2) + " s"),
    int: (v) => (v === null || v === undefined ? "—" : Number(v).toLocaleString("en-US")),
    time: (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + "Z" : "—"),
    id: (id) => (id && id.length > 12 ? "…" + id.slice(-8) : id),
    exp: (e) => (e === null || e === undefined ? "(no experiment)" : e),
    value: (v) => (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(4)) : typeof v === "string" ? v : JSON.stringify(v)),
  };

  function clean(params) {
    const out = {};
    for (const [key, value] of Object.entries(params || {})) {
      if (value !== undefined && value !== null && value !== "") out[key] = String(value);
    }
    return out;
  }

  class ApiError extends Error {
    constructor(message, status) { super(message); this.status = status; }
  }

  async function api(path, params, keepEmpty) {
    const query = new URLSearchParams(clean(params));
    for (const key of keepEmpty || []) if (params && params[key] === "") query.set(key, "");
    const qs = query.toString();
    const response = await fetch("api/" + path + (qs ? "?" + qs : ""), { headers: { Accept: "application/json" }, credentials: "same-origin" });
    if (!response.ok) {
      let reason = response.status + " " + response.statusText;
      try {
        const body = await response.json();
        if (body && body.error) reason = body.error.reason || JSON.stringify(body.error);
      } catch (_) { /* not JSON */ }
      if (response.status === 401) reason += " — open this page as /ui/?token=YOUR_TOKEN";
      throw new ApiError(reason, response.status);
    }
    const body = await response.json();
    if (body && body.index) noteIndex(body.index);
    return body;
  }

  // The experiment filter as the API wants it: NONE means experiment= (no experiment name).
  function expParam(exp) { return exp === NONE ? "" : exp; }
  function expKey(exp) { return exp === null || exp === undefined ? NONE : exp; }

  function href(path, params) {
    const qs = new URLSearchParams(clean(params)).toString();
    return "#" + path + (qs ? "?" + qs : "");
  }
  function go(path, params) { location.hash = href(path, params); }

  function noteIndex(index) {
    if (!index || index.caught_up) { statusEl.textContent = ""; return; }
    statusEl.textContent = "indexing the store… " + fmt.int(index.behind_spans) + " spans to go";
    // the lists grow while the index catches up; a trajectory or a comparison is already complete
    const { path } = parseHash();
    if (refreshTimer === null && (path === "/" || path === "/list")) refreshTimer = setTimeout(() => { refreshTimer = null; render(); }, 1500);
  }

  function errorBox(err) {
    return h("div", { class: "error-box", "data-testid": "error" }, String(err.message || err));
  }

  function pretty(value, full) {
    return JSON.stringify(value, (key, v) => {
      if (!full && Array.isArray(v) && v.length > 24 && v.every((x) => typeof x === "number")) {
        return "[" + v.slice(0, 12).join(", ") + ", … " + v.length + " numbers]";
      }
      return v;
    }, 2);
  }

  function jsonBlock(value) {
    if (value === null || value === undefined) return h("span", { class: "muted" }, "—");
    let full = false;
    const pre = h("pre", { class: "json" }, pretty(value, full));
    const text = pretty(value, false);
    if (text === pretty(value, true)) return foldable(pre, text);
    const toggle = h("button", { type: "button", onclick: () => { full = !full; pre.textContent = pretty(value, full); toggle.textContent = full ? "abbreviate" : "show all numbers"; } }, "show all numbers");
    return h("div", null, foldable(pre, text), toggle);
  }

  function rewardBadge(reward, cls) {
    return h("span", { class: "badge " + (cls || "") }, "reward " + fmt.reward(reward));
  }

  const kit = { h, api, fmt, href, go, expKey, expParam }; // what groups.js draws with
  const truthUi = window.tracecarTruth; // static/truth.js: drift, reward parts (issue 29)

  // ---- router ----------------------------------------------------------------------------
  function parseHash() {
    const raw = location.hash.replace(/^#/, "") || "/";
    const at = raw.indexOf("?");
    const path = at < 0 ? raw : raw.slice(0, at);
    const params = Object.fromEntries(new URLSearchParams(at < 0 ? "" : raw.slice(at + 1)));
    return { path, params };
  }

  async function render() {
    const seq = ++renderSeq;
    const { path, params } = parseHash();
    for (const link of document.querySelectorAll("[data-nav]")) {
      const nav = link.getAttribute("data-nav");
      link.classList.toggle("active", (nav === "overview" && path === "/") || (nav === "list" && path === "/list") || (nav === "live" && path === "/live") || (nav === "runs" && path === "/runs"));
    }
    const mount = [];
    try {
      let view;
      if (path === "/") view = await overviewView(params, mount);
      else if (path === "/list") view = await listView(params);
      else if (path.startsWith("/t/")) view = await trajectoryView(decodeURIComponent(path.slice(3)));
      else if (path === "/groups" && window.tracecarGroups) view = await window.tracecarGroups.view(params, kit);
      else if (path === "/live" && window.tracecarLive) view = await window.tracecarLive.view(params, kit);
      else if (path === "/runs" && window.tracecarRuns) view = await window.tracecarRuns.view(params, kit);
      else if (path === "/compare" && window.tracecarCompare) view = await window.tracecarCompare.view((params.ids || "").split(",").filter(Boolean), kit);
      else view = h("p", null, "No such page. ", h("a", { href: "#/" }, "Back to the steps"));
      if (path === "/list" && params.step !== undefined && window.tracecarLive) view.prepend(window.tracecarLive.panel(params, kit, { hideEmpty: true, onFinished: render }));
      if (seq !== renderSeq) return; // a newer navigation won
      for (const chart of charts) chart.destroy();
      charts = [];
      app.replaceChildren(view);
      for (const fn of mount) fn();
    } catch (err) {
      if (seq === renderSeq) app.replaceChildren(errorBox(err));
      if (!(err instanceof ApiError)) console.error(err);
    }
  }

  // ---- charts ------------------------------------------------------------------------------
  const PALETTE = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

  function chartsAvailable() { return typeof window.Chart === "function"; }

  function makeChart(canvas, config) {
    config.options = Object.assign({ animation: false, responsive: true, maintainAspectRatio: false }, config.options || {});
    const chart = new window.Chart(canvas, config);
    charts.push(chart);
    return chart;
  }

  function rewardChart(canvas, ov, onPick) {
    const steps = ov.steps;
    const pick = (key) => steps.map((s) => (s[key] === undefined ? null : s[key]));
    const dense = steps.length > 60; // many steps: lines, no dots
    return makeChart(canvas, {
      type: "line",
      data: {
        labels: steps.map((s) => s.step),
        datasets: [
          { label: "p10–p90", data: pick("p90"), borderWidth: 0, pointRadius: 0, backgroundColor: "rgba(37,99,235,0.15)", fill: "+1" },
          { label: "p10", data: pick("p10"), borderWidth: 0, pointRadius: 0, fill: false },
          { label: "mean", data: pick("mean"), borderColor: "#2563eb", backgroundColor: "#2563eb", pointRadius: dense ? 0 : 3, borderWidth: dense ? 1.5 : 3 },
          { label: "best", data: pick("max"), showLine: dense, borderWidth: 1, borderColor: "#16a34a", backgroundColor: "#16a34a", pointStyle: "triangle", pointRadius: dense ? 0 : 5 },
          { label: "worst", data: pick("min"), showLine: dense, borderWidth: 1, borderColor: "#dc2626", backgroundColor: "#dc2626", pointStyle: "triangle", rotation: 180, pointRadius: dense ? 0 : 5 },
        ],
      },
      options: {
        interaction: { mode: "index", intersect: false },
        plugins: { legend: { labels: { filter: (item) => item.text !== "p10", boxWidth: 12 } } },
        scales: { x: { title: { display: true, text: "step" } }, y: { title: { display: true, text: "reward" } } },
        onClick: (event, elements) => { if (elements.length) onPick(steps[elements[0].index].step); },
      },
    });
  }

  function keptChart(canvas, ov) {
    return makeChart(canvas, {
      type: "bar",
      data: {
        labels: ov.steps.map((s) => s.step),
        datasets: ov.rules.map((rule, i) => ({ label: rule, data: ov.steps.map((s) => s.kept[rule] || 0), backgroundColor: PALETTE[i % PALETTE.length] })),
      },
      options: {
        plugins: { legend: { labels: { boxWidth: 12 } } },
        scales: { x: { stacked: true, title: { display: true, text: "step" } }, y: { stacked: true, beginAtZero: true, title: { display: true, text: "trajectories kept" } } },
      },
    });
  }

  function histChart(canvas, ov, step) {
    const edges = ov.bin_edges;
    const labels = edges.slice(0, -1).map((e, i) => e.toFixed(2) + "…" + edges[i + 1].toFixed(2));
    return makeChart(canvas, {
      type: "bar",
      data: { labels, datasets: [{ label: "step " + step.step, data: step.hist, backgroundColor: "#60a5fa" }] },
      options: { plugins: { legend: { display: false } }, scales: { x: { title: { display: true, text: "reward" } }, y: { beginAtZero: true, ticks: { precision: 0 }, title: { display: true, text: "trajectories" } } } },
    });
  }

  // ---- #/ : steps overview -------------------------------------------------------------------
  // ---- tracing health (issue 15 §5): the numbers traces are trusted by, and the chosen step's ----------
  // [key, label, a failure?]: sampled out is a budget working as configured, never red
  const LOSSES = [["client_dropped", "dropped by the workers", true], ["sampled_out", "sampled out", false], ["rejected", "rejected", true],
    ["decode_failures", "decode failures", true], ["forward_failures", "forward failures", true]];

  function healthCard(experiment, split) {
    const totals = h("div", { class: "health-totals", "data-testid": "health-totals" }, h("span", { class: "muted" }, "reading /v1/health…"));
    const stepLine = h("div", { class: "health-step", "data-testid": "health-step" });
    const card = h("div", { class: "card health", "data-testid": "health" }, h("h3", null, "Tracing health"), totals, stepLine);
    const validate = split === "all" ? undefined : String(split === "validation");
    let seq = 0;
    const count = (n, label, detail, testid, failure = true) => h("span", { class: "health-item" + (n && failure ? " bad" : ""),
      title: (detail || "") + (failure ? "" : (detail ? "; " : "") + "by the sampling budgets, as configured"), "data-testid": testid }, fmt.int(n) + " " + label);
    const detail = (by) => Object.entries(by || {}).map(([k, v]) => (k || "-") + " " + v).join(", ");
    async function show(step) {
      const mine = ++seq;
      let got;
      try {
        got = await api("health", { step, experiment: expParam(experiment), validate }, ["experiment"]);
      } catch (err) {
        totals.replaceChildren(errorBox(err));
        return;
      }
      if (mine !== seq) return;
      totals.replaceChildren(...[...LOSSES.map(([key, label, failure]) => count(got[key + "_total"], label, detail(got[key]), "health-" + key, failure)),
        h("span", { class: "health-item" }, "spool depth " + fmt.int(got.spool_depth)),
        h("span", { class: "health-item" }, fmt.int(got.held_spans) + " held"),
        got.backend_unreachable ? h("span", { class: "health-item bad" }, "backend unreachable") : null,
        h("span", { class: "muted" }, "collector totals since start")].filter(Boolean));
      const st = got.step;
      if (!st) { stepLine.replaceChildren(); return; }
      const sampling = st.sampling || {};
      stepLine.replaceChildren(h("strong", null, "step " + st.step + ": "),
        h("span", { class: "health-item" }, fmt.int(st.trajectories) + " stored"),
        count(st.with_error, "with an error", null, "health-step-errors"),
        h("span", { class: "health-item" + (st.running ? " warn" : ""), "data-testid": "health-step-running" }, fmt.int(st.running) + " running"),
        h("span", { class: "health-item" }, fmt.int(st.held_spans) + " spans held"),
        h("span", { class: "health-item", title: detail(sampling.dropped_by_reason), "data-testid": "health-step-sampling" },
          "sampling " + (sampling.mode || "—") + ": kept " + fmt.int(sampling.kept) + ", dropped " + fmt.int(sampling.dropped)),
        h("span", { class: "health-item", title: detail(st.trainer.filtered_by), "data-testid": "health-step-trainer" },
          "trainer: " + fmt.int(st.trainer.trained) + " trained, " + fmt.int(st.trainer.dropped) + " dropped"),
        ...(truthUi ? truthUi.healthItems(kit, st) : []));
    }
    return { card, show };
  }

  async function overviewView(params, mount) {
    const facets = await api("facets");
    if (!facets.experiments.length) {
      return h("div", { "data-testid": "empty" }, h("h1", null, "No trajectories yet"),
        h("p", null, "Point rollout workers at this collector (TRACECAR_URL), or feed it the demo: ",
          h("code", null, "tracecar demo --url " + location.origin)));
    }
    const exp = params.experiment !== undefined ? params.experiment : expKey(facets.experiments[0].experiment);
    const entry = facets.experiments.find((e) => expKey(e.experiment) === exp) || facets.experiments[0];
    const split = params.split || (entry.train ? "train" : "all");
    const ov = await api("overview", { experiment: expParam(expKey(entry.experiment)), split }, ["experiment"]);
    const steps = ov.steps;
    const expArg = expKey(entry.experiment);

    const controls = h("div", { class: "controls" },
      h("label", null, "experiment", h("select", { "data-testid": "overview-experiment", onchange: (e) => go("/", { experiment: e.target.value, split }) },
        facets.experiments.map((e) => h("option", { value: expKey(e.experiment), selected: e === entry }, fmt.exp(e.experiment) + " (" + fmt.int(e.trajectories) + ")")))),
      h("label", null, "rollouts", h("select", { onchange: (e) => go("/", { experiment: expArg, split: e.target.value }) },
        [["train", "training (" + fmt.int(entry.train) + ")"], ["validation", "validation (" + fmt.int(entry.validation) + ")"], ["all", "all"]]
          .map(([v, label]) => h("option", { value: v, selected: v === split }, label)))),
      h("a", { class: "button", href: href("/list", { experiment: expArg, sort: "reward", order: "desc" }) }, "All trajectories of this experiment →"));

    if (!steps.length) return h("div", { "data-testid": "overview" }, h("h1", null, fmt.exp(entry.experiment)), controls, h("p", { class: "muted" }, "No " + split + " trajectories in this experiment."));

    let chosen = steps.find((s) => String(s.step) === params.step) || steps[steps.length - 1];
    const histTitle = h("h3", null, "");
    const histCanvas = h("canvas", { "data-testid": "hist-chart" });
    let hist = null;
    const rows = new Map();
    const perPage = 25;
    let pageStart = Math.max(0, Math.floor(steps.indexOf(chosen) / perPage) * perPage);
    const tbody = h("tbody");
    const pager = h("div", { class: "pager" });

    const health = healthCard(expArg, split);

    function choose(stepNumber) {
      chosen = steps.find((s) => s.step === stepNumber) || chosen;
      health.show(chosen.step);
      histTitle.textContent = "Reward histogram, step " + chosen.step;
      if (hist) { hist.destroy(); charts = charts.filter((c) => c !== hist); }
      if (chartsAvailable()) hist = histChart(histCanvas, ov, chosen);
      const index = steps.indexOf(chosen);
      if (index < pageStart || index >= pageStart + perPage) { pageStart = Math.floor(index / perPage) * perPage; drawTable(); }
      for (const [s, tr] of rows) tr.classList.toggle("selected-step", s === chosen.step);
    }

    function drawTable() {
      rows.clear();
      tbody.replaceChildren(...steps.slice(pageStart, pageStart + perPage).map((s) => {
        const listLink = href("/list", { experiment: expArg, step: s.step, sort: "reward", order: "asc", validate: split === "all" ? undefined : String(split === "validation") });
        const tr = h("tr", { "data-testid": "step-row", "data-step": s.step },
          h("td", null, h("a", { href: listLink, title: "list this step's trajectories, worst first" }, "step " + s.step)),
          h("td", { class: "num" }, fmt.int(s.trajectories)),
          h("td", { class: "num" }, s.scored === s.trajectories ? fmt.int(s.scored) : h("span", { class: "bad", title: "trajectories without a reward" }, fmt.int(s.scored))),
          h("td", { class: "num" }, fmt.reward(s.mean)),
          h("td", { class: "num" }, fmt.reward(s.p50)),
          h("td", { class: "num" }, s.worst ? h("a", { href: "#/t/" + encodeURIComponent(s.worst.trace_id), class: "bad", "data-testid": "worst-link", title: "open the worst trajectory and why it failed" }, fmt.reward(s.worst.reward)) : "—"),
          h("td", { class: "num" }, s.best ? h("a", { href: "#/t/" + encodeURIComponent(s.best.trace_id), class: "good", "data-testid": "best-link", title: "open the best trajectory" }, fmt.reward(s.best.reward)) : "—"),
          h("td", null, Object.entries(s.kept).map(([rule, n]) => h("span", { class: "badge rule" }, rule + " " + n)), " "),
          h("td", null, h("a", { "data-testid": "groups-spread", title: "this step's GRPO groups, widest reward spread first",
            href: href("/groups", { experiment: expArg, step: s.step, sort: "spread", validate: split === "validation" ? "true" : undefined }) }, "groups"), " · ",
            h("a", { "data-testid": "groups-zero", title: "groups whose rollouts all got the same reward (GRPO learns nothing) first",
              href: href("/groups", { experiment: expArg, step: s.step, sort: "zero_spread", validate: split === "validation" ? "true" : undefined }) }, "zero spread")),
          h("td", null, s.best && s.worst && s.best.trace_id !== s.worst.trace_id
            ? h("a", { class: "button primary", "data-testid": "compare-best-worst", href: href("/compare", { ids: s.best.trace_id + "," + s.worst.trace_id }) }, "Compare best vs worst")
            : null));
        tr.addEventListener("click", (e) => { if (!e.target.closest("a")) choose(s.step); });
        rows.set(s.step, tr);
        return tr;
      }));
      for (const [s, tr] of rows) tr.classList.toggle("selected-step", s === chosen.step);
      pager.replaceChildren();
      if (steps.length > perPage) {
        pager.append(
          h("button", { type: "button", disabled: pageStart === 0, onclick: () => { pageStart = Math.max(0, pageStart - perPage); drawTable(); } }, "← earlier"),
          h("span", { class: "muted" }, "steps " + steps[pageStart].step + "–" + steps[Math.min(steps.length, pageStart + perPage) - 1].step + " of " + steps.length),
          h("button", { type: "button", disabled: pageStart + perPage >= steps.length, onclick: () => { pageStart += perPage; drawTable(); } }, "later →"));
      }
    }
    drawTable();

    const rewardCanvas = h("canvas", { "data-testid": "reward-chart" });
    const keptCanvas = h("canvas", { "data-testid": "kept-chart" });
    const scored = steps.reduce((n, s) => n + s.scored, 0);
    mount.push(() => {
      if (!chartsAvailable()) { health.show(chosen.step); return; }
      rewardChart(rewardCanvas, ov, choose);
      if (ov.rules.length) keptChart(keptCanvas, ov);
      choose(chosen.step);
    });
    return h("div", { "data-testid": "overview" },
      h("h1", null, fmt.exp(entry.experiment)),
      controls,
      h("p", { class: "muted" }, fmt.int(ov.trajectories) + { train: " training", validation: " validation", all: "" }[split] + " trajectories over " + steps.length + " step" + (steps.length === 1 ? "" : "s") + ", " + fmt.int(scored) + " with a reward."),
      chartsAvailable() ? null : errorBox(new Error("the chart library did not load (static/vendor/chart.umd.min.js)")),
      h("div", { class: "cards" },
        h("div", { class: "card" }, h("h3", null, "Reward per step"), h("div", { class: "chart-box" }, rewardCanvas)),
        h("div", { class: "card" }, h("h3", null, "Trajectories kept per rule"), ov.rules.length
          ? h("div", { class: "chart-box" }, keptCanvas)
          : h("p", { class: "muted" }, "No trajectory carries a kept_because attribute (every span the sampler admits is kept).")),
        h("div", { class: "card" }, histTitle, h("div", { class: "chart-box" }, histCanvas))),
      health.card,
      h("h2", null, "Steps"),
      h("table", { "data-testid": "steps-table" },
        h("thead", null, h("tr", null, h("th", null, "step"), h("th", { class: "num" }, "trajectories"), h("th", { class: "num" }, "scored"),
          h("th", { class: "num" }, "mean"), h("th", { class: "num" }, "median"), h("th", { class: "num" }, "worst"), h("th", { class: "num" }, "best"),
          h("th", null, "kept because"), h("th", null, "groups"), h("th", null, ""))),
        tbody),
      pager);
  }

  // ---- #/list : trajectories ----------------------------------------------------------------
  const FILTERS = [
    ["step", "step"], ["step_min", "step ≥"], ["step_max", "step ≤"], ["sample_index", "sample"], ["rollout_n", "rollout"],
    ["reward_min", "reward ≥"], ["reward_max", "reward ≤"],
  ];
  const SORTABLE = { reward: "reward", turns: "turns", duration: "duration", step: "step", start: "started", tools: "tools", tokens: "tokens", advantage: "advantage" };

  async function listView(params) {
    const facets = await api("facets");
    const limit = Number(params.limit || 50);
    const offset = Number(params.offset || 0);
    const sort = params.sort || "start";
    const order = params.order || "desc";
    const query = { ...params, sort, order, limit, offset };
    if (query.experiment !== undefined) query.experiment = expParam(query.experiment);
    const page = await api("trajectories", query, ["experiment"]);
    const nav = (changes) => go("/list", { ...params, ...changes });

    const form = h("form", { class: "controls", "data-testid": "filter-form" },
      h("label", { class: "search" }, "search prompts and responses", h("input", { type: "search", name: "q", maxlength: "256", value: params.q || "",
        placeholder: "words in the first prompt or last response", "data-testid": "search", "aria-label": "search prompts and responses" })),
      h("label", null, "experiment", h("select", { name: "experiment" }, h("option", { value: "" }, "any"),
        facets.experiments.map((e) => h("option", { value: expKey(e.experiment), selected: params.experiment === expKey(e.experiment) }, fmt.exp(e.experiment))))),
      FILTERS.map(([name, label]) => h("label", null, label, name === "sample_index"
        // VERL's sample index is an int or a string (uuid datasets): a text field
        ? h("input", { type: "text", name, maxlength: "256", value: params[name] || "" })
        : h("input", { type: "number", name, step: name.startsWith("reward") ? "any" : "1", value: params[name] || "" }))),
      h("label", null, "rollouts", h("select", { name: "validate" },
        [["", "any"], ["false", "training"], ["true", "validation"]].map(([v, l]) => h("option", { value: v, selected: (params.validate || "") === v }, l)))),
      h("label", null, "kept because", h("select", { name: "kept_because" }, h("option", { value: "" }, "any"),
        facets.kept_because.map((r) => h("option", { value: r.rule, selected: params.kept_because === r.rule }, r.rule + " (" + fmt.int(r.trajectories) + ")")))),
      h("label", null, "trainer", h("select", { name: "trained", "data-testid": "filter-trained" },
        [["", "any"], ["true", "trained"], ["false", "dropped by the trainer"]].map(([v, l]) => h("option", { value: v, selected: (params.trained || "") === v }, l)))),
      (facets.trainer || []).some((f) => f.filtered_by) ? h("label", null, "filtered by", h("select", { name: "filtered_by", "data-testid": "filter-filtered-by" }, h("option", { value: "" }, "any"),
        facets.trainer.filter((f) => f.filtered_by).map((f) => h("option", { value: f.filtered_by, selected: params.filtered_by === f.filtered_by }, f.filtered_by + " (" + fmt.int(f.trajectories) + ")")))) : null,
      // a gateway's trajectories came through node collectors: which one forwarded each
      (facets.nodes || []).length ? h("label", null, "node", h("select", { name: "node", "data-testid": "filter-node" }, h("option", { value: "" }, "any"),
        facets.nodes.map((n) => h("option", { value: n.node, selected: params.node === n.node }, n.node + " (" + fmt.int(n.trajectories) + ")")))) : null,
      h("label", { class: "attr-filter" }, "attributes", h("input", { type: "text", name: "attr", maxlength: "512", value: params.attr || "",
        placeholder: "key=value; key2=value2", title: "the root span's attributes: each key=value must hold (a dotted key reaches into a mapping)",
        "data-testid": "filter-attr" })),
      truthUi ? truthUi.listFilters(kit, params, facets) : null,
      h("label", null, "errors", h("select", { name: "has_error" },
        [["", "any"], ["true", "with errors"], ["false", "without"]].map(([v, l]) => h("option", { value: v, selected: (params.has_error || "") === v }, l)))),
      h("label", null, "sort", h("select", { name: "sort" }, Object.entries(SORTABLE).map(([v, l]) => h("option", { value: v, selected: sort === v }, l)))),
      h("label", null, "order", h("select", { name: "order" }, [["desc", "high → low"], ["asc", "low → high"]].map(([v, l]) => h("option", { value: v, selected: order === v }, l)))),
      h("button", { type: "submit", class: "primary", "data-testid": "apply-filters" }, "Apply"),
      h("a", { class: "button", href: "#/list" }, "Reset"));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const next = {};
      for (const [key, value] of new FormData(form).entries()) if (value !== "") next[key] = value;
      go("/list", { ...next, limit: params.limit });
    });

    const compareButton = h("button", { type: "button", class: "primary", "data-testid": "compare-selected", disabled: selected.size < 2,
      onclick: () => go("/compare", { ids: [...selected].join(",") }) }, "Compare selected (" + selected.size + ")");
    const clearButton = h("button", { type: "button", onclick: () => { selected.clear(); render(); } }, "Clear selection");
    const updateSelection = () => { compareButton.textContent = "Compare selected (" + selected.size + ")"; compareButton.disabled = selected.size < 2; };

    const head = (key, label, cls) => {
      if (!SORTABLE[key]) return h("th", { class: cls }, label);
      const active = sort === key;
      return h("th", { class: (cls || "") + " sortable" + (active ? " sorted" : ""), "data-sort": key, title: "sort by " + label,
        onclick: () => nav({ sort: key, order: active && order === "desc" ? "asc" : "desc", offset: 0 }) },
        label + (active ? (order === "desc" ? " ▼" : " ▲") : ""));
    };
    const rows = page.trajectories.map((t) => {
      const box = h("input", { type: "checkbox", "aria-label": "select for comparison", checked: selected.has(t.trace_id),
        onchange: (e) => { if (e.target.checked) selected.add(t.trace_id); else selected.delete(t.trace_id); updateSelection(); } });
      const tr = h("tr", { class: "clickable", "data-testid": "traj-row", "data-trace-id": t.trace_id },
        h("td", null, box),
        h("td", { class: "mono" }, h("a", { href: "#/t/" + encodeURIComponent(t.trace_id), title: t.trace_id }, fmt.id(t.trace_id))),
        previewCell(t, params.q),
        h("td", null, fmt.exp(t.experiment)),
        h("td", { class: "num" }, t.step ?? "—"), h("td", { class: "num" }, t.sample_index ?? "—"), h("td", { class: "num" }, t.rollout_n ?? "—"),
        h("td", null, t.validate ? h("span", { class: "badge" }, "val") : ""),
        h("td", null, t.kept_because ? h("span", { class: "badge rule" }, t.kept_because) : ""),
        h("td", { class: "num" }, t.turns),
        h("td", { class: "num" }, t.tool_calls, t.tool_errors ? h("span", { class: "bad", title: "tool calls that raised" }, " (" + t.tool_errors + " err)") : ""),
        h("td", { class: "num" }, fmt.int(t.response_tokens)),
        h("td", { class: "num" }, fmt.dur(t.duration)),
        h("td", { class: "num" + (t.has_error ? " bad" : "") }, t.has_error ? "error" : ""),
        h("td", { class: "num", "data-testid": "reward" }, fmt.reward(t.reward)),
        h("td", { class: "trainer" }, trainerBadge(t, null) || ""),
        truthUi ? truthUi.listCells(kit, t, params) : null);
      tr.addEventListener("click", (e) => { if (!e.target.closest("a, input")) go("/t/" + encodeURIComponent(t.trace_id)); });
      return tr;
    });
    const last = Math.min(page.total, offset + page.trajectories.length);
    const pager = h("div", { class: "pager", "data-testid": "pager" },
      h("button", { type: "button", disabled: offset === 0, onclick: () => nav({ offset: Math.max(0, offset - limit) }) }, "← previous"),
      h("span", { "data-testid": "page-info" }, page.total ? (offset + 1) + "–" + last + " of " + fmt.int(page.total) : "no trajectories match"),
      h("button", { type: "button", disabled: offset + limit >= page.total, onclick: () => nav({ offset: offset + limit }) }, "next →"),
      h("label", { class: "muted" }, " per page ", h("select", { onchange: (e) => nav({ limit: e.target.value, offset: 0 }) },
        [25, 50, 100, 200].map((n) => h("option", { value: n, selected: n === limit }, n)))));
    return h("div", { "data-testid": "list" },
      h("h1", null, "Trajectories"), form,
      h("div", { class: "row" }, compareButton, clearButton, h("span", { class: "muted" }, "tick two or more rows to compare them side by side"),
        exportLinks(query, page.total)),
      pager,
      h("div", { class: "table-scroll" }, h("table", { "data-testid": "list-table" },
        h("thead", null, h("tr", null, h("th", null, ""), h("th", null, "trajectory"),
          h("th", { class: "preview", title: "the first prompt's last user message (system prompt and template tokens left out) and the last response" },
            h("span", { "data-testid": "preview-header" }, "last user message → last response")), h("th", null, "experiment"), head("step", "step", "num"),
          h("th", { class: "num" }, "sample"), h("th", { class: "num" }, "rollout"), h("th", null, ""), h("th", null, "kept because"),
          head("turns", "turns", "num"), head("tools", "tools", "num"), head("tokens", "resp. tokens", "num"), head("duration", "duration", "num"),
          h("th", null, ""), head("reward", "reward", "num"), head("advantage", "trainer"), truthUi ? truthUi.listHeads(kit, params) : null)),
        h("tbody", null, rows))));
  }

  // The list's selection as a dataset file (GET /ui/api/export = /v1/export, same filters; issue 15 §6)
  function exportLinks(query, total) {
    const { sort, order, limit, offset, ...filters } = query;
    const link = (format, label) => {
      const qs = new URLSearchParams(clean({ ...filters, format }));
      if (filters.experiment === "") qs.set("experiment", "");
      return h("a", { class: "button", href: "api/export?" + qs.toString(), download: "tracecar-export." + format,
        "data-testid": "export-" + format, title: "all " + fmt.int(total) + " trajectories matching these filters, for datasets.load_dataset" }, label);
    };
    return h("span", { class: "export-links", "data-testid": "export-links" }, h("span", { class: "muted" }, "export " + fmt.int(total) + ":"),
      link("jsonl", "JSONL"), link("parquet", "Parquet"));
  }

  // The ends of a trajectory's first prompt and last response (the list's previews), the searched words marked.
  function marked(text, q) {
    const words = (q || "").toLowerCase().match(/[\p{L}\p{N}_]+/gu);
    if (!words || !text) return [text];
    const pattern = new RegExp("(" + words.map((w) => w.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")).join("|") + ")", "giu");
    return text.split(pattern).map((part, i) => (i % 2 ? h("mark", { class: "hit" }, part) : part));
  }

  function previewCell(t, q) {
    if (!t.prompt_preview && !t.response_preview) return h("td", { class: "preview muted" }, "no decoded text");
    return h("td", { class: "preview", "data-testid": "preview" },
      h("div", { class: "pv-prompt", title: t.prompt_preview || "", "data-testid": "prompt-preview" }, h("span", { class: "pv-role" }, "prompt"), marked(t.prompt_preview || "—", q)),
      h("div", { class: "pv-response", title: t.response_preview || "", "data-testid": "response-preview" }, h("span", { class: "pv-role" }, "response"), marked(t.response_preview || "—", q)));
  }

  // ---- long texts folded (issue 15 §7): their first lines, and a button (keyboard: Tab, Enter) for the rest ----
  // The whole text stays in the page (find-in-page and selection see it); only its height is clipped.
  const FOLD_CHARS = 1200;
  const FOLD_LINES = 12;
  let foldSeq = 0;

  function setFold(wrap, open) {
    wrap.classList.toggle("is-folded", !open);
    const button = wrap.querySelector(":scope > .fold-toggle");
    button.setAttribute("aria-expanded", open ? "true" : "false");
    button.textContent = open ? "Show less" : button.dataset.more;
  }

  function foldable(el, text) {
    const lines = text.split("\n").length;
    if (text.length <= FOLD_CHARS && lines <= FOLD_LINES) return el;
    el.id = el.id || "fold-" + (++foldSeq);
    const more = "Show all (" + (lines > FOLD_LINES ? fmt.int(lines) + " lines, " : "") + fmt.int(text.length) + " characters)";
    const button = h("button", { type: "button", class: "fold-toggle quiet", "aria-expanded": "false", "aria-controls": el.id,
      "data-testid": "fold-toggle", "data-more": more }, more);
    const wrap = h("div", { class: "fold is-folded", "data-testid": "fold" }, el, button);
    button.addEventListener("click", () => setFold(wrap, wrap.classList.contains("is-folded")));
    return wrap;
  }

  // one button (and the key e) shows or folds every long text of the page
  function foldAllButton() {
    const button = h("button", { type: "button", class: "quiet", "data-testid": "fold-all", "data-key": "fold-all",
      title: "show or fold every long text (key: e)" }, "Show all long texts");
    button.addEventListener("click", () => {
      const folds = [...document.querySelectorAll("[data-testid=fold]")];
      const open = folds.some((w) => w.classList.contains("is-folded"));
      folds.forEach((w) => setFold(w, open));
      button.textContent = open ? "Fold long texts" : "Show all long texts";
    });
    return button;
  }

  // ---- #/t/ID : one trajectory ----------------------------------------------------------------
  function textBlock(text, cls, fallback) {
    if (text === null || text === undefined) return h("p", { class: "muted" }, fallback);
    return foldable(h("pre", { class: "text " + (cls || "") }, text === "" ? "(empty)" : text), text);
  }

  // the inference engine's own timings of a turn (vLLM's llm_request span, received over OTLP)
  function engineLine(t) {
    const parts = [["queue", t.queue_s], ["TTFT", t.ttft_s], ["prefill", t.prefill_s], ["decode", t.decode_s], ["e2e", t.e2e_s]]
      .filter(([, v]) => typeof v === "number").map(([k, v]) => k + " " + fmt.dur(v));
    if (t.prompt_tokens !== undefined || t.completion_tokens !== undefined) parts.push(fmt.int(t.prompt_tokens) + " → " + fmt.int(t.completion_tokens) + " tokens");
    return h("div", { class: "muted engine" + (t.error ? " error" : ""), "data-testid": "engine-timings" },
      "engine " + (t.name || "") + ": " + (parts.length ? parts.join(" · ") : fmt.dur(t.duration)) + (t.error ? " · error: " + t.error : ""));
  }

  function eventCard(e) {
    if (e.type === "engine") return engineLine(e.engine);
    const isTool = e.type === "tool";
    return h("div", { class: "tool" + (isTool ? "" : " op") + (e.error ? " error" : ""), "data-testid": isTool ? "tool-call" : "op-call" },
      h("div", { class: "row" }, h("strong", null, (isTool ? "tool call: " : "") + e.name), h("span", { class: "muted" }, fmt.dur(e.duration)),
        e.error ? h("span", { class: "badge bad" }, "error") : null),
      h("div", { class: "grid" },
        h("div", null, h("div", { class: "label" }, "arguments"), jsonBlock(e.arguments)),
        h("div", null, h("div", { class: "label" }, e.error ? "error" : "result"), e.error ? foldable(h("div", { class: "err-text" }, e.error), String(e.error)) : jsonBlock(e.result))));
  }

  function turnCard(turn) {
    const tokens = (turn.prompt_tokens !== null ? fmt.int(turn.prompt_tokens) + " prompt tokens" : "prompt tokens not sent") + " → " +
      (turn.response_tokens !== null ? fmt.int(turn.response_tokens) + " response tokens" : "response tokens not sent");
    // say what actually failed (the collector's stored warning) rather than to set what may be set already
    const noText = turn.decode_problem ? "no decoded text: " + turn.decode_problem :
      "no decoded text: token2text was off for this batch (start the collector with TRACECAR_TOKEN2TEXT=true and TRACECAR_TOKENIZER to see it)";
    const first = turn.index === 1;
    return h("section", { class: "turn", "data-testid": "turn" },
      h("header", null, h("strong", null, "Turn " + turn.index), h("span", { class: "muted" }, turn.name), h("span", null, fmt.dur(turn.duration)),
        h("span", { class: "muted" }, tokens), turn.stop_reason ? h("span", { class: "badge" }, "stop: " + turn.stop_reason) : null,
        turn.error ? h("span", { class: "badge bad" }, "error") : null),
      h("div", { class: "body" },
        truthUi ? truthUi.turnDrift(kit, turn) : null,
        (turn.engine || []).map(engineLine),
        h("div", { class: "label" }, first ? "prompt" : "new context since the previous turn"),
        textBlock(first ? turn.prompt_text : turn.new_context, "", noText),
        !first && turn.prompt_text !== null ? h("details", null, h("summary", { class: "muted" }, "full prompt of this turn"), textBlock(turn.prompt_text, "")) : null,
        h("div", { class: "label" }, "response"),
        textBlock(turn.response_text, "response", noText),
        turn.error ? h("div", { class: "err-text" }, turn.error) : null,
        turn.after.map(eventCard)));
  }

  function spanTree(span) {
    const duration = span.end_time && span.start_time ? span.end_time - span.start_time : null;
    const details = h("details", { class: "span" },
      h("summary", null, h("span", { class: "name" }, span.name), " ", h("span", { class: "badge" }, span.kind), " ",
        h("span", { class: "muted" }, fmt.dur(duration)), span.exception ? h("span", { class: "badge bad" }, "error") : null,
        span.parent_missing ? h("span", { class: "badge bad", title: "its parent span never arrived" }, "parent missing") : null,
        span.depth_capped ? h("span", { class: "badge", title: "nested deeper than TRACECAR_MAX_TREE_DEPTH: shown at the cap; parent_id names its real parent" }, "depth " + span.depth) : null,
        h("span", { class: "muted mono" }, " " + span.span_id)));
    details.addEventListener("toggle", () => {
      if (!details.open || details.dataset.filled) return;
      details.dataset.filled = "1";
      const { children, ...fields } = span;
      details.append(h("div", { class: "body" }, jsonBlock(fields)));
    });
    return h("li", null, details, span.children && span.children.length ? h("ul", { class: "tree" }, span.children.map(spanTree)) : null);
  }

  // ---- what the trainer did (issue 15 §3) --------------------------------------------------------
  function trainerBadge(s, keptBecause) {
    if (!s || (s.trained === null && s.filtered_by === null) || (s.trained === undefined && s.filtered_by === undefined)) return null;
    if (s.trained === false || (s.filtered_by && s.trained !== true)) {
      const why = s.filtered_by || "by the trainer";
      return h("span", { class: "badge bad", "data-testid": "trainer-status", title: keptBecause
        ? "tracecar kept it (" + keptBecause + "); the trainer did not train on it (" + why + ")" : "the trainer did not train on it" },
        keptBecause ? "kept by tracecar, filtered by the trainer: " + why : "dropped by the trainer: " + why);
    }
    return h("span", { class: "badge good", "data-testid": "trainer-status", title: "the trainer trained on it" },
      "trained" + (s.advantage !== null && s.advantage !== undefined ? " · adv " + (s.advantage >= 0 ? "+" : "") + Number(s.advantage).toFixed(3) : ""));
  }

  function staleness(s) {
    if (!s || s.policy_version === null || s.policy_version === undefined || s.trained_on_version === null || s.trained_on_version === undefined) return undefined;
    return "generated by v" + s.policy_version + ", trained at v" + s.trained_on_version + " (staleness " + (s.trained_on_version - s.policy_version) + ")";
  }

  // ---- token view (issue 15 §2) ---------------------------------------------------------------------
  // shade buckets by probability p = exp(logprob): 0 (p ≥ .9, none) … 5 (p < .1); classes, not inline styles (the CSP allows none)
  function shade(lp) {
    if (lp === null || lp === undefined) return "";
    const p = Math.exp(lp);
    return " lp" + (p >= 0.9 ? 0 : p >= 0.7 ? 1 : p >= 0.5 ? 2 : p >= 0.3 ? 3 : p >= 0.1 ? 4 : 5);
  }

  function tokenTitle(tok) {
    const parts = ["#" + tok.i, "id " + tok.id];
    if (tok.logprob !== undefined) parts.push(tok.logprob === null ? "logprob —" : "logprob " + tok.logprob.toFixed(4) + " (p " + Math.exp(tok.logprob).toFixed(3) + ")");
    if (tok.entropy !== undefined && tok.entropy !== null) parts.push("entropy " + tok.entropy.toFixed(3));
    if (tok.mask === 0) parts.push("outside the loss mask (tool output)");
    if (tok.text === "") parts.push("bytes of a character the next token completes");
    return parts.join(" · ");
  }

  function tokenPanel(view) {
    if (!view || !view.spans.length) {
      return h("p", { class: "muted", "data-testid": "token-view-empty" },
        "No span of this trajectory carried per-token data (VERL's response_mask, and response_logprobs with calculate_log_probs).");
    }
    const spans = view.spans;
    let current = spans.find((s) => s.aggregate) || spans[0];
    const body = h("div");
    const pick = h("div", { class: "row", "data-testid": "token-spans" }, spans.length > 1 ? spans.map((s, i) => h("button", {
      type: "button", class: s === current ? "primary" : null, "data-testid": "token-span",
      onclick: (e) => { current = s; pick.querySelectorAll("button").forEach((b) => b.classList.remove("primary")); e.target.classList.add("primary"); draw(); } },
      (s.aggregate ? "whole response" : "turn " + (spans.filter((x) => !x.aggregate).indexOf(s) + 1)) + " · " + s.name + " (" + fmt.int(s.count) + ")")) : null);
    function draw() {
      const s = current;
      const box = h("div", { class: "tokens", "data-testid": "token-text" });
      const els = s.tokens.map((tok) => h("span", { class: "tok" + shade(tok.logprob) + (tok.mask === 0 ? " out" : "") + (truthUi ? truthUi.tokenClass(tok) : ""), "data-i": tok.i,
        "data-testid": "token", title: tokenTitle(tok) + (truthUi ? truthUi.tokenTitle(tok) : "") }, tok.text === undefined ? "⟨" + tok.id + "⟩" : tok.text));
      box.append(...els);
      const flash = (i) => { const el = els[i]; if (!el) return; el.scrollIntoView({ block: "center" }); el.classList.add("flash"); setTimeout(() => el.classList.remove("flash"), 1500); };
      const lowest = s.lowest.length
        ? h("table", { "data-testid": "lowest-tokens" },
          h("thead", null, h("tr", null, h("th", { class: "num" }, "#"), h("th", null, "token"), h("th", { class: "num" }, "logprob"),
            h("th", { class: "num" }, "p"), s.has.entropy ? h("th", { class: "num" }, "entropy") : null,
            s.max_logprob_diff !== undefined && s.max_logprob_diff !== null ? h("th", { class: "num" }, "trainer") : null, h("th", null, "context"))),
          h("tbody", null, s.lowest.map((tok) => {
            const before = s.text ? s.text.slice(Math.max(0, tok.start - 30), tok.start) : "";
            const after = s.text ? s.text.slice(tok.end, tok.end + 30) : "";
            const tr = h("tr", { class: "clickable", "data-testid": "lowest-token", onclick: () => flash(tok.i) },
              h("td", { class: "num" }, tok.i), h("td", { class: "mono" }, JSON.stringify(tok.text ?? tok.id)),
              h("td", { class: "num mono bad" }, tok.logprob.toFixed(3)), h("td", { class: "num mono" }, Math.exp(tok.logprob).toFixed(3)),
              s.has.entropy ? h("td", { class: "num mono" }, tok.entropy === null || tok.entropy === undefined ? "—" : tok.entropy.toFixed(3)) : null,
              s.max_logprob_diff !== undefined && s.max_logprob_diff !== null ? h("td", { class: "num mono" + (truthUi ? truthUi.tokenClass(tok) : ""), "data-testid": "lowest-trainer" },
                tok.trainer_logprob === undefined ? "—" : tok.trainer_logprob.toFixed(3)) : null,
              h("td", { class: "mono muted ctx" }, "…" + before, h("mark", null, tok.text ?? ""), after + "…"));
            return tr;
          })))
        : h("p", { class: "muted" }, s.has.logprobs ? "No generated token with a log-probability." : "No log-probabilities sent (VERL: actor_rollout_ref.rollout.calculate_log_probs=True).");
      body.replaceChildren(
        h("p", { class: "muted", "data-testid": "token-summary" }, fmt.int(s.count) + " tokens" +
          (s.has.mask ? ", " + fmt.int(s.outside_mask) + " outside the loss mask" : "") +
          (s.mean_logprob !== null ? ", mean logprob " + s.mean_logprob.toFixed(3) + " over generated tokens" : "") +
          (s.text_note ? " — " + s.text_note : "")),
        s.exact === false ? h("p", { class: "badge bad", "data-testid": "token-inexact" },
          "Token boundaries approximated: the pieces join to the decoded text, but a token's own text may be shown on a neighbour.") : null,
        h("div", { class: "legend" }, "p(token): ", [0, 1, 2, 3, 4, 5].map((b) => h("span", { class: "tok lp" + b }, ["≥.9", ".7", ".5", ".3", ".1", "<.1"][b])),
          s.has.mask ? h("span", { class: "tok out" }, "tool output (not trained on)") : null),
        truthUi ? truthUi.tokenLegend(kit, view) : null,
        box,
        h("h3", null, "Lowest-probability tokens"), lowest);
    }
    draw();
    return h("section", { "data-testid": "token-view" }, pick, body);
  }

  // what the list's "error" means (any span raised), said as what raised; as the compare page says it
  function errorSaid(t) {
    if (!t.has_error) return undefined;
    return h("span", { class: "bad", "data-testid": "traj-error" },
      t.error || (t.tool_errors ? t.tool_errors + " failed tool call" + (t.tool_errors === 1 ? "" : "s") : "a span raised (see the span tree)"));
  }

  // j/k between the rollouts of this trajectory's group (prefs.js follows the data-key links), b/w the step's best/worst
  function rolloutNav(t, a, rollouts, best, worst) {
    const list = rollouts ? rollouts.trajectories : [];
    const at = list.findIndex((r) => r.trace_id === t.trace_id);
    const link = (r, key, label, testid) => (r ? h("a", { href: "#/t/" + encodeURIComponent(r.trace_id), "data-key": key, "data-testid": testid, title: key + ": " + label }, label) : null);
    const top = best && best.trajectories[0];
    const bottom = worst && worst.trajectories[0];
    return h("div", { class: "rollout-nav", "data-testid": "rollout-nav" },
      list.length > 1 ? [
        h("span", { class: "muted" }, "rollouts of sample " + a.sample_index + ":"),
        link(at > 0 ? list[at - 1] : null, "prev", "◀ previous", "rollout-prev"),
        h("span", { class: "rollouts" }, list.map((r) => h("a", { href: "#/t/" + encodeURIComponent(r.trace_id), class: r.trace_id === t.trace_id ? "here" : null,
          title: "rollout " + r.rollout_n + ", reward " + fmt.reward(r.reward), "data-testid": "rollout-chip" }, String(r.rollout_n ?? "?")))),
        link(at >= 0 && at < list.length - 1 ? list[at + 1] : null, "next", "next ▶", "rollout-next"),
        h("a", { href: href("/groups", { experiment: expKey(a.experiment_name), step: a.step, sample_index: a.sample_index, validate: a.validate ? "true" : undefined }),
          "data-key": "group", title: "g: the group ranked" }, "group"),
      ] : null,
      top ? [h("span", { class: "muted" }, "step " + a.step + ":"), link(top, "best", "best " + fmt.reward(top.reward), "step-best"),
        link(bottom, "worst", "worst " + fmt.reward(bottom.reward), "step-worst")] : null,
      h("span", { class: "muted hint" }, h("kbd", null, "j"), " ", h("kbd", null, "k"), " rollouts · ", h("kbd", null, "g"), " group · ",
        h("kbd", null, "b"), " ", h("kbd", null, "w"), " best/worst · ", h("kbd", null, "?"), " keys"));
  }

  // Why this reward, in a few lines: what raised, how the last turn stopped, what it finally said.
  function whyPanel(t, best, worst) {
    const items = [];
    const top = best && best.trajectories[0];
    const bottom = worst && worst.trajectories[0];
    const a = t.attributes || {};
    if (t.reward === null || t.reward === undefined) items.push(h("li", null, "no reward attached (yet)"));
    else if (bottom && bottom.trace_id === t.trace_id) items.push(h("li", null, "the worst reward of step " + a.step + (top ? " (best " + fmt.reward(top.reward) + ")" : "")));
    else if (top && top.trace_id === t.trace_id) items.push(h("li", null, "the best reward of step " + a.step));
    if (t.error) items.push(h("li", { class: "bad" }, "the trajectory raised: ", h("span", { class: "quote" }, t.error)));
    t.turns.forEach((turn) => {
      if (turn.error) items.push(h("li", { class: "bad" }, "turn " + turn.index + " raised: ", h("span", { class: "quote" }, turn.error)));
      for (const e of turn.after) if (e.error) items.push(h("li", { class: "bad" }, "turn " + turn.index + ": " + (e.type === "tool" ? "tool call " : "") + e.name + " failed: ", h("span", { class: "quote" }, e.error)));
    });
    for (const e of t.before_first_turn || []) if (e.error) items.push(h("li", { class: "bad" }, e.name + " failed: ", h("span", { class: "quote" }, e.error)));
    const last = t.turns[t.turns.length - 1];
    if (last && last.stop_reason && last.stop_reason !== "stop") items.push(h("li", null, "the last turn stopped: " + last.stop_reason + (last.stop_reason === "length" ? " (cut at the length limit)" : "")));
    if (last && last.response_text) {
      const text = last.response_text.length > 240 ? "…" + last.response_text.slice(-240) : last.response_text;
      items.push(h("li", null, "it finally said: ", h("span", { class: "quote", "data-testid": "why-last" }, text)));
    }
    const failed = t.has_error;
    return h("section", { class: "why" + (failed ? "" : " fine"), "data-testid": "why" },
      h("strong", null, failed ? "Why it failed" : "Why this reward"),
      failed ? null : h("span", { class: "muted" }, " — no span raised"),
      items.length ? h("ul", null, items) : null);
  }

  async function trajectoryView(id) {
    const tokensPromise = api("trajectories/" + encodeURIComponent(id) + "/tokens").catch(() => null);
    const t = await api("trajectories/" + encodeURIComponent(id));
    const a = t.attributes || {};
    const s = t.summary || {};
    const actions = h("div", { class: "actions", "data-testid": "actions" });
    let nav = null;
    let why = whyPanel(t, null, null);
    if (a.step !== undefined) {
      const base = { experiment: a.experiment_name === undefined ? "" : a.experiment_name, step: a.step, validate: a.validate === undefined ? undefined : String(a.validate) };
      const [best, worst, rollouts] = await Promise.all([
        api("trajectories", { ...base, sort: "reward", order: "desc", limit: 1 }, ["experiment"]),
        api("trajectories", { ...base, sort: "reward", order: "asc", limit: 1 }, ["experiment"]),
        a.sample_index !== undefined ? api("trajectories", { ...base, sample_index: a.sample_index, sort: "rollout_n", order: "asc", limit: 64 }, ["experiment"]) : null,
      ]);
      const other = (page, label, testid) => {
        const top = page.trajectories[0];
        if (!top || top.trace_id === t.trace_id) return null;
        return h("a", { class: "button primary", "data-testid": testid, href: href("/compare", { ids: t.trace_id + "," + top.trace_id }) }, label + " (" + fmt.reward(top.reward) + ")");
      };
      actions.append(...[
        other(best, "Compare with the best of step " + a.step, "compare-with-best"),
        other(worst, "Compare with the worst of step " + a.step, "compare-with-worst"),
        rollouts && rollouts.trajectories.length > 1 ? h("a", { class: "button", "data-testid": "compare-rollouts",
          href: href("/compare", { ids: rollouts.trajectories.map((r) => r.trace_id).join(",") }) }, "Compare all " + rollouts.trajectories.length + " rollouts of sample " + a.sample_index) : null,
        a.sample_index !== undefined ? h("a", { class: "button", "data-testid": "its-group", href: href("/groups", { experiment: expKey(a.experiment_name), step: a.step,
          sample_index: a.sample_index, validate: a.validate ? "true" : undefined }) }, "Its group: sample " + a.sample_index + " ranked") : null,
        a.sample_index !== undefined ? h("a", { class: "button", href: href("/list", { experiment: expKey(a.experiment_name), sample_index: a.sample_index, rollout_n: a.rollout_n, sort: "step", order: "asc" }) }, "This sample at other steps") : null,
        h("a", { class: "button", href: href("/list", { experiment: expKey(a.experiment_name), step: a.step, sort: "reward", order: "desc" }) }, "All of step " + a.step),
      ].filter(Boolean));
      nav = rolloutNav(t, a, rollouts, best, worst);
      why = whyPanel(t, best, worst);
    }
    const kv = (pairs) => h("dl", { class: "kv" }, pairs.filter(([, v]) => v !== undefined && v !== null && v !== "").map(([k, v]) => [h("dt", null, k), h("dd", null, v)]));
    const extraAttributes = Object.entries(a).filter(([k]) => !["experiment_name", "step", "sample_index", "rollout_n", "validate", "kept_because", "reward"].includes(k));
    const tokenView = await tokensPromise;
    const metrics = t.metrics.length
      ? h("table", null, h("thead", null, h("tr", null, h("th", null, "source"), h("th", null, "metric"), h("th", { class: "num" }, "value"))),
        h("tbody", null, t.metrics.map((m) => h("tr", null, h("td", { class: "muted" }, m.source), h("td", null, m.key), h("td", { class: "num mono" }, fmt.value(m.value))))))
      : h("p", { class: "muted" }, "No metrics.");
    const annotations = t.annotations.length
      ? h("table", null, h("thead", null, h("tr", null, h("th", null, "annotated at"), h("th", null, "values"))),
        h("tbody", null, t.annotations.map((n) => h("tr", null, h("td", { class: "muted" }, fmt.time(n.start_time)), h("td", { class: "mono" }, JSON.stringify(n.values))))))
      : h("p", { class: "muted" }, "No annotation (no reward attached yet).");
    return h("div", { "data-testid": "trajectory", "data-trace-id": t.trace_id },
      h("div", { class: "head" },
        h("div", null,
          h("h1", null, (t.name || "trajectory") + " ", h("span", { class: "muted mono" }, t.trace_id)),
          kv([["experiment", fmt.exp(a.experiment_name)], ["step", a.step], ["sample", a.sample_index], ["rollout", a.rollout_n],
            ["rollouts", a.validate === undefined ? undefined : a.validate ? "validation" : "training"],
            ["kept because", t.kept_because ? h("span", { class: "badge rule" }, fmt.value(t.kept_because)) : undefined],
            ["trainer", trainerBadge(s, t.kept_because) || undefined], ["advantage", s.advantage === null || s.advantage === undefined ? undefined : fmt.value(s.advantage)],
            ["policy", staleness(s)],
            ["worker", s.worker], ["node", s.node], ["started", fmt.time(t.start_time)],
            ...extraAttributes.map(([k, v]) => [k, fmt.value(v)]),
            ["root", t.root_received ? undefined : h("span", { class: "bad" }, "not received yet (still running, or lost)")]])),
        h("div", null,
          h("div", { class: "muted" }, "reward"), h("div", { class: "big", "data-testid": "reward" }, fmt.reward(t.reward)),
          kv([["duration", fmt.dur(t.duration)], ["turns", t.turn_count], ["tool calls", t.tool_calls + (t.tool_errors ? " (" + t.tool_errors + " failed)" : "")],
            ["response tokens", fmt.int(t.response_tokens)], ["spans", t.span_count], ["error", errorSaid(t)]]))),
      nav, why,
      truthUi ? [truthUi.fateLine(kit, t), truthUi.rewardPanel(kit, t), truthUi.trainerPanel(kit, t)] : null,
      actions,
      h("h2", { class: "with-tools" }, "Conversation", foldAllButton()),
      t.before_first_turn.map(eventCard),
      t.turns.length ? t.turns.map(turnCard) : h("p", { class: "muted" }, "No LLM call in this trajectory (no span whose output carries response_ids / token_ids)."),
      h("h2", null, "Tokens"),
      tokenPanel(tokenView),
      h("h2", null, "Reward and metrics"),
      h("div", { class: "cards" }, h("div", { class: "card" }, h("h3", null, "Annotations"), annotations), h("div", { class: "card" }, h("h3", null, "Metrics"), metrics)),
      h("h2", null, "Timeline"),
      h("p", { class: "muted" }, "Where the time went: each span on the trajectory's clock; generation (LLM calls), tools, and the rest (waiting, the loop's own work)."),
      window.tracecarTimeline ? window.tracecarTimeline.view(t, kit) : null,
      h("h2", null, "Span tree"),
      h("p", { class: "muted" }, "Every span as stored; open one to see its attributes, inputs and output."),
      h("ul", { class: "tree top", "data-testid": "span-tree" }, spanTree(t.tree)));
  }

  // ---- #/compare : side by side, aligned by turn (static/compare.js) ----------------------------

  window.addEventListener("hashchange", render);
  render();
})();
