"""The official `openai` Python package against a running idem.

Usage: python openai_sdk.py BASE_URL [--http2]   (e.g. http://127.0.0.1:18080/v1)

Checks what the README shows: a plain and a streamed chat completion, and an
Idempotency-Key replay; with --http2, over HTTP/2 with prior knowledge (an
httpx client with HTTP/1.1 off, as docs/http-api.md shows). Exits non-zero on the
first difference.
"""

import sys
import uuid

import httpx
from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1]
    http2 = "--http2" in sys.argv[2:]
    http_client = httpx.Client(http1=False, http2=True) if http2 else None
    client = OpenAI(
        base_url=base_url,
        api_key="sk-any-key-works-on-the-default",
        max_retries=0,
        http_client=http_client,
    )
    expected_version = "HTTP/2" if http2 else "HTTP/1.1"
    question = f"Where is my order? {uuid.uuid4()}"
    messages = [{"role": "user", "content": question}]

    raw = client.chat.completions.with_raw_response.create(model="mock", messages=messages)
    assert raw.http_response.http_version == expected_version, raw.http_response.http_version
    plain = raw.parse()
    text = plain.choices[0].message.content
    assert text and question in text, text
    assert plain.object == "chat.completion", plain.object

    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model="mock", messages=messages, stream=True)
        if chunk.choices
    )
    assert streamed == text, (streamed, text)

    key = f"refund-{uuid.uuid4()}"
    refund = [{"role": "user", "content": "Refund order 45"}]
    first = client.chat.completions.with_raw_response.create(
        model="mock", messages=refund, extra_headers={"Idempotency-Key": key}
    )
    again = client.chat.completions.with_raw_response.create(
        model="mock", messages=refund, extra_headers={"Idempotency-Key": key}
    )
    assert first.headers["idem-job-id"] == again.headers["idem-job-id"]
    assert again.headers.get("idempotent-replayed") == "true", dict(again.headers)
    assert first.parse().choices[0].message.content == again.parse().choices[0].message.content

    print(
        f"openai {sys.modules['openai'].__version__} over {expected_version}: "
        "plain, streamed and idempotent completions OK"
    )


if __name__ == "__main__":
    main()
