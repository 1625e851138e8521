// prima's web page: a chat over /v1/chat/completions (streamed) and the cluster from /v1/cluster.
// Plain browser JavaScript, no libraries: it is served as it is, with nothing fetched from elsewhere.
"use strict";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

// An element with properties (class, text, data-*, aria-*) and children; text only, never HTML.
function el(tag, props = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v == null) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-") || k.startsWith("aria-") || k === "role") e.setAttribute(k, v);
    else e[k] = v;
  }
  e.append(...children.flat(Infinity).filter((c) => c != null));
  return e;
}

const GiB = 2 ** 30;
const MiB = 2 ** 20;
const bytes = (n) => (n >= GiB ? `${(n / GiB).toFixed(2)} GiB` : `${(n / MiB).toFixed(1)} MiB`);
const ms = (t) => (t == null ? "–" : t >= 10000 ? `${(t / 1000).toFixed(1)} s` : `${t.toFixed(t < 10 ? 2 : 1)} ms`);
const perS = (n, unit) => (n >= 1e9 ? `${(n / 1e9).toFixed(1)} G${unit}/s` : `${(n / 1e6).toFixed(0)} M${unit}/s`);
const win = ([a, b]) => `[${a},${b})`;

// --- the API key -------------------------------------------------------------------------------

// A server started with an API key wants it on every call but /health; the page keeps it in this
// browser's localStorage, never in the page or a URL.
const KEY_STORE = "prima.apiKey";

function storedKey() {
  try {
    return localStorage.getItem(KEY_STORE) ?? "";
  } catch {
    return ""; // storage disabled: the key lives in the field only
  }
}

function apiHeaders(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The message for a failed call; a 401 opens the key field.
async function failure(resp) {
  if (resp.status === 401) {
    $("key-box").open = true;
    return "the server needs its API key: enter it under “API key”";
  }
  const err = await resp.json().catch(() => null);
  return err?.error?.message ?? `the server answered ${resp.status}`;
}

$("api-key").value = storedKey();
$("api-key").addEventListener("change", () => {
  try {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
  } catch {
    // storage disabled: the key still works for this page
  }
  refreshCluster();
});

// --- chat --------------------------------------------------------------------------------------

const history = []; // the conversation as the API takes it: {role, content}
let controller = null; // aborts the running request (the Stop button)

function addMessage(role, text) {
  const body = el("div", { class: "text", text });
  const meta = el("div", { class: "meta" });
  const box = el("article", { class: `message ${role}`, "aria-label": role }, body, meta);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, body, meta };
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("chat-status").textContent = busy ? "generating…" : "";
}

function samplingFields() {
  const out = {};
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    const value = $(name).value.trim();
    if (value !== "") out[name] = Number(value);
  }
  return out;
}

// The `data:` events of a Server-Sent Events body, parsed, up to `[DONE]`.
async function* sseEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function replySummary(usage, finish, t0, tFirst, tEnd) {
  const parts = [];
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  const cached = usage?.prompt_tokens_details?.cached_tokens;
  if (cached) parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  if (finish) parts.push(finish === "length" ? "cut at max tokens" : "done");
  if (tFirst != null) parts.push(`first text after ${ms(tFirst - t0)}`);
  if (usage && usage.completion_tokens > 1 && tFirst != null) {
    parts.push(`${ms((tEnd - tFirst) / (usage.completion_tokens - 1))}/token here`);
  }
  return parts.join(" · ");
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.box.setAttribute("aria-busy", "true");
  controller = new AbortController();
  setBusy(true);
  const request = { messages: history, stream: true, stream_options: { include_usage: true }, ...samplingFields() };
  const t0 = performance.now();
  let tFirst = null;
  let usage = null;
  let finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: apiHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await failure(resp));
    for await (const event of sseEvents(resp.body)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices?.[0];
      if (choice?.delta?.content) {
        tFirst ??= performance.now();
        reply.body.textContent += choice.delta.content;
      }
      if (choice?.finish_reason) finish = choice.finish_reason;
    }
    reply.meta.textContent = replySummary(usage, finish, t0, tFirst, performance.now());
  } catch (err) {
    if (err.name === "AbortError") {
      reply.meta.textContent = "stopped";
    } else {
      reply.box.classList.add("error");
      reply.meta.textContent = `error: ${err.message}`;
    }
  } finally {
    // What was said stays in the conversation, a stopped reply too; a failed turn is taken back.
    if (reply.body.textContent) history.push({ role: "assistant", content: reply.body.textContent });
    else history.pop();
    reply.box.removeAttribute("aria-busy");
    controller = null;
    setBusy(false);
    refreshCluster();
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("reset").addEventListener("click", () => {
  controller?.abort();
  history.length = 0;
  $("messages").replaceChildren();
});

// --- cluster -----------------------------------------------------------------------------------

function summary(view) {
  const m = view.measured;
  const parts = [];
  if (view.mode !== "none") {
    const where = view.mode === "local" ? "this device" : `${view.nodes.length} node(s)`;
    parts.push(`${view.n_layers} layers on ${where}, ${view.rounds} round(s), plan epoch ${view.plan_epoch}`);
  }
  parts.push(`predicted ${ms(view.predicted_ms_per_token)}/token`);
  parts.push(`measured ${ms(m.ms_per_token)}/token over ${m.requests} request(s)`);
  if (m.last) parts.push(`last request ${ms(m.last.ms_per_token)}/token`);
  return parts.join(" · ");
}

function memory(r) {
  if (!r) return "no layers loaded";
  const budget = r.budget_bytes ? bytes(r.budget_bytes) : "no limit";
  const meter = el("meter", { min: 0, max: r.owned_bytes || 1, value: r.resident_bytes, "aria-hidden": "true" });
  const text = `${bytes(r.resident_bytes)} resident of ${bytes(r.owned_bytes)} · budget ${budget}`;
  if (!(r.budget_bytes && r.budget_bytes < r.owned_bytes)) return [meter, ` ${text}`];
  return [meter, ` ${text} · streaming: ${r.pinned_layers} layers pinned, ${bytes(r.bytes_read)} read`];
}

function device(d) {
  if (!d) return "not profiled (a plan given by hand)";
  // What Halda planned with: the RAM left free, or, under --mem-budget, the budget scaled to hold
  // each layer's KV cache too (and the head's embedding and output head).
  const parts = [d.os, `RAM: Halda plans with ${bytes(d.ram_available_bytes)} of ${bytes(d.ram_total_bytes)}`];
  if (d.disk_read_bytes_per_s) parts.push(`disk ${perS(d.disk_read_bytes_per_s, "B")}`);
  if (d.mem_bandwidth_bytes_per_s) parts.push(`memory ${perS(d.mem_bandwidth_bytes_per_s, "B")}`);
  const flops = Object.entries(d.cpu_gflops);
  if (flops.length) parts.push(`CPU ${flops.map(([f, g]) => `${f} ${g.toFixed(1)}`).join(", ")} GFLOP/s`);
  if (d.accelerator) parts.push(d.accelerator);
  if (d.next_hop_ms) parts.push(`link to next ${ms(d.next_hop_ms)}`);
  return parts.join(" · ");
}

function nodeCard(n) {
  const r = n.residency;
  const rows = [
    ["windows", n.windows.map((w, i) => `round ${i + 1}: ${win(w)}`).join(" · "), "windows"],
    ["memory", memory(r)],
    ["device", device(n.device)],
  ];
  // Per decode token: the sum of this node's hop rows; disk waits are counted over every token.
  const perToken = [
    ["predicted", n.predicted_ms_per_token],
    ["computed", n.compute_ms_per_token],
    ["sent", n.relay_ms_per_token],
  ].filter(([, t]) => t != null);
  if (perToken.length) rows.push(["per token", perToken.map(([what, t]) => `${what} ${ms(t)}`).join(" · ")]);
  if (n.wait_ms_per_token) rows.push(["disk waits", `${ms(n.wait_ms_per_token)} per token (prompt and generated)`]);
  if (r && (r.compute_ms || r.wait_ms || r.read_ms)) {
    rows.push(["in all", `computed ${ms(r.compute_ms)} · waited ${ms(r.wait_ms)} · read ${ms(r.read_ms)}`]);
  }
  if (n.error) rows.push(["error", n.error, "error"]);
  return el(
    "article",
    { class: `node${n.answering ? "" : " down"}`, "data-node": n.node_id, "aria-label": `node ${n.node_id}` },
    el("h3", {}, n.node_id, " ", el("span", { class: "badge", text: n.role }), " ", el("span", { class: "state", text: n.status })),
    el("p", { class: "muted", text: n.address }),
    el("dl", {}, rows.map(([term, value, cls]) => [el("dt", { text: term }), el("dd", { class: cls }, value)])),
  );
}

function hopItem(h) {
  const parts = [`${h.node_id} ${win(h.window)}`];
  if (h.predicted_ms != null) parts.push(`predicted ~${ms(h.predicted_ms)}`);
  if (h.compute_ms != null) {
    parts.push(`measured ${ms(h.compute_ms)} compute + ${ms(h.relay_ms)} send per token (${h.measured_steps} steps)`);
  }
  return el("li", { class: "hop", "data-hop": `${h.node_id} ${win(h.window)}`, text: parts.join(" · ") });
}

function render(view) {
  $("model").textContent = `${view.model} · ${view.mode === "ring" ? "ring" : view.mode === "local" ? "this device" : "server"}`;
  $("summary").textContent = summary(view);
  $("hops").replaceChildren(...view.hops.map(hopItem));
  $("nodes").replaceChildren(...view.nodes.map(nodeCard));
  $("dropped-box").hidden = view.dropped.length === 0;
  $("dropped").replaceChildren(...view.dropped.map((d) => el("li", { text: `${d.node_id}: ${d.reason}` })));
  const failures = [...view.failures].reverse(); // newest first
  $("failures").replaceChildren(
    ...(failures.length
      ? failures.map((f) =>
          el("li", {}, el("time", { text: new Date(f.unix_s * 1000).toLocaleTimeString() }), ` ${f.message}`),
        )
      : [el("li", { class: "muted", text: "none" })]),
  );
}

async function refreshCluster() {
  try {
    const resp = await fetch("/v1/cluster", { cache: "no-store", headers: apiHeaders() });
    if (!resp.ok) throw new Error(await failure(resp));
    render(await resp.json());
  } catch (err) {
    $("summary").textContent = `cannot read the cluster: ${err.message}`;
  }
}

async function poll() {
  if (!document.hidden) await refreshCluster();
  setTimeout(poll, POLL_MS);
}
poll();
