"""Benchmark of the ingress hop (and the whole path through a node when otela_node can run one).

Against tests/fake_engine.py on loopback, in one run, straight to the engine vs through the
ingress, with and without uvloop in the ingress:
  - latency: p50/p99 of non-streamed chat completions at 16 requests/s on one keep-alive
    connection; "added" = through the ingress minus straight to the engine;
  - throughput: requests/s at 64 keep-alive connections, the ingress pinned to CPU 0 (engine and
    client share CPU 1), and the ingress's CPU time per request (from /proc);
  - SSE: added time to the first chunk of a paced stream, chunks/s across 16 concurrent streams
    and the ingress's CPU time per chunk.

Prints a table and writes JSON to <--out DIR>/ingress.json. Never asserts on time.
Usage: python tests/bench_ingress.py [--out bench-results] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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
_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.I)


# -- the ingress under test, in its own process ----------------------------------------------------
def child(engines: dict, use_uvloop: bool, db: str) -> None:
    """Run an ingress with a stand-in node whose registry names the given engines."""
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
            node.add_worker(f"127.0.0.1:{port}", [model])
        db_conn = otela_ingress.open_db(db)
        _, key = otela_ingress.create_key(db_conn, "bench")
        db_conn.close()
        ingress = otela_ingress.Ingress(node, db_path=db)
        port = await ingress.start("127.0.0.1", 0)
        print(json.dumps({"port": port, "key": key}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def pin(pid: int, cpu: int) -> None:
    try:
        if os.cpu_count() and os.cpu_count() > 1:
            os.sched_setaffinity(pid, {cpu})
    except (AttributeError, OSError):
        pass


# -- clients ---------------------------------------------------------------------------------------
def request_bytes(model: str, key: str, stream: bool = False) -> bytes:
    body = json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "say hello to the benchmark"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer %s\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (key.encode(), len(body), body))


def read_response(sock: socket.socket, buf: bytearray) -> None:
    """Read one Content-Length response off a blocking socket."""
    while True:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            length = int(_CONTENT_LENGTH.search(buf, 0, head_end).group(1))
            total = head_end + 4 + length
            if len(buf) >= total:
                del buf[:total]
                return
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


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


# -- the run ---------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="short run (~30 s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        child(spec["engines"], spec["uvloop"], spec["db"])
        return 0
    quick = args.quick
    n_latency = 80 if quick else 400
    tput_seconds = 2.0 if quick else 6.0
    n_ttfb = 20 if quick else 100
    bulk_chunks = 500 if quick else 1000
    stream_rounds = 16 if quick else 64

    procs = []
    tmp = tempfile.mkdtemp(prefix="otela-bench-")
    results = {"machine": {"cpus": os.cpu_count()}, "quick": quick, "configs": {}}
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
        for use_uvloop in (True, False):
            spec = json.dumps({"engines": ports, "uvloop": use_uvloop,
                               "db": os.path.join(tmp, f"ledger-{int(use_uvloop)}.sqlite")})
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", spec],
                                    stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            info = json.loads(proc.stdout.readline())
            pin(proc.pid, 0)
            ingresses["ingress+uvloop" if use_uvloop else "ingress+asyncio"] = (proc.pid, info["port"],
                                                                                info["key"])
        targets = {"direct": (None, None, "none")}
        targets.update({name: (pid, port, key) for name, (pid, port, key) in ingresses.items()})

        for name, (pid, port, key) in targets.items():
            r = results["configs"][name] = {}
            fast_port = port or ports["fast"]
            paced_port = port or ports["paced"]
            bulk_port = port or ports["bulk"]
            # 1. latency at 16 req/s, one keep-alive connection
            lat = latency_run(fast_port, "fast", key, n_latency)
            r["latency_p50_ms"] = statistics.median(lat) * 1e3
            r["latency_p99_ms"] = pct(lat, 99) * 1e3
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
        direct = results["configs"]["direct"]
        for name in ingresses:
            r = results["configs"][name]
            r["added_p50_ms"] = r["latency_p50_ms"] - direct["latency_p50_ms"]
            r["added_p99_ms"] = r["latency_p99_ms"] - direct["latency_p99_ms"]
            r["added_ttfb_ms"] = r["ttfb_p50_ms"] - direct["ttfb_p50_ms"]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)

    cols = ["latency_p50_ms", "latency_p99_ms", "added_p50_ms", "added_p99_ms", "rps_64conn",
            "cpu_us_per_request", "ingress_cpu_utilisation", "ttfb_p50_ms", "added_ttfb_ms",
            "sse_chunks_per_s_16streams", "cpu_us_per_chunk"]
    print(f"{'':28}" + "".join(f"{name:>18}" for name in results["configs"]))
    for col in cols:
        cells = []
        for r in results["configs"].values():
            v = r.get(col)
            cells.append(f"{v:18.3f}" if isinstance(v, float) and v < 100 else
                         (f"{v:18.0f}" if isinstance(v, float) else f"{'-':>18}"))
        print(f"{col:28}" + "".join(cells))
    print("targets (ingress hop): added p50 <= 0.3 ms, p99 <= 1 ms; >= 6000 req/s at <= 170 us/request; "
          ">= 60000 chunks/s at <= 15 us/chunk; added TTFB <= 0.3 ms")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ingress.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
