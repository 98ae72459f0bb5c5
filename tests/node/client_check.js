// A Node.js client of a live baton gateway, as a user of @grpc/grpc-js would write one:
// the protos are loaded at run time from protos/ (the proto root) with @grpc/proto-loader.
//
//   node client_check.js GATEWAY_ADDRESS DECODE_ADDRESS PROTO_ROOT
//
// 1. streams a greedy completion and checks it ends with FINISH_REASON_LENGTH and usage;
// 2. starts a long completion, reads a few chunks, reads the decode worker's Stats while
//    the request holds KV blocks, then cancels the call and expects CANCELLED;
// 3. sends a request with a bad temperature and expects INVALID_ARGUMENT naming the field.
// Prints one JSON object with what it saw; exits non-zero (with the reason on stderr) on
// any failed check. tests/test_clients_e2e.py runs it and checks the KV blocks after it.
"use strict";

const assert = require("node:assert/strict");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [gatewayAddress, decodeAddress, protoRoot] = process.argv.slice(2);
if (!gatewayAddress || !decodeAddress || !protoRoot) {
  console.error("usage: node client_check.js GATEWAY_ADDRESS DECODE_ADDRESS PROTO_ROOT");
  process.exit(2);
}

const definition = protoLoader.loadSync(["baton/v1/generate.proto", "baton/v1/worker.proto"], {
  includeDirs: [protoRoot],
  keepCase: true,
  enums: String,
  longs: Number,
  defaults: true,
  oneofs: true,
});
const v1 = grpc.loadPackageDefinition(definition).baton.v1;
const credentials = grpc.credentials.createInsecure();
const baton = new v1.Baton(gatewayAddress, credentials);
const decode = new v1.DecodeWorker(decodeAddress, credentials);

function deadline(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

function promptIds(n, start) {
  return Array.from({ length: n }, (_, i) => 1000 + ((start * 7919 + i * 104729) % 19000));
}

function stats() {
  return new Promise((resolve, reject) => {
    decode.Stats({}, { deadline: deadline(5) }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

// Read a whole stream: resolves with its messages, or rejects with the call's error.
function collect(call) {
  return new Promise((resolve, reject) => {
    const messages = [];
    call.on("data", (m) => messages.push(m));
    call.on("error", reject);
    call.on("end", () => resolve(messages));
  });
}

async function streamOne() {
  const request = {
    token_ids: { ids: promptIds(12, 1) },
    sampling_params: { max_tokens: 8, temperature: 0, ignore_eos: true },
    request_id: "node-stream",
  };
  const messages = await collect(baton.Generate(request, { deadline: deadline(60) }));
  const last = messages[messages.length - 1];
  const tokens = messages.flatMap((m) => m.token_ids);
  assert.equal(last.finish_reason, "FINISH_REASON_LENGTH");
  assert.equal(last.usage.completion_tokens, 8);
  assert.equal(last.usage.prompt_tokens, 12);
  assert.equal(tokens.length, 8);
  assert.ok(messages.every((m) => m.request_id === "node-stream"));
  return { chunks: messages.length, tokens, text: messages.map((m) => m.text).join("") };
}

async function cancelMidStream() {
  const request = {
    token_ids: { ids: promptIds(20, 2) },
    sampling_params: { max_tokens: 1000, temperature: 0, ignore_eos: true },
    request_id: "node-cancel",
  };
  const call = baton.Generate(request, { deadline: deadline(60) });
  let received = 0;
  let during = null;
  const ended = new Promise((resolve, reject) => {
    call.on("data", (m) => {
      received += m.token_ids.length;
      if (received >= 4 && during === null) {
        during = "pending";
        call.pause(); // no more chunks while the worker's load is read
        stats().then(
          (s) => {
            during = s;
            call.cancel();
          },
          (err) => reject(err),
        );
      }
    });
    call.on("error", (err) => resolve(err));
    call.on("end", () => reject(new Error(`stream finished after ${received} tokens, never cancelled`)));
  });
  const err = await ended;
  assert.equal(err.code, grpc.status.CANCELLED, `expected CANCELLED, got ${err.code}: ${err.details}`);
  assert.ok(received < 1000, `received all ${received} tokens`);
  assert.equal(during.num_running, 1, "the request was not running on decode when cancelled");
  assert.ok(during.free_kv_blocks < during.total_kv_blocks, "the request held no KV blocks");
  return {
    tokens_before_cancel: received,
    code: err.code,
    free_kv_blocks_during: during.free_kv_blocks,
    total_kv_blocks: during.total_kv_blocks,
  };
}

async function badRequest() {
  const request = { text: "hello", sampling_params: { max_tokens: 4, temperature: -1 } };
  let err = null;
  try {
    await collect(baton.Generate(request, { deadline: deadline(30) }));
  } catch (e) {
    err = e;
  }
  assert.ok(err !== null, "a negative temperature was accepted");
  assert.equal(err.code, grpc.status.INVALID_ARGUMENT, `got ${err.code}: ${err.details}`);
  assert.match(err.details, /sampling_params\.temperature/);
  return { code: err.code, details: err.details };
}

async function main() {
  const result = {
    stream: await streamOne(),
    cancel: await cancelMidStream(),
    bad_request: await badRequest(),
  };
  process.stdout.write(JSON.stringify(result) + "\n");
  baton.close();
  decode.close();
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : String(err));
  process.exit(1);
});
