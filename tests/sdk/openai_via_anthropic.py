"""The openai SDK through idem to an Anthropic target.

Usage: python openai_via_anthropic.py GATEWAY_V1_URL

GATEWAY_V1_URL is an idem gateway whose route "claude" has one target, a
provider of kind "anthropic" in front of `idem mock-upstream`'s Messages
API face. The official openai package must get from it, unmodified: a plain
answer, a stream (the bare `chunk.choices[0].delta` loop, with usage at
the end), a tool call whose arguments stream in several pieces, and the
right `finish_reason` for each of Anthropic's stop reasons. Exits non-zero
on the first difference.
"""

import json
import sys
import uuid

import openai
from openai import OpenAI


def check(what: str, ok: bool, detail="") -> None:
    if not ok:
        sys.exit(f"FAIL {what}: {detail}")


def main() -> None:
    client = OpenAI(base_url=sys.argv[1], api_key="sk-any", max_retries=0)
    run = uuid.uuid4().hex[:8]

    plain = client.chat.completions.create(
        model="claude",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{run} hello"}],
    )
    text = plain.choices[0].message.content
    check("a plain answer", text.endswith(f"to: {run} hello"), text)
    check("finish_reason stop for end_turn", plain.choices[0].finish_reason == "stop", plain)
    check("usage", plain.usage.prompt_tokens > 0 and plain.usage.completion_tokens > 0, plain.usage)

    stream = client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": f"{run} stream"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        if chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        finish = chunk.choices[0].finish_reason or finish
    check("a stream in pieces", len(pieces) > 2 and "".join(pieces).endswith(f"to: {run} stream"), pieces)
    check("the stream's usage", usage is not None and usage.completion_tokens > 0, usage)
    check("the stream's finish_reason", finish == "stop", finish)

    tools = [{"type": "function", "function": {"name": "lookup", "description": "find an order",
              "parameters": {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]}}}]
    call = client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": f"{run} where is 1234"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
    )
    check("finish_reason tool_calls for tool_use", call.choices[0].finish_reason == "tool_calls", call)
    fn = call.choices[0].message.tool_calls[0].function
    check("a tool call", fn.name == "lookup" and "order" in json.loads(fn.arguments), fn)

    stream = client.chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": f"{run} where is 5678"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        stream=True,
    )
    arguments, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.function and tc.function.arguments:
                arguments.append(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    check("the arguments stream in several pieces", len(arguments) > 1, arguments)
    check("and assemble into JSON", "order" in json.loads("".join(arguments)), arguments)
    check("a streamed tool call ends with tool_calls", finish == "tool_calls", finish)

    short = client.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": f"{run} a long question"}], max_tokens=2
    )
    check("finish_reason length for max_tokens", short.choices[0].finish_reason == "length", short)
    stop = client.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": f"{run} stop here"}], stop=["here"]
    )
    check("finish_reason stop for stop_sequence", stop.choices[0].finish_reason == "stop"
          and "here" not in stop.choices[0].message.content, stop)
    print(f"openai {openai.__version__}: an Anthropic target through idem (plain, streamed, tool calls, stop reasons) OK")


if __name__ == "__main__":
    main()
