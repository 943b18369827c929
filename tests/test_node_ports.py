"""No work before authentication on the node's ports: the gossip TCP port and the tunnel port
under attack (idle connections, huge frame lengths, keyless bodies) stay bounded, and members'
own traffic still goes through. In one process, plus one real node process for memory and
descriptors."""
import asyncio
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import fake_engine  # noqa: E402

import otela_node as on  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = bytes(range(32))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def with_node(test, **config):
    port = fake_engine.free_port()
    engine = await fake_engine.start_fake_engine(port)
    cfg = on.Config(key=KEY, listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05, **config)
    node = on.Node(cfg, models=["fake-model"], engine_url=f"http://127.0.0.1:{port}")
    await node.start(serve_http=True)
    try:
        return await test(node, engine)
    finally:
        await node.stop()
        await engine.close()


async def until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def addr_of(node, field):
    host, port = node.registry.get(node.session_id)[field].rsplit(":", 1)
    return host, int(port)


def credential(node) -> bytes:
    name, value = node.tunnel_header
    return f"{name}: {value}\r\n".encode()


async def read_all(reader, timeout=10.0) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(-1), timeout)
    except ConnectionResetError:
        return b""


async def plain_request(node, body=b'{"prompt":"a b"}') -> bytes:
    reader, writer = await asyncio.open_connection(*addr_of(node, "addr"))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n%sconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                 % (credential(node), len(body), body))
    try:
        return await read_all(reader)
    finally:
        writer.close()


# -- gossip TCP ------------------------------------------------------------------------------
def test_a_strangers_huge_frame_length_closes_the_gossip_connection_before_its_body_is_read():
    async def t(node, engine):
        reader, writer = await asyncio.open_connection(*addr_of(node, "gossip"))
        writer.write(struct.pack(">I", 32 * 1024 * 1024) + b"\0" * 65536)
        closed = await read_all(reader)
        writer.close()
        return closed, node.wire.dropped["oversized"], node.bytes_received
    closed, oversized, received = run(with_node(t))
    assert closed == b"" and oversized == 1 and received == 0


def test_a_big_authentic_frame_after_a_hello_is_accepted_and_a_forged_small_one_closes():
    async def t(node, engine):
        target = addr_of(node, "gossip")
        before = node.wire.accepted
        big = {"t": "a", "n": 1, "pad": "x" * 50000}    # > max_datagram: sent after a hello
        await node.gossip_tcp.send(target, [dict(big, ra="127.0.0.1:1")])
        await until(lambda: node.wire.accepted >= before + 2, what="hello and big frame")
        reader, writer = await asyncio.open_connection(*target)
        forged = b"o1" + os.urandom(100)
        writer.write(struct.pack(">I", len(forged)) + forged + struct.pack(">I", 4096) + os.urandom(4096))
        closed = await read_all(reader)
        writer.close()
        return node.wire.accepted - before, node.wire.dropped["forged"], closed
    accepted, forged, closed = run(with_node(t))
    assert accepted == 2 and forged == 1 and closed == b""


def test_the_pieces_of_a_state_transfer_go_on_one_connection_each_big_frame_after_a_hello():
    async def t(node, engine):
        target = addr_of(node, "gossip")
        before, connections = node.wire.accepted, node.refused["gossip_evicted"]
        pieces = [{"t": "a", "n": i, "pad": "x" * 50000, "ra": "127.0.0.1:1"} for i in range(40)]
        await node.gossip_tcp.send(target, pieces)     # 40 connections at once would take 16 slots
        await until(lambda: node.wire.accepted >= before + 80, what="40 hellos and 40 big frames")
        return node.wire.accepted - before, node.refused["gossip_evicted"] - connections, node.wire.dropped["oversized"]
    accepted, evicted, oversized = run(with_node(t))
    assert (accepted, evicted, oversized) == (80, 0, 0)


def test_gossip_tcp_strangers_are_cut_oldest_first_per_address_and_at_the_cap_never_an_authenticated_member():
    async def t(node, engine):
        target = addr_of(node, "gossip")
        member = await asyncio.open_connection(*target)     # authenticated by its first frame, then idle
        hello = node.wire.seal({"t": "h"}, time.time())
        member[1].write(struct.pack(">I", len(hello)) + hello)
        await until(lambda: len(node.gossip_tcp.members) == 1, what="the member authenticated")
        idle = [await asyncio.open_connection(*target) for _ in range(100)]        # one address
        await until(lambda: node.refused["gossip_evicted"] >= 100 - 16, what="its share cut")
        one_address = len(node.gossip_tcp.strangers)
        first_closed = await read_all(idle[0][0], 2)
        others = [await asyncio.open_connection(*target, local_addr=(f"127.0.0.{2 + i // 16}", 0))
                  for i in range(80)]                                                # five more
        await until(lambda: node.refused["gossip_evicted"] >= 84 + 17, what="the oldest cut at the cap")
        held = node.gossip_tcp.connections, len(node.gossip_tcp.members)
        member_open = not member[1].transport.is_closing() and not member[0].at_eof()
        for _, w in idle + others:
            w.close()
        member[1].close()
        await until(lambda: node.gossip_tcp.connections == 0, what="idle closed")
        before = node.wire.accepted
        await node.gossip_tcp.send(target, [{"t": "a", "n": 1, "ra": "127.0.0.1:1"}])
        await until(lambda: node.wire.accepted == before + 1, what="a member's frame")
        return one_address, first_closed, held, member_open, node.refused["gossip_busy"]
    one_address, first_closed, held, member_open, busy = run(with_node(t, max_gossip_connections=64))
    assert one_address == 16 and first_closed == b""
    assert held == (64, 1) and member_open and busy == 0


def test_with_every_slot_a_members_a_newcomer_cuts_the_oldest_idle_one_never_one_mid_frame():
    async def t(node, engine):
        target = addr_of(node, "gossip")

        async def member(mid_frame: bool):
            r, w = await asyncio.open_connection(*target)
            hello = node.wire.seal({"t": "h"}, time.time())
            w.write(struct.pack(">I", len(hello)) + hello + (struct.pack(">I", 100000) + b"\0" * 10 if mid_frame else b""))
            return r, w
        idle = [await member(False) for _ in range(4)]
        await until(lambda: len(node.gossip_tcp.members) == 4 and all(node.gossip_tcp.members.values()), what="4 idle")
        newcomer = await asyncio.open_connection(*target)
        first_cut = await read_all(idle[0][0], 5)
        await until(lambda: node.refused["gossip_evicted"] == 1, what="the oldest idle cut")
        for _, w in idle + [newcomer]:
            w.close()
        await until(lambda: node.gossip_tcp.connections == 0, what="all closed")
        busy = [await member(True) for _ in range(4)]
        await until(lambda: len(node.gossip_tcp.members) == 4 and not any(node.gossip_tcp.members.values()),
                    what="4 mid-frame")
        refused = await asyncio.open_connection(*target)
        await until(lambda: node.refused["gossip_busy"] == 1, what="the newcomer refused")
        still = node.gossip_tcp.connections
        for _, w in busy + [refused]:
            w.close()
        return first_cut, still, node.refused["gossip_evicted"]
    first_cut, still, evicted = run(with_node(t, max_gossip_connections=4))
    assert first_cut == b"" and still == 4 and evicted == 1


def test_a_gossip_tcp_stranger_with_no_authentic_frame_is_closed_at_the_auth_deadline():
    async def t(node, engine):
        reader, writer = await asyncio.open_connection(*addr_of(node, "gossip"))
        writer.write(b"\x00\x00\x10\x00")                  # a length, then nothing
        began = time.monotonic()
        closed = await read_all(reader, 5)
        writer.close()
        return closed, time.monotonic() - began, node.refused["gossip_slow"]
    closed, took, slow = run(with_node(t, gossip_auth_timeout=0.5))
    assert closed == b"" and 0.4 <= took < 2.0 and slow == 1


def test_frames_after_an_authentic_frame_stay_datagram_sized_but_for_one_after_a_hello_within_a_global_budget():
    def framed(node, msg) -> bytes:
        sealed = node.wire.seal(msg, time.time())
        return struct.pack(">I", len(sealed)) + sealed

    async def t(node, engine):
        target = addr_of(node, "gossip")
        big = {"t": "a", "n": 1, "ra": "127.0.0.1:1", "pad": "x" * 50000}
        # a small authentic message, then a big frame: refused, as before any frame
        reader, writer = await asyncio.open_connection(*target)
        writer.write(framed(node, {"t": "a", "n": 1, "ra": "127.0.0.1:1"}) + struct.pack(">I", 60000))
        after_small = await read_all(reader, 5)
        writer.close()
        oversized = node.wire.dropped["oversized"]
        # a hello buys one big frame; the next big one on that connection is refused
        reader, writer = await asyncio.open_connection(*target)
        before = node.wire.accepted
        writer.write(framed(node, {"t": "h"}) + framed(node, big) + framed(node, big))
        after_two = await read_all(reader, 5)
        writer.close()
        accepted = node.wire.accepted - before
        # two hellos announcing 80 KB each at once, with a 100 KB budget: the second is refused
        held = []
        for _ in range(2):
            r, w = await asyncio.open_connection(*target)
            w.write(framed(node, {"t": "h"}) + struct.pack(">I", 80000) + b"\0" * 1000)
            held.append((r, w))
        await until(lambda: node.refused["frame_budget"] == 1, what="the second big frame refused")
        budget = node.gossip_tcp.frame_bytes
        for _, w in held:
            w.close()
        await until(lambda: node.gossip_tcp.frame_bytes == 0, what="the budget given back")
        return after_small, oversized, after_two, accepted, node.wire.dropped["oversized"], budget
    after_small, oversized, after_two, accepted, oversized_then, budget = run(
        with_node(t, max_frame_bytes=100000))
    assert after_small == b"" and oversized == 1
    assert after_two == b"" and accepted == 2 and oversized_then == 2    # the hello and one big frame
    assert budget == 80000


def test_16_connections_each_announcing_a_30_mib_frame_after_a_hello_get_the_budget_of_two():
    """The issue's insider (the key, 16 connections, 30 MiB frames after one hello each, +466 MB
    before): what may be read at once is max_frame_bytes (64 MiB), the rest refused at the length."""
    async def t(node, engine):
        target = addr_of(node, "gossip")
        held = []
        for _ in range(16):
            r, w = await asyncio.open_connection(*target)
            hello = node.wire.seal({"t": "h"}, time.time())
            w.write(struct.pack(">I", len(hello)) + hello + struct.pack(">I", 30 * 1024 * 1024) + b"\0" * 4096)
            held.append((r, w))
        await until(lambda: node.refused["frame_budget"] == 14, what="14 big frames refused")
        reading = node.gossip_tcp.frame_bytes
        for _, w in held:
            w.close()
        return reading
    reading = run(with_node(t))
    assert reading == 2 * 30 * 1024 * 1024 <= on.Config().max_frame_bytes


async def join_over_tcp(node, target, ra: str, rc: bool, source: str = "127.0.0.1") -> bytes:
    """A join with no record of its own (the answer is the whole state all the same); what comes
    back on its connection."""
    reader, writer = await asyncio.open_connection(*target, local_addr=(source, 0))
    join = {"t": "j", "r": {}, "ra": ra, **({"rc": 1} if rc else {})}
    sealed = node.wire.seal(join, time.time())
    writer.write(struct.pack(">I", len(sealed)) + sealed)
    writer.write_eof()
    back = await read_all(reader, 5)
    writer.close()
    return back


def test_a_join_is_answered_on_its_own_connection_never_at_an_address_it_names_and_a_flood_is_rate_limited():
    async def t(node, engine):
        target = addr_of(node, "gossip")
        dialled = []
        victim = await asyncio.start_server(lambda r, w: (dialled.append(1), w.close()), "127.0.0.2", 0)
        victim_addr = f"127.0.0.2:{victim.sockets[0].getsockname()[1]}"
        # no "rc" (an older joiner) and an address it did not come from: no answer anywhere
        misdirected = await join_over_tcp(node, target, victim_addr, rc=False)
        # "rc": the state comes back on the connection, and never to the address named
        answered = await join_over_tcp(node, target, victim_addr, rc=True)
        # a flood of 40 joins from one address: the burst answered, the rest refused
        flood = [await join_over_tcp(node, target, victim_addr, rc=True) for _ in range(40)]
        await asyncio.sleep(0.3)
        victim.close()
        return misdirected, answered, flood, len(dialled), dict(node.refused)
    misdirected, answered, flood, dialled, refused = run(with_node(t))
    assert misdirected == b"" and dialled == 0 and refused["join_misdirected"] == 1
    answer = on.Wire(KEY, on.Config(key=KEY))
    frames, pos = [], 0
    while pos < len(answered):
        (length,) = struct.unpack_from(">I", answered, pos)
        frames.append(answer.open(answered[pos + 4:pos + 4 + length], time.time(), tcp=True))
        pos += 4 + length
    assert [f["t"] for f in frames] == ["st"] and len(frames[0]["r"]) >= 1
    served = sum(1 for back in flood if back)
    assert 7 <= served <= 9 and refused["join_limited"] == 40 - served      # burst 8 (+ ~0.5/s refill)


def test_a_new_member_joins_by_the_answer_on_its_own_connection():
    async def t(node, engine):
        cfg = on.Config(key=KEY, listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05,
                        bootstrap=[node.overlay.addr], push_pull_interval=600.0)
        joiner = on.Node(cfg, role="relay")
        read = joiner.gossip_tcp._read_join_answer
        learned = []

        async def reading(*args):                   # what the joiner knew once its answer was read
            await read(*args)
            learned.append(joiner.registry.get(node.session_id) is not None)
        joiner.gossip_tcp._read_join_answer = reading
        await joiner.start(serve_http=False)
        try:
            await until(lambda: learned, 5, "the answer read on the join's connection")
            return node.refused["join_misdirected"], node.refused["join_limited"], learned
        finally:
            await joiner.stop(leave=False)
    misdirected, limited, learned = run(with_node(t))
    assert misdirected == limited == 0 and learned == [True]


# -- the tunnel port -------------------------------------------------------------------------
def test_a_keyless_request_is_refused_on_its_head_before_its_body_is_sent():
    async def t(node, engine):
        reader, writer = await asyncio.open_connection(*addr_of(node, "addr"))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 60000000\r\n\r\n")
        answer = await read_all(reader)                     # no body byte was ever written
        writer.close()
        return answer, engine.requests, node.refused["credential"]
    answer, reached, refused = run(with_node(t))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403") and b"connection: close" in head
    assert json.loads(body)["error"]["type"] == "permission_error" and reached == 0 and refused == 1


def test_idle_strangers_are_capped_and_cut_oldest_first_while_a_member_is_served():
    async def t(node, engine):
        target = addr_of(node, "addr")
        idle = [await asyncio.open_connection(*target) for _ in range(200)]
        await until(lambda: node.refused["cut"] >= 200 - 64, what="strangers cut")
        held = len(node.tunnel.unauthenticated)
        answer = await plain_request(node)
        first_closed = await read_all(idle[0][0], 2)
        for _, w in idle:
            w.close()
        return held, answer, first_closed
    held, answer, first_closed = run(with_node(t, max_unauthenticated=64))
    assert held == 64 and answer.startswith(b"HTTP/1.1 200") and first_closed == b""


def test_the_connection_over_the_cap_gets_a_503_error_body_and_a_close():
    async def t(node, engine):
        target = addr_of(node, "addr")
        idle = [await asyncio.open_connection(*target) for _ in range(8)]
        await until(lambda: len(node.tunnel.connections) == 8, what="8 held")
        reader, writer = await asyncio.open_connection(*target)
        answer = await read_all(reader)
        writer.close()
        for _, w in idle:
            w.close()
        await until(lambda: not node.tunnel.connections, what="all closed")
        return answer, await plain_request(node)
    busy, after = run(with_node(t, max_tunnel_connections=8, max_unauthenticated=8))
    head, _, body = busy.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "busy"
    assert after.startswith(b"HTTP/1.1 200")


def test_a_silent_connection_and_a_slow_head_are_closed_at_the_head_deadline():
    async def t(node, engine):
        target = addr_of(node, "addr")
        silent = await asyncio.open_connection(*target)
        slow = await asyncio.open_connection(*target)
        slow[1].write(b"POST /v1/completions HTTP/1.1\r\n")       # and never the rest
        started = time.monotonic()
        results = [await read_all(silent[0]), await read_all(slow[0])]
        for _, w in (silent, slow):
            w.close()
        await until(lambda: not node.tunnel.connections, what="both gone")
        return results, time.monotonic() - started
    results, _ = run(with_node(t, head_timeout=0.3))
    assert results == [b"", b""]


def test_a_stranger_kept_alive_after_an_open_request_is_closed_at_the_head_deadline():
    async def t(node, engine):
        reader, writer = await asyncio.open_connection(*addr_of(node, "addr"))
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")   # kept alive, then silent
        answer = await read_all(reader)
        writer.close()
        return answer
    answer = run(with_node(t, head_timeout=0.3))
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"}")   # answered, then closed


def test_a_body_that_stops_arriving_is_cut_at_the_body_deadline_and_never_reaches_the_engine():
    async def t(node, engine):
        reader, writer = await asyncio.open_connection(*addr_of(node, "addr"))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n%scontent-length: 1000\r\n\r\n{" % credential(node))
        answer = await read_all(reader)
        writer.close()
        return answer, engine.requests
    assert run(with_node(t, body_timeout=0.3)) == (b"", 0)


# -- a real node process: memory and descriptors stay bounded ---------------------------------
def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def _wait(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _http(port, data, timeout=10.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while True:
            part = sock.recv(65536)
            if not part:
                return out
            out += part


def test_a_node_process_under_port_attack_keeps_its_memory_and_descriptors_and_serves(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    key_file = tmp_path / "cluster.key"                     # no certificate beside it: plain tunnel
    key_file.write_text(KEY.hex() + "\n")
    key_file.chmod(0o600)
    listen, gossip, engine = fake_engine.free_port(), fake_engine.free_port(), fake_engine.free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "otela_node.py"), "start", "--key-file", str(key_file),
         "--listen", f"127.0.0.1:{listen}", "--gossip", f"127.0.0.1:{gossip}", "--log-level", "ERROR",
         "--engine-url", f"http://127.0.0.1:{engine}",
         "--process", f"{sys.executable} {ROOT / 'tests' / 'fake_engine.py'} --port {engine}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socks = []
    try:
        _wait(lambda: b"SERVING" in _http(listen, b"GET /v1/registry HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"),
              30, "node SERVING")
        name, value = on.Node(on.Config(key=KEY)).tunnel_header
        good = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n%s: %s\r\nconnection: close\r\n"
                b"content-length: 2\r\n\r\n{}" % (name.encode(), value.encode()))
        rss0, fds0 = _rss_kb(proc.pid), _fds(proc.pid)
        for _ in range(24):                                 # 32 MiB frame lengths at the gossip port
            s = socket.create_connection(("127.0.0.1", gossip))
            s.setblocking(False)
            try:
                s.send(struct.pack(">I", 32 * 1024 * 1024) + b"\0" * (1 << 20))
            except OSError:
                pass
            socks.append(s)
        for _ in range(8):                                  # keyless heads with 60 MB bodies behind
            s = socket.create_connection(("127.0.0.1", listen))
            s.setblocking(False)
            try:
                s.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 60000000\r\n\r\n"
                       + b"x" * (1 << 20))
            except OSError:
                pass
            socks.append(s)
        for _ in range(1300):                               # idle connections at the tunnel port
            socks.append(socket.create_connection(("127.0.0.1", listen)))
        _wait(lambda: _fds(proc.pid) <= fds0 + 64 + 8, 20, "strangers cut down to the cap")
        answer = _http(listen, good)
        rss1, fds1 = _rss_kb(proc.pid), _fds(proc.pid)
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert answer.startswith(b"HTTP/1.1 200")
    assert fds1 - fds0 <= 64 + 8                            # max_unauthenticated, plus a margin
    assert rss1 - rss0 < 40 * 1024                          # KiB: was +1 GB (gossip) and +550 MB (tunnel)
