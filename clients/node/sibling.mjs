#!/usr/bin/env node
// The sibling scenario played by a Node.js agent host, written from protos/ and
// docs/clients.md alone: a parent and its children A and B; A sends B a random
// secret that B was never given, B consumes it and replies quoting it, A consumes
// the reply, and both report to the parent, which consumes both reports. One
// Consume stream delivers for all three agents. One call is refused on purpose
// and its google.rpc.Status / ErrorInfo decoded.
//
//   node clients/node/sibling.mjs --address 127.0.0.1:50051 [--timeout 60] [--heartbeats 0]
//
// --heartbeats N keeps the stream open at the end until N heartbeats came on it.
//
// Prints one JSON line at the end ({"ok": true, ...}); anything unexpected (an
// event, a receipt status, an ack result, the timeout) fails the run with exit
// code 1, a message on stderr and {"ok": false, "failure": ...} on stdout.

import { randomBytes, randomUUID } from "node:crypto";
import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

// protobufjs is proto-loader's own dependency (pinned by package-lock.json);
// resolved from there, it decodes google.rpc.Status outside of any call.
const protobuf = createRequire(createRequire(import.meta.url).resolve("@grpc/proto-loader"))("protobufjs");

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
const INCLUDE_DIRS = [join(ROOT, "protos"), join(ROOT, "protos", "third_party")];
const SERVICE_PROTOS = ["inboxmesh/registry/v1/registry.proto", "inboxmesh/inbox/v1/inbox.proto"];
const STATUS_PROTOS = ["google/rpc/status.proto", "google/rpc/error_details.proto"];
const ERROR_INFO_TYPE_URL = "type.googleapis.com/google.rpc.ErrorInfo";
const CALL_DEADLINE_MS = 10_000;

class Failure extends Error {}

function fail(message) {
  throw new Failure(message);
}

function parseOptions() {
  const { values } = parseArgs({
    options: {
      address: { type: "string" },
      timeout: { type: "string", default: "60" },
      heartbeats: { type: "string", default: "0" },
    },
  });
  if (!values.address) fail("--address HOST:PORT is required (the mesh's plaintext loopback address)");
  const timeoutS = Number(values.timeout);
  if (!(timeoutS > 0)) fail(`--timeout must be a positive number of seconds, not ${values.timeout}`);
  const heartbeats = Number(values.heartbeats);
  if (!Number.isInteger(heartbeats) || heartbeats < 0) {
    fail(`--heartbeats must be a whole number, not ${values.heartbeats}`);
  }
  return { address: values.address, timeoutMs: timeoutS * 1000, heartbeats };
}

function loadServices() {
  const definition = protoLoader.loadSync(SERVICE_PROTOS, {
    includeDirs: INCLUDE_DIRS,
    keepCase: true, // field names as the protos spell them
    longs: String, // uint64 sequences and request ids as decimal strings
    enums: String,
    defaults: true,
    oneofs: true, // SubscribeResponse.event names the oneof case
  });
  const loaded = grpc.loadPackageDefinition(definition);
  return { Registry: loaded.inboxmesh.registry.v1.RegistryService, Inbox: loaded.inboxmesh.inbox.v1.InboxService };
}

function loadStatusTypes() {
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) =>
    INCLUDE_DIRS.map((dir) => join(dir, target)).find((path) => existsSync(path)) ?? target;
  root.loadSync(STATUS_PROTOS, { keepCase: true }); // google/protobuf/*.proto are built into protobufjs
  return { Status: root.lookupType("google.rpc.Status"), ErrorInfo: root.lookupType("google.rpc.ErrorInfo") };
}

function bearer(credential) {
  const metadata = new grpc.Metadata();
  metadata.add("authorization", `Bearer ${credential}`);
  return metadata;
}

function deadline() {
  return { deadline: Date.now() + CALL_DEADLINE_MS };
}

function unary(client, method, request, metadata = new grpc.Metadata()) {
  return new Promise((resolveCall, rejectCall) => {
    client[method](request, metadata, deadline(), (error, response) => {
      if (error) rejectCall(Object.assign(error, { method }));
      else resolveCall(response);
    });
  });
}

function codeName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code) ?? String(code);
}

function describe(error) {
  if (error instanceof Failure || typeof error?.code !== "number") return error?.message ?? String(error);
  return `${error.method ?? "the call"} failed with ${codeName(error.code)}: ${error.details}`;
}

// A failed call's google.rpc.Status, from the `grpc-status-details-bin` trailer, with its ErrorInfo.
function decodeRefusal(error, types) {
  const [raw] = error.metadata?.get("grpc-status-details-bin") ?? [];
  if (!raw) fail(`the refused call (${describe(error)}) carries no grpc-status-details-bin trailer`);
  const status = types.Status.toObject(types.Status.decode(raw), { defaults: true });
  if (status.code !== error.code) fail(`google.rpc.Status code ${status.code} is not the call's ${error.code}`);
  if (status.message !== error.details) {
    fail(`google.rpc.Status message ${JSON.stringify(status.message)}`
      + ` is not the call's ${JSON.stringify(error.details)}`);
  }
  const infos = status.details.filter((any) => any.type_url === ERROR_INFO_TYPE_URL);
  if (infos.length !== 1) {
    const found = JSON.stringify(status.details.map((any) => any.type_url));
    fail(`expected one ${ERROR_INFO_TYPE_URL} in the status details, found ${found}`);
  }
  const info = types.ErrorInfo.toObject(types.ErrorInfo.decode(infos[0].value), { defaults: true });
  return {
    code: status.code,
    code_name: codeName(status.code),
    message: status.message,
    domain: info.domain,
    reason: info.reason,
    metadata: info.metadata,
  };
}

class SiblingHost {
  constructor(address, services, statusTypes, heartbeatsWanted) {
    const insecure = grpc.credentials.createInsecure();
    this.registry = new services.Registry(address, insecure);
    this.inbox = new services.Inbox(address, insecure);
    this.statusTypes = statusTypes;
    this.conversation = `sibling-${randomUUID()}`;
    this.secret = `SEC-${randomBytes(6).toString("hex")}`;
    this.ids = {
      secret: `secret-${randomUUID()}`,
      reply: `reply-${randomUUID()}`,
      report_a: `report-a-${randomUUID()}`,
      report_b: `report-b-${randomUUID()}`,
      refused: `forged-${randomUUID()}`,
    };
    this.agents = {}; // role -> {agent_id, credential}
    this.done = []; // the steps done so far, for the timeout's message
    this.waitingFor = "the registrations";
    this.heartbeats = 0;
    this.heartbeatsWanted = heartbeatsWanted;
    this.enoughHeartbeats = new Promise((resolveEnough) => {
      this.resolveEnoughHeartbeats = resolveEnough;
    });
    this.nextRequestId = 1;
    this.pendingAcks = new Map(); // request_id -> {role, message_id, onConsumed}
    this.turns = { parent: 0, A: 0, B: 0 };
    this.seen = new Set(); // message ids delivered so far: a second delivery is unexpected
    this.reportsConsumed = new Set();
    this.stream = null;
    this.ending = false;
    this.waiters = []; // {kind, requestId, waiting: agent ids, resolve}: the ATTACHED / DETACHED awaited
    // Every failure of a callback (the stream's, an ack's, a send's) rejects this one, which never resolves.
    this.failure = new Promise((_, rejectFailure) => {
      this.rejectFailure = rejectFailure;
    });
    this.failure.catch(() => {}); // observed by until(); no unhandled rejection in between
    this.reportsTaken = new Promise((resolveTaken) => {
      this.resolveReportsTaken = resolveTaken;
    });
  }

  step(what) {
    this.done.push(what);
  }

  progress() {
    return `waiting for ${this.waitingFor}; done so far: ${this.done.join(", ") || "nothing"}`;
  }

  roleOf(agentId) {
    return Object.keys(this.agents).find((role) => this.agents[role].agent_id === agentId);
  }

  // Callbacks of the stream and of the sends run outside run()'s await chain: route their failures to it.
  guard(work) {
    Promise.resolve().then(work).catch((error) => this.rejectFailure(error));
  }

  // Waits for `promise`, or fails at once with the first failure of a callback.
  until(promise) {
    return Promise.race([promise, this.failure]);
  }

  async register() {
    const parent = await unary(this.registry, "RegisterAgent", { name: "parent", mode: "AGENT_MODE_MAIN" });
    this.agents.parent = { agent_id: parent.agent.agent_id, credential: parent.credential };
    const children = await unary(this.registry, "RegisterChildren", {
      children: ["A", "B"].map((name) => ({ name, mode: "AGENT_MODE_ASYNC", parent_id: parent.agent.agent_id })),
    }, bearer(parent.credential));
    if (children.results.length !== 2) {
      fail(`RegisterChildren answered ${children.results.length} results for 2 children`);
    }
    children.results.forEach((result, index) => {
      const name = ["A", "B"][index];
      if (result.error) fail(`RegisterChildren refused ${name}: ${result.error.reason}: ${result.error.message}`);
      const { agent, credential } = result.registered;
      if (agent.parent_id !== parent.agent.agent_id || agent.name !== name) {
        fail(`RegisterChildren result ${index} is ${agent.name} with parent ${agent.parent_id},`
          + ` not ${name} of ${parent.agent.agent_id}`);
      }
      this.agents[name] = { agent_id: agent.agent_id, credential };
    });
  }

  async send(role, envelope) {
    const message = { ...envelope, conversation_id: this.conversation };
    const response = await unary(this.inbox, "Send", { messages: [message] }, bearer(this.agents[role].credential));
    if (response.receipts.length !== 1) {
      fail(`${role}'s send of ${message.message_id} got ${response.receipts.length} receipts`);
    }
    const [receipt] = response.receipts;
    if (receipt.status !== "RECEIPT_STATUS_ACCEPTED" || receipt.message_id !== message.message_id
        || receipt.recipient !== message.recipient) {
      fail(`${role}'s send of ${message.message_id} to ${message.recipient}: receipt ${receipt.status}`
        + ` for ${receipt.message_id} to ${receipt.recipient} (${receipt.detail || "no detail"}), expected ACCEPTED`);
    }
    return receipt;
  }

  // A sends as B: refused as a whole (PERMISSION_DENIED / SENDER_MISMATCH), nothing stored.
  async refusedSend() {
    const forged = {
      message_id: this.ids.refused, sender: this.agents.B.agent_id, recipient: this.agents.parent.agent_id,
      kind: "MESSAGE_KIND_TEXT", content: { text: "A pretending to be B" }, conversation_id: this.conversation,
    };
    try {
      const response = await unary(this.inbox, "Send", { messages: [forged] }, bearer(this.agents.A.credential));
      fail(`A's send as B was not refused: receipts ${JSON.stringify(response.receipts)}`);
    } catch (error) {
      if (error instanceof Failure) throw error;
      const refusal = decodeRefusal(error, this.statusTypes);
      if (refusal.domain !== "inboxmesh" || refusal.code !== grpc.status.PERMISSION_DENIED
          || refusal.reason !== "SENDER_MISMATCH") {
        fail(`A's send as B was refused with ${refusal.code_name} ${refusal.domain}/${refusal.reason},`
          + " expected PERMISSION_DENIED inboxmesh/SENDER_MISMATCH");
      }
      return refusal;
    }
  }

  openStream() {
    this.stream = this.inbox.Consume(); // credentials go in the first request, not the metadata
    this.stream.on("data", (response) => this.guard(() => this.onResponse(response)));
    this.stream.on("error", (error) => {
      if (!this.ending) this.rejectFailure(new Failure(`the Consume stream failed: ${describe(error)}`));
    });
    this.stream.on("end", () => {
      if (!this.ending) this.rejectFailure(new Failure("the Consume stream ended before the scenario did"));
    });
    this.streamStatus = new Promise((resolveStatus) => this.stream.on("status", resolveStatus));
    const attached = this.expectSubscription("ATTACHED", 0);
    const credentials = ["parent", "A", "B"].map((role) => this.agents[role].credential);
    this.stream.write({ subscribe: { credentials } });
    return attached;
  }

  // Resolves once every agent got a `kind` subscription event answering request `requestId`.
  expectSubscription(kind, requestId) {
    const waiting = new Set(Object.values(this.agents).map((agent) => agent.agent_id));
    return new Promise((resolveAll) => {
      this.waiters.push({ kind, requestId: String(requestId), waiting, resolve: resolveAll });
    });
  }

  onResponse(response) {
    switch (response.event) {
      case "heartbeat":
        this.heartbeats += 1;
        if (this.heartbeats >= this.heartbeatsWanted) this.resolveEnoughHeartbeats();
        return;
      case "subscription":
        return this.onSubscription(response.subscription);
      case "deliveries":
        for (const envelope of response.deliveries.messages) this.onDelivery(envelope);
        return;
      case "acked":
        return this.onAcked(response.acked);
      default:
        fail(`unexpected answer on the Consume stream: ${response.event} ${JSON.stringify(response)}`);
    }
  }

  onSubscription(event) {
    const kind = event.kind.replace("SUBSCRIPTION_EVENT_KIND_", "");
    const waiter = this.waiters.find((w) => w.kind === kind && w.requestId === String(event.request_id)
      && w.waiting.has(event.agent_id));
    if (!waiter) {
      fail(`unexpected subscription event ${kind} for ${this.roleOf(event.agent_id) ?? event.agent_id}`
        + ` (request ${event.request_id}): ${event.detail || event.error?.reason || "no detail"}`);
    }
    waiter.waiting.delete(event.agent_id);
    if (waiter.waiting.size === 0) {
      this.waiters.splice(this.waiters.indexOf(waiter), 1);
      waiter.resolve();
    }
  }

  onDelivery(envelope) {
    const role = this.roleOf(envelope.recipient);
    const sender = this.roleOf(envelope.sender) ?? envelope.sender;
    const what = `${envelope.kind} ${envelope.message_id} from ${sender} to ${role ?? envelope.recipient}`;
    if (this.seen.has(envelope.message_id) || envelope.delivery_attempt !== 1) {
      fail(`unexpected redelivery (attempt ${envelope.delivery_attempt}) of ${what}`);
    }
    this.seen.add(envelope.message_id);
    const expect = (condition) => {
      if (!condition) fail(`unexpected delivery: ${what}`);
    };
    if (role === "B") {
      expect(envelope.message_id === this.ids.secret && sender === "A" && envelope.kind === "MESSAGE_KIND_TEXT");
      this.ack("B", envelope, () => this.bReplies(envelope));
    } else if (role === "A") {
      expect(envelope.message_id === this.ids.reply && sender === "B" && envelope.kind === "MESSAGE_KIND_REPLY"
        && envelope.in_reply_to === this.ids.secret);
      this.ack("A", envelope, () => this.aReports(envelope));
    } else if (role === "parent") {
      const report = { A: this.ids.report_a, B: this.ids.report_b }[sender];
      expect(report === envelope.message_id && envelope.kind === "MESSAGE_KIND_COMPLETION");
      this.ack("parent", envelope, () => this.parentTakes(envelope));
    } else {
      expect(false);
    }
  }

  // Acks one message on the stream in the agent's next turn; `onConsumed` runs on a CONSUMED result only.
  ack(role, envelope, onConsumed) {
    const requestId = String(this.nextRequestId++);
    this.turns[role] += 1;
    this.pendingAcks.set(requestId, { role, message_id: envelope.message_id, onConsumed });
    this.stream.write({
      ack: {
        agent_id: this.agents[role].agent_id,
        sequences: [envelope.sequence],
        request_id: requestId,
        turn: this.turns[role],
      },
    });
  }

  onAcked(acked) {
    const pending = this.pendingAcks.get(String(acked.request_id));
    if (!pending) fail(`an acked answer for request ${acked.request_id}, which this host never sent`);
    this.pendingAcks.delete(String(acked.request_id));
    if (acked.error) {
      const { reason, message } = acked.error;
      fail(`${pending.role}'s ack of ${pending.message_id} was refused: ${reason}: ${message}`);
    }
    const [result] = acked.results;
    if (acked.agent_id !== this.agents[pending.role].agent_id || acked.results.length !== 1
        || result.message_id !== pending.message_id || result.status !== "ACK_STATUS_CONSUMED") {
      fail(`${pending.role}'s ack of ${pending.message_id} answered ${JSON.stringify(acked)},`
        + " expected one CONSUMED result");
    }
    this.guard(pending.onConsumed);
  }

  async bReplies(consumed) {
    this.step("B consumed A's message");
    const [quoted] = consumed.content.text.match(/SEC-[0-9a-f]{12}/) ?? [];
    if (!quoted) fail(`B consumed A's message without a secret in it: ${JSON.stringify(consumed.content.text)}`);
    await this.send("B", {
      message_id: this.ids.reply, recipient: this.agents.A.agent_id, kind: "MESSAGE_KIND_REPLY",
      in_reply_to: consumed.message_id, content: { text: `B here: the secret you sent me is ${quoted}.` },
    });
    this.step("B replied to A");
    await this.send("B", {
      message_id: this.ids.report_b, recipient: this.agents.parent.agent_id, kind: "MESSAGE_KIND_COMPLETION",
      content: { text: `B: received the secret ${quoted} from A and replied to A quoting it.` },
    });
    this.step("B reported to the parent");
  }

  async aReports(reply) {
    this.step("A consumed B's reply");
    if (!reply.content.text.includes(this.secret)) {
      fail(`B's reply does not quote A's secret ${this.secret}: ${JSON.stringify(reply.content.text)}`);
    }
    await this.send("A", {
      message_id: this.ids.report_a, recipient: this.agents.parent.agent_id, kind: "MESSAGE_KIND_COMPLETION",
      content: { text: `A: sent B the secret; B's reply (${reply.message_id}) quoted it back.` },
    });
    this.step("A reported to the parent");
  }

  parentTakes(report) {
    this.reportsConsumed.add(report.message_id);
    this.step(`the parent consumed ${report.message_id === this.ids.report_a ? "A" : "B"}'s report`);
    if (this.reportsConsumed.size === 2) this.resolveReportsTaken();
  }

  // Detach all three agents (one DETACHED each), then half-close: the mesh ends the call with OK.
  async closeStream() {
    const requestId = String(this.nextRequestId++);
    const detached = this.expectSubscription("DETACHED", requestId);
    const agentIds = Object.values(this.agents).map((agent) => agent.agent_id);
    this.stream.write({ detach: { agent_ids: agentIds, request_id: requestId } });
    await detached;
    this.ending = true;
    this.stream.end();
    const status = await this.streamStatus;
    if (status.code !== grpc.status.OK) {
      fail(`the Consume stream ended with ${codeName(status.code)}: ${status.details}`);
    }
  }

  async run() {
    await this.register();
    this.step("registered parent, A and B");
    this.waitingFor = "ATTACHED for the three agents";
    await this.until(this.openStream());
    this.step("the three agents ATTACHED");
    // The refusal comes while the stream is open: were the forged message stored, a delivery would fail the run.
    this.waitingFor = "the refusal of A's send as B";
    const refusal = await this.refusedSend();
    this.step(`A's send as B refused (${refusal.reason})`);
    this.waitingFor = "the receipt of A's message to B";
    await this.send("A", {
      message_id: this.ids.secret, recipient: this.agents.B.agent_id, kind: "MESSAGE_KIND_TEXT",
      content: { text: `A to B: the secret code is ${this.secret}. Reply to this message quoting it.` },
    });
    this.step("A sent B the secret");
    this.waitingFor = "the exchange to end with the parent consuming both reports";
    await this.until(this.reportsTaken);
    if (this.pendingAcks.size) fail(`acks left unanswered: ${[...this.pendingAcks.keys()]}`);
    this.waitingFor = `${this.heartbeatsWanted} heartbeats on the stream (${this.heartbeats} so far)`;
    if (this.heartbeats < this.heartbeatsWanted) await this.until(this.enoughHeartbeats);
    this.waitingFor = "DETACHED for the three agents and the stream's end";
    await this.until(this.closeStream());
    const { refused, ...messages } = this.ids;
    return {
      ok: true,
      agents: Object.fromEntries(Object.entries(this.agents).map(([role, agent]) => [role, agent.agent_id])),
      messages,
      secret: this.secret,
      conversation_id: this.conversation,
      error: { ...refusal, message_id: refused },
      heartbeats: this.heartbeats,
    };
  }

  close() {
    this.ending = true;
    this.stream?.cancel();
    this.registry.close();
    this.inbox.close();
  }
}

async function main() {
  let host;
  let timer;
  try {
    const { address, timeoutMs, heartbeats } = parseOptions();
    host = new SiblingHost(address, loadServices(), loadStatusTypes(), heartbeats);
    const timeout = new Promise((_, rejectTimeout) => {
      timer = setTimeout(() => rejectTimeout(new Failure(`timed out after ${timeoutMs / 1000} s ${host.progress()}`)),
        timeoutMs);
    });
    const outcome = await Promise.race([host.run(), timeout]);
    return [outcome, 0];
  } catch (error) {
    const failure = describe(error);
    const bug = !(error instanceof Failure) && typeof error?.code !== "number"; // not the mesh's answer: show where
    process.stderr.write(`sibling.mjs failed: ${failure}\n${bug ? `${error.stack}\n` : ""}`);
    return [{ ok: false, failure }, 1];
  } finally {
    clearTimeout(timer);
    host?.close();
  }
}

const [outcome, exitCode] = await main();
process.stdout.write(`${JSON.stringify(outcome)}\n`, () => process.exit(exitCode));
