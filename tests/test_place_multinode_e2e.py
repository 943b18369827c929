"""A model bigger than a node, end to end in the multi-node Slurm lab (tests/multilab.py: 4 nodes
of 1 GPU, each a network namespace with its own address): one placer pass (plan --site
--emit-sbatch --submit) places Qwen3-32B, which no 80 GB GPU holds alone, as two instances of
2 nodes each (tp 1 within a node, pp 2 across), run by the SGLang template with the emulated
engine (otela_sim.py serve --nnodes --node-rank --dist-init-addr) standing in for SGLang. Each
job's node wraps rank 0 and joins a real ingress on the lab's bridge; the registry says the
session's nodes, tp and pp. Then the rank-1 process of one job is killed under load: its session
is DOWN within 2 s, no non-streamed request fails (the ingress retries on the other instance),
every stream finishes or ends with an error event, the job ends, and the placer's next pass
replaces it. Last, the other job gets its time limit's signal: its node drains and leaves, and
the job ends with every rank. Prints the seconds from the kill to DOWN. Needs root."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import poll
from multilab import BRIDGE_ADDR, mlab  # noqa: F401  (the multi-node Slurm lab)
from test_place_e2e import real_ingress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.slow]
PY = sys.executable
MODEL = "Qwen/Qwen3-32B"

# `python3 -m sglang.launch_server --model-path W --served-model-name M --tp T --pp-size P
# --nnodes N --dist-init-addr A --host H --port P --node-rank R`, as the template writes it, run by
# the emulated engine (whose flags are SGLang's but --model and --pp): a site's own engine
SGLANG = f"""#!{PY}
import os, sys
names = {{"--model-path": "--model", "--pp-size": "--pp"}}
args = [names.get(a, a) for a in sys.argv[3:]]
os.execv({PY!r}, [{PY!r}, {os.path.join(ROOT, "otela_sim.py")!r}, "serve", "--gpu", "H100"] + args)
"""


def sim_is_multi_node():
    out = subprocess.run([PY, os.path.join(ROOT, "otela_sim.py"), "serve", "--help"], capture_output=True, text=True)
    return "--node-rank" in out.stdout


@pytest.fixture
def ingress(mlab, tmp_path):  # noqa: F811
    """A real ingress on the lab's bridge address, where the nodes in their namespaces reach it."""
    with real_ingress(tmp_path, BRIDGE_ADDR) as found:
        yield found


def registry(ingress):
    with urllib.request.urlopen(ingress["url"] + "/v1/registry", timeout=5) as resp:
        return json.loads(resp.read()).get("sessions", [])


def of_job(sessions, job):
    return [s for s in sessions if str((s.get("labels") or {}).get("slurm_job")) == str(job)]


def chat(url, stream=False, tokens=8):
    """(status, error) of one chat completion; a stream is read to its end: error is None when it
    ended with [DONE], "event" when it ended with an SSE error event, "cut" when it just stopped."""
    body = json.dumps({"model": MODEL, "max_tokens": tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            if not stream:
                json.loads(resp.read())
                return resp.status, None
            events = [line for line in resp.read().decode().splitlines() if line.startswith("data:")]
            if events and events[-1].strip() == "data: [DONE]":
                return resp.status, None
            return resp.status, "event" if any('"error"' in e for e in events) else "cut"
    except urllib.error.HTTPError as e:
        return e.code, f"HTTP {e.code}"
    except OSError as e:
        return None, str(e)


def timed_stream(url, tokens):
    """One streamed chat read to its end: {start, end, session (the X-Otela-Session that began
    serving it), outcome (chat's error: None for [DONE], "event", "cut" or the failure)}."""
    body = json.dumps({"model": MODEL, "max_tokens": tokens, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    out = {"start": time.monotonic(), "session": None}
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            out["session"] = resp.headers.get("X-Otela-Session")
            events = [line for line in resp.read().decode().splitlines() if line.startswith("data:")]
        if events and events[-1].strip() == "data: [DONE]":
            out["outcome"] = None
        else:
            out["outcome"] = "event" if any('"error"' in e for e in events) else "cut"
    except urllib.error.HTTPError as e:
        out["outcome"] = f"HTTP {e.code}"
    except OSError as e:
        out["outcome"] = str(e)
    out["end"] = time.monotonic()
    return out


def session_id(session):
    return session.get("session") or session.get("id")


def job_processes(job):
    """[argv] of every process of Slurm job `job` on this machine (its environment says the job)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SLURM_JOB_ID={job}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append((int(pid), f.read().split(b"\0")))
        except OSError:
            continue
    return found


def rank_pid(job, rank):
    """The pid of the emulated engine's rank `rank` in Slurm job `job`."""
    return next((pid for pid, argv in job_processes(job) if b"serve" in argv and b"--node-rank" in argv
                 and any(a.endswith(b"otela_sim.py") for a in argv)
                 and argv[argv.index(b"--node-rank") + 1] == str(rank).encode()), None)


def test_a_model_bigger_than_a_node_serves_over_two_nodes_and_a_dead_rank_is_replaced(mlab, ingress, tmp_path):  # noqa: F811
    if not sim_is_multi_node():
        pytest.skip("this otela_sim.py serve has no multi-node engine (--nnodes/--node-rank)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(SGLANG)
    (bin_dir / "python3").chmod(0o755)
    site = {"gpus": [{"type": "H100", "count": 4, "per_node": 1, "gres": "gpu", "partition": mlab["partition"],
                      "time_limit": "10"}],
            "engine_wrapper": f"env PATH={bin_dir}:/usr/bin:/bin", "log_dir": str(tmp_path / "logs"),
            "catalogue": [{"name": MODEL, "min": 2, "max": 2, "template": "sglang"}]}
    (tmp_path / "site.json").write_text(json.dumps(site))
    argv = [PY, os.path.join(ROOT, "otela_place.py"), "plan", "--from-ingress", ingress["url"],
            "--site", str(tmp_path / "site.json"), "--emit-sbatch", str(tmp_path / "jobs"), "--submit",
            "--lock", str(tmp_path / "lock"), "--json"]
    for k, v in {"KEY_FILE": ingress["key"], "BOOTSTRAP": ingress["gossip"], "LISTEN_HOST": "0.0.0.0"}.items():
        argv += ["--sbatch-var", f"{k}={v}"]
    env = dict(os.environ, OTELA_SITE=str(tmp_path / "site.json"))

    def placer_pass():
        out = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["reconcile"]

    stop = threading.Event()
    try:
        jobs = placer_pass()["submitted"]
        assert len(jobs) == 2
        assert {j["key"] for j in place.slurm_jobs()} == {(MODEL, "H100", 1, 2)}

        def serving():
            view = registry(ingress)
            mine = [s for j in jobs for s in of_job(view, j)]
            if any(s["state"] in ("DOWN", "LEFT") for s in mine):
                logs = "".join(p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*"))
                raise AssertionError(f"a session went DOWN before serving; job logs:\n{logs}")
            up = [s for s in mine if s["state"] == "SERVING"]
            return up if len(up) == 2 else None
        sessions = poll(serving, "two sessions of 2 nodes SERVING", 240, interval=0.5)
        for s in sessions:   # the registry knows each instance's nodes, GPUs and layout
            hw = s["hardware"]
            assert len(hw["nodes"]) == 2 and set(hw["nodes"]) <= set(mlab["nodes"])
            assert (hw["tp"], hw["pp"], hw["count"]) == (1, 2, 2)
            assert place.session_key(s) == (MODEL, "H100", 1, 2)
        assert set(sum((s["hardware"]["nodes"] for s in sessions), [])) == set(mlab["nodes"])
        assert chat(ingress["url"]) == (200, None)

        results = {"plain": [], "stream": []}

        def load(kind):
            while not stop.is_set():
                # streams long enough (256 tokens, seconds) that several are in flight on the rank killed
                results[kind].append(chat(ingress["url"], tokens=64) if kind == "plain"
                                     else timed_stream(ingress["url"], tokens=256))
        threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in ("plain", "plain") + ("stream",) * 4]
        for t in threads:
            t.start()
        time.sleep(2)
        victim = jobs[0]
        victim_sessions = {session_id(s) for s in of_job(sessions, victim)}
        pid = poll(lambda: rank_pid(victim, 1), f"job {victim}'s rank-1 process", 10)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        poll(lambda: [s for s in of_job(registry(ingress), victim) if s["state"] in ("DOWN", "LEFT")],
             f"job {victim}'s session DOWN after its rank 1 was killed", 10, interval=0.05)
        down_s = time.monotonic() - t_kill
        time.sleep(3)   # requests keep coming while the job ends
        stop.set()
        for t in threads:
            t.join(70)
        plain_errors = [r for r in results["plain"] if r != (200, None)]
        cut = [r for r in results["stream"] if r["outcome"] not in (None, "event")]
        # streams the killed instance was serving when its rank died
        hit = [r for r in results["stream"] if r["session"] in victim_sessions and r["start"] < t_kill < r["end"]]
        print(f"\nrank 1 killed: session DOWN after {down_s:.2f} s; {len(results['plain'])} non-streamed requests, "
              f"{len(plain_errors)} failed; {len(results['stream'])} streams, {len(hit)} in flight on the killed "
              f"instance: {sum(1 for r in hit if r['outcome'] is None)} continued elsewhere, "
              f"{sum(1 for r in hit if r['outcome'] == 'event')} ended by an error event; {len(cut)} cut")
        assert down_s < 2.0
        assert plain_errors == [] and len(results["plain"]) > 0
        assert hit, "no stream was in flight on the killed instance"
        assert cut == [] and all(r["outcome"] in (None, "event") for r in hit)
        poll(lambda: victim not in {j["id"] for j in place.slurm_jobs()}, f"job {victim} did not end", 60, interval=0.5)
        again = placer_pass()["submitted"]   # the next pass replaces it
        assert len(again) == 1 and victim not in again

        # The time limit's --signal (B:TERM to the batch shell, as `scancel --batch` sends it): rank 0's
        # node drains and leaves, the job ends, and its other rank with it.
        other = jobs[1]
        assert rank_pid(other, 1)
        subprocess.run(["scancel", "--batch", "--signal=TERM", other], check=True, timeout=30)
        poll(lambda: [s for s in of_job(registry(ingress), other) if s["state"] == "LEFT"],
             f"job {other}'s session LEFT after its --signal", 60, interval=0.2)
        poll(lambda: other not in {j["id"] for j in place.slurm_jobs()}, f"job {other} did not end", 60, interval=0.5)
        assert rank_pid(other, 1) is None
    finally:
        stop.set()
        from test_place_slurm import _cancel_ours
        _cancel_ours()


# Stand-ins for Ray and vLLM (neither is installed here): `ray start --head --port P --block`
# listens on P; `ray start --address HOST:P --block` checks it reaches the head, then waits;
# `vllm serve W ... --pipeline-parallel-size P ...` is the emulated engine as one process.
RAY = f"""#!{PY}
import socket, sys, time
args = sys.argv[1:]
if "--head" in args:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((args[args.index("--node-ip-address") + 1], int(args[args.index("--port") + 1])))
    s.listen(8)
else:
    host, port = args[args.index("--address") + 1].rsplit(":", 1)
    socket.create_connection((host, int(port)), 10).close()
print("ray", *args, flush=True)
time.sleep(1e6)
"""
VLLM = f"""#!{PY}
import os, sys
args, out, skip = sys.argv[3:], [], 0
for a in args:
    if skip:
        skip -= 1
    elif a in ("--pipeline-parallel-size", "--distributed-executor-backend"):
        skip = 1
    else:
        out.append("--tp" if a == "--tensor-parallel-size" else a)
os.execv({PY!r}, [{PY!r}, {os.path.join(ROOT, "otela_sim.py")!r}, "serve", "--model", sys.argv[2]] + out)
"""


def ray_pids(job):
    """{'head' or 'worker': pid} of the Ray stand-ins of Slurm job `job`."""
    return {"head" if b"--head" in argv else "worker": pid for pid, argv in job_processes(job)
            if len(argv) > 2 and argv[1].endswith(b"/ray")}


def submit_by_hand(mlab, ingress, tmp_path, stand_ins, row, template):  # noqa: F811
    """(job id, script) of one instance of `row` rendered from `template` as plan renders it
    (a grant of its own) and submitted with sbatch, its engine the stand-ins {name: text}."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    site = place.check_site({"gpus": [{"type": "H100", "count": 4, "per_node": 1, "gres": "gpu",
                                       "partition": mlab["partition"], "time_limit": "10"}],
                             "engine_wrapper": f"env PATH={bin_dir}:/usr/bin:/bin", "log_dir": str(tmp_path / "logs")})
    os.makedirs(tmp_path / "logs")
    grants = place.GrantIssuer(str(tmp_path / "grants"), ingress["key"], PY)   # as plan does
    (_, name, text), = place.job_scripts([row], site, template, {"KEY_FILE": ingress["key"], "PYTHON": PY,
                                                                 "BOOTSTRAP": ingress["gossip"], "LISTEN_HOST": "0.0.0.0"},
                                         grant=grants.grant)
    (tmp_path / name).write_text(text)
    job = subprocess.run(["sbatch", "--parsable", str(tmp_path / name)], capture_output=True, text=True,
                         check=True, timeout=30).stdout.strip().split(";")[0]
    return job, text


def serving_session(ingress, tmp_path, job):
    """Job `job`'s session once SERVING; its job logs in the error if it went DOWN first."""
    def serving():
        mine = of_job(registry(ingress), job)
        if any(s["state"] in ("DOWN", "LEFT") for s in mine):
            raise AssertionError("".join(p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*")))
        return [s for s in mine if s["state"] == "SERVING"]
    return poll(serving, f"job {job}'s session SERVING", 120, interval=0.5)[0]


def test_the_vllm_template_runs_a_ray_head_and_a_worker_over_the_jobs_nodes(mlab, ingress, tmp_path):  # noqa: F811
    from test_place_slurm import _cancel_ours
    row = {"model": MODEL, "gpu": "H100", "tp": 1, "pp": 2, "nodes": 2, "instances": 1, "weight": 1.0}
    try:
        job, _ = submit_by_hand(mlab, ingress, tmp_path, {"ray": RAY, "vllm": VLLM}, row, "vllm")
        session = serving_session(ingress, tmp_path, job)
        assert len(session["hardware"]["nodes"]) == 2 and (session["hardware"]["tp"], session["hardware"]["pp"]) == (1, 2)
        assert set(ray_pids(job)) == {"head", "worker"}
        log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*"))
        assert "--pipeline-parallel-size 2 --distributed-executor-backend ray" in log
        assert chat(ingress["url"]) == (200, None)
        os.kill(ray_pids(job)["worker"], signal.SIGKILL)   # a Ray worker gone: the node stops, the job ends
        poll(lambda: [s for s in of_job(registry(ingress), job) if s["state"] in ("DOWN", "LEFT")],
             f"job {job}'s session DOWN after its Ray worker died", 10, interval=0.05)
        poll(lambda: job not in {j["id"] for j in place.slurm_jobs()} and not ray_pids(job),
             f"job {job} and its Ray processes did not end", 60, interval=0.5)
    finally:
        _cancel_ours()


def test_the_sglang_template_runs_tp_across_two_nodes_with_a_rank_on_each(mlab, ingress, tmp_path):  # noqa: F811
    # tp 2 over 2 nodes of 1 GPU (SGLang --tp 2 --nnodes 2), as the placer plans it where no pp
    # divides a model's layers: each node asks Slurm for its share (1 GPU) and runs one rank
    if not sim_is_multi_node():
        pytest.skip("this otela_sim.py serve has no multi-node engine (--nnodes/--node-rank)")
    from test_place_slurm import _cancel_ours
    row = {"model": MODEL, "gpu": "H100", "tp": 2, "nodes": 2, "instances": 1, "weight": 1.0}
    try:
        job, text = submit_by_hand(mlab, ingress, tmp_path, {"python3": SGLANG}, row, "sglang")
        assert "#SBATCH --gres=gpu:1\n" in text and "#SBATCH --nodes=2\n" in text
        session = serving_session(ingress, tmp_path, job)
        hw = session["hardware"]
        assert len(hw["nodes"]) == 2 and (hw["tp"], hw["pp"]) == (2, 1)
        assert place.session_key(session) == (MODEL, "H100", 2)
        assert rank_pid(job, 1) and chat(ingress["url"]) == (200, None)
        os.kill(rank_pid(job, 1), signal.SIGKILL)   # a tp rank gone: the engine is gone, the session DOWN
        poll(lambda: [s for s in of_job(registry(ingress), job) if s["state"] in ("DOWN", "LEFT")],
             f"job {job}'s session DOWN after its rank 1 died", 10, interval=0.05)
        poll(lambda: job not in {j["id"] for j in place.slurm_jobs()}, f"job {job} did not end", 60, interval=0.5)
    finally:
        _cancel_ours()
