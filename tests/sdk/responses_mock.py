"""The official `openai` SDK's responses resource against the mock provider.

Usage: python responses_mock.py MOCK_URL

MOCK_URL is `idem mock-upstream`'s address (http://HOST:PORT, not holding
its calls); the SDK is given MOCK_URL/v1. Asked, each parsed by the SDK's
own types, plain (`client.responses.create`) and streamed
(`client.responses.stream`, its events, then `get_final_response()`): a
reasoning item with a summary and encrypted content, a `custom_tool_call`
(a tool with a grammar, as Codex's apply_patch), a `function_call` (also
one nested in a namespace), a `web_search_call`; a second turn that sends
the first turn's output (its reasoning with `encrypted_content`) back with
the call's output; `max_output_tokens` making the response incomplete;
a `json_schema` text format; OpenAI's 400s (an unknown parameter,
`previous_response_id`, tampered encrypted content). Exits non-zero on the
first difference.
"""

import json
import sys

import openai
from openai import OpenAI

MODEL = "gpt-mock-1"
TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a command.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
    },
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Apply a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[\\s\\S]+/"},
    },
    {
        "type": "namespace",
        "name": "clock",
        "description": "Time.",
        "tools": [
            {
                "type": "function",
                "name": "sleep",
                "parameters": {
                    "type": "object",
                    "properties": {"duration_ms": {"type": "number"}},
                    "required": ["duration_ms"],
                },
            }
        ],
    },
    {"type": "web_search"},
]
REASONING = {"effort": "low", "summary": "auto"}
INCLUDE = ["reasoning.encrypted_content"]


def check(what: str, ok: bool, detail="") -> None:
    if not ok:
        sys.exit(f"FAIL {what}: {detail}")


def seq_of(response) -> int:
    check("the id is resp_mock<seq>", response.id.startswith("resp_mock"), response.id)
    return int(response.id.removeprefix("resp_mock"))


def types(response) -> list:
    return [item.type for item in response.output]


def ask(client: OpenAI, text, **extra):
    return client.responses.create(
        model=MODEL, input=text, tools=TOOLS, reasoning=REASONING, include=INCLUDE, store=False, **extra
    )


def main() -> None:
    mock = sys.argv[1].rstrip("/")
    client = OpenAI(base_url=f"{mock}/v1", api_key="sk-any", max_retries=0)

    # Plain: reasoning, then the message.
    response = ask(client, "hello there")
    seq = seq_of(response)
    check("completed", response.status == "completed", response)
    check("reasoning then message", types(response) == ["reasoning", "message"], types(response))
    reasoning = response.output[0]
    check("a reasoning summary", reasoning.summary and reasoning.summary[0].type == "summary_text", reasoning)
    check("encrypted content", bool(reasoning.encrypted_content), reasoning)
    check("the text", response.output_text == f"mock answer #{seq} to: hello there", response.output_text)
    usage = response.usage
    check("usage", usage.input_tokens >= 1 and usage.output_tokens >= 1, usage)
    check("reasoning tokens", usage.output_tokens_details.reasoning_tokens >= 1, usage)
    check("total", usage.total_tokens == usage.input_tokens + usage.output_tokens, usage)

    # A custom tool call, its input the JSON string written after the name.
    patch = "*** Begin Patch\n*** Add File: a.txt\n+a\n*** End Patch\n"
    response = ask(client, f"call tool apply_patch {json.dumps(patch)}")
    check("custom call", types(response) == ["reasoning", "message", "custom_tool_call"], types(response))
    call = response.output[2]
    check("its name and input", call.name == "apply_patch" and call.input == patch, call)
    check("its call id", call.call_id.startswith("call_mock_"), call)

    # The second turn: the whole first turn (its encrypted reasoning) back,
    # with the call's output.
    history = [{"role": "user", "content": f"call tool apply_patch {json.dumps(patch)}"}]
    history += [item.model_dump(exclude_none=True) for item in response.output]
    history.append({"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"})
    second = ask(client, history)
    check("the round trip ends with a message", types(second) == ["reasoning", "message"], types(second))
    check("it echoes the output", second.output_text.endswith("to: Done!"), second.output_text)

    # Tampered reasoning: OpenAI's invalid_encrypted_content.
    history[1]["encrypted_content"] = history[1]["encrypted_content"][:-4] + "AAAA"
    try:
        ask(client, history)
        sys.exit("FAIL tampered encrypted content was accepted")
    except openai.BadRequestError as err:
        check("invalid_encrypted_content", err.code == "invalid_encrypted_content", err.body)

    # A function, and one nested in a namespace.
    response = ask(client, 'call tool exec_command {"cmd": "ls"}')
    call = response.output[-1]
    check("function call", call.type == "function_call" and call.name == "exec_command", call)
    check("its arguments", json.loads(call.arguments) == {"cmd": "ls"}, call)
    response = ask(client, "call tool clock.sleep")
    call = response.output[-1]
    check("namespaced call", call.type == "function_call" and call.name == "sleep", call)
    check("its namespace", getattr(call, "namespace", None) == "clock" or (call.model_extra or {}).get("namespace") == "clock", call)

    # A web search.
    response = ask(client, "search the web for otters")
    check("web search first", types(response) == ["reasoning", "web_search_call", "message"], types(response))
    search = response.output[1]
    check("the search", search.status == "completed" and search.action.type == "search", search)
    check("its query", search.action.query == "search the web for otters", search.action)

    # Streamed: the events, then the final response.
    with client.responses.stream(
        model=MODEL, input=f"search, then call tool apply_patch {json.dumps(patch)}", tools=TOOLS,
        reasoning=REASONING, include=INCLUDE, store=False,
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    for kind in [
        "response.created",
        "response.in_progress",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_part.done",
        "response.web_search_call.searching",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]:
        check(f"the stream has {kind}", kind in events, events)
    check("it ends completed", events[-1] == "response.completed", events[-1])
    check(
        "the final response",
        types(final) == ["reasoning", "web_search_call", "message", "custom_tool_call"],
        types(final),
    )
    check("its reasoning", bool(final.output[0].encrypted_content), final.output[0])
    check("its custom call", final.output[3].input == patch, final.output[3])
    check("its text", final.output_text.startswith(f"mock answer #{seq_of(final)} to: search"), final.output_text)

    with client.responses.stream(
        model=MODEL, input="x", tools=TOOLS, tool_choice={"type": "function", "name": "exec_command"}
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    check("streamed arguments", "response.function_call_arguments.delta" in events, events)
    check("a forced call alone", types(final) == ["function_call"], types(final))
    check("its arguments", json.loads(final.output[0].arguments) == {"cmd": "x"}, final.output[0])

    # Cut by max_output_tokens: incomplete.
    response = client.responses.create(
        model=MODEL, input="a question long enough to be cut by sixteen tokens of answer", max_output_tokens=16
    )
    check("incomplete", response.status == "incomplete", response.status)
    check("why", response.incomplete_details.reason == "max_output_tokens", response.incomplete_details)

    # Structured output.
    response = client.responses.create(
        model=MODEL,
        input="who?",
        text={"format": {"type": "json_schema", "name": "person", "strict": True, "schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"], "additionalProperties": False}}},
    )
    person = json.loads(response.output_text)
    check("a JSON object of the schema", person["age"] == 1 and person["name"].endswith("to: who?"), person)

    # OpenAI's 400s.
    for kwargs, code in [
        ({"extra_body": {"bogus": 1}}, "unknown_parameter"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_not_found"),
    ]:
        try:
            client.responses.create(model=MODEL, input="x", **kwargs)
            sys.exit(f"FAIL {kwargs} was accepted")
        except openai.BadRequestError as err:
            check(code, err.code == code, err.body)

    print(f"openai {openai.__version__}: responses from the mock (reasoning, custom, function, namespace, web search, streamed, round trip, errors) OK")


if __name__ == "__main__":
    main()
