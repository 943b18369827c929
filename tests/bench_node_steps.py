"""The node's share of a tunnelled request, stage by stage, in one process: a client stand-in,
the node's tunnel port (TLS as the ingress dials it, or the plain one) and an engine stand-in
that answers each request at once, all on one event loop (pinned to one CPU), so every stage
is the CPU work done for it, in sequence, with no other process between.

Stages of one request (wall time, the median of --n requests, each after an idle gap of
COLD_GAP_S as the bench's 16 req/s leaves the CPU, and back to back):
    to engine   the client's write -> the engine stand-in has the request: the node reads it
                (TLS decrypt), parses it, judges its credential, writes it to the engine
    back        the engine stand-in's write -> the client has the whole answer: the node reads
                the answer, parses its head, writes it back (TLS encrypt)
    node added  to engine + back, less the same two stages of the client talking to the
                engine stand-in directly (loopback and the stand-ins' own work)
With this checkout's node (a _TunnelConnection), the node's own callbacks are timed too: read
(the client's write -> the node's data_received: TLS both ways, loopback, the loop's wake-up),
parse (parse_request), admission (the credential, the size limit), dispatch and the engine's
request head, engine write (the write to the pooled engine connection), engine (-> the node's
engine_data), write back (the answer parsed, re-headed and written), deliver (-> the client).
Steps: interpreter instructions per request (sys.settrace opcode events), by file: the same
count every run whatever the machine's load; asyncio's share shows what tasks and futures cost.

Compare two checkouts with --root (the otela_node imported). Never asserts on time.
Usage: python tests/bench_node_steps.py [--root DIR] [--n 200] [--plain] [--uvloop] [--out DIR]
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


class Stamps:
    """perf_counter stamps of the request in flight, by stage name."""

    def __init__(self):
        self.at: dict = {}

    def __call__(self, name: str) -> None:
        if name not in self.at:
            self.at[name] = time.perf_counter()


class Engine(asyncio.Protocol):
    """Answers each whole request at once (a request comes in one read here)."""

    def __init__(self, stamps: Stamps):
        self.stamps = stamps

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.stamps("engine in")
        self.stamps("engine out")
        self.transport.write(ANSWER)


class Client(asyncio.Protocol):
    def __init__(self, stamps: Stamps):
        self.stamps, self.buf, self.done = stamps, b"", None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        if self.buf.endswith(BODY):
            self.stamps("client in")
            self.buf = b""
            self.done.set_result(None)

    async def one(self, request: bytes) -> None:
        self.done = asyncio.get_running_loop().create_future()
        self.stamps("client out")
        self.transport.write(request)
        await self.done


def hook(on, stamps: Stamps) -> bool:
    """Stamps inside the node's callbacks, when it serves the tunnel from them (this checkout)."""
    conn = getattr(on, "_TunnelConnection", None)
    if conn is None or not hasattr(conn, "engine_data"):
        return False

    def stamped(owner, name: str, before: str, after: str = "") -> None:
        inner = getattr(owner, name)

        def call(*args):
            stamps(before)
            result = inner(*args)
            if after:
                stamps(after)
            return result
        setattr(owner, name, call)

    stamped(conn, "data_received", "node read", "node wrote engine")
    stamped(on, "parse_request", "node parse", "node parsed")
    stamped(conn, "_admit", "node admit", "node admitted")
    stamped(conn, "_to_engine", "node engine write")
    stamped(conn, "engine_data", "node engine in", "node wrote client")
    return True


STAGES = (("read", "client out", "node read"), ("parse", "node parse", "node parsed"),
          ("admission", "node admit", "node admitted"), ("dispatch, request head", "node admitted", "node engine write"),
          ("engine write", "node engine write", "node wrote engine"), ("engine", "node wrote engine", "node engine in"),
          ("write back", "node engine in", "node wrote client"), ("deliver", "node wrote client", "client in"))


async def measure(on, tls: bool, n: int) -> dict:
    stamps = Stamps()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Engine(stamps), "127.0.0.1", 0)
    engine_port = server.sockets[0].getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="otela-node-steps-")
    key_file = on.keygen(tmp)[0]
    cfg = on.Config(key=on.load_key(key_file), listen="127.0.0.1:0", gossip="127.0.0.1:0", leave_linger=0.05)
    if tls:
        cfg.tls_cert, cfg.tls_key = on.find_tunnel_tls(key_file)
    node = on.Node(cfg, models=["fake-model"], engine_url=f"http://127.0.0.1:{engine_port}")
    await node.start(serve_http=True)
    hooked = hook(on, stamps)
    host, port = node.registry.get(node.session_id)["addr"].rsplit(":", 1)
    extra = b"" if tls else b"%s: %s\r\n" % (node.tunnel_header[0].encode(), node.tunnel_header[1].encode())
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: n\r\n%scontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (extra, len(PROMPT), PROMPT))
    direct_request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-length: %d\r\n\r\n%s" % (
        len(PROMPT), PROMPT)
    ssl_kwargs = {"ssl": node.tunnel_client_ssl, "server_hostname": on.TLS_SERVER_NAME} if tls else {}
    _, via_node = await loop.create_connection(lambda: Client(stamps), host, int(port), **ssl_kwargs)
    _, direct = await loop.create_connection(lambda: Client(stamps), "127.0.0.1", engine_port)
    out: dict = {"tls": tls, "hooked": hooked}
    try:
        for _ in range(50):                         # warm up: the engine connection pooled, tables filled
            await via_node.one(request)
            stamps.at.clear()
        for label, gap in (("cold", COLD_GAP_S), ("warm", 0.0)):
            rows = {name: [] for name in ("to engine", "back", "direct to engine", "direct back")}
            rows.update({name: [] for name, _, _ in STAGES})
            for _ in range(n):
                for client, prefix, data in ((direct, "direct ", direct_request), (via_node, "", request)):
                    if gap:
                        await asyncio.sleep(gap)
                    stamps.at.clear()
                    await client.one(data)
                    at = stamps.at
                    rows[prefix + "to engine"].append(at["engine in"] - at["client out"])
                    rows[prefix + "back"].append(at["client in"] - at["engine out"])
                    if hooked and not prefix:
                        for name, start, end in STAGES:
                            rows[name].append(at[end] - at[start])
            figures = {name: statistics.median(v) * 1e6 for name, v in rows.items() if v}
            figures["node added"] = (figures["to engine"] + figures["back"] - figures["direct to engine"]
                                     - figures["direct back"])
            out[label] = figures

        async def batch():
            for _ in range(20):
                await via_node.one(request)
        traced: collections.Counter = collections.Counter()

        def trace(frame, event, arg):
            frame.f_trace_opcodes = True
            if event == "opcode":
                path = frame.f_code.co_filename
                name = os.path.basename(path)
                traced["otela_node.py" if name == "otela_node.py" else "bench" if name == "bench_node_steps.py"
                       else "asyncio" if os.sep + "asyncio" + os.sep in path
                       else "ssl" if name == "ssl.py" else "other"] += 1
            return trace

        sys.settrace(trace)
        try:
            await batch()
        finally:
            sys.settrace(None)
        out["steps"] = {name: count / 20 for name, count in sorted(traced.items())}
    finally:
        via_node.transport.close()
        direct.transport.close()
        await node.stop()
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.dirname(HERE), help="the checkout whose otela_node is measured")
    parser.add_argument("--n", type=int, default=200, help="requests per figure")
    parser.add_argument("--plain", action="store_true", help="the plain tunnel (header credential), not TLS")
    parser.add_argument("--uvloop", action="store_true", help="on uvloop, as `otela_node.py start` runs")
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.root))
    import otela_node as on
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    except (AttributeError, OSError):
        pass
    if args.uvloop:
        on.install_event_loop()
    result = asyncio.run(measure(on, not args.plain, args.n))
    result["root"] = os.path.abspath(args.root)
    print(f"node of {result['root']}, {'TLS' if result['tls'] else 'plain'} tunnel"
          f"{', uvloop' if args.uvloop else ''}: microseconds per request (median of {args.n})")
    names = [name for name in result["cold"]]
    print(f"{'':28}{'cold':>10}{'warm':>10}")
    for name in names:
        print(f"{name:28}{result['cold'][name]:10.1f}{result['warm'][name]:10.1f}")
    print("steps per request (interpreter instructions, by file): "
          + ", ".join(f"{name} {count:.0f}" for name, count in result["steps"].items()))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "node_steps.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
