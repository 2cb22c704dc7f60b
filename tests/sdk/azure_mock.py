"""The openai SDK's `AzureOpenAI` client against the mock provider's Azure routes.

Usage: python azure_mock.py MOCK_URL

MOCK_URL is `idem mock-upstream`'s address (http://HOST:PORT, not holding
its calls), given to the client as its `azure_endpoint`; the client then
posts to /openai/deployments/{deployment}/...?api-version=V with an
`api-key` header. Asked: `chat.completions.create` plain and streamed and
`embeddings.create`; the answers name the deployment as their model, and
the mock's `/_mock/stats` must show the deployment, the api-version and the
key the client sent. A client without a key (an Entra token instead) gets
Azure's 401, a URL without api-version Azure's 404. Exits non-zero on the
first difference.
"""

import sys

import httpx
import openai
from openai import AzureOpenAI

API_VERSION = "2024-10-21"
KEY = "azure-any-key-works-here"


def check(what: str, ok: bool, detail="") -> None:
    if not ok:
        sys.exit(f"FAIL {what}: {detail}")


def main() -> None:
    mock = sys.argv[1].rstrip("/")
    client = AzureOpenAI(azure_endpoint=mock, api_version=API_VERSION, api_key=KEY, max_retries=0)
    control = httpx.Client(base_url=mock, timeout=10)

    # Plain chat: the deployment is the model the client names.
    answer = client.chat.completions.create(
        model="chat-deployment", messages=[{"role": "user", "content": "hello azure"}]
    )
    seq = int(answer.id.removeprefix("chatcmpl-mock-"))
    check("the content", answer.choices[0].message.content == f"mock answer #{seq} to: hello azure", answer)
    check("the model is the deployment", answer.model == "chat-deployment", answer.model)
    check("finish_reason", answer.choices[0].finish_reason == "stop", answer)
    last = control.get("/_mock/stats").json()["last_requests"][-1]
    check("the mock saw the deployment", last["deployment"] == "chat-deployment", last)
    check("the mock saw the api-version", last["api_version"] == API_VERSION, last)
    check("the mock saw the api-key", last["api_key"] == KEY, last)
    check("a chat call", last["endpoint"] == "chat_completions", last)
    calls = control.get("/_mock/calls").json()
    check("the call log's model is the deployment", calls[-1]["model"] == "chat-deployment", calls[-1])

    # Streamed chat.
    stream = client.chat.completions.create(
        model="chat-deployment",
        messages=[{"role": "user", "content": "stream from azure"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text = ""
    usage = None
    models = set()
    for chunk in stream:
        models.add(chunk.model)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    check("the streamed content", text.startswith("mock answer #") and text.endswith(" to: stream from azure"), text)
    check("streamed: the model is the deployment", models == {"chat-deployment"}, models)
    check("streamed usage", usage is not None and usage.total_tokens >= 2, usage)

    # Embeddings.
    embedded = client.embeddings.create(model="embed-deployment", input=["one", "two"])
    check("two vectors", len(embedded.data) == 2 and len(embedded.data[0].embedding) == 8, embedded)
    check("the embeddings model is the deployment", embedded.model == "embed-deployment", embedded.model)
    last = control.get("/_mock/stats").json()["last_requests"][-1]
    check("an embeddings call", last["endpoint"] == "embeddings" and last["deployment"] == "embed-deployment", last)

    # Azure's refusals.
    keyless = AzureOpenAI(
        azure_endpoint=mock, api_version=API_VERSION, azure_ad_token="an-entra-token", max_retries=0
    )
    try:
        keyless.chat.completions.create(model="chat-deployment", messages=[{"role": "user", "content": "x"}])
        sys.exit("FAIL a request without api-key was answered")
    except openai.AuthenticationError as err:
        check("401 with Azure's code", err.status_code == 401 and err.code == "401", err)
    response = control.post(
        "/openai/deployments/chat-deployment/chat/completions",
        headers={"api-key": KEY},
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    check("no api-version: 404", response.status_code == 404, response.text)
    check("Azure's 404 body", response.json() == {"error": {"code": "404", "message": "Resource not found"}}, response.text)

    print(f"openai {openai.__version__}: AzureOpenAI against the mock (chat plain and streamed, embeddings, 401, 404) OK")


if __name__ == "__main__":
    main()
