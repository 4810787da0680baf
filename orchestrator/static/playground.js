// The playground's script: streams /v1/chat/completions and shades each committed round by
// origin from the `specdec` extension of every chunk (spans of [characters, drafted]).
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("token").value) h.Authorization = "Bearer " + $("token").value;
  return h;
}

async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (!r.ok) {
    $("model").textContent = r.status === 401 ? "enter the API token" : "model unknown (" + r.status + ")";
    return null;
  }
  const name = (await r.json()).data[0].id;
  $("model").textContent = name;
  return name;
}

function number(id) {
  return Number($(id).value);
}

function requestBody(model) {
  const body = {
    model,
    messages: [{ role: "user", content: $("prompt").value }],
    max_tokens: number("max_tokens"),
    temperature: number("temperature"),
    top_p: number("top_p"),
    stream: true,
    speculation: {
      lookahead: number("lookahead"),
      adaptive: $("adaptive").checked,
      disabled: $("disabled").checked,
      rule: $("rule").value,
    },
  };
  // A tree's accepted path is a round's drafted span, shaded as a chain's accepted drafts are.
  if (number("tree_nodes") > 0) body.speculation.tree_nodes = number("tree_nodes");
  if (number("seed") > 0) body.seed = number("seed");
  // Structured output: the reply follows the schema (OpenAI's response_format), the draft too.
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try {
      parsed = JSON.parse(schema);
    } catch (err) {
      throw new Error("JSON schema: " + err.message);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed, strict: true } };
  }
  return body;
}

// Shading: a round is its accepted drafts' span, if any, then the target's span.
class Reply {
  constructor(el) {
    this.el = el;
    this.round = null;
  }
  add(text, spans) {
    const chars = Array.from(text); // span lengths count code points
    let at = 0;
    for (const [length, drafted] of spans) {
      if (!this.round) {
        this.round = document.createElement("span");
        this.round.className = "round";
        this.el.appendChild(this.round);
      }
      const piece = document.createElement("span");
      piece.className = drafted ? "drafted" : "target";
      piece.textContent = chars.slice(at, at + length).join("");
      this.round.appendChild(piece);
      at += length;
      if (!drafted) this.round = null;
    }
  }
}

class Stats {
  constructor() {
    this.rounds = this.tokens = this.drafts = this.accepted = 0;
    this.start = performance.now();
  }
  add(ext) {
    this.rounds += ext.round_counts.rounds;
    this.drafts += ext.round_counts.draft_tokens;
    this.accepted += ext.round_counts.accepted_tokens;
    this.tokens += ext.tokens;
    const seconds = (performance.now() - this.start) / 1000;
    this.show(this.drafts ? this.accepted / this.drafts : null, this.rounds ? this.tokens / this.rounds : null,
      seconds > 0 ? this.tokens / seconds : null);
  }
  final(ext) {
    this.rounds = ext.rounds;
    this.show(ext.draft_tokens ? ext.acceptance_rate : null, ext.mean_accepted_length, ext.tokens_per_second);
  }
  show(acceptance, perRound, tps) {
    $("stat-rounds").textContent = this.rounds;
    $("stat-tokens").textContent = this.tokens;
    $("stat-acceptance").textContent = acceptance === null ? "–" : (100 * acceptance).toFixed(1) + " %";
    $("stat-per-round").textContent = perRound === null ? "–" : perRound.toFixed(2);
    $("stat-tps").textContent = tps === null ? "–" : tps.toFixed(1);
  }
}

// Server-sent events from a fetch body: events end with a blank line; we read `data:` lines.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

async function generate(event) {
  event.preventDefault();
  const replyEl = $("reply");
  replyEl.textContent = "";
  replyEl.dataset.state = "streaming";
  $("error").textContent = "";
  $("send").disabled = true;
  $("stop").disabled = false;
  controller = new AbortController();
  const reply = new Reply(replyEl);
  const stats = new Stats();
  stats.show(null, null, null);
  try {
    const model = await loadModel();
    if (!model) throw new Error("GET /v1/models failed: " + $("model").textContent);
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(model)), signal: controller.signal,
    });
    if (!r.ok) throw new Error(r.status + ": " + (await r.json()).error.message);
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      reply.add(choice.delta.content || "", chunk.specdec.spans);
      stats.add(chunk.specdec);
      if (choice.finish_reason) stats.final(chunk.specdec);
    }
    replyEl.dataset.state = "done";
  } catch (err) {
    replyEl.dataset.state = err.name === "AbortError" ? "stopped" : "error";
    if (err.name !== "AbortError") $("error").textContent = String(err.message || err);
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
loadModel();
