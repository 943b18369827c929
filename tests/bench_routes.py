"""Pacing of a streamed route through the ingress (issue 42): when each server-sent event of a
Responses API stream (and of SGLang's native /generate) reaches the client, straight from the
engine and through the ingress, the engine sending one event every --delay seconds.

Prints, per route, each event's arrival time (ms after the request went out) direct and through
the ingress, and the difference at the first event and at the last. Never asserts on time.
Usage: python tests/bench_routes.py [--events 5] [--delay 0.5] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from fake_engine import free_port, spawn_fake_engine  # noqa: E402
from test_ingress_support import Stack  # noqa: E402


def arrivals(port: int, path: str, body: dict, key: str = "") -> list:
    """Milliseconds from the request's last byte to the arrival of each complete SSE event."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\nconnection: close\r\n"
            + (f"authorization: Bearer {key}\r\n" if key else "") + "\r\n").encode()
    times, seen, buf = [], 0, b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        start = time.perf_counter()
        sock.sendall(head + data)
        while True:
            piece = sock.recv(65536)
            if not piece:
                break
            buf += piece
            now = (time.perf_counter() - start) * 1000.0
            count = buf.count(b"\n\n")
            times += [now] * (count - seen)
            seen = count
            if buf.endswith(b"0\r\n\r\n"):
                break
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    engine = spawn_fake_engine(port, "--model", "m1", "--chunks", str(args.events), "--chunk-delay", str(args.delay))
    tmp = tempfile.mkdtemp()
    stack = Stack(os.path.join(tmp, "bench.sqlite"), native_routes=["/generate"])
    try:
        stack.call(stack.node.add_worker, f"127.0.0.1:{port}", ["m1"])
        key = stack.key()
        for path, body in (("/v1/responses", {"model": "m1", "input": "hi", "stream": True}),
                           ("/generate", {"text": "hi", "stream": True})):
            arrivals(stack.port, path, body, key)   # warm: the pooled connection
            direct = [arrivals(port, path, body) for _ in range(args.rounds)]
            through = [arrivals(stack.port, path, body, key) for _ in range(args.rounds)]
            d = [statistics.median(col) for col in zip(*direct)]
            t = [statistics.median(col) for col in zip(*through)]
            print(f"{path}: {len(d)} events, engine {args.delay * 1000:.0f} ms apart; median of {args.rounds}")
            print("  direct  ms: " + " ".join(f"{x:8.1f}" for x in d))
            print("  ingress ms: " + " ".join(f"{x:8.1f}" for x in t))
            print(f"  added: first event {t[0] - d[0]:+.2f} ms, last event {t[-1] - d[-1]:+.2f} ms")
    finally:
        stack.close()
        engine.terminate()
        engine.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
