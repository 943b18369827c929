"""Overlay benchmarks: figures, not assertions.

Real node processes and real UDP sockets on loopback. 128 Python processes do not fit a 2-core
box, so each worker process hosts many `otela_node.Node` objects, every one with its own UDP and
TCP sockets and its own protocol state (the victim of the kill -9 test is alone in its
process). All processes share the machine's clock, so a write's arrival time at each node is
comparable with the time it was written.

    python tests/bench_node.py [--quick] [--out bench-results]

Phases: idle gossip bytes/s per node at 10, 50 and 128 nodes; convergence of 20 writes to 128
nodes; detection of a kill -9 at 128 nodes (suspected and LEFT at every peer); churn (10 nodes
re-registering every 3 s); false evictions among 64 idle nodes while other processes saturate
both CPUs (10 minutes; 20 s with --quick); the in-process simulator at 1,000 members; the
tunnel (the node's --listen port forwarding to a fake engine, node only): added latency, req/s,
SSE chunks/s and the node's CPU per request and per chunk.
Writes <out>/node.json.
"""
import argparse
import asyncio
import hashlib
import hmac
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import simnet  # noqa: E402

import crdt  # noqa: E402
import otela_node as on  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Worker process: many nodes, driven by JSON lines on stdin, answering on stdout
# ---------------------------------------------------------------------------------------------
class Host:
    def __init__(self, nodes):
        self.nodes = nodes
        self.arrivals = [dict() for _ in nodes]     # per node: tag -> time first seen
        self.watched = None
        self.suspected = [None] * len(nodes)
        self.left = [None] * len(nodes)
        self.suspicions = 0
        self.churn_task = None
        for i, node in enumerate(nodes):
            node.on_change(lambda sid, rec, i=i: self.changed(i, sid, rec))

    def changed(self, i, sid, rec):
        now = time.time()
        if rec is None:
            return
        tag = (rec.get("labels") or {}).get("w")
        if tag is not None and tag not in self.arrivals[i]:
            self.arrivals[i][tag] = now
        if self.nodes[i].is_suspected(sid):
            self.suspicions += 1
        if sid == self.watched:
            if self.suspected[i] is None and (self.nodes[i].is_suspected(sid) or rec["state"] == crdt.LEFT):
                self.suspected[i] = now
            if self.left[i] is None and rec["state"] == crdt.LEFT:
                self.left[i] = now

    async def handle(self, cmd):
        op = cmd["cmd"]
        if op == "addr":
            return {"addr": self.nodes[0].overlay.addr}
        if op == "live":
            return {"min": min(len(n.registry.live()) for n in self.nodes)}
        if op == "write":
            node = self.nodes[cmd["node"]]
            t = time.time()
            node.update(labels={"w": cmd["tag"]})
            return {"t": t, "sid": node.session_id}
        if op == "arrivals":
            return {"arrivals": self.arrivals}
        if op == "bytes":
            return {"sent": sum(n.bytes_sent for n in self.nodes), "count": len(self.nodes),
                    "lhm": [n.overlay.lhm for n in self.nodes]}
        if op == "sessions":
            return {"sessions": [n.session_id for n in self.nodes]}
        if op == "watch":
            self.watched = cmd["sid"]
            return {}
        if op == "detect":
            return {"suspected": self.suspected, "left": self.left}
        if op == "churn":
            self.churn_task = asyncio.ensure_future(self.churn(cmd["period"]))
            return {}
        if op == "evictions":
            evicted = set()
            for n in self.nodes:
                evicted |= {sid for sid, r in n.registry.items() if r.get("evicted_by")}
            return {"evicted": sorted(evicted), "suspicions": self.suspicions}
        if op == "quit":
            if self.churn_task:
                self.churn_task.cancel()
            for n in self.nodes:
                await n.stop(leave=False)
            return {"bye": True}
        raise ValueError(op)

    async def churn(self, period):
        """Each node re-registers (new session, old one LEFT) every `period` s, staggered."""
        start = time.monotonic()
        k = 0
        while True:
            i = k % len(self.nodes)
            when = start + period * (k // len(self.nodes)) + period * i / len(self.nodes)
            await asyncio.sleep(max(0.0, when - time.monotonic()))
            self.nodes[i].rejoin(state=crdt.SERVING)
            k += 1


async def worker(args):
    key = on.load_key(args.key_file)
    cfg = on.config_from_env(on.Config(key=key, listen="127.0.0.1:0", gossip="127.0.0.1:0"))
    cfg.bootstrap = [args.bootstrap] if args.bootstrap else []
    nodes = []
    for i in range(args.count):
        node = on.Node(cfg, role="worker", models=["bench-model"],
                       hardware={"gpu": "H100", "count": 8, "memory_gb": 80}, labels={"i": str(i)})
        await node.start(serve_http=False)
        await asyncio.sleep(args.stagger)            # joins arrive as a stream, not one burst
        if not cfg.bootstrap:                        # the first node seeds the others
            cfg.bootstrap = [node.overlay.addr]
        nodes.append(node)
    host = Host(nodes)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def reader():
        for line in sys.stdin:
            cmd = json.loads(line)
            result = asyncio.run_coroutine_threadsafe(host.handle(cmd), loop).result()
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()
            if cmd["cmd"] == "quit":
                break
        loop.call_soon_threadsafe(done.set)

    threading.Thread(target=reader, daemon=True).start()
    await done.wait()


class Worker:
    def __init__(self, count, key_file, bootstrap=None, stagger=0.05):
        # Each join costs the cluster ~N x fanout x retransmits datagrams; 128 nodes share two
        # CPUs here (one per machine in real life), so joins are paced to keep the loops live.
        argv = [sys.executable, __file__, "--worker", "--count", str(count), "--key-file", key_file,
                "--stagger", str(stagger)]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        self.count = count
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, cmd, **kw):
        kw["cmd"] = cmd
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.poll()})")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------
# Coordinator
# ---------------------------------------------------------------------------------------------
def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summary_ms(values):
    return {k: (round(pct(values, q) * 1000, 2) if values else None)
            for k, q in (("p50", 50), ("p75", 75), ("p95", 95), ("p99", 99), ("max", 100))}


def wait_live(workers, n, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(w.call("live")["min"] >= n for w in workers):
            return True
        time.sleep(0.5)
    return False


def idle_bytes(workers, window):
    before = sum(w.call("bytes")["sent"] for w in workers)
    time.sleep(window)
    after = sum(w.call("bytes")["sent"] for w in workers)
    n = sum(w.count for w in workers)
    return (after - before) / n / window


def cluster_phases(key_file, quick, results):
    window = 6 if quick else 20
    workers = [Worker(10, key_file)]
    try:
        seed = workers[0].call("addr")["addr"]
        idle = {}
        for target, sizes in ((10, []), (50, [40]), (128, [39, 38])):
            for size in sizes:
                workers.append(Worker(size, key_file, seed, stagger=0.1 if target < 128 else 0.3))
            if target == 128:
                victim = Worker(1, key_file, seed)
                workers.append(victim)
            ok = wait_live(workers, target)
            time.sleep(3)                            # let join rumours and push-pull finish
            idle[target] = round(idle_bytes(workers, window) / 1000, 3)
            evicted = set()
            for w in workers:
                evicted |= set(w.call("evictions")["evicted"])
            print(f"idle gossip at {target:>3} nodes: {idle[target]:.3f} KB/s per node sent"
                  f"{'' if ok else ' (NOT CONVERGED)'}; {len(evicted)} evictions so far", flush=True)
            results.setdefault("join_phase_evictions", {})[target] = len(evicted)
        results["idle_kbps_per_node"] = idle

        # convergence of writes at 128 nodes
        writes = 10 if quick else 20
        hosts = [w for w in workers if w is not victim]
        written = []
        rng = random.Random(1)
        for k in range(writes):
            wi = rng.randrange(len(hosts))
            ni = rng.randrange(hosts[wi].count)
            r = hosts[wi].call("write", node=ni, tag=f"w{k}")
            written.append((f"w{k}", r["t"], (wi, ni)))
            time.sleep(0.3)
        time.sleep(2.0)
        arrivals = [w.call("arrivals")["arrivals"] for w in hosts]
        delays, missing = [], 0
        for tag, t, writer in written:
            for wi, per_worker in enumerate(arrivals):
                for ni, per_node in enumerate(per_worker):
                    if (wi, ni) == writer:
                        continue                     # the writer itself
                    if tag in per_node:
                        delays.append(max(0.0, per_node[tag] - t))
                    else:
                        missing += 1
        conv = summary_ms(delays)
        conv["samples"], conv["missing"] = len(delays), missing
        results["convergence_128_ms"] = conv
        print(f"convergence of {writes} writes to 128 nodes (ms): p50 {conv['p50']} p75 {conv['p75']} "
              f"p95 {conv['p95']} p99 {conv['p99']} max {conv['max']} ({len(delays)} arrivals, "
              f"{missing} missing)", flush=True)

        lhm = [x for w in workers for x in w.call("bytes")["lhm"]]
        results["local_health_before_kill"] = {"max": max(lhm), "mean": round(sum(lhm) / len(lhm), 2)}
        print(f"local health multiplier before the kill: mean {results['local_health_before_kill']['mean']} "
              f"max {max(lhm)}", flush=True)
        # detection: kill -9 the lone victim process
        sid = victim.call("sessions")["sessions"][0]
        for w in hosts:
            w.call("watch", sid=sid)
        victim.proc.kill()
        victim.proc.wait()
        killed = time.time()
        workers.remove(victim)
        deadline = time.monotonic() + (60 if quick else 120)
        while time.monotonic() < deadline:
            det = [w.call("detect") for w in hosts]
            if all(t is not None for d in det for t in d["left"]):
                break
            time.sleep(0.5)
        sus = [t - killed for d in det for t in d["suspected"] if t is not None]
        left = [t - killed for d in det for t in d["left"] if t is not None]
        peers = sum(w.count for w in hosts)
        results["detection_128_s"] = {
            "suspected_p50": round(pct(sus, 50), 3) if sus else None,
            "suspected_max": round(max(sus), 3) if sus else None, "suspected_at": len(sus),
            "left_p50": round(pct(left, 50), 3) if left else None,
            "left_max": round(max(left), 3) if left else None, "left_at": len(left), "peers": peers}
        d = results["detection_128_s"]
        print(f"kill -9 at 128 nodes: suspected at {d['suspected_at']}/{peers} peers p50 {d['suspected_p50']} s "
              f"max {d['suspected_max']} s; LEFT at {d['left_at']}/{peers} p50 {d['left_p50']} s "
              f"max {d['left_max']} s", flush=True)
    finally:
        for w in workers:
            w.close()


def churn_phase(key_file, quick, results):
    window = 9 if quick else 30
    w = Worker(10, key_file)
    try:
        wait_live([w], 10)
        time.sleep(2)
        quiet = idle_bytes([w], 3)
        w.call("churn", period=3.0)
        time.sleep(3)
        kbps = idle_bytes([w], window) / 1000
        results["churn_kbps_per_node"] = round(kbps, 3)
        print(f"churn, 10 nodes re-registering every 3 s: {kbps:.2f} KB/s per node sent "
              f"(idle before: {quiet / 1000:.3f} KB/s)", flush=True)
    finally:
        w.close()


def false_eviction_phase(key_file, quick, results, seconds=None):
    duration = seconds or (20 if quick else 600)
    workers = [Worker(32, key_file)]
    burners = []
    try:
        workers.append(Worker(32, key_file, workers[0].call("addr")["addr"]))
        wait_live(workers, 64)
        time.sleep(3)
        for _ in range(2):                           # saturate both CPUs
            burners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(duration)
        ev = [w.call("evictions") for w in workers]
        evicted = set()
        for e in ev:
            evicted |= set(e["evicted"])
        suspicions = sum(e["suspicions"] for e in ev)
        results["false_evictions_64"] = {"seconds": duration, "evicted_sessions": len(evicted),
                                         "suspicion_events": suspicions}
        print(f"64 idle nodes, CPUs saturated for {duration} s: {len(evicted)} false evictions, "
              f"{suspicions} suspicion events (all refuted or pending)", flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
        for w in workers:
            w.close()


def simulator_phase(quick, results):
    n = 300 if quick else 1000
    cfg = on.Config(key=b"k" * 32)
    net = simnet.SimulatedNetwork(seed=5, config=cfg, loss=0.01)
    t0 = time.monotonic()
    members = [net.add() for _ in range(n)]
    records = {m.sid: m.record for m in members}
    for m in members:                                # pre-seeded registry: a join storm of 1,000
        m.map.merge(records)                         # through one seed is not what we measure
        for sid, rec in records.items():
            m._track(sid, rec, net.now)
    net.run(5.0)
    before = sum(net.bytes_sent.values())
    net.run(20.0)
    idle = (sum(net.bytes_sent.values()) - before) / n / 20.0
    delays = []
    for k in range(5):
        writer = members[k * 7]
        start = net.now
        mark = len(net.changes)
        net.send(writer.addr, writer.update(net.now, labels={"w": str(k)}))
        net.run(3.0)
        seen = {}
        for t, at, sid, rec in net.changes[mark:]:
            if sid == writer.sid and rec and (rec.get("labels") or {}).get("w") == str(k):
                seen.setdefault(at, t - start)
        delays.append((len(seen), max(seen.values()) if seen else None))
    results["simulator"] = {"members": n, "idle_bytes_per_node_s": round(idle, 1),
                            "write_reached": [d[0] for d in delays],
                            "convergence_max_ms": [round(d[1] * 1000, 1) for d in delays if d[1] is not None],
                            "wall_s": round(time.monotonic() - t0, 1)}
    s = results["simulator"]
    print(f"simulator, {n} members, 1% loss: idle {s['idle_bytes_per_node_s']} B/s per node; a write reached "
          f"{min(s['write_reached'])}-{max(s['write_reached'])} members, convergence max "
          f"{max(s['convergence_max_ms'])} ms (simulated network delay 0.2-2 ms per hop)", flush=True)


# ---------------------------------------------------------------------------------------------
# Tunnel: the node's --listen port forwarding to a fake engine (node-only, no ingress)
# ---------------------------------------------------------------------------------------------
def _tunnel_request(model, tunnel, stream=False):
    body = json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "say hello to the benchmark"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n%s: %s\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (tunnel[0].encode(), tunnel[1].encode(), len(body), body))


def _start_tunnel_node(key_file, engine_flags, procs):
    """`otela_node.py start` wrapping a fake engine; node on CPU 0, engine on CPU 1."""
    import bench_ingress as bi
    from fake_engine import free_port
    engine_port, listen = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "otela_node.py"), "start", "--key-file", key_file,
                             "--listen", f"127.0.0.1:{listen}", "--gossip", f"127.0.0.1:{free_port()}",
                             "--log-level", "WARNING", "--engine-url", f"http://127.0.0.1:{engine_port}",
                             "--process", f"{sys.executable} {ROOT / 'tests' / 'fake_engine.py'} "
                                          f"--port {engine_port} {engine_flags}"], stderr=subprocess.DEVNULL)
    procs.append(proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{listen}/v1/registry", timeout=2) as r:   # open in plain
                if json.load(r)["sessions"][0]["state"] == "SERVING":
                    break
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.2)
    else:
        raise RuntimeError("tunnel node did not come up")
    bi.pin(proc.pid, 0)
    for pid in bi._pids_of_port(engine_port):
        bi.pin(pid, 1)
    return proc.pid, listen, engine_port


def _tls_client(key_file):
    """The client context a member dials a TLS tunnel with, or None for a plain-tunnel key."""
    cfg = on.Config(key=on.load_key(key_file))
    cfg.tls_cert, cfg.tls_key = on.find_tunnel_tls(key_file)
    return on.tunnel_tls(cfg)[1]


def _plain_key(key_file):
    """The same cluster secret alone in a folder: a node started with it runs the plain tunnel."""
    folder = tempfile.mkdtemp(prefix="otela-plain-")
    path = os.path.join(folder, "cluster.key")
    with open(key_file) as src, open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as dst:
        dst.write(src.read())
    return path


async def _one_stream_tls(port, req, tls):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls,
                                                   server_hostname=on.TLS_SERVER_NAME if tls else None)
    writer.write(req)
    data = bytearray()
    while not data.endswith(b"\r\n0\r\n\r\n"):
        piece = await reader.read(262144)
        if not piece:
            break
        data += piece
    writer.close()
    return data.count(b"data: {")


def tunnel_phase(key_file, quick, results):
    """Side by side in one run: the engine direct, a plain-tunnel node (static header) and a
    TLS-tunnel node (mutual TLS, keygen's certificate), same engine flags."""
    import bench_ingress as bi
    sys.path.insert(0, str(ROOT / "tests"))
    tunnel = (on.TUNNEL_HEADER, hmac.new(on.load_key(key_file), b"tunnel", hashlib.sha256).hexdigest())
    tls = _tls_client(key_file)
    plain_key = _plain_key(key_file)
    n_lat, seconds, rounds = (80, 2.0, 16) if quick else (400, 5.0, 48)
    procs = []
    out = results["tunnel"] = {}
    try:
        fast_pid, fast_port, fast_engine = _start_tunnel_node(key_file, "--chunks 8", procs)
        plain_pid, plain_port, _ = _start_tunnel_node(plain_key, "--chunks 8", procs)
        bulk_pid, bulk_port, bulk_engine = _start_tunnel_node(key_file, "--chunks 1000", procs)
        bi.pin(0, 1)
        paths = (("direct", fast_engine, None), ("node_plain", plain_port, None), ("node", fast_port, tls))
        # Interleaved: each round sends one request down every path in turn (one kept-alive
        # connection each), so the three see the same machine load; the TLS cost is also taken
        # per round (TLS minus plain of the same round), which cancels load that drifts.
        socks, lat = {}, {name: [] for name, _, _ in paths}
        req, buf = _tunnel_request("fast", tunnel), bytearray()
        for name, port, ctx in paths:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:
                sock = ctx.wrap_socket(sock, server_hostname=on.TLS_SERVER_NAME)
            for _ in range(5):
                sock.sendall(req)
                bi.read_response(sock, buf)
            socks[name] = sock
        start = time.perf_counter()
        for i in range(n_lat):
            time.sleep(max(0.0, start + i / 16 - time.perf_counter()))
            for name, sock in socks.items():
                t0 = time.perf_counter()
                sock.sendall(req)
                bi.read_response(sock, buf)
                lat[name].append(time.perf_counter() - t0)
        for sock in socks.values():
            sock.close()
        for name, _, _ in paths:
            out[name] = {"latency_p50_ms": pct(lat[name], 50) * 1e3, "latency_p90_ms": pct(lat[name], 90) * 1e3,
                         "latency_p99_ms": pct(lat[name], 99) * 1e3}
        for name in ("node_plain", "node"):
            out[name]["added_p50_ms"] = out[name]["latency_p50_ms"] - out["direct"]["latency_p50_ms"]
            out[name]["added_p99_ms"] = out[name]["latency_p99_ms"] - out["direct"]["latency_p99_ms"]
        node = out["node"]
        node["tls_added_per_round_p50_ms"] = pct([t - p for t, p in zip(lat["node"], lat["node_plain"])], 50) * 1e3
        node["tls_added_p50_ms"] = node["latency_p50_ms"] - out["node_plain"]["latency_p50_ms"]

        class Held(bi._Conn):
            """Connected (and through its handshake) first; the clock starts when all are."""
            def connection_made(self, transport):
                self.transport = transport

        async def tput(port, ctx, pid):
            counter, loop = [0], asyncio.get_running_loop()
            protos = []
            for _ in range(64):
                _, proto = await loop.create_connection(
                    lambda: Held(_tunnel_request("fast", tunnel), counter, 0.0), "127.0.0.1", port,
                    ssl=ctx, server_hostname=on.TLS_SERVER_NAME if ctx else None)
                protos.append(proto)
            cpu0 = bi.cpu_seconds(pid)              # after the 64 handshakes: per request only
            t0 = time.perf_counter()
            for proto in protos:
                proto.stop_at = t0 + seconds
                proto.transport.write(proto.req)
            await asyncio.gather(*(p.done for p in protos))
            return counter[0], time.perf_counter() - t0, bi.cpu_seconds(pid) - cpu0

        async def streams(port, ctx):
            req, chunks, t0 = _tunnel_request("bulk", tunnel, stream=True), 0, time.perf_counter()
            for _ in range(max(1, rounds // 16)):
                chunks += sum(await asyncio.gather(*(_one_stream_tls(port, req, ctx) for _ in range(16))))
            return chunks, time.perf_counter() - t0

        for name, pid, port, ctx in (("node_plain", plain_pid, plain_port, None), ("node", fast_pid, fast_port, tls)):
            done, elapsed, cpu = asyncio.run(tput(port, ctx, pid))
            out[name]["rps_64conn"] = done / elapsed
            out[name]["cpu_us_per_request"] = cpu / max(1, done) * 1e6
        cpu0 = bi.cpu_seconds(bulk_pid)
        chunks, elapsed = asyncio.run(streams(bulk_port, tls))
        node["sse_chunks_per_s_16streams"] = chunks / elapsed
        node["cpu_us_per_chunk"] = (bi.cpu_seconds(bulk_pid) - cpu0) / max(1, chunks) * 1e6
        chunks, elapsed = asyncio.run(streams(bulk_engine, None))
        out["direct"]["sse_chunks_per_s_16streams"] = chunks / elapsed
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        import shutil
        shutil.rmtree(os.path.dirname(plain_key), ignore_errors=True)
    print("tunnel (node only, node pinned to CPU 0, engine and client on CPU 1; node = TLS tunnel,"
          " node_plain = the plain one, same run):")
    for name, r in out.items():
        print(f"  {name:10}" + "  ".join(f"{k}={v:.3f}" for k, v in r.items()))


# ---------------------------------------------------------------------------------------------
# NAT lab (root): the same ingress reaching a public node directly and a private one relayed
# ---------------------------------------------------------------------------------------------
NAT_PATHS = ("direct", "mux", "splice")    # the three paths of one lab, measured in alternating rounds
NAT_SLICES = 4                              # each round's throughput runs: slices per path, taking turns
CLK_TCK = os.sysconf("SC_CLK_TCK")         # /proc/PID/stat's utime and stime are in these


def cpu_seconds(pid):
    """utime + stime of a process (fields 14 and 15 of /proc/PID/stat; the name may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def nat_phase(quick, results, rounds=10):
    """In tests/natlab.py's lab (cone NATs), one lab for the whole phase: the ingress and a
    standalone relay (relay_mux 1) on the public host; node "fm-direct" on the public host
    (reached direct), "fm-mux" behind NAT A (its link takes tunnel streams: relay_mux 1) and
    "fm-splice" behind NAT B (its link hello says mux 0: a dial-back per stream, spliced at the
    relay), both reached through the standalone relay; TLS end to end; all wrap the fake engine.
    Clients on the public host, through the ingress. `rounds` rounds, each measuring the three
    paths (the order rotating per round) with the same clients and the same number of requests:
    latency (sequential, one path after the other), plain requests/s (16 connections x a fixed
    count) and SSE chunks/s (8 streams x a fixed count), each in NAT_SLICES slices per path with
    the paths taking turns, and the CPU seconds of the ingress, the relay and the path's node
    over the plain requests and over the SSE chunks (/proc/PID/stat). Per-round ratios against the
    direct path of the same round, medians over rounds: what else runs on the box slows all
    three paths of a round alike. Then the hole punch between the two private nodes and a
    private ingress reaching fm-splice's node punched (once).

    Figures this phase gave (--nat-runs 10, TLS, a loaded 2-core box, medians of alternating
    rounds), the reasons for the relay's design (otela_node.py, "NAT traversal", rules 2 and 5):
    mux adds 0.48-0.75 ms p50 over direct; the relay spends 107-130 us of CPU per request
    (0.74-0.84x the splice's), the member's node 272-318 us; a socketpair per stream, or asyncio's
    SSLProtocol over an in-memory transport, cost the member's node 1.27x and 1.44x the direct
    path's CPU per request; streams on a link the dialer holds itself would cost +0.49-1.2 ms p50
    (the dial-back -0.24-0.61); 16 new punched connections at once cost a private ingress 30-41 %
    of its req/s over ~1 s when each waited punch_delay, 4 % once pooled. Wall-clock req/s swung
    0.7-1.0x between runs on that box, all paths alike."""
    import natlab
    out = results["nat"] = {}
    reason = natlab.unavailable()
    if reason:
        out["skipped"] = reason
        print(f"nat: skipped ({reason})")
        return
    _nat_lab_run(quick, rounds, out)


def _nat_lab_run(quick, rounds, out):
    import http.client

    import natlab
    import reliability as rel
    # plain and SSE counts sized for about a second each per path per round: a shorter window
    # (960 requests took ~0.15 s) was swung by any burst of load elsewhere on the box
    n_lat, per_conn, per_stream = (30, 20, 4) if quick else (60, 360, 48)
    with tempfile.TemporaryDirectory() as tmp, natlab.NatLab() as lab, \
            rel.Fleet(tmp, dict(rel.QUICK_TIMINGS)) as fleet:
        pub, a, b = lab.place("pub"), lab.place("a"), lab.place("b")
        # --no-relay: an ingress holding a member's link takes its dial-back itself (relay rule 2),
        # so both relayed paths would be the same path; only the standalone relay relays here.
        ingress = rel.Member("ingress", "ingress", pub,
                             [sys.executable, str(ROOT / "otela_ingress.py"), "serve", "--key-file", fleet.key_file,
                              "--listen", f"{pub.host}:8080", "--gossip", f"{pub.host}:7946", "--db", fleet.db,
                              "--no-relay"], f"{pub.host}:8080", f"{pub.host}:7946")
        fleet.members.append(ingress)
        fleet.start(ingress)
        rel.wait(lambda: fleet.up() and fleet.get(ingress, "/healthz")[0] == 200, 60, "ingress /healthz")
        relay_gossip = f"{natlab.PUBLIC}:{natlab.RELAY_GOSSIP_PORT}"   # a standalone relay, preferred
        relay = rel.Member("relay", "relay", pub, [sys.executable, str(ROOT / "otela_node.py"), "relay",
                                                   "--key-file", fleet.key_file, "--gossip", relay_gossip, "--listen",
                                                   f"{natlab.PUBLIC}:7701", "--bootstrap", ingress.gossip],
                           f"{natlab.PUBLIC}:7701", relay_gossip)
        fleet.members.append(relay)
        fleet.start(relay)
        engine = f"{sys.executable} {ROOT / 'tests' / 'fake_engine.py'} --port {{port}} --chunks 8"
        # Each node bootstraps to the relay too, so the lab is up at once (a private member whose
        # only seed does not relay learns of the relay from that seed's answer, a relay check later).
        members = {}
        for path, place, gossip, listen, mux in (("direct", pub, 7950, 7710, "1"), ("mux", a, 7946, 7700, "1"),
                                                 ("splice", b, 7946, 7700, "0")):
            argv = ["env", f"OTELA_RELAY_MUX={mux}", sys.executable, str(ROOT / "otela_node.py"), "start",
                    "--key-file", fleet.key_file, "--listen", f"{place.host}:{listen}",
                    "--gossip", f"{place.host}:{gossip}", "--bootstrap", f"{relay_gossip},{ingress.gossip}",
                    "--process", f"{engine} --model fm-{path}", "--grant-file", fleet.grant(f"fm-{path}", (f"fm-{path}",))]
            members[path] = rel.Member(f"fm-{path}", "worker", place, argv, f"{place.host}:{listen}",
                                       f"{place.host}:{gossip}")
            fleet.members.append(members[path])
            fleet.start(members[path])

        def ready():
            view = {s["models"][0]: s for s in fleet.registry(ingress)["sessions"]
                    if s.get("role") == "worker" and s["state"] == "SERVING" and s.get("models")}
            state["view"] = {m: (s["reach"], s.get("relay")) for m, s in view.items()}
            return len(view) == 3 and view["fm-direct"]["reach"] == "direct" and all(
                view[m]["reach"] == "relayed" and view[m].get("relay", "").startswith(relay_gossip)
                for m in ("fm-mux", "fm-splice"))
        state = {}
        if rel.until(lambda: fleet.up() and ready(), 60) is None:
            raise TimeoutError(f"three nodes SERVING, two relayed by the standalone relay: not within 60 s "
                               f"(seen: {state.get('view')})")
        rel.until(lambda: fleet.get(members["mux"], "/healthz")[1]["gossip"]["punches"]["ok"], 15)
        health = [fleet.get(members[m], "/healthz")[1]["gossip"] for m in ("mux", "splice")]
        out["punch_ms"] = [h["punch_ms"] for h in health]
        out["punch_after_join_ms"] = [h.get("punch_after_join_ms") for h in health]   # both members -> acked path
        out["punched"] = [bool(h["punched"]) for h in health]
        front = {"host": ingress.listen.rsplit(":", 1)[0], "port": int(ingress.listen.rsplit(":", 1)[1]),
                 "place": pub, "token": fleet.token}   # where the clients send: the public ingress first

        def body(model, stream=False):
            return json.dumps({"model": model, "stream": stream,
                               "messages": [{"role": "user", "content": "say hello to the benchmark"}]})

        def latency(model, n):
            conn = http.client.HTTPConnection(front["host"], front["port"], timeout=30)
            heads = {"content-type": "application/json", "authorization": f"Bearer {front['token']}"}
            lat = []
            for i in range(n + 3):
                t0 = time.perf_counter()
                conn.request("POST", "/v1/chat/completions", body=body(model), headers=heads)
                conn.getresponse().read()
                if i >= 3:                           # the first ones open the pooled connections
                    lat.append(time.perf_counter() - t0)
                time.sleep(1 / 32)
            conn.close()
            return lat

        def throughput(model, per_client, stream=False, clients=16):
            """`clients` connections, `per_client` requests each: (units/s, requests, units)."""
            counts = [0] * clients

            def worker(i):
                front["place"].enter()
                conn = http.client.HTTPConnection(front["host"], front["port"], timeout=30)
                heads = {"content-type": "application/json", "authorization": f"Bearer {front['token']}"}
                for _ in range(per_client):
                    conn.request("POST", "/v1/chat/completions", body=body(model, stream), headers=heads)
                    data = conn.getresponse().read()
                    counts[i] += data.count(b"data: {") if stream else 1
                conn.close()
            pool = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
            t0 = time.perf_counter()
            for t in pool:
                t.start()
            for t in pool:
                t.join(120)
            return sum(counts) / (time.perf_counter() - t0), clients * per_client, sum(counts)

        on_path = {"ingress": ingress, "relay": relay}
        per_round = []
        cpu = {p: {"requests": 0, **{k: 0.0 for k in ("ingress", "relay", "node")}} for p in NAT_PATHS}
        sse_cpu = {p: {"chunks": 0, **{k: 0.0 for k in ("ingress", "relay", "node")}} for p in NAT_PATHS}
        lat_all = {p: [] for p in NAT_PATHS}
        def measured(path, stream):
            """One slice of a path's throughput (plain or SSE), and the CPU its processes spent:
            (units, seconds)."""
            procs = dict(on_path, node=members[path])
            before = {k: cpu_seconds(m.proc.pid) for k, m in procs.items()}
            if stream:
                rate, _, units = throughput(f"fm-{path}", per_stream // NAT_SLICES, stream=True, clients=8)
            else:
                rate, units, _ = throughput(f"fm-{path}", per_conn // NAT_SLICES)
            table, count = (sse_cpu, "chunks") if stream else (cpu, "requests")
            for k, m in procs.items():
                table[path][k] += cpu_seconds(m.proc.pid) - before[k]
            table[path][count] += units
            return units, units / rate

        for r in range(rounds):
            order = NAT_PATHS[r % 3:] + NAT_PATHS[:r % 3]   # the order rotates: no path always first
            row = {}
            for path in order:
                lat = front["place"].call(latency, f"fm-{path}", n_lat, timeout=120)
                lat_all[path] += lat
                row[path] = {"latency_p50_ms": pct(lat, 50) * 1e3, "latency_p99_ms": pct(lat, 99) * 1e3}
            # throughput in NAT_SLICES slices per path, the paths taking turns: a burst of load
            # elsewhere on the box falls on all three paths of the round alike
            for key, stream in (("rps_16conn", False), ("sse_chunks_per_s_8streams", True)):
                done = {path: [0, 0.0] for path in order}
                for _ in range(NAT_SLICES):
                    for path in order:
                        units, seconds = measured(path, stream)
                        done[path][0] += units
                        done[path][1] += seconds
                for path in order:
                    row[path][key] = done[path][0] / done[path][1]
            per_round.append(row)
        out["rounds"] = per_round
        out["relay_counters"] = fleet.get(relay, "/healthz")[1].get("gossip", {}).get("relayed")
        summary = out["summary"] = {}
        for path in ("mux", "splice"):
            ratios = {k: statistics.median(rw[path][k] / rw["direct"][k] for rw in per_round)
                      for k in ("rps_16conn", "sse_chunks_per_s_8streams")}
            lat_d, lat_p = lat_all["direct"], lat_all[path]
            summary[path] = {
                "rps_over_direct": ratios["rps_16conn"],
                "sse_over_direct": ratios["sse_chunks_per_s_8streams"],
                "throughput_loss_pct": 100 * (1 - ratios["rps_16conn"]),
                "sse_loss_pct": 100 * (1 - ratios["sse_chunks_per_s_8streams"]),
                "added_p50_ms": statistics.median(rw[path]["latency_p50_ms"] - rw["direct"]["latency_p50_ms"]
                                                  for rw in per_round),
                "added_p99_ms": statistics.median(rw[path]["latency_p99_ms"] - rw["direct"]["latency_p99_ms"]
                                                  for rw in per_round),
                "pooled_added_p50_ms": (pct(lat_p, 50) - pct(lat_d, 50)) * 1e3,
                "pooled_added_p99_ms": (pct(lat_p, 99) - pct(lat_d, 99)) * 1e3}
        summary["mux_over_splice_rps"] = statistics.median(rw["mux"]["rps_16conn"] / rw["splice"]["rps_16conn"]
                                                           for rw in per_round)
        out["cpu_us_per_request"] = {p: {k: 1e6 * c[k] / c["requests"] for k in ("ingress", "relay", "node")}
                                     for p, c in cpu.items()}
        out["cpu_us_per_sse_chunk"] = {p: {k: 1e6 * c[k] / max(1, c["chunks"]) for k in ("ingress", "relay", "node")}
                                       for p, c in sse_cpu.items()}
        for table in (out["cpu_us_per_request"], out["cpu_us_per_sse_chunk"]):
            for c in table.values():
                c["path"] = sum(c.values())
        print(f"nat lab (cone NATs; clients on the public host through the ingress; mux and splice through a "
              f"standalone relay, TLS end to end; {rounds} rounds x 3 paths, {n_lat} latency requests, "
              f"16 x {per_conn} plain, 8 x {per_stream} SSE requests per path per round):")
        for i, rw in enumerate(per_round):
            print(f"  round {i + 1:2}  " + "  ".join(
                f"{p}: p50={rw[p]['latency_p50_ms']:.2f} rps={rw[p]['rps_16conn']:.0f} "
                f"sse={rw[p]['sse_chunks_per_s_8streams']:.0f}" for p in NAT_PATHS))
        print("  medians of the per-round ratios (targets: added p50 <= 0.5 ms, throughput loss <= 10 %):")
        for key, row in summary.items():
            print(f"  {key:22}" + ("  ".join(f"{k}={v:.3f}" for k, v in row.items()) if isinstance(row, dict)
                                  else f"{row:.3f}"))
        print(f"  the standalone relay's tunnel streams: {out['relay_counters']}")
        print("  CPU us per plain request (utime+stime over the 16-connection runs, all rounds):")
        for p, c in out["cpu_us_per_request"].items():
            print(f"  {p:8}" + "  ".join(f"{k}={v:.0f}" for k, v in c.items()))
        print("  CPU us per SSE chunk (over the 8-stream runs, all rounds):")
        for p, c in out["cpu_us_per_sse_chunk"].items():
            print(f"  {p:8}" + "  ".join(f"{k}={v:.1f}" for k, v in c.items()))
        # A private ingress on host A (behind NAT A, OTELA_REACH=private), its clients on host A:
        # the public node direct, the node behind NAT B over a punched TCP tunnel, side by side.
        listen, gossip = f"{a.host}:8090", f"{a.host}:7956"
        db = os.path.join(tmp, "private-ingress.sqlite")
        token = subprocess.run([sys.executable, str(ROOT / "otela_ingress.py"), "keys", "create", "--user", "bench",
                                "--db", db], env=fleet.env, check=True, capture_output=True, text=True,
                               timeout=60).stdout.strip()
        private = rel.Member("private-ingress", "ingress", a,
                             ["env", "OTELA_REACH=private", sys.executable, str(ROOT / "otela_ingress.py"), "serve",
                              "--key-file", fleet.key_file, "--listen", listen, "--gossip", gossip, "--db", db,
                              "--bootstrap", f"{relay_gossip},{ingress.gossip}"], listen, gossip)
        fleet.members.append(private)
        fleet.start(private)

        def punched_at_private():
            return any(s.get("models") == ["fm-splice"] and s["state"] == "SERVING" and s["reach"] == "punched"
                       for s in fleet.registry(private)["sessions"])
        punched = rel.until(lambda: private.proc.poll() is None and punched_at_private(), 60)
        if punched:
            front.update(host=a.host, port=8090, place=a, token=token)
            rows = {}
            for name, model in (("private_ingress_direct", "fm-direct"), ("private_ingress_punched", "fm-splice")):
                lat = front["place"].call(latency, model, n_lat * 3, timeout=120)
                rows[name] = {"latency_p50_ms": pct(lat, 50) * 1e3, "latency_p99_ms": pct(lat, 99) * 1e3,
                              "rps_16conn": throughput(model, per_conn)[0],   # 15 of the 16 connections new
                              "rps_16conn_warm": throughput(model, per_conn)[0]}   # the same 16, pooled
            base, row = rows["private_ingress_direct"], rows["private_ingress_punched"]
            row["added_p50_ms"] = row["latency_p50_ms"] - base["latency_p50_ms"]
            row["added_p99_ms"] = row["latency_p99_ms"] - base["latency_p99_ms"]
            row["throughput_loss_pct"] = 100 * (1 - row["rps_16conn"] / base["rps_16conn"])
            row["warm_throughput_loss_pct"] = 100 * (1 - row["rps_16conn_warm"] / base["rps_16conn_warm"])
            gossip = fleet.get(members["splice"], "/healthz")[1].get("gossip", {})   # the member's side
            out["private_ingress_tunnel_punches"] = gossip.get("tunnel_punches")     # of the punched connections
            out.update(rows)
            out["private_ingress_tunnels"] = {s.get("models", [""])[0]: s.get("tunnel")
                                              for s in fleet.registry(private)["sessions"] if s.get("role") == "worker"}
            for name in rows:
                print(f"  {name:24}" + "  ".join(f"{k}={v:.3f}" for k, v in rows[name].items()))
            print(f"  private ingress on host A (clients on host A), tunnel per model: {out['private_ingress_tunnels']}")
            print(f"  its punched tunnel connections: {out['private_ingress_tunnel_punches']}")
        else:
            print("  private ingress: fm-splice not punched within 60 s")
        fleet.stop(private)
        print(f"  punch between the two private nodes: {out['punch_ms']} ms, punched {out['punched']}")
        print(f"  punch in use after both sides were members (target < 1000 ms): {out['punch_after_join_ms']} ms")
        fleet.stop(relay)
        fleet.stop(ingress)


# ---------------------------------------------------------------------------------------------
# The relay's own cost, in process (no lab, no TLS): a relay forwarding tunnel streams between
# dialers' connections and one member link, all on loopback
# ---------------------------------------------------------------------------------------------
RELAY_REQUEST = 400                 # bytes a dialer sends per request: a TLS record of a small request
RELAY_ANSWER = (600, 1400)          # the member's answer: two DATA frames (head's and body's records)


def _batched(mux):
    """_link_frames's `mux` where the code has it (the phase also measures older code)."""
    import inspect
    return {"mux": mux} if "mux" in inspect.signature(on._link_frames).parameters else {}


def _link_frames(reader, writer, on_frame, mux):
    """on._link_frames as the code measured has it: on the link's _Stream, or (older code) its
    StreamReader and StreamWriter."""
    if hasattr(on, "_Stream"):
        return on._link_frames(reader, on_frame, 1 << 20, mux)
    return on._link_frames(reader, writer, on_frame, 1 << 20, **_batched(mux))


async def _serve(handler, port):
    """A server calling handler(reader, writer) per connection: the code's own _Stream (then
    reader is writer) where it has one."""
    if not hasattr(on, "_Stream"):
        return await asyncio.start_server(handler, "127.0.0.1", port)
    return await asyncio.get_running_loop().create_server(
        lambda: on._Stream(lambda stream: asyncio.ensure_future(handler(stream, stream))), "127.0.0.1", port)


async def _connect(port):
    if not hasattr(on, "open_stream"):
        return await asyncio.open_connection("127.0.0.1", port)
    stream = await on.open_stream("127.0.0.1", port)
    return stream, stream


def _relay_process(link_port, dial_port, ready):
    """The relay's side alone in this process: one member link read as the node reads one
    (_link_frames, its _MuxLink), each dialer's connection a stream on it (_MuxStream.bridge)."""
    on.install_event_loop()

    async def run():
        muxes = []

        async def on_link(reader, writer):
            mux = on._MuxLink(writer, 4096)
            muxes.append(mux)
            await _link_frames(reader, writer, lambda data: mux.on_frame(data), mux)

        async def on_dialer(reader, writer):
            writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = muxes[0].open()
            await (stream.bridge(reader) if hasattr(on, "_Stream") else stream.bridge(reader, writer))
        servers = [await _serve(on_link, link_port), await _serve(on_dialer, dial_port)]
        ready.set()
        await asyncio.sleep(3600)
        for s in servers:
            s.close()
    asyncio.run(run())


class _AnswerStream(on._MuxCredit):
    """The member's side of a stream in this phase: RELAY_ANSWER for each RELAY_REQUEST bytes."""

    def __init__(self, link, sid):
        self._start_credit(link, sid)
        self.got = 0

    def on_data(self, data):
        if not self._within_window(data):
            return False
        self.got += len(data)
        self.owed += len(data)
        self._credit_back()
        while self.got >= RELAY_REQUEST:
            self.got -= RELAY_REQUEST
            for n in RELAY_ANSWER:
                self.link.send(on.mux_frame(on.MUX_DATA, self.sid, b"a" * n))
                self.credit -= n
        return True

    def on_close(self):
        self.link.streams.pop(self.sid, None)

    def cut(self):
        pass


def relay_phase(quick, results):
    """The standalone relay's CPU per forwarded request (utime + stime of its process), its
    requests/s with 16 dialers, and the sequential round trip through it, on loopback: the
    relay's own code, without the lab's NAT gateways and TLS (those add to every path alike)."""
    import multiprocessing
    out = results["relay"] = {}
    per_conn, n_lat, conns = (200, 300, 16) if quick else (1000, 2000, 16)
    link_port, dial_port = on.free_port(), on.free_port()
    ready = multiprocessing.get_context("fork").Event()
    proc = multiprocessing.get_context("fork").Process(target=_relay_process, args=(link_port, dial_port, ready),
                                                       daemon=True)
    proc.start()
    try:
        ready.wait(30)
        answer = sum(RELAY_ANSWER)

        async def run():
            reader, writer = await _connect(link_port)
            mux = on._MuxLink(writer, 4096, _AnswerStream)
            reading = asyncio.ensure_future(_link_frames(reader, writer, lambda data: mux.on_frame(data, lambda s: None),
                                                         mux))

            async def dialer(count, lat=None):
                r, w = await asyncio.open_connection("127.0.0.1", dial_port)
                w.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                request = b"q" * RELAY_REQUEST
                for _ in range(count):
                    t0 = time.perf_counter()
                    w.write(request)
                    await r.readexactly(answer)
                    if lat is not None:
                        lat.append(time.perf_counter() - t0)
                w.close()
            await dialer(50)                        # warm up
            lat = []
            await dialer(n_lat, lat)
            before = cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            await asyncio.gather(*(dialer(per_conn) for _ in range(conns)))
            elapsed = time.perf_counter() - t0
            cpu = cpu_seconds(proc.pid) - before
            reading.cancel()
            writer.close()
            return lat, elapsed, cpu
        on.install_event_loop()
        lat, elapsed, cpu = asyncio.run(run())
    finally:
        proc.kill()
        proc.join(10)
    n = per_conn * conns
    out.update({"requests": n, "cpu_us_per_request": cpu / n * 1e6, "rps_16conn": n / elapsed,
                "latency_p50_ms": pct(lat, 50) * 1e3, "latency_p99_ms": pct(lat, 99) * 1e3})
    print(f"relay alone (in process, loopback, no TLS; {conns} dialers x {per_conn} requests of {RELAY_REQUEST} B, "
          f"answers {RELAY_ANSWER} B): CPU {out['cpu_us_per_request']:.1f} us/request, "
          f"{out['rps_16conn']:.0f} req/s, round trip p50 {out['latency_p50_ms']:.3f} ms "
          f"p99 {out['latency_p99_ms']:.3f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="", help="comma list of phases: cluster,churn,false,sim,tunnel,nat,relay")
    p.add_argument("--nat-runs", type=int, default=10,
                   help="rounds of the nat phase (each: direct, mux and splice one after the other); "
                        "medians of the per-round ratios")
    p.add_argument("--saturate-seconds", type=float, default=None,
                   help="length of the false-eviction run with saturated CPUs (default 600; 20 with --quick)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--key-file", help=argparse.SUPPRESS)
    p.add_argument("--bootstrap", help=argparse.SUPPRESS)
    p.add_argument("--stagger", type=float, default=0.05, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        on.install_event_loop()
        asyncio.run(worker(args))
        return
    phases = set(args.only.split(",")) if args.only else {"cluster", "churn", "false", "sim", "tunnel", "nat", "relay"}
    results = {"quick": args.quick, "method": "worker processes hosting many Node objects, each with its "
               "own UDP+TCP sockets, on loopback; default timings"}
    with tempfile.TemporaryDirectory() as tmp:
        key_file = on.keygen(tmp)[0]
        if "cluster" in phases:
            cluster_phases(key_file, args.quick, results)
        if "churn" in phases:
            churn_phase(key_file, args.quick, results)
        if "tunnel" in phases:
            tunnel_phase(key_file, args.quick, results)
        if "nat" in phases:
            nat_phase(args.quick, results, args.nat_runs)
        if "relay" in phases:
            relay_phase(args.quick, results)
        if "false" in phases:
            false_eviction_phase(key_file, args.quick, results, args.saturate_seconds)
    if "sim" in phases:
        simulator_phase(args.quick, results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "node.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {os.path.join(args.out, 'node.json')}")


if __name__ == "__main__":
    main()
