"""Benchmark of the ingress hop (and the whole path through a node when otela_node can run one).

Against tests/fake_engine.py on loopback, in one run, straight to the engine vs through the
ingress, with and without uvloop in the ingress:
  - latency: p50/p99 of non-streamed chat completions at 16 requests/s on one keep-alive
    connection; "added" = through the ingress minus straight to the engine; the same at 100
    and 1000 requests/s; and "busy", the same requests sent back to back (the hop's own work,
    with no CPU waking from idle);
  - throughput: requests/s at 64 keep-alive connections, the ingress pinned to CPU 0 (engine and
    client share CPU 1), and the ingress's CPU time per request (from /proc);
  - SSE: added time to the first chunk of a paced stream, chunks/s across 16 concurrent streams
    and the ingress's CPU time per chunk;
  - failures (see failure_runs): client errors and the added cost of a retried request with one
    of two engines answering 500 or killed, and error events when an engine dies mid-stream.

"ingress+uvloop+otlp" is the same ingress with --otlp-endpoint set to a local collector that
answers: the cost of tracing on, as ratios to "ingress+uvloop" of the same run.

Peers measured in the same run, for scale on this machine: "tcp-relay", a uvloop relay that
copies bytes between connections without reading them (the floor of any user-space proxy hop
here), and "nginx" (a reverse proxy with upstream keep-alive, one worker pinned like the
ingress) when an nginx binary is installed (`apt-get install nginx-light`; skipped otherwise).
With the whole path, "bare-asyncio x2": two bare asyncio proxies in a row, pinned as the ingress
and the node are, the floor of a path of two Python hops on this machine (without TLS), and
"bare-asyncio x2 + TLS", the same with the second hop on TLS 1.3 with the tunnel's own contexts
(mutual, the cluster certificate): the floor the whole path (ingress -> node tunnel over TLS ->
engine) is to be read against. "bare-asyncio + node" is that floor with its second hop the real
node (the front bare proxy dials the whole path's nodes over TLS): less the floor, the node's own
share of the whole path's excess; the rest is the ingress's.

Prints a table and writes JSON to <--out DIR>/ingress.json. Never asserts on time.
With --rounds N every config is measured N times in rotating order (a noisy machine's bursts
then fall on different configs); figures are medians of the rounds, and the ratios to nginx
(added p50, req/s, SSE chunks/s) are the medians of per-round ratios.
With --before DIR (a checkout of an earlier commit, e.g. `git worktree add DIR REV`), that
checkout's ingress is measured beside this one as "before+uvloop", and its whole path as
"before: ingress+node", in the same rounds.
Usage: python tests/bench_ingress.py [--out bench-results] [--quick] [--no-node] [--rounds N] [--before DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from fake_engine import free_port, spawn_fake_engine  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
# From the issue: the ingress hop's targets, and peers measured on this kind of machine with the
# same method (proxy pinned to one core), for the closing comparison.
TARGETS = {"added_p50_ms": 0.3, "added_p99_ms": 1.0, "rps_64conn": 6000, "cpu_us_per_request": 170,
           "sse_chunks_per_s_16streams": 60000, "cpu_us_per_chunk": 15, "added_ttfb_ms": 0.3,
           "whole_path_added_p50_ms": 0.6, "whole_path_added_p99_ms": 2.0}
PEERS = {"nginx": {"added_p50_ms": 0.23, "rps_64conn": 23600, "cpu_us_per_request": 26,
                   "sse_chunks_per_s_16streams": 94000},
         "vllm-router": {"added_p50_ms": 0.63, "rps_64conn": 14200, "cpu_us_per_request": 69,
                         "sse_chunks_per_s_16streams": 120000},
         "production-stack router": {"added_p50_ms": 2.3, "rps_64conn": 600},
         "LiteLLM": {"added_p50_ms": 15, "rps_64conn": 74, "sse_chunks_per_s_16streams": 1400},
         "bare asyncio proxy": {"rps_64conn": 18000, "cpu_us_per_request": 51}}
SWEEP_RATES = (100, 1000)   # requests/s, besides the 16 and back to back
_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.I)


# -- the ingress under test, in its own process ----------------------------------------------------
def child(engines: dict, use_uvloop: bool, db: str, otlp: str = None) -> None:
    """Run an ingress with a stand-in node whose registry names the given engines (`otlp`: its
    spans go to that collector)."""
    if not use_uvloop:
        sys.modules["uvloop"] = None
    from test_ingress_support import StandInNode

    import otela_ingress
    if use_uvloop:
        import uvloop
        uvloop.install()

    async def main():
        node = StandInNode()
        for model, port in engines.items():
            for one in (port if isinstance(port, list) else [port]):   # a list: sessions sharing a model
                node.add_worker(f"127.0.0.1:{one}", [model])
        db_conn = otela_ingress.open_db(db)
        _, key = otela_ingress.create_key(db_conn, "bench")
        db_conn.close()
        ingress = otela_ingress.Ingress(node, db_path=db, otlp_endpoint=otlp)
        port = await ingress.start("127.0.0.1", 0)
        print(json.dumps({"port": port, "key": key}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def relay_child(routes: dict, parse: bool = False, tls: str = "", key_file: str = "") -> None:
    """A TCP relay: each accepted connection gets its own connection to the engine and bytes are
    copied both ways unread (listen port -> engine port). With `parse`, the bare asyncio proxy
    the issue cites: requests are read by hand (head, Content-Length body) and sent on whole.
    With `tls` ("listen" or "connect"), that side is the node tunnel's TLS (its contexts, from
    the cluster's certificate beside `key_file`)."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    listen_tls = connect_tls = None
    if tls:
        import types

        import otela_node
        cert, tls_key = otela_node.find_tunnel_tls(key_file)
        server, client = otela_node.tunnel_tls(types.SimpleNamespace(tls_cert=cert, tls_key=tls_key, job_tls=None))
        listen_tls, connect_tls = (server, None) if tls == "listen" else (None, client)
    tls_name = {"server_hostname": "otela-cluster"} if connect_tls is not None else {}

    class Pipe(asyncio.Protocol):
        def __init__(self, peer=None):
            self.peer, self.transport, self.pending = peer, None, []

        def connection_made(self, transport):
            self.transport = transport
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def data_received(self, data):
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.write(data)
            else:
                self.pending.append(data)

        def connection_lost(self, exc):
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.close()

    class Front(Pipe):
        def __init__(self, engine_port):
            super().__init__()
            self.engine_port = engine_port
            self.buf = bytearray()

        def data_received(self, data):
            if not parse:
                return super().data_received(data)
            buf = self.buf
            buf += data
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                length = 0
                for line in bytes(buf[:end]).split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                if len(buf) < end + 4 + length:
                    return
                super().data_received(bytes(buf[:end + 4 + length]))
                del buf[:end + 4 + length]

        def connection_made(self, transport):
            super().connection_made(transport)
            asyncio.ensure_future(self.connect())

        async def connect(self):
            loop = asyncio.get_running_loop()
            _, back = await loop.create_connection(lambda: Pipe(self), "127.0.0.1", self.engine_port,
                                                   ssl=connect_tls, **tls_name)
            self.peer = back
            for data in self.pending:
                back.transport.write(data)
            self.pending = []

    async def main():
        loop = asyncio.get_running_loop()
        for listen, engine_port in routes.items():
            await loop.create_server(lambda p=engine_port: Front(p), "127.0.0.1", int(listen), ssl=listen_tls)
        print(json.dumps({"ready": True}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def bare_tls_key(tmp: str) -> str:
    """A cluster key with its tunnel certificate (keygen), for the bare pair's TLS hop."""
    folder = os.path.join(tmp, "bare-tls")
    subprocess.run([sys.executable, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", folder], check=True,
                   capture_output=True, timeout=60)
    return os.path.join(folder, "cluster.key")


def start_bare_pair(ports: dict, procs: list, key_file: str = "") -> tuple:
    """Two bare asyncio proxies in a row (front on CPU 0 as the ingress, back on CPU 1 as the
    node), the back one's port on TLS when `key_file` is given; the front's target."""
    front, back = {model: free_port() for model in ports}, {model: free_port() for model in ports}
    for routes, cpu, tls in (({back[m]: ports[m] for m in ports}, 1, "listen"),
                             ({front[m]: back[m] for m in ports}, 0, "connect")):
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(
            {"relay": {str(k): v for k, v in routes.items()}, "parse": True, "tls": tls if key_file else "",
             "key_file": key_file})], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        proc.stdout.readline()
        pin(proc.pid, cpu)
    return proc.pid, front, "none"


def start_bare_front(routes: dict, procs: list, key_file: str) -> tuple:
    """One bare asyncio proxy (CPU 0, as the ingress) in front of each model's node tunnel (TLS,
    the cluster's certificate beside `key_file`); the target."""
    front = {model: free_port() for model in routes}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(
        {"relay": {str(front[m]): routes[m] for m in routes}, "parse": True, "tls": "connect",
         "key_file": key_file})], stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    proc.stdout.readline()
    pin(proc.pid, 0)
    return proc.pid, front, "none"


NGINX_CONF = """worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;   # nginx closes a client connection after 1000 requests by default
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  {servers}
}}
"""
NGINX_SERVER = """upstream e{engine} {{ server 127.0.0.1:{engine}; keepalive 128; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{listen};
    location / {{
      proxy_pass http://e{engine}; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_request_buffering off; client_max_body_size 16m;
    }}
  }}"""


def start_nginx(tmp: str, routes: dict, procs: list):
    """nginx in front of the engines (listen port -> engine port); returns its worker's pid, or
    None when no nginx is installed."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if binary is None:
        return None
    conf = os.path.join(tmp, "nginx.conf")
    with open(conf, "w") as f:
        f.write(NGINX_CONF.format(tmp=tmp, servers="\n  ".join(
            NGINX_SERVER.format(listen=listen, engine=engine) for listen, engine in routes.items())))
    master = subprocess.Popen([binary, "-c", conf, "-p", tmp], stderr=subprocess.DEVNULL)
    procs.append(master)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", int(next(iter(routes)))), timeout=1).close()
            children = subprocess.run(["pgrep", "-P", str(master.pid)], capture_output=True,
                                      text=True).stdout.split()
            if children:
                return int(children[0])
        except OSError:
            pass
        time.sleep(0.1)
    return None


def collector_url() -> str:
    """A local OTLP collector that takes every batch (threads of this process): the endpoint of
    the traced ingress."""
    from test_ingress_support import Collector
    return f"http://127.0.0.1:{Collector(keep=False).port}"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def pin(pid: int, cpu: int) -> None:
    """Pin every thread of a process (the ingress's ledger writer too) to one CPU."""
    if not (os.cpu_count() and os.cpu_count() > 1):
        return
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")] if pid else [0]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, {cpu})
        except (AttributeError, OSError):
            pass


# -- clients ---------------------------------------------------------------------------------------
def request_bytes(model: str, key: str, stream: bool = False) -> bytes:
    body = json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "say hello to the benchmark"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer %s\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (key.encode(), len(body), body))


def read_response(sock: socket.socket, buf: bytearray) -> int:
    """Read one Content-Length response off a blocking socket; its status."""
    while True:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            length = int(_CONTENT_LENGTH.search(buf, 0, head_end).group(1))
            total = head_end + 4 + length
            if len(buf) >= total:
                status = int(buf[9:12])
                del buf[:total]
                return status
        data = sock.recv(262144)
        if not data:
            raise ConnectionError("closed")
        buf += data


def latency_run(port: int, model: str, key: str, n: int, rate: float = 16.0) -> list:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req, buf, out = request_bytes(model, key), bytearray(), []
    for _ in range(5):   # warm the connection and the pools
        sock.sendall(req)
        read_response(sock, buf)
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t0 = time.perf_counter()
        sock.sendall(req)
        read_response(sock, buf)
        out.append(time.perf_counter() - t0)
    sock.close()
    return out


class _Conn(asyncio.Protocol):
    def __init__(self, req: bytes, counter: list, stop_at: float):
        self.req, self.counter, self.stop_at = req, counter, stop_at
        self.buf = bytearray()
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.req)

    def data_received(self, data):
        buf = self.buf
        buf += data
        while True:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = int(_CONTENT_LENGTH.search(buf, 0, head_end).group(1))
            total = head_end + 4 + length
            if len(buf) < total:
                return
            del buf[:total]
            self.counter[0] += 1
            if time.perf_counter() >= self.stop_at:
                self.transport.close()
                return
            self.transport.write(self.req)

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(None)


async def _throughput(port, model, key, conns, seconds):
    counter = [0]
    loop = asyncio.get_running_loop()
    stop_at = time.perf_counter() + seconds
    protos = []
    for _ in range(conns):
        _, proto = await loop.create_connection(lambda: _Conn(request_bytes(model, key), counter, stop_at),
                                                "127.0.0.1", port)
        protos.append(proto)
    t0 = time.perf_counter()
    await asyncio.gather(*(p.done for p in protos))
    return counter[0], time.perf_counter() - t0


def throughput_run(port, model, key, conns, seconds):
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_throughput(port, model, key, conns, seconds))


async def _one_stream(port, req, ttfb_out):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(req)
    data = bytearray()
    first = None
    while not data.endswith(b"\r\n0\r\n\r\n"):
        piece = await reader.read(262144)
        if not piece:
            break
        data += piece
        if first is None and b"data: " in data:
            first = time.perf_counter() - t0
    writer.close()
    if ttfb_out is not None and first is not None:
        ttfb_out.append(first)
    return data.count(b"data: {")


async def _streams(port, model, key, concurrent, total_streams):
    req = request_bytes(model, key, stream=True)
    chunks = 0
    t0 = time.perf_counter()
    for _ in range(max(1, total_streams // concurrent)):
        chunks += sum(await asyncio.gather(*(_one_stream(port, req, None) for _ in range(concurrent))))
    return chunks, time.perf_counter() - t0


async def _ttfb(port, model, key, n):
    req = request_bytes(model, key, stream=True)
    out = []
    await _one_stream(port, req, [])   # warm
    for _ in range(n):
        await _one_stream(port, req, out)
    return out


def h11_reference_us(n: int = 3000) -> float:
    """CPU time of h11's own work for one proxied request on this machine (parse the request,
    send it upstream, parse the response, send it back): the issue quotes ~110 us for it, so
    the ratio tells how much slower (or busier) this machine is than the reference one."""
    import h11
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: b\r\nauthorization: Bearer k\r\n"
           b"content-type: application/json\r\ncontent-length: 100\r\n\r\n" + b"x" * 100)
    resp = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 300\r\n\r\n" + b"y" * 300
    srv, cli = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    t0 = time.process_time()
    for _ in range(n):
        srv.receive_data(req)
        srv.next_event()
        body = srv.next_event()
        srv.next_event()
        cli.send(h11.Request(method=b"POST", target=b"/v1/chat/completions",
                             headers=[(b"host", b"e"), (b"content-length", b"100")]))
        cli.send(h11.Data(data=body.data))
        cli.send(h11.EndOfMessage())
        cli.receive_data(resp)
        head = cli.next_event()
        data = cli.next_event()
        cli.next_event()
        srv.send(h11.Response(status_code=head.status_code, headers=[(b"content-length", b"300")]))
        srv.send(h11.Data(data=data.data))
        srv.send(h11.EndOfMessage())
        srv.start_next_cycle()
        cli.start_next_cycle()
    return (time.process_time() - t0) / n * 1e6


def start_overlay(tmp: str, models: dict, flags: dict, procs: list, root: str = ROOT) -> tuple:
    """`otela_ingress.py serve` plus one `otela_node.py start` per model, each wrapping a fake
    engine: the real path (of the checkout in `root`). Returns (ingress pid, port, key, [node
    pids], {model: its node's tunnel port})."""
    from test_ingress_support import Client
    py = sys.executable
    subprocess.run([py, os.path.join(root, "otela_node.py"), "keygen", "--out", tmp], check=True,
                   capture_output=True, timeout=60)
    key_file, db = os.path.join(tmp, "cluster.key"), os.path.join(tmp, "overlay.sqlite")
    key = subprocess.run([py, os.path.join(root, "otela_ingress.py"), "keys", "create", "--user", "bench",
                          "--db", db], check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    port, gossip = free_port(), free_port()
    ingress = subprocess.Popen([py, os.path.join(root, "otela_ingress.py"), "serve", "--key-file", key_file,
                                "--listen", f"127.0.0.1:{port}", "--gossip", f"127.0.0.1:{gossip}",
                                "--db", db], stderr=subprocess.DEVNULL)
    procs.append(ingress)
    pin(ingress.pid, 0)
    side, listens = [], {}
    for model, engine_port in models.items():
        grant = os.path.join(tmp, f"{engine_port}.grant")   # the login node's grant for each job
        subprocess.run([py, os.path.join(root, "otela_ingress.py"), "grant", "--key-file", key_file, "--model", model,
                        "--out", grant], check=True, capture_output=True, timeout=60)
        listens[model] = free_port()
        node = subprocess.Popen([py, os.path.join(root, "otela_node.py"), "start", "--key-file", key_file,
                                 "--grant-file", grant,
                                 "--bootstrap", f"127.0.0.1:{gossip}", "--listen", f"127.0.0.1:{listens[model]}",
                                 "--gossip", f"127.0.0.1:{free_port()}", "--log-level", "WARNING",
                                 "--process", f"{py} {os.path.join(HERE, 'fake_engine.py')} --port {engine_port} "
                                              f"--model {model} {flags[model]}",
                                 "--engine-url", f"http://127.0.0.1:{engine_port}"], stderr=subprocess.DEVNULL)
        procs.append(node)
        side.append(node.pid)
    deadline = time.monotonic() + 60
    while True:
        try:
            listing = json.loads(Client(f"http://127.0.0.1:{port}", key).request("GET", "/v1/models")[2])
            if sorted(m["id"] for m in listing.get("data", [])) == sorted(models):
                break
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the overlay did not come up within 60 s")
        time.sleep(0.2)
    for pid in side:
        pin(pid, 1)
    return ingress.pid, port, key, side, listens


def failure_runs(procs: list, tmp: str, quick: bool) -> dict:
    """The issue's failure cases, through an ingress (uvloop) in front of fake engines:
    one of two engines answering 500 while healthy, one of two killed with SIGKILL mid-run (both
    at 16 requests/s on one keep-alive connection: client errors, and what a retried request
    costs against one answered first time, from the ledger's latencies), and an engine that dies
    mid-stream (how many streams end with an error event and [DONE])."""
    import sqlite3
    good, bad, victim, cut = free_port(), free_port(), free_port(), free_port()
    procs.append(spawn_fake_engine(good, "--chunks", "8"))
    procs.append(spawn_fake_engine(bad, "--chunks", "8", "--mode", "error500"))
    victim_proc = spawn_fake_engine(victim, "--chunks", "8")
    procs.append(victim_proc)
    procs.append(spawn_fake_engine(cut, "--chunks", "10", "--mode", "cut"))
    for proc in procs[-4:]:
        pin(proc.pid, 1)
    db = os.path.join(tmp, "ledger-failures.sqlite")
    spec = json.dumps({"engines": {"half500": [good, bad], "killed": [good, victim], "cut": cut},
                       "uvloop": True, "db": db})
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", spec], stdout=subprocess.PIPE,
                            text=True)
    procs.append(proc)
    info = json.loads(proc.stdout.readline())
    pin(proc.pid, 0)
    port, key = info["port"], info["key"]
    seconds = 4.0 if quick else 15.0
    out = {}

    def paced(model, on_tick=None):
        sock = socket.create_connection(("127.0.0.1", port))
        req, buf, errors, sent = request_bytes(model, key), bytearray(), 0, 0
        start = time.perf_counter()
        try:
            while time.perf_counter() - start < seconds:
                if on_tick is not None:
                    on_tick(time.perf_counter() - start)
                sock.sendall(req)
                status = read_response(sock, buf)
                errors += status != 200
                sent += 1
                time.sleep(max(0.0, start + sent / 16.0 - time.perf_counter()))
        finally:
            sock.close()
        return sent, errors

    def retry_cost(model):
        time.sleep(0.6)   # the ledger commits every 250 ms
        db_conn = sqlite3.connect(db)
        try:
            rows = db_conn.execute("SELECT attempts, latency_ms FROM requests WHERE model = ? AND status = 200",
                                   (model,)).fetchall()
        finally:
            db_conn.close()
        first = [lat for attempts, lat in rows if attempts == 1]
        retried = [lat for attempts, lat in rows if attempts > 1]
        return len(retried), (statistics.median(retried) - statistics.median(first)) if retried and first else None

    sent, errors = paced("half500")
    retried, cost = retry_cost("half500")
    out["one_engine_500"] = {"requests": sent, "client_errors": errors, "retried": retried,
                             "added_ms_per_retried_request": cost}
    killed = []

    def kill_at_one_second(t):
        if t > 1.0 and not killed:
            victim_proc.kill()
            killed.append(t)

    sent, errors = paced("killed", kill_at_one_second)
    retried, cost = retry_cost("killed")
    out["one_engine_killed"] = {"requests": sent, "client_errors": errors, "retried": retried,
                                "added_ms_per_retried_request": cost}
    streams, with_event = 20, 0
    for _ in range(streams):
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            sock.sendall(request_bytes("cut", key, stream=True))
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                piece = sock.recv(65536)
                if not piece:
                    break
                data += piece
        finally:
            sock.close()
        with_event += b'"code":"stream_cut"' in data and b"data: [DONE]" in data and data.endswith(b"0\r\n\r\n")
    out["engine_dies_mid_stream"] = {"streams": streams, "ended_with_error_event_and_done": with_event}
    return out


def _pids_of_port(port: int) -> list:
    from test_ingress_support import pids_listening_on
    return pids_listening_on(port)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


# -- one config, one round -------------------------------------------------------------------------
def measure_config(target: tuple, n_latency: int, tput_seconds: float, n_ttfb: int, stream_rounds: int) -> dict:
    """Latency (16 req/s, back to back, the sweep rates), throughput and SSE of one target, once."""
    pid, target_ports, key = target
    r = {}
    fast_port, paced_port, bulk_port = (target_ports[m] for m in ("fast", "paced", "bulk"))
    # 1. latency at 16 req/s, one keep-alive connection
    lat = latency_run(fast_port, "fast", key, n_latency)
    r["latency_p50_ms"] = statistics.median(lat) * 1e3
    r["latency_p99_ms"] = pct(lat, 99) * 1e3
    # 1b. the same back to back: the hop's own work, without a CPU waking from idle
    busy = latency_run(fast_port, "fast", key, n_latency * 5, rate=1e9)
    r["busy_latency_p50_ms"] = statistics.median(busy) * 1e3
    # 1c. at 100 and 1000 requests/s: how the cost of a request grows with the idle time
    # before it (caches and TLBs gone cold), which 16 req/s leaves at ~62 ms
    for rate in SWEEP_RATES:
        lat = latency_run(fast_port, "fast", key, n_latency * (5 if rate >= 1000 else 1), rate=rate)
        r[f"latency_p50_ms_at_{rate}rps"] = statistics.median(lat) * 1e3
    # 2. throughput at 64 connections
    cpu0 = cpu_seconds(pid) if pid else 0.0
    done, elapsed = throughput_run(fast_port, "fast", key, 64, tput_seconds)
    r["rps_64conn"] = done / elapsed
    if pid:
        r["cpu_us_per_request"] = (cpu_seconds(pid) - cpu0) / done * 1e6
        r["ingress_cpu_utilisation"] = (cpu_seconds(pid) - cpu0) / elapsed
    # 3. SSE: time to first chunk on a paced stream; chunks/s across 16 streams
    ttfb = asyncio.run(_ttfb(paced_port, "paced", key, n_ttfb))
    r["ttfb_p50_ms"] = statistics.median(ttfb) * 1e3
    cpu0 = cpu_seconds(pid) if pid else 0.0
    chunks, elapsed = asyncio.run(_streams(bulk_port, "bulk", key, 16, stream_rounds))
    r["sse_chunks_per_s_16streams"] = chunks / elapsed
    if pid:
        r["cpu_us_per_chunk"] = (cpu_seconds(pid) - cpu0) / max(1, chunks) * 1e6
    return r


def nginx_ratios(per_round: dict) -> dict:
    """config -> the median over rounds of its ratio to nginx's figure of the same round: added p50
    (lower is better, the target is <= 1.2), req/s and SSE chunks/s (higher is better, >= 1)."""
    direct, nginx = per_round["direct"], per_round["nginx"]
    out = {}
    for name, rounds in per_round.items():
        if name in ("direct", "nginx") or not rounds:
            continue
        added, rps, sse = [], [], []
        for r, d, n in zip(rounds, direct, nginx):
            nginx_added = n["latency_p50_ms"] - d["latency_p50_ms"]
            if nginx_added > 0:
                added.append((r["latency_p50_ms"] - d["latency_p50_ms"]) / nginx_added)
            rps.append(r["rps_64conn"] / n["rps_64conn"])
            sse.append(r["sse_chunks_per_s_16streams"] / n["sse_chunks_per_s_16streams"])
        out[name] = {"added_p50": statistics.median(added) if added else None,
                     "rps_64conn": statistics.median(rps), "sse_chunks_per_s_16streams": statistics.median(sse)}
    return out


def floor_ratios(per_round: dict, floor: str) -> dict:
    """Each whole path's added p50 over the floor's of the same round, the median over rounds (a
    noisy machine's load moves both alike)."""
    out = {}
    for name in ("ingress+node", "before: ingress+node", "bare-asyncio + node", "before: bare-asyncio + node"):
        ratios = []
        for r, d, f in zip(per_round.get(name, []), per_round["direct"], per_round[floor]):
            if f["latency_p50_ms"] > d["latency_p50_ms"]:
                ratios.append((r["latency_p50_ms"] - d["latency_p50_ms"]) / (f["latency_p50_ms"] - d["latency_p50_ms"]))
        if ratios:
            out[name] = statistics.median(ratios)
    return out


# -- the run ---------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="short run (~30 s)")
    parser.add_argument("--no-node", action="store_true", help="skip the whole path through otela_node")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every config N times in rotating order; medians and per-round ratios")
    parser.add_argument("--before", metavar="DIR",
                        help="a checkout of an earlier commit: its ingress measured beside this one")
    parser.add_argument("--only", metavar="NAMES",
                        help="measure only these configs (comma-separated; 'direct' always), no failure runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    before = os.path.join(args.before, "tests", "bench_ingress.py") if args.before else None
    if before is not None and not os.path.isfile(before):
        parser.error(f"--before: {before} does not exist")
    if args.child:
        spec = json.loads(args.child)
        if spec.get("relay"):
            relay_child(spec["relay"], spec.get("parse", False), spec.get("tls", ""), spec.get("key_file", ""))
        else:
            child(spec["engines"], spec["uvloop"], spec["db"], spec.get("otlp"))
        return 0
    quick = args.quick
    n_latency = 80 if quick else 400
    tput_seconds = 2.0 if quick else 6.0
    n_ttfb = 20 if quick else 100
    bulk_chunks = 500 if quick else 1000
    stream_rounds = 16 if quick else 64

    procs = []
    tmp = tempfile.mkdtemp(prefix="otela-bench-")
    h11_us = h11_reference_us()
    results = {"machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0],
                           "h11_proxied_request_us": h11_us, "h11_reference_us": 110.0,
                           "slowdown_vs_reference": h11_us / 110.0},
               "quick": quick, "configs": {}}
    try:
        ports = {"fast": free_port(), "paced": free_port(), "bulk": free_port()}
        procs.append(spawn_fake_engine(ports["fast"], "--chunks", "8"))
        procs.append(spawn_fake_engine(ports["paced"], "--chunks", "10", "--chunk-delay", "0.005"))
        procs.append(spawn_fake_engine(ports["bulk"], "--chunks", str(bulk_chunks)))
        engine_pids = [p.pid for p in procs]
        for pid in engine_pids:
            pin(pid, 1)
        pin(0, 1)
        ingresses = {}
        runs = [("ingress+uvloop", os.path.abspath(__file__), True),
                ("ingress+asyncio", os.path.abspath(__file__), False),
                ("ingress+uvloop+otlp", os.path.abspath(__file__), True)]   # tracing on: the cost of spans
        if before is not None:   # the earlier checkout's own child, with its own otela_ingress
            runs.append(("before+uvloop", os.path.abspath(before), True))
        for name, script, use_uvloop in runs:
            spec = json.dumps({"engines": ports, "uvloop": use_uvloop, "db": os.path.join(tmp, f"ledger-{name}.sqlite"),
                               "otlp": collector_url() if name.endswith("+otlp") else None})
            proc = subprocess.Popen([sys.executable, script, "--child", spec],
                                    stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            info = json.loads(proc.stdout.readline())
            pin(proc.pid, 0)
            ingresses[name] = (proc.pid, info["port"], info["key"])
        every = {model: port for model, port in ports.items()}
        targets = {"direct": (None, every, "none")}
        targets.update({name: (pid, {model: port for model in ports}, key)
                        for name, (pid, port, key) in ingresses.items()})
        # peers, for scale: the floor of a proxy hop here (bytes copied unread), the floor of a
        # Python HTTP proxy (requests read by hand, nothing else), and nginx when installed
        for name, parse in (("tcp-relay", False), ("bare-asyncio", True)):
            relay_ports = {model: free_port() for model in ports}
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(
                {"relay": {str(relay_ports[model]): ports[model] for model in ports}, "parse": parse})],
                stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            proc.stdout.readline()
            pin(proc.pid, 0)
            targets[name] = (proc.pid, relay_ports, "none")
        if not args.no_node:   # the floor of the whole path's two Python hops: two bare proxies in a row,
            # and the same with the second hop on TLS as the node's tunnel is (its certificate, its contexts)
            key_file = bare_tls_key(tmp)
            for name, tls in (("bare-asyncio x2", False), ("bare-asyncio x2 + TLS", True)):
                targets[name] = start_bare_pair(ports, procs, key_file if tls else "")
        nginx_ports = {model: free_port() for model in ports}
        worker = start_nginx(tmp, {nginx_ports[model]: ports[model] for model in ports}, procs)
        if worker is not None:
            pin(worker, 0)
            targets["nginx"] = (worker, nginx_ports, "none")
        if not args.no_node:
            flags = {"fast": "--chunks 8", "paced": "--chunks 10 --chunk-delay 0.005",
                     "bulk": f"--chunks {bulk_chunks}"}
            overlays = [("ingress+node", ROOT)] + ([("before: ingress+node", args.before)] if before else [])
            for name, root in overlays:   # with --before, that checkout's whole path too
                node_engines = {model: free_port() for model in flags}
                folder = os.path.join(tmp, f"overlay-{len(targets)}")
                pid, port, key, _, listens = start_overlay(folder, node_engines, flags, procs, os.path.abspath(root))
                targets[name] = (pid, {model: port for model in ports}, key)
                # the node's hop alone: the bare front proxy (CPU 0) dials the same nodes' tunnels
                # over TLS with the cluster's certificate, so this less "bare-asyncio x2 + TLS" is
                # what the node adds over a bare Python hop on TLS
                targets[name.replace("ingress+node", "bare-asyncio + node")] = start_bare_front(
                    listens, procs, os.path.join(folder, "cluster.key"))
                for engine_port in node_engines.values():
                    for engine_pid in _pids_of_port(engine_port):
                        pin(engine_pid, 1)

        # --rounds N: every config is measured N times, in an order that rotates each round, so
        # a burst of load elsewhere on the machine falls on different configs in different rounds;
        # each figure is the median of its rounds, and the ratios to nginx are taken per round
        # (against nginx's figure of the same round) before their median is taken
        names = list(targets)
        if args.only:
            names = [name for name in names if name == "direct" or name in args.only.split(",")]
        per_round = {name: [] for name in names}
        for round_no in range(args.rounds):
            for name in names[round_no % len(names):] + names[:round_no % len(names)]:
                per_round[name].append(measure_config(targets[name], n_latency, tput_seconds, n_ttfb,
                                                      stream_rounds))
        for name in names:
            rounds = per_round[name]
            if not rounds:
                continue
            results["configs"][name] = {col: statistics.median(r[col] for r in rounds) for col in rounds[0]}
            if args.rounds > 1:
                results["configs"][name]["rounds"] = rounds
        direct = results["configs"]["direct"]
        for name in results["configs"]:
            if name == "direct":
                continue
            r = results["configs"][name]
            r["added_p50_ms"] = r["latency_p50_ms"] - direct["latency_p50_ms"]
            r["added_p99_ms"] = r["latency_p99_ms"] - direct["latency_p99_ms"]
            r["added_ttfb_ms"] = r["ttfb_p50_ms"] - direct["ttfb_p50_ms"]
            r["busy_added_p50_ms"] = r["busy_latency_p50_ms"] - direct["busy_latency_p50_ms"]
            for rate in SWEEP_RATES:
                r[f"added_p50_ms_at_{rate}rps"] = (r[f"latency_p50_ms_at_{rate}rps"]
                                                   - direct[f"latency_p50_ms_at_{rate}rps"])
            if "cpu_us_per_request" in r:
                r["cpu_us_per_request_normalised"] = r["cpu_us_per_request"] / results["machine"][
                    "slowdown_vs_reference"]
        if per_round.get("nginx"):
            results["ratios_to_nginx"] = nginx_ratios(per_round)
        on, off = results["configs"].get("ingress+uvloop+otlp"), results["configs"].get("ingress+uvloop")
        results["tracing_cost"] = {col: on[col] / off[col] for col in ("added_p50_ms", "added_p99_ms", "rps_64conn",
                                                                       "cpu_us_per_request")
                                   if on and off and off.get(col)}
        if per_round.get("bare-asyncio x2 + TLS"):
            results["ratios_to_tls_floor"] = floor_ratios(per_round, "bare-asyncio x2 + TLS")
        results["rounds"] = args.rounds
        results["failures"] = {} if args.only else failure_runs(procs, tmp, quick)
        results["machine"]["loadavg_end"] = os.getloadavg()[0]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    cols = ["latency_p50_ms", "latency_p99_ms", "added_p50_ms", "added_p99_ms",
            *(f"added_p50_ms_at_{rate}rps" for rate in SWEEP_RATES), "busy_added_p50_ms", "rps_64conn",
            "cpu_us_per_request", "cpu_us_per_request_normalised", "ingress_cpu_utilisation", "ttfb_p50_ms", "added_ttfb_ms",
            "sse_chunks_per_s_16streams", "cpu_us_per_chunk"]
    print(f"{'':28}" + "".join(f"{name:>18}" for name in results["configs"]))
    for col in cols:
        cells = []
        for r in results["configs"].values():
            v = r.get(col)
            cells.append(f"{v:18.3f}" if isinstance(v, float) and v < 100 else
                         (f"{v:18.0f}" if isinstance(v, float) else f"{'-':>18}"))
        print(f"{col:28}" + "".join(cells))
    for case, figures in results["failures"].items():
        print(f"failures, {case}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in figures.items()))
    for name, ratios in results.get("ratios_to_nginx", {}).items():
        added = ratios["added_p50"]
        print(f"vs nginx, median of {args.rounds} per-round ratios, {name}: added p50 "
              + (f"{added:.2f}x" if added is not None else "-") + f" (target <= 1.2), "
              f"req/s {ratios['rps_64conn']:.2f}x, SSE chunks/s {ratios['sse_chunks_per_s_16streams']:.2f}x "
              "(targets >= 1)")
    print("tracing on (--otlp-endpoint, a collector that answers) / off, same run: " + ", ".join(
        f"{col} {ratio:.2f}x" for col, ratio in results["tracing_cost"].items()))
    whole, floor = results["configs"].get("ingress+node"), results["configs"].get("bare-asyncio x2")
    tls_floor, nginx = results["configs"].get("bare-asyncio x2 + TLS"), results["configs"].get("nginx")
    if whole and tls_floor:   # (--only may leave the floor without TLS out)
        print(f"whole path (ingress, TLS, node): added p50 {whole['added_p50_ms']:.3f} ms, p99 "
              f"{whole['added_p99_ms']:.3f} ms (target <= 0.6 / 1.5 ms); floors of two Python hops here (two bare "
              "asyncio proxies in a row): "
              + (f"{floor['added_p50_ms']:.3f} / {floor['added_p99_ms']:.3f} ms, " if floor else "") +
              f"with the second hop on TLS as the tunnel {tls_floor['added_p50_ms']:.3f} / {tls_floor['added_p99_ms']:.3f} ms "
              f"(whole path {whole['added_p50_ms'] / max(tls_floor['added_p50_ms'], 1e-9):.2f}x the TLS floor at "
              "p50" + (f"; nginx's single hop {nginx['added_p50_ms']:.3f} ms" if nginx else "") + ")")
        for name, ratio in results.get("ratios_to_tls_floor", {}).items():
            print(f"{name}: added p50 over the TLS floor's, median of {args.rounds} per-round ratios: {ratio:.2f}x")
        for prefix in ("", "before: "):   # where the excess over the floor is: the node's hop, the ingress's
            node_hop, path = (results["configs"].get(prefix + name) for name in ("bare-asyncio + node", "ingress+node"))
            if node_hop and path:
                print(f"{prefix}bare-asyncio + node (a bare proxy in front of the node): added p50 "
                      f"{node_hop['added_p50_ms']:.3f} ms, p99 {node_hop['added_p99_ms']:.3f} ms: the node adds "
                      f"{node_hop['added_p50_ms'] - tls_floor['added_p50_ms']:+.3f} ms at p50 over the bare TLS hop, "
                      f"the ingress {path['added_p50_ms'] - node_hop['added_p50_ms']:+.3f} ms over the bare front hop")
        earlier = results["configs"].get("before: ingress+node")
        if earlier:
            print(f"whole path of --before: added p50 {earlier['added_p50_ms']:.3f} ms, p99 "
                  f"{earlier['added_p99_ms']:.3f} ms ({earlier['added_p50_ms'] / max(tls_floor['added_p50_ms'], 1e-9):.2f}x "
                  "the TLS floor at p50)")
    m = results["machine"]
    print(f"machine: {m['cpus']} CPUs, load average {m['loadavg_start']:.2f} -> {m['loadavg_end']:.2f}; h11's own "
          f"work per proxied request {m['h11_proxied_request_us']:.0f} us (reference machine: 110 us), so CPU "
          f"figures here are x{m['slowdown_vs_reference']:.2f} the reference ('normalised' divides by it)")
    print("targets (ingress hop): added p50 <= 0.3 ms, p99 <= 1 ms; >= 6000 req/s at <= 170 us/request; "
          ">= 60000 chunks/s at <= 15 us/chunk; added TTFB <= 0.3 ms")
    results["targets"] = TARGETS
    results["peers"] = PEERS
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ingress.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
