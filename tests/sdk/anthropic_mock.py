"""The official `anthropic` SDK against the mock provider's Anthropic face.

Usage: python anthropic_mock.py MOCK_URL

MOCK_URL is `idem mock-upstream`'s address (http://HOST:PORT, not holding
its calls), given to the SDK as its base_url (the SDK adds /v1/messages).
Asked: `client.messages.create` (plain), `client.messages.stream` (its
`text_stream`, then `get_final_message()`), tool use (forced by
`tool_choice`, and chosen by the mock's "call tool" marker while
streaming, the input's JSON arriving in several `input_json_delta`
pieces), the stop reasons `max_tokens` and `stop_sequence`, errors (a 400
as `BadRequestError`, a 529 as a status error with `overloaded_error`, a
429 as `RateLimitError`) and `client.messages.count_tokens`. The mock's
`/_mock/stats` must show the key and version the SDK sent. Exits non-zero
on the first difference.
"""

import json
import sys

import anthropic
import httpx
from anthropic import Anthropic

MODEL = "claude-mock-1"
KEY = "sk-ant-any-key-works-here"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
        },
        "required": ["city", "unit"],
    },
}


def check(what: str, ok: bool, detail="") -> None:
    if not ok:
        sys.exit(f"FAIL {what}: {detail}")


def seq_of(message) -> int:
    """The call number in the mock's message id (msg_mock_<seq>)."""
    check("the id is msg_mock_<seq>", message.id.startswith("msg_mock_"), message.id)
    return int(message.id.removeprefix("msg_mock_"))


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def main() -> None:
    mock = sys.argv[1].rstrip("/")
    client = Anthropic(base_url=mock, api_key=KEY, max_retries=0)
    control = httpx.Client(base_url=mock, timeout=10)

    # Plain.
    message = client.messages.create(
        model=MODEL, max_tokens=256, system="be brief", messages=user("hello there")
    )
    seq = seq_of(message)
    check("a message", message.type == "message" and message.role == "assistant", message)
    check("the model is echoed", message.model == MODEL, message.model)
    check("one text block", [b.type for b in message.content] == ["text"], message.content)
    check("the text", message.content[0].text == f"mock answer #{seq} to: hello there", message.content)
    check("end_turn", message.stop_reason == "end_turn" and message.stop_sequence is None, message)
    usage = message.usage
    check("usage", usage.input_tokens >= 1 and usage.output_tokens >= 1, usage)
    check("no cache", usage.cache_creation_input_tokens == 0 and usage.cache_read_input_tokens == 0, usage)

    stats = control.get("/_mock/stats").json()
    last = stats["last_requests"][-1]
    check("the mock saw the key", last["x_api_key"] == KEY, last)
    check("the mock saw the version", bool(last["anthropic_version"]), last)
    check("the endpoint is messages", last["endpoint"] == "messages", last)

    # Token counting: the same input tokens as the answer's usage.
    counted = client.messages.count_tokens(model=MODEL, system="be brief", messages=user("hello there"))
    check("count_tokens is the usage's input_tokens", counted.input_tokens == usage.input_tokens, counted)

    # Streamed: text_stream, then the final message.
    with client.messages.stream(model=MODEL, max_tokens=256, messages=user("tell me a story")) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    seq = seq_of(final)
    check("the streamed text", text == f"mock answer #{seq} to: tell me a story", text)
    check("the final message holds it", [b.text for b in final.content] == [text], final.content)
    check("streamed end_turn", final.stop_reason == "end_turn", final)
    check("streamed usage", final.usage.input_tokens >= 1 and final.usage.output_tokens > 1, final.usage)

    # Tool use, forced by tool_choice.
    message = client.messages.create(
        model=MODEL,
        max_tokens=256,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=user("weather in Paris"),
    )
    check("a forced tool call is the only block", [b.type for b in message.content] == ["tool_use"], message.content)
    call = message.content[0]
    check("the tool", call.name == "get_weather" and call.id.startswith("toolu_"), call)
    check("the input", call.input == {"city": "weather in Paris", "unit": "celsius"}, call.input)
    check("stop_reason tool_use", message.stop_reason == "tool_use", message)

    # Tool use chosen by the marker, streamed: the input arrives in pieces.
    pieces = []
    events = []
    with client.messages.stream(
        model=MODEL, max_tokens=256, tools=[WEATHER], messages=user("please call tool get_weather for Oslo")
    ) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    check("the events start and end", events[0] == "message_start" and events[-1] == "message_stop", events)
    check("a text block then a tool_use", [b.type for b in final.content] == ["text", "tool_use"], final.content)
    check("the input came in several pieces", len(pieces) > 1, pieces)
    expected = {"city": "please call tool get_weather for Oslo", "unit": "celsius"}
    check("the pieces reassemble to the input", json.loads("".join(pieces)) == expected, pieces)
    check("the SDK reassembled the same", final.content[1].input == expected, final.content[1])
    check("streamed tool_use", final.stop_reason == "tool_use", final)

    # max_tokens: the text cut to 4 characters a token.
    message = client.messages.create(model=MODEL, max_tokens=3, messages=user("a long question"))
    check("max_tokens", message.stop_reason == "max_tokens", message)
    check("cut to 12 characters", message.content[0].text == "mock answer ", message.content)
    check("output_tokens is max_tokens", message.usage.output_tokens == 3, message.usage)

    # A stop sequence: the text cut before it.
    message = client.messages.create(
        model=MODEL, max_tokens=256, stop_sequences=["zzz", "#"], messages=user("stop here")
    )
    check("stop_sequence", message.stop_reason == "stop_sequence" and message.stop_sequence == "#", message)
    check("cut before it", message.content[0].text == "mock answer ", message.content)
    with client.messages.stream(
        model=MODEL, max_tokens=256, stop_sequences=["to:"], messages=user("stop here")
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check("streamed stop_sequence", final.stop_reason == "stop_sequence" and final.stop_sequence == "to:", final)
    check("streamed, cut before it", text == f"mock answer #{seq_of(final)} ", text)

    # Errors.
    try:
        client.messages.create(
            model=MODEL, max_tokens=16, messages=[{"role": "assistant", "content": "I start"}]
        )
        sys.exit("FAIL a first assistant message was accepted")
    except anthropic.BadRequestError as err:
        check("400 invalid_request_error", err.status_code == 400 and err.body["error"]["type"] == "invalid_request_error", err.body)
    try:
        client.messages.create(model=MODEL, max_tokens=16, messages=user("x"), extra_body={"bogus": 1})
        sys.exit("FAIL an unknown field was accepted")
    except anthropic.BadRequestError as err:
        check("an extra input is refused", "bogus" in err.body["error"]["message"], err.body)

    control.patch("/_mock/behaviour", json={"fail_status": 529}).raise_for_status()
    try:
        client.messages.create(model=MODEL, max_tokens=16, messages=user("busy?"))
        sys.exit("FAIL a 529 was not raised")
    except anthropic.APIStatusError as err:
        check("529", err.status_code == 529, err)
        check("overloaded_error", err.body["error"]["type"] == "overloaded_error", err.body)
        check("the request id", (err.request_id or "").startswith("req_"), err.request_id)
    control.patch("/_mock/behaviour", json={"fail_status": 429, "retry_after": 1}).raise_for_status()
    try:
        client.messages.create(model=MODEL, max_tokens=16, messages=user("too many?"))
        sys.exit("FAIL a 429 was not raised")
    except anthropic.RateLimitError as err:
        check("429 rate_limit_error", err.body["error"]["type"] == "rate_limit_error", err.body)
        check("retry-after", err.response.headers.get("retry-after") == "1", err.response.headers)
    control.post("/_mock/reset").raise_for_status()

    print(f"anthropic {anthropic.__version__}: messages from the mock (plain, streamed, tools, stop reasons, errors, count_tokens) OK")


if __name__ == "__main__":
    main()
