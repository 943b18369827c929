"""The ingress: OpenAI API, errors, keys and allowlists, routing, retries, streams, ledger, metrics."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ingress_support import Client, Stack, sse_events

import crdt
import otela_ingress
import otela_node
from otela_ingress import (
    Candidate,
    HardwarePolicy,
    LeastLoadedPolicy,
    PassiveHealth,
    RoundRobinPolicy,
    RoutedRequest,
    StreamWatch,
    allowed,
    hardware_weight,
    load_policy,
)


@pytest.fixture
def client(stack):
    c = Client(stack.url, stack.key("alice"))
    try:
        yield c
    finally:
        c.close()


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- the proxy path ------------------------------------------------------------------------------
def test_chat_completion_is_answered_by_the_engine_with_the_body_forwarded_verbatim(stack, client):
    sid, engine = stack.engine("m1")
    raw = b'{"model":"m1","messages":[{"role":"user","content":"two words"}],"user":"u-7","x_unknown":[1,2]}'
    status, headers, body = client.request("POST", "/v1/chat/completions", raw)
    assert status == 200
    assert headers["x-otela-session"] == sid
    answer = json.loads(body)
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
    assert engine.last_body == raw


def test_completions_and_embeddings_are_proxied(stack, client):
    stack.engine("m1")
    status, _, body = client.request("POST", "/v1/completions", {"model": "m1", "prompt": "a b c"})
    assert status == 200 and json.loads(body)["object"] == "text_completion"
    status, _, body = client.request("POST", "/v1/embeddings", {"model": "m1", "input": ["x y", "z"]})
    assert status == 200 and len(json.loads(body)["data"]) == 2


def test_stream_is_relayed_chunk_by_chunk_without_the_usage_chunk_the_client_did_not_ask_for(stack, client):
    _, engine = stack.engine("m1", chunks=5)
    status, headers, body = client.chat(stream=True)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5 and all(c["choices"] for c in chunks)
    assert "usage" not in body.decode()
    # the engine was asked for usage so the ledger could count the stream
    assert json.loads(engine.last_body)["stream_options"] == {"include_usage": True}
    assert stack.sql("SELECT prompt_tokens, completion_tokens, stream FROM requests") == [(2, 5, 1)]


def test_stream_keeps_the_usage_chunk_when_the_client_asked_for_it(stack, client):
    _, engine = stack.engine("m1", chunks=3)
    raw = b'{"model":"m1","stream":true,"stream_options":{"include_usage":true},"prompt":"a b c d"}'
    status, _, body = client.request("POST", "/v1/completions", raw)
    events = sse_events(body)
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert engine.last_body == raw


def test_stream_options_without_include_usage_get_it_added(stack, client):
    _, engine = stack.engine("m1", chunks=2)
    status, _, body = client.chat(stream=True, stream_options={"include_usage": False})
    assert status == 200 and "usage" not in body.decode()
    assert json.loads(engine.last_body)["stream_options"] == {"include_usage": True}


# -- errors in OpenAI's shape ----------------------------------------------------------------------
def test_errors_have_openai_bodies_and_statuses(stack, client):
    stack.engine("m1", labels={"site": "a"})
    other = stack.key("bob", allow=["site=b"])
    cases = [
        (client.request("POST", "/v1/chat/completions", b"{not json"), 400, "invalid_json"),
        (client.request("POST", "/v1/chat/completions", {"messages": []}), 400, "missing_model"),
        (client.request("POST", "/v1/chat/completions", {"model": "m1"}, key=""), 401, "missing_api_key"),
        (client.request("POST", "/v1/chat/completions", {"model": "m1"}, key="sk-otela-nope"), 401,
         "invalid_api_key"),
        (client.request("POST", "/v1/chat/completions", {"model": "m1"}, key=other), 404, "model_not_found"),
        (client.request("POST", "/v1/chat/completions", {"model": "nope"}), 404, "model_not_found"),
        (client.request("GET", "/nothing"), 404, "unknown_url"),   # (under /v1/: relayed, see test_ingress_routes)
        (client.request("GET", "/v1/chat/completions"), 405, "method_not_allowed"),
    ]
    for (status, headers, body), want_status, want_code in cases:
        assert (status, error_of(body)["code"]) == (want_status, want_code)
        assert headers["content-type"] == "application/json"
    assert error_of(cases[1][0][2])["param"] == "model"


def test_a_body_over_the_limit_is_refused_with_413(tmp_path):
    stack = Stack(str(tmp_path / "o.sqlite"), limits=otela_ingress.Limits(max_body_bytes=1000))
    try:
        client = Client(stack.url, stack.key())
        stack.engine("m1")
        status, _, body = client.chat(content="x " * 1000)
        assert status == 413 and error_of(body)["code"] == "request_too_large"
    finally:
        stack.close()


def test_rate_limited_key_gets_429_with_retry_after(stack):
    stack.engine("m1")
    client = Client(stack.url, stack.key("slow", rate=1))
    statuses = [client.chat()[0] for _ in range(3)]
    status, headers, body = client.chat()
    assert statuses[0] == 200 and status == 429
    assert headers["retry-after"] == "1" and error_of(body)["type"] == "rate_limit_error"


def test_no_healthy_provider_gives_503_with_retry_after(stack, client):
    down, _ = stack.engine("m1")
    stack.call(stack.node.set_state, down, crdt.DOWN)
    suspected, _ = stack.engine("m2")
    stack.call(stack.node.suspect, suspected)
    for model in ("m1", "m2"):
        status, headers, body = client.chat(model)
        assert status == 503 and error_of(body)["code"] == "no_healthy_provider"
        assert int(headers["retry-after"]) > 0


def test_502_when_every_attempt_failed(stack, client):
    for _ in range(3):   # no answer at all (a 500 from two sessions is the request's: passed on)
        stack.engine("m1", mode="reset")
    status, _, body = client.chat()
    assert status == 502 and error_of(body)["code"] == "upstream_failed"
    assert stack.ingress.metrics.retries == 2


def test_engine_client_errors_are_passed_through_not_retried(stack, client):
    _, engine = stack.engine("m1")
    status, _, body = client.request("POST", "/v1/chat/completions", b'["m1"]')
    assert status == 400   # refused by the ingress: not an object
    stack.engine("m1")
    assert engine.requests == 0


def test_oversized_headers_get_431(stack):
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 431 ")


def test_connections_over_the_limit_get_503(tmp_path):
    stack = Stack(str(tmp_path / "o.sqlite"), limits=otela_ingress.Limits(max_connections=2))
    socks = []
    try:
        socks = [socket.create_connection(("127.0.0.1", stack.port)) for _ in range(2)]
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", stack.port)) as extra:
            extra.settimeout(5)
            assert extra.recv(100).startswith(b"HTTP/1.1 503 ")
        socks[0].sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert socks[0].recv(100).startswith(b"HTTP/1.1 200 ")
    finally:
        for s in socks:
            s.close()
        stack.close()


# -- keys and allowlists ---------------------------------------------------------------------------
def test_allowlist_is_enforced_over_many_requests(stack):
    a1, _ = stack.engine("m1", labels={"site": "a"})
    a2, _ = stack.engine("m1", owner="carol@gpu7")
    b1, _ = stack.engine("m1", labels={"site": "b"})
    restricted = Client(stack.url, stack.key("bob", allow=["site=a", "carol@gpu7"]))
    anyone = Client(stack.url, stack.key("dave"))
    served = {restricted.chat()[1]["x-otela-session"] for _ in range(60)}
    assert served == {a1, a2}
    served_any = {anyone.chat()[1]["x-otela-session"] for _ in range(60)}
    assert served_any == {a1, a2, b1}


def test_allowlist_matches_owner_label_pair_label_value_or_session():
    owner, labels = "ann@h1", {"site": "lrz", "tier": "gold"}
    assert allowed([], "s1", owner, labels)
    assert allowed(["ann@h1"], "s1", owner, labels)
    assert allowed(["site=lrz"], "s1", owner, labels)
    assert allowed(["gold"], "s1", owner, labels)
    assert allowed(["s1"], "s1", owner, labels)
    assert not allowed(["site=gold", "bob@h1", "s2"], "s1", owner, labels)


def test_models_lists_the_union_of_serving_unsuspected_models_the_key_may_use(stack, client):
    stack.engine("m1", labels={"site": "a"})
    stack.engine("m2", labels={"site": "b"})
    down, _ = stack.engine("m3")
    stack.call(stack.node.set_state, down, crdt.DOWN)
    suspected, _ = stack.engine("m4")
    stack.call(stack.node.suspect, suspected)
    status, _, body = client.request("GET", "/v1/models")
    listing = json.loads(body)
    assert status == 200 and listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["m1", "m2"]
    _, _, body = client.request("GET", "/v1/models", key=stack.key("bob", allow=["site=b"]))
    assert [m["id"] for m in json.loads(body)["data"]] == ["m2"]


def test_a_model_is_retrieved_by_its_id_slashes_included_within_the_key_allowlist(stack, client):
    stack.engine("org/m1", labels={"site": "a"})
    for target in ("/v1/models/org/m1", "/v1/models/org%2Fm1"):
        status, _, body = client.request("GET", target)
        assert status == 200 and json.loads(body)["id"] == "org/m1" and json.loads(body)["object"] == "model"
    for target, key in (("/v1/models/m2", None), ("/v1/models/org/m1", stack.key("bob", allow=["site=b"]))):
        status, _, body = client.request("GET", target, key=key)
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert client.request("GET", "/v1/models/org/m1", key="sk-otela-wrong")[0] == 401
    assert client.request("POST", "/v1/models/org/m1")[0] == 405


def test_a_suspected_session_gets_no_requests(stack, client):
    healthy, _ = stack.engine("m1")
    suspected, engine = stack.engine("m1")
    stack.call(stack.node.suspect, suspected)
    assert {client.chat()[1]["x-otela-session"] for _ in range(20)} == {healthy}
    assert engine.requests == 0


def keys_cli(db, *args):
    return subprocess.run([sys.executable, "otela_ingress.py", "keys", *args, "--db", db],
                          capture_output=True, text=True, timeout=30)


def test_keys_cli_creates_lists_and_revokes_hashed_keys(stack):
    stack.engine("m1")
    made = keys_cli(stack.db_path, "create", "--user", "erin", "--allow", "site=a,bob@x", "--admin")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("sk-otela-") and "key id" in made.stderr
    listed = keys_cli(stack.db_path, "list", "--json")
    row = [r for r in json.loads(listed.stdout) if r["user"] == "erin"][0]
    assert row["allow"] == ["bob@x", "site=a"] and row["admin"] is True and row["revoked"] is None
    assert token not in open(stack.db_path, "rb").read().decode("latin-1")   # only its hash is stored
    client = Client(stack.url, token)
    deadline = time.monotonic() + 5
    while client.request("GET", "/v1/models")[0] != 200:   # picked up by the reload within ~1 s
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert keys_cli(stack.db_path, "revoke", row["id"]).returncode == 0
    deadline = time.monotonic() + 5
    while client.request("GET", "/v1/models")[0] != 401:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    again = keys_cli(stack.db_path, "revoke", row["id"])
    assert again.returncode == 1 and "no active key" in again.stderr


def test_keys_cli_usage_error_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "otela_ingress.py", "keys", "create"], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2 and "--user" in done.stderr


@pytest.mark.parametrize("args, says", [
    (["--user", " "], "--user"), (["--user", "a\tb"], "--user"),
    (["--user", "ann", "--allow", ""], "--allow"), (["--user", "ann", "--allow", " , ,"], "--allow"),
    (["--user", "ann", "--rate", "-1"], "--rate"), (["--user", "ann", "--rate", "nan"], "--rate"),
    (["--user", "ann", "--rate", "inf"], "--rate")])
def test_keys_cli_refuses_a_key_for_nobody_or_for_an_empty_allowlist(tmp_path, args, says):
    db = str(tmp_path / "keys.sqlite")
    done = keys_cli(db, "create", *args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("otela-ingress: " + says) and done.stderr.count("\n") == 1
    assert not os.path.exists(db)   # nothing written


# -- retries and passive health --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["reset", "error500", "cut"])
def test_a_failing_engine_costs_clients_nothing(stack, client, mode):
    good, _ = stack.engine("m1")
    bad, bad_engine = stack.engine("m1", mode=mode)
    statuses = [client.chat()[0] for _ in range(40)]
    assert statuses == [200] * 40
    assert stack.ingress.metrics.retries >= 1
    # the bad engine leaves this ingress's rotation after two failures in a row
    assert bad_engine.requests <= 3
    assert bad in stack.ingress.health.sick(time.monotonic())


def test_a_killed_engine_costs_clients_nothing(stack, client):
    stack.engine("m1")
    _, doomed = stack.engine("m1")
    stack.run(doomed.close())
    assert [client.chat()[0] for _ in range(30)] == [200] * 30


def test_a_stream_that_fails_before_its_first_byte_is_retried(stack, client):
    stack.engine("m1", mode="cut", chunks=1)   # cut: drops the connection before any chunk
    stack.engine("m1", mode="reset")
    good, _ = stack.engine("m1", chunks=4)
    for _ in range(5):
        status, headers, body = client.chat(stream=True)
        assert status == 200 and headers["x-otela-session"] == good
        assert len(sse_events(body)) == 5


def test_a_stream_cut_midway_ends_with_an_error_event_and_done(stack, client):
    stack.engine("m1", mode="cut", chunks=8)
    status, _, body = client.chat(stream=True)
    events = sse_events(body)
    assert status == 200
    assert len(events) == 4 + 2
    assert all(json.loads(e)["choices"] for e in events[:4])
    assert json.loads(events[4])["error"]["code"] == "stream_cut"
    assert events[5] == "[DONE]"
    assert stack.ingress.metrics.stream_cuts == 1


def test_a_stream_cut_midway_is_continued_on_another_session_from_the_text_that_went_out(stack, client):
    cut, _ = stack.engine("m1", mode="cut", chunks=8)
    good, good_engine = stack.engine("m1", chunks=8)
    resumed = 0
    for i in range(12):   # different prompts: the policy spreads them over both sessions
        status, headers, body = client.chat(content=f"question {i} " * 40, stream=True, max_tokens=100)
        events = sse_events(body)
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["choices"] and "error" not in c for c in chunks)
        assert {c["id"] for c in chunks} == {chunks[0]["id"]}   # one id, the one the client saw first
        if headers["x-otela-session"] != cut:
            assert len(chunks) == 8
            continue
        resumed += 1
        assert len(chunks) == 4 + 8   # 4 from the cut engine, then the continuation's
        sent = json.loads(good_engine.last_body)
        assert sent["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 tok2 tok3 "}
        assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
        assert sent["max_tokens"] == 100 - 4
    assert resumed and stack.ingress.metrics.stream_resumes == resumed
    assert stack.ingress.metrics.stream_cuts == 0
    # metered as one answer: the continuation's engine counted the 4 tokens before it as prompt
    rows = stack.sql("SELECT status, prompt_tokens, completion_tokens, attempts FROM requests")
    assert sorted(rows) == sorted([(200, 80, 12, 2)] * resumed + [(200, 80, 8, 1)] * (12 - resumed))


def test_a_stream_of_reasoning_or_several_choices_is_cut_not_continued():
    watch = StreamWatch(strip=True)
    watch.feed(b'data: {"id":"a","choices":[{"delta":{"content":"x"}}]}\n\n')
    assert watch.generated() == "x"
    watch.feed(b'data: {"id":"a","choices":[{"delta":{"reasoning_content":"hm"}}]}\n\n')
    assert watch.generated() is None
    watch = StreamWatch(strip=True)   # a tool call's arguments, in one read with text before it
    watch.feed(b'data: {"id":"a","choices":[{"delta":{"content":"x"}}]}\n\n'
               b'data: {"id":"a","choices":[{"delta":{"content":null,"tool_calls":[{"index":0}]}}]}\n\n')
    assert watch.generated() is None
    watch = StreamWatch(strip=True)
    watch.feed(b'data: {"id":"a","choices":[{"delta":{"content":"\\"q\\" \\u00e9"}}]}\n\n')
    assert watch.generated() == '"q" \u00e9'
    watch.continued()   # a continuation's chunks take the id the client saw
    out = watch.feed(b'data: {"id": "b", "choices":[{"delta":{"content":"y"}}]}\n\n')
    assert out == b'data: {"id": "a", "choices":[{"delta":{"content":"y"}}]}\n\n'
    assert watch.generated() == '"q" \u00e9y'


def test_passive_health_backoff_grows_per_relapse_and_ends_on_success():
    health = PassiveHealth()
    health.failed("s", 0.0)
    assert not health.is_sick("s", 0.0)
    health.failed("s", 0.0)
    assert health.is_sick("s", 0.5) and not health.is_sick("s", 1.0)   # probed back in after 1 s
    health.failed("s", 1.0)
    assert health.is_sick("s", 2.9) and not health.is_sick("s", 3.0)   # relapse: 2 s
    health.failed("s", 3.0)
    assert health.is_sick("s", 6.9)                                    # then 4 s
    health.succeeded("s")
    assert not health.is_sick("s", 3.1) and health.sick(3.1) == []



def test_failures_on_an_old_path_do_not_keep_a_session_out_of_rotation():
    health = PassiveHealth()
    health.failed("s", 0.0, "10.0.1.2:7700")
    health.failed("s", 0.0, "10.0.1.2:7700")
    assert health.is_sick("s", 0.5)
    health.moved("s", "10.0.1.2:7700")                  # the same path: still out
    assert health.is_sick("s", 0.5)
    health.moved("s", "relay/ab12")                     # its record names a relayed address now
    assert not health.is_sick("s", 0.5) and health.failures == {} and health.paths == {}
    health.failed("s", 1.0, "relay/ab12")
    health.failed("s", 1.0, "10.0.1.2:7700")            # a late failure on the old path starts over
    assert health.failures == {"s": 1} and not health.is_sick("s", 1.0)


def test_a_session_whose_record_names_another_address_than_its_failures_is_back_in_rotation(stack):
    sid, _ = stack.engine("m1")                         # its record: the engine's address
    for _ in range(2):                                  # failures on an address it had before
        stack.call(stack.ingress.health.failed, sid, time.monotonic(), "10.0.1.2:7700")
    assert stack.call(lambda: stack.ingress.health.is_sick(sid, time.monotonic()))

    def rewritten():                                    # a new version of its record arrives
        stack.node.registry.put(sid, dict(stack.node.registry.get(sid), version=9))
        stack.node._changed(sid)
    stack.call(rewritten)
    assert not stack.call(lambda: stack.ingress.health.is_sick(sid, time.monotonic()))


def test_a_connect_failure_is_retried_on_a_session_out_of_rotation_when_no_other_is_left(stack, client):
    from fake_engine import free_port
    good, _ = stack.engine("m1")
    dead = stack.call(stack.node.add_worker, f"127.0.0.1:{free_port()}", ["m1"])   # nothing listens
    addr = stack.call(lambda: stack.node.registry.get(good)["addr"])
    for _ in range(2):                                  # out of rotation: the dead one is picked first
        stack.call(stack.ingress.health.failed, good, time.monotonic(), addr)
    status, headers, _ = client.chat()
    assert status == 200 and headers["x-otela-session"] == good
    assert stack.call(lambda: stack.ingress.health.failures.get(dead)) == 1

# -- policies --------------------------------------------------------------------------------------
def candidates(n, **record):
    return [Candidate(f"s{i}", dict({"addr": f"h:{i}"}, **record)) for i in range(n)]


def test_round_robin_cycles_through_candidates():
    policy, cands = RoundRobinPolicy(), candidates(3)
    req = RoutedRequest("m", "u", "k", False, "/v1/completions")
    assert [policy.pick(cands, req).session for _ in range(6)] == ["s0", "s1", "s2"] * 2


def test_least_loaded_picks_the_session_with_fewest_outstanding_requests():
    policy, cands = LeastLoadedPolicy(), candidates(3)
    req = RoutedRequest("m", "u", "k", False, "/v1/completions")
    for c in cands[:2]:
        policy.on_request_start(c, req)
    assert policy.pick(cands, req).session == "s2"
    for c in cands[:2]:
        policy.on_request_end(c, req, True)
    assert policy.outstanding == {}


def test_hardware_weights_follow_capacity_then_gpu_bandwidth():
    assert hardware_weight({"capacity": 7}) == 7.0
    assert hardware_weight({"hardware": {"gpu": "NVIDIA H100 80GB HBM3", "count": 2}}) == pytest.approx(6.7)
    assert hardware_weight({"hardware": {"gpu": "NVIDIA A100-SXM4-80GB", "count": 1}}) == 2.0
    assert hardware_weight({"hardware": {"gpu": "CPU"}}) == otela_ingress.CPU_WEIGHT
    big, small = Candidate("big", {"capacity": 9.0}), Candidate("small", {"capacity": 1.0})
    picks = [HardwarePolicy().pick([big, small], None).session for _ in range(2000)]
    assert 0.85 < picks.count("big") / 2000 < 0.95


class FirstPolicy:
    """A user's own policy: always the first candidate (no hooks: they are optional)."""

    def pick(self, candidates, request):
        return candidates[0]


def test_policy_can_be_loaded_from_module_and_class():
    policy = load_policy("test_ingress:FirstPolicy")
    assert policy.pick(candidates(2), None).session == "s0"
    policy.on_request_start(None, None)
    assert isinstance(load_policy("round_robin"), RoundRobinPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        load_policy("fastest")


# -- stream usage watch ----------------------------------------------------------------------------
def test_stream_watch_strips_the_usage_only_chunk_even_when_split_across_reads():
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    stream = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' * 2 + usage + b"data: [DONE]\n\n"
    for split in range(1, len(stream)):
        watch = StreamWatch(strip=True)
        out = watch.feed(stream[:split]) + watch.feed(stream[split:]) + watch.flush()
        assert out == stream.replace(usage, b"")
        assert (watch.prompt_tokens, watch.completion_tokens) == (3, 2)
    watch = StreamWatch(strip=False)
    assert watch.feed(stream) == stream and watch.completion_tokens == 2



_USAGE_PIECES = st.sampled_from([
    b'"usage"', b'"prompt_tokens"', b'"completion_tokens"', b":", b" ", b"\n", b"\t", b",", b"}", b"{",
    b"0", b"7", b"12", b"123456789012345678901234", b"-1", b"x", b'"', b"1_0", b"\xff"])


@settings(max_examples=500, deadline=None)
@given(st.lists(_USAGE_PIECES, max_size=30), st.integers(0, 40))
def test_usage_is_read_as_the_patterns_read_it_whatever_the_spacing_and_junk(pieces, start):
    body = b"".join(pieces)
    at = body.rfind(b'"usage"', start)
    expect = (0, 0)
    if at >= 0:
        prompt = otela_node._PROMPT_TOKENS.search(body, at)
        completion = otela_node._COMPLETION_TOKENS.search(body, at)
        expect = (int(prompt.group(1)) if prompt else 0, int(completion.group(1)) if completion else 0)
    # a count of more than 19 digits is read as 10**19 (never an int of an engine's megabyte of digits)
    expect = tuple(min(n, 10 ** 19) for n in expect)
    assert otela_ingress.usage_of(body, start) == expect


def _take_usage_by_splitting(watch: StreamWatch, piece: bytes) -> bytes:
    """The reference: every event split out, each one with a usage object read (and a usage-only
    one dropped when the client did not ask for it)."""
    import re
    kept = []
    for event in re.split(rb"(?<=\n\n)|(?<=\r\n\r\n)", piece):
        if not event:
            continue
        if otela_ingress._USAGE.search(event) is not None:
            watch.prompt_tokens, watch.completion_tokens = otela_ingress.usage_of(event)
            watch.saw_usage = True
            if watch.strip and re.search(rb'"choices"\s*:\s*\[\s*\]', event):
                continue
        kept.append(event)
    return b"".join(kept)


_SSE_EVENTS = st.sampled_from([
    b'data: {"choices":[{"delta":{"content":"a"}}]}',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
    b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":5,"completion_tokens":7}}',
    b'data: {"usage" : {"prompt_tokens":1}, "choices" : [ ]}',
    b": keep-alive", b"data: [DONE]", b'data: {"usage":{', b"event: x\ndata: y", b'data: "usage"', b':{"a":1}'])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_SSE_EVENTS, st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n"])), max_size=12),
       st.booleans())
def test_the_usage_reader_agrees_with_splitting_every_event(events, strip):
    piece = b"".join(event + end for event, end in events)
    fast, slow = StreamWatch(strip), StreamWatch(strip)
    assert fast._take_usage(piece) == _take_usage_by_splitting(slow, piece)
    assert (fast.prompt_tokens, fast.completion_tokens, fast.saw_usage) == \
        (slow.prompt_tokens, slow.completion_tokens, slow.saw_usage)


# -- the usage ledger ------------------------------------------------------------------------------
def test_ledger_token_sums_equal_the_engines_reported_usage(stack, client):
    stack.engine("m1", chunks=3)
    stack.engine("m1", chunks=5)
    reported = [0, 0]
    for i in range(30):
        if i % 2:
            _, _, body = client.chat(content="w " * i)
            usage = json.loads(body)["usage"]
        else:
            _, _, body = client.chat(content="w " * i, stream=True, stream_options={"include_usage": True})
            usage = json.loads(sse_events(body)[-2])["usage"]
        reported[0] += usage["prompt_tokens"]
        reported[1] += usage["completion_tokens"]
    rows = stack.sql("SELECT count(*), sum(prompt_tokens), sum(completion_tokens) FROM requests")
    assert rows == [(30, reported[0], reported[1])]
    daily = stack.sql("SELECT user, model, requests, prompt_tokens, completion_tokens FROM daily")
    assert daily == [("alice", "m1", 30, reported[0], reported[1])]


def test_opted_out_requests_leave_no_row_but_are_counted(stack, client):
    stack.engine("m1")
    client.chat()
    client.chat(headers={"x-otela-no-track": "1"})
    client.chat(headers={"x-otela-no-track": "1"}, stream=True)
    assert stack.sql("SELECT count(*) FROM requests") == [(1,)]
    assert stack.sql("SELECT requests, opted_out FROM daily") == [(3, 2)]


def test_usage_needs_an_admin_key_and_totals_per_user_model_and_day(stack, client):
    stack.engine("m1", chunks=2)
    stack.engine("m2", chunks=4)
    bob = Client(stack.url, stack.key("bob"))
    client.chat("m1")
    client.chat("m2")
    bob.chat("m2")
    status, _, body = client.request("GET", "/v1/usage")
    assert status == 403 and error_of(body)["code"] == "admin_required"
    status, _, body = client.request("GET", "/v1/usage?days=2", key=stack.key("root", admin=True))
    usage = json.loads(body)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert status == 200
    assert [(d["day"], d["user"], d["model"], d["requests"], d["completion_tokens"]) for d in usage["data"]] == [
        (today, "alice", "m1", 1, 2), (today, "alice", "m2", 1, 4), (today, "bob", "m2", 1, 4)]
    assert usage["totals"]["requests"] == 3 and usage["totals"]["completion_tokens"] == 10


def test_usage_stats_give_arrival_rate_and_token_mean_and_std(stack, client):
    stack.engine("m1", chunks=4)
    for words in (2, 4, 6):
        client.chat(content="w " * words)
    status, _, body = client.request("GET", "/v1/usage/stats")
    stats = json.loads(body)["models"]["m1"]
    assert status == 200 and stats["requests"] == 3
    assert stats["input_tokens"]["mean"] == pytest.approx(4.0)
    assert stats["input_tokens"]["std"] == pytest.approx((8 / 3) ** 0.5)
    assert stats["output_tokens"] == {"mean": 4.0, "std": 0.0}
    assert stats["arrival_rate"] > 0


KILL9_SERVER = r"""
import asyncio, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import otela_ingress
from test_ingress_support import StandInNode
from fake_engine import start_fake_engine

async def main():
    node = StandInNode()
    engine = await start_fake_engine(int(sys.argv[3]), model="m1")
    node.add_worker("127.0.0.1:" + sys.argv[3], ["m1"])
    ingress = otela_ingress.Ingress(node, db_path=sys.argv[2], no_auth=True)
    port = await ingress.start("127.0.0.1", 0)
    print(port, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def test_kill_9_after_n_completed_requests_leaves_n_rows(tmp_path):
    from fake_engine import free_port
    db = str(tmp_path / "ledger.sqlite")
    root = str(otela_ingress.__file__).rsplit("/", 1)[0]
    proc = subprocess.Popen([sys.executable, "-c", KILL9_SERVER, root, db, str(free_port())],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        client = Client(f"http://127.0.0.1:{port}")
        n = 25
        for i in range(n):
            assert client.chat(stream=bool(i % 2))[0] == 200
        proc.kill()   # SIGKILL right after the last response arrived
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the next start of the ingress applies what the journal holds beyond SQLite
    ledger = otela_ingress.Ledger(db, lambda keys: None)
    ledger.close()
    import sqlite3
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM requests").fetchone() == (n,)
        assert conn.execute("SELECT sum(requests) FROM daily").fetchone() == (n,)
    # and applying it is idempotent: a second start adds nothing
    otela_ingress.Ledger(db, lambda keys: None).close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM requests").fetchone() == (n,)


# -- observability ---------------------------------------------------------------------------------
def test_metrics_parse_with_prometheus_client(stack, client):
    from prometheus_client.parser import text_string_to_metric_families
    stack.engine("m1")
    bad, _ = stack.engine("m1", mode="error500")
    for _ in range(6):
        client.chat()
        client.chat(stream=True)
    client.chat("unknown")
    status, headers, body = client.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("otela_requests_total", (("code", "200"), ("model", "m1")))] == 12
    assert samples[("otela_requests_total", (("code", "404"), ("model", "")))] == 1
    assert samples[("otela_retries_total", ())] >= 1
    assert samples[("otela_request_duration_seconds_count", (("model", "m1"),))] == 12
    assert samples[("otela_tokens_total", (("direction", "output"), ("model", "m1")))] == 12 * 8
    assert samples[("otela_sessions", (("state", "SERVING"),))] == 2
    assert families["otela_request_duration_seconds"].type == "histogram"


def test_healthz_and_registry_answer(stack):
    sid, _ = stack.engine("m1")
    client = Client(stack.url)
    status, _, body = client.request("GET", "/healthz")
    assert status == 200 and json.loads(body)["serving_sessions"] == 1
    status, _, body = client.request("GET", "/v1/registry")
    view = json.loads(body)
    assert status == 200 and view["sessions"][sid]["models"] == ["m1"]
    assert view["ingress"]["sick"] == []
    status, headers, body = client.request("GET", "/dashboard")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"<script>" in body


# -- one client never stalls another ---------------------------------------------------------------
def test_a_slow_or_silent_client_does_not_stall_others(stack, client):
    stack.engine("m1", chunks=2000)
    # a client that streams a long answer and never reads it
    reader = socket.create_connection(("127.0.0.1", stack.port))
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    reader.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {client.key}\r\n"
                   f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}".encode())
    # and one that sends half a request head and goes quiet
    silent = socket.create_connection(("127.0.0.1", stack.port))
    silent.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    try:
        t0 = time.monotonic()
        assert [client.chat()[0] for _ in range(20)] == [200] * 20
        assert time.monotonic() - t0 < 10   # generous: only a stall would take this long
    finally:
        reader.close()
        silent.close()


def test_expect_100_continue_is_answered_before_the_body_is_sent(stack, client):
    stack.engine("m1")
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x " * 800}]}).encode()
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(5)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                     b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % (client.key.encode(), len(body)))
        assert sock.recv(100).startswith(b"HTTP/1.1 100 ")
        sock.sendall(body)
        answer = b""
        while b'"usage"' not in answer:
            piece = sock.recv(65536)
            assert piece, answer   # (an answer without usage, then a close: not a loop forever)
            answer += piece
        assert answer.startswith(b"HTTP/1.1 200 ")


def test_a_client_that_stops_mid_body_is_closed_after_the_request_timeout(stack, monkeypatch):
    monkeypatch.setattr(stack.ingress.limits, "request_timeout_s", 0.5)
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                     b"content-length: 100\r\n\r\n{\"mo" % stack.key().encode())   # a key: the body is read
        t0 = time.monotonic()
        assert sock.recv(100) == b""   # closed by the ingress, not by us
        assert time.monotonic() - t0 < 5


def test_stopping_lets_requests_in_flight_finish(stack, client):
    import threading
    stack.engine("m1", mode="slow", slow_delay=0.5)
    answers = []
    worker = threading.Thread(target=lambda: answers.append(client.chat()[0]))
    worker.start()
    time.sleep(0.2)
    stack.run(stack.ingress.stop(drain=5.0))
    worker.join(10)
    assert answers == [200]
    assert stack.sql("SELECT status FROM requests") == [(200,)]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", stack.port), timeout=2).close()


def test_stream_watch_estimates_completion_tokens_when_the_engine_sends_no_usage():
    watch = StreamWatch(strip=True)
    chat = (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
            + b'data: {"choices":[{"delta":{"content": "tok"}}]}\n\n' * 3
            + b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    assert watch.feed(chat) == chat and watch.tokens() == (None, 3)
    watch = StreamWatch(strip=True)
    text = b'data: {"choices":[{"text":"a"}]}\n\n' * 2 + b'data: {"choices":[{"text":""}]}\n\n'
    assert watch.feed(text) == text and watch.tokens() == (None, 2)


def test_a_second_ingress_on_the_same_ledger_is_refused(stack):
    with pytest.raises(ValueError, match="another running ingress"):
        otela_ingress.Ledger(stack.db_path, lambda keys: None)


def test_usage_stats_leave_unknown_prompt_sizes_out_of_the_input_statistics():
    stats = otela_ingress.UsageStats(window=60)
    stats.add("m", 100.0, None, 5)
    assert stats.view(101.0)["models"]["m"]["input_tokens"] is None
    stats.add("m", 101.0, 10, 7)
    view = stats.view(102.0)["models"]["m"]
    assert view["input_tokens"] == {"mean": 10.0, "std": 0.0}
    assert view["output_tokens"] == {"mean": 6.0, "std": 1.0} and view["requests"] == 2


def _read_answers(sock: socket.socket, count: int) -> list:
    """`count` Content-Length responses off a blocking socket: [(status line, body)]."""
    data, answers = b"", []
    while len(answers) < count:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            head = data[:end].lower()
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            if len(data) >= end + 4 + length:
                answers.append((data[:data.find(b"\r\n")], data[end + 4:end + 4 + length]))
                data = data[end + 4 + length:]
                continue
        piece = sock.recv(65536)
        assert piece, f"closed after {len(answers)} answers"
        data += piece
    return answers


def test_pipelined_requests_then_a_chunked_one_on_the_same_connection_are_all_answered(stack, client):
    # plain requests take the ingress's own parser; the chunked one hands the connection to h11
    stack.engine("m1")
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
    plain = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
             b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (client.key.encode(), len(body), body))
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
               b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (client.key.encode(), len(body), body))
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(10)
        sock.sendall(plain + plain + chunked)
        answers = _read_answers(sock, 3)
        sock.sendall(plain + b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        answers += _read_answers(sock, 2)
    assert [status for status, _ in answers] == [b"HTTP/1.1 200 OK"] * 5
    assert all(json.loads(b)["usage"]["prompt_tokens"] == 1 for _, b in answers[:4])
    assert json.loads(answers[4][1])["status"] == "ok"


def test_http_1_0_and_bad_request_lines_keep_h11s_answers(stack, client):
    stack.engine("m1")
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        (status, body), = _read_answers(sock, 1)
        assert status.startswith(b"HTTP/1.1 200 ") and json.loads(body)["status"] == "ok"
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n")
        (status, body), = _read_answers(sock, 1)
        assert status.startswith(b"HTTP/1.1 400 ") and "error" in json.loads(body)


def test_journal_rows_spread_over_many_mapped_files_are_all_recovered(tmp_path, monkeypatch):
    monkeypatch.setattr(otela_ingress, "LEDGER_JOURNAL_MAX", 256)   # about two rows per file
    db = str(tmp_path / "ledger.sqlite")
    ledger = otela_ingress.Ledger(db, lambda keys: None)
    ledger._commit = lambda rows, position: None   # as if killed before any batch reached SQLite
    for i in range(9):
        ledger.record((1764430000.0 + i, "k", "user", "model", "s", "o", 200, 1, i, 1.5, 0, 1, 1))
    assert ledger.seq >= 3
    ledger._closing = True
    ledger._wake.set()
    ledger._thread.join(10)
    import os
    os.close(ledger._lock)   # the lock of a dead process is released
    otela_ingress.Ledger(db, lambda keys: None).close()
    import sqlite3
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*), sum(completion_tokens) FROM requests").fetchone() == (9, 36)


def test_keys_cli_names_a_db_it_cannot_use_and_leaves_it_alone(tmp_path):
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_bytes(b"my notes, not a database\n" * 200)
    for args in (("list",), ("create", "--user", "ann"), ("revoke", "abc")):
        done = keys_cli(str(not_a_db), *args)
        assert done.returncode == 2 and done.stderr == f"otela-ingress: --db {not_a_db}: file is not a database\n"
    assert not_a_db.read_bytes() == b"my notes, not a database\n" * 200
    done = keys_cli(str(tmp_path / "no" / "such" / "dir.sqlite"), "create", "--user", "ann")
    assert done.returncode == 2 and "unable to open database file" in done.stderr
    done = keys_cli(str(tmp_path / "no" / "such" / "dir.sqlite"), "list")   # never a new, empty one
    assert done.returncode == 2 and "no such database" in done.stderr


def test_serve_refuses_addresses_it_cannot_use_in_one_line(tmp_path):
    assert subprocess.run([sys.executable, "otela_node.py", "keygen", "--out", str(tmp_path)],
                          capture_output=True, timeout=60).returncode == 0
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = f"127.0.0.1:{held.getsockname()[1]}"
    try:
        for flags, says in ((["--listen", "127.0.0.1:99999"], "port 0-65535"),
                            (["--gossip", "127.0.0.1:65536"], "port 0-65535"),
                            (["--gossip", "no-such-host.invalid:0"], "cannot bind the gossip address"),
                            (["--listen", taken], f"cannot serve the API on {taken}")):
            done = subprocess.run([sys.executable, "otela_ingress.py", "serve", "--key-file",
                                   str(tmp_path / "cluster.key"), "--db", str(tmp_path / "x.sqlite"),
                                   "--gossip", "127.0.0.1:0", *flags], capture_output=True, text=True, timeout=60)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and says in lines[0], (flags, done.stderr)
    finally:
        held.close()


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_awaited_from_a_session_gone_unroutable_is_retried_on_another(stack, client, stream):
    """Its site cut off: the session stops answering without a reset and is suspected; what it
    was silently working on goes to another session within seconds, not after the idle timeout."""
    import threading
    silent, _ = stack.engine("m1", mode="slow", slow_delay=60.0)
    answers = []
    worker = threading.Thread(target=lambda: answers.append(client.chat(stream=stream)))
    worker.start()
    deadline = time.monotonic() + 5
    while not stack.call(lambda: stack.ingress.pool.active) and time.monotonic() < deadline:
        time.sleep(0.02)   # its attempt is at the silent session
    other, _ = stack.engine("m1")
    t0 = time.monotonic()
    stack.call(stack.node.suspected.add, silent)
    stack.call(stack.node._changed, silent)
    worker.join(15)
    status, headers, _ = answers[0]
    assert status == 200 and headers["x-otela-session"] == other
    assert time.monotonic() - t0 < otela_ingress.GONE_SILENT_S + 2 * otela_ingress.SWEEP_INTERVAL_S + 2
