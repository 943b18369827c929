"""The ingress's one request engine, its protocol callbacks, on every path: a plain request whose
whole body is buffered on a kept-alive upstream connection, a body arriving in pieces, a new
upstream connection, a retry, a stream, a request h11 judges; no task ever owns a connection."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import sqlite3
import struct
import time

import pytest
from fake_engine import free_port
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ingress_support import Client, RecordingTransport, Stack

import otela_ingress
import otela_node


class ScriptedEngine:
    """An engine that answers the n-th request on each connection as `script(n)` says: bytes to
    send back (then keep the connection), or None to close the connection without an answer."""

    def __init__(self, stack: Stack, script):
        self.script = script
        self.connections = 0
        self.port = free_port()
        self.server = stack.run(asyncio.start_server(self._serve, "127.0.0.1", self.port))

    async def _serve(self, reader, writer):
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                answer = self.script(n)
                n += 1
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def _plain(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(body), body)


ANSWER = json.dumps({"object": "chat.completion", "choices": [],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}).encode()


def request(key: str, body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
            b"content-length: %d\r\n\r\n%s" % (key.encode(), len(body), body))


CHAT = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_a_pooled_connection_the_engine_closed_is_replaced_without_an_error(stack):
    # the engine answers once per connection, then drops the next request unanswered: the
    # second request (sent on the pooled connection) goes again on a fresh connection to the
    # same engine, not counted as a retry
    engine = ScriptedEngine(stack, lambda n: _plain(ANSWER) if n == 0 else None)
    stack.call(stack.node.add_worker, f"127.0.0.1:{engine.port}", ["m1"])
    client = Client(stack.url, stack.key())
    try:
        assert [client.chat()[0] for _ in range(4)] == [200] * 4
    finally:
        client.close()
    assert engine.connections == 4
    assert stack.ingress.metrics.retries == 0
    assert stack.sql("SELECT count(*), sum(prompt_tokens), sum(attempts) FROM requests") == [(4, 12, 4)]


def test_a_chunked_plain_answer_and_a_500_are_read_in_pieces_and_retried(stack):
    chunked = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
               b"%x\r\n%s\r\n0\r\n\r\n" % (len(ANSWER), ANSWER))
    flaky = ScriptedEngine(stack, lambda n: _plain(b'{"error":"boom"}', b"500 Internal Server Error"))
    good = ScriptedEngine(stack, lambda n: chunked)
    stack.call(stack.node.add_worker, f"127.0.0.1:{flaky.port}", ["m1"])
    stack.call(stack.node.add_worker, f"127.0.0.1:{good.port}", ["m1"])
    client = Client(stack.url, stack.key())
    try:
        answers = [client.chat() for _ in range(10)]
    finally:
        client.close()
    assert [status for status, _, _ in answers] == [200] * 10
    assert all(json.loads(body)["usage"]["completion_tokens"] == 4 for _, _, body in answers)


def test_a_body_in_pieces_then_plain_requests_on_the_same_connection(stack):
    stack.engine("m1")
    key = stack.key()
    whole = request(key, CHAT)
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(10)
        sock.sendall(whole[:-10])
        time.sleep(0.1)   # data_received reads the rest of this body as it comes
        sock.sendall(whole[-10:] + whole + whole)
        data = b""
        while data.count(b"HTTP/1.1 200 OK") < 3 or not data.endswith(b"}"):
            piece = sock.recv(65536)
            assert piece, data
            data += piece
    assert data.count(b"HTTP/1.1 200 OK") == 3


def test_a_client_gone_before_its_answer_frees_the_engine_is_logged_499_and_others_go_on(stack):
    stack.engine("m1", mode="slow", slow_delay=1.0)
    key = stack.key()

    def vanish():
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            sock.sendall(request(key, CHAT))
            time.sleep(0.05)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = reset
        t0 = time.monotonic()
        while stack.ingress.pool.active and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        # the engine connection was closed long before the engine would have answered
        assert not stack.ingress.pool.active and time.monotonic() - t0 < 0.5
        time.sleep(1.2)   # the engine's handler wakes up to a closed connection and ends

    client = Client(stack.url, key)
    try:
        vanish()                          # a new upstream connection
        assert client.chat()[0] == 200
        vanish()                          # a pooled one
        assert client.chat()[0] == 200
    finally:
        client.close()
    assert sorted(stack.sql("SELECT status FROM requests")) == [(200,), (200,), (499,), (499,)]
    assert stack.inflight_settled() == 0


def test_a_bug_in_the_callbacks_costs_one_request_a_500(stack, monkeypatch, capsys):
    stack.engine("m1")
    key = stack.key()
    real = otela_ingress.Ingress._prepare

    def broken(self, client, path, fields, body, t0, *rest):
        if b"boom" in body:
            raise RuntimeError("a bug")
        return real(self, client, path, fields, body, t0, *rest)

    monkeypatch.setattr(otela_ingress.Ingress, "_prepare", broken)
    client = Client(stack.url, key)
    try:
        status, _, body = client.chat(content="boom")
        assert status == 500 and json.loads(body)["error"]["code"] == "internal_error"
    finally:
        client.close()
    assert "internal error: RuntimeError: a bug" in capsys.readouterr().err
    client = Client(stack.url, key)
    try:
        assert client.chat()[0] == 200
    finally:
        client.close()


def test_a_client_gone_mid_stream_stops_the_engine_stream_and_is_metered(stack):
    stack.engine("m1", chunks=400, chunk_delay=0.005)
    key = stack.key()
    body = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()

    def read_some_then_vanish():
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            sock.settimeout(10)
            sock.sendall(request(key, body))
            data = b""
            while data.count(b"data: {") < 3:
                piece = sock.recv(65536)
                assert piece, data
                data += piece
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    read_some_then_vanish()   # a new upstream connection
    client = Client(stack.url, key)
    try:
        assert client.chat()[0] == 200   # leaves a pooled connection
    finally:
        client.close()
    read_some_then_vanish()   # a pooled one: relayed from the callbacks
    assert stack.inflight_settled() == 0
    rows = stack.sql("SELECT status, completion_tokens FROM requests WHERE stream = 1 ORDER BY ts")
    assert [status for status, _ in rows] == [499, 499]
    assert all(3 <= tokens < 400 for _, tokens in rows)
    assert not stack.ingress.pool.active
    assert not stack.ingress.health.failures   # clients leaving says nothing about the engine


@pytest.mark.parametrize("warm", [False, True], ids=["new-connection", "pooled"])
def test_a_client_that_does_not_read_its_stream_pauses_the_engine_not_our_memory(stack, warm):
    stack.engine("m1", chunks=20000, chunk_delay=0.0001)   # it waits for its writes, as engines do
    key = stack.key()
    if warm:
        client = Client(stack.url, key)
        try:
            assert client.chat()[0] == 200
        finally:
            client.close()
    body = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    before = set(stack.ingress.clients)
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        # small kernel buffers on the ingress's side too, or the whole stream fits in them
        deadline = time.monotonic() + 5
        while not set(stack.ingress.clients) - before and time.monotonic() < deadline:
            time.sleep(0.01)
        stack.call(lambda: [c.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 4096) for c in set(stack.ingress.clients) - before])
        sock.sendall(request(key, body))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(up.proto.paused for up in stack.ingress.pool.active):
            time.sleep(0.05)
        time.sleep(0.2)
        buffered = stack.call(lambda: [c.transport.get_write_buffer_size() for c in stack.ingress.clients])
        assert any(up.proto.paused for up in stack.ingress.pool.active)
        assert max(buffered) < 1024 * 1024
    deadline = time.monotonic() + 5   # the client left: the engine's stream is dropped too
    while stack.ingress.pool.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not stack.ingress.pool.active
    time.sleep(0.1)   # the engine's handler sees the end


# -- the hand parser of plain requests agrees with h11, or leaves the request to it ----------------
NAMES = ["host", "Host", "content-length", "Content-Type", "authorization", "connection", "transfer-encoding",
         "expect", "x-otela-no-track", "bad name", "x:y", "", "X_Under"]
VALUES = st.one_of(st.sampled_from(["x", "keep-alive", "close", "12", "0", " 5 ", "chunked", "100-continue",
                                    "Bearer k", "a\tb", "", "é"]),
                   st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x7f), max_size=8))


def usually(valid, *odd):
    return st.one_of(st.just(valid), st.just(valid), st.sampled_from(odd))


@settings(max_examples=1000, deadline=None)
@given(method=usually("POST", "GET", "PUT", "post"),
       target=usually("/v1/chat/completions", "/x?y=1", "*", "/a%20b", "/\u00e9"),
       version=usually("HTTP/1.1", "HTTP/1.0", "HTTP/1.1 ", "HTTP/2"),
       headers=st.lists(st.one_of(st.tuples(st.sampled_from(["authorization", "Content-Type", "content-length",
                                                             "Connection"]),
                                            st.sampled_from(["x", "12", "keep-alive", "Bearer k", "a\tb"])),
                                  st.tuples(st.sampled_from(NAMES), VALUES)), max_size=5),
       body=st.binary(max_size=20), space=st.sampled_from(["", " ", "\t"]), host=usually(True, False))
def test_the_plain_request_parser_agrees_with_h11_or_hands_over(method, target, version, headers, body, space,
                                                                host):
    import h11
    headers = [("Host", "x")] + headers if host else headers
    head = f"{method} {target} {version}\r\n" + "".join(f"{n}:{space}{v}\r\n" for n, v in headers) + "\r\n"
    data = head.encode("utf-8") + body
    ours = otela_ingress._ClientConn()
    ours.receive_data(data)
    try:
        event = ours.next_event()
    except h11.RemoteProtocolError:   # refused: h11 refuses it too, or it is framing a proxy must refuse
        if ours.by_h11:
            return   # h11's own judgement
        fields = [(n.lower().encode(), v.strip(space).encode("utf-8")) for n, v in headers]
        assert otela_node.framing_error(fields) is not None or [n for n, _ in fields].count(b"host") > 1
        return
    if ours.by_h11:
        return   # h11 reads this request: nothing to compare
    reference = h11.Connection(h11.SERVER)
    reference.receive_data(data)
    expected = reference.next_event()   # raises if h11 would refuse what we accepted
    assert isinstance(expected, h11.Request)
    assert (event.method, event.target) == (expected.method, expected.target)
    assert event.fields == dict(expected.headers)
    parts = []
    while True:
        nxt = reference.next_event()
        if nxt is h11.NEED_DATA or type(nxt) is h11.EndOfMessage:
            break
        parts.append(bytes(nxt.data))
    whole = ours.whole_body(otela_ingress.MAX_BODY_BYTES)
    if type(nxt) is h11.EndOfMessage:
        assert whole == b"".join(parts)
    else:
        assert whole is None   # the body is not all here yet


class _NoTransport:
    def is_closing(self):
        return False


def _upstream(data: bytes) -> otela_ingress.Upstream:
    proto = otela_ingress._UpstreamProtocol(None)
    proto.buf += data
    return otela_ingress.Upstream("127.0.0.1:1", _NoTransport(), proto)


def test_the_upstream_head_reader_frames_bodies_and_refuses_garbage():
    up = _upstream(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A:  b c \r\n\r\nhi")
    head = up.parse_head()
    assert (head.status, head.fields, up.body.framing, up.body.remaining, up.keep_alive) == (
        200, {b"content-length": b"2", b"x-a": b"b c"}, otela_node.LENGTH, 2, True)
    assert up.take() == b"hi" and up.take() is None
    up = _upstream(b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n1;x=y\r\nc\r\n0\r\n\r\n")
    up.parse_head()
    assert up.keep_alive is False and up.take() == b"abc" and up.done
    up = _upstream(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nrest")
    up.parse_head()
    assert (up.body.framing, up.keep_alive, up.take()) == (otela_node.UNTIL_CLOSE, False, b"rest")
    up = _upstream(b"HTTP/1.1 204\r\n\r\n")   # no reason phrase, no fields
    assert (up.parse_head().status, up.body.framing, up.done) == (204, otela_node.NO_BODY, True)
    for bad in (b"HTTP/2 200 OK\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: many\r\n\r\n", b"HTTP/1.1 2000 OK\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nx: a\nb: c\r\n\r\n", b"HTTP/1.1 200 OK\r\nx: a\rb\r\n\r\n",
                b"HTTP/1.1 200 OK\r\n: empty name\r\n\r\n"):
        up = _upstream(bad)
        with pytest.raises(otela_ingress.UpstreamFailure):
            up.parse_head()
    up = _upstream(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")
    up.parse_head()
    with pytest.raises(otela_ingress.UpstreamFailure):
        up.take()


def test_pipelined_errors_and_answers_keep_their_order(stack):
    from test_ingress import _read_answers
    stack.engine("m1")
    key = stack.key()
    stream = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode()
    batch = (request("sk-otela-wrong", CHAT) + request(key, CHAT) + request(key, b"{not json")
             + request(key, b'{"model":"nope"}') + request(key, CHAT)
             + b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n" + request(key, CHAT))
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(10)
        sock.sendall(batch)
        answers = _read_answers(sock, 7)
        sock.sendall(request(key, stream) + request(key, CHAT))   # a stream, then a plain one behind it
        data = b""
        while b"0\r\n\r\n" not in data or data.count(b"HTTP/1.1 200 OK") < 2 or not data.endswith(b"}"):
            piece = sock.recv(65536)
            assert piece, data
            data += piece
    assert [status.split(b" ")[1] for status, _ in answers] == [b"401", b"200", b"400", b"404", b"200", b"200",
                                                                   b"200"]
    assert data.index(b"data: [DONE]") < data.rindex(b"HTTP/1.1 200 OK")


def test_a_policy_that_raises_costs_its_request_a_500_and_nothing_else(tmp_path):
    class Broken(otela_ingress.LeastLoadedPolicy):
        def pick(self, candidates, request):
            if request.user == "mallory":
                raise RuntimeError("policy bug")
            return super().pick(candidates, request)

    stack = Stack(str(tmp_path / "otela.sqlite"), policy=Broken())
    try:
        stack.engine("m1")
        good, bad = Client(stack.url, stack.key("alice")), Client(stack.url, stack.key("mallory"))
        try:
            assert good.chat()[0] == 200            # leaves a pooled connection
            assert bad.chat()[0] == 500
            assert good.chat()[0] == 200
        finally:
            good.close()
            bad.close()
        assert stack.inflight_settled() == 0
    finally:
        stack.close()


def test_every_proxied_request_runs_down_the_lifecycle_table_and_is_booked_once(tmp_path, monkeypatch):
    paths, booked = {}, {}
    moved, finished = otela_ingress._Exchange.to, otela_ingress._Exchange.finish

    def to(ex, state):
        paths.setdefault(ex, ["received"]).append(state)   # (held: no id reused)
        moved(ex, state)

    def finish(ex, outcome, *last):
        did = finished(ex, outcome, *last)
        booked[ex] = booked.get(ex, 0) + did
        return did

    monkeypatch.setattr(otela_ingress._Exchange, "to", to)
    monkeypatch.setattr(otela_ingress._Exchange, "finish", finish)

    def run(modes, **chat):
        paths.clear()
        booked.clear()
        stack = Stack(str(tmp_path / f"{'-'.join(modes)}-{len(chat)}.sqlite"))
        try:
            for mode in modes:
                stack.engine("m1", mode=mode)
            client = Client(stack.url, stack.key())
            try:
                answers = [client.chat(**chat)[0] for _ in range(2)]
            finally:
                client.close()
            assert stack.inflight_settled() == 0
            rows = stack.sql("SELECT status FROM requests")
        finally:
            stack.close()
        assert sorted(booked.values()) == [1, 1]   # each request booked once, in finish
        return answers, sorted(paths.values()), sorted(status for status, in rows)

    plain = ["received", "routed", "sent", "head", "done"]
    # the first on a new upstream connection, the second on the pooled one
    assert run(["ok"]) == ([200, 200], [plain, plain], [200, 200])
    stream = ["received", "routed", "sent", "head", "stream", "done"]
    assert run(["ok"], stream=True) == ([200, 200], [stream, stream], [200, 200])
    # (a body goes through "body" only while more of it is due: these come whole with their head)
    refused = ["routed", "sent", "head", "retried"]
    poison = ["received"] + refused + ["routed", "sent", "head", "done"]
    assert run(["error500", "error500"]) == ([500, 500], [poison, poison], [500, 500])
    exhausted = ["received", "routed", "sent", "retried", "routed", "sent", "retried", "failed"]
    assert run(["reset", "reset"]) == ([502, 502], [exhausted, exhausted], [502, 502])


# -- one engine: every kind of request is served by the protocol callbacks -------------------------
def _answers(sock: socket.socket, n: int, head_only: bool = False) -> list:
    """The status lines of n answers read off sock (Content-Length or chunked bodies; none at
    all for answers to HEAD)."""
    data, statuses = b"", []
    while len(statuses) < n:
        while b"\r\n\r\n" not in data:
            piece = sock.recv(65536)
            assert piece, (statuses, data)
            data += piece
        head, _, data = data.partition(b"\r\n\r\n")
        status, *lines = head.split(b"\r\n")
        if status.startswith(b"HTTP/1.1 1"):   # 100 Continue: no body
            continue
        fields = dict(line.lower().split(b": ", 1) for line in lines)
        if b"content-length" in fields:
            need = 0 if head_only else int(fields[b"content-length"])
            while len(data) < need:
                data += sock.recv(65536)
            data = data[need:]
        else:   # chunked: read to the last chunk
            while b"0\r\n\r\n" not in data:
                data += sock.recv(65536)
            data = data[data.index(b"0\r\n\r\n") + 5:]
        statuses.append(status.split(b" ")[1].decode())
    return statuses


def test_every_kind_of_request_is_served_with_no_task_owning_its_connection(tmp_path):
    # Structure: no coroutine in the request path, and nothing a connection could be handed to.
    coroutines = {name for name, fn in vars(otela_ingress.Ingress).items() if asyncio.iscoroutinefunction(fn)}
    assert coroutines == {"start", "stop", "_sweep"}   # none in the request path (nor read_revocations)
    assert not any(asyncio.iscoroutinefunction(fn) for fn in vars(otela_ingress._Client).values())
    assert "task" not in otela_ingress._Client.__slots__
    # Behaviour: every task the ingress's code starts while serving, by the coroutine it runs.
    stack = Stack(str(tmp_path / "one.sqlite"))
    started: list = []

    def factory(loop, coro, **kwargs):
        code = getattr(coro, "cr_code", None)
        if code is not None and code.co_filename == otela_ingress.__file__:
            started.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    stack.call(stack.loop.set_task_factory, factory)
    try:
        stack.engine("m1")
        for _ in range(2):   # m2's request is refused by both: a retry, then the engine's answer
            flaky = ScriptedEngine(stack, lambda n: _plain(b'{"error":"boom"}', b"500 Internal Server Error"))
            stack.call(stack.node.add_worker, f"127.0.0.1:{flaky.port}", ["m2"])
        key, admin = stack.key(), stack.key("root", admin=True)
        body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
        stream = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
        retried = json.dumps({"model": "m2", "messages": [{"role": "user", "content": "hi"}]}).encode()
        auth = b"authorization: Bearer %s\r\n" % key.encode()
        post = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + auth
        kinds = [
            ("plain", post + b"content-length: %d\r\n\r\n%s" % (len(body), body), "200"),
            ("stream", post + b"content-length: %d\r\n\r\n%s" % (len(stream), stream), "200"),
            ("retry", post + b"content-length: %d\r\n\r\n%s" % (len(retried), retried), "500"),
            ("h11 (chunked body)", post + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
             % (len(body), body), "200"),
            ("expect 100-continue", post + b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n%s"
             % (len(body), body), "200"),
            ("GET", b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + auth + b"\r\n", "200"),
            ("HEAD", b"HEAD /healthz HTTP/1.1\r\nhost: x\r\n\r\n", "200"),
            ("admin", b"GET /v1/admin/keys HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n\r\n"
             % admin.encode(), "200"),
            ("usage (SQLite in an executor)", b"GET /v1/usage HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n\r\n"
             % admin.encode(), "200"),
            ("an error answer", b"GET /nowhere HTTP/1.1\r\nhost: x\r\n\r\n", "404"),
        ]
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            sock.settimeout(10)
            for name, raw, status in kinds:
                sock.sendall(raw)
                assert _answers(sock, 1, head_only=name == "HEAD") == [status], name
            # a body in pieces, then a pipelined pair, on the same connection
            whole = post + b"content-length: %d\r\n\r\n%s" % (len(body), body)
            sock.sendall(whole[:-7])
            time.sleep(0.05)
            sock.sendall(whole[-7:] + whole + whole)
            assert _answers(sock, 3) == ["200"] * 3
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n")   # a protocol error
            assert _answers(sock, 1) == ["400"]
        assert stack.inflight_settled() == 0 and stack.ingress.metrics.retries == 1
        # the only tasks: opening new upstream connections (each calls one method back when done)
        assert started and set(started) == {"UpstreamPool.acquire"}
    finally:
        stack.close()


def test_a_request_and_its_answer_in_one_read_are_served_as_the_same_bytes_in_pieces(tmp_path, monkeypatch):
    """A request in one read (read from the read's own bytes, _ClientConn.whole_request) and its
    answer in one read send the engine, the client and the ledger exactly what the same bytes in
    pieces do."""
    from test_ingress_support import StandInNode
    whole_paths = []
    original = otela_ingress._ClientConn.whole_request

    def counted(self, *args):
        head = original(self, *args)
        whole_paths.append(head is not None)
        return head
    monkeypatch.setattr(otela_ingress._ClientConn, "whole_request", counted)

    async def run():
        db = str(tmp_path / "otela.sqlite")
        conn = otela_ingress.open_db(db)
        _, key = otela_ingress.create_key(conn, "alice")
        conn.close()
        node = StandInNode()
        node.add_worker("127.0.0.1:9", ["m1"])
        ingress = otela_ingress.Ingress(node, db_path=db)
        await ingress.start("127.0.0.1", 0)
        try:
            client, to_client = otela_ingress._Client(ingress), RecordingTransport()
            client.connection_made(to_client)
            proto, to_engine = otela_ingress._UpstreamProtocol(asyncio.get_running_loop()), RecordingTransport()
            proto.connection_made(to_engine)
            ingress.pool._idle["127.0.0.1:9"] = [otela_ingress.Upstream("127.0.0.1:9", to_engine, proto)]
            sent = request(key, CHAT)
            answer = _plain(ANSWER)
            seen = []
            for pieces in ((sent,), (sent[:40], sent[40:-5], sent[-5:])):
                for piece in pieces:
                    client.data_received(piece)
                upstream = to_engine.taken()
                for piece in ((answer,) if len(pieces) == 1 else (answer[:20], answer[20:-3], answer[-3:])):
                    proto.data_received(piece)
                # (each request has its own id, trace and timings)
                seen.append((re.sub(rb"traceparent: [^\r]*", b"traceparent: <trace>",
                                    upstream.replace(client.request_id, b"<id>")),
                             re.sub(rb"server-timing: [^\r]*", b"server-timing: <timing>",
                                    to_client.taken().replace(client.request_id, b"<id>"))))
            assert ingress.ledger.flush()
            with sqlite3.connect(db) as ledger:
                rows = ledger.execute("SELECT status, prompt_tokens, completion_tokens FROM requests").fetchall()
        finally:
            await ingress.stop()
        return seen, rows

    (whole, pieces), rows = asyncio.run(run())
    assert whole == pieces
    assert whole[1].startswith(b"HTTP/1.1 200 OK\r\n") and whole[1].endswith(ANSWER)
    assert whole[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and whole[0].endswith(CHAT)
    assert True in whole_paths
    assert rows == [(200, 3, 4), (200, 3, 4)]
