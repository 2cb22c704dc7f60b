"""The openai SDK's Batch API (`client.batches`) through the gateway.

Usage: python openai_batches.py GATEWAY_V1_URL

GATEWAY_V1_URL is an idem gateway on its embedded default. Uploads a batch
input whose lines repeat one another, creates a batch with an
Idempotency-Key (created again: the same batch), polls it to `completed`
with `batches.retrieve`, reads the output file with `files.content` and
checks every line is there once with its answer, identical lines with the
same answer and counted as answered without a call; lists the batches by
pages; a completed batch cannot be cancelled; then the same for a batch of
the Responses API, and one of embeddings (read back with the SDK's own
types; a base64 line as its bytes). Exits non-zero on the first difference.
"""

import base64
import json
import sys
import time
import uuid

from openai import ConflictError, OpenAI
from openai.types import CreateEmbeddingResponse

from openai_embeddings_mock import check

ENDED = ("completed", "failed", "expired", "cancelled")


def upload(client: OpenAI, name: str, lines: list) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=(name, content), purpose="batch").id


def until_ended(client: OpenAI, batch_id: str):
    deadline = time.monotonic() + 120
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        check("the batch ends within 120 s", time.monotonic() < deadline, batch)
        time.sleep(0.2)


def output(client: OpenAI, file_id: str) -> dict:
    text = client.files.content(file_id).text
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    by_id = {line["custom_id"]: line for line in lines}
    check("each custom_id once in the output", len(by_id) == len(lines), lines)
    return by_id


def chat_batch(client: OpenAI, run: str) -> None:
    # 30 lines, 10 distinct prompts: each prompt three times.
    lines = [
        {
            "custom_id": f"{run}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "mock", "messages": [{"role": "user", "content": f"{run} prompt {i % 10}"}]},
        }
        for i in range(30)
    ]
    file_id = upload(client, f"{run}.jsonl", lines)
    key = {"Idempotency-Key": f"sdk-batch-{run}"}
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": run},
        extra_headers=key,
    )
    check("a batch object", batch.object == "batch" and batch.status == "validating", batch)
    again = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": run},
        extra_headers=key,
    )
    check("created again with its key: the same batch", again.id == batch.id, again)

    done = until_ended(client, batch.id)
    check("completed", done.status == "completed", done)
    counts = done.request_counts
    check("every line counted", (counts.total, counts.completed, counts.failed) == (30, 30, 0), counts)
    idem = done.to_dict().get("idem", {})
    check("20 lines answered without a call", idem.get("deduplicated") == 20, idem)
    check("times in seconds", done.completed_at is not None and done.completed_at >= done.created_at, done)
    check("metadata kept", done.metadata == {"run": run}, done.metadata)

    out = output(client, done.output_file_id)
    check("30 output lines", sorted(out) == sorted(line["custom_id"] for line in lines), sorted(out))
    for i in range(30):
        line = out[f"{run}-{i}"]
        check("a 200 response", line["response"]["status_code"] == 200 and line["error"] is None, line)
        body = line["response"]["body"]
        check("a chat completion", body["object"] == "chat.completion" and body["choices"], body)
        first = out[f"{run}-{i % 10}"]["response"]["body"]
        check("identical lines, one answer", body["choices"] == first["choices"], (body, first))

    # One batch a page: the SDK follows `has_more` and `after`.
    ids = []
    for b in client.batches.list(limit=1):
        ids.append(b.id)
        if len(ids) == 3:
            break
    check("listed, newest first", batch.id in ids, ids)
    try:
        client.batches.cancel(batch.id)
        check("a completed batch cannot be cancelled", False, batch.id)
    except ConflictError:
        pass


def responses_batch(client: OpenAI, run: str) -> None:
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": "mock", "input": f"{run} responses {i % 2}"},
        }
        for i in range(4)
    ]
    file_id = upload(client, f"{run}-responses.jsonl", lines)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")
    done = until_ended(client, batch.id)
    check("a Responses batch completed", done.status == "completed", done)
    out = output(client, done.output_file_id)
    check("4 output lines", sorted(out) == [f"r-{i}" for i in range(4)], sorted(out))
    for line in out.values():
        body = line["response"]["body"]
        check("a response object", body["object"] == "response" and body["status"] == "completed", body)


def embeddings_batch(client: OpenAI, run: str) -> None:
    inputs = [[f"{run} a", f"{run} b"], f"{run} c", [f"{run} a", f"{run} b"], [f"{run} b", f"{run} d"]]
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "mock", "input": item, "encoding_format": "base64" if i == 3 else "float"},
        }
        for i, item in enumerate(inputs)
    ]
    file_id = upload(client, f"{run}-embeddings.jsonl", lines)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    done = until_ended(client, batch.id)
    check("an embeddings batch completed", done.status == "completed", done)
    out = output(client, done.output_file_id)
    check("4 output lines", sorted(out) == [f"e-{i}" for i in range(4)], sorted(out))
    for i, item in enumerate(inputs):
        body = out[f"e-{i}"]["response"]["body"]
        want = len(item) if isinstance(item, list) else 1
        check("one embedding per item", len(body["data"]) == want, body)
        if i == 3:
            # base64: the little-endian f32s.
            sizes = {len(base64.b64decode(d["embedding"])) % 4 for d in body["data"]}
            check("base64 vectors", sizes == {0}, body)
        else:
            listed = CreateEmbeddingResponse.model_validate(body)
            check("float vectors", all(isinstance(d.embedding, list) for d in listed.data), body)
    first, again = out["e-0"]["response"]["body"], out["e-2"]["response"]["body"]
    check("identical lines, one answer", first["data"] == again["data"], (first, again))


def main() -> None:
    client = OpenAI(base_url=sys.argv[1], api_key="sk-any", max_retries=0)
    run = uuid.uuid4().hex[:8]
    chat_batch(client, run)
    responses_batch(client, run)
    embeddings_batch(client, run)
    print("openai batches: create (and again with its key), retrieve to completed, output, list, cancel refused; Responses and embeddings batches: ok")


if __name__ == "__main__":
    main()
