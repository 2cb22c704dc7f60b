"""The official SDKs on idem's other faces: `anthropic` on /v1/messages and
`openai`'s `responses` resource on /v1/responses.

Usage: python faces_sdk.py GATEWAY_ROOT_URL MOCK_URL KEY_A KEY_B

GATEWAY_ROOT_URL is an idem gateway (no /v1) with three routes: "gpt",
one target on an OpenAI-compatible provider, "claude", one target of kind
"anthropic", and "gpt-native", one target on a provider with
`responses_api = true`; all in front of the `idem mock-upstream` at
MOCK_URL. KEY_A
and KEY_B are two tenants' keys. Each SDK, unmodified, must get from each
route: a plain answer, a stream (and the SDK's stream helper), and a
function tool call round trip; the Responses API also `store` with
`previous_response_id`, and `retrieve` and `delete` scoped to the tenant.
Exits non-zero on the first difference.
"""

import json
import sys
import urllib.request
import uuid

import anthropic
import openai


def check(what: str, ok: bool, detail="") -> None:
    if not ok:
        sys.exit(f"FAIL {what}: {detail}")


def last_upstream_body(mock: str) -> dict:
    with urllib.request.urlopen(f"{mock}/_mock/stats") as r:
        stats = json.load(r)
    return stats["last_requests"][-1]["body"]


def upstream_texts(body: dict) -> str:
    """Every text the last upstream request carried, whatever its format."""
    return json.dumps(body)


LOOKUP_SCHEMA = {
    "type": "object",
    "properties": {"order": {"type": "string"}},
    "required": ["order"],
}


def messages_face(root: str, key: str, model: str, run: str) -> None:
    client = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0)
    where = f"messages via {model}"

    msg = client.messages.create(
        model=model,
        max_tokens=256,
        system="Be brief.",
        messages=[{"role": "user", "content": f"{run} hello"}],
    )
    check(f"{where}: a plain answer", msg.content[0].type == "text"
          and msg.content[0].text.endswith(f"to: {run} hello"), msg)
    check(f"{where}: stop_reason", msg.stop_reason == "end_turn", msg)
    check(f"{where}: usage", msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0, msg.usage)
    check(f"{where}: the id", msg.id.startswith("msg_"), msg.id)

    with client.messages.stream(
        model=model,
        max_tokens=256,
        messages=[{"role": "user", "content": f"{run} stream"}],
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    check(f"{where}: a stream in pieces", len(pieces) > 1
          and "".join(pieces).endswith(f"to: {run} stream"), pieces)
    check(f"{where}: the stream's final message", final.content[0].text == "".join(pieces)
          and final.stop_reason == "end_turn" and final.usage.output_tokens > 0, final)

    # The raw event loop, as older clients write it.
    events = client.messages.create(
        model=model,
        max_tokens=256,
        messages=[{"role": "user", "content": f"{run} raw"}],
        stream=True,
    )
    kinds, text = [], ""
    for event in events:
        kinds.append(event.type)
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
    check(f"{where}: the event sequence", kinds[0] == "message_start" and kinds[-1] == "message_stop"
          and "message_delta" in kinds, kinds)
    check(f"{where}: the raw stream's text", text.endswith(f"to: {run} raw"), text)

    tools = [{"name": "lookup", "description": "find an order", "input_schema": LOOKUP_SCHEMA}]
    question = {"role": "user", "content": f"{run} where is order 1234"}
    msg = client.messages.create(
        model=model,
        max_tokens=256,
        tools=tools,
        tool_choice={"type": "tool", "name": "lookup"},
        messages=[question],
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    check(f"{where}: a tool_use block", len(uses) == 1 and uses[0].name == "lookup"
          and isinstance(uses[0].input, dict) and "order" in uses[0].input, msg)
    check(f"{where}: stop_reason tool_use", msg.stop_reason == "tool_use", msg)
    answer = client.messages.create(
        model=model,
        max_tokens=256,
        tools=tools,
        messages=[
            question,
            {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "shipped yesterday"}]},
        ],
    )
    check(f"{where}: the answer after the tool result", answer.content[0].type == "text", answer)
    check(f"{where}: the tool result went upstream",
          "shipped yesterday" in upstream_texts(last_upstream_body(MOCK)), last_upstream_body(MOCK))

    # Streamed tool use: the input arrives as partial JSON.
    with client.messages.stream(
        model=model,
        max_tokens=256,
        tools=tools,
        tool_choice={"type": "tool", "name": "lookup"},
        messages=[{"role": "user", "content": f"{run} stream a tool call"}],
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    check(f"{where}: a streamed tool_use", len(uses) == 1 and "order" in uses[0].input, final)

    if model == "claude":
        counted = client.messages.count_tokens(
            model=model, messages=[{"role": "user", "content": f"{run} count me"}]
        )
        check(f"{where}: count_tokens", counted.input_tokens > 0, counted)

    try:
        client.messages.create(model="no-such-model", max_tokens=16,
                               messages=[{"role": "user", "content": "hi"}])
        check(f"{where}: an unknown model is refused", False)
    except anthropic.NotFoundError as e:
        check(f"{where}: Anthropic's error shape", e.body["type"] == "error"
              and e.body["error"]["type"] == "not_found_error", e.body)


def responses_face(root: str, key: str, other_key: str, model: str, run: str) -> None:
    client = openai.OpenAI(base_url=f"{root}/v1", api_key=key, max_retries=0)
    other = openai.OpenAI(base_url=f"{root}/v1", api_key=other_key, max_retries=0)
    where = f"responses via {model}"

    r = client.responses.create(model=model, input=f"{run} hello", instructions="Be brief.",
                                store=False)
    check(f"{where}: output_text", r.output_text.endswith(f"to: {run} hello"), r)
    check(f"{where}: status and usage", r.status == "completed" and r.usage.input_tokens > 0
          and r.usage.output_tokens > 0, r)
    check(f"{where}: the id", r.id.startswith("resp_"), r.id)

    stream = client.responses.create(model=model, input=f"{run} stream", stream=True, store=False)
    kinds, text, final = [], "", None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    check(f"{where}: the event sequence", kinds[0] == "response.created"
          and kinds[-1] == "response.completed", kinds)
    check(f"{where}: the stream's text", text.endswith(f"to: {run} stream")
          and final is not None and final.output_text == text, (text, final))

    with client.responses.stream(model=model, input=f"{run} helper", store=False) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    check(f"{where}: the stream helper", "".join(deltas) == final.output_text
          and final.output_text.endswith(f"to: {run} helper"), final)

    tools = [{"type": "function", "name": "lookup", "description": "find an order",
              "parameters": LOOKUP_SCHEMA}]
    question = {"role": "user", "content": f"{run} where is order 1234"}
    r = client.responses.create(model=model, input=[question], tools=tools,
                                tool_choice={"type": "function", "name": "lookup"}, store=False)
    calls = [i for i in r.output if i.type == "function_call"]
    check(f"{where}: a function_call item", len(calls) == 1 and calls[0].name == "lookup"
          and "order" in json.loads(calls[0].arguments), r)
    r = client.responses.create(
        model=model,
        tools=tools,
        store=False,
        input=[question, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "shipped yesterday"}],
    )
    check(f"{where}: the answer after the tool output", r.output_text != "", r)
    check(f"{where}: the tool output went upstream",
          "shipped yesterday" in upstream_texts(last_upstream_body(MOCK)), last_upstream_body(MOCK))

    # store + previous_response_id: the earlier turns go upstream again.
    first = client.responses.create(model=model, input=f"{run} my name is Ada", store=True)
    second = client.responses.create(model=model, input=f"{run} what is my name?",
                                     previous_response_id=first.id, store=True)
    sent = upstream_texts(last_upstream_body(MOCK))
    check(f"{where}: the conversation continues", f"{run} my name is Ada" in sent
          and first.output_text in sent and second.output_text.endswith(f"to: {run} what is my name?"),
          sent)
    check(f"{where}: the continuation names its predecessor",
          second.previous_response_id == first.id, second)
    got = client.responses.retrieve(first.id)
    check(f"{where}: retrieve", got.id == first.id and got.output_text == first.output_text, got)
    try:
        other.responses.retrieve(first.id)
        check(f"{where}: another tenant cannot retrieve it", False)
    except openai.NotFoundError:
        pass
    try:
        other.responses.create(model=model, input="go on", previous_response_id=first.id)
        check(f"{where}: another tenant cannot continue it", False)
    except openai.NotFoundError:
        pass
    client.responses.delete(first.id)
    try:
        client.responses.retrieve(first.id)
        check(f"{where}: a deleted response is gone", False)
    except openai.NotFoundError:
        pass


def main() -> None:
    global MOCK
    root, MOCK, key_a, key_b = sys.argv[1:5]
    for model in ("gpt", "claude", "gpt-native"):
        run = uuid.uuid4().hex[:8]
        messages_face(root, key_a, model, run)
        responses_face(root, key_a, key_b, model, run)
    print("faces: the anthropic and openai SDKs work against /v1/messages and /v1/responses")


MOCK = ""

if __name__ == "__main__":
    main()
