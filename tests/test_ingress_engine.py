"""The official openai client and curl through the ingress and a real node to the real tiny engine
(llama.cpp's server from the xllamacpp wheel with SmolLM2-135M); skips with a reason when the
engine is not installed."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from test_ingress_support import Cluster, free_port, sse_events

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    real_engine = request.getfixturevalue("real_engine")   # skips when the engine is not installed
    c = Cluster(str(tmp_path_factory.mktemp("engine-cluster")))
    try:
        port = free_port()
        c.node("n1", real_engine.cmd.format(port=port), port, real_engine.model, timeout=180)
        c.model = real_engine.model
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def openai_client(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=cluster.token, max_retries=0, timeout=120)
    yield client
    client.close()


MESSAGES = [{"role": "user", "content": "Say hello."}]


def ledger(cluster):
    """(requests, prompt tokens, completion tokens) in the ledger, via the admin usage API
    (which first lets every completed request reach SQLite)."""
    from test_ingress_support import Client
    totals = json.loads(Client(cluster.url, cluster.token).request("GET", "/v1/usage")[2])["totals"]
    return totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]


def test_openai_client_lists_the_model(cluster, openai_client):
    import openai
    assert [m.id for m in openai_client.models.list()] == [cluster.model]
    assert openai_client.models.retrieve(cluster.model).id == cluster.model
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


def test_openai_client_chat_without_streaming_is_answered_and_metered(cluster, openai_client):
    before = ledger(cluster)
    answer = openai_client.chat.completions.create(model=cluster.model, messages=MESSAGES, max_tokens=8)
    assert answer.choices[0].message.content
    assert answer.usage.completion_tokens > 0
    after = ledger(cluster)
    assert after[0] == before[0] + 1
    assert (after[1] - before[1], after[2] - before[2]) == (answer.usage.prompt_tokens,
                                                            answer.usage.completion_tokens)


def test_openai_client_streams_chat_chunk_by_chunk(cluster, openai_client):
    before = ledger(cluster)
    chunks = list(openai_client.chat.completions.create(model=cluster.model, messages=MESSAGES, max_tokens=8,
                                                        stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 2 and text
    assert all(c.usage is None for c in chunks)   # it did not ask for usage, so it gets none
    after = ledger(cluster)
    assert after[0] == before[0] + 1 and after[2] > before[2]   # yet the ingress counted the tokens


def test_streamed_completion_tokens_are_metered_as_the_engine_counted_them(cluster, openai_client):
    # llama-server sends usage in the last chunk when asked (stream_options.include_usage);
    # the fallback engine (llama-cpp-python) ignores it, and the ingress then counts one
    # completion token per chunk with text, which is what that engine sends
    before = ledger(cluster)
    chunks = list(openai_client.completions.create(model=cluster.model, prompt="Once upon a time", max_tokens=6,
                                                   stream=True, stream_options={"include_usage": True}))
    with_text = sum(1 for c in chunks if c.choices and c.choices[0].text)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert with_text > 0
    after = ledger(cluster)
    expected = usage[-1].completion_tokens if usage else with_text
    assert after[0] == before[0] + 1 and after[2] - before[2] == expected


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_without_and_with_streaming(cluster):
    body = json.dumps({"model": cluster.model, "messages": MESSAGES, "max_tokens": 8})
    base = ["curl", "-sS", "--max-time", "120", cluster.url + "/v1/chat/completions",
            "-H", f"Authorization: Bearer {cluster.token}", "-H", "Content-Type: application/json"]
    plain = subprocess.run(base + ["-d", body], capture_output=True, text=True, timeout=130)
    assert plain.returncode == 0 and json.loads(plain.stdout)["choices"][0]["message"]["content"]
    stream_body = json.dumps({"model": cluster.model, "messages": MESSAGES, "max_tokens": 8, "stream": True})
    streamed = subprocess.run(base + ["-N", "-d", stream_body], capture_output=True, timeout=130)
    events = sse_events(streamed.stdout)
    assert streamed.returncode == 0 and events[-1] == "[DONE]" and len(events) >= 3
    assert all("usage" not in json.loads(e) or json.loads(e)["usage"] is None for e in events[:-1])


def test_the_engines_context_window_is_listed_and_a_prompt_past_it_is_refused_as_openai_refuses_it(
        cluster, openai_client):
    import openai
    from test_ingress_support import Client
    listed = json.loads(Client(cluster.url, cluster.token).request("GET", "/v1/models")[2])["data"]
    window = listed[0]["max_model_len"]   # llama.cpp's server says its n_ctx in /v1/models' meta
    assert window > 0
    with pytest.raises(openai.BadRequestError) as caught:   # 10 bytes a token of the window: 1.25 windows
        openai_client.chat.completions.create(model=cluster.model, max_tokens=8, messages=[   # at 8 bytes a token
            {"role": "user", "content": "word " * (window * 2)}])
    assert caught.value.code == "context_length_exceeded"
