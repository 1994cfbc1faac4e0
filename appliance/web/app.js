// The box's own page: plain JavaScript, no build step, no network beyond the box itself.
// Talk: the microphone as PCM16 at 24 kHz over an OpenAI Realtime session (/v1/realtime, GA events):
// the box's interpreter session (its speech pipeline hears, translates and speaks each turn:
// response.output_audio.delta), or a transcription session whose turns the page translates (/translate)
// and has said (/v1/audio/speech).
// Type: /translate (LibreTranslate's route) and /v1/audio/speech; Status: /status and /v2/health/ready.
"use strict";

const RATE = 24000; // the Realtime API's PCM16 rate, both ways
const SEND_EVERY = RATE / 10; // samples per input_audio_buffer.append: 100 ms
const STATUS_EVERY_MS = 5000;
const $ = (id) => document.getElementById(id);

// what a test (or a curious operator in the console) can read back
const page = (window.appliancePage = { languages: [], voices: [], events: [], playedSamples: 0, status: null });

function say(id, text, kind = "info") {
  const element = $(id);
  element.textContent = text;
  element.className = `message ${text ? kind : ""}`;
}

// --- the box's routes ---------------------------------------------------------------------------

async function call(path, options) {
  let response;
  try {
    response = await fetch(path, keyed(options));
  } catch (exc) {
    throw new Error(`the box does not answer (${exc.message})`);
  }
  return checked(response);
}

// A room's client secret (traded for the PIN the operator handed out, `/?room=PIN`): sent as the key of
// every call, and as a WebSocket subprotocol (a browser cannot set a WebSocket's headers).
function keyed(options = {}) {
  if (!page.secret) return options;
  return { ...options, headers: { ...(options.headers || {}), Authorization: `Bearer ${page.secret}` } };
}

async function joinRoom() {
  const pin = new URLSearchParams(location.search).get("room");
  if (!pin) return;
  $("room-pin").value = pin;
  try {
    const body = JSON.stringify({ room: pin });
    const secret = await json("/v1/realtime/client_secrets", { method: "POST", headers: { "content-type": "application/json" }, body });
    page.secret = secret.value;
    page.room = secret.session.model;
    say("room-message", `In the room until ${new Date(secret.expires_at * 1000).toLocaleTimeString()}.`);
  } catch (exc) {
    say("room-message", `The room PIN was refused: ${exc.message}`, "error");
  }
}

async function checked(response) {
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    if ((response.headers.get("content-type") || "").includes("json")) {
      const doc = await response.json();
      message = typeof doc.error === "string" ? doc.error : doc.error?.message || message;
    }
    throw new Error(message);
  }
  return response;
}

const json = async (path, options) => (await call(path, options)).json();

function languageName(code) {
  return page.languages.find((l) => l.code === code)?.name || code;
}

function voiceFor(language) {
  return page.voices.find((v) => v.language === language || v.language.split(/[-_]/)[0] === language);
}

function voiceNames() {
  return page.voices.map((v) => `${languageName(v.language)} (${v.voice})`).join(", ") || "none";
}

// Voices from every model that speaks, whatever its kind: /v1/audio/voices lists each with its language and model.
async function loadModels() {
  const [{ models }, { voices }] = await Promise.all([json("/v2/models"), json("/v1/audio/voices")]);
  const described = (kind) =>
    Promise.all(models.filter((m) => m.kind === kind).map((m) => json(`/v2/models/${encodeURIComponent(m.name)}`)));
  const listeners = await described("speech_to_text");
  page.voices = voices.filter((v) => v.language).map((v) => ({ model: v.model, voice: v.name, language: v.language }));
  page.listeners = listeners.map((m) => ({ model: m.name, multilingual: Boolean(m.parameters?.multilingual) }));
  page.pipelines = models.filter((m) => m.kind === "speech_pipeline").map((m) => m.name);
  page.kinds = Object.fromEntries(models.map((m) => [m.name, m.kind]));
}

// The speech model that hears `language`: the first for English, else the first multilingual one.
function listenerFor(language) {
  return (page.listeners || []).find((l) => l.multilingual || language === "en");
}

function fillPair(sourceId, targetId) {
  const source = $(sourceId);
  const target = $(targetId);
  const options = (select, codes) => {
    const keep = select.value;
    select.replaceChildren(...codes.map((code) => new Option(languageName(code), code)));
    if (codes.includes(keep)) select.value = keep;
  };
  const targets = () => options(target, page.languages.find((l) => l.code === source.value)?.targets || []);
  const spoken = page.voices.map((v) => v.language.split(/[-_]/)[0]);
  options(source, [...new Set([...page.languages.filter((l) => l.targets.length).map((l) => l.code), ...spoken])]);
  source.addEventListener("change", targets);
  targets();
}

// --- sound out: PCM16 pieces played one after another ------------------------------------------

class Player {
  constructor() {
    this.context = null;
    this.next = 0;
  }

  open() {
    this.context ??= new AudioContext();
    this.context.resume();
  }

  play(samples, rate) {
    this.open();
    const buffer = this.context.createBuffer(1, samples.length, rate);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < samples.length; i++) channel[i] = samples[i] / 32768;
    const node = this.context.createBufferSource();
    node.buffer = buffer;
    node.connect(this.context.destination);
    this.next = Math.max(this.next, this.context.currentTime + 0.05);
    node.start(this.next);
    this.next += buffer.duration;
    page.playedSamples += samples.length;
  }

  stop() {
    this.context?.close();
    this.context = null;
    this.next = 0;
  }
}

const player = new Player();

// Whole samples out of a byte stream whose pieces may split one.
function pcmReader(onSamples) {
  let carry = new Uint8Array(0);
  return (bytes) => {
    const all = new Uint8Array(carry.length + bytes.length);
    all.set(carry);
    all.set(bytes, carry.length);
    const whole = all.length - (all.length % 2);
    carry = all.slice(whole);
    if (whole) onSamples(new Int16Array(all.buffer.slice(0, whole)));
  };
}

async function speak(text, language, messageId) {
  const voice = voiceFor(language);
  if (!voice) {
    say(messageId, `This box has no voice for ${languageName(language)} (its voices: ${voiceNames()}).`, "error");
    return;
  }
  if (!text.trim()) {
    say(messageId, "There is no text to say.", "error");
    return;
  }
  player.open();
  say(messageId, `Speaking in ${languageName(language)}…`);
  try {
    const response = await call("/v1/audio/speech", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: voice.model, voice: voice.voice, input: text, response_format: "pcm" }),
    });
    const rate = Number(response.headers.get("x-sample-rate")) || 22050;
    const feed = pcmReader((samples) => player.play(samples, rate));
    const reader = response.body.getReader();
    for (let piece = await reader.read(); !piece.done; piece = await reader.read()) feed(piece.value);
    say(messageId, "");
  } catch (exc) {
    say(messageId, `Could not speak: ${exc.message}`, "error");
  }
}

// --- Type ---------------------------------------------------------------------------------------

async function translateText() {
  const q = $("text-input").value;
  const source = $("text-source").value;
  const target = $("text-target").value;
  if (!q.trim()) return say("text-message", "Type something first.", "error");
  say("text-message", "Translating…");
  $("speak-output").disabled = true;
  try {
    const doc = await json("/translate", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ q, source, target, format: "text" }),
    });
    $("text-output").textContent = doc.translatedText;
    $("text-output").lang = target;
    $("speak-output").disabled = false;
    say("text-message", "");
  } catch (exc) {
    say("text-message", `Could not translate: ${exc.message}`, "error");
  }
}

// --- Talk: the Realtime interpreter session -------------------------------------------------------

function samplesOf(base64) {
  const text = atob(base64);
  const bytes = new Uint8Array(text.length - (text.length % 2));
  for (let i = 0; i < bytes.length; i++) bytes[i] = text.charCodeAt(i);
  return new Int16Array(bytes.buffer);
}

function base64Of(int16) {
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

class Interpreter {
  constructor() {
    this.socket = null;
    this.microphone = null;
    this.context = null;
    this.stopping = false;
    this.turns = Promise.resolve(); // each heard turn is translated and said in order
  }

  async start(source, target) {
    this.stopping = false;
    const listener = listenerFor(source);
    if (!listener) throw new Error(`this box cannot hear ${languageName(source)}: its speech models are English only`);
    this.source = source;
    this.target = target;
    this.voice = voiceFor(target);
    const notice = `This box has no voice for ${languageName(target)} (its voices: ${voiceNames()}): the translation is shown as text only.`;
    say("talk-voice", this.voice ? "" : notice, "error");
    player.open();
    try {
      this.microphone = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
    } catch (exc) {
      throw new Error(`no microphone (${exc.message}); the page needs HTTPS and the microphone permission`);
    }
    // The box's interpreter session where it has one (a speech pipeline, a voice for the target): it
    // hears, translates and speaks each turn itself. Else a transcription session, each turn translated
    // and said from here.
    const pipeline = this.voice && page.pipelines?.[0];
    this.mode = "";
    if (pipeline) {
      const query = new URLSearchParams({ model: pipeline, source, target });
      if (await this.open(`/v1/realtime?${query}`)) this.mode = "interpreter";
    }
    if (!this.mode) {
      const query = new URLSearchParams({ intent: "transcription", model: listener.model });
      if (!(await this.open(`/v1/realtime?${query}`))) throw new Error("the box refused the interpreter session");
      this.mode = "transcription";
    }
    page.mode = this.mode;
    this.socket.addEventListener("close", (event) => this.closed(event));
    const input = { format: { type: "audio/pcm", rate: RATE }, turn_detection: { type: "server_vad" } };
    if (this.mode === "interpreter") {
      const output = { format: { type: "audio/pcm", rate: RATE } };
      this.send({ type: "session.update", session: { type: "realtime", audio: { input, output } } });
    } else {
      input.transcription = { model: listener.model, language: source };
      this.send({ type: "session.update", session: { type: "transcription", audio: { input } } });
    }
    await this.capture();
    say("talk-message", `Listening: speak ${languageName(source)}.`);
  }

  // A WebSocket to `path`: true once open, false if the box refused it.
  async open(path) {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const protocols = page.secret ? ["realtime", `openai-insecure-api-key.${page.secret}`] : [];
    const socket = new WebSocket(`${scheme}://${location.host}${path}`, protocols);
    const opened = await new Promise((resolve) => {
      socket.addEventListener("open", () => resolve(true), { once: true });
      socket.addEventListener("close", () => resolve(false), { once: true });
    });
    if (opened) {
      this.socket = socket;
      socket.addEventListener("message", (event) => this.received(JSON.parse(event.data)));
    }
    return opened;
  }

  async capture() {
    this.context = new AudioContext({ sampleRate: RATE });
    await this.context.audioWorklet.addModule("/page/capture-worklet.js");
    const node = new AudioWorkletNode(this.context, "capture");
    let pending = [];
    let count = 0;
    node.port.onmessage = ({ data }) => {
      pending.push(data);
      count += data.length;
      if (count < SEND_EVERY) return;
      const pcm = new Int16Array(count);
      let at = 0;
      for (const piece of pending) {
        for (let i = 0; i < piece.length; i++) pcm[at++] = Math.max(-32768, Math.min(32767, Math.round(piece[i] * 32767)));
      }
      pending = [];
      count = 0;
      this.send({ type: "input_audio_buffer.append", audio: base64Of(pcm) });
    };
    this.context.createMediaStreamSource(this.microphone).connect(node);
  }

  send(event) {
    if (this.socket?.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(event));
  }

  received(event) {
    page.events.push(event.type);
    if (event.type === "input_audio_buffer.speech_started") {
      say("talk-message", "Hearing you…");
    } else if (event.type === "conversation.item.input_audio_transcription.completed" && event.transcript.trim()) {
      $("talk-heard").textContent += `${event.transcript.trim()}\n`;
      const text = event.transcript.trim();
      if (this.mode === "transcription") this.turns = this.turns.then(() => this.interpret(text));
    } else if (event.type === "response.output_audio.delta") {
      player.play(samplesOf(event.delta), RATE);
    } else if (event.type === "response.output_audio_transcript.done" || event.type === "response.output_text.done") {
      $("talk-translated").textContent += `${event.transcript ?? event.text}\n`;
    } else if (event.type === "response.done" && !this.stopping) {
      say("talk-message", "Listening.");
    } else if (event.type === "error") {
      say("talk-message", `The box says: ${event.error?.message || "an error"}`, "error");
    }
  }

  async interpret(text) {
    say("talk-message", "Translating…");
    try {
      const doc = await json("/translate", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ q: text, source: this.source, target: this.target, format: "text" }),
      });
      $("talk-translated").textContent += `${doc.translatedText}\n`;
      if (this.voice) await speak(doc.translatedText, this.target, "talk-message");
      if (!this.stopping) say("talk-message", "Listening.");
    } catch (exc) {
      say("talk-message", `Could not translate: ${exc.message}`, "error");
    }
  }

  closed(event) {
    const dropped = !this.stopping;
    this.release();
    setTalking(false);
    if (dropped) {
      const why = event.reason ? `: ${event.reason}` : "";
      say("talk-message", `The connection to the box dropped (code ${event.code}${why}). Press Start to reconnect.`, "error");
    }
  }

  stop() {
    this.stopping = true;
    this.socket?.close(1000, "stopped");
    this.release();
    player.stop(); // what is still queued to be said is not said
    say("talk-message", "Stopped.");
  }

  release() {
    this.microphone?.getTracks().forEach((track) => track.stop());
    this.context?.close();
    this.microphone = this.context = null;
  }
}

const interpreter = new Interpreter();

function setTalking(on) {
  $("talk-start").disabled = on;
  $("talk-stop").disabled = !on;
}

async function startTalking() {
  setTalking(true);
  say("talk-message", "Connecting…");
  try {
    await interpreter.start($("talk-source").value, $("talk-target").value);
  } catch (exc) {
    interpreter.stopping = true;
    interpreter.release();
    setTalking(false);
    say("talk-message", `Could not start: ${exc.message}`, "error");
  }
}

// --- Status -------------------------------------------------------------------------------------

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) tr.appendChild(Object.assign(document.createElement("td"), { textContent: String(cell) }));
  return tr;
}

function showStatus(status, ready) {
  page.status = status;
  const f = status.firmware;
  $("firmware").textContent = `firmware ${f.name} ${f.version}`;
  $("health").textContent = ready ? "ready" : "not ready";
  $("health").className = `badge ${ready ? "good" : "bad"}`;
  const engines = [...new Set(status.models.map((m) => m.engine))].join(", ");
  const cache = status.conncache;
  const items = [
    ["Firmware", `${f.name} ${f.version} (built ${f.built_at}, key ${f.signing_key_id})`],
    ["Health", ready ? "ready" : "not ready"],
    ["Engines", engines],
    ...(status.operator
      ? [
          ["Workers", status.workers ? `${status.workers.filter((w) => w.up).length} of ${status.workers.length} up` : "in the engine process"],
          ["QUIC", status.quic ? `${status.quic.workers} QUIC workers${status.quic.reason ? ` (${status.quic.reason})` : ""}` : "off"],
          ["Connection cache", cache ? `${cache.backend}${cache.reason ? ` (${cache.reason})` : ""}: ${cache.peers.length} peers, ${cache.totals.packets} packets, ${cache.totals.drops} dropped` : "off"],
        ]
      : []),
    ["HTTPS", status.tls?.https_port ? `TCP port ${status.tls.https_port}${status.tls.mutual_tls ? ", mutual TLS" : ""}` : "off"],
    ["Certificate SHA-256", status.tls?.sha256 || "none"],
  ];
  $("status-list").replaceChildren(
    ...items.flatMap(([name, value]) => [
      Object.assign(document.createElement("dt"), { textContent: name }),
      Object.assign(document.createElement("dd"), { textContent: value }),
    ]),
  );
  $("status-models").tBodies[0].replaceChildren(
    ...status.models.map((m) => row([m.name, page.kinds?.[m.name] || "", m.engine, m.live_sequences])),
  );
  $("status-operator").hidden = !status.operator;
  $("status-workers").tBodies[0].replaceChildren(
    ...(status.workers || []).map((w) => row([w.worker, w.up ? "yes" : "no", w.in_flight ?? "", w.up ? w.connections + w.tcp_connections + w.quic_peers.length : "", w.restarts])),
  );
}

// /status is for operators (root or the socket's group on the box; a certificate the operator CA signed
// over the network). It is asked once: after a refusal the page asks no more (a visitor in the room is
// never an operator later) and shows what the public routes say: the firmware, the models and engines,
// the certificate (its fingerprint computed here from the PEM the box serves).
async function readStatus() {
  if (page.operator !== false) {
    const response = await fetch("/status");
    page.operator = response.status !== 403;
    if (page.operator) return { ...(await (await checked(response)).json()), operator: true };
  }
  const [server, listing, pem] = await Promise.all([json("/v2"), json("/v2/models"), call("/tls/certificate.pem").then((r) => r.text())]);
  const https = location.protocol === "https:";
  return {
    operator: false,
    firmware: server.firmware,
    models: listing.models.map((m) => ({ name: m.name, engine: m.engine, live_sequences: "" })),
    tls: { sha256: await fingerprint(pem), https_port: https ? Number(location.port || 443) : null },
  };
}

async function fingerprint(pem) {
  const base64 = pem.split("-----")[2].replace(/\s/g, ""); // the first certificate: the box's own
  const der = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", der));
  return [...digest].map((b) => b.toString(16).padStart(2, "0").toUpperCase()).join(":");
}

async function refreshStatus() {
  try {
    const [status, ready] = await Promise.all([readStatus(), fetch("/v2/health/ready").then((r) => r.ok)]);
    showStatus(status, ready);
    say("status-message", "");
  } catch (exc) {
    $("health").textContent = "unreachable";
    $("health").className = "badge bad";
    say("status-message", `The box does not answer: ${exc.message}`, "error");
  }
}

// --- start --------------------------------------------------------------------------------------

async function main() {
  $("translate").addEventListener("click", translateText);
  $("speak-input").addEventListener("click", () => speak($("text-input").value, $("text-source").value, "text-message"));
  $("speak-output").addEventListener("click", () => speak($("text-output").textContent, $("text-target").value, "text-message"));
  $("talk-start").addEventListener("click", startTalking);
  $("talk-stop").addEventListener("click", () => {
    interpreter.stop();
    setTalking(false);
  });
  await joinRoom();
  await refreshStatus();
  setInterval(refreshStatus, STATUS_EVERY_MS);
  try {
    [page.languages] = await Promise.all([json("/languages"), loadModels()]);
  } catch (exc) {
    say("text-message", `Could not read the box's languages: ${exc.message}`, "error");
  }
  fillPair("text-source", "text-target");
  fillPair("talk-source", "talk-target");
  if (!page.languages.length) {
    say("text-message", "This firmware has no translation models: there is nothing to translate between.", "error");
  }
  await refreshStatus(); // again, now with the models' kinds
  page.ready = true;
}

main();
