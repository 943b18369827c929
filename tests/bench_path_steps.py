"""The whole path's work per request, in one process: a client, a real ingress (otela_ingress.Ingress
on an overlay member of role "ingress", with a key and the usage ledger), the worker node's tunnel
over mutual TLS as the ingress dials it, and an engine stand-in that answers each request at once,
all on one event loop, so the count is the CPU work done for a request, with no other process
between.

Figures:
  - steps: interpreter instructions per request (sys.settrace opcode events), by file
    (otela_ingress.py, otela_node.py, crdt.py, asyncio, ssl, the rest): the same count every run
    whatever the machine's load, so a change to either hop is seen exactly; the median of
    requests traced one by one, so a gossip timer that fires meanwhile is not counted;
    with --top N, the N functions that take the most steps;
  - steps by phase: otela's own steps in each hop's callback (PHASES), before and after its
    first write;
  - us: wall time per request, through the path and straight to the engine stand-in, the median
    of --n requests back to back (warm) and after an idle gap of COLD_GAP_S each (cold, as the
    bench's 16 requests/s leaves the CPU); "path added" is the difference. One loop runs both
    hops here, so this is their CPU work in sequence, not tests/bench_ingress.py's two processes.
Compare two checkouts with --root (the otela_node and otela_ingress imported). Never asserts on time.
With --asyncio (whose transports write in Python, so every hop's write is seen), the critical
path too: the four hops' steps before their first writes, what a request waits for; the rest
of each callback runs while the next hop works. Measured (--asyncio): 4,418 steps at 03c9f9c, of
which the node's 908 (the ingress's request) + 483 (the engine's answer); 4,141 once the node
passes the request's field lines and a whole answer on as they came (770 + 338). The rest is
the ingress's: ~1,900 before its write to the node (routing by the ttft policy is ~600 of them)
and ~1,130 before its write to the client (the ledger row is journalled first).
Usage: python tests/bench_path_steps.py [--root DIR] [--n 200] [--quick] [--top 0] [--asyncio] [--out DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COLD_GAP_S = 0.06      # the idle time before each request at the bench's 16 req/s
BODY = (b'{"id": "fake-1", "object": "chat.completion", "created": 1796166468, "model": "fake-model", '
        b'"choices": [{"index": 0, "message": {"role": "assistant", "content": "tok0 tok1 tok2 tok3 "}, '
        b'"finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}')
ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-fake-engine: 1\r\n\r\n%s"
          % (len(BODY), BODY))   # tests/fake_engine.py's head
PROMPT = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "say hello to the benchmark"}]}
                    ).encode()
FILES = ("otela_ingress.py", "otela_node.py", "crdt.py", "bench_path_steps.py")
OWN = FILES[:3]        # the files whose steps are counted by phase


class Engine(asyncio.Protocol):
    """Answers each whole request at once (a request comes in one read here)."""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(ANSWER)


class Client(asyncio.Protocol):
    """Sends one request at a time and waits for its whole answer (tests/fake_engine.py's body)."""

    def __init__(self):
        self.buf, self.done = b"", None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        if self.buf.endswith(BODY):
            if not self.buf.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the path answered {self.buf[:200]!r}")
            self.buf = b""
            self.done.set_result(None)

    async def one(self, request: bytes) -> None:
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        await self.done


def file_of(path: str) -> str:
    name = os.path.basename(path)
    if name in FILES:
        return name
    if os.sep + "asyncio" + os.sep in path:
        return "asyncio"
    return "ssl" if name == "ssl.py" else "other"


# The callbacks that begin each hop's work, by qualified name: a phase runs from its entry to its
# return, cut in two at its first write ("->" before it: what the next hop waits for; "after":
# booking done while the next hop works, which on the bench's CPUs shares the engine's at the node).
PHASES = {"_Client.data_received": "ingress: client's request", "_UpstreamProtocol.data_received":
          "ingress: node's answer", "_TunnelConnection.data_received": "node: ingress's request",
          "_EngineConn.data_received": "node: engine's answer", "Engine.data_received": "engine stand-in",
          "Client.data_received": "client"}
CRITICAL = ("ingress: client's request", "node: ingress's request", "node: engine's answer", "ingress: node's answer")


class Tracer:
    """One request's steps, by file, and otela's own by phase (see PHASES); `functions` (shared
    across requests, when given) by function."""

    def __init__(self, functions: collections.Counter = None):
        self.files: collections.Counter = collections.Counter()
        self.phases: collections.Counter = collections.Counter()
        self.functions = functions
        self.phase, self.entry, self.written = "other", None, False

    def trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            name = file_of(code.co_filename)
            self.files[name] += 1
            if name in OWN:
                self.phases[self.phase + (" (after its write)" if self.written else "")] += 1
            if self.functions is not None:
                self.functions[(os.path.basename(code.co_filename), code.co_firstlineno, code.co_name)] += 1
        elif event == "call" and self.entry is None:
            phase = PHASES.get(frame.f_code.co_qualname)
            if phase is not None:
                self.phase, self.entry, self.written = phase, frame, False
        elif event == "return" and frame is self.entry:
            self.phase, self.entry, self.written = "other", None, False
        return self.trace

    def profile(self, frame, event, arg):
        """A write inside a phase: a C method named write (the ssl object's), or asyncio's."""
        if self.entry is None:
            return
        if event == "c_call" and getattr(arg, "__name__", "") in ("write", "writelines") \
                or event == "call" and frame.f_code.co_name in ("write", "writelines") \
                and file_of(frame.f_code.co_filename) == "asyncio":
            self.written = True


async def traced_steps(one, runs: int, top: int) -> tuple:
    """Steps of each of `runs` requests, by file, and otela's own by phase (PHASES; "other":
    timers, tasks): the median request's, and the functions with the most steps (summed over
    the runs, per request). A write is seen as a call of asyncio's write (--asyncio) or of the
    ssl object's (setprofile's c_call): uvloop's plain transports write in C, unseen, so on
    uvloop only the ingress's write to the node cuts its phase."""
    per_run, functions = [], collections.Counter() if top else None
    for _ in range(runs):
        tracer = Tracer(functions)
        sys.setprofile(tracer.profile)
        sys.settrace(tracer.trace)
        try:
            await one()
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        per_run.append(tracer)
    totals = [sum(t.files.values()) for t in per_run]
    median = per_run[totals.index(sorted(totals)[len(totals) // 2])]   # the median request, whole
    steps = {name: median.files[name] for name in (*FILES, "asyncio", "ssl", "other") if median.files[name]}
    steps["total"] = sum(median.files.values())
    hot = [(f"{name}:{line} {func}", count / runs) for (name, line, func), count in (functions or collections.Counter()).most_common(top)]
    return steps, dict(sorted(median.phases.items())), hot


async def wait_serving(on, ingress_node, worker) -> None:
    """Until the ingress's registry holds the worker as serving."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        record = ingress_node.registry.get(worker.session_id)
        if record and record.get("state") == on.crdt.SERVING:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the ingress did not learn the worker within 30 s")


async def measure(oi, on, n: int, top: int) -> dict:
    loop = asyncio.get_running_loop()
    engine = await loop.create_server(Engine, "127.0.0.1", 0)
    engine_port = engine.sockets[0].getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="otela-path-steps-")
    key_file = on.keygen(tmp)[0]
    cfg = on.Config(key=on.load_key(key_file), listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
    cfg.tls_cert, cfg.tls_key = on.find_tunnel_tls(key_file)
    if not cfg.tls_cert:
        raise RuntimeError("keygen wrote no tunnel certificate (is openssl installed?)")
    worker = on.Node(cfg, models=["fake-model"], engine_url=f"http://127.0.0.1:{engine_port}")
    await worker.start(serve_http=True)
    member = on.Node(on.Config(**{**cfg.__dict__, "bootstrap": [worker.overlay.addr]}), role="ingress")
    await member.start(serve_http=False)
    db = os.path.join(tmp, "usage.sqlite")
    conn = oi.open_db(db)
    _, key = oi.create_key(conn, "bench")
    conn.close()
    ingress = oi.Ingress(member, db_path=db)
    port = await ingress.start("127.0.0.1", 0)
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer %s\r\n"
               b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (key.encode(), len(PROMPT), PROMPT))
    direct_request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-length: %d\r\n\r\n%s" % (
        len(PROMPT), PROMPT)
    out: dict = {}
    via = direct = None
    try:
        await wait_serving(on, member, worker)
        _, via = await loop.create_connection(Client, "127.0.0.1", port)
        _, direct = await loop.create_connection(Client, "127.0.0.1", engine_port)
        for _ in range(50):                         # warm up: the pools filled, the fits settled
            await via.one(request)
        for label, gap in (("cold", COLD_GAP_S), ("warm", 0.0)):
            rows = {"path": [], "direct": []}
            for _ in range(n):
                for client, name, data in ((direct, "direct", direct_request), (via, "path", request)):
                    if gap:
                        await asyncio.sleep(gap)
                    t0 = time.perf_counter()
                    await client.one(data)
                    rows[name].append(time.perf_counter() - t0)
            figures = {name: statistics.median(v) * 1e6 for name, v in rows.items()}
            figures["path added"] = figures["path"] - figures["direct"]
            out[label] = figures
        out["steps"], out["phases"], out["hot"] = await traced_steps(lambda: via.one(request), 21, top)
    finally:
        for client in (via, direct):
            if client is not None:
                client.transport.close()
        await ingress.stop()
        await member.stop()
        await worker.stop()
        engine.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.dirname(HERE),
                        help="the checkout whose otela_ingress and otela_node are measured")
    parser.add_argument("--n", type=int, default=200, help="requests per timing")
    parser.add_argument("--quick", action="store_true", help="50 requests per timing")
    parser.add_argument("--top", type=int, default=0, help="also list the N functions with the most steps")
    parser.add_argument("--asyncio", action="store_true",
                        help="on asyncio's own loop (its transports and TLS in Python, so counted), not uvloop")
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    sys.path[:0] = [root, HERE]
    import otela_ingress as oi
    import otela_node as on
    if args.asyncio:
        sys.modules["uvloop"] = None
    on.install_event_loop()
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})   # one CPU: both hops in sequence
    except (AttributeError, OSError):
        pass
    result = asyncio.run(measure(oi, on, 50 if args.quick else args.n, args.top))
    result["root"] = root
    print(f"whole path of {root} (ingress -> TLS -> node -> engine stand-in, one loop"
          f"{', asyncio' if args.asyncio else ', uvloop'}): microseconds per request (median of {args.n})")
    print(f"{'':16}{'cold':>10}{'warm':>10}")
    for name in result["cold"]:
        print(f"{name:16}{result['cold'][name]:10.1f}{result['warm'][name]:10.1f}")
    print("steps per request (interpreter instructions, by file): "
          + ", ".join(f"{name} {count:.0f}" for name, count in result["steps"].items()))
    print("otela's steps per request by phase (a hop's callback, before and after its first write):")
    for name, count in result["phases"].items():
        print(f"{count:8.0f}  {name}")
    if args.asyncio:   # what a request waits for: each hop's steps before its first write
        result["critical_path_steps"] = sum(count for name, count in result["phases"].items()
                                            if name.split(" (")[0] in CRITICAL and "after" not in name)
        print(f"{result['critical_path_steps']:8.0f}  the critical path (the four hops' phases before their writes)")
    for name, count in result["hot"]:
        print(f"{count:8.0f}  {name}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "path_steps.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
