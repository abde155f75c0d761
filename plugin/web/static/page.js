// Loom's page: the restyled stream over WebRTC, the controls over a WebSocket, and the numbers.
// Plain JavaScript, no build step. The host describes itself in its "hello" (mode, frame size,
// the stamp layout of plugin/web/stamp.py and the controls' schema) and sends its state four
// times a second; every control goes to the host, which applies it or refuses it in words.
"use strict";

const $ = (id) => document.getElementById(id);
const token = new URLSearchParams(location.search).get("token");
const HISTORY = 240; // chart points: a minute at the host's four states a second
const SENT_MEMORY = 600; // stamped camera frames remembered for the round trip
const THUMB = 16; // side of the thumbnails kept for each timed frame pair

// What the page measured and saw, read by the numbers below and by Loom's browser tests.
const loom = { hello: null, state: null, pairs: [], g2g: [], refusals: [], accepted: [], sent: 0, shown: 0 };
window.loom = loom;

let ws = null;
let pc = null;
let hello = null;
const chart = { fps: [], latency: [], g2g: [], drops: [], lastDropped: null };

// ---------------------------------------------------------------- the socket

function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const query = token ? `?token=${encodeURIComponent(token)}` : "";
  ws = new WebSocket(`${scheme}://${location.host}/ws${query}`);
  ws.onopen = () => badge("connection", "connected", "ok");
  ws.onclose = () => { badge("connection", "disconnected: reload to reconnect", "bad"); };
  ws.onmessage = (event) => onMessage(JSON.parse(event.data));
}

function send(message) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(message));
}

function control(name, fields) {
  send({ type: "control", control: name, ...fields });
}

function onMessage(m) {
  if (m.type === "hello") {
    hello = loom.hello = m;
    setRole(m.role);
    buildControls(m.schema);
    startMedia().catch((err) => note(`video: ${err}`));
  } else if (m.type === "answer") {
    pc.setRemoteDescription({ type: "answer", sdp: m.sdp });
  } else if (m.type === "state") {
    loom.state = m;
    setRole(m.role);
    showState(m);
  } else if (m.type === "refused") {
    loom.refusals.push(m.message);
    say(m.message, "refused");
  } else if (m.type === "accepted") {
    loom.accepted.push(m.message);
  }
}

function setRole(role) {
  badge("role", role === "driver" ? "you drive" : "watching: another page drives", role === "driver" ? "ok" : "");
  document.body.classList.toggle("viewer", role !== "driver");
}

// ---------------------------------------------------------------- video

async function startMedia() {
  const [w, h] = hello.size;
  $("output-frame").style.aspectRatio = `${w} / ${h}`;
  pc = new RTCPeerConnection({ iceServers: hello.ice_servers || [] }); // the host's --ice-server list
  pc.ontrack = (event) => {
    // Show each restyled frame as soon as it is decoded: no playout delay, no jitter buffer target.
    if ("playoutDelayHint" in event.receiver) event.receiver.playoutDelayHint = 0;
    if ("jitterBufferTarget" in event.receiver) event.receiver.jitterBufferTarget = 0;
    const first = pc.getTransceivers()[0];
    const video = event.transceiver === first ? $("output") : $("input");
    video.srcObject = new MediaStream([event.track]);
    if (video.id === "output") watchOutput(video);
  };
  if (hello.mode === "camera") {
    const track = await stampedCamera().catch((err) => { note(`camera: ${err}; watching only`); return null; });
    if (track) pc.addTransceiver(track, { direction: "sendrecv" });
    else pc.addTransceiver("video", { direction: "recvonly" });
  } else {
    pc.addTransceiver("video", { direction: "recvonly" });
    pc.addTransceiver("video", { direction: "recvonly" });
  }
  await pc.setLocalDescription(await pc.createOffer());
  await gathered(pc);
  send({ type: "offer", sdp: pc.localDescription.sdp });
}

function gathered(peer) {
  if (peer.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    peer.addEventListener("icegatheringstatechange", () => {
      if (peer.iceGatheringState === "complete") resolve();
    });
    setTimeout(resolve, 2000); // what was gathered by then is enough on a LAN or a tunnel
  });
}

// The camera, cropped to the host's size, with the frame counter stamped below it (stamp.py's layout).
async function stampedCamera() {
  const [w, h] = hello.size;
  const rows = hello.stamp.rows;
  const fps = hello.fps || 30;
  const stream = await navigator.mediaDevices.getUserMedia({
    video: { width: { ideal: w }, height: { ideal: h }, frameRate: { ideal: fps } }, audio: false });
  const camera = $("input");
  camera.srcObject = stream;
  await camera.play();
  const canvas = document.createElement("canvas");
  canvas.width = w;
  canvas.height = h + rows;
  const ctx = canvas.getContext("2d");
  const thumbs = new Map();
  // Captured on request, right after each frame is drawn, rather than on the canvas's own schedule.
  const track = canvas.captureStream(0).getVideoTracks()[0];
  let counter = 0;
  const limit = 1 << hello.stamp.code_bits;
  const draw = () => {
    const vw = camera.videoWidth, vh = camera.videoHeight;
    if (vw && vh) {
      const scale = Math.max(w / vw, h / vh); // cover: crop the camera to the host's aspect
      const sw = w / scale, sh = h / scale;
      ctx.drawImage(camera, (vw - sw) / 2, (vh - sh) / 2, sw, sh, 0, 0, w, h);
      counter = counter % (limit - 1) + 1;
      drawStamp(ctx, counter, w, h, rows);
      const t = performance.now();
      if (track.requestFrame) track.requestFrame();
      thumbs.set(counter, { t, thumb: thumbnail(canvas, 0, 0, w, h) });
      if (thumbs.size > SENT_MEMORY) thumbs.delete(thumbs.keys().next().value);
      loom.sent += 1;
    }
    schedule();
  };
  const schedule = () => {
    if (camera.requestVideoFrameCallback) camera.requestVideoFrameCallback(draw);
    else setTimeout(draw, 1000 / fps);
  };
  schedule();
  loom.stamped = thumbs;
  return track;
}

function blocks(code) {
  const bits = hello.stamp.code_bits;
  const data = [];
  for (let i = bits - 1; i >= 0; i--) data.push((code >> i) & 1);
  const parity = data.reduce((a, b) => a + b, 0) % 2;
  return [1, ...data, parity, 0];
}

function drawStamp(ctx, code, w, h, rows) {
  const n = hello.stamp.bits;
  blocks(code).forEach((bit, i) => {
    const x0 = Math.floor(i * w / n), x1 = Math.floor((i + 1) * w / n);
    ctx.fillStyle = bit ? "#fff" : "#000";
    ctx.fillRect(x0, h, x1 - x0, rows);
  });
}

const probe = document.createElement("canvas");
const probeCtx = probe.getContext("2d", { willReadFrequently: true });

function thumbnail(source, sx, sy, sw, sh) {
  probe.width = THUMB;
  probe.height = THUMB;
  probeCtx.drawImage(source, sx, sy, sw, sh, 0, 0, THUMB, THUMB);
  const rgba = probeCtx.getImageData(0, 0, THUMB, THUMB).data;
  const rgb = [];
  for (let i = 0; i < rgba.length; i += 4) rgb.push(rgba[i], rgba[i + 1], rgba[i + 2]);
  return rgb;
}

function readStamp(video) {
  const n = hello.stamp.bits;
  const [w, h] = hello.size;
  const vh = video.videoHeight, vw = video.videoWidth;
  const top = vh * h / (h + hello.stamp.rows);
  probe.width = n * 4;
  probe.height = 4;
  probeCtx.drawImage(video, 0, top, vw, vh - top, 0, 0, n * 4, 4);
  const px = probeCtx.getImageData(0, 0, n * 4, 4).data;
  const bits = [];
  for (let i = 0; i < n; i++) {
    const o = (2 * n * 4 + i * 4 + 2) * 4; // row 2, the block's middle
    bits.push((px[o] + px[o + 1] + px[o + 2]) / 3 > 127 ? 1 : 0);
  }
  let code = 0;
  for (const bit of bits.slice(1, 1 + hello.stamp.code_bits)) code = (code << 1) | bit;
  return blocks(code).every((b, i) => b === bits[i]) ? code : 0;
}

// Each restyled frame shown: read its stamp, and time it against when that camera frame was drawn.
function watchOutput(video) {
  if (!video.requestVideoFrameCallback) { note("this browser cannot time frames (no requestVideoFrameCallback)"); return; }
  let last = 0;
  const seen = (now, meta) => {
    loom.shown += 1;
    const code = hello.stamp && loom.stamped ? readStamp(video) : 0;
    const sent = code && code !== last ? loom.stamped.get(code) : null;
    if (sent) {
      last = code;
      const shownAt = meta.expectedDisplayTime || now;
      const ms = shownAt - sent.t;
      loom.g2g.push(ms);
      if (loom.g2g.length > 120) loom.g2g.shift();
      const [w, h] = hello.size;
      const top = video.videoHeight * h / (h + hello.stamp.rows);
      // receive to display: the browser's own share (jitter buffer, decode, render) of this frame's trip
      const received = meta.receiveTime ? shownAt - meta.receiveTime : null;
      loom.pairs.push({ code, at: sent.t, ms, shown_after_receive: received, input: sent.thumb,
                        output: thumbnail(video, 0, 0, video.videoWidth, top) });
      if (loom.pairs.length > 120) loom.pairs.shift();
    }
    video.requestVideoFrameCallback(seen);
  };
  video.requestVideoFrameCallback(seen);
  setInterval(() => {
    const ms = median(loom.g2g.slice(-30));
    if (ms !== null) send({ type: "report", glass_to_glass_ms: Math.round(ms), samples: loom.g2g.length });
  }, 1000);
}

function median(values) {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

// ---------------------------------------------------------------- controls

function buildControls(schema) {
  const steps = $("steps");
  steps.textContent = "";
  for (const n of schema.steps) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = n;
    b.dataset.steps = n;
    b.onclick = () => control("steps", { value: n });
    steps.appendChild(b);
  }
  slider("noise_scale", schema.noise_scale, (v) => control("noise_scale", { value: v }));
  slider("transition_chunks", schema.transition_chunks, (v) => control("transition_chunks", { value: v }));
  slider("adapter_strength", schema.adapter_strength, (v) => control("adapter_strength", { value: v }));
  $("motion_aware").onchange = (e) => control("motion_aware", { value: e.target.checked });
  slider("context_scale", schema.context_scale, (v) => control("context_scale", { value: v }));
  $("control_source").onchange = (e) => control("control_source", { value: e.target.value });
  $("reference").onchange = (e) => {
    const file = e.target.files[0];
    if (file) uploadReference(file, schema.reference_max_bytes);
    e.target.value = ""; // the same file again (overwritten meanwhile) is a new pick
  };
  $("pause").onclick = () => control("pause", { value: !(loom.state && loom.state.controls.paused) });
  $("prompt-form").onsubmit = (e) => {
    e.preventDefault();
    control("prompt", { text: $("prompt").value });
  };
}

// A range for dragging and a number box for typing; a typed value out of range goes to the host
// anyway, which refuses it in words (shown in the message line).
function slider(id, spec, sendValue) {
  const range = $(`${id}-range`), box = $(id);
  range.min = spec.min; range.max = spec.ui_max; range.step = spec.step;
  box.step = spec.step;
  box.title = range.title = spec.allowed;
  range.oninput = () => { box.value = range.value; };
  range.onchange = () => sendValue(Number(range.value));
  box.onchange = () => { if (box.value !== "") sendValue(Number(box.value)); }; // emptied: nothing to send
  box.onkeydown = (e) => { if (e.key === "Enter") box.blur(); }; // Enter commits the typed value
}

// VACE presets only: the control scale and the sources this run can make (the host refuses the others).
function showControl(c) {
  const sources = c.control_sources || [];
  $("vace").hidden = !sources.length;
  if (!sources.length) return;
  $("reference").parentElement.hidden = !c.takes_reference; // the edges-only default takes none
  const select = $("control_source");
  if (select.dataset.items !== JSON.stringify(sources)) {
    select.dataset.items = JSON.stringify(sources);
    select.textContent = "";
    for (const name of sources) {
      const o = document.createElement("option");
      o.value = o.textContent = name;
      select.appendChild(o);
    }
  }
  setIfIdle(select, c.control_source);
  setIfIdle($("context_scale"), c.context_scale);
  setIfIdle($("context_scale-range"), c.context_scale);
}

// The rows of the live parameters the running engine does not take (its ready message's list; null: any, all
// shown) are hidden, as the overlay leaves them out, rather than offered only to be refused. Each row names its
// control (data-control); the schema names the parameter that control sets.
function showTaken(takes) {
  for (const row of document.querySelectorAll("[data-control]")) {
    row.hidden = Array.isArray(takes) && !takes.includes(hello.schema.params[row.dataset.control]);
  }
}

function setIfIdle(el, value) {
  if (document.activeElement !== el) el.value = value;
}

function showState(m) {
  const c = m.controls, e = m.engine, s = m.session || {};
  badge("engine-state", `engine ${e.state}${e.message && e.state !== "running" ? ": " + e.message : ""}`,
        e.state === "running" ? "ok" : "");
  $("standby-state").hidden = !e.standby;  // only with --standby: a second engine kept to take over
  if (e.standby) badge("standby-state", `standby ${e.standby}`, e.standby === "ready" ? "ok" : "");
  const list = $("prompts");
  if (list.dataset.items !== JSON.stringify(c.prompts)) {
    list.dataset.items = JSON.stringify(c.prompts);
    list.textContent = "";
    c.prompts.forEach((text, i) => {
      const li = document.createElement("li");
      li.textContent = text;
      li.onclick = () => control("prompt_index", { value: i });
      list.appendChild(li);
    });
  }
  [...list.children].forEach((li, i) => li.classList.toggle("current", i === c.prompt_index));
  const match = s.prompt_style;
  $("style").textContent = match
    ? `style: ${match.style} (similarity ${Number(match.similarity).toFixed(2)}` +
      `${match.runner_up ? ", runner-up " + match.runner_up : ""})`
    : `prompt: ${s.prompt || c.prompts[c.prompt_index]}`;
  for (const b of $("steps").children) b.classList.toggle("on", Number(b.dataset.steps) === c.steps);
  setIfIdle($("noise_scale"), c.noise_scale);
  setIfIdle($("noise_scale-range"), c.noise_scale);
  const chunks = c.transition_chunks === null ? "" : c.transition_chunks;
  setIfIdle($("transition_chunks"), chunks);
  setIfIdle($("transition_chunks-range"), chunks);
  setIfIdle($("adapter_strength"), c.adapter_strength);
  setIfIdle($("adapter_strength-range"), c.adapter_strength);
  $("motion_aware").checked = c.motion_aware;
  $("pause").textContent = c.paused ? "Resume" : "Pause";
  $("pause").classList.toggle("on", c.paused);
  showLoras(c.lora_scales);
  showControl(c);
  showTaken(c.takes);
  // a command the frame loop refused, or a value the running engine refused, is said as refused
  const refusedNow = c.refused > (showState.lastRefused ?? c.refused);
  if (c.message && (c.message !== showState.lastMessage || refusedNow)) {
    say(c.message, refusedNow ? "refused" : "accepted");
  }
  if (e.errors > (showState.lastErrors ?? e.errors) && e.last_error) say(e.last_error, "refused");
  showState.lastMessage = c.message;
  showState.lastRefused = c.refused;
  showState.lastErrors = e.errors;
  const g2g = median(loom.g2g.slice(-30));
  const share = webShare(m.through || []);
  $("fps").textContent = e.fps !== undefined ? e.fps.toFixed(1) : "-";
  $("dropped").textContent = e.dropped !== undefined ? e.dropped : "-";
  $("latency").textContent = e.latency_ms ? `${Math.round(e.latency_ms)} ms` : "-";
  $("g2g").textContent = g2g !== null ? `${Math.round(g2g)} ms` : (hello.mode === "camera" ? "-" : "n/a (no page camera)");
  const adds = share !== null ? share : (g2g !== null && e.latency_ms ? g2g - e.latency_ms : null);
  loom.webAdds = adds;
  $("web-adds").textContent = adds !== null ? `${Math.round(adds)} ms` : "-";
  $("pages").textContent = m.pages;
  const path = m.host_path || {};
  const ms = (key) => (path[key] !== undefined ? `${Math.round(path[key])}` : "-");
  $("host-path").textContent = `${ms("camera_to_submit")} / ${ms("submit_to_post")} / ${ms("post_to_send")} ms`;
  plot(e, g2g);
}

// The web path's share of each timed frame: its glass to glass less the time the host says the same
// frame (by its stamp) spent from submitted to the engine to sent back; the median of the recent ones.
function webShare(through) {
  const host = new Map(through);
  const shares = [];
  for (const p of loom.pairs.slice(-60)) {
    if (host.has(p.code)) shares.push(p.ms - host.get(p.code));
  }
  return median(shares.slice(-30));
}

function showLoras(scales) {
  const box = $("loras");
  const names = Object.keys(scales);
  if (box.dataset.names !== names.join("\n")) {
    box.dataset.names = names.join("\n");
    box.textContent = "";
    for (const name of names) {
      const row = document.createElement("div");
      row.className = "control";
      const id = `lora-${names.indexOf(name)}`;
      row.innerHTML = `<label for="${id}"></label><input type="range" id="${id}-range"><input type="number" id="${id}">`;
      row.querySelector("label").textContent = `LoRA ${name}`;
      box.appendChild(row);
      slider(id, hello.schema.lora_scale, (v) => control("lora_scale", { name, value: v }));
    }
  }
  names.forEach((name, i) => {
    setIfIdle($(`lora-${i}`), scales[name]);
    setIfIdle($(`lora-${i}-range`), scales[name]);
  });
}

// ---------------------------------------------------------------- the chart

function plot(e, g2g) {
  const drops = chart.lastDropped === null ? 0 : Math.max(0, (e.dropped || 0) - chart.lastDropped);
  chart.lastDropped = e.dropped || 0;
  for (const [key, value] of [["fps", e.fps || 0], ["latency", e.latency_ms || 0], ["g2g", g2g || 0],
                              ["drops", drops]]) {
    chart[key].push(value);
    if (chart[key].length > HISTORY) chart[key].shift();
  }
  const canvas = $("chart"), ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height;
  ctx.clearRect(0, 0, W, H);
  const x = (i) => W - (chart.fps.length - 1 - i) * (W / HISTORY);
  const maxDrops = Math.max(1, ...chart.drops);
  ctx.fillStyle = "#f55";
  chart.drops.forEach((d, i) => { if (d) ctx.fillRect(x(i) - 1, H - 20 * d / maxDrops, 2, 20 * d / maxDrops); });
  const line = (values, top, color) => {
    ctx.strokeStyle = color;
    ctx.beginPath();
    values.forEach((v, i) => { const y = H - 4 - (H - 8) * v / top; i ? ctx.lineTo(x(i), y) : ctx.moveTo(x(i), y); });
    ctx.stroke();
  };
  const fpsTop = Math.max(5, ...chart.fps) * 1.1;
  const msTop = Math.max(100, ...chart.latency, ...chart.g2g) * 1.1;
  line(chart.fps, fpsTop, "#6c6");
  line(chart.latency, msTop, "#6af");
  line(chart.g2g, msTop, "#fc6");
  ctx.fillStyle = "#888";
  ctx.fillText(`${fpsTop.toFixed(0)} fps`, 4, 12);
  ctx.fillText(`${msTop.toFixed(0)} ms`, W - 60, 12);
}

// ---------------------------------------------------------------- words

function badge(id, text, kind) {
  const el = $(id);
  el.textContent = text;
  el.className = `badge ${kind || ""}`;
}

// A reference image (VACE) from a file: its bytes go to the host, which checks and decodes them. A file
// that is not a PNG or JPEG, or too large to send, is refused here in the host's words and never sent.
function uploadReference(file, maxBytes) {
  let why = "";
  if (!["image/png", "image/jpeg"].includes(file.type)) {
    why = `reference ${file.name}: not a PNG or JPEG image; expected a PNG or JPEG file`;
  } else if (file.size > maxBytes) {
    why = `reference ${file.name}: over ${Math.floor(maxBytes / 1048576)} MB; expected a smaller PNG or JPEG file`;
  }
  if (why) {
    loom.refusals.push(why);
    say(why, "refused");
    return;
  }
  const reader = new FileReader();
  reader.onload = () => control("reference", { name: file.name, data: reader.result.split(",", 2)[1] });
  reader.readAsDataURL(file);
}

function say(text, kind) {
  const el = $("message");
  el.textContent = text;
  el.className = `readout ${kind}`;
}

function note(text) {
  $("media-note").textContent = text;
}

connect();
