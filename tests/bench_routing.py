"""Benchmark of routing (issue 28): otela's ingress policies against sglang-router and
vllm-router, side by side in one run, in front of identically configured engines.

    .venv/bin/python tests/bench_routing.py [--out bench-results] [--full | --quick] [--llamacpp]
        [--time-scale K] [--count N] [--duration S] [--routers DIR]

Engines: ENGINES x `otela_sim.py serve --model Llama-3.1-8B-Instruct --gpu H100 --engine vllm-v1
--time-scale K`: emulated H100s slowed K times, so that the fleet at load runs at 1/K of the
request rate with the same queues and cache hits, and the box's CPUs stay with the proxies
measured. Every policy run gets a fresh fleet (cold caches, empty queues):
  otela   each engine wrapped by `otela_node.py start --process "... --port {port}"`, joined to
          `otela_ingress.py serve --policy P` (two ingresses on the same overlay for the
          two-ingress case, the client alternating between them)
  peers   the router binary (sglang-router 0.3.2, vllm-router; installed by this bench into
          .cache/routers with pip when missing, else "skipped: <reason>") given the engines'
          own URLs (two router processes, each given every engine, for the two-ingress case:
          they share nothing)
Workloads (tests/workload.py, streamed with usage, a session key per group or chat):
shared-prefix (64 groups x 16 prompts, 2,048-token system prompt, 128-token question, 256-token
output), multi-turn chat, and the "reasoning" (~90 % reusable prefix) and "instruct" (~15 %)
presets; agentic (issue 44): tool-calling loops (workload.agent_loops: contexts growing to 16-32k
tokens, tool outputs of 200-8,000 tokens, each turn 0-2 s after the last answer, a session key per
loop), alone and beside multi-turn chat (one ingress beside it with --full only), through one and two
ingresses/routers, against
sglang's cache_aware and vllm's consistent_hash (and, not --quick, otela's ttft with --no-queue: what
the fair queue's wait costs the turns, a diagnosis); alternating: 48 chats of 4 turns on 4 engines,
turns 0 or 0.3 s apart alternating over 1, 2 and 4 ingresses, with and without prompt_cache_key
(its hit rate and TTFT p99 of turns 2+ against one ingress's); warm (issue 44 item 3, otela
only): agent loops beside one tenant's flood of cold requests through one ingress whose fair
queue holds the flood, FairQueue's warm-turn rule on and off (WARM_*; at K = WARM_TIME_SCALE
unless --time-scale says another than the default); Poisson arrivals at a share of the
fleet's capacity for that workload, MEASURED first in
the same run: a fresh fleet at time scale 1, requests not streamed (the engines sleep through
their steps), the client round-robin over the engines with CAPACITY_INFLIGHT requests in flight
per engine for CAPACITY_S; the tokens the engines generated (their /metrics) in its last two
thirds per second, over the workload's output per request; divided by K for the runs.
Cases: default 80 % load, every workload, one ingress, plus two ingresses for shared-prefix and
multi-turn;
--full adds 50 % and 100 % and two ingresses everywhere; --quick is a smoke run (few requests,
two policies, small loops). A kill case: shared-prefix through otela's `ttft` (least_loaded until it
exists), one node and its engine SIGKILLed at 40 % of the arrivals: client errors and the
hit rate of the requests sent after the kill. A confirmation case (--llamacpp; in the default
run when the real engine is installed, `make engine`): 2 real llama.cpp servers (SmolLM2-135M,
a context that holds fewer prefixes than the workload has) behind the same policies, the summed
timings.cache_n / (cache_n + prompt_n) and TTFT.

Per policy and case: TTFT p50/p99, end-to-end p99 (wall ms at time scale K: divide by K for
the GPU's), output tokens/s (wall), cache hit rate (sum of usage cached_tokens / sum of prompt
tokens), errors; and the ratios issue 28's targets name, beside the workload's reusable share
(the hit rate of a cache that never evicts: what no placement can beat), and, where otela's
`ttft` and sglang's `cache_aware` hit the same (within half a point), their TTFT p50 apart (the
same engine work: what the path adds). Each TTFT is also split where it was spent (the emulators'
--request-log, matched by response id): at the engine (queue and prefill: what placement
decides) and on the path (the rest: connecting, the proxies); and beside it a floor under the
TTFT p99 at the engines for the placement as it ran (engine_floor_ms: each request's own step
beside the streams its engine held, after the rest of the step in progress). The kill case
adds the ingress's retries, streams continued elsewhere and streams cut. Prints a table, writes
<out>/routing.json; never asserts. Loopback only; every process started is stopped (its
process group) and every temporary folder removed, on Ctrl-C and failure too.
"""
import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import workload  # noqa: E402
from conftest import ENGINE_DIR, ENGINE_MODEL, ENGINE_PYTHON, ENGINE_SERVE, free_port  # noqa: E402
from test_ingress_support import child_pids  # noqa: E402

import otela_ingress  # noqa: E402
import otela_sim as sim  # noqa: E402

MODEL, GPU, ENGINE = "meta-llama/Llama-3.1-8B-Instruct", "H100", "vllm-v1"
ENGINES = 8
# K: 8 emulated H100s at 80 % load stream ~19k tokens/s (shared prefix); each token is a write
# and a read in the engine, the node, the ingress and the client, so the fleet is slowed until
# that fits in part of this box's two shared cores: at K = 5, 400 requests through otela's
# ingress and nodes took ~0.6 cores (0.4 through a peer router), at K = 10 ~0.3.
TIME_SCALE = 5.0
# otela's own policies, then those that exist in otela_ingress.POLICIES when the bench runs
# (`ttft`: the cache- and queue-aware estimate of issue 28, the default-to-be)
OTELA_BASE = ["least_loaded", "round_robin"]
OTELA_POLICIES = ["ttft"]
# the peers: (name, console script, its --policy); installed from PyPI into ROUTERS_DIR
PEERS = [("sglang cache_aware", "sglang-router", "cache_aware"), ("sglang round_robin", "sglang-router", "round_robin"),
         ("vllm cache_aware", "vllm-router", "cache_aware"), ("vllm consistent_hash", "vllm-router", "consistent_hash")]
ROUTER_SPECS = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
ROUTERS_DIR = ROOT / ".cache" / "routers"
# the workloads: name -> its requests for a seed (the runs use seed 0, capacity fresh seeds)
WORKLOADS = {
    "shared_prefix": lambda seed: workload.shared_prefix(64, 16, system_len=2048, question_len=128, output_len=256,
                                                         seed=seed),
    # 125 chats of 6 turns (messages of 120 tokens, answers of 120): turn k's prompt holds turn
    # k-1's. Turns go out chat by chat, so with a number of chats divisible by the engines round
    # robin would send every turn of a chat to the same engine (128 chats: its hit rate was
    # cache_aware's); 125 moves each chat 5 engines on per turn
    "multi_turn": lambda seed: workload.multi_turn(125, 6, message_len=120, output_len=120, seed=seed),
    "reasoning": lambda seed: workload.preset("reasoning", seed, prompts=128),
    "instruct": lambda seed: workload.preset("instruct", seed, prompts=128),
}
LOADS_DEFAULT, LOADS_FULL = (0.8,), (0.5, 0.8, 1.0)
# the agentic workload (issue 44): tool-calling loops (workload.agent_loops: contexts growing to
# 16-32k tokens, turns 0-2 s after the answer), started within AGENT_START_S, alone and beside
# multi-turn chat at AGENT_CHAT_LOAD of its capacity, through one and two ingresses/routers,
# against the peers named here; each loop has a session key (vllm's consistent_hash reads it)
AGENT_LOOPS, AGENT_START_S, AGENT_CHAT_LOAD, AGENT_TOOL_LENS = 24, 20.0, 0.4, (200, 8000)
AGENT_PEERS = ("sglang cache_aware", "vllm consistent_hash")
# beside otela's `ttft` (not --quick): the same with --no-queue, a diagnosis, not a contender: what
# the ingress's fair queue costs these turns (its wait is on the path, engine_side's split)
AGENT_DIAGNOSIS = {"otela ttft no-queue": ("--no-auth", "--no-queue")}
# issue 44's alternating case: 48 chats of 4 turns on 4 engines, a 600-token system prompt each,
# the next turn 0 or 0.3 s after the answer, turns alternating over 1, 2 and 4 ingresses, with
# and without prompt_cache_key (sglang's cache_aware through one router beside them)
ALTERNATING = {"conversations": 48, "turns": 4, "system_len": 600}
ALTERNATING_ENGINES, ALTERNATING_GAPS, ALTERNATING_START_S = 4, (0.0, 0.3), 10.0
# issue 44 item 3, the warm case: agent loops beside a flood of cold requests (no shared prefix)
# at WARM_FLOOD x the fleet's capacity for the flood's shape, through ONE ingress whose fair
# queue holds the flood back (its sessions full), FairQueue's warm-turn rule on and off (first
# come first served within the tenant), WARM_REPEATS times each, alternating. Under --no-auth
# every request is one tenant of one class, so only that rule orders them. The ingress's queue
# clocks (QUEUE_WAIT_S, QUEUE_AGE_S, QUEUE_TIMEOUT_S) are scaled by K: the same policy in GPU
# time as at K = 1. The flood's backlog grows to ~4 s of GPU time (2x capacity for 4 s), under
# QUEUE_AGE_S; each WARM_AGES_S (GPU seconds) is run, the second shorter than the backlog, as
# a flood that outlasts QUEUE_AGE_S is (the rule lets an aged cold request go first). The
# engines' KV is cut to WARM_KV_TOKENS so that the flood's prefill turns the cache over within
# the run (~1-2 s of GPU time: an H100's 409k tokens take ~20 s, longer than a run), which is
# what a long flood does to a turn that waits behind it: its context evicted. Loops of 4-8k
# tokens with 16-token tool calls, so that their turns fall inside the flood
# Measured (8 agent loops beside a cold flood at 2x the capacity of 4 emulated H100s, one tenant,
# one ingress, two runs each): while the flood's backlog (~4 s of GPU time) stays under QUEUE_AGE_S
# the turns' TTFT p99 is 2.6-3.1 s against 41-44 s first come first served (p50 1.3 s against
# 0.6-7.2 s), the flood's throughput the same (194-207 against 208-210 tokens/s); the hit rate is no
# better (0.48-0.54 against 0.54-0.58: the flood turns a small cache over between turns either way).
# Once the backlog outlasts QUEUE_AGE_S (a tenth of it) the aged cold requests go first again and a
# turn waits behind all of them: p99 36-42 s against 42-47 s (p50 0.6-0.7 s against 2.4-8.9 s).
WARM_ENGINES, WARM_KV_TOKENS, WARM_FLOOD, WARM_REPEATS, WARM_TIME_SCALE = 4, 32768, 2.0, 2, 10.0
WARM_AGES_S = (otela_ingress.QUEUE_AGE_S, otela_ingress.QUEUE_AGE_S / 10)
WARM_LOOPS = dict(loops=8, context=(4000, 8000), tool_lens=(200, 2000), call_len=16, gaps=(0.0, 2.0))
WARM_FLOOD_SHAPE = dict(prompt=1024, output=16)   # tokens in and out of each cold request
WARM_START_S, WARM_DURATION_S = 5.0, 40.0         # loops started within; the flood's seconds (wall)
# the ingress run with the rule off: otela_ingress's main, FairQueue._warm_first cleared first
WARM_OFF = "import sys, otela_ingress; otela_ingress.FairQueue._warm_first = False; sys.exit(otela_ingress.main())"
EXTRA_WORKLOADS = ("agentic", "alternating", "warm")
# capacity: requests in flight per engine (above the ~128 that an H100's KV holds at 2-4k
# tokens, so each engine's queue never runs dry) and the seconds it runs (three waves of the
# slowest workload at time scale 1)
CAPACITY_INFLIGHT, CAPACITY_S = 160, 24.0
# a run: at most this many requests, sent within this many seconds, each answered within
# REQUEST_TIMEOUT_S (wall; a 256-token answer at time scale 5 under load takes ~15-25 s); 400
# shared-prefix requests are ~6 of each group's 16 (at most ~80 % of prompt tokens reusable)
RUN_COUNT, RUN_DURATION_S, REQUEST_TIMEOUT_S = 400, 30.0, 240.0
KILL_AT = 0.4                # the kill case: the node dies at this share of the arrivals
READY_S = 180.0              # a fleet's processes up and routable within this (a loaded box)
# the llama.cpp confirmation: 2 servers of 2 slots, 512 tokens each (-c 1024): 4 cached
# prefixes at most, against 6 groups of ~300-token prompts; one thread each
LLAMA_SERVERS, LLAMA_CTX, LLAMA_SLOTS, LLAMA_MODEL = 2, 1024, 2, "smollm2-135m"
LLAMA_RATE = 0.4             # req/s: a miss is ~1-3 s of one CPU thread, a hit a fraction


# --- processes: everything started is in one list, stopped by process group ----------------

class Processes:
    """Processes started in their own process groups, logs in a temporary folder; stop()
    ends them all (SIGTERM to each group, SIGKILL after a grace), and the folder with them."""

    def __init__(self, label):
        self.tmp = tempfile.mkdtemp(prefix=f"otela-bench-routing-{label}-")
        self.procs = []
        self.orphans = []            # engines whose node was SIGKILLed (their own group)

    def spawn(self, name, argv, env=None):
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(ROOT), start_new_session=True, env=env)
        log.close()
        proc.name = name
        self.procs.append(proc)
        return proc

    def check(self):
        for proc in self.procs:
            if proc.poll() is not None and not getattr(proc, "killed", False):
                raise RuntimeError(f"{proc.name} exited with {proc.returncode}: {self.tail(proc.name)}")

    def tail(self, name, n=600):
        try:
            with open(os.path.join(self.tmp, f"{name}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace=10.0):
        for proc in reversed(self.procs):
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in self.orphans:
            _signal_group(pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def http_get(url, timeout=3.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read()


def wait_until(ready, what, procs, timeout=READY_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        try:
            if ready():
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready within {timeout:g} s")


# --- fleets -------------------------------------------------------------------------------------

def sim_command(scale, port="{port}", log=None, kv_tokens=None):
    """An emulated engine; `log`: the file its requests' engine-side times are appended to;
    `kv_tokens`: its KV pool (default: the GPU's)."""
    return [sys.executable, str(ROOT / "otela_sim.py"), "serve", "--model", MODEL, "--gpu", GPU, "--engine", ENGINE,
            "--time-scale", f"{scale:g}", "--port", str(port)] + (["--request-log", log] if log else []) + \
        (["--kv-tokens", str(kv_tokens)] if kv_tokens else [])


def llama_command(port="{port}"):
    return [str(ENGINE_PYTHON), str(ENGINE_SERVE), "-m", str(ENGINE_MODEL), "--alias", LLAMA_MODEL, "--host",
            "127.0.0.1", "-c", str(LLAMA_CTX), "-np", str(LLAMA_SLOTS), "-t", "1", "--port", str(port)]


def start_engines(procs, command, n):
    """n engines straight on loopback (the peers' fleet); their URLs once each answers /health."""
    urls = []
    for i in range(n):
        port = free_port()
        procs.spawn(f"engine{i}", command(port))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_until(lambda url=url: http_get(url + "/health")[0] == 200, f"engine {url}", procs)
    return urls


def start_otela(procs, command, n, model, policy, ingresses=1, flags=("--no-auth",), warm_first=True):
    """otela's fleet: `ingresses` ingresses on one overlay (--policy, and `flags`), n nodes wrapping
    the engine command; their URLs once each ingress routes `model` to all n. `warm_first` False:
    the ingresses' fair queue without its warm-turn rule (WARM_OFF). Returns (urls, nodes)."""
    node_py, ingress_py = str(ROOT / "otela_node.py"), str(ROOT / "otela_ingress.py")
    subprocess.run([sys.executable, node_py, "keygen", "--out", procs.tmp], check=True, capture_output=True,
                   timeout=60)
    key = os.path.join(procs.tmp, "cluster.key")
    urls, gossip = [], []
    for i in range(ingresses):
        port, g = free_port(), free_port()
        argv = [sys.executable, *((ingress_py,) if warm_first else ("-c", WARM_OFF)), "serve", "--key-file", key, "--listen", f"127.0.0.1:{port}",
                "--gossip", f"127.0.0.1:{g}", "--db", os.path.join(procs.tmp, f"ingress{i}.sqlite"),
                "--policy", policy, *flags, "--max-connections", "16384"]
        if gossip:
            argv += ["--bootstrap", gossip[0]]
        procs.spawn(f"ingress{i}", argv)
        urls.append(f"http://127.0.0.1:{port}")
        gossip.append(f"127.0.0.1:{g}")
    engine = " ".join(shlex.quote(a) for a in command())
    nodes = []
    for i in range(n):
        grant = os.path.join(procs.tmp, f"node{i}.grant")   # the login node's grant for each job
        subprocess.run([sys.executable, ingress_py, "grant", "--key-file", key, "--model", model, "--job", f"node{i}",
                        "--out", grant], check=True, capture_output=True, timeout=60)
        nodes.append(procs.spawn(f"node{i}", [sys.executable, node_py, "start", "--key-file", key,
                                              "--grant-file", grant, "--bootstrap", gossip[0], "--listen", f"127.0.0.1:{free_port()}",
                                              "--gossip", f"127.0.0.1:{free_port()}", "--process", engine]))

    def serving(url):
        view = json.loads(http_get(url + "/v1/registry")[1])
        return sum(1 for s in view["sessions"] if s["state"] == "SERVING" and not s.get("suspected")
                   and model in s.get("models", []))
    for url in urls:
        wait_until(lambda url=url: serving(url) == n, f"{n} nodes serving at {url}", procs)
    return urls, nodes


def routers_dir(wanted):
    """The folder holding the routers' console scripts: installed there with pip when missing.
    Returns (dir, {script: reason it is missing})."""
    missing = {}
    env_dir = os.environ.get("OTELA_ROUTERS")
    d = Path(wanted or env_dir or ROUTERS_DIR)
    need = [s for s in ROUTER_SPECS if not (d / "bin" / s).exists()]
    if need and not wanted and not env_dir:
        print(f"routers: installing {', '.join(ROUTER_SPECS[s] for s in need)} into {d} (pip, once)")
        try:
            if not (d / "bin" / "pip").exists():
                subprocess.run([sys.executable, "-m", "venv", str(d)], check=True, capture_output=True, timeout=300)
            for script in need:
                done = subprocess.run([str(d / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                                       ROUTER_SPECS[script]], capture_output=True, text=True, timeout=900)
                if done.returncode:
                    missing[script] = f"pip install {ROUTER_SPECS[script]} failed: " + \
                        (done.stderr.strip().splitlines() or ["?"])[-1]
        except (OSError, subprocess.SubprocessError) as exc:
            for script in need:
                missing.setdefault(script, f"cannot make a venv at {d}: {exc}")
    for script in ROUTER_SPECS:
        if script not in missing and not (d / "bin" / script).exists():
            missing[script] = f"no {d / 'bin' / script}"
    return d, missing


def start_router(procs, rdir, script, policy, workers, name):
    port = free_port()
    # through the venv's python: a console script's first line names the folder the venv was
    # made in, and a venv moved (or reached through another path) keeps that stale name
    argv = [str(rdir / "bin" / "python"), str(rdir / "bin" / script)] + \
        (["launch"] if script == "sglang-router" else []) + [
        "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--prometheus-port", str(free_port()),
        "--log-level", "error", "--worker-urls", *workers]
    procs.spawn(name, argv)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_get(url + "/health")[0] == 200, f"{script} --policy {policy}", procs)
    return url


# --- measuring ----------------------------------------------------------------------------------

def percentile(values, p):
    """Nearest-rank percentile, None for no values."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(p * len(values) + 0.5) - 1))]


def complete(r):
    """Answered 200 with every token asked for (each engine here generates max_tokens: the
    emulator always, llama.cpp with ignore_eos); a stream cut short ends like a whole one on
    the wire (a proxy closes it cleanly), so its tokens are what tell."""
    done = max(r.get("tokens") or 0, ((r.get("usage") or {}).get("completion_tokens") or 0))
    return r.get("status") == 200 and r.get("tokens", 0) > 0 and done >= (r.get("asked") or 1)


def why(r):
    if r.get("status") == 200:
        return f"cut short: {r.get('tokens')} of {r.get('asked')} tokens"
    return str(r.get("error") or f"{r.get('status')} {r.get('body', '')}")[:160]


def figures(records):
    """TTFT p50/p99, e2e p99 (ms), output tokens/s (from the first send to the last token),
    hit rate and errors (a request not complete()) of one run's records."""
    ok = [r for r in records if complete(r)]
    failed = [r for r in records if not complete(r)]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    e2e = [r["e2e"] for r in ok]
    cached = sum((r.get("cache_n") if r.get("cache_n") is not None else r.get("cached_tokens")) or 0 for r in ok)
    prompt = sum(((r["cache_n"] + r["prompt_n"]) if r.get("cache_n") is not None else r.get("prompt_tokens")) or 0
                 for r in ok)
    span = max((r["at"] + r["e2e"] for r in ok), default=0.0) - min((r["at"] for r in ok), default=0.0)

    def ms(x):
        return None if x is None else x * 1e3
    return {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
            "ttft_p50_ms": ms(percentile(ttft, 0.5)), "ttft_p99_ms": ms(percentile(ttft, 0.99)),
            "e2e_p99_ms": ms(percentile(e2e, 0.99)),
            "output_tok_s": sum(r["tokens"] for r in ok) / span if span > 0 else None,
            "hit_rate": cached / prompt if prompt else None, "prompt_tokens": prompt, "cached_tokens": cached,
            "error_kinds": sorted({why(r) for r in failed})[:5]}


def engine_side(records, log, scale):
    """A client's TTFT split where it was spent: at the engine (the emulator's --request-log: from
    the request's last byte read to its first token, queue and prefill) and on the path (the
    client's TTFT less that: connecting, the proxies both ways). Requests found by their id
    (the engine's; a stream continued elsewhere keeps the first engine's, whose line a killed
    engine never wrote); p50 and p99 of each, ms."""
    try:
        with open(log) as f:
            engine = {e["id"]: e for e in map(json.loads, f) if e.get("ttft_ms") is not None}
    except (OSError, ValueError):
        return {}
    ok = [r for r in records if complete(r) and r.get("ttft") is not None and r.get("id") in engine]
    if not ok:
        return {}
    lines = [engine[r["id"]] for r in ok]
    at_engine, path = [e["ttft_ms"] for e in lines], [r["ttft"] * 1e3 - e["ttft_ms"] for r, e in zip(ok, lines)]
    return {"engine_ttft_p50_ms": percentile(at_engine, 0.5), "engine_ttft_p99_ms": percentile(at_engine, 0.99),
            "path_p50_ms": percentile(path, 0.5), "path_p99_ms": percentile(path, 0.99), "engine_matched": len(ok),
            "engine_floor_p99_ms": engine_floor_ms(list(engine.values()), scale)}


def engine_floor_ms(lines, scale):
    """A floor under the TTFT p99 at the engines of the placement as it ran (every request on
    the engine it got, beside the streams that engine held when it arrived), from the engines'
    --request-log lines (the engine is the emulator's tag in the id) and their own step cost.
    A request arriving while its engine runs n >= 1 streams waits out the rest of the step in
    progress, a decode step D(n) at least, the wait uniform over it (Poisson arrivals at a
    random point of the step), then its own step S: its new tokens beside those n decodes (vLLM
    schedules running decodes first). So it takes x or more with probability at least
    min(1, max(0, (S + D - x) / D)); the p99 is at least the largest x whose probabilities,
    averaged over the requests, reach 1 %. It bounds what a faster path, or a smarter choice
    among engines in the same state, could give this placement; not another placement. Wall
    ms at time scale `scale`; None without lines."""
    if not lines:
        return None
    cost = sim.serve_core(MODEL, GPU, engine=ENGINE).cost
    engines = [e["id"].rsplit("-", 1)[0] for e in lines]      # an engine is its ids' tag
    spans = {}                                 # engine -> (arrived, ended, prompt tokens) of its requests
    for engine, e in zip(engines, lines):
        spans.setdefault(engine, []).append((e["arrived"], e["arrived"] + (e["e2e_ms"] or 0) / 1e3,
                                             e["prompt_tokens"]))
    bounds = []                                # (S, D) per request, seconds at full speed
    for engine, e in zip(engines, lines):
        start = e["arrived"]
        beside = [tokens for a, b, tokens in spans[engine] if a < start < b]
        n, ctx = len(beside), sum(beside)      # the streams its engine held, their prompts' context
        new, cached = e["prompt_tokens"] - e["cached_tokens"], e["cached_tokens"]
        decode = cost.step(n, n, decode_ctx=ctx) if n else 0.0
        own = cost.step(n + new, n + 1, decode_ctx=ctx, prefill_pairs=new * (cached + (new + 1) / 2),
                        prefill_tokens=new)
        bounds.append((own, decode))

    def share(x):                              # the share of requests taking x or more, at least
        return sum((1.0 if s >= x else 0.0) if d == 0 else min(1.0, max(0.0, (s + d - x) / d))
                   for s, d in bounds) / len(bounds)
    lo, hi = 0.0, max(s + d for s, d in bounds)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) >= 0.01 else (lo, mid)
    return lo * scale * 1e3


def metric_sums(urls, names):
    """The ingresses' /metrics series named in `names` (name -> key), summed over labels and
    ingresses (an ingress that does not answer counts nothing)."""
    out = dict.fromkeys(names.values(), 0.0)
    for url in urls:
        try:
            text = http_get(url + "/metrics")[1].decode()
        except OSError:
            continue
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def ingress_counters(urls):
    """The ingresses' retries, streams continued elsewhere and streams cut, summed."""
    return {k: int(v) for k, v in metric_sums(urls, {"otela_retries_total": "retries", "otela_stream_resumes_total":
                                                     "stream_resumes", "otela_stream_cuts_total": "stream_cuts"}).items()}


def queue_counters(urls):
    """The ingresses' fair queue: requests that waited and their seconds waited in all, 429s
    from its bounds, summed over tenants and ingresses."""
    return metric_sums(urls, {"otela_queue_wait_seconds_count": "waited", "otela_queue_wait_seconds_sum": "waited_s",
                              "otela_queue_throttled_total": "throttled"})


def generated_tokens(urls):
    """The engines' vllm:generation_tokens counters, summed."""
    total = 0.0
    for url in urls:
        for line in http_get(url + "/metrics")[1].decode().splitlines():
            if line.startswith("vllm:generation_tokens"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _closed_loop(urls, model, requests, inflight, seconds):
    """`inflight` requests per URL always outstanding (not streamed), for `seconds`: the tokens
    the engines generated in its last two thirds (their /metrics), and the requests completed."""
    done, it = [0], iter(requests)
    end = time.monotonic() + seconds

    async def lane(url):
        host, port, _ = workload.loopback(url)
        for req in it:
            if time.monotonic() >= end:
                return
            body = {"model": model, "messages": req["messages"], "max_tokens": req["max_tokens"], "stream": False,
                    "temperature": 0, "ignore_eos": True}
            try:
                rec = await asyncio.wait_for(workload.one_request(host, port, "/v1/chat/completions", body,
                                                                  seconds + 30), end - time.monotonic())
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError, ValueError):
                return
            done[0] += rec.get("status") == 200

    async def window():
        await asyncio.sleep(seconds / 3)
        first = await asyncio.get_running_loop().run_in_executor(None, generated_tokens, urls)
        await asyncio.sleep(max(0.0, end - time.monotonic() - 0.1))
        return await asyncio.get_running_loop().run_in_executor(None, generated_tokens, urls) - first
    tokens, *_ = await asyncio.gather(window(), *(lane(url) for url in urls for _ in range(inflight)))
    return tokens, done[0]


def measure_capacity(name, seconds, inflight=CAPACITY_INFLIGHT):
    """The fleet's saturating throughput on `name` (requests/s at time scale 1, client round
    robin straight to the engines, CAPACITY_INFLIGHT outstanding per engine): the tokens the
    engines generated in the run's last two thirds, over that time, over the workload's mean
    output per request. Returns (requests/s, requests completed)."""
    procs = Processes("capacity")
    try:
        urls = start_engines(procs, lambda port: sim_command(1.0, port), ENGINES)
        shape = WORKLOADS[name](0)
        per_request = sum(r["max_tokens"] for r in shape) / len(shape)
        requests = (r for seed in range(1000, 1100) for r in WORKLOADS[name](seed))
        tokens, done = asyncio.run(_closed_loop(urls, MODEL, requests, inflight, seconds))
        return tokens / (seconds * 2 / 3 - 0.1) / per_request, done
    finally:
        procs.stop()


async def _run(urls, model, requests, times, timeout, during=None):
    """The workload, request i to urls[i % len(urls)]; `during` (a coroutine) alongside."""
    task = asyncio.ensure_future(workload.run_async(urls, model, requests, times, timeout))
    if during is not None:
        await during
    return await task


def with_session(requests, name):
    """Each request with a session key (workload.run_async sends it as `user` and X-Session-Id):
    its group (one app's system prompt) or its chat. vllm-router's consistent_hash hashes the
    header (without one it sends every request to the same engine); a cache-aware router reads
    the text, not this."""
    return [dict(r, session=f"{name}-{r['group']}") for r in requests]


def start_fleet(procs, kind, policy, command, ingresses, rdir, engines=ENGINES, **otela):
    """otela's nodes and ingresses (`otela`: start_otela's flags and warm_first), or the engines
    and `ingresses` routers: (urls, otela's nodes)."""
    if kind == "otela":
        return start_otela(procs, command, engines, MODEL, policy, ingresses, **otela)
    workers = start_engines(procs, command, engines)
    return [start_router(procs, rdir, kind, policy, workers, f"router{i}") for i in range(ingresses)], []


def loop_run(kind, policy, loops, starts, a, ingresses=1, rdir=None, engines=ENGINES, requests=(), times=(),
             kv_tokens=None, **otela):
    """A fresh fleet, closed loops (workload.agent_loops' shape; turns alternating between the
    ingresses) and open-loop `requests` at `times` beside them: the figures of all, of the
    loops' turns after their first ("turns_2plus", with where their TTFT went: engine_side), and
    of each kind where both ran; otela's: its fair queue's counters ("queue"). `kv_tokens`: the
    engines' KV pool; `otela`: start_otela's flags and warm_first."""
    procs = Processes(f"loops-{kind}-{policy}")
    try:
        log = os.path.join(procs.tmp, "engines.jsonl")
        command = lambda port="{port}": sim_command(a.time_scale, port, log, kv_tokens)  # noqa: E731
        urls, _ = start_fleet(procs, kind, policy, command, ingresses, rdir, engines, **otela)
        records = asyncio.run(workload.run_loops_async(urls, MODEL, loops, starts, REQUEST_TIMEOUT_S,
                                                       requests=requests, times=times))
        out = figures(records)
        out.update(engine_side(records, log, a.time_scale), engines=engines, ingresses=ingresses)
        turns = [r for r in records if r.get("loop") is not None]
        later = [r for r in turns if r["turn"] >= 1]
        out["turns_2plus"] = dict(figures(later), **engine_side(later, log, a.time_scale))
        if requests:
            out["loops"], out["chat"] = figures(turns), figures([r for r in records if r.get("loop") is None])
        if kind == "otela":
            out["queue"] = queue_counters(urls)
        return out
    finally:
        procs.stop()


def one_run(kind, policy, name, load, capacity, a, ingresses=1, kill=False, rdir=None):
    """A fresh fleet, the workload at `load` x capacity (requests/s at time scale K), its figures."""
    procs = Processes(f"{kind}-{policy}")
    requests = with_session(WORKLOADS[name](0)[:a.count], name)
    rate = load * capacity / a.time_scale
    times = workload.arrivals(len(requests), rate, "poisson", seed=0, duration=a.duration)
    requests = requests[:len(times)]
    try:
        log = os.path.join(procs.tmp, "engines.jsonl")      # every engine's requests, one line each
        command = lambda port="{port}": sim_command(a.time_scale, port, log)  # noqa: E731
        urls, nodes = start_fleet(procs, kind, policy, command, ingresses, rdir)
        during, killed = None, {}
        if kill:
            async def killer():
                await asyncio.sleep(times[int(len(times) * KILL_AT)])
                victim = nodes[0]
                engines = child_pids({victim.pid}, b"otela_sim.py")
                victim.killed = True
                _signal_group(victim.pid, signal.SIGKILL)
                for pid in engines:
                    procs.orphans.append(pid)
                    _signal_group(pid, signal.SIGKILL)
                killed["at"] = times[int(len(times) * KILL_AT)]
            during = killer()
        records = asyncio.run(_run(urls, MODEL, requests, times, REQUEST_TIMEOUT_S, during))
        out = figures(records)
        out.update(engine_side(records, log, a.time_scale), rate=rate, sent=len(requests),
                   sent_over_s=times[-1] if times else 0.0)
        if kind == "otela":   # what the ingresses did about failures: retried, continued, cut
            out["ingress"] = ingress_counters(urls)
        if kill:
            after = [r for r in records if r.get("at", 0) >= killed["at"]]
            out["killed_at_s"] = killed["at"]
            out["after_kill"] = figures(after)
        return out
    finally:
        procs.stop()


def llama_run(kind, policy, a, rdir=None):
    """The confirmation: 2 real llama.cpp servers behind one policy; TTFT and cache_n / prompt_n."""
    procs = Processes(f"llama-{kind}-{policy}")
    requests = with_session(workload.shared_prefix(6, 3 if not a.quick else 2, system_len=256, question_len=24,
                                                output_len=8, seed=3, words=workload.WORDS), "llama")
    times = workload.arrivals(len(requests), LLAMA_RATE, "poisson", seed=3)
    try:
        if kind == "otela":
            urls, _ = start_otela(procs, llama_command, LLAMA_SERVERS, LLAMA_MODEL, policy)
        else:
            workers = start_engines(procs, llama_command, LLAMA_SERVERS)
            urls = [start_router(procs, rdir, kind, policy, workers, "router0")]
        records = asyncio.run(_run(urls, LLAMA_MODEL, requests, times, 300.0))
        return figures(records)
    finally:
        procs.stop()


# --- the agentic cases (issue 44) --------------------------------------------------------------

def agentic_cases(a, plan, rdir, result):
    """Tool-calling loops alone and beside chat, one and two ingresses/routers: otela's `ttft`
    and AGENT_PEERS, in result["cases"] (ratios() reads them as the other workloads')."""
    ours = [p for p in plan if p[0] == "otela ttft"] or [p for p in plan if p[1] == "otela"][:1]
    peers = [p for p in plan if p[0] in AGENT_PEERS] or [p for p in plan if p[1] != "otela"][:1]
    shape = dict(loops=4, context=(2000, 4000), tool_lens=(50, 800), gaps=(0.0, 0.5)) if a.quick else \
        dict(loops=AGENT_LOOPS, tool_lens=AGENT_TOOL_LENS)
    loops = workload.agent_loops(**shape, seed=0)
    for one in loops:
        for turn in one["turns"]:
            turn["session"] = f"agent-{one['loop']}"
    start_s = 2.0 if a.quick else AGENT_START_S
    starts = [start_s * i / len(loops) for i in range(len(loops))]
    flat = [t for one in loops for t in one["turns"]]
    result.setdefault("reusable", {})["agentic"] = workload.reusable_share(flat)
    mixes = [("agentic", (), ())]
    if not a.quick:
        cap = result["capacity"].get("multi_turn", {}).get("req_s_at_scale_1")
        if cap is None:
            cap = measure_capacity("multi_turn", CAPACITY_S)[0]
        chat = with_session(WORKLOADS["multi_turn"](0)[:a.count], "chat")
        times = workload.arrivals(len(chat), AGENT_CHAT_LOAD * cap / a.time_scale, "poisson", seed=0,
                                  duration=a.duration)
        mixes.append(("agentic+chat", chat[:len(times)], times))
        result["reusable"]["agentic+chat"] = workload.reusable_share(flat + chat[:len(times)])
    for name, requests, times in mixes:
        # (beside chat, one ingress only with --full: the two-ingress case is the target's)
        for ingresses in (2,) if a.quick or (requests and not a.full) else (1, 2):
            case = name + (" x2" if ingresses == 2 else "")
            cases = result["cases"][case] = {}
            diagnosis = [(label, "otela", "ttft") for label in AGENT_DIAGNOSIS if ours and not a.quick]
            for label, kind, policy in ours + diagnosis + peers:
                flags = {"flags": AGENT_DIAGNOSIS[label]} if label in AGENT_DIAGNOSIS else {}
                try:
                    cases[label] = loop_run(kind, policy, loops, starts, a, ingresses, rdir, requests=requests,
                                            times=times, **flags)
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                    cases[label] = {"skipped": f"failed: {exc}"}
                report(case, label, cases[label])
            print_table(case, cases)


def alternating_cases(a, plan, rdir, result):
    """Issue 44's table: turns alternating over 1, 2 and 4 ingresses at each gap, with and
    without prompt_cache_key; hit rate and TTFT p99 of turns 2+ against one ingress's."""
    shape = dict(ALTERNATING, conversations=12) if a.quick else ALTERNATING
    gaps, keyed = ((0.3,), (False,)) if a.quick else (ALTERNATING_GAPS, (False, True))
    peer = [p for p in plan if p[0] == "sglang cache_aware"][:0 if a.quick else 1]
    out = result["alternating"] = {}
    for gap in gaps:
        for key in keyed:
            loops = workload.turn_loops(**shape, gap=gap, seed=0)
            if key:
                for one in loops:
                    for turn in one["turns"]:
                        turn["cache_key"] = f"chat-{one['loop']}"
            starts = [(2.0 if a.quick else ALTERNATING_START_S) * i / len(loops) for i in range(len(loops))]
            case = f"gap {gap:g}s" + (" prompt_cache_key" if key else "")
            runs = out[case] = {}
            plan_here = [(f"otela ttft x{n}", "otela", "ttft", n) for n in ((1, 2) if a.quick else (1, 2, 4))]
            plan_here += [(f"{label} x1", kind, policy, 1) for label, kind, policy in peer if not key]
            for label, kind, policy, n in plan_here:
                try:
                    runs[label] = loop_run(kind, policy, loops, starts, a, n, rdir, ALTERNATING_ENGINES)
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                    runs[label] = {"skipped": f"failed: {exc}"}
                report(case, label, runs[label])
            one = runs.get("otela ttft x1", {}).get("turns_2plus", {})
            for n in (2, 4):
                many = runs.get(f"otela ttft x{n}", {}).get("turns_2plus", {})
                if one.get("hit_rate") and many.get("hit_rate") is not None:
                    runs[f"x{n}_hit_rate_vs_x1"] = many["hit_rate"] / one["hit_rate"]
                if one.get("ttft_p99_ms") and many.get("ttft_p99_ms") is not None:
                    runs[f"x{n}_ttft_p99_vs_x1"] = many["ttft_p99_ms"] / one["ttft_p99_ms"]
            print(f"\nalternating {case} (turns 2+): " + "; ".join(
                f"{label} hit {fmt(f.get('turns_2plus', {}).get('hit_rate'), '.3f')} TTFT p99 "
                f"{fmt(f.get('turns_2plus', {}).get('ttft_p99_ms'), '.0f')} ms" if isinstance(f, dict) else
                f"{label} {f:.2f}" for label, f in runs.items()), flush=True)


def flood_requests(seed):
    """The warm case's cold requests, as many as taken: random prompts (no prefix shared)."""
    rng = random.Random(seed)
    while True:
        yield {"messages": [{"role": "user", "content": workload.text(WARM_FLOOD_SHAPE["prompt"], rng)}],
               "max_tokens": WARM_FLOOD_SHAPE["output"]}


def warm_cases(a, result):
    """Issue 44 item 3 (WARM_*): the warm-turn rule on and off, the same loops and flood, fresh
    fleets alternating; per run the turns after each loop's first (TTFT p99, hit rate, where
    their TTFT went: at the engine or on the path, which holds the wait in the ingress's queue),
    the flood's output tokens/s and errors, and the queue's counters (it held the flood)."""
    scale = WARM_TIME_SCALE if a.time_scale == TIME_SCALE else a.time_scale
    shape = dict(WARM_LOOPS, loops=2, context=(2000, 3000)) if a.quick else WARM_LOOPS
    repeats, duration = (1, 8.0) if a.quick else (WARM_REPEATS, WARM_DURATION_S)
    loops = workload.agent_loops(**shape, seed=0)
    for one in loops:
        for turn in one["turns"]:
            turn["session"] = f"agent-{one['loop']}"
    starts = [(1.0 if a.quick else WARM_START_S) * i / len(loops) for i in range(len(loops))]
    procs = Processes("warm-capacity")   # the flood's capacity: straight to the engines at K = 1
    try:
        urls = start_engines(procs, lambda port: sim_command(1.0, port, kv_tokens=WARM_KV_TOKENS), WARM_ENGINES)
        seconds = 8.0 if a.quick else 18.0
        tokens, _ = asyncio.run(_closed_loop(urls, MODEL, flood_requests(99), 64, seconds))
        capacity = tokens / (seconds * 2 / 3 - 0.1) / WARM_FLOOD_SHAPE["output"]
    finally:
        procs.stop()
    rate = WARM_FLOOD * capacity / scale
    times = workload.arrivals(int(rate * duration * 2) + 10, rate, "poisson", seed=0, duration=duration)
    flood = list(itertools.islice(flood_requests(0), len(times)))
    run_a = argparse.Namespace(**dict(vars(a), time_scale=scale))
    out = result["warm"] = {"time_scale": scale, "engines": WARM_ENGINES, "kv_tokens": WARM_KV_TOKENS,
                            "flood_capacity_req_s_at_scale_1": capacity, "flood_rate_req_s": rate,
                            "flood_sent": len(times), "loops": shape, "runs": []}
    print(f"warm: {len(loops)} agent loops beside a flood of {len(times)} cold requests at {rate:.1f} req/s "
          f"({WARM_FLOOD:g} x capacity {capacity:.1f} req/s at full speed), one ingress, K = {scale:g}", flush=True)
    for age, i in [(age, i) for age in WARM_AGES_S[:1 if a.quick else None] for i in range(repeats)]:
        flags = ("--no-auth", "--queue-wait-s", f"{otela_ingress.QUEUE_WAIT_S * scale:g}", "--queue-age-s",
                 f"{age * scale:g}", "--queue-timeout-s", f"{otela_ingress.QUEUE_TIMEOUT_S * scale:g}")
        for warm_first in (True, False) if i % 2 == 0 else (False, True):
            label = ("rule on" if warm_first else "rule off") + f", age {age:g} s"
            try:
                f = loop_run("otela", "ttft", loops, starts, run_a, 1, None, WARM_ENGINES, flood, times,
                             kv_tokens=WARM_KV_TOKENS, flags=flags, warm_first=warm_first)
                f["flood"] = f.pop("chat")
            except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                f = {"skipped": f"failed: {exc}"}
            f.update(label=label, repeat=i, queue_age_s=age)
            out["runs"].append(f)
            if "skipped" in f:
                print(f"  warm {label} #{i}: skipped: {f['skipped']}", flush=True)
                continue
            t, fl, q = f["turns_2plus"], f["flood"], f.get("queue", {})
            print(f"  warm {label} #{i}: turns 2+ {t['ok']}/{t['requests']} TTFT p50/p99 "
                  f"{fmt(t['ttft_p50_ms'], '.0f')}/{fmt(t['ttft_p99_ms'], '.0f')} ms (engine p99 "
                  f"{fmt(t.get('engine_ttft_p99_ms'), '.0f')}, path p99 {fmt(t.get('path_p99_ms'), '.0f')}) hit "
                  f"{fmt(t['hit_rate'], '.3f')}; flood ok {fl['ok']}/{fl['requests']} tok/s "
                  f"{fmt(fl['output_tok_s'], '.0f')}; queue: {q.get('waited', 0):.0f} waited "
                  f"{q.get('waited_s', 0):.0f} s in all, {q.get('throttled', 0):.0f} 429s", flush=True)


def report(case, label, f):
    print(f"  {case:22s} {label:22s} " + (f"skipped: {f['skipped']}" if "skipped" in f else
          f"ok {f['ok']}/{f['requests']} TTFT p99 {fmt(f['ttft_p99_ms'], '.0f')} ms hit "
          f"{fmt(f['hit_rate'], '.3f')} tok/s {fmt(f['output_tok_s'], '.0f')}" +
          (f" queue: {f['queue']['waited']:.0f} waited {f['queue']['waited_s']:.0f} s in all" if f.get("queue") else
           "")), flush=True)


# --- the run ------------------------------------------------------------------------------------

def policies(quick, missing):
    """(label, kind, policy): kind "otela" or a router's console script."""
    otela = OTELA_BASE + [p for p in OTELA_POLICIES if p in otela_ingress.POLICIES]
    out = [(f"otela {p}", "otela", p) for p in otela]
    out += [(label, script, p) for label, script, p in PEERS if script not in missing]
    if quick:   # the smoke: otela's best and the first peer there is
        best = "ttft" if "ttft" in otela else "least_loaded"
        out = [o for o in out if o[0] == f"otela {best}"] + [o for o in out if o[1] != "otela"][:1]
    return out


def best_peer(cases, key, higher):
    peers = {k: v for k, v in cases.items() if not k.startswith("otela") and v.get(key) is not None}
    if not peers:
        return None, None
    label = (max if higher else min)(peers, key=lambda k: peers[k][key])
    return label, peers[label][key]


def ratios(result):
    """The ratios issue 28's targets name, from the cases measured."""
    out = {}
    ours = "otela ttft" if any("otela ttft" in c for c in result["cases"].values()) else "otela least_loaded"
    for case, cases in result["cases"].items():
        if ours not in cases or not cases[ours].get("ok"):
            continue
        me = cases[ours]
        r = {"policy": ours}
        for key, higher, what in (("ttft_p99_ms", False, "ttft_p99_vs_best_peer"),
                                  ("hit_rate", True, "hit_rate_vs_best_peer"),
                                  ("output_tok_s", True, "throughput_vs_best_peer")):
            label, value = best_peer(cases, key, higher)
            if label and me.get(key) is not None:
                r[what] = me[key] / value if value else None
                r["best_peer_" + key] = label
        fastest = cases.get(r.get("best_peer_ttft_p99_ms"), {})
        if me.get("engine_ttft_p99_ms") and fastest.get("engine_ttft_p99_ms"):
            # the TTFT split: the engines' share (placement: queue and prefill) and the path's
            r["engine_ttft_p99_vs_best_peer"] = me["engine_ttft_p99_ms"] / fastest["engine_ttft_p99_ms"]
            r["path_p99_ms"], r["best_peer_path_p99_ms"] = me["path_p99_ms"], fastest["path_p99_ms"]
            if me.get("engine_floor_p99_ms"):   # 0.8x the best peer below it: this placement cannot meet it
                r["engine_floor_p99_ms"] = me["engine_floor_p99_ms"]
                r["target_p99_ms"] = 0.8 * fastest["ttft_p99_ms"]
        reusable = result.get("reusable", {}).get(case.split(" ")[0])
        if reusable and me.get("hit_rate") is not None:   # 1.0: no placement could hit more
            r["hit_rate_vs_reusable"] = me["hit_rate"] / reusable
        peer = cases.get("sglang cache_aware", {})
        if peer.get("hit_rate") is not None and me.get("hit_rate") is not None and peer.get("ttft_p50_ms") \
                and abs(me["hit_rate"] - peer["hit_rate"]) <= 0.005:
            # the same hits, so the same engine work: the TTFT p50 apart is what the path adds (the
            # node hop, two Python processes, against the router's one Rust process)
            r["path_ms_at_equal_hits"] = me["ttft_p50_ms"] - peer["ttft_p50_ms"]
        if case.startswith("instruct") and "otela least_loaded" in cases and me.get("ttft_p99_ms"):
            r["instruct_ttft_p99_vs_least_loaded"] = me["ttft_p99_ms"] / cases["otela least_loaded"]["ttft_p99_ms"]
        if "x2" in case:
            one = result["cases"].get(case.replace(" x2", ""), {}).get(ours, {})
            if one.get("hit_rate") and me.get("hit_rate") is not None:
                r["two_ingress_hit_rate_vs_one"] = me["hit_rate"] / one["hit_rate"]
        out[case] = r
    return out


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(title, cases):
    print(f"\n{title}")
    print(f"  {'policy':24s} {'ok':>5s} {'err':>4s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'e2e p99':>9s} "
          f"{'tok/s':>7s} {'hit':>6s} {'engine p50/p99':>15s} {'path p50/p99':>13s}")
    for label, f in cases.items():
        if "skipped" in f:
            print(f"  {label:24s} skipped: {f['skipped']}")
            continue
        hit = None if f.get("hit_rate") is None else f["hit_rate"] * 100
        print(f"  {label:24s} {f['ok']:5d} {f['errors']:4d} {fmt(f['ttft_p50_ms'], '9.0f')} "
              f"{fmt(f['ttft_p99_ms'], '9.0f')} {fmt(f['e2e_p99_ms'], '9.0f')} {fmt(f['output_tok_s'], '7.0f')} "
              f"{fmt(hit, '5.1f')}% {fmt(f.get('engine_ttft_p50_ms'), '7.0f')}/{fmt(f.get('engine_ttft_p99_ms'), '<7.0f')} "
              f"{fmt(f.get('path_p50_ms'), '6.1f')}/{fmt(f.get('path_p99_ms'), '<6.1f')}")


def _interrupt(signum, frame):
    """SIGTERM (make, a CI runner) ends the run as Ctrl-C does: through every finally."""
    raise KeyboardInterrupt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results")
    p.add_argument("--full", action="store_true", help="50, 80 and 100 %% load, two ingresses on every workload")
    p.add_argument("--quick", action="store_true", help="a smoke run: few requests, two policies, one workload")
    p.add_argument("--llamacpp", action="store_true", help="the llama.cpp confirmation (default: when installed)")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp confirmation")
    p.add_argument("--time-scale", type=float, default=TIME_SCALE, help=f"engines slowed K times (default {TIME_SCALE:g})")
    p.add_argument("--count", type=int, default=None, help=f"requests per run at most (default {RUN_COUNT})")
    p.add_argument("--duration", type=float, default=None, help=f"seconds of arrivals per run (default {RUN_DURATION_S:g})")
    p.add_argument("--workloads", default=None, help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--routers", default=None, help="a venv holding sglang-router and vllm-router "
                                                   f"(default {ROUTERS_DIR}, installed there when missing)")
    a = p.parse_args()
    a.count = a.count or (24 if a.quick else RUN_COUNT)
    a.duration = a.duration or (8.0 if a.quick else RUN_DURATION_S)
    names = a.workloads.split(",") if a.workloads else \
        (["shared_prefix", *EXTRA_WORKLOADS] if a.quick else [*WORKLOADS, *EXTRA_WORKLOADS])
    unknown = [n for n in names if n not in WORKLOADS and n not in EXTRA_WORKLOADS]
    if unknown:
        p.error(f"unknown workload {', '.join(unknown)}: use {','.join([*WORKLOADS, *EXTRA_WORKLOADS])}")
    loads = LOADS_FULL if a.full else LOADS_DEFAULT
    result = {"time_scale": a.time_scale, "engines": f"{ENGINES} x otela_sim.py serve --model {MODEL} --gpu {GPU} "
              f"--engine {ENGINE} --time-scale {a.time_scale:g}", "count": a.count, "duration_s": a.duration,
              "capacity": {}, "cases": {}, "skipped": {}, "command": "tests/bench_routing.py " + " ".join(sys.argv[1:])}
    signal.signal(signal.SIGTERM, _interrupt)
    rdir, missing = routers_dir(a.routers)
    for script, why in missing.items():
        print(f"{script}: skipped: {why}")
        result["skipped"][script] = why
    plan = policies(a.quick, missing)
    print(f"routing bench: {ENGINES} emulated {GPU}s slowed {a.time_scale:g} times; policies: "
          f"{', '.join(label for label, _, _ in plan)}; workloads {', '.join(names)} at "
          f"{', '.join(f'{x * 100:.0f}%' for x in loads)} of measured capacity; the box is shared: figures are "
          f"ratios in this run")
    t0 = time.monotonic()
    try:
        for name in [n for n in names if n in WORKLOADS]:
            # the smoke: fewer in flight, so that its short window sees decodes, not the first prefills
            cap, done = measure_capacity(name, *((8.0, 16) if a.quick else (CAPACITY_S, CAPACITY_INFLIGHT)))
            result["capacity"][name] = {"req_s_at_scale_1": cap, "req_s_at_scale_k": cap / a.time_scale,
                                        "completed": done}
            # the hit rate of a cache that never evicts, each request against those before it:
            # no placement can do better (the oracle a policy is measured against)
            result.setdefault("reusable", {})[name] = workload.reusable_share(WORKLOADS[name](0)[:a.count])
            if cap <= 0:
                print(f"capacity {name}: nothing generated in the window; its runs skipped")
                continue
            print(f"capacity {name}: {cap:.1f} req/s at full speed ({cap / a.time_scale:.2f} req/s slowed "
                  f"{a.time_scale:g} times; {done} completed)")
            for load in loads:
                two = name in ("shared_prefix", "multi_turn") and not a.quick   # the target's two workloads
                for ingresses in (1, 2) if (a.full or two) else (1,):
                    case = f"{name} {load * 100:.0f}%" + (" x2" if ingresses == 2 else "")
                    cases = result["cases"][case] = {}
                    for label, kind, policy in plan:
                        try:
                            cases[label] = one_run(kind, policy, name, load, cap, a, ingresses, rdir=rdir)
                        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                            cases[label] = {"skipped": f"failed: {exc}"}
                        report(case, label, cases[label])
                    print_table(case, cases)
        if "agentic" in names:
            agentic_cases(a, plan, rdir, result)
        if "alternating" in names:
            alternating_cases(a, plan, rdir, result)
        if "warm" in names:
            warm_cases(a, result)
        if not a.quick:
            policy = "ttft" if "ttft" in otela_ingress.POLICIES else "least_loaded"
            if "shared_prefix" not in result["capacity"]:
                cap, done = measure_capacity("shared_prefix", CAPACITY_S)
                result["capacity"]["shared_prefix"] = {"req_s_at_scale_1": cap, "req_s_at_scale_k": cap / a.time_scale,
                                                       "completed": done}
            cap = result["capacity"]["shared_prefix"]["req_s_at_scale_1"]
            kill = one_run("otela", policy, "shared_prefix", 0.8, cap, a, kill=True)
            kill["policy"] = policy
            result["kill"] = kill
            print(f"kill: otela {policy}, shared prefix at 80 %, a node and its engine SIGKILLed at "
                  f"{kill['killed_at_s']:.1f} s: {kill['errors']} client errors of {kill['requests']} "
                  f"({kill['error_kinds']}); hit rate after the kill {fmt(kill['after_kill']['hit_rate'], '.3f')} "
                  f"(the whole run {fmt(kill['hit_rate'], '.3f')}); the ingress {kill.get('ingress')}")
        llama_ready = (ENGINE_DIR / ".ready").exists() and ENGINE_PYTHON.exists()
        if a.llamacpp or (not a.quick and not a.no_llamacpp):
            if not llama_ready:
                result["llamacpp"] = {"skipped": f"no real engine in {ENGINE_DIR} (make engine)"}
                print(f"llamacpp: skipped: {result['llamacpp']['skipped']}")
            else:
                cases = result["llamacpp"] = {}
                for label, kind, policy in plan:
                    try:
                        cases[label] = llama_run(kind, policy, a, rdir)
                    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                        cases[label] = {"skipped": f"failed: {exc}"}
                print_table(f"llamacpp: {LLAMA_SERVERS} x llama.cpp (SmolLM2-135M, -c {LLAMA_CTX} -np {LLAMA_SLOTS}), "
                            f"shared prefix 6 groups x 256-token system prompts, {LLAMA_RATE:g} req/s; hit = "
                            "cache_n / (cache_n + prompt_n)", cases)
    except KeyboardInterrupt:
        print("routing bench: interrupted; what was measured is written", file=sys.stderr)
        result["interrupted"] = True
    result["ratios"] = ratios(result)
    result["wall_s"] = time.monotonic() - t0
    for case, r in result["ratios"].items():
        print(f"ratios {case}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in r.items()))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "routing.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"figures written to {os.path.join(a.out, 'routing.json')} ({result['wall_s']:.0f} s)")
    return 130 if result.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
