// chronoq console: calls the JSON endpoints under /api/ and shows the SVG charts under /chart/.
// No framework and no build step: plain DOM calls. Every reply that is not OK carries
// {"error", "message"}; the message is shown as it is.
//
// What it shows follows who is calling (/api/topics): an admin (or anyone, with auth off) sees
// every topic, the delivery-error chart and cancel buttons; another user sees the topics it may
// publish or subscribe to, and the views the server cuts to them, with the admin views hidden.
"use strict";

let horizon = "1h";
let me = { user: null, admin: false, topics: [] };

// Every request names the page's origin: opened as http://user:secret@host/, the page's own
// address carries the credentials, and a browser refuses to fetch a URL resolved against it
// ("Request cannot be constructed from a URL that includes credentials"). The origin never
// carries them; the browser sends the credentials it was given for the page with each request.
function here(path) { return location.origin + path; }

function credentialsInUrl() {
  return "this browser refuses requests from a page opened with a user and password in its address: open " +
    location.origin + "/ instead, and give the access key and secret key when the browser asks";
}

function $(id) { return document.getElementById(id); }

// Numbers as chronoq.timefmt writes them for the CLI: counts with thousands separators, and
// milliseconds as a duration in its two largest units (12ms, 1.25s, 4m03s, 3h12m, 2d03h, 30 days).
function count(n) { return n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"); }

function duration(ms) {
  ms = Math.trunc(Number(ms));
  const sign = ms < 0 ? "-" : "";
  ms = Math.abs(ms);
  const pad = (n) => String(n).padStart(2, "0");
  if (ms < 1000) return sign + ms + "ms";
  if (ms < 60000) return sign + (ms / 1000).toFixed(3).replace(/0+$/, "").replace(/\.$/, "") + "s";
  if (ms < 3600000) return sign + Math.floor(ms / 60000) + "m" + pad(Math.floor((ms % 60000) / 1000)) + "s";
  if (ms < 86400000) return sign + Math.floor(ms / 3600000) + "h" + pad(Math.floor((ms % 3600000) / 60000)) + "m";
  const days = Math.floor(ms / 86400000), hours = Math.floor((ms % 86400000) / 3600000);
  if (hours && days < 10) return sign + days + "d" + pad(hours) + "h";
  return sign + days.toLocaleString("en-US") + " day" + (days !== 1 ? "s" : "");
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (cls) td.className = cls;
  return td;
}

function showStatus(text, isError) {
  const p = $("status");
  p.textContent = text;
  p.className = isError ? "status error" : "status";
  p.hidden = false;
}

async function call(url, options) {
  let reply;
  try {
    reply = await fetch(here(url), options);
  } catch (err) {
    if (/credentials/i.test(err.message)) throw new Error(credentialsInUrl());
    throw new Error("the server did not answer (" + err.message + ")");
  }
  let body;
  try { body = await reply.json(); } catch (err) { body = { message: reply.status + " " + reply.statusText }; }
  if (!reply.ok) throw new Error(body.message || ("error " + reply.status));
  return body;
}

// Who is calling, and the topics it may see: the drop-down lists them; the admin views show for admins.
async function refreshTopics() {
  me = await call("/api/topics");
  for (const el of document.querySelectorAll(".admin-only")) el.hidden = !me.admin;
  $("who").textContent = me.user ? "signed in as " + me.user + (me.admin ? " (admin)" : "") : "";
  const select = $("search-topic");
  const chosen = select.value;
  select.replaceChildren(new Option(me.admin ? "(all topics)" : "(all my topics)", ""));
  for (const name of me.topics) select.add(new Option(name, name));
  select.value = me.topics.includes(chosen) ? chosen : "";
  if (!me.topics.length && !me.admin) {
    showStatus("user " + me.user + " may not publish or subscribe to any topic: there is nothing to show", false);
  }
}

async function refreshOverview() {
  await refreshTopics();
  const o = await call("/api/overview");
  $("now").textContent = "broker time " + o.now;
  const tbody = $("topics").tBodies[0];
  tbody.replaceChildren();
  const select = $("search-topic");
  for (const t of o.topics) {
    const row = tbody.insertRow();
    row.dataset.topic = t.name;
    cell(row, t.name);
    cell(row, t.queues, "num");
    cell(row, count(t.pending), "num");
    cell(row, count(t.accepted), "num");
    cell(row, count(t.delivered), "num");
    const b = document.createElement("button");
    b.textContent = "pending timers";
    b.onclick = () => { select.value = t.name; search(); };
    row.insertCell().append(b);
  }
  if (o.admin) {
    $("timer-summary").textContent = count(o.pending_total) + " timers pending; next due " + o.next_deadline +
      (o.oldest_overdue_ms ? "; firing is " + duration(o.oldest_overdue_ms) + " behind" : "");
    const e = o.delivery_error_ms;
    $("error-summary").textContent = e.count ? ("since start: " + count(e.count) + " fired, fired minus due p50 " +
      duration(e.p50) + ", p99 " + duration(e.p99) + ", max " + duration(e.max))
      : "no timer has fired since the broker started";
  } else {
    $("timer-summary").textContent = count(o.pending_total) + " timers pending in your topics " +
      "(the broker-wide figures are for admins)";
  }
  const gbody = $("groups").tBodies[0];
  gbody.replaceChildren();
  for (const g of o.groups) {
    const row = gbody.insertRow();
    cell(row, g.group); cell(row, g.topic); cell(row, count(g.lag), "num"); cell(row, count(g.inflight), "num");
  }
  const hs = $("horizons");
  if (!hs.childElementCount) {
    for (const [name, label] of Object.entries(o.horizons)) {
      const b = document.createElement("button");
      b.textContent = name; b.title = label; b.dataset.horizon = name;
      b.onclick = () => { horizon = name; refreshCharts(); };
      hs.append(b);
    }
  }
  refreshCharts();
}

function refreshCharts() {
  const t = Date.now();
  $("pending-chart").src = here("/chart/pending.svg?horizon=" + encodeURIComponent(horizon) + "&t=" + t);
  if (me.admin) $("error-chart").src = here("/chart/error.svg?t=" + t);
  for (const b of $("horizons").children) b.classList.toggle("active", b.dataset.horizon === horizon);
}

// Cancelling from the console is for admins (the server refuses it to others): no button otherwise.
function cancelCell(row, topic, id, due, due_ms) {
  const c = row.insertCell();
  if (me.admin) c.append(cancelButton(topic, id, due, due_ms));
}

function cancelButton(topic, id, due, due_ms) {
  const b = document.createElement("button");
  b.textContent = "cancel";
  b.className = "cancel";
  b.onclick = async () => {
    if (!window.confirm("Cancel timer " + id + " on " + topic + " (due " + due + ")? It will not be delivered.")) return;
    try {
      await call("/api/cancel", { method: "POST", headers: { "Content-Type": "application/json" },
                                  // The due time names this row's timer: an id reused after the dedupe
                                  // window names several, and a cancel by id alone is refused for it.
                                  body: JSON.stringify({ topic: topic, message_id: id, deliver_at_ms: due_ms }) });
      showStatus("cancelled " + id + " on " + topic, false);
      await search(true);
      await refreshOverview();
    } catch (err) { showStatus("cancel failed: " + err.message, true); }
  };
  return b;
}

async function search(quiet) {
  const params = new URLSearchParams({ topic: $("search-topic").value, from: $("search-from").value,
                                       to: $("search-to").value });
  const tbody = $("results").tBodies[0];
  try {
    const r = await call("/api/search?" + params);
    tbody.replaceChildren();
    for (const t of r.timers) {
      const row = tbody.insertRow();
      row.dataset.messageId = t.message_id;
      cell(row, t.deliver_at); cell(row, t.topic); cell(row, t.message_id);
      cell(row, t.keys.join(" ")); cell(row, t.accepted);
      cancelCell(row, t.topic, t.message_id, t.deliver_at, t.deliver_at_ms);
    }
    const where = $("search-topic").value ? " on " + $("search-topic").value : me.admin ? "" : " in your topics";
    $("search-note").textContent = count(r.timers.length) + " pending" + where + " due " + r.from + " .. " + r.to +
      (r.truncated ? " (stopped at a limit: narrow the range to see the rest)" : "");
    if (!quiet) $("status").hidden = true;
  } catch (err) {
    tbody.replaceChildren();
    $("search-note").textContent = "";
    showStatus("search: " + err.message, true);
  }
}

async function lookup() {
  const kind = $("lookup-kind").value;
  const value = $("lookup-value").value.trim();
  const tbody = $("lookup-result").tBodies[0];
  tbody.replaceChildren();
  try {
    const r = await call("/api/message?" + new URLSearchParams({ [kind]: value }));
    for (const s of r.statuses) {
      const row = tbody.insertRow();
      row.dataset.messageId = s.message_id;
      cell(row, s.message_id); cell(row, s.topic); cell(row, s.state, "state"); cell(row, s.deliver_at);
      cell(row, s.accepted); cell(row, s.fired); cell(row, s.cancelled);
      if (s.state === "pending") cancelCell(row, s.topic, s.message_id, s.deliver_at, s.deliver_at_ms);
      else row.insertCell();
    }
    $("status").hidden = true;
  } catch (err) { showStatus("look up: " + err.message, true); }
}

document.addEventListener("DOMContentLoaded", () => {
  $("search-form").addEventListener("submit", (ev) => { ev.preventDefault(); search(); });
  $("lookup-form").addEventListener("submit", (ev) => { ev.preventDefault(); lookup(); });
  refreshOverview().then(() => search(true)).catch((err) => showStatus(err.message, true));
  setInterval(() => { refreshOverview().catch((err) => showStatus(err.message, true)); }, 10000);
});
