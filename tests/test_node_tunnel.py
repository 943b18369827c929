"""The node's TCP port in one process: /v1/registry, /healthz and the tunnel to the engine."""
import asyncio
import functools
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import fake_engine  # noqa: E402

import crdt  # noqa: E402
import otela_node as on  # noqa: E402

KEY = bytes(range(32))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def with_node(test, **engine_opts):
    """Start a fake engine and a node in front of it; run test(node, client); clean up."""
    port = fake_engine.free_port()
    engine = await fake_engine.start_fake_engine(port, **engine_opts)
    cfg = on.Config(key=KEY, listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
    node = on.Node(cfg, models=["fake-model"], engine_url=f"http://127.0.0.1:{port}")
    await node.start(serve_http=True)
    client = on.EngineClient("http://" + node.registry.get(node.session_id)["addr"])
    try:
        return await test(node, client, engine)
    finally:
        client.close()
        await node.stop()
        await engine.close()


async def call(client, method, path, body=b"", headers=()):
    response, conn = await client.exchange(method, path, list(headers), body)
    chunks = [c async for c in client.body(conn)]
    return response, chunks


def test_registry_endpoint_lists_this_session_with_state_names_and_suspicion():
    async def t(node, client, engine):
        response, chunks = await call(client, "GET", "/v1/registry")
        view = json.loads(b"".join(chunks))
        assert response.status == 200
        assert view["self"] == node.session_id
        [me] = view["sessions"]
        assert (me["session"], me["state"], me["suspected"], me["models"]) == \
            (node.session_id, "SERVING", False, ["fake-model"])
        assert me["gossip"] == node.overlay.addr
        return True
    assert run(with_node(t))


def test_healthz_answers_ok_then_503_while_draining():
    async def t(node, client, engine):
        r1, c1 = await call(client, "GET", "/healthz")
        node.draining = True
        r2, c2 = await call(client, "GET", "/healthz")
        return r1.status, json.loads(b"".join(c1))["status"], r2.status
    assert run(with_node(t)) == (200, "ok", 503)


def test_request_without_tunnel_header_is_refused_with_403_openai_error():
    async def t(node, client, engine):
        response, chunks = await call(client, "POST", "/v1/chat/completions", b"{}")
        return response.status, json.loads(b"".join(chunks)), engine.requests
    status, body, reached = run(with_node(t))
    assert status == 403 and body["error"]["type"] == "permission_error" and reached == 0


def test_tunnelled_stream_arrives_chunk_by_chunk_and_body_is_forwarded_verbatim():
    raw = b'{"model":"fake-model","stream":true,"user":"u1","extra_field":[1,2],' \
          b'"messages":[{"role":"user","content":"one two three"}]}'

    async def t(node, client, engine):
        response, chunks = await call(client, "POST", "/v1/chat/completions", raw, [node.tunnel_header])
        return response, chunks, engine.last_body
    response, chunks, seen = run(with_node(t, chunks=5, chunk_delay=0.01))
    assert response.status == 200
    assert dict(response.headers)[b"content-type"] == b"text/event-stream"
    events = b"".join(chunks).split(b"\n\n")
    assert len([e for e in events if e.startswith(b"data: {")]) == 5
    assert events[-2] == b"data: [DONE]"
    assert len(chunks) >= 5                         # streamed, not buffered into one piece
    assert seen == raw


def test_keep_alive_connection_serves_several_tunnelled_requests():
    async def t(node, client, engine):
        statuses = []
        for _ in range(3):
            r, _ = await call(client, "POST", "/v1/completions", b'{"prompt":"a b"}', [node.tunnel_header])
            statuses.append(r.status)
        return statuses, len(client.idle), len(node.engine.idle)
    statuses, client_pool, engine_pool = run(with_node(t))
    assert statuses == [200, 200, 200] and client_pool == 1 and engine_pool == 1


def test_engine_error_status_is_passed_through():
    async def t(node, client, engine):
        r, chunks = await call(client, "POST", "/v1/completions", b'{"prompt":"x"}', [node.tunnel_header])
        return r.status, json.loads(b"".join(chunks))["error"]["type"]
    assert run(with_node(t, mode="error500")) == (500, "server_error")


def test_unreachable_engine_gives_502_and_draining_node_gives_503():
    async def t(node, client, engine):
        await engine.close()
        r1, c1 = await call(client, "POST", "/v1/completions", b"{}", [node.tunnel_header])
        node.draining = True
        r2, _ = await call(client, "POST", "/v1/completions", b"{}", [node.tunnel_header])
        return r1.status, json.loads(b"".join(c1))["error"]["code"], r2.status
    assert run(with_node(t)) == (502, "bad_gateway", 503)


def test_stream_cut_by_the_engine_is_cut_for_the_client_never_completed():
    async def t(node, client, engine):
        response, conn = await client.exchange("POST", "/v1/chat/completions", [node.tunnel_header],
                                               b'{"stream":true,"messages":[]}')
        got = []
        with pytest.raises(on.EngineError):
            async for chunk in client.body(conn):
                got.append(chunk)
        return response.status, b"".join(got)
    status, partial = run(with_node(t, mode="cut", chunks=6))
    assert status == 200
    assert partial.count(b"data: {") == 3 and b"[DONE]" not in partial


def test_in_flight_counter_tracks_a_slow_request():
    async def t(node, client, engine):
        task = asyncio.ensure_future(call(client, "POST", "/v1/completions", b"{}", [node.tunnel_header]))
        await asyncio.sleep(0.3)
        during = node.inflight
        response, _ = await task
        return during, node.inflight, response.status
    assert run(with_node(t, mode="slow", slow_delay=0.6)) == (1, 0, 200)


def test_on_change_reports_own_updates_and_tunnel_header_is_derived_from_key():
    async def t(node, client, engine):
        seen = []
        node.on_change(lambda sid, rec: seen.append((sid, rec["state"], rec["version"])))
        node.update(models=["m2"])
        node.set_state(crdt.DOWN)
        return list(seen), node.tunnel_header
    seen, header = run(with_node(t))
    assert [s[1:] for s in seen] == [(crdt.SERVING, 1), (crdt.DOWN, 2)]
    import hashlib
    import hmac
    assert header == ("x-otela-tunnel", hmac.new(KEY, b"tunnel", hashlib.sha256).hexdigest())


def test_engine_without_health_route_is_watched_without_touching_v1_models():
    async def scenario():
        port = fake_engine.free_port()
        engine = await fake_engine.start_fake_engine(port, health=False)
        cfg = on.Config(key=KEY, engine_check_interval=0.05)
        supervisor = on.EngineSupervisor(f"true --port {port}", f"http://127.0.0.1:{port}", cfg)
        supervisor.alive = lambda: True            # the engine runs in-process here
        try:
            await supervisor.wait_ready()
            ready_models = engine.hits.get("/v1/models", 0)
            health_before = engine.hits.get("/health", 0)
            watch = asyncio.ensure_future(supervisor.watch())
            await asyncio.sleep(0.6)
            assert not watch.done()                 # accepting connections counts as alive
            watch.cancel()
            return ready_models, engine.hits.get("/v1/models", 0), engine.hits.get("/health", 0) - health_before
        finally:
            supervisor.client.close()
            await engine.close()

    ready_models, later_models, health_probes = run(scenario())
    assert later_models == ready_models
    assert health_probes == 0   # no request at all: an engine logs each (a 404 line every 2 s)


async def raw_exchange(node, data: bytes) -> bytes:
    """Write raw bytes to the node's tunnel port; read until it closes the connection."""
    host, port = node.registry.get(node.session_id)["addr"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


def tunnel_line(node) -> bytes:
    name, value = node.tunnel_header
    return f"{name}: {value}\r\n".encode()


def test_pipelined_requests_are_answered_in_order_and_connection_close_is_honoured():
    async def t(node, client, engine):
        body = b'{"prompt":"a b"}'
        one = b"POST /v1/completions HTTP/1.1\r\nhost: n\r\n%scontent-length: %d\r\n\r\n%s" % (
            tunnel_line(node), len(body), body)
        last = b"GET /healthz HTTP/1.1\r\nhost: n\r\nconnection: close\r\n\r\n"
        return await raw_exchange(node, one + one + last)
    data = run(with_node(t))
    assert data.count(b"HTTP/1.1 200 ") == 3
    assert data.index(b'"text_completion"') < data.rindex(b'"text_completion"') < data.index(b'"status":"ok"')


def test_chunked_request_body_and_http10_client_are_served_through_h11():
    raw = b'{"stream":true,"messages":[{"role":"user","content":"a b"}]}'

    async def t(node, client, engine):
        chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: n\r\n%stransfer-encoding: chunked\r\n"
                   b"connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (tunnel_line(node), len(raw), raw))
        first = await raw_exchange(node, chunked)
        seen_first = engine.last_body
        http10 = b"POST /v1/chat/completions HTTP/1.0\r\n%scontent-length: %d\r\n\r\n%s" % (
            tunnel_line(node), len(raw), raw)
        return first, seen_first, await raw_exchange(node, http10)
    first, seen, second = run(with_node(t, chunks=3))
    assert seen == raw
    assert b"transfer-encoding: chunked\r\nconnection: close\r\n" in first.lower()
    assert first.endswith(b"0\r\n\r\n") and first.count(b"data: {") == 3
    assert second.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in second.lower()
    assert second.count(b"data: {") == 3 and second.rstrip().endswith(b"data: [DONE]")


def test_request_body_over_the_limit_gets_413_without_reaching_the_engine():
    async def t(node, client, engine):
        node.config.max_request_body = 100
        data = await raw_exchange(node, b"POST /v1/completions HTTP/1.1\r\nhost: n\r\n%scontent-length: 101\r\n\r\n"
                                  % tunnel_line(node) + b"x" * 101)
        return data, engine.requests
    data, reached = run(with_node(t))
    assert data.startswith(b"HTTP/1.1 413 ") and b'"invalid_request_error"' in data and reached == 0


def test_large_bodies_relay_intact_to_a_slow_client_and_engine_connection_is_reused():
    big = bytes(range(256)) * 4096                  # 1 MiB: many reads, and back-pressure

    async def engine(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if b" /chunked " in head:
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    for i in range(0, len(big), 70000):
                        part = big[i:i + 70000]
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    writer.write(b"0\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big))
                await writer.drain()
        except (asyncio.IncompleteReadError, OSError):
            writer.close()

    async def scenario():
        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cfg = on.Config(key=KEY, listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
        node = on.Node(cfg, engine_url=f"http://127.0.0.1:{port}")
        await node.start()
        client = on.EngineClient("http://" + node.registry.get(node.session_id)["addr"])
        results = []
        try:
            for path in ("/length", "/chunked", "/length", "/chunked"):
                response, conn = await client.exchange("POST", path, [node.tunnel_header], b"{}")
                got = bytearray()
                async for chunk in client.body(conn):
                    got += chunk
                    await asyncio.sleep(0.002)      # a slow reader: the node must pause the engine
                results.append((response.status, got == big, len(node.engine.idle)))
        finally:
            client.close()
            await node.stop()
            server.close()
        return results
    assert run(scenario()) == [(200, True, 1)] * 4


# ---------------------------------------------------------------------------------------------
# Broken framing, from an engine or a client: a clear status or a clean cut, never a hang
# ---------------------------------------------------------------------------------------------
async def _raw_exchange(host, port, request: bytes, limit: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    data = b""
    try:
        while True:
            piece = await asyncio.wait_for(reader.read(65536), limit)
            if not piece:
                break
            data += piece
    except asyncio.TimeoutError:            # a kept-alive connection after a whole answer
        pass
    finally:
        writer.close()
    return data


@pytest.mark.parametrize("answer, cut", [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-6\r\nabcdef\r\n0\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x5\r\nabcde\r\n0\r\n\r\n", True),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"9" * 5000 + b"\r\nx", True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\nhello", False),
    (b"HTTP/1.1 200 OK\r\ncontent-length: " + b"9" * 5000 + b"\r\n\r\nhello", False),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", False),
    (b"HTTP/1.1 -200 OK\r\ncontent-length: 5\r\n\r\nhello", False),
])
def test_an_engine_with_broken_framing_gets_a_502_or_a_clean_cut_never_a_hang(answer, cut):
    async def scripted(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(3)                      # keep the connection open: a hang would show
        writer.close()

    async def t():
        server = await asyncio.start_server(scripted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cfg = on.Config(key=KEY, listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
        node = on.Node(cfg, models=["m"], engine_url=f"http://127.0.0.1:{port}")
        await node.start(serve_http=True)
        host, nport = node.registry.get(node.session_id)["addr"].split(":")
        name, value = node.tunnel_header
        try:
            return await _raw_exchange(host, int(nport), b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                       b"%s: %s\r\ncontent-length: 2\r\n\r\n{}" % (name.encode(), value.encode()),
                                       limit=2.0)
        finally:
            await node.stop()
            server.close()
    data = run(t())
    if cut and data.startswith(b"HTTP/1.1 200"):   # the head went out before the body turned
        assert not data.endswith(b"0\r\n\r\n")       # bad: the answer is cut, unfinished
    else:
        assert data.startswith(b"HTTP/1.1 502") and b'"server_error"' in data


@pytest.mark.parametrize("head", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: " + b"9" * 5000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n-6\r\nabcdef\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
])
def test_a_client_with_broken_framing_gets_a_400_and_the_connection_closed(head):
    async def t(node, client, engine):
        host, port = node.registry.get(node.session_id)["addr"].split(":")
        line, rest = head.split(b"\r\n", 1)       # with the credential: the framing is what is judged
        return await _raw_exchange(host, int(port), line + b"\r\n" + tunnel_line(node) + rest), engine.requests
    data, reached = run(with_node(t))
    assert data.startswith(b"HTTP/1.1 400") and b"invalid_request_error" in data and reached == 0


async def one_answer_per_connection(answers: list, reader, writer) -> None:
    """An engine that answers one request on a connection, then closes it while it idles."""
    await reader.readuntil(b"\r\n\r\n")
    answers.append(1)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()                                  # keep-alive said, then closed while idle


def test_engine_connections_the_engine_closed_while_idle_are_not_a_failure():
    """An engine that closes kept-alive connections between requests (llama.cpp's server did, in
    1-2 of 18 requests of the routing bench): the node's next request on a stale one goes out on
    a new connection, however many stale ones the pool holds."""
    async def main():
        answers = []
        server = await asyncio.start_server(functools.partial(one_answer_per_connection, answers), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = on.EngineClient(f"http://127.0.0.1:{port}")
        request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
        try:
            opened = []
            for _ in range(3):                    # three connections in the pool, all idle
                opened.append(await client.send_raw(request))
            for conn, _buf, head in opened:
                assert head.status == 200
                conn.body = on.BodyReader(head.framing, head.length)
                assert [p async for p in client.body(conn)] == [b"ok"]
            await asyncio.sleep(0.3)              # the engine closed all three meanwhile
            for _ in range(4):
                conn, _buf, head = await client.send_raw(request)
                assert head.status == 200
                client.release(conn, False)
            assert len(answers) == 7
        finally:
            client.close()
            server.close()
            await server.wait_closed()
    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# One parser per connection, in callbacks: what a read boundary or a client's going must not break
# ---------------------------------------------------------------------------------------------
def test_a_request_split_across_reads_anywhere_reaches_the_engine_whole_and_the_next_one_follows():
    raw = b'{"model":"fake-model","messages":[{"role":"user","content":"split me"}]}'

    async def t(node, client, engine):
        one = b"POST /v1/chat/completions HTTP/1.1\r\nhost: n\r\n%scontent-length: %d\r\n\r\n%s" % (
            tunnel_line(node), len(raw), raw)
        last = b"GET /healthz HTTP/1.1\r\nhost: n\r\nconnection: close\r\n\r\n"
        data = one + one + last
        host, port = node.registry.get(node.session_id)["addr"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        seen = []
        try:   # cuts inside the head, inside the body, and across the end of one request and the next
            for start, end in zip((0, 20, len(one) - 7, len(one) + 3, 2 * len(one) - 1),
                                  (20, len(one) - 7, len(one) + 3, 2 * len(one) - 1, len(data))):
                writer.write(data[start:end])
                await writer.drain()
                await asyncio.sleep(0.05)
                seen.append(engine.last_body)
            answer = await asyncio.wait_for(reader.read(-1), 10)
        finally:
            writer.close()
        return answer, seen, engine.requests
    answer, seen, reached = run(with_node(t))
    assert reached == 2 and seen[-1] == raw and all(body in (b"", raw) for body in seen)
    assert answer.count(b"HTTP/1.1 200 ") == 3 and answer.count(b'"chat.completion"') == 2
    assert answer.index(b'"chat.completion"') < answer.rindex(b'"chat.completion"') < answer.index(b'"status":"ok"')


def test_a_request_h11_reads_hands_the_connection_back_to_the_codec_for_the_next_one():
    async def t(node, client, engine):
        body = b'{"prompt":"a b"}'
        odd = b"POST /v1/completions HTTP/1.1\r\nhost: n\r\n%sexpect: 100-continue\r\ncontent-length: %d\r\n\r\n%s" % (
            tunnel_line(node), len(body), body)   # Expect: h11's to read
        plain = b"POST /v1/completions HTTP/1.1\r\nhost: n\r\n%scontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
            tunnel_line(node), len(body), body)
        return await raw_exchange(node, odd + plain), engine.requests
    data, reached = run(with_node(t))
    assert reached == 2 and data.count(b"HTTP/1.1 200 ") == 2 and data.count(b'"text_completion"') == 2


def test_a_client_gone_mid_stream_drops_the_engine_connection_and_the_tunnel_serves_on():
    async def t(node, client, engine):
        host, port = node.registry.get(node.session_id)["addr"].rsplit(":", 1)
        body = b'{"stream":true,"messages":[{"role":"user","content":"a long answer"}]}'
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: n\r\n%scontent-length: %d\r\n\r\n%s" % (
            tunnel_line(node), len(body), body))
        first = await asyncio.wait_for(reader.read(65536), 10)
        during = node.inflight
        writer.transport.abort()                    # the client goes after the first chunk
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.handlers:
                break
        after = node.inflight, len(node.engine.idle), len(engine.handlers), len(node.tunnel.connections)
        response, chunks = await call(client, "POST", "/v1/completions", b'{"prompt":"x"}', [node.tunnel_header])
        return first, during, after, response.status
    first, during, after, status = run(with_node(t, chunks=200, chunk_delay=0.02))
    assert first.startswith(b"HTTP/1.1 200 ") and during == 1
    assert after == (0, 0, 0, 0)   # no request counted, no engine connection kept or open, the tunnel
                                   # connection forgotten
    assert status == 200


def test_a_pooled_engine_connection_closed_while_idle_is_retried_for_the_tunnel_on_a_new_one():
    async def t():
        answered = []
        server = await asyncio.start_server(functools.partial(one_answer_per_connection, answered), "127.0.0.1", 0)
        cfg = on.Config(key=KEY, listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
        node = on.Node(cfg, models=["m"], engine_url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        await node.start(serve_http=True)
        client = on.EngineClient("http://" + node.registry.get(node.session_id)["addr"])
        try:
            statuses = []
            for _ in range(3):
                response, chunks = await call(client, "POST", "/v1/completions", b"{}", [node.tunnel_header])
                statuses.append((response.status, b"".join(chunks)))
                await asyncio.sleep(0.2)            # the engine closes the pooled connection meanwhile
            return statuses, len(answered)
        finally:
            client.close()
            await node.stop()
            server.close()
    assert run(t()) == ([(200, b"ok")] * 3, 3)


def test_a_whole_answer_in_one_read_goes_out_as_it_came_and_one_with_a_hop_by_hop_field_is_rewritten():
    plain = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nX-Engine:  1 \r\ncontent-length: 2\r\n\r\n{}"
    hop = b"HTTP/1.1 200 OK\r\nkeep-alive: timeout=5\r\ncontent-length: 2\r\n\r\n{}"

    async def engine(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(hop if b" /hop " in head else plain)   # one write: one read at the node
        except (asyncio.IncompleteReadError, OSError):
            writer.close()

    async def scenario():
        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        cfg = on.Config(key=KEY, listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
        node = on.Node(cfg, engine_url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        await node.start()
        host, port = node.registry.get(node.session_id)["addr"].rsplit(":", 1)
        name, value = node.tunnel_header
        reader, writer = await asyncio.open_connection(host, int(port))
        answers = []
        try:
            for path in (b"/plain", b"/hop", b"/plain"):
                writer.write(b"POST %s HTTP/1.1\r\nhost: n\r\n%s: %s\r\ncontent-length: 2\r\n\r\n{}"
                             % (path, name.encode(), value.encode()))
                head = await reader.readuntil(b"\r\n\r\n")
                answers.append(head + await reader.readexactly(2))
            return answers, len(node.engine.idle)
        finally:
            writer.close()
            await node.stop()
            server.close()
    answers, pooled = run(scenario())
    assert answers[0] == answers[2] == plain and pooled == 1
    assert answers[1] == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
