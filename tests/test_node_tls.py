"""The private tunnel: mutual TLS from keygen's cluster certificate. A client without the key
material is refused, bytes on the wire carry no plaintext prompt or credential, recorded bytes
replayed are refused, and the ingress reaches nodes over it. In one process, on loopback."""
import asyncio
import json
import os
import shutil
import ssl
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import fake_engine  # noqa: E402

import otela_ingress  # noqa: E402
import otela_node as on  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="keygen needs openssl for the certificate")
PROMPT = "the zebra-4471 ate my homework"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def material(folder) -> on.Config:
    key_file = on.keygen(str(folder))[0]
    cfg = on.Config(key=on.load_key(key_file), listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
    cfg.tls_cert, cfg.tls_key = on.find_tunnel_tls(key_file)
    return cfg


@pytest.fixture
def cluster_config(tmp_path):
    return material(tmp_path / "keys")


async def with_node(cfg, test, **engine_opts):
    port = fake_engine.free_port()
    engine = await fake_engine.start_fake_engine(port, **engine_opts)
    node = on.Node(cfg, models=["fake-model"], engine_url=f"http://127.0.0.1:{port}")
    await node.start(serve_http=True)
    try:
        return await test(node, engine)
    finally:
        await node.stop()
        await engine.close()


def addr_of(node):
    host, port = node.registry.get(node.session_id)["addr"].rsplit(":", 1)
    return host, int(port)


def request(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n%scontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (extra, len(body), body))


CHAT = json.dumps({"model": "fake-model", "stream": True,
                   "messages": [{"role": "user", "content": PROMPT}]}).encode()


async def exchange(host, port, data: bytes, tls=None) -> bytes:
    """Write `data` (over TLS with context `tls`), read to the end; b"" when refused."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=tls, server_hostname=on.TLS_SERVER_NAME if tls else None), 10)
    except (OSError, ssl.SSLError, asyncio.TimeoutError):
        return b""
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(-1), 10)
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        return b""
    finally:
        writer.close()


class Recorder:
    """A TCP relay between a client and the node that keeps every byte it passes."""

    def __init__(self, target):
        self.target = target
        self.up = bytearray()                       # client -> node
        self.down = bytearray()                     # node -> client
        self.server = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pump(src, dst, log):
            try:
                while True:
                    data = await src.read(65536)
                    if not data:
                        break
                    log += data
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()
        await asyncio.gather(pump(reader, up_writer, self.up), pump(up_reader, writer, self.down))

    def close(self):
        self.server.close()


def test_a_member_with_the_cluster_certificate_is_served_over_tls_without_any_header(cluster_config):
    async def t(node, engine):
        _, client = on.tunnel_tls(cluster_config)
        answer = await exchange(*addr_of(node), request(CHAT), client)
        return answer, engine.requests, dict(node.tunnel.admitted)
    answer, reached, admitted = run(with_node(cluster_config, t, chunks=3))
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"data: {") == 3 and b"data: [DONE]" in answer
    assert reached == 1 and admitted == {"tls": 1, "plain": 0}


def test_clients_without_the_key_material_are_refused_and_never_reach_the_engine(cluster_config, tmp_path):
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.check_hostname, no_cert.verify_mode = False, ssl.CERT_NONE
    _, other_cluster = on.tunnel_tls(material(tmp_path / "other"))
    stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)        # someone else's cert, trusting ours
    stranger.check_hostname = False
    stranger.load_cert_chain(str(tmp_path / "other" / "cluster.crt"), str(tmp_path / "other" / "cluster-tls.key"))
    stranger.load_verify_locations(cluster_config.tls_cert)

    async def t(node, engine):
        addr = addr_of(node)
        credential = "{}: {}\r\n".format(*node.tunnel_header).encode()
        answers = [await exchange(*addr, request(CHAT), ctx) for ctx in (no_cert, other_cluster, stranger)]
        plain = await exchange(*addr, request(CHAT, credential))   # even the old static credential
        health = await exchange(*addr, b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return answers, plain, health, engine.requests, node.refused["handshake"]
    answers, plain, health, reached, handshakes = run(with_node(cluster_config, t))
    assert answers == [b"", b"", b""] and handshakes >= 2    # the other cluster's client refuses us
    head, _, body = plain.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403") and json.loads(body)["error"]["code"] == "tls_required"
    assert health.startswith(b"HTTP/1.1 200") and reached == 0   # probes still see /healthz in plain


def test_captured_tunnel_bytes_hold_no_prompt_or_credential_and_replayed_bytes_are_refused(cluster_config):
    async def t(node, engine):
        recorder = Recorder(addr_of(node))
        port = await recorder.start()
        _, client = on.tunnel_tls(cluster_config)
        credential = node.tunnel_header[1].encode()
        answer = await exchange("127.0.0.1", port, request(CHAT, b"x-otela-tunnel: %s\r\n" % credential), client)
        wire = bytes(recorder.up + recorder.down)
        replayed = await exchange(*addr_of(node), bytes(recorder.up))
        deadline = time.monotonic() + 5
        while node.refused["handshake"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        recorder.close()
        return answer, wire, replayed, engine.requests, node.refused["handshake"], credential
    answer, wire, replayed, reached, refused, credential = run(with_node(cluster_config, t))
    assert answer.startswith(b"HTTP/1.1 200") and engine_body(answer).count(b"data: {") >= 1
    for secret in (PROMPT.encode(), b"zebra", b"chat/completions", b"fake-model", credential):
        assert secret not in wire
    assert len(wire) > 1000                               # it did carry the request and the stream
    assert replayed == b"" and reached == 1 and refused == 1


def engine_body(answer: bytes) -> bytes:
    return answer.partition(b"\r\n\r\n")[2]


def test_the_ingress_reaches_a_node_over_mutual_tls_and_sends_no_static_credential(cluster_config, tmp_path):
    async def t(node, engine):
        cfg = on.Config(**{**cluster_config.__dict__, "bootstrap": [node.overlay.addr]})
        member = on.Node(cfg, role="ingress")
        await member.start(serve_http=False)
        ingress = otela_ingress.Ingress(member, db_path=str(tmp_path / "u.sqlite"), no_auth=True)
        port = await ingress.start("127.0.0.1", 0)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                record = member.registry.get(node.session_id)
                if record and record.get("state") == on.crdt.SERVING:
                    break
                await asyncio.sleep(0.05)
            answers = [await exchange("127.0.0.1", port, request(CHAT)) for _ in range(3)]
            return answers, dict(node.tunnel.admitted), node.refused["credential"], ingress.pool.tunnel_line
        finally:
            await ingress.stop()
            await member.stop()
    answers, admitted, refused, line = run(with_node(cluster_config, t, chunks=2))
    assert all(a.startswith(b"HTTP/1.1 200") and a.count(b"data: {") >= 2 for a in answers)
    assert admitted["tls"] >= 1 and admitted["plain"] == 0 and refused == 0 and line == b""


def test_an_unreadable_or_public_cluster_tls_key_is_a_config_error(tmp_path):
    key_file = on.keygen(str(tmp_path))[0]
    os.chmod(tmp_path / "cluster-tls.key", 0o644)
    with pytest.raises(on.ConfigError, match="chmod 600"):
        on.find_tunnel_tls(key_file)
    os.chmod(tmp_path / "cluster-tls.key", 0o600)
    (tmp_path / "cluster.crt").write_text("not a certificate\n")
    cfg = on.Config(key=b"k" * 32)
    cfg.tls_cert, cfg.tls_key = on.find_tunnel_tls(key_file)
    with pytest.raises(on.ConfigError, match="cannot load the cluster certificate"):
        on.tunnel_tls(cfg)
