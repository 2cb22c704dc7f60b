"""The openai SDK's `client.embeddings.create` against the mock provider.

Usage: python openai_embeddings_mock.py MOCK_URL

MOCK_URL is `idem mock-upstream`'s address (http://HOST:PORT, not holding
its calls); the SDK is given MOCK_URL/v1. Each vector is recomputed here
from the derivation the mock documents (SHA-256 of the item and the
dimensions, with the standard library only) and must be the mock's exactly.
Asked: a string, a list of strings (a repeated item gets the same vector),
token arrays, other dimensions, `encoding_format="float"` and "base64", and
the SDK's default, where the SDK asks for base64 and decodes it itself
(`with_raw_response` shows the wire form). Exits non-zero on the first
difference.
"""

import array
import base64
import hashlib
import json
import math
import struct
import sys

import openai
from openai import BadRequestError, OpenAI


def embedding_of(item, dimensions: int) -> list:
    """The mock's vector of `item` (a string or a token list), as f32 values."""
    if isinstance(item, str):
        encoding = b"s" + item.encode("utf-8")
    else:
        encoding = b"j" + json.dumps(item, separators=(",", ":")).encode()
    seed = hashlib.sha256(
        b"idem mock embedding\n" + struct.pack("<Q", dimensions) + encoding
    ).digest()
    components = []
    block = 0
    while len(components) < dimensions:
        digest = hashlib.sha256(seed + struct.pack("<Q", block)).digest()
        components.extend(u / 4294967295 * 2.0 - 1.0 for u in struct.unpack("<8I", digest))
        block += 1
    components = components[:dimensions]
    total = 0.0
    for x in components:
        total += x * x
    norm = math.sqrt(total) or 1.0
    return [f32(x / norm) for x in components]


def f32(x: float) -> float:
    """`x` rounded to the nearest f32, as the mock sends it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def check(what: str, ok: bool, detail="") -> None:
    if not ok:
        sys.exit(f"FAIL {what}: {detail}")


def vectors(response) -> list:
    """The response's vectors, each number rounded to f32 (a JSON number
    is the shortest text that rounds back to the f32)."""
    shapes = [(item.object, item.index) for item in response.data]
    if shapes != [("embedding", i) for i in range(len(shapes))]:
        sys.exit(f"FAIL the items are not embeddings at indices 0..: {shapes}")
    return [[f32(x) for x in item.embedding] for item in response.data]


def main() -> None:
    mock = sys.argv[1].rstrip("/")
    client = OpenAI(base_url=f"{mock}/v1", api_key="sk-any-key-works-here", max_retries=0)
    model = "text-embedding-3-small"

    one = client.embeddings.create(model=model, input="hello there", encoding_format="float")
    check("a string: a list of one", one.object == "list" and len(one.data) == 1, one)
    check("the model is echoed", one.model == model, one.model)
    check("usage counts the prompt", one.usage.prompt_tokens >= 1 and one.usage.total_tokens == one.usage.prompt_tokens, one.usage)
    got = vectors(one)[0]
    check("8 dimensions by default", len(got) == 8, len(got))
    check("unit length", abs(math.fsum(x * x for x in got) - 1.0) < 1e-5, got)
    check("the vector is the string's", got == embedding_of("hello there", 8), got)

    items = ["alpha", "beta", "alpha", "hello there"]
    batch = client.embeddings.create(model="another-model", input=items, encoding_format="float")
    got = vectors(batch)
    check("a list: one vector per item", len(got) == len(items), len(got))
    check("each vector is its own item's, in order", got == [embedding_of(i, 8) for i in items], got)
    check("a repeated item gets the same vector", got[0] == got[2] and got[0] != got[1])
    check("an item's vector depends neither on the model nor on its place", got[3] == vectors(one)[0])

    tokens = client.embeddings.create(model=model, input=[[1, 2, 3], [42]], dimensions=16, encoding_format="float")
    got = vectors(tokens)
    check("token arrays, 16 dimensions", got == [embedding_of([1, 2, 3], 16), embedding_of([42], 16)], got)
    check("token usage is the arrays' length", tokens.usage.prompt_tokens == 4, tokens.usage)

    # Asked explicitly for base64, the SDK leaves the string as it came.
    raw = client.embeddings.with_raw_response.create(model=model, input=items, encoding_format="base64")
    wire = raw.http_response.json()
    check("base64 on the wire", all(isinstance(d["embedding"], str) for d in wire["data"]), wire)
    parsed = raw.parse()
    decoded = [array.array("f", base64.b64decode(d.embedding)).tolist() for d in parsed.data]
    check("base64 decodes to the same vectors", decoded == [embedding_of(i, 8) for i in items], decoded)

    # The SDK's default: it asks for base64 itself and decodes it.
    raw = client.embeddings.with_raw_response.create(model=model, input=items)
    wire = raw.http_response.json()
    check("the SDK's default asks for base64", all(isinstance(d["embedding"], str) for d in wire["data"]), wire)
    got = vectors(raw.parse())
    check("the SDK decodes it to the same vectors", got == vectors(batch), got)

    try:
        client.embeddings.create(model=model, input="", encoding_format="float")
        sys.exit("FAIL an empty input was accepted")
    except BadRequestError as err:
        check("an empty input is a 400 naming input", err.status_code == 400 and err.param == "input", err)
    print(f"openai {openai.__version__}: embeddings from the mock (float, base64, the SDK's default) OK")


if __name__ == "__main__":
    main()
