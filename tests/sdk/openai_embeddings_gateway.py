"""The openai SDK's `client.embeddings.create` through the gateway.

Usage: python openai_embeddings_gateway.py GATEWAY_V1_URL

GATEWAY_V1_URL is an idem gateway on its embedded default (route "mock",
which serves embeddings from the built-in mock provider). Each vector is
recomputed from the mock's documented derivation and must come back
exactly, in the caller's order, whether the item was sent upstream,
cached, or repeated in the batch; asked as floats, as base64, and with the
SDK's default (it asks for base64 and decodes it itself). Exits non-zero
on the first difference.
"""

import array
import base64
import sys
import uuid

import openai
from openai import BadRequestError, OpenAI

from openai_embeddings_mock import check, embedding_of, vectors


def main() -> None:
    client = OpenAI(base_url=sys.argv[1], api_key="sk-any", max_retries=0)
    run = uuid.uuid4().hex[:8]
    items = [f"{run} alpha", f"{run} beta", f"{run} alpha", f"{run} gamma"]

    raw = client.embeddings.with_raw_response.create(model="mock", input=items, encoding_format="float")
    headers = raw.http_response.headers
    batch = raw.parse()
    check("one vector per item, each its own, in order", vectors(batch) == [embedding_of(i, 8) for i in items], vectors(batch))
    check("the first batch is sent", headers["idem-outcome"] == "leader", dict(headers))
    check("a repeated item is sent once", headers["idem-items-sent"] == "3" and headers["idem-items-saved"] == "1", dict(headers))
    check("usage counts what was sent", batch.usage.prompt_tokens >= 1, batch.usage)

    # The same items again, as base64: one task per item, another rendering.
    raw = client.embeddings.with_raw_response.create(model="mock", input=items, encoding_format="base64")
    headers = raw.http_response.headers
    check("the items come from the cache", headers["idem-outcome"] == "cache-hit" and headers["idem-items-sent"] == "0", dict(headers))
    wire = raw.http_response.json()
    check("base64 on the wire", all(isinstance(d["embedding"], str) for d in wire["data"]), wire)
    decoded = [array.array("f", base64.b64decode(d.embedding)).tolist() for d in raw.parse().data]
    check("base64 decodes to the same vectors", decoded == [embedding_of(i, 8) for i in items], decoded)
    check("nothing sent, no usage", raw.parse().usage.prompt_tokens == 0, raw.parse().usage)

    # The SDK's default: it asks for base64 and decodes it.
    raw = client.embeddings.with_raw_response.create(model="mock", input=items + [f"{run} delta"])
    headers = raw.http_response.headers
    check("only the new item is sent", headers["idem-items-sent"] == "1" and headers["idem-items-saved"] == "4", dict(headers))
    got = vectors(raw.parse())
    check("the SDK decodes the same vectors", got == [embedding_of(i, 8) for i in items + [f"{run} delta"]], got)

    tokens = client.embeddings.create(model="mock", input=[[1, 2, 3], [42]], dimensions=16, encoding_format="float")
    check("token arrays, 16 dimensions", vectors(tokens) == [embedding_of([1, 2, 3], 16), embedding_of([42], 16)], vectors(tokens))

    try:
        client.embeddings.create(model="mock", input="", encoding_format="float")
        sys.exit("FAIL an empty input was accepted")
    except BadRequestError as err:
        check("an empty input is a 400 naming input", err.status_code == 400 and err.param == "input", err)
    print(f"openai {openai.__version__}: embeddings through idem (float, base64, the SDK's default, cached, repeated) OK")


if __name__ == "__main__":
    main()
