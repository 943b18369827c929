"""The ingress's own work per proxied request and per SSE chunk, measured in process: no sockets,
no engine process, so it is stable on a busy machine where tests/bench_ingress.py is not.

Fake transports drive the protocol callbacks (a client connection, one pooled upstream connection)
through the whole request path: head parsed, routed, sent upstream, the answer's head and body
parsed, the answer written, the exchange booked (ledger row journalled, metrics, usage). Figures:
  - steps: interpreter instructions (sys.settrace opcode events) per request and per chunk: the
    same count every run, whatever the machine's load, so a change to the path is seen exactly;
  - us: wall time per request and per chunk (the best of several rounds), which still moves
    with the load but far less than a socket benchmark's.
SSE is measured twice: one chunk per read (a paced engine) and 16 chunks per read (a fast one).
With --phases, the plain request is also cut in four at its writes: A (the client's bytes to
the upstream write), T (what runs after that write, in the same callback, while the engine
works), B (the upstream's answer to the client write) and C (what runs after that write, in the
same callback): A and B are what a client waits for. Steps per phase, and wall time of A, B and C
warm (back to back) and
cold (after an idle gap of COLD_GAP_S, as the bench's 16 req/s leaves the CPU), the medians of
PHASE_SAMPLES requests, the process pinned to one CPU.
Run it from two checkouts to compare them. Prints a table and writes JSON to <--out>/ingress_steps.json.
Never asserts on time. Usage: python tests/bench_ingress_steps.py [--out bench-results] [--quick] [--phases]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from test_ingress_support import RecordingTransport, StandInNode  # noqa: E402

import otela_ingress  # noqa: E402

ADDR = "127.0.0.1:9"   # never connected to: the pool holds a fake connection to it
BODY = (b'{"id": "fake-1", "object": "chat.completion", "created": 1796166468, "model": "fake-model", '
        b'"choices": [{"index": 0, "message": {"role": "assistant", "content": "tok0 tok1 tok2 tok3 "}, '
        b'"finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}')
ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-fake-engine: 1\r\n\r\n%s"
          % (len(BODY), BODY))   # tests/fake_engine.py's head
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNKS = 500           # per stream, like the bench's "bulk" engine
COLD_GAP_S = 0.06      # the idle time before each request at the bench's 16 req/s (10 ms already
                       # costs the full cold penalty)
PHASE_SAMPLES = 60     # requests per phase timing (cold: 60 x 60 ms, about 4 s)


def request(key: str, stream: bool) -> bytes:
    body = json.dumps({"model": "fake-model", "stream": stream,
                       "messages": [{"role": "user", "content": "say hello to the benchmark"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer %s\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (key.encode(), len(body), body))


def stream_chunks(n: int) -> list:
    chunks = []
    for i in range(n):
        event = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"fake-model",'
                 b'"choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}]}\n\n' % i)
        chunks.append(b"%x\r\n%s\r\n" % (len(event), event))
    event = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"fake-model","choices":[],'
             b'"usage":{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":9}}\n\ndata: [DONE]\n\n' % n)
    chunks.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
    return chunks


class PhaseTransport(RecordingTransport):
    """A transport whose write marks the end of a phase: `phase` moves to `then`, the time is kept."""

    def __init__(self, phase: list, then: str):
        super().__init__()
        self.phase, self.then, self.at = phase, then, 0.0

    def write(self, data):
        self.out.append(data)
        if self.phase[0] != self.then:
            self.at = time.perf_counter()
            self.phase[0] = self.then


def phase_figures(client, proto, plain: bytes, phase: list, client_transport, up_transport) -> dict:
    """Steps of phases A, T, B and C of one plain request, and warm/cold microseconds of A, B, C."""
    counts = {"A": 0, "T": 0, "B": 0, "C": 0}

    def one():
        phase[0] = "A"
        client.data_received(plain)
        if phase[0] == "A":
            raise RuntimeError("the request did not reach the upstream (the request path changed?)")
        phase[0] = "B"
        t1 = time.perf_counter()
        proto.data_received(ANSWER)
        t3 = time.perf_counter()
        phase[0] = "-"
        client_transport.out.clear()
        up_transport.out.clear()
        return up_transport.at, t1, client_transport.at, t3

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode" and phase[0] in counts:
            counts[phase[0]] += 1
        return trace

    runs = 50
    sys.settrace(trace)
    try:
        for _ in range(runs):
            one()
    finally:
        sys.settrace(None)
    out = {f"steps_phase_{p}": counts[p] / runs for p in "ATBC"}
    for label, gap in (("warm", 0.0), ("cold", COLD_GAP_S)):
        times = {"A": [], "B": [], "C": []}
        for _ in range(PHASE_SAMPLES):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            t_up, t1, t_client, t3 = one()
            times["A"].append(t_up - t0)
            times["B"].append(t_client - t1)
            times["C"].append(t3 - t_client)
        for p in "ABC":
            out[f"us_phase_{p}_{label}"] = statistics.median(times[p]) * 1e6
        out[f"us_phase_AB_{label}"] = out[f"us_phase_A_{label}"] + out[f"us_phase_B_{label}"]
    return out


def steps(fn, runs: int) -> float:
    """Interpreter instructions per call of fn."""
    count = [0]

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(runs):
            fn()
    finally:
        sys.settrace(None)
    return count[0] / runs


async def measure(quick: bool, phases: bool = False) -> dict:
    tmp = tempfile.mkdtemp(prefix="otela-steps-")
    db = os.path.join(tmp, "usage.sqlite")
    conn = otela_ingress.open_db(db)
    _, key = otela_ingress.create_key(conn, "bench")
    conn.close()
    node = StandInNode()
    node.add_worker(ADDR, ["fake-model"])
    ingress = otela_ingress.Ingress(node, db_path=db)
    await ingress.start("127.0.0.1", 0)
    try:
        loop = asyncio.get_running_loop()
        phase = ["-"]   # --phases: which phase of a plain request runs (see phase_figures)
        client, client_transport = otela_ingress._Client(ingress), PhaseTransport(phase, "C")
        client.connection_made(client_transport)
        proto, up_transport = otela_ingress._UpstreamProtocol(loop), PhaseTransport(phase, "T")
        proto.connection_made(up_transport)
        ingress.pool._idle[ADDR] = [otela_ingress.Upstream(ADDR, up_transport, proto)]
        plain, streamed = request(key, False), request(key, True)
        chunks = stream_chunks(CHUNKS)
        grouped = [b"".join(chunks[i:i + 16]) for i in range(0, len(chunks), 16)]

        def one():
            client.data_received(plain)
            proto.data_received(ANSWER)
            client_transport.out.clear()
            up_transport.out.clear()

        def stream(reads):
            client.data_received(streamed)
            proto.data_received(STREAM_HEAD)
            for read in reads:
                proto.data_received(read)
            client_transport.out.clear()
            up_transport.out.clear()

        for _ in range(50):
            one()
        stream(chunks)
        if not ingress.pool._idle.get(ADDR) or client.busy:
            raise RuntimeError("the driven request did not complete (the request path changed?)")
        n, rounds = (1000, 3) if quick else (3000, 7)
        per_chunk = len(chunks)
        out = {
            "steps_per_request": steps(one, 100),
            "us_per_request": min(timeit.repeat(one, number=n, repeat=rounds)) / n * 1e6,
            "steps_per_chunk_1_per_read": steps(lambda: stream(chunks), 2) / per_chunk,
            "us_per_chunk_1_per_read": min(timeit.repeat(lambda: stream(chunks), number=5, repeat=rounds))
            / 5 / per_chunk * 1e6,
            "steps_per_chunk_16_per_read": steps(lambda: stream(grouped), 2) / per_chunk,
            "us_per_chunk_16_per_read": min(timeit.repeat(lambda: stream(grouped), number=5, repeat=rounds))
            / 5 / per_chunk * 1e6,
        }
        if phases:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # one CPU, as the bench pins
            out.update(phase_figures(client, proto, plain, phase, client_transport, up_transport))
    finally:
        await ingress.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    out["loadavg"] = os.getloadavg()[0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
    parser.add_argument("--phases", action="store_true",
                        help="also steps and warm/cold us of a plain request's phases (A, T, B, C)")
    args = parser.parse_args()
    result = asyncio.run(measure(args.quick, args.phases))
    for name, value in result.items():
        print(f"{name:32} {value:10.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ingress_steps.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {os.path.join(args.out, 'ingress_steps.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
