"""The anthropic SDK's Message Batches (`client.messages.batches`) through
the gateway.

Usage: python anthropic_batches.py GATEWAY_URL

GATEWAY_URL is an idem gateway on its embedded default (no /v1: the SDK
adds it). Creates a batch whose requests repeat one another, with an
Idempotency-Key (created again: the same batch), polls it to `ended` with
`batches.retrieve`, reads `batches.results` (which follows the batch's
`results_url`) and checks every request is there once: the answered ones
with their message, identical ones with the same, a request without
`max_tokens` errored as the Messages API would refuse it; lists the
batches by pages; cancelling an ended batch answers it as it is; deletes
it, after which it is not found. Exits non-zero on the first difference.
"""

import sys
import time
import uuid

from anthropic import Anthropic, NotFoundError

from openai_embeddings_mock import check


def main() -> None:
    client = Anthropic(base_url=sys.argv[1], api_key="sk-any", max_retries=0)
    run = uuid.uuid4().hex[:8]
    requests = [
        {
            "custom_id": f"{run}-{i}",
            "params": {
                "model": "mock",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": f"{run} message {i % 5}"}],
            },
        }
        for i in range(15)
    ]
    requests.append(
        {"custom_id": f"{run}-bad", "params": {"model": "mock", "messages": [{"role": "user", "content": "no max"}]}}
    )
    key = {"Idempotency-Key": f"sdk-msgbatch-{run}"}
    batch = client.messages.batches.create(requests=requests, extra_headers=key)
    check("a message batch", batch.type == "message_batch" and batch.id.startswith("msgbatch_"), batch)
    check("16 requests processing", batch.processing_status == "in_progress" and batch.request_counts.processing == 16, batch)
    again = client.messages.batches.create(requests=requests, extra_headers=key)
    check("created again with its key: the same batch", again.id == batch.id, again)

    deadline = time.monotonic() + 120
    while True:
        got = client.messages.batches.retrieve(batch.id)
        if got.processing_status == "ended":
            break
        check("the batch ends within 120 s", time.monotonic() < deadline, got)
        time.sleep(0.2)
    counts = got.request_counts
    check(
        "every request counted",
        (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 15, 1, 0, 0),
        counts,
    )
    check("a results_url", got.results_url is not None and got.results_url.endswith(f"/{batch.id}/results"), got)
    check("ended_at", got.ended_at is not None and got.ended_at >= got.created_at, got)
    idem = got.to_dict().get("idem", {})
    check("10 requests answered without a call", idem.get("deduplicated") == 10, idem)

    results = {r.custom_id: r for r in client.messages.batches.results(batch.id)}
    check("16 results", sorted(results) == sorted(r["custom_id"] for r in requests), sorted(results))
    for i in range(15):
        r = results[f"{run}-{i}"].result
        check("succeeded", r.type == "succeeded", r)
        check("a message", r.message.type == "message" and r.message.content[0].type == "text", r)
        first = results[f"{run}-{i % 5}"].result.message
        check("identical requests, one answer", r.message.content == first.content, (r, first))
    bad = results[f"{run}-bad"].result
    check("a request the Messages API refuses is errored", bad.type == "errored", bad)
    check("as invalid_request_error", bad.error.error.type == "invalid_request_error", bad)

    ids = []
    for b in client.messages.batches.list(limit=1):
        ids.append(b.id)
        if len(ids) == 3:
            break
    check("listed, newest first", ids[0] == batch.id, ids)
    cancelled = client.messages.batches.cancel(batch.id)
    check("an ended batch's cancel answers it as it is", cancelled.processing_status == "ended", cancelled)
    deleted = client.messages.batches.delete(batch.id)
    check("deleted", deleted.type == "message_batch_deleted" and deleted.id == batch.id, deleted)
    try:
        client.messages.batches.retrieve(batch.id)
        check("a deleted batch is not found", False, batch.id)
    except NotFoundError:
        pass
    print("anthropic message batches: create (and again with its key), retrieve to ended, results, list, cancel, delete: ok")


if __name__ == "__main__":
    main()
