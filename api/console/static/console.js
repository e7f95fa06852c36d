// Twinkle console: keeps the API key in sessionStorage (this tab only), fetches server-rendered fragments with
// it as the X-API-Key header, and draws the metric charts as inline SVG. No framework, no network but this server.
"use strict";

const KEY = "twinkle.apiKey";
const $ = (id) => document.getElementById(id);

function apiKey() { return sessionStorage.getItem(KEY); }

function showSignIn(message) {
  $("sign-in").hidden = false;
  $("sign-out").hidden = true;
  $("refresh").hidden = true;
  $("view").replaceChildren();
  $("sign-in-error").textContent = message || "";
}

function route() {
  const m = location.hash.match(/^#\/runs\/(.+)$/);
  if (m) return "/console/fragments/runs/" + m[1];
  const u = location.hash.match(/^#\/usage(?:\?(.*))?$/);
  if (u) return "/console/fragments/usage" + (u[1] ? "?" + u[1] : "");
  return "/console/fragments/overview";
}

async function load() {
  if (!apiKey()) { showSignIn(); return; }
  $("sign-in").hidden = true;
  $("sign-out").hidden = false;
  $("refresh").hidden = false;
  const response = await fetch(route(), { headers: { "X-API-Key": apiKey() }, cache: "no-store" });
  if (response.status === 401) {
    sessionStorage.removeItem(KEY);
    showSignIn("That API key was not accepted.");
    return;
  }
  const view = $("view");
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error || message; } catch (e) { /* not JSON */ }
    const p = document.createElement("p");
    p.className = "error not-found";
    p.textContent = message;
    view.replaceChildren(p);
    document.body.dataset.loaded = route();
    return;
  }
  view.innerHTML = await response.text();  // server-rendered, every value escaped there
  view.querySelectorAll("figure.chart").forEach(setUpChart);
  view.querySelectorAll("select.usage-tenant").forEach((select) => select.addEventListener("change", () => {
    const query = new URLSearchParams({ days: select.dataset.days });
    if (select.value) query.set("key", select.value);
    location.hash = "#/usage?" + query;
  }));
  view.querySelectorAll("a[data-csv]").forEach((link) => link.addEventListener("click", downloadCsv));
  document.body.dataset.loaded = route();
}

// The CSV routes want the key as a header, which a plain link cannot send: fetch the file, hand it over as a blob.
async function downloadCsv(event) {
  event.preventDefault();
  const link = event.currentTarget;
  const response = await fetch(link.href, { headers: { "X-API-Key": apiKey() }, cache: "no-store" });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error || message; } catch (e) { /* not JSON */ }
    link.parentElement.append(Object.assign(document.createElement("span"), { className: "error", textContent: " " + message }));
    return;
  }
  const url = URL.createObjectURL(await response.blob());
  const save = Object.assign(document.createElement("a"), { href: url, download: link.dataset.csv });
  document.body.append(save);
  save.click();
  save.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function setUpChart(figure) {
  const data = JSON.parse(figure.dataset.chart);
  const select = figure.querySelector("select.metric");
  const draw = () => drawChart(figure.querySelector(".plot"), select.value, data.series[select.value] || []);
  select.addEventListener("change", draw);
  draw();
}

const SVG = "http://www.w3.org/2000/svg";
function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v) { return Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0) ? v.toExponential(2) : v.toPrecision(3); }

// One line chart: x = optimizer step, y = the metric; axes with min/max labels, a dot per step.
function drawChart(container, name, points) {
  const W = 800, H = 280, L = 64, R = 16, T = 16, B = 36;
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${name} per step`,
                          "data-metric": name, "data-points": String(points.length) });
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const sx = (x) => L + (x1 === x0 ? (W - L - R) / 2 : (x - x0) / (x1 - x0) * (W - L - R));
    const sy = (y) => T + (y1 === y0 ? (H - T - B) / 2 : (y1 - y) / (y1 - y0) * (H - T - B));
    svg.append(el("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
    svg.append(el("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
    svg.append(el("text", { x: L - 6, y: T + 4, "text-anchor": "end" }, fmt(y1)));
    svg.append(el("text", { x: L - 6, y: H - B, "text-anchor": "end" }, fmt(y0)));
    svg.append(el("text", { x: L, y: H - B + 16, "text-anchor": "middle" }, String(x0)));
    svg.append(el("text", { x: W - R, y: H - B + 16, "text-anchor": "end" }, String(x1)));
    svg.append(el("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle" }, "step"));
    const d = points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg.append(el("path", { class: "line", d }));
    for (const [x, y] of points) {
      const dot = el("circle", { class: "dot", cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 3 });
      dot.append(el("title", {}, `step ${x}: ${y}`));
      svg.append(dot);
    }
  }
  container.replaceChildren(svg);
}

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    $("api-key").value = "";
    load();
  });
  $("sign-out").addEventListener("click", () => { sessionStorage.removeItem(KEY); location.hash = "#/"; showSignIn(); });
  $("refresh").addEventListener("click", load);
  window.addEventListener("hashchange", load);
  load();
});
