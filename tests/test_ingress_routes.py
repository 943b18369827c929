"""Every client, every route (issue 42): any method, any path under /v1/ and the engine routes a
site enables, any body (JSON, multipart, none), relayed as the engine answers it: a stream of any
route event by event, the model found wherever the request names it (or any session of the key's
models when it names none), with the keys, the ledger and the retries of the completion routes;
and fallbacks that fall back, to the next model of an alias or of --fallback."""
from __future__ import annotations

import json
import socket
import time

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ingress_support import Client, Collector, Stack, read_to_close

import otela_ingress


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=30)


def error_code(body: bytes):
    return json.loads(body)["error"]["code"]


@pytest.fixture
def native(tmp_path):
    s = Stack(str(tmp_path / "native.sqlite"), native_routes=["/tokenize", "/detokenize", "/generate"])
    try:
        yield s
    finally:
        s.close()


# -- 1. one relay for any route ----------------------------------------------------------------
def test_a_responses_stream_reaches_the_client_event_by_event_as_the_engine_sends_it(stack):
    stack.engine("m1", chunks=5, chunk_delay=0.3)
    key = stack.key()
    client = sdk(stack, key)
    # The SDK builds its Responses event models on the first event it parses (1.5 s on a busy
    # box, holding the events behind it): one stream first, so that what is timed is the path.
    with client.responses.create(model="m1", input="warm", stream=True) as events:
        assert [event.type for event in events][-1] == "response.completed"
    arrivals, kinds = [], []
    start = time.monotonic()
    with client.responses.create(model="m1", input="hello there", stream=True) as events:
        for event in events:
            arrivals.append(time.monotonic() - start)
            kinds.append(event.type)
    assert kinds == ["response.created"] + ["response.output_text.delta"] * 5 + ["response.completed"]
    # the engine spaces its 7 events 0.3 s apart (1.8 s in all): the first is not held until the last
    assert arrivals[-1] - arrivals[0] > 1.0
    assert stack.sql("SELECT model, status, prompt_tokens, completion_tokens, stream FROM requests")[-1] == (
        "m1", 200, 2, 5, 1)   # usage from response.completed's input_tokens and output_tokens


def test_a_whole_responses_answer_is_booked_from_its_input_and_output_tokens(stack):
    stack.engine("m1", chunks=3)
    response = sdk(stack, stack.key()).responses.create(model="m1", input="one two three four")
    assert response.output_text == "tok0 tok1 tok2 "
    assert stack.sql("SELECT model, prompt_tokens, completion_tokens, stream FROM requests") == [("m1", 4, 3, 0)]


def test_a_responses_request_is_retried_on_another_session_before_its_first_byte(stack):
    stack.engine("m1", mode="error500")
    stack.engine("m1", chunks=2)
    client = sdk(stack, stack.key())
    answers = [client.responses.create(model="m1", input="hi").output_text for _ in range(6)]
    assert answers == ["tok0 tok1 "] * 6
    assert {status for status, in stack.sql("SELECT status FROM requests")} == {200}


def test_a_responses_stream_cut_mid_way_ends_with_its_own_error_events_and_no_done(stack):
    stack.engine("m1", mode="cut", chunks=6)
    key = stack.key()
    client = Client(stack.url, key)
    try:
        status, _, body = client.request("POST", "/v1/responses", {"model": "m1", "input": "hi", "stream": True})
    finally:
        client.close()
    assert status == 200
    text = body.decode()
    assert "event: response.output_text.delta" in text and "[DONE]" not in text
    assert text.rstrip().split("\n\n")[-2].startswith("event: error\ndata: ")
    last = text.rstrip().split("\n\n")[-1]
    assert last.startswith("event: response.failed\ndata: ")
    assert json.loads(last.split("data: ", 1)[1])["response"]["status"] == "failed"
    assert stack.sql("SELECT status FROM requests") == [(502,)]


def test_a_multipart_audio_upload_is_routed_by_its_model_field_and_relayed_verbatim(stack):
    stack.engine("m1")
    _, m2 = stack.engine("m2")
    audio = bytes(range(256)) * 40   # binary, 10 KiB
    answer = sdk(stack, stack.key()).audio.transcriptions.create(model="m2", file=("a.wav", audio))
    assert answer.text == f"fake transcription of {len(audio)} bytes"
    assert m2.hits.get("/v1/audio/transcriptions") == 1
    assert m2.last_headers["content-type"].startswith("multipart/form-data; boundary=")
    assert stack.sql("SELECT model, status, prompt_tokens, completion_tokens FROM requests") == [
        ("m2", 200, len(audio) // 100, 4)]


def test_a_get_route_without_a_model_is_answered_by_a_session_of_the_keys_models(stack):
    _, engine = stack.engine("m1")
    key = stack.key()
    assert list(sdk(stack, key).files.list()) == []
    assert engine.last_method == "GET" and engine.last_target == "/v1/files"
    client = Client(stack.url, key)
    try:
        status, _, _ = client.request("GET", "/v1/files?purpose=batch&limit=2")
        assert status == 200 and engine.last_target == "/v1/files?purpose=batch&limit=2"   # the query goes too
        status, _, body = client.request("DELETE", "/v1/files/file-123")
        assert (status, engine.last_method) == (404, "DELETE")   # the engine's own answer, passed on
    finally:
        client.close()
    assert stack.sql("SELECT model, status FROM requests") == [("*", 200), ("*", 200), ("*", 404)]


def test_a_request_naming_no_model_with_a_key_that_may_use_none_is_refused_with_the_reason(stack):
    stack.engine("m1", labels={"site": "a"})
    client = Client(stack.url, stack.key("bob", allow=["site=b"]))
    try:
        status, _, body = client.request("GET", "/v1/files")
    finally:
        client.close()
    assert status == 404 and "names no model" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("how", ["header", "query", "path"])
def test_the_model_is_found_in_a_header_the_query_or_the_path(stack, how):
    _, m1 = stack.engine("m1")
    _, m2 = stack.engine("m2")
    target, headers = {"header": ("/v1/files", {"x-otela-model": "m2"}),
                       "query": ("/v1/files?model=m2", {}),
                       "path": ("/v1/fine_tuning/m2/files", {})}[how]
    client = Client(stack.url, stack.key())
    try:
        for _ in range(4):
            client.request("GET", target, headers=headers)
    finally:
        client.close()
    assert (m1.hits, sum(m2.hits.values())) == ({}, 4)
    assert {model for model, in stack.sql("SELECT model FROM requests")} == {"m2"}


def test_native_routes_a_site_enables_are_relayed_and_others_are_not(native):
    _, engine = native.engine("m1", chunks=3)
    client = Client(native.url, native.key())
    try:
        status, _, body = client.request("POST", "/tokenize", {"prompt": "a few words here"})   # no model: vLLM's
        assert (status, json.loads(body)["count"]) == (200, 4)
        status, _, body = client.request("POST", "/detokenize", {"tokens": [1, 2]})
        assert (status, json.loads(body)["prompt"]) == (200, "w ww")
        status, _, body = client.request("POST", "/generate", {"text": "hi", "stream": True})
        assert status == 200
        events = [line for line in body.decode().split("\n") if line.startswith("data: ")]
        assert [json.loads(e[6:])["text"] for e in events[:-1]] == ["tok0 ", "tok0 tok1 ", "tok0 tok1 tok2 "]
        assert events[-1] == "data: [DONE]" and body.count(b"[DONE]") == 1
        status, _, body = client.request("POST", "/flush_cache", {})   # not enabled: never reaches the engine
        assert (status, error_code(body)) == (404, "unknown_url")
        assert Client(native.url, "sk-otela-nope").request("POST", "/tokenize", {"prompt": "x"})[0] == 401
    finally:
        client.close()
    assert "/flush_cache" not in engine.hits


def test_a_v1_tokenize_without_a_model_is_answered(stack):
    _, engine = stack.engine("m1")
    client = Client(stack.url, stack.key())
    try:
        status, _, _ = client.request("POST", "/v1/tokenize", {"prompt": "x"})
    finally:
        client.close()
    assert status == 404 and engine.hits == {"/v1/tokenize": 1}   # the fake engine has no such route: its answer


# -- 1. hostile inputs, held by the existing limits -----------------------------------------------
def test_a_multipart_body_over_the_size_limit_is_refused_413_before_any_engine(tmp_path):
    stack = Stack(str(tmp_path / "small.sqlite"), limits=otela_ingress.Limits(max_body_bytes=64 * 1024))
    try:
        _, engine = stack.engine("m1")
        with pytest.raises(openai.APIStatusError) as refused:
            sdk(stack, stack.key()).audio.transcriptions.create(model="m1", file=("bomb.wav", b"\0" * 200_000))
        assert refused.value.status_code == 413
        assert engine.requests == 0
    finally:
        stack.close()


def test_an_upload_whose_body_never_ends_is_cut_at_the_body_timeout(tmp_path):
    stack = Stack(str(tmp_path / "slow.sqlite"), limits=otela_ingress.Limits(request_timeout_s=1.0))
    try:
        _, engine = stack.engine("m1")
        head = (b"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                b"content-type: multipart/form-data; boundary=b\r\ncontent-length: 100000\r\n\r\n--b\r\n"
                % stack.key().encode())
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            sock.sendall(head)
            _, closed = read_to_close(sock, deadline_s=5.0)
        assert closed and engine.requests == 0
    finally:
        stack.close()


@pytest.mark.parametrize("target", ["/v1/files%2F..%2Fadmin", "/v1/files%5cx", "/v1/files/../admin",
                                    "/v1/files/%2e%2e/admin"])
def test_a_relayed_path_with_dot_segments_or_encoded_separators_is_refused(stack, target):
    _, engine = stack.engine("m1")
    client = Client(stack.url, stack.key())
    try:
        status, _, body = client.request("GET", target)
    finally:
        client.close()
    assert (status, error_code(body)) == (400, "invalid_path")
    assert engine.hits == {}


# -- 2. fallbacks that fall back -------------------------------------------------------------------
def test_an_alias_falls_back_to_its_next_model_when_the_first_fails_before_the_first_byte(tmp_path):
    stack = Stack(str(tmp_path / "alias.sqlite"), aliases={"fast": ["m2", "m1"]})
    try:
        stack.engine("m2", mode="error500")
        _, m1 = stack.engine("m1")
        client = Client(stack.url, stack.key())
        try:
            answers = [client.chat("fast") for _ in range(6)]
        finally:
            client.close()
        assert [status for status, _, _ in answers] == [200] * 6
        assert {json.loads(body)["model"] for _, _, body in answers} == {"m1"}   # the model that answered
        assert {headers["x-otela-model"] for _, headers, _ in answers} == {"m1"}
        assert m1.requests == 6
        assert {model for model, in stack.sql("SELECT model FROM requests")} == {"m1"}
    finally:
        stack.close()


def test_a_fallback_list_moves_a_failing_models_requests_on_in_order_on_every_route(tmp_path):
    stack = Stack(str(tmp_path / "fallback.sqlite"), fallbacks={"m2": ["m3", "m1"]})
    try:
        stack.engine("m2", mode="error500")
        stack.engine("m3", mode="reset")
        _, m1 = stack.engine("m1", chunks=2)
        key = stack.key()
        client = sdk(stack, key)
        assert client.responses.create(model="m2", input="hi").output_text == "tok0 tok1 "
        text = client.audio.transcriptions.create(model="m2", file=("a.wav", b"\1" * 300))
        assert text.model_extra.get("model") == "m1"   # the form's field names the model it went to
        with client.responses.create(model="m2", input="hi", stream=True) as events:
            assert [e.type for e in events][-1] == "response.completed"
        assert m1.requests == 3
        assert stack.sql("SELECT model, status FROM requests") == [("m1", 200)] * 3
        metrics = Client(stack.url).request("GET", "/metrics")[2].decode()
        assert 'otela_fallbacks_total{model="m3",to="m1"}' in metrics
    finally:
        stack.close()


def test_a_model_with_no_session_at_all_goes_straight_to_its_fallback(tmp_path):
    stack = Stack(str(tmp_path / "none.sqlite"), fallbacks={"gone": ["m1"]})
    try:
        stack.engine("m1")
        status, headers, body = Client(stack.url, stack.key()).chat("gone")
        assert (status, headers["x-otela-model"], json.loads(body)["model"]) == (200, "m1", "m1")
    finally:
        stack.close()


def test_a_daily_budget_counts_the_responses_apis_input_and_output_tokens(stack):
    stack.engine("m1", chunks=5)
    db = otela_ingress.open_db(stack.db_path)
    try:
        _, token = otela_ingress.create_key(db, "carol", budget_day=10)
        records = otela_ingress.load_key_records(db)
    finally:
        db.close()
    stack.call(stack.ingress.cluster.read_records, records)
    client = sdk(stack, token)
    client.responses.create(model="m1", input="two words")   # 2 + 5 tokens: within 10
    client.responses.create(model="m1", input="two words")   # 14: the budget is spent after this one
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model="m1", input="two words")


# -- 3. trace context end to end -------------------------------------------------------------------
TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_the_clients_trace_context_request_id_and_user_agent_reach_the_engine_and_the_ledger(stack):
    _, engine = stack.engine("m1")
    client = Client(stack.url, stack.key())
    try:
        status, headers, _ = client.chat(headers={"traceparent": f"00-{TRACE}-{SPAN}-01", "tracestate": "vendor=x1",
                                                  "x-request-id": "req-abc", "user-agent": "app/1.2"})
    finally:
        client.close()
    assert status == 200
    sent = engine.last_headers
    version, trace, parent, flags = sent["traceparent"].split("-")
    assert (version, trace, flags) == ("00", TRACE, "01") and parent not in (SPAN, "0" * 16)   # our span, theirs above
    assert (sent["tracestate"], sent["x-request-id"], sent["user-agent"]) == ("vendor=x1", "req-abc", "app/1.2")
    assert stack.sql("SELECT request_id, trace_id FROM requests") == [("req-abc", TRACE)]
    ingress_ms, upstream_ms = (float(part.split("dur=")[1]) for part in headers["server-timing"].split(", "))
    assert ingress_ms >= 0 and upstream_ms >= 0


@pytest.mark.parametrize("given", [None, "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "garbage",
                                   f"ff-{TRACE}-{SPAN}-01"])
def test_a_request_without_a_valid_traceparent_starts_a_trace_the_engine_and_the_ledger_share(stack, given):
    _, engine = stack.engine("m1")
    client = Client(stack.url, stack.key())
    try:
        status, _, _ = client.chat(headers={"traceparent": given} if given else None)
    finally:
        client.close()
    version, trace, parent, flags = engine.last_headers["traceparent"].split("-")
    assert (version, len(trace), len(parent), flags) == ("00", 32, 16, "01") and trace != "0" * 32
    assert stack.sql("SELECT trace_id FROM requests") == [(trace,)]


def test_a_stream_answer_carries_server_timing_and_its_trace_reaches_the_engine(stack):
    _, engine = stack.engine("m1", chunks=3)
    client = Client(stack.url, stack.key())
    try:
        status, headers, _ = client.request("POST", "/v1/responses", {"model": "m1", "input": "x", "stream": True},
                                            headers={"traceparent": f"00-{TRACE}-{SPAN}-00"})
    finally:
        client.close()
    assert status == 200 and headers["server-timing"].startswith("ingress;dur=")
    assert engine.last_headers["traceparent"].startswith(f"00-{TRACE}-") and engine.last_headers[
        "traceparent"].endswith("-00")


def test_a_ledger_from_before_trace_ids_gets_the_column_and_keeps_its_rows(tmp_path):
    import sqlite3
    path = str(tmp_path / "old.sqlite")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE requests (ts REAL NOT NULL, day TEXT NOT NULL, key_id TEXT, user TEXT, model TEXT, "
               "session TEXT, provider TEXT, status INTEGER, prompt_tokens INTEGER, completion_tokens INTEGER, "
               "latency_ms REAL, stream INTEGER, attempts INTEGER)")
    db.execute("INSERT INTO requests VALUES (1.0, '1970-01-01', 'k', 'u', 'm0', 's', 'p', 200, 1, 2, 3.0, 0, 1)")
    db.commit()
    db.close()
    stack = Stack(path)
    try:
        stack.engine("m1")
        assert Client(stack.url, stack.key()).chat(headers={"traceparent": f"00-{TRACE}-{SPAN}-01"})[0] == 200
        rows = stack.sql("SELECT model, request_id, trace_id FROM requests ORDER BY ts")
    finally:
        stack.close()
    assert rows[0] == ("m0", None, None) and rows[1][0] == "m1" and rows[1][2] == TRACE


def test_spans_reach_an_otlp_collector_with_the_requests_trace(tmp_path):
    collector = Collector()
    stack = Stack(str(tmp_path / "otlp.sqlite"), otlp_endpoint=f"http://127.0.0.1:{collector.port}")
    try:
        stack.engine("m1")
        assert Client(stack.url, stack.key()).chat(headers={"traceparent": f"00-{TRACE}-{SPAN}-01"})[0] == 200
        deadline = time.monotonic() + 10
        while not collector.documents and time.monotonic() < deadline:
            time.sleep(0.05)
        path, document = collector.documents[0]
        spans = document["resourceSpans"][0]["scopeSpans"][0]["spans"]
        assert path == "/v1/traces"
        assert {s["name"] for s in spans} == {"/v1/chat/completions", "otela.route", "otela.upstream.first_byte"}
        assert {s["traceId"] for s in spans} == {TRACE}
        root = next(s for s in spans if s["name"] == "/v1/chat/completions")
        assert root["parentSpanId"] == SPAN and int(root["endTimeUnixNano"]) >= int(root["startTimeUnixNano"])
        assert all(s["parentSpanId"] == root["spanId"] for s in spans if s is not root)
    finally:
        stack.close()
        collector.close()


def test_a_collector_that_never_answers_costs_requests_nothing_and_its_spans_are_dropped_and_counted(tmp_path):
    collector = Collector(hang=True)
    stack = Stack(str(tmp_path / "hang.sqlite"), otlp_endpoint=f"127.0.0.1:{collector.port}")
    try:
        tracer = stack.ingress.tracer
        tracer.timeout, tracer.interval, tracer.queue_max = 0.5, 0.05, 4
        stack.engine("m1")
        client = Client(stack.url, stack.key())
        try:
            assert [client.chat()[0] for _ in range(20)] == [200] * 20
            deadline = time.monotonic() + 10
            while tracer.dropped < 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            metrics = client.request("GET", "/metrics")[2].decode()
        finally:
            client.close()
        assert tracer.exported == 0 and tracer.dropped == 20
        assert "otela_otlp_spans_dropped_total 20" in metrics
    finally:
        stack.close()
        collector.close()


# -- 4. smaller items ------------------------------------------------------------------------------
def test_a_session_that_left_takes_its_series_off_metrics(stack):
    import crdt
    sid, _ = stack.engine("m1", usage_tokens=10 ** 9)   # a lying engine: counted per session
    keep, _ = stack.engine("m2", usage_tokens=10 ** 9)
    client = Client(stack.url, stack.key())
    try:
        for model in ("m1", "m2"):
            assert client.chat(model)[0] == 200
        assert sid in client.request("GET", "/metrics")[2].decode()
        stack.call(stack.node.set_state, sid, crdt.LEFT)
        metrics = client.request("GET", "/metrics")[2].decode()
    finally:
        client.close()
    assert sid not in metrics and keep in metrics
    assert 'otela_sessions{state="LEFT"} 1' in metrics


def test_a_key_the_cli_just_wrote_works_on_its_first_request_and_a_made_up_one_is_refused(stack):
    stack.engine("m1")
    db = otela_ingress.open_db(stack.db_path)
    try:
        _, token = otela_ingress.create_key(db, "erin")   # as `keys create` does: SQLite only
    finally:
        db.close()
    client = Client(stack.url, token)
    try:
        assert client.chat()[0] == 200                                    # the common path
        assert client.request("GET", "/v1/models", key=token)[0] == 200
        for _ in range(3):   # an unknown token: one read of SQLite, then refused at once for a second
            status, _, body = client.request("POST", "/v1/chat/completions", {"model": "m1"}, key="sk-otela-nope")
            assert (status, error_code(body)) == (401, "invalid_api_key")
    finally:
        client.close()


def test_a_key_the_cli_just_wrote_works_on_a_body_read_in_pieces_too(stack):
    stack.engine("m1")
    db = otela_ingress.open_db(stack.db_path)
    try:
        _, token = otela_ingress.create_key(db, "erin")
    finally:
        db.close()
    body = json.dumps({"model": "m1", "input": "hi"}).encode()
    head = (b"POST /v1/responses HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % (token.encode(), len(body)))
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(10)
        sock.sendall(head)
        time.sleep(0.05)
        sock.sendall(body)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 ")


def test_an_admin_pins_a_request_to_one_session_and_others_may_not(stack):
    sid, pinned = stack.engine("m1", mode="error500")
    _, other = stack.engine("m1")
    admin, user = Client(stack.url, stack.key("root", admin=True)), Client(stack.url, stack.key("bob"))
    try:
        answers = [admin.chat(headers={"x-otela-session": sid}) for _ in range(3)]
        assert [status for status, _, _ in answers] == [500] * 3   # its own answer: never another session
        assert {headers["x-otela-session"] for _, headers, _ in answers} == {sid}
        assert (pinned.requests, other.requests) == (3, 0)
        status, _, body = user.chat(headers={"x-otela-session": sid})
        assert (status, error_code(body)) == (403, "admin_required")
        status, _, body = admin.chat("m1", headers={"x-otela-session": "0" * 32})
        assert (status, error_code(body)) == (404, "session_not_found")
        assert admin.request("GET", "/v1/files", headers={"x-otela-session": sid})[0] == 200
        assert pinned.hits.get("/v1/files") == 1
    finally:
        admin.close()
        user.close()


# -- the form parser, property-tested --------------------------------------------------------------
_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(lambda n: n != "model")
_VALUES = st.binary(max_size=300).filter(lambda v: b"--" not in v)   # (a value never holds the delimiter)


def form(fields, boundary: bytes = b"XyZ123") -> bytes:
    parts = [b"--%s\r\ncontent-disposition: form-data; name=\"%s\"%s\r\n\r\n%s\r\n" % (
        boundary, name.encode(), b'; filename="f.bin"\r\ncontent-type: application/octet-stream' if file else b"",
        value) for name, value, file in fields]
    return b"".join(parts) + b"--%s--\r\n" % boundary


@settings(max_examples=200, deadline=None)
@given(before=st.lists(st.tuples(_NAMES, _VALUES, st.booleans()), max_size=4),
       after=st.lists(st.tuples(_NAMES, _VALUES, st.booleans()), max_size=4),
       model=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-/", min_size=1, max_size=40),
       target=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-/", min_size=1, max_size=40))
def test_a_forms_model_field_is_found_and_replaced_whatever_the_fields_around_it(before, after, model, target):
    ctype = b"multipart/form-data; boundary=XyZ123"
    body = form([*before, ("model", model.encode(), False), *after])
    start, end = otela_ingress.form_model(body, ctype)
    assert body[start:end] == model.encode()
    moved = otela_ingress.with_model(body, ctype, target)
    assert moved == form([*before, ("model", target.encode(), False), *after])
    assert otela_ingress.form_model(form([*before, *after]), ctype) is None   # no field: none found


def test_a_key_read_whose_waiter_left_leaves_the_ledger_writing(stack):
    stack.engine("m1")
    key = stack.key()
    waiting = [stack.ingress.ledger.reload_keys() for _ in range(3)]
    for future in waiting:
        future.cancel()   # as wrap_future does when its client leaves
    assert Client(stack.url, key).chat()[0] == 200
    assert stack.sql("SELECT count(*) FROM requests") == [(1,)]   # the writer thread lives on
    assert stack.ingress.ledger.health()["ok"]
