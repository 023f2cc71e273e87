// tracecar viewer: the theme and the keyboard (loaded first, in <head>, so a dark theme never flashes light).
// Theme: "auto" follows prefers-color-scheme; the header's toggle cycles auto → dark → light, remembered in
// localStorage. Keys act on elements that pages mark with data-key (app.js): j/k next/previous rollout of
// the group, g its group, b / w best / worst of the step, t theme, ? the list of keys.
"use strict";
(() => {
  const STORE = "tracecar-theme";
  const root = document.documentElement;
  const media = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;
  const choice = () => { try { return localStorage.getItem(STORE) || "auto"; } catch (_) { return "auto"; } };
  const resolved = (c) => (c === "dark" || c === "light" ? c : media && media.matches ? "dark" : "light");

  function chartColours() {
    if (typeof window.Chart !== "function") return;
    const css = getComputedStyle(root);
    window.Chart.defaults.color = css.getPropertyValue("--muted").trim() || "#656d76";
    window.Chart.defaults.borderColor = css.getPropertyValue("--chart-grid").trim() || "rgba(0,0,0,0.1)";
  }

  function apply(rerender) {
    const c = choice();
    root.dataset.theme = resolved(c);
    root.dataset.themeChoice = c;
    const button = document.getElementById("theme-toggle");
    if (button) {
      button.textContent = { auto: "◐ auto", dark: "☾ dark", light: "☀ light" }[c] || c;
      button.title = "theme: " + c + " (click or press t to change; auto follows the system)";
    }
    chartColours();
    if (rerender) window.dispatchEvent(new HashChangeEvent("hashchange")); // redraw the charts in the new colours
  }

  function cycle() {
    const next = { auto: "dark", dark: "light", light: "auto" }[choice()] || "auto";
    try { localStorage.setItem(STORE, next); } catch (_) { /* private mode: this page only */ root.dataset.theme = resolved(next); }
    apply(true);
  }

  const KEYS = [["j", "next rollout of this group"], ["k", "previous rollout of this group"], ["g", "this rollout's group"],
    ["b", "best of this step"], ["w", "worst of this step"], ["t", "switch theme"], ["e", "show or fold every long text"], ["?", "show or hide these keys"]];

  function help() {
    let box = document.getElementById("key-help");
    if (box) { box.remove(); return; }
    box = document.createElement("div");
    box.id = "key-help";
    box.setAttribute("data-testid", "key-help");
    box.setAttribute("role", "dialog");
    const title = document.createElement("strong");
    title.textContent = "Keys";
    box.append(title);
    const list = document.createElement("dl");
    for (const [key, what] of KEYS) {
      const dt = document.createElement("dt");
      const kbd = document.createElement("kbd");
      kbd.textContent = key;
      dt.append(kbd);
      const dd = document.createElement("dd");
      dd.textContent = what;
      list.append(dt, dd);
    }
    box.append(list);
    box.addEventListener("click", () => box.remove());
    document.body.append(box);
  }

  function follow(name) {
    const link = document.querySelector("[data-key='" + name + "']");
    if (!link || !link.getAttribute("href")) return false;
    location.hash = link.getAttribute("href").replace(/^#/, "");
    return true;
  }

  function press(name) {
    const button = document.querySelector("button[data-key='" + name + "']");
    if (!button) return false;
    button.click();
    return true;
  }

  function onKey(e) {
    if (e.ctrlKey || e.metaKey || e.altKey || e.defaultPrevented) return;
    const target = e.target;
    if (target && (target.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(target.tagName))) return;
    const actions = { j: () => follow("next"), k: () => follow("prev"), g: () => follow("group"), b: () => follow("best"),
      w: () => follow("worst"), t: () => { cycle(); return true; }, e: () => press("fold-all"), "?": () => { help(); return true; },
      Escape: () => { const box = document.getElementById("key-help"); if (box) box.remove(); return Boolean(box); } };
    const act = actions[e.key];
    if (act && act()) e.preventDefault();
  }

  apply(false);
  if (media && media.addEventListener) media.addEventListener("change", () => { if (choice() === "auto") apply(true); });
  document.addEventListener("keydown", onKey);
  document.addEventListener("DOMContentLoaded", () => {
    const button = document.getElementById("theme-toggle");
    if (button) button.addEventListener("click", cycle);
    const keys = document.getElementById("keys-hint");
    if (keys) keys.addEventListener("click", help);
    apply(false);
  });
})();
