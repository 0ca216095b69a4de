// The tokenmill dashboard: one server-sent event stream in, canvases and numbers out.
// The server sends each record once (steps, latency observations, finished requests) and its
// cumulative totals; everything over a window (rates, percentiles, goodput) is computed here.
"use strict";

const MAX_KEEP_SECONDS = 300;
const PERCENTILES = [50, 90, 95, 99];
const COLORS = Object.fromEntries(
  ["prefill", "decode", "batch", "steptime", "used", "cached", "free", "waiting", "line", "dim"]
    .map((name) => [name, getComputedStyle(document.documentElement).getPropertyValue(`--${name}`).trim()]),
);

const state = {
  setup: null,
  windowSeconds: 60,
  slo: {},
  now: 0,
  steps: [],     // [time, seconds, prefill, decode, num_reqs, k, num_preempted]
  ttft: [],      // [time, seconds]
  itl: [],       // [time, seconds]
  finished: [],  // [time, ttft, tpot, e2e, queue_time, num_output_tokens]
  kv_transfers: [],  // [time, request_id, direction, bytes, seconds, error, reason]
  ticks: [],     // {now, totals, queues}
  last: null,
};

const $ = (id) => document.getElementById(id);

function show(id, value, text) {
  const el = $(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text ?? (value === null || value === undefined ? "–" : String(value));
}

const fmt = {
  int: (v) => (v === null ? "–" : Math.round(v).toLocaleString("en-US")),
  num: (v, digits = 1) => (v === null ? "–" : v.toFixed(digits)),
  pct: (v) => (v === null ? "–" : `${(100 * v).toFixed(1)}%`),
  ms: (v) => (v === null ? "–" : (1000 * v).toFixed(v < 0.01 ? 2 : 1)),
};

// numpy's default (linear) percentile of sorted values.
function percentile(sorted, p) {
  if (!sorted.length) return null;
  const rank = (p / 100) * (sorted.length - 1);
  const lo = Math.floor(rank), hi = Math.ceil(rank);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo);
}

const inWindow = (records) => {
  const start = state.now - state.windowSeconds;
  return records.filter((r) => r[0] >= start);
};
const sortedValues = (values) => values.filter((v) => v !== null).sort((a, b) => a - b);

// Change of a cumulative total over the window (null until there are two ticks in it).
function windowDelta(get) {
  const start = state.now - state.windowSeconds;
  const first = state.ticks.find((t) => t.now >= start);
  const last = state.ticks[state.ticks.length - 1];
  if (!first || first === last) return null;
  const a = get(first.totals), b = get(last.totals);
  if (a === undefined || b === undefined || a === null || b === null) return null;
  return { value: b - a, seconds: last.now - first.now };
}

// ---- the stream -------------------------------------------------------------------------

function connect() {
  const source = new EventSource("/dashboard/events");
  source.addEventListener("setup", (e) => onSetup(JSON.parse(e.data)));
  source.addEventListener("update", (e) => onUpdate(JSON.parse(e.data)));
  // "live" once numbers arrive, not when the connection opens: until the first update the
  // page has nothing to show, and must not claim otherwise.
  source.onerror = () => setConnection("lost");
}

function setConnection(status) {
  const el = $("connection");
  if (el.dataset.state === status) return;
  el.dataset.state = status;
  el.textContent = status === "live" ? "live" : "reconnecting";
}

function onSetup(setup) {
  // A reconnect starts a fresh feed that sends the window's history again.
  Object.assign(state, { setup, steps: [], ttft: [], itl: [], finished: [], kv_transfers: [], ticks: [] });
  $("model").textContent = setup.model;
  $("weights").textContent = setup.weight_format ? `weights ${setup.weight_format}` : "";
  $("budget").textContent = setup.max_num_batched_tokens;
  for (const name of ["ttft", "tpot", "e2el"]) {
    const input = $(`slo-${name}`);
    if (!input.dataset.touched && setup.slo[name] !== undefined) {
      input.value = String(+(1000 * setup.slo[name]).toFixed(3));
    }
  }
  readSlo();
  $("spec-on").hidden = !setup.speculative;
  $("spec-off").hidden = !!setup.speculative;
  $("kv-transfer-on").hidden = !setup.kv_transfer;
  $("kv-transfer-off").hidden = !!setup.kv_transfer;
  $("kv-transfer-role").textContent = setup.kv_transfer
    ? `${setup.kv_transfer.connector}, ${setup.kv_transfer.role}` : "";
}

function onUpdate(update) {
  state.now = update.now;
  for (const name of ["steps", "ttft", "itl", "finished", "kv_transfers"]) {
    const records = update[name] || [];
    for (const r of records) state[name].push(r);
    const start = update.now - MAX_KEEP_SECONDS;
    const firstKept = state[name].findIndex((r) => r[0] >= start);
    state[name].splice(0, firstKept < 0 ? state[name].length : firstKept);
  }
  state.ticks.push({ now: update.now, totals: update.totals, queues: update.queues });
  while (state.ticks.length && state.ticks[0].now < update.now - MAX_KEEP_SECONDS) state.ticks.shift();
  state.last = update;
  setConnection("live");
  render();
}

// ---- panels -----------------------------------------------------------------------------

function render() {
  renderSteps();
  renderKv();
  renderQueues();
  renderLatency();
  renderSpec();
  renderKvTransfer();
}

function renderSteps() {
  const steps = inWindow(state.steps);
  const totals = state.last.totals;
  $("steps-empty").hidden = steps.length > 0;
  $("steps-empty").textContent = "No steps in this window: the engine is idle.";
  show("steps-per-second", steps.length / state.windowSeconds, fmt.num(steps.length / state.windowSeconds));
  const stepTimes = sortedValues(steps.map((s) => s[1]));
  const p50 = percentile(stepTimes, 50);
  show("step-time-p50", p50, p50 === null ? "–" : `${fmt.ms(p50)} ms`);
  const lastStep = state.steps[state.steps.length - 1];
  const batch = lastStep && lastStep[0] >= state.now - 1 ? lastStep[4] : 0;
  show("batch-size", batch);
  const prompt = windowDelta((t) => t.prompt_tokens);
  const generation = windowDelta((t) => t.generation_tokens);
  const rate = (d) => (d && d.seconds > 0 ? d.value / d.seconds : null);
  show("prompt-tps", rate(prompt), fmt.num(rate(prompt)));
  show("generation-tps", rate(generation), fmt.num(rate(generation)));
  show("total-prompt-tokens", totals.prompt_tokens, fmt.int(totals.prompt_tokens));
  show("total-generation-tokens", totals.generation_tokens, fmt.int(totals.generation_tokens));
  drawStepStrip($("step-strip"), steps);
  drawStepLines($("step-lines"), steps);
}

function renderKv() {
  const kv = state.last.kv;
  const totals = state.last.totals;
  const usage = kv.num_used / kv.num_blocks;
  show("kv-usage", usage, fmt.pct(usage));
  show("kv-used", kv.num_used, `${fmt.int(kv.num_used)} / ${fmt.int(kv.num_blocks)}`);
  show("kv-cached", kv.num_cached_free, fmt.int(kv.num_cached_free));
  const free = kv.num_blocks - kv.num_used - kv.num_cached_free;
  show("kv-free", free, fmt.int(free));
  const hitRate = totals.prefix_cache_queries ? totals.prefix_cache_hits / totals.prefix_cache_queries : null;
  show("prefix-hit-rate", hitRate, state.setup.prefix_caching ? fmt.pct(hitRate) : "off");
  const hits = windowDelta((t) => t.prefix_cache_hits);
  const queries = windowDelta((t) => t.prefix_cache_queries);
  const windowRate = hits && queries && queries.value > 0 ? hits.value / queries.value : null;
  show("prefix-hit-rate-window", windowRate, fmt.pct(windowRate));
  show("kv-swapped", kv.num_swapped,
    kv.num_swap_blocks ? `${fmt.int(kv.num_swapped)} / ${fmt.int(kv.num_swap_blocks)}` : "no swap space");
  drawBlockMap($("block-map"), kv.block_map);
}

function renderQueues() {
  const q = state.last.queues;
  show("queue-running", q.running);
  show("queue-waiting", q.waiting);
  show("queue-swapped", q.swapped);
  const queueTimes = sortedValues(inWindow(state.finished).map((f) => f[4]));
  for (const p of [50, 95]) {
    const v = percentile(queueTimes, p);
    show(`queue-time-p${p}`, v, v === null ? "–" : `${fmt.ms(v)} ms`);
  }
  const preempted = inWindow(state.steps).reduce((sum, s) => sum + s[6], 0);
  const perMinute = (preempted * 60) / state.windowSeconds;
  show("preemptions-per-minute", perMinute, fmt.num(perMinute));
  show("total-preemptions", state.last.totals.preemptions, fmt.int(state.last.totals.preemptions));
  drawQueueLines($("queue-lines"));
}

function renderLatency() {
  const finished = inWindow(state.finished);
  const series = [
    ["TTFT", inWindow(state.ttft).map((o) => o[1])],
    ["ITL", inWindow(state.itl).map((o) => o[1])],
    ["TPOT", finished.map((f) => f[2])],
    ["E2E", finished.map((f) => f[3])],
    ["Queue", finished.map((f) => f[4])],
  ];
  $("latency-rows").innerHTML = series.map(([name, values]) => {
    const sorted = sortedValues(values);
    const cells = PERCENTILES.map((p) => {
      const v = percentile(sorted, p);
      return `<td data-value="${v ?? ""}">${fmt.ms(v)}</td>`;
    }).join("");
    return `<tr id="latency-${name.toLowerCase()}"><td>${name}</td>${cells}<td data-value="${sorted.length}">${sorted.length}</td></tr>`;
  }).join("");
  $("latency-empty").hidden = finished.length > 0;
  $("latency-empty").textContent = "No requests finished in this window.";
  const requestRate = finished.length / state.windowSeconds;
  show("request-rate", requestRate, fmt.num(requestRate, 2));
  show("total-finished", state.last.totals.finished_requests, fmt.int(state.last.totals.finished_requests));
  if (!Object.keys(state.slo).length) {
    show("goodput", null, "set an SLO");
    show("within-slo", null);
    return;
  }
  const good = finished.filter(meetsSlo).length;
  show("goodput", good / state.windowSeconds, `${fmt.num(good / state.windowSeconds, 2)} req/s`);
  const share = finished.length ? good / finished.length : null;
  show("within-slo", share, fmt.pct(share));
}

// As `tokenmill bench serve --goodput`: every SLO met, a request without TPOT meets a TPOT SLO.
function meetsSlo(f) {
  const values = { ttft: f[1], tpot: f[2] ?? 0, e2el: f[3] };
  return Object.entries(state.slo).every(([name, slo]) => values[name] !== null && values[name] <= slo);
}

function renderSpec() {
  if (!state.setup.speculative) return;
  const totals = state.last.totals;
  const accepted = windowDelta((t) => t.spec_accepted_tokens);
  const drafted = windowDelta((t) => t.spec_draft_tokens);
  const rate = accepted && drafted && drafted.value > 0 ? accepted.value / drafted.value : null;
  show("spec-acceptance", rate, fmt.pct(rate));
  const total = totals.spec_draft_tokens ? totals.spec_accepted_tokens / totals.spec_draft_tokens : null;
  show("spec-acceptance-total", total, fmt.pct(total));
  const length = totals.spec_drafts ? 1 + totals.spec_accepted_tokens / totals.spec_drafts : null;
  show("spec-acceptance-length", length, fmt.num(length, 2));
  const steps = inWindow(state.steps);
  const lastStep = steps[steps.length - 1];
  show("spec-k", lastStep ? lastStep[5] : null);
  const meanK = steps.length ? steps.reduce((s, r) => s + r[5], 0) / steps.length : null;
  show("spec-k-mean", meanK, fmt.num(meanK, 2));
  drawSpecStrip($("spec-strip"), steps);
}

// ---- drawing ----------------------------------------------------------------------------

// The canvas's CSS size (dashboard.css gives each its height) in device pixels.
function renderKvTransfer() {
  if (!state.setup.kv_transfer) return;
  const transfers = inWindow(state.kv_transfers);
  const done = transfers.filter((t) => t[5] === null);
  const rows = [];
  for (const direction of ["send", "recv"]) {
    const mine = done.filter((t) => t[2] === direction);
    if (!mine.length) continue;
    const seconds = sortedValues(mine.map((t) => t[4]));
    const mb = sortedValues(mine.map((t) => t[3] / 1e6));
    rows.push(`<tr><th>${direction} ms</th><td>${fmt.ms(percentile(seconds, 50))}</td><td>${fmt.ms(percentile(seconds, 99))}</td><td>${seconds.length}</td></tr>`);
    rows.push(`<tr><th>${direction} MB</th><td>${fmt.num(percentile(mb, 50), 2)}</td><td>${fmt.num(percentile(mb, 99), 2)}</td><td>${mb.length}</td></tr>`);
  }
  $("kv-transfer-rows").innerHTML = rows.join("") || '<tr><td colspan="4" class="dim">no transfer in this window</td></tr>';
  const busy = done.reduce((sum, t) => sum + t[4], 0);
  const bytes = done.reduce((sum, t) => sum + t[3], 0);
  const rate = busy > 0 ? bytes / busy / 1e6 : null;
  show("kv-transfer-rate", rate, fmt.num(rate, 1));
  show("kv-transfer-failed", transfers.length - done.length);
  const totals = state.last.totals;
  const mb = (v) => (v === undefined ? null : v / 1e6);
  show("kv-total-loaded", mb(totals.kv_bytes_loaded), fmt.num(mb(totals.kv_bytes_loaded), 1));
  show("kv-total-sent", mb(totals.kv_bytes_sent), fmt.num(mb(totals.kv_bytes_sent), 1));
  show("kv-total-failed", totals.kv_failed_transfers);
  show("kv-total-expired", totals.kv_expired_requests);
}

function canvasContext(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.max(1, Math.round(width * ratio));
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

// Records of the window bucketed into one column per pixel: column -> records.
function columns(records, width) {
  const start = state.now - state.windowSeconds;
  const cols = Array.from({ length: Math.max(1, Math.floor(width)) }, () => []);
  for (const r of records) {
    const x = Math.min(cols.length - 1, Math.floor(((r[0] - start) / state.windowSeconds) * cols.length));
    if (x >= 0) cols[x].push(r);
  }
  return cols;
}

const mean = (values) => values.reduce((a, b) => a + b, 0) / values.length;

// Scaled to the window's busiest column, so a few decodes under a large budget still show.
function drawStepStrip(canvas, steps) {
  const { ctx, width, height } = canvasContext(canvas);
  if (!steps.length) return;  // the panel says the engine is idle; no scale for nothing
  const cols = columns(steps, width).map((col) => (col.length
    ? [mean(col.map((s) => s[2])), mean(col.map((s) => s[3]))] : null));
  const max = Math.max(1, ...cols.map((c) => (c ? c[0] + c[1] : 0)));
  cols.forEach((col, x) => {
    if (!col) return;
    const hp = (col[0] / max) * (height - TOP_BAND), hd = (col[1] / max) * (height - TOP_BAND);
    ctx.fillStyle = COLORS.decode;
    ctx.fillRect(x, height - hd, 1, hd);
    ctx.fillStyle = COLORS.prefill;
    ctx.fillRect(x, height - hd - hp, 1, hp);
  });
  label(ctx, `max ${Math.round(max)} tokens`, 2, 10);
}

// Text in the chart's top band (lines keep below it); returns where the next label can start.
function label(ctx, text, x, y, color = COLORS.dim) {
  ctx.fillStyle = color;
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(text, x, y);
  return x + ctx.measureText(text).width + 12;
}

const TOP_BAND = 14;

// Points are [x, value]; a gap wider than `maxGap` pixels (an idle engine) breaks the line.
function drawLine(ctx, points, color, height, max, maxGap = Infinity) {
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let lastX = -Infinity;
  for (const [x, v] of points) {
    const y = height - 2 - (v / max) * (height - TOP_BAND - 4);
    if (x - lastX <= maxGap) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    lastX = x;
  }
  ctx.stroke();
}

function drawStepLines(canvas, steps) {
  const { ctx, width, height } = canvasContext(canvas);
  if (!steps.length) return;
  const cols = columns(steps, width);
  const batch = [], times = [];
  cols.forEach((col, x) => {
    if (!col.length) return;
    batch.push([x, mean(col.map((s) => s[4]))]);
    times.push([x, Math.max(...col.map((s) => s[1]))]);
  });
  const maxBatch = Math.max(1, ...batch.map((p) => p[1]));
  const maxTime = Math.max(1e-3, ...times.map((p) => p[1]));
  const gap = Math.max(3, width / 60);  // idle for more than a second or so
  drawLine(ctx, batch, COLORS.batch, height, maxBatch, gap);
  drawLine(ctx, times, COLORS.steptime, height, maxTime, gap);
  const next = label(ctx, `max ${Math.round(maxBatch)} requests`, 2, 10, COLORS.batch);
  label(ctx, `max ${fmt.ms(maxTime)} ms`, next, 10, COLORS.steptime);
}

function drawQueueLines(canvas) {
  const { ctx, width, height } = canvasContext(canvas);
  const start = state.now - state.windowSeconds;
  const ticks = state.ticks.filter((t) => t.now >= start);
  const x = (t) => ((t.now - start) / state.windowSeconds) * width;
  const peak = Math.max(0, ...ticks.map((t) => Math.max(t.queues.running, t.queues.waiting)));
  const max = Math.max(1, peak);
  drawLine(ctx, ticks.map((t) => [x(t), t.queues.running]), COLORS.used, height, max);
  drawLine(ctx, ticks.map((t) => [x(t), t.queues.waiting]), COLORS.waiting, height, max);
  const next = label(ctx, peak ? `running (max ${peak})` : "running", 2, 10, COLORS.used);
  label(ctx, "waiting", next, 10, COLORS.waiting);
}

function drawBlockMap(canvas, map) {
  const { ctx, width, height } = canvasContext(canvas);
  const n = map.length;
  // The largest square cell that fits n cells in the canvas.
  let size = Math.floor(Math.sqrt((width * height) / n));
  while (size > 1 && Math.floor(width / size) * Math.floor(height / size) < n) size -= 1;
  const perRow = Math.max(1, Math.floor(width / size));
  const fills = { 0: COLORS.free, 1: COLORS.used, 2: COLORS.cached };
  const gap = size > 4 ? 1 : 0;
  for (let i = 0; i < n; i += 1) {
    ctx.fillStyle = fills[map[i]];
    ctx.fillRect((i % perRow) * size, Math.floor(i / perRow) * size, size - gap, size - gap);
  }
}

function drawSpecStrip(canvas, steps) {
  const { ctx, width, height } = canvasContext(canvas);
  const maxK = Math.max(1, state.setup.speculative.max_k);
  ctx.fillStyle = COLORS.cached;
  columns(steps, width).forEach((col, x) => {
    if (!col.length) return;
    const h = (mean(col.map((s) => s[5])) / maxK) * height;
    ctx.fillRect(x, height - h, 1, h);
  });
}

// ---- controls ---------------------------------------------------------------------------

function readSlo() {
  state.slo = {};
  for (const name of ["ttft", "tpot", "e2el"]) {
    const ms = parseFloat($(`slo-${name}`).value);
    if (ms > 0) state.slo[name] = ms / 1000;
  }
}

$("window").addEventListener("change", (e) => {
  state.windowSeconds = Number(e.target.value);
  if (state.last) render();
});
$("slo-form").addEventListener("input", (e) => {
  e.target.dataset.touched = "1";
  readSlo();
  if (state.last) render();
});
$("slo-form").addEventListener("submit", (e) => e.preventDefault());

connect();
