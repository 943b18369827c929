"""Benchmark: work nobody waits for (issue 43, item 5). A flood of clients on emulated engines
(`otela_sim.py serve`), sent to the engines directly or through an ingress and a node per
engine; every client then closes its connection, and the engines' /metrics say how many
requests they still hold (vllm:num_requests_running + waiting) 5 s later, and when they held
none.

    .venv/bin/python tests/bench_abort.py [--engines 4] [--clients 1200] [--through-ingress]
        [--stream] [--hold 2] [--after 5]

Run it from another release's tree (its files, this script copied into its tests/) for the
figure before a change. Prints figures; asserts nothing."""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from conftest import ROOT, free_port, stop_process, wait_http

MODEL = "llama-3.1-8b"


def held(engines):
    """(running, waiting, aborted) summed over the engines' /metrics."""
    total = [0.0, 0.0, 0.0]
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_aborted_requests_total")
    for url in engines:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            for line in resp.read().decode().splitlines():
                name = line.split("{", 1)[0]
                if name in names:
                    total[names.index(name)] += float(line.rsplit(" ", 1)[1])
    return tuple(int(x) for x in total)


async def flood(targets, clients, stream, hold, token, before_close):
    """Open `clients` connections (client i to targets[i % len]; from 127.0.0.1-4: the ingress's
    per-address share), each sending one chat request; after `hold` seconds close them all.
    Returns the closing time."""
    auth = b"authorization: Bearer %s\r\n" % token.encode() if token else b""
    writers = []

    async def one(i):
        _, writer = await asyncio.open_connection(*targets[i % len(targets)], local_addr=(f"127.0.0.{1 + i % 4}", 0))
        body = json.dumps({"model": MODEL, "max_tokens": 1024, "stream": stream, "messages": [
            {"role": "user", "content": f"client {i}: " + " ".join(f"w{i}x{j}" for j in range(100))}]}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s"
                     b"content-length: %d\r\n\r\n%s" % (auth, len(body), body))
        writers.append(writer)
    for start in range(0, clients, 100):       # (a connect burst the backlog takes)
        await asyncio.gather(*(one(i) for i in range(start, min(clients, start + 100))))
    await asyncio.sleep(hold)
    before_close()
    for writer in writers:
        writer.close()
    return time.monotonic()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--clients", type=int, default=1200)
    ap.add_argument("--through-ingress", action="store_true")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--hold", type=float, default=2.0, help="seconds the clients wait before closing")
    ap.add_argument("--after", type=float, default=5.0, help="seconds after the close the engines are read")
    a = ap.parse_args()
    procs, cluster, tmp = [], None, tempfile.mkdtemp(prefix="bench-abort-")
    ports = [free_port() for _ in range(a.engines)]
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        if a.through_ingress:
            from test_ingress_support import Cluster
            cluster = Cluster(tmp)
            for i, port in enumerate(ports):
                cluster.node(f"sim{i}", f"{sys.executable} otela_sim.py serve --model {MODEL} --gpu H100 "
                             f"--port {port}", port, MODEL)
            targets, token = [("127.0.0.1", cluster.port)], cluster.token
        else:
            for port in ports:
                procs.append(subprocess.Popen([sys.executable, str(ROOT / "otela_sim.py"), "serve", "--model", MODEL,
                                               "--gpu", "H100", "--port", str(port)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for url, proc in zip(engines, procs):
                wait_http(url + "/health", timeout=60, proc=proc)
            targets, token = [("127.0.0.1", port) for port in ports], None
        aborted0 = held(engines)[2]
        at_close = []
        closed = asyncio.run(flood(targets, a.clients, a.stream, a.hold, token, lambda: at_close.append(held(engines))))
        running, waiting, _ = at_close[0]
        print(f"before the close: {running} running, {waiting} waiting "
              f"({'through the ingress' if a.through_ingress else 'direct'}, {a.clients} clients, "
              f"{'stream' if a.stream else 'plain'}, {a.engines} engine(s), after {a.hold:g} s)")
        none_at, said = None, False
        while True:                             # the engines read every 0.1 s from the close
            since = time.monotonic() - closed
            running, waiting, aborted = held(engines)
            if none_at is None and running + waiting == 0:
                none_at = since
            if not said and since >= a.after:
                said = True
                print(f"{a.after:g} s after every client closed: {running + waiting} requests held "
                      f"({running} running, {waiting} waiting), {aborted - aborted0} aborted")
            if said and none_at is not None or since > 120:
                break
            time.sleep(0.1)
        print(f"none held {none_at:.1f} s after the close" if none_at is not None else
              f"still {running + waiting} held 120 s after the close")
    finally:
        for proc in procs:
            stop_process(proc, 5)
        if cluster is not None:
            cluster.close()
        subprocess.run(["rm", "-rf", tmp], check=False)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
