// The inboxmesh web view: the agent tree and a sequence diagram of messages, folded from the event record
// (a snapshot, then the live stream after it), or one message's path (/message/<id>). Plain JavaScript, no
// build step. Everything shown comes from the mesh's record; names and details are user text, so they go
// into the page as text only (textContent), never as HTML.
"use strict";

const MAX_ARROWS = 300;   // the diagram keeps the newest arrows only
const MAX_LOG = 200;      // rows of the event record shown
const MAX_EXTERNAL = 20;  // columns for addresses that are not agents here (ioa:, channel:)
const SVG = "http://www.w3.org/2000/svg";

// The state an event puts its agent in; must agree with services/webview/board.py LIVE_STATES.
const LIVE_STATES = {
  agent_woken: "running", turn_started: "running", run_started: "running",
  agent_idle: "idle", task_failed: "failed", run_cancelled: "cancelled",
};
// How far a message has got; an arrow's status only moves forward.
const PROGRESS = {
  sent: 1, outboxed: 1, published: 2, stored: 2, delivered: 3, consumed: 4, "dead-lettered": 5, refused: 5,
};

const view = {
  agents: new Map(),     // id -> {id, name, parent_id, scope_id, mode, state, done, depth, identity}
  arrows: new Map(),     // sender + "\n" + message_id -> arrow
  reports: new Set(),    // keys named by TASK_COMPLETED before their message was seen
  tasks: new Set(),      // keys named by AGENT_SPAWNED (a parent's task to its child)
  lastEventId: 0,
  source: null,
  dirty: false,
};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function time(us) {
  return us ? new Date(us / 1000).toISOString().slice(11, 23) : "-";
}

function say(text) {
  const notice = document.getElementById("notice");
  notice.hidden = !text;
  notice.textContent = text || "";
}

function setConnection(state) {
  const node = document.getElementById("connection");
  node.dataset.connection = state;
  node.textContent = state;
}

async function getJSON(url) {
  const response = await fetch(url, {credentials: "same-origin", cache: "no-store"});
  const body = await response.json().catch(() => ({error: response.statusText}));
  if (!response.ok) {
    const error = new Error(body.error || response.statusText);
    error.status = response.status;
    throw error;
  }
  return body;
}

// -- folding events ---------------------------------------------------------------------------------------
function agentOf(id) {
  let agent = view.agents.get(id);
  if (!agent && id && !id.startsWith("ioa:") && !id.startsWith("channel:")) {
    agent = {id, name: id, parent_id: "", scope_id: "", mode: "", state: "registered", done: false, depth: 0,
             identity: null};
    view.agents.set(id, agent);
  }
  return agent;
}

function keyOf(sender, messageId) {
  return sender + "\n" + messageId;
}

function arrowFor(e) {
  const key = keyOf(e.sender, e.message_id);
  let arrow = view.arrows.get(key);
  if (!arrow) {
    arrow = {key, id: e.message_id, from: e.sender, to: e.recipient, kind: "message", status: "", detail: "",
             inReplyTo: e.in_reply_to, traceId: e.trace_id, firstEventId: e.id, replied: false};
    if (view.tasks.has(key)) arrow.kind = "task";
    if (view.reports.has(key) || e.message_id.startsWith("inboxmesh:announce:")) arrow.kind = "report";
    view.arrows.set(key, arrow);
    while (view.arrows.size > MAX_ARROWS) view.arrows.delete(view.arrows.keys().next().value);
  }
  if (!arrow.traceId && e.trace_id) arrow.traceId = e.trace_id;
  return arrow;
}

function advance(arrow, status, detail) {
  if ((PROGRESS[status] || 0) > (PROGRESS[arrow.status] || 0)) {
    arrow.status = status;
    arrow.detail = detail || "";
  }
}

function foldMessage(e) {
  if (!e.message_id || !e.sender) return;
  const arrow = arrowFor(e);
  switch (e.kind) {
    case "message_sent":
      if (e.detail === "accepted") advance(arrow, "sent");
      else if (e.detail === "outboxed") advance(arrow, "outboxed");
      else if (e.detail !== "duplicate") advance(arrow, "refused", e.detail);
      break;
    case "message_stored":
      if (e.detail === "dead-letter notice") arrow.kind = "notice";
      advance(arrow, "stored");
      break;
    case "message_delivered": advance(arrow, "delivered"); break;
    case "message_consumed": advance(arrow, "consumed"); break;
    case "message_dead_lettered": advance(arrow, "dead-lettered", e.detail); break;
    case "ioa_published": advance(arrow, "published", e.detail); break;
    case "ioa_outboxed": advance(arrow, "outboxed"); break;
  }
  if (arrow.kind === "message" && arrow.inReplyTo) arrow.kind = "reply";
  if (arrow.inReplyTo && e.kind === "message_stored") {  // the message it answers was sent by its recipient
    const original = view.arrows.get(keyOf(e.recipient, arrow.inReplyTo));
    if (original) original.replied = true;
  }
}

function fold(e) {
  if (e.id <= view.lastEventId) return;  // a replay after a reconnect: already folded
  view.lastEventId = e.id;
  const agent = e.kind === "agent_registered" ? agentOf(e.agent_id) : view.agents.get(e.agent_id);
  switch (e.kind) {
    case "agent_registered": {
      const found = /^name=(.*) mode=(\d+) scope=(\S*)$/.exec(e.detail);
      if (agent && found) {
        agent.name = found[1];
        agent.mode = {1: "main", 2: "sync", 3: "async", 4: "fork"}[found[2]] || found[2];
        agent.scope_id = found[3];
        agent.parent_id = e.sender;
      }
      // on a mesh with routing, the live stream says which configured agent's identity it shows
      if (agent && e.identity) agent.identity = e.identity;
      break;
    }
    case "agent_closed": if (agent) agent.state = "closed"; break;
    case "task_completed":
      if (agent) agent.done = true;
      if (e.message_id) {
        const key = keyOf(e.agent_id, e.message_id);
        view.reports.add(key);
        const arrow = view.arrows.get(key);
        if (arrow) arrow.kind = "report";
      }
      break;
    case "agent_spawned":
      if (e.message_id) view.tasks.add(keyOf(e.agent_id, e.message_id));
      break;
    case "message_stored": if (agent) agent.depth += 1; break;
    case "message_consumed":
    case "message_dead_lettered": if (agent) agent.depth = Math.max(0, agent.depth - 1); break;
  }
  if (agent && LIVE_STATES[e.kind] && agent.state !== "closed") agent.state = LIVE_STATES[e.kind];
  if (e.kind.startsWith("message_") || e.kind.startsWith("ioa_")) foldMessage(e);
  logEvent(e);
  view.dirty = true;
}

// -- drawing ----------------------------------------------------------------------------------------------
function logEvent(e) {
  const log = document.getElementById("log");
  const who = e.sender && e.recipient ? `${nameOf(e.sender)} → ${nameOf(e.recipient)}` : nameOf(e.agent_id);
  const row = el("li", {"data-event-id": e.id, "data-kind": e.kind},
                 el("span", {class: "id"}, `#${e.id}`), " ", el("span", {class: "time"}, time(e.at_us)), " ",
                 el("span", {class: "kind"}, e.kind), " ", who, e.detail ? ` (${e.detail.slice(0, 120)})` : "");
  log.prepend(row);
  while (log.childElementCount > MAX_LOG) log.lastElementChild.remove();
}

function nameOf(id) {
  const agent = view.agents.get(id);
  return agent ? agent.name : id;
}

// "🏠 Claw": the identity of the configured agent an agent runs as (services/webview/identities.py); "" for none
function identityText(agent) {
  const identity = agent && agent.identity;
  return identity ? [identity.emoji, identity.name].filter(Boolean).join(" ") : "";
}

// a lifeline's head: "🏠 Claw (home)" for an agent with an identity, else its name
function laneName(id) {
  const shown = identityText(view.agents.get(id));
  return shown ? `${shown} (${nameOf(id)})` : nameOf(id);
}

function identityAttrs(agent) {
  const identity = agent && agent.identity;
  return identity ? {"data-identity-name": identity.name, "data-identity-emoji": identity.emoji} : {};
}

function treeOrder() {
  const children = new Map();
  const roots = [];
  for (const agent of view.agents.values()) {
    if (agent.parent_id && view.agents.has(agent.parent_id)) {
      if (!children.has(agent.parent_id)) children.set(agent.parent_id, []);
      children.get(agent.parent_id).push(agent);
    } else {
      roots.push(agent);
    }
  }
  return {roots, children};
}

function drawTree() {
  const {roots, children} = treeOrder();
  const row = (agent) => {
    const item = el("li", {
      class: "agent", "data-agent-id": agent.id, "data-agent-name": agent.name, "data-parent-id": agent.parent_id,
      "data-mode": agent.mode, "data-state": agent.state, "data-depth": agent.depth, "data-done": agent.done,
      ...identityAttrs(agent),
    });
    const shown = identityText(agent);
    const line = el("div", {class: "agent-line", title: agent.id},
                    shown ? el("span", {class: "identity", title: `configured agent ${agent.identity.agent}`}, shown) : "",
                    shown ? " " : "",
                    el("span", {class: "name"}, shown ? `(${agent.name})` : agent.name), " ",
                    el("span", {class: "mode"}, agent.mode), " ",
                    el("span", {class: `state state-${agent.state}`}, agent.state),
                    agent.done ? el("span", {class: "done"}, "done") : "",
                    el("span", {class: "depth", title: "unconsumed messages in its inbox"}, `inbox ${agent.depth}`));
    item.append(line);
    const kids = children.get(agent.id) || [];
    if (kids.length) item.append(el("ul", {class: "children"}, ...kids.map(row)));
    return item;
  };
  document.getElementById("tree").replaceChildren(...roots.map(row));
  return {roots, children};
}

function columns(tree) {
  const order = [];
  const walk = (agent) => {
    order.push(agent.id);
    for (const kid of tree.children.get(agent.id) || []) walk(kid);
  };
  tree.roots.forEach(walk);
  const known = new Set(order);
  const used = new Set();
  for (const arrow of view.arrows.values()) { used.add(arrow.from); used.add(arrow.to); }
  // only the agents that take part in a shown arrow get a lifeline, in tree order; then other addresses
  const shown = order.filter((id) => used.has(id));
  for (const id of used) if (!known.has(id) && shown.length < order.length + MAX_EXTERNAL) shown.push(id);
  return shown;
}

function drawDiagram(tree) {
  const lanes = columns(tree);
  const x = new Map(lanes.map((id, i) => [id, 90 + i * 170]));
  const arrows = [...view.arrows.values()].filter((a) => x.has(a.from) && x.has(a.to));
  const top = 44, step = 30;
  const width = Math.max(300, 90 + lanes.length * 170);
  const height = top + 20 + arrows.length * step;
  const root = svg("svg", {id: "sequence", width, height, viewBox: `0 0 ${width} ${height}`});
  const defs = svg("defs");
  const marker = svg("marker", {id: "head", markerWidth: 10, markerHeight: 8, refX: 9, refY: 4, orient: "auto"});
  marker.append(svg("path", {d: "M0,0 L10,4 L0,8 z", class: "head"}));
  defs.append(marker);
  root.append(defs);
  for (const id of lanes) {
    const lane = svg("g", {class: "lifeline", "data-agent-id": id, ...identityAttrs(view.agents.get(id))});
    lane.append(svg("text", {x: x.get(id), y: 18, "text-anchor": "middle", class: "lane-name"}, laneName(id)));
    lane.append(svg("line", {x1: x.get(id), y1: 26, x2: x.get(id), y2: height, class: "lane"}));
    root.append(lane);
  }
  arrows.forEach((arrow, i) => {
    const y = top + i * step, x1 = x.get(arrow.from), x2 = x.get(arrow.to);
    const status = arrow.replied && arrow.status === "consumed" ? "consumed, replied" : arrow.status;
    const link = svg("a", {href: `/message/${encodeURIComponent(arrow.id)}?sender=${encodeURIComponent(arrow.from)}`});
    const group = svg("g", {
      class: `arrow kind-${arrow.kind} status-${arrow.status}`, "data-message-id": arrow.id, "data-kind": arrow.kind,
      "data-from": arrow.from, "data-to": arrow.to, "data-status": arrow.status, "data-replied": arrow.replied,
      "data-in-reply-to": arrow.inReplyTo, "data-trace-id": arrow.traceId, "data-event-id": arrow.firstEventId,
    });
    group.append(svg("title", {}, `${arrow.kind} ${arrow.id}\nfrom ${nameOf(arrow.from)} to ${nameOf(arrow.to)}\n` +
                     `${status}${arrow.detail ? " (" + arrow.detail + ")" : ""}\nevent #${arrow.firstEventId}` +
                     `${arrow.traceId ? "\ntrace " + arrow.traceId : ""}`));
    if (x1 === x2) {
      group.append(svg("path", {d: `M${x1},${y} h40 v12 h-38`, class: "line", "marker-end": "url(#head)"}));
    } else {
      group.append(svg("line", {x1, y1: y, x2: x2 + (x2 > x1 ? -4 : 4), y2: y, class: "line",
                                "marker-end": "url(#head)"}));
    }
    const label = `${arrow.kind} · ${status}${arrow.detail ? " (" + arrow.detail + ")" : ""}`;
    group.append(svg("text", {x: (x1 + x2) / 2 + (x1 === x2 ? 46 : 0), y: y - 5,
                              "text-anchor": x1 === x2 ? "start" : "middle", class: "label"}, label));
    link.append(group);
    root.append(link);
  });
  document.getElementById("diagram").replaceChildren(root);
}

function draw() {
  if (!view.dirty) return;
  view.dirty = false;
  const tree = drawTree();
  drawDiagram(tree);
  const last = document.getElementById("last-event");
  last.dataset.lastEventId = view.lastEventId;
  last.textContent = `event #${view.lastEventId}`;
}

function scheduleDraw() {
  if (view.dirty) requestAnimationFrame(draw);
}

// -- the mesh view ----------------------------------------------------------------------------------------
async function showMesh() {
  document.getElementById("mesh-view").hidden = false;
  let snapshot;
  try {
    snapshot = await getJSON("/api/snapshot");
  } catch (error) {
    setConnection("error");
    say(error.status === 401 ? "Open this page once as /?token=<admin token> (the admin_token in mesh.json)."
                             : `No snapshot: ${error.message}`);
    return;
  }
  for (const a of snapshot.agents) view.agents.set(a.id, {...a});
  const note = document.getElementById("tree-note");
  if (!snapshot.all_agents_listed) {
    note.hidden = false;
    note.textContent = "Only the newest trees are listed; agents of older trees appear when they act.";
  }
  // the snapshot's agents are as of now, its events those up to last_event_id: fold the events for the
  // arrows (the agents' states and depths are already in the snapshot), then follow the stream after it
  const seeded = new Map([...view.agents].map(([id, a]) => [id, {...a}]));
  for (const e of snapshot.events) fold(e);
  for (const [id, a] of seeded) view.agents.set(id, a);
  view.lastEventId = snapshot.last_event_id;
  view.dirty = true;
  draw();
  connect();
}

function connect() {
  setConnection("connecting");
  const source = new EventSource(`/api/events?after=${view.lastEventId}`);
  view.source = source;
  source.onopen = () => { setConnection("live"); say(""); };
  source.onmessage = (message) => {
    fold(JSON.parse(message.data));
    scheduleDraw();
  };
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {  // refused (401, 503): try again from where we are
      setConnection("reconnecting");
      source.close();
      setTimeout(connect, 3000);
    } else {
      setConnection("reconnecting");  // the browser reconnects with Last-Event-ID by itself
    }
  };
}

// -- one message's path -----------------------------------------------------------------------------------
async function showMessage(messageId, sender) {
  document.getElementById("message-view").hidden = false;
  document.getElementById("message-id").textContent = messageId;
  setConnection("static");
  document.getElementById("last-event").hidden = true;
  let found;
  try {
    found = await getJSON(`/api/message/${encodeURIComponent(messageId)}?sender=${encodeURIComponent(sender)}`);
  } catch (error) {
    say(error.status === 401 ? "Open the mesh once as /?token=<admin token> (the admin_token in mesh.json)."
                             : `Not found: ${error.message}`);
    return;
  }
  const first = found.events.find((e) => e.recipient) || {};
  const facts = document.getElementById("message-facts");
  const traces = [...new Set(found.events.map((e) => e.trace_id).filter(Boolean))];
  const fact = (term, ...value) => facts.append(el("dt", {}, term), el("dd", {}, ...value));
  const named = (id) => (found.names[id] ? `${found.names[id]} (${id})` : id || "-");
  fact("from", named(first.sender || sender));
  fact("to", named(first.recipient));
  if (first.in_reply_to) {
    fact("in reply to", el("a", {href: `/message/${encodeURIComponent(first.in_reply_to)}?sender=${
      encodeURIComponent(first.recipient || "")}`, id: "in-reply-to"}, first.in_reply_to));
  }
  if (first.conversation_id) fact("conversation", first.conversation_id);
  fact("trace", el("span", {id: "message-trace", "data-trace-id": traces.join(" ")}, traces.join(", ") || "-"));
  const body = document.querySelector("#message-events tbody");
  for (const e of found.events) {
    body.append(el("tr", {class: "event", "data-event-id": e.id, "data-kind": e.kind, "data-trace-id": e.trace_id},
                   el("td", {}, `#${e.id}`), el("td", {}, time(e.at_us)), el("td", {}, e.kind),
                   el("td", {}, e.agent_id), el("td", {}, e.sender), el("td", {}, e.recipient),
                   el("td", {}, e.sequence || ""), el("td", {}, e.detail), el("td", {class: "trace"}, e.trace_id)));
  }
  if (!found.complete) body.append(el("tr", {}, el("td", {colspan: 9}, "… more events than this page shows")));
  const replies = document.getElementById("message-replies");
  for (const r of found.replies) {
    replies.append(el("li", {class: "reply", "data-message-id": r.message_id},
                      el("a", {href: `/message/${encodeURIComponent(r.message_id)}?sender=${encodeURIComponent(r.sender)}`},
                         r.message_id), ` (event #${r.event_id})`));
  }
  if (!found.replies.length) replies.append(el("li", {}, found.replies_complete ? "none" : "none found so far"));
  document.body.dataset.loaded = "message";
}

function main() {
  const match = /^\/message\/(.+)$/.exec(location.pathname);
  if (match) {
    showMessage(decodeURIComponent(match[1]), new URLSearchParams(location.search).get("sender") || "");
  } else {
    showMesh();
  }
}

main();
