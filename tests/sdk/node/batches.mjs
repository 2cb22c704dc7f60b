// The official openai Node package's Batch API through the gateway.
//
// Usage: node batches.mjs GATEWAY_V1_URL (run from a directory whose
// node_modules holds the package: .ci/sdk-check copies it there).
//
// GATEWAY_V1_URL is an idem gateway on its embedded default. Uploads a
// batch input whose lines repeat one another (`files.create` with
// `toFile`), creates a batch with an Idempotency-Key (created again: the
// same batch), polls it to `completed`, reads the output with
// `files.content` and checks every line is there once with its answer,
// identical lines with one answer, and the lines answered without a call;
// pages through `batches.list`; a completed batch cannot be cancelled.
// Exits non-zero on the first difference.

import OpenAI, { toFile } from "openai";

function check(what, ok, detail) {
  if (!ok) {
    console.error(`FAILED: ${what}: ${JSON.stringify(detail)}`);
    process.exit(1);
  }
}

const ENDED = ["completed", "failed", "expired", "cancelled"];

async function untilEnded(client, id) {
  const deadline = Date.now() + 120_000;
  for (;;) {
    const batch = await client.batches.retrieve(id);
    if (ENDED.includes(batch.status)) return batch;
    check("the batch ends within 120 s", Date.now() < deadline, batch);
    await new Promise((r) => setTimeout(r, 200));
  }
}

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "sk-any", maxRetries: 0 });
const run = Math.random().toString(16).slice(2, 10);
// 12 lines, 4 distinct prompts: each three times.
const lines = Array.from({ length: 12 }, (_, i) => ({
  custom_id: `node-${run}-${i}`,
  method: "POST",
  url: "/v1/chat/completions",
  body: { model: "mock", messages: [{ role: "user", content: `${run} node prompt ${i % 4}` }] },
}));
const content = lines.map((l) => JSON.stringify(l) + "\n").join("");
const file = await client.files.create({
  file: await toFile(Buffer.from(content), `${run}.jsonl`),
  purpose: "batch",
});
check("a file object", file.object === "file" && file.bytes === Buffer.byteLength(content), file);

const params = { input_file_id: file.id, endpoint: "/v1/chat/completions", completion_window: "24h" };
const headers = { headers: { "Idempotency-Key": `node-batch-${run}` } };
const batch = await client.batches.create(params, headers);
check("a batch object", batch.object === "batch" && batch.status === "validating", batch);
const again = await client.batches.create(params, headers);
check("created again with its key: the same batch", again.id === batch.id, again);

const done = await untilEnded(client, batch.id);
check("completed", done.status === "completed", done);
const c = done.request_counts;
check("every line counted", c.total === 12 && c.completed === 12 && c.failed === 0, c);
check("8 lines answered without a call", done.idem && done.idem.deduplicated === 8, done.idem);

const text = await (await client.files.content(done.output_file_id)).text();
const out = new Map();
for (const line of text.split("\n").filter((l) => l.trim())) {
  const parsed = JSON.parse(line);
  check("each custom_id once", !out.has(parsed.custom_id), parsed.custom_id);
  out.set(parsed.custom_id, parsed);
}
check("12 output lines", out.size === 12, [...out.keys()]);
for (let i = 0; i < 12; i++) {
  const line = out.get(`node-${run}-${i}`);
  check("a 200 chat completion", line && line.response.status_code === 200 && line.response.body.object === "chat.completion", line);
  const first = out.get(`node-${run}-${i % 4}`).response.body;
  check("identical lines, one answer", JSON.stringify(line.response.body.choices) === JSON.stringify(first.choices), [line, first]);
}

const ids = [];
for await (const b of client.batches.list({ limit: 1 })) {
  ids.push(b.id);
  if (ids.length === 3) break;
}
check("listed, newest first", ids[0] === batch.id, ids);
try {
  await client.batches.cancel(batch.id);
  check("a completed batch cannot be cancelled", false, batch.id);
} catch (e) {
  check("409 for a completed batch", e instanceof OpenAI.ConflictError, String(e));
}
console.log("openai (node) batches: create (and again with its key), retrieve to completed, output, list, cancel refused: ok");
