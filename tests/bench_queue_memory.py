"""Memory of the ingress's fair queue: N requests waiting from K keys, measured in-process.

    .venv/bin/python tests/bench_queue_memory.py [--requests 10000] [--keys 1000] [--tokens 64:1024]

What one waiting request holds, built as Ingress._wait builds it: its body as received (a chat
request of the workload's shape, its prompt uniform in --tokens tokens), the header fields, the
parsed JSON the TTFT policy reads (RoutedRequest.body) and its memo (the prompt's block chain),
the candidates it may go to (its own list of shared Candidate objects), the closure that sends
it and its Waiting entry in the FairQueue's lanes, plus the queue's per-key and per-tenant
books. Not counted: the client's connection (its transport and buffers exist whether the
request waits or not, and are held by the connection limits, MAX_CONNECTIONS and ADDRESS_SHARE).
Prints the bytes traced (tracemalloc) in all, per request beyond its body, and against the
bodies' bytes; never asserts.
"""
import argparse
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import workload  # noqa: E402

import crdt  # noqa: E402
import otela_ingress  # noqa: E402
import otela_node  # noqa: E402
from otela_ingress import Candidate, FairQueue, Key, Limits, RoutedRequest, Waiting  # noqa: E402

MODEL = "Llama-3.1-8B-Instruct"


def bodies(n, low, high, seed=7):
    """n request bodies as a client sends them (workload._body's JSON, bytes)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        req = {"messages": [{"role": "user", "content": workload.text(rng.randint(low, high), rng)}],
               "max_tokens": 128}
        body, _ = workload._body(MODEL, req, None)
        out.append(json.dumps(body).encode())
    return out


def fill(queue, keys, raw, candidates, secret):
    """Queue one request per body, keys in turn, as Ingress._wait holds it."""
    now = time.monotonic()
    for i, body in enumerate(raw):
        key = keys[i % len(keys)]
        fields = {b"host": b"ingress.example.org", b"authorization": b"Bearer sk-otela-" + b"x" * 43,
                  b"content-type": b"application/json", b"content-length": str(len(body)).encode(),
                  b"user-agent": b"OpenAI/Python 1.54.0", b"accept": b"text/event-stream"}
        request = crdt.loads(body)
        routed = RoutedRequest(MODEL, key.user, key.id, True, "/v1/chat/completions", now, request)
        text = otela_node.prompt_text(request)
        routed.memo = otela_ingress._Pick(otela_node.prompt_chain(text, secret), len(text.encode()))
        left = list(candidates)

        def send(fields=fields, body=body, routed=routed, key=key, left=left):   # (what _wait's closure holds)
            return (fields, body, routed, key, left)
        entry = Waiting(queue, send, key, 1, now, len(body), MODEL, None)
        if queue.refusal(key, len(body)) is not None:
            raise SystemExit("a queue bound refused the fill: raise it with the flags")
        queue.add(entry)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--tokens", default="64:1024", help="prompt tokens per request, low:high (uniform)")
    a = p.parse_args()
    low, high = (int(x) for x in a.tokens.split(":"))
    keys = [Key.of_record(f"{i:064x}", crdt.key_record(f"k{i}", f"user{i}", 0.0)) for i in range(a.keys)]
    candidates = [Candidate(f"s{i}", {"models": [MODEL], "addr": f"10.0.0.{i}:7700"}) for i in range(4)]
    raw = bodies(a.requests, low, high)
    body_bytes = sum(len(b) for b in raw)
    limits = Limits(queue_max=a.requests, queue_max_per_key=a.requests, queue_max_bytes=2 * body_bytes,
                    queue_key_bytes=2 * body_bytes)
    queue = FairQueue(limits, {})
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    fill(queue, keys, raw, candidates, b"k" * 32)
    after = tracemalloc.take_snapshot()
    traced = sum(s.size_diff for s in after.compare_to(before, "filename"))
    tracemalloc.stop()
    held = traced + body_bytes   # (the bodies were made before the trace began: they count too)
    out = {"requests": a.requests, "keys": a.keys, "prompt_tokens": [low, high], "body_bytes": body_bytes,
           "traced_bytes_beyond_bodies": traced, "held_bytes": held,
           "per_request_beyond_body": round(traced / a.requests), "held_per_body_byte": round(held / body_bytes, 2)}
    print(json.dumps(out))
    print(f"{a.requests} waiting from {a.keys} keys: {held / 2**20:.1f} MiB held, {body_bytes / 2**20:.1f} MiB of "
          f"it bodies; {traced / a.requests / 1024:.1f} KiB per request beyond its body")


if __name__ == "__main__":
    main()
