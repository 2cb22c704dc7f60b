"""The openai SDK's usual stream loop as a follower and as a cache hit.

Usage: python openai_rendering.py GATEWAY_URL MOCK_URL ADMIN_KEY

GATEWAY_URL is idem's base URL (.../v1) with a route "mock" to the mock
provider at MOCK_URL, which holds every call until released. A leader
streams with `stream_options={"include_usage": True}` and is held; five
followers join its flight without asking for usage, then the call is
released. Each follower, and later a cache hit, is read with the loop the
SDK's documentation shows, `chunk.choices[0].delta.content` without a
guard, which raises IndexError on a usage chunk (it has no choices). The
leader gets its usage chunk. Exits non-zero on the first difference.
"""

import sys
import threading
import time
import uuid

import httpx
from openai import OpenAI


def bare_loop(stream) -> str:
    """The loop as the SDK's README writes it: no check for empty choices."""
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream)


def until(what: str, check, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.02)


def main() -> None:
    gateway, mock, admin_key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = OpenAI(base_url=gateway, api_key="sk-any-key-works-here", max_retries=0)
    control = httpx.Client(timeout=10)
    messages = [{"role": "user", "content": f"Track parcel {uuid.uuid4()}"}]
    results: dict = {}

    def leader() -> None:
        raw = client.chat.completions.with_raw_response.create(
            model="mock",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(raw.parse())
        results["leader"] = (raw.headers.get("idem-outcome"), chunks)

    def follower(i: int) -> None:
        raw = client.chat.completions.with_raw_response.create(
            model="mock", messages=messages, stream=True
        )
        results[i] = (raw.headers.get("idem-outcome"), bare_loop(raw.parse()))

    threads = [threading.Thread(target=leader)]
    threads[0].start()
    until("the leader's call", lambda: control.get(f"{mock}/_mock/stats").json()["held"] == 1)
    threads += [threading.Thread(target=follower, args=(i,)) for i in range(5)]
    for t in threads[1:]:
        t.start()
    stats_url = gateway.rstrip("/") + "/stats"
    headers = {"Authorization": f"Bearer {admin_key}"}
    until(
        "five followers",
        lambda: control.get(stats_url, headers=headers).json()["waiting_followers"] >= 5,
    )
    control.post(f"{mock}/_mock/release", json={})
    for t in threads:
        t.join(30)

    outcome, chunks = results["leader"]
    assert outcome == "leader", outcome
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0, chunks[-1]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    for i in range(5):
        outcome, got = results[i]
        assert outcome == "follower", outcome
        assert got == text, (got, text)

    raw = client.chat.completions.with_raw_response.create(
        model="mock", messages=messages, stream=True
    )
    assert raw.headers.get("idem-outcome") == "cache-hit", dict(raw.headers)
    assert bare_loop(raw.parse()) == text

    print(
        f"openai {sys.modules['openai'].__version__}: the bare stream loop works "
        "as a follower and as a cache hit of a leader that asked for usage"
    )


if __name__ == "__main__":
    main()
