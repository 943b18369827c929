"""Reachability and relays on loopback, in one process: a worker that acts as if behind a NAT
(Config.reach="private") is reached through relay links, gossip and tunnel alike; a public one
is dialled back and stays direct; two private members open tunnel connections punched (TCP
simultaneous open) or, failing that, through the relay. The NAT lab (tests/natlab.py) runs the
same over real NATs."""
import asyncio
import json
import os
import shutil
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import fake_engine  # noqa: E402

import crdt  # noqa: E402
import otela_ingress  # noqa: E402
import otela_node as on  # noqa: E402

FAST = dict(probe_interval=0.3, probe_timeout=0.1, indirect_timeout=0.1, suspicion_mult=3.0,
            push_pull_interval=1.0, leave_linger=0.05, relay_check_interval=0.2, join_retry_min=0.2)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


def base_config(tmp_path) -> on.Config:
    cfg = on.Config(key=bytes(range(32)), listen="127.0.0.1:0", gossip="127.0.0.1:0", **FAST)
    if shutil.which("openssl"):
        key_file = on.keygen(str(tmp_path / "keys"))[0]
        cfg.key = on.load_key(key_file)
        cfg.tls_cert, cfg.tls_key = on.find_tunnel_tls(key_file)
    return cfg


async def until(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Bed:
    """An ingress (a relay by default), optional standalone relays, and workers with engines."""

    def __init__(self, cfg: on.Config, tmp_path):
        self.cfg, self.tmp = cfg, tmp_path
        self.members, self.engines = [], []

    def config(self, **fields) -> on.Config:
        return on.Config(**{**self.cfg.__dict__, **fields})

    async def ingress(self, **fields):
        node = on.Node(self.config(**fields), role="ingress")
        await node.start(serve_http=False)
        self.members.append(node)
        self.front = otela_ingress.Ingress(node, db_path=str(self.tmp / "u.sqlite"), no_auth=True)
        self.port = await self.front.start("127.0.0.1", 0)
        self.ingress_node = node
        return node

    async def relay(self):
        node = on.Node(self.config(bootstrap=[self.ingress_node.overlay.addr]), role="relay")
        await node.start(serve_http=False)
        self.members.append(node)
        return node

    async def worker(self, reach="private", **fields):
        port = fake_engine.free_port()
        engine = await fake_engine.start_fake_engine(port, model="fm", chunks=3)
        self.engines.append(engine)
        cfg = self.config(bootstrap=[self.ingress_node.overlay.addr], reach=reach, **fields)
        node = on.Node(cfg, models=["fm"], engine_url=f"http://127.0.0.1:{port}")
        await node.start(serve_http=True)
        self.members.append(node)
        return node

    async def chat(self, stream=False) -> bytes:
        body = json.dumps({"model": "fm", "stream": stream, "messages": [{"role": "user", "content": "a b"}]}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        try:
            return await asyncio.wait_for(reader.read(-1), 15)
        finally:
            writer.close()

    def view_of(self, member, sid):
        return next(s for s in member.registry_view()["sessions"] if s["session"] == sid)

    async def close(self):
        await self.front.stop()
        for node in reversed(self.members):
            await node.stop(leave=False)
        for engine in self.engines:
            await engine.close()


async def with_bed(tmp_path, test, **config):
    cfg = base_config(tmp_path)
    for name, value in config.items():
        setattr(cfg, name, value)
    bed = Bed(cfg, tmp_path)
    await bed.ingress()
    try:
        return await test(bed)
    finally:
        await bed.close()


def serving_relayed(bed, worker):
    record = bed.ingress_node.registry.get(worker.session_id)
    return record and record["state"] == crdt.SERVING and on.is_relayed(record["gossip"]) and record


def test_a_public_worker_is_dialled_back_and_stays_direct(tmp_path):
    async def t(bed):
        worker = await bed.worker(reach="auto")
        await until(lambda: worker.observed, what="the seed's answer")
        await until(lambda: (bed.ingress_node.registry.get(worker.session_id) or {}).get("state") == crdt.SERVING)
        answer = await bed.chat()
        return worker.private, worker.observed, bed.view_of(bed.ingress_node, worker.session_id)["reach"], answer
    private, observed, reach, answer = run(with_bed(tmp_path, t))
    assert private is False and observed.startswith("127.0.0.1:") and reach == "direct"
    assert answer.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("mux", [1, 0], ids=["multiplexed", "dial-back"])
def test_a_private_worker_is_served_through_its_relay_with_no_inbound_connection(tmp_path, mux):
    async def t(bed):
        worker = await bed.worker()
        record = await until(lambda: serving_relayed(bed, worker), what="relayed and SERVING")
        plain = [await bed.chat() for _ in range(3)]
        stream = await bed.chat(stream=True)
        view = bed.view_of(bed.ingress_node, worker.session_id)
        return worker, record, plain, stream, view, dict(bed.ingress_node.relayed)
    worker, record, plain, stream, view, relayed = run(with_bed(tmp_path, t, relay_mux=mux))
    assert record["gossip"] == record["addr"] == "relay/" + worker.link_id
    assert record["relay"] == worker.config.bootstrap[0] and view["reach"] == "relayed"
    assert all(a.startswith(b"HTTP/1.1 200") for a in plain)
    assert stream.count(b"data: {") == 3 and b"data: [DONE]" in stream
    assert relayed["spliced"] == 0                                   # the ingress holds the link itself
    if mux:
        assert relayed["muxed"] >= 1 and relayed["handed_over"] == 0
        assert worker.relayed["streams"] >= 1 and worker.relayed["dialed_back"] == 0
    else:
        assert relayed["handed_over"] >= 1 and relayed["muxed"] == 0 and worker.relayed["dialed_back"] >= 1
    if worker.tunnel_server_ssl is not None:
        assert worker.admitted["tls"] >= 1 and worker.admitted["plain"] == 0


def test_a_private_worker_keeps_two_relays_and_survives_the_death_of_one(tmp_path):
    async def t(bed):
        relay = await bed.relay()
        worker = await bed.worker()
        await until(lambda: len(worker._links) == 2 and (serving_relayed(bed, worker) or {}).get("relay", "").count(",") == 1,
                    what="two relay links")
        first = bed.ingress_node.registry.get(worker.session_id)
        statuses = []
        await relay.stop(leave=False)                  # a relay dies (its sockets close)
        bed.members.remove(relay)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            statuses.append((await bed.chat())[:12])
        await until(lambda: relay.overlay.addr not in worker._links, what="the dead link dropped")
        after = bed.ingress_node.registry.get(worker.session_id)
        return first, after, statuses, worker
    first, after, statuses, worker = run(with_bed(tmp_path, t))
    assert len(first["relay"].split(",")) == 2
    assert statuses and all(s == b"HTTP/1.1 200" for s in statuses)
    assert after["state"] == crdt.SERVING and after["version"] > first["version"]


def test_two_private_workers_punch_a_direct_path_and_fall_back_to_the_relay_when_it_breaks(tmp_path):
    async def t(bed):
        a, b = await bed.worker(), await bed.worker()
        for w in (a, b):
            await until(lambda w=w: serving_relayed(bed, w), what="relayed")
        await until(lambda: bed.view_of(a, b.session_id)["reach"] == "punched"
                    and bed.view_of(b, a.session_id)["reach"] == "punched", what="punched both ways")
        received = a._punched[b.overlay.addr].last_rx
        await until(lambda: a._punched[b.overlay.addr].last_rx > received, what="gossip over the punched path")
        for w in (a, b):                               # the path breaks (its sockets vanish) ...
            for path in w._punched.values():
                path.transport.close()
        await until(lambda: not a._punched and not b._punched, what="fallen back")
        await asyncio.sleep(1.5)                        # ... and nobody is suspected meanwhile
        return ([a.is_suspected(b.session_id), b.is_suspected(a.session_id)], bed.view_of(a, b.session_id)["reach"],
                a.punches["ok"] + b.punches["ok"], a.punches["fell_back"] + b.punches["fell_back"], a.punch_ms)
    suspected, reach, ok, fell_back, took = run(with_bed(tmp_path, t, punch_idle=1.0))
    assert suspected == [False, False] and reach == "relayed" and ok >= 2 and fell_back == 2


async def tunnel_get(node, addr) -> bytes:
    """GET /v1/models from the member at `addr` over node.open_relayed's socket (TLS when the
    cluster certificate is there, as the ingress's pool does)."""
    sock = await node.open_relayed(addr)
    tls = node.tunnel_client_ssl
    reader, writer = await asyncio.open_connection(sock=sock, ssl=tls,
                                                   server_hostname=on.TLS_SERVER_NAME if tls else None)
    name, value = node.tunnel_header
    writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n%s: %s\r\n\r\n"
                 % (name.encode(), value.encode()))
    try:
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


async def punched_pair(bed):
    a, b = await bed.worker(), await bed.worker()
    for w in (a, b):
        await until(lambda w=w: serving_relayed(bed, w), what="relayed")
    await until(lambda: b.overlay.addr in a._punched and a.overlay.addr in b._punched, what="UDP punched both ways")
    return a, b


def test_two_private_workers_open_tunnel_connections_by_tcp_simultaneous_open(tmp_path):
    async def t(bed):
        a, b = await punched_pair(bed)
        spliced = sum(bed.ingress_node.relayed[k] for k in ("spliced", "handed_over", "muxed"))
        answers = [await tunnel_get(a, b.overlay.addr) for _ in range(3)]
        return (answers, dict(a.tunnel_punches), bed.view_of(a, b.session_id)["tunnel"],
                sum(bed.ingress_node.relayed[k] for k in ("spliced", "handed_over", "muxed")) - spliced,
                dict(b.admitted), b.tunnel_server_ssl is not None)
    answers, punches, tunnel, via_relay, admitted, tls = run(with_bed(tmp_path, t))
    assert all(a.startswith(b"HTTP/1.1 200") and b'"fm"' in a for a in answers)
    assert punches == {"ok": 3, "failed": 0} and tunnel == "punched" and via_relay == 0
    if tls:
        assert admitted["tls"] == 3 and admitted["plain"] == 0


def test_a_tunnel_punch_that_gets_no_answer_falls_back_to_the_relay_and_serves(tmp_path):
    async def t(bed):
        a, b = await punched_pair(bed)
        b._punch_handlers.pop("tq")                # b's side never answers: a symmetric NAT's effect
        answers = [await tunnel_get(a, b.overlay.addr) for _ in range(3)]
        return answers, dict(a.tunnel_punches), bed.view_of(a, b.session_id)["tunnel"], dict(bed.ingress_node.relayed)
    answers, punches, tunnel, relayed = run(with_bed(tmp_path, t))
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers)
    assert punches == {"ok": 0, "failed": 2}       # two orders tried, then straight to the relay
    assert tunnel == "relayed" and relayed["spliced"] + relayed["muxed"] == 3


def test_a_relay_refuses_links_when_relaying_is_off_and_forged_envelopes(tmp_path):
    async def t(bed):
        ingress = bed.ingress_node
        ingress.config.relay = False
        worker = await bed.worker(relay_check_interval=0.1)
        await asyncio.sleep(1.0)
        refused = ingress.relayed["refused"]
        ingress._on_datagram(on.envelope("127.0.0.1:9", b"o1" + os.urandom(80)), ("127.0.0.1", 9))
        return worker._links, refused, ingress.wire.dropped["forged"], ingress.relayed["forwarded"]
    links, refused, forged, forwarded = run(with_bed(tmp_path, t))
    assert links == {} and refused >= 1 and forged >= 1 and forwarded == 0


@pytest.mark.parametrize("argv", [["relay", "--help"]])
def test_the_relay_command_exists(argv, capsys):
    with pytest.raises(SystemExit) as done:
        on.main(argv)
    assert done.value.code == 0 and "--gossip" in capsys.readouterr().out
