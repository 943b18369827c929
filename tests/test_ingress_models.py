"""Models that change while serving (issue 42, items 2 and 5): LoRA adapters loaded and unloaded
through the overlay (admin keys only) reach the registry with their base and the ingress's
/v1/models with vLLM's `parent` and `root`; a node reads its engine's model list again on a short
period; an engine's context window (`max_model_len`) sends a prompt too long for a model to the
next model of its fallbacks, or answers 400 context_length_exceeded; the fallback lists are read
and changed through the admin API."""
from __future__ import annotations

import json
import time

import pytest
from test_ingress_support import Client, Cluster, Collector, Stack, free_port

import crdt
import otela_node

ENGINE = "{python} tests/fake_engine.py --model base --max-model-len 4096 --port {port}"


def wait_for(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s")


def models(client):
    return {m["id"]: m for m in json.loads(client.request("GET", "/v1/models")[2])["data"]}


@pytest.mark.slow
def test_an_adapter_loaded_through_the_ingress_is_routed_with_its_base_and_unloaded_again(tmp_path, monkeypatch):
    monkeypatch.setenv("OTELA_ENGINE_MODELS_INTERVAL", "0.3")
    cluster = Cluster(str(tmp_path))
    try:
        port = free_port()
        cluster.node("n1", ENGINE.format(python=cluster.python, port=port), port, "base")
        admin = Client(cluster.url, cluster.token)
        status, _, body = admin.request("POST", "/v1/load_lora_adapter",
                                        {"lora_name": "sql", "lora_path": "/adapters/sql", "model": "base"})
        assert status == 200, body
        answer = json.loads(body)
        assert (answer["action"], [s["status"] for s in answer["sessions"]]) == ("load", [200])
        # the answer came once the node's record said it: the adapter is routed at once
        listed = models(admin)
        assert {k: listed["sql"].get(k) for k in ("parent", "root", "max_model_len")} == {
            "parent": "base", "root": "/adapters/sql", "max_model_len": 4096}
        assert "parent" not in listed["base"]
        status, _, body = admin.chat("sql")
        assert status == 200 and json.loads(body)["model"] == "sql"
        stats = json.loads(Client(f"http://127.0.0.1:{port}").request("GET", "/fake/stats")[2])
        assert json.loads(stats["last_body"])["model"] == "sql"
        # an adapter loaded at the engine itself, not through the overlay: its record says it on the
        # next period, but under a grant that names only the base it is the job's word, not routed
        Client(f"http://127.0.0.1:{port}").request("POST", "/v1/load_lora_adapter",
                                                   {"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert wait_for(lambda: b'"chat"' in admin.request("GET", "/v1/registry")[2])
        assert "chat" not in models(admin) and admin.chat("chat")[0] == 404
        status, _, body = admin.request("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 200, body
        assert "sql" not in models(admin)
        served = json.loads(Client(f"http://127.0.0.1:{port}").request("GET", "/fake/stats")[2])["requests"]
        assert admin.chat("sql")[0] == 503   # (a model served a moment ago: a retry, not a 404)
        assert json.loads(Client(f"http://127.0.0.1:{port}").request("GET", "/fake/stats")[2])["requests"] == served
    finally:
        cluster.close()


def publish_catalog(stack, sid, engine):
    """What a node does once a load passed its tunnel: its record says its engine's models (on
    the stack's loop)."""
    node, record = stack.node, stack.node.registry.get(sid)
    node._versions[sid] += 1
    record.update(version=node._versions[sid], **otela_node.engine_catalog(engine.model_list()))
    node.registry.put(sid, record)
    node._changed(sid)


@pytest.fixture
def fast_seen(monkeypatch):
    """A stand-in node's record never changes by itself: the load's answer waits a little for it."""
    import otela_ingress
    monkeypatch.setattr(otela_ingress, "ADAPTER_SEEN_S", 0.2)


def test_a_load_is_sent_to_every_session_of_its_base_or_to_the_one_an_admin_names(stack, fast_seen):
    a, engine_a = stack.engine("base")
    b, engine_b = stack.engine("base")
    stack.engine("other")
    admin = Client(stack.url, stack.key(admin=True))
    status, _, body = admin.request("POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"},
                                    headers={"x-otela-model": "base"})
    assert status == 200 and sorted(s["session"] for s in json.loads(body)["sessions"]) == sorted([a, b])
    assert engine_a.adapters == engine_b.adapters == {"sql": "/a/sql"}
    assert json.loads(engine_a.last_body) == {"lora_name": "sql", "lora_path": "/a/sql"}   # no `model` for vLLM
    status, _, body = admin.request("POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"},
                                    headers={"x-otela-session": a})
    assert status == 400 and json.loads(body)["sessions"][0]["status"] == 400   # the engine's: loaded already
    status, _, _ = admin.request("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"},
                                 headers={"x-otela-session": b})
    assert status == 200 and engine_a.adapters == {"sql": "/a/sql"} and engine_b.adapters == {}


@pytest.mark.parametrize("body, code", [
    ({"lora_name": "x" * 100_000, "lora_path": "/a/x", "model": "base"}, "invalid_parameter"),   # a huge name
    ({"lora_name": "bad\nname", "lora_path": "/a/x", "model": "base"}, "invalid_parameter"),
    ({"lora_name": "sql", "lora_path": "p" * 5000, "model": "base"}, "invalid_parameter"),
    ({"lora_name": "sql", "model": "base"}, "invalid_parameter"),                                  # no path
    ({"lora_name": "sql", "lora_path": "/a/sql"}, "missing_model"),                               # no base named
    ([1, 2], "invalid_json"),
])
def test_a_bad_load_request_is_refused_400_before_any_engine(stack, body, code):
    _, engine = stack.engine("base")
    status, _, answer = Client(stack.url, stack.key(admin=True)).request("POST", "/v1/load_lora_adapter", body)
    assert (status, json.loads(answer)["error"]["code"]) == (400, code)
    assert engine.requests == 0 and engine.adapters == {}


def test_a_key_that_is_not_an_admins_may_not_load_or_unload_an_adapter(stack):
    _, engine = stack.engine("base")
    user = Client(stack.url, stack.key())
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, _, body = user.request("POST", route, {"lora_name": "sql", "lora_path": "/a/sql", "model": "base"})
        assert (status, json.loads(body)["error"]["code"]) == (403, "admin_required")
    assert engine.requests == 0


def test_an_adapter_no_session_has_is_loaded_on_its_base_first_where_the_site_allows_it(tmp_path, fast_seen):
    for on_demand in (False, True):
        stack = Stack(str(tmp_path / f"demand{on_demand}.sqlite"), adapter_on_demand=on_demand)
        try:
            sid, engine = stack.engine("base")
            admin = Client(stack.url, stack.key(admin=True))
            admin.request("POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql", "model": "base"})
            stack.call(publish_catalog, stack, sid, engine)
            admin.request("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
            stack.call(publish_catalog, stack, sid, engine)
            user = Client(stack.url, stack.key())
            stack.call(stack.ingress.grants.served.clear)   # (not a model served a moment ago: a 404)
            if not on_demand:
                assert user.chat("sql")[0] == 404 and engine.adapters == {}
                continue
            # the stand-in's record follows its engine's list once the load passed, as a node's does
            stack.ingress.adapters._fan_out = watched(stack, sid, engine)
            status, headers, body = user.chat("sql")
            assert (status, json.loads(body)["model"]) == (200, "sql")
            assert engine.adapters == {"sql": "/a/sql"}
            assert user.chat("never-loaded")[0] == 404   # base and path unknown: nothing is loaded
        finally:
            stack.close()


def watched(stack, sid, engine):
    fan_out = stack.ingress.adapters._fan_out

    async def fan_out_then_publish(*args):
        answer = await fan_out(*args)
        publish_catalog(stack, sid, engine)
        return answer
    return fan_out_then_publish


def test_a_record_whose_adapters_overflow_it_is_published_without_their_paths_then_without_them():
    node = otela_node.Node(otela_node.Config(key=b"k" * 32))
    node.overlay = otela_node.Overlay(node.config, "a" * 32, {"owner": "me", "state": crdt.SERVING, "version": 0,
                                                              "started": 1.0, "gossip": "10.0.0.2:7946"}, 1.0)
    node.send = lambda outs: None
    node.schedule = lambda: None
    long = {"id": "base"}, *({"id": f"a{i}", "parent": "base", "root": "/" + "p" * 200} for i in range(20))
    otela_node.publish_catalog(node, otela_node.engine_catalog(list(long)))
    record = node.overlay.record
    assert len(record["adapters"]) == 20 and {path for _, path in record["adapters"].values()} == {""}
    many = [{"id": "base"}] + [{"id": f"a{i:02d}-{'n' * 40}", "parent": "base"} for i in range(30)]
    otela_node.publish_catalog(node, otela_node.engine_catalog(many))
    assert node.overlay.record["adapters"] == {}


# -- context windows -----------------------------------------------------------------------------
def windowed(stack, model, window, **opts):
    """A fake engine for `model` whose record says its context window, as a node publishes it."""
    sid, engine = stack.engine(model, **opts)

    def say():
        record = stack.node.registry.get(sid)
        stack.node._versions[sid] += 1
        record.update(version=stack.node._versions[sid], max_model_len=window)
        stack.node.registry.put(sid, record)
        stack.node._changed(sid)
    stack.call(say)
    return engine


def test_a_prompt_longer_than_a_models_window_goes_to_its_next_fallback_that_fits(tmp_path):
    stack = Stack(str(tmp_path / "window.sqlite"), fallbacks={"small": ["tiny", "large"]})
    try:
        small, tiny = windowed(stack, "small", 100), windowed(stack, "tiny", 50)
        large = windowed(stack, "large", 4096)
        client = Client(stack.url, stack.key())
        status, headers, body = client.chat("small", content="word " * 400)   # 2,000 bytes: 250 tokens at least
        assert (status, headers["x-otela-model"], json.loads(body)["model"]) == (200, "large", "large")
        assert (small.requests, tiny.requests, large.requests) == (0, 0, 1)
        assert client.chat("small", content="word " * 100)[0] == 200 and small.requests == 1   # 500 bytes may fit
        # the completion asked counts as OpenAI counts it: 60 + 50 > 100
        assert client.chat("small", content="word " * 96, max_tokens=50)[0] == 200 and large.requests == 2
        assert stack.sql("SELECT model FROM requests") == [("large",), ("small",), ("large",)]
        metrics = Client(stack.url).request("GET", "/metrics")[2].decode()
        assert 'otela_fallbacks_total{model="small",to="large"} 2' in metrics
    finally:
        stack.close()


def test_a_prompt_longer_than_every_window_it_may_use_is_refused_as_openai_refuses_it(tmp_path):
    import openai
    stack = Stack(str(tmp_path / "window.sqlite"), fallbacks={"a": ["b"], "b": ["a"]})   # a loop: a -> b -> a
    try:
        a, b = windowed(stack, "a", 100), windowed(stack, "b", 200)
        sdk = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key(), max_retries=0, timeout=30)
        for model in ("a", "b"):
            with pytest.raises(openai.BadRequestError) as caught:
                sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "é" * 1000}])
            assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
            assert "maximum context length is" in caught.value.message
        with pytest.raises(openai.BadRequestError):   # token ids, one each
            sdk.completions.create(model="a", prompt=list(range(250)))
        assert a.requests == b.requests == 0
    finally:
        stack.close()


def test_a_window_counts_text_and_token_ids_but_not_images():
    from otela_ingress import prompt_tokens_at_least
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 80_000}}
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 800}, image]}],
            "tools": [{"description": "y" * 10_000}]}
    assert prompt_tokens_at_least(chat) == 100
    assert prompt_tokens_at_least({"prompt": [[1, 2, 3], [4, 5]]}) == 5
    assert prompt_tokens_at_least({"input": [{"role": "user", "content": [{"type": "input_text", "text": "z" * 80}]}],
                                   "instructions": "i" * 16}) == 12


def test_fallbacks_that_loop_end_after_each_model_once(tmp_path):
    stack = Stack(str(tmp_path / "loop.sqlite"), fallbacks={"a": ["b"], "b": ["a"]})
    try:
        _, a = stack.engine("a", mode="error500")
        _, b = stack.engine("b", mode="error500")
        status, _, body = Client(stack.url, stack.key()).chat("a")
        assert (status, json.loads(body)["error"]["code"]) == (502, "upstream_failed")
        assert (a.requests, b.requests) == (1, 1)
    finally:
        stack.close()


# -- fallbacks through the admin API ---------------------------------------------------------------
def test_an_admin_sets_lists_and_deletes_a_models_fallbacks_while_serving(stack):
    stack.engine("m2", mode="error500")
    _, m1 = stack.engine("m1")
    admin, user = Client(stack.url, stack.key(admin=True)), Client(stack.url, stack.key())
    assert user.chat("m2")[0] == 502
    status, _, body = admin.request("POST", "/v1/admin/fallbacks/m2", {"fallbacks": ["m1"]})
    assert (status, json.loads(body)) == (200, {"model": "m2", "fallbacks": ["m1"]})
    status, headers, _ = user.chat("m2")
    assert (status, headers["x-otela-model"], m1.requests) == (200, "m1", 1)
    assert json.loads(admin.request("GET", "/v1/admin/fallbacks")[2])["data"] == [{"model": "m2", "fallbacks": ["m1"]}]
    assert admin.request("DELETE", "/v1/admin/fallbacks/m2")[0] == 200
    assert user.chat("m2")[0] == 502 and m1.requests == 1
    assert admin.request("DELETE", "/v1/admin/fallbacks/m2")[0] == 404
    status, _, body = user.request("POST", "/v1/admin/fallbacks/m2", {"fallbacks": ["m1"]})
    assert (status, json.loads(body)["error"]["code"]) == (403, "admin_required")


@pytest.mark.parametrize("body", [
    {"fallbacks": ["m2"]},                       # itself
    {"fallbacks": ["m1", "m1"]},                 # twice
    {"fallbacks": [f"m{i}" for i in range(3, 40)]},   # past MAX_FALLBACKS
    {"fallbacks": ["x" * 300]}, {"fallbacks": []}, {"fallbacks": "m1"}, {"fallbacks": [7]}, [1],
])
def test_a_bad_fallback_list_is_refused_400_and_changes_nothing(stack, body):
    admin = Client(stack.url, stack.key(admin=True))
    status, _, answer = admin.request("POST", "/v1/admin/fallbacks/m2", body)
    assert (status, json.loads(answer)["error"]["type"]) == (400, "invalid_request_error")
    assert json.loads(admin.request("GET", "/v1/admin/fallbacks")[2])["data"] == []


def test_a_fallback_list_set_as_a_loop_tries_each_model_once(stack):
    _, a = stack.engine("a", mode="error500")
    _, b = stack.engine("b", mode="error500")
    admin = Client(stack.url, stack.key(admin=True))
    for model, other in (("a", "b"), ("b", "a")):
        assert admin.request("POST", f"/v1/admin/fallbacks/{model}", {"fallbacks": [other]})[0] == 200
    assert admin.chat("a")[0] == 502 and (a.requests, b.requests) == (1, 1)


@pytest.mark.parametrize("how", ["query", "header"])
def test_a_fallback_renames_the_model_where_the_request_named_it(tmp_path, how):
    stack = Stack(str(tmp_path / "rename.sqlite"), fallbacks={"m2": ["m1"]})
    try:
        stack.engine("m2", mode="error500")
        _, m1 = stack.engine("m1")
        client = Client(stack.url, stack.key())
        target = "/v1/responses?model=m2" if how == "query" else "/v1/responses"
        headers = {"x-otela-model": "m2"} if how == "header" else {}
        status, answer_headers, _ = client.request("POST", target, {"input": "hi"}, headers=headers)
        assert (status, answer_headers["x-otela-model"]) == (200, "m1")
        assert m1.last_target == ("/v1/responses?model=m1" if how == "query" else "/v1/responses")
    finally:
        stack.close()


def test_an_alias_named_in_the_path_reaches_the_engine_as_its_model(tmp_path):
    stack = Stack(str(tmp_path / "alias.sqlite"), aliases={"fast": ["org/m1"]})
    try:
        _, m1 = stack.engine("org/m1")
        Client(stack.url, stack.key()).request("GET", "/v1/adapters/fast/info")
        assert m1.last_target == "/v1/adapters/org/m1/info"
    finally:
        stack.close()


def test_a_target_names_the_new_model_in_its_query_or_path_and_nothing_else_changes():
    from otela_ingress import with_model_target
    assert with_model_target(b"/v1/x?a=1&model=m2&b=%20", "m2", "m1") == b"/v1/x?a=1&model=m1&b=+"
    assert with_model_target(b"/v1/x?model=other", "m2", "m1") == b"/v1/x?model=other"
    assert with_model_target(b"/v1/models/org%2Fm2/x", "org/m2", "m1") == b"/v1/models/m1/x"
    assert with_model_target(b"/v1/m22/x", "m2", "m1") == b"/v1/m22/x"


# -- the node's spans ------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_ingresss_and_the_nodes_spans_reach_one_collector_in_one_trace(tmp_path, monkeypatch):
    collector = Collector()
    monkeypatch.setenv("OTELA_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.port}")   # the ingress and the node
    cluster = Cluster(str(tmp_path))
    try:
        port = free_port()
        cluster.node("n1", ENGINE.format(python=cluster.python, port=port), port, "base")
        trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        status, _, _ = Client(cluster.url, cluster.token).chat("base", headers={"traceparent": f"00-{trace}-{span}-01"})
        assert status == 200

        def spans():
            found = {}
            for _, document in list(collector.documents):
                for resource in document["resourceSpans"]:
                    service = resource["resource"]["attributes"][0]["value"]["stringValue"]
                    for s in resource["scopeSpans"][0]["spans"]:
                        found[s["name"]] = dict(s, service=service)
            return found if {"otela.node.tunnel", "/v1/chat/completions"} <= set(found) else None
        found = wait_for(spans)
        assert {s["traceId"] for s in found.values()} == {trace}
        ingress, tunnel, engine = found["/v1/chat/completions"], found["otela.node.tunnel"], found["otela.engine.first_byte"]
        assert (ingress["service"], tunnel["service"], engine["service"]) == ("otela-ingress", "otela-node", "otela-node")
        assert tunnel["parentSpanId"] == ingress["spanId"] and engine["parentSpanId"] == tunnel["spanId"]
        assert int(tunnel["startTimeUnixNano"]) <= int(engine["endTimeUnixNano"]) <= int(tunnel["endTimeUnixNano"])
    finally:
        cluster.close()
        collector.close()


def test_a_node_given_a_bad_otlp_endpoint_says_so_in_one_line(tmp_path):
    import subprocess
    import sys
    subprocess.run([sys.executable, "otela_node.py", "keygen", "--out", str(tmp_path)], check=True, capture_output=True,
                   timeout=60)
    done = subprocess.run([sys.executable, "otela_node.py", "start", "--process", "true", "--otlp-endpoint", "ftp://x",
                           "--key-file", str(tmp_path / "cluster.key"), "--listen", "127.0.0.1:0", "--gossip",
                           "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "otela_node.py: error: --otlp-endpoint 'ftp://x': expected http(s)://HOST:PORT[/path]"]
