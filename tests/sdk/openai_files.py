"""The openai SDK's Files API (`client.files`) through the gateway.

Usage: python openai_files.py GATEWAY_V1_URL

GATEWAY_V1_URL is an idem gateway on its embedded default. Uploads a batch
input file as the SDK does (multipart, purpose "batch"), reads it back
byte for byte, pages through the list one file at a time (the SDK follows
`has_more` and `after`), deletes it and checks it is gone. Exits non-zero
on the first difference.
"""

import json
import os
import sys
import tempfile
import uuid

from openai import NotFoundError, OpenAI

from openai_embeddings_mock import check


def main() -> None:
    client = OpenAI(base_url=sys.argv[1], api_key="sk-any", max_retries=0)
    run = uuid.uuid4().hex[:8]
    lines = [
        {
            "custom_id": f"{run}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "mock", "messages": [{"role": "user", "content": f"{run} {i}"}]},
        }
        for i in range(3000)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    made = []
    with tempfile.TemporaryDirectory() as d:
        for name in ("first", "second"):
            path = os.path.join(d, f"{run}-{name}.jsonl")
            with open(path, "wb") as f:
                f.write(content)
            with open(path, "rb") as f:
                made.append(client.files.create(file=f, purpose="batch"))
    first, second = made
    check("a file object", first.object == "file" and first.purpose == "batch" and first.status == "processed", first)
    check("its size", first.bytes == len(content), first.bytes)
    check("its name", first.filename == f"{run}-first.jsonl", first.filename)
    check("an expiry", first.expires_at is not None and first.expires_at > first.created_at, first)

    got = client.files.retrieve(first.id)
    check("retrieved as created", got == first, got)
    check("the content as uploaded", client.files.content(first.id).read() == content, "content differs")

    # One file a page: the SDK pages with `after` while `has_more`.
    ids = [f.id for f in client.files.list(limit=1, purpose="batch")]
    check("listed newest first, every page", ids[:2] == [second.id, first.id], ids)

    deleted = client.files.delete(first.id)
    check("deleted", deleted.deleted and deleted.id == first.id, deleted)
    try:
        client.files.retrieve(first.id)
        check("a deleted file is gone", False, first.id)
    except NotFoundError:
        pass
    client.files.delete(second.id)
    print("openai files: upload, retrieve, content, list by pages, delete: ok")


if __name__ == "__main__":
    main()
