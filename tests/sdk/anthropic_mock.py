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
    # anthropic 2.x sends the key as a bearer token; older ones as x-api-key.
    check(
        "the mock saw the key",
        last["x_api_key"] == KEY or last["authorization"] == f"Bearer {KEY}",
        last,
    )
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

    thinking_and_search(client, control)

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

    print(f"anthropic {anthropic.__version__}: messages from the mock (plain, streamed, tools, thinking, web search, stop reasons, errors, count_tokens) OK")


def thinking_and_search(client: Anthropic, control: httpx.Client) -> None:
    """Thinking, redacted thinking, web search and citations, parsed by the
    SDK's own types, plain and streamed; the thinking sent back."""
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    for kind in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        message = client.messages.create(model=MODEL, max_tokens=2048, thinking=kind, messages=user("why?"))
        check("thinking first", [b.type for b in message.content] == ["thinking", "text"], message.content)
        block = message.content[0]
        check("a thinking text", block.thinking.startswith("mock thinking #"), block)
        check("a signature", len(block.signature) > 20, block)

    # Streamed with everything: the SDK accumulates each block.
    with client.messages.stream(
        model=MODEL,
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[search],
        messages=user("search the web for otters, and redact"),
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    types = [b.type for b in final.content]
    check(
        "streamed blocks",
        types == ["thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result", "text"],
        types,
    )
    check("thinking events", "thinking" in kinds and "signature" in kinds and "citation" in kinds, kinds)
    thinking, redacted, call, result, text = final.content
    check("the thinking accumulated", thinking.thinking.startswith("mock thinking #"), thinking)
    check("the signature accumulated", len(thinking.signature) > 20, thinking)
    check("redacted data", len(redacted.data) > 10, redacted)
    check("the search call", call.name == "web_search" and call.id.startswith("srvtoolu_"), call)
    check("its query", call.input == {"query": "search the web for otters, and redact"}, call.input)
    check("its result", result.tool_use_id == call.id and result.content[0].type == "web_search_result", result)
    hit = result.content[0]
    check("the result's fields", hit.url and hit.title and hit.encrypted_content and hit.page_age, hit)
    check("the text cites it", text.citations and text.citations[0].type == "web_search_result_location", text)
    check("the citation's url", text.citations[0].url == hit.url, text.citations)
    check("server tool usage", final.usage.server_tool_use.web_search_requests == 1, final.usage)

    # The turn sent back: accepted; with the thinking changed, Anthropic's 400.
    history = [
        {"role": "user", "content": "search the web for otters, and redact"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": "thanks"},
    ]
    again = client.messages.create(
        model=MODEL, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[search], messages=history,
    )
    check("the next turn", again.content[-1].text.endswith("to: thanks"), again.content)
    history[1]["content"][0]["thinking"] = "not what was thought"
    try:
        client.messages.create(
            model=MODEL, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
            tools=[search], messages=history,
        )
        sys.exit("FAIL a tampered thinking block was accepted")
    except anthropic.BadRequestError as err:
        check("the signature is refused", "signature" in err.body["error"]["message"], err.body)

    # The beta resource (?beta=true, an anthropic-beta header), a system
    # message inside messages, output_config, as Claude Code sends them.
    message = client.beta.messages.create(
        model=MODEL,
        max_tokens=2048,
        betas=["interleaved-thinking-2025-05-14"],
        thinking={"type": "adaptive"},
        messages=[
            {"role": "user", "content": "hello"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
        ],
        extra_body={"output_config": {"effort": "low"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
    )
    check("beta: thinking and text", [b.type for b in message.content] == ["thinking", "text"], message.content)
    last = control.get("/_mock/stats").json()["last_requests"][-1]
    check("the beta header", "interleaved-thinking-2025-05-14" in (last["anthropic_beta"] or ""), last)
    counted = client.messages.count_tokens(
        model=MODEL, thinking={"type": "enabled", "budget_tokens": 1024}, tools=[search],
        messages=[{"role": "user", "content": "hello"}, {"role": "system", "content": "env"}],
    )
    check("count_tokens with thinking and a system message", counted.input_tokens >= 1, counted)


if __name__ == "__main__":
    main()
