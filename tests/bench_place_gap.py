"""tests/bench_place_gap.py: the gap a Slurm time limit leaves in a model's service, with and
without the placer's successors (issue 39, point 6), measured on a real single-node Slurm.

One model of a site catalogue (min 1, max 1) runs as an emulated engine (otela_sim.py serve,
behind a `vllm` stand-in that first sleeps LOAD_S: the model's load) in jobs of TIME_LIMIT
minutes whose node is told to drain SIGNAL_S before the limit. A placer pass runs every
CRON_S seconds (as cron would, faster) and a client sends one chat completion every
1 / RATE seconds through a real ingress, across the first job's end. Two arms, same run:

    before   successor_lead_s 0: the successor is submitted only once the job has gone
    after    successor_lead_s LEAD_S: it is submitted ahead of the end and serves beside it

Reported per arm: requests, client errors (anything but 200), and seconds unserved (from a
failed request to the next answered one, summed); in the JSON also the errors by cause (status
and error code) and each burst of them, with the jobs (squeue) and the ingress's sessions
(/v1/registry: state, ends_at, unrouted) around it, polled each second and printed as a
timeline. `--arms after` runs one arm. Needs root (Slurm: tests/lab/slurm_up.sh);
without it, it says so and writes nothing. Never asserts on time; leaves no job, partition,
process or file behind (a cluster it started is stopped again).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from fake_engine import free_port  # noqa: E402

import otela_place as place  # noqa: E402

PY = sys.executable
MODEL = "meta-llama/Llama-3.2-1B"
PARTITION = "otela-gap"
# A 4-minute job: Slurm sends --signal up to 60 s early, so SIGNAL_S = 30 drains it 150-210 s
# in, and a successor is due at half the limit (120 s: place.ending's cap), serving by ~140 s.
TIME_LIMIT_MIN = 4
SIGNAL_S = 30
LEAD_S = 120
LOAD_S = 10.0     # the emulated model load (a small model from a parallel file system)
CRON_S = 10.0     # placer passes: cron's finest period is 60 s; faster here to keep the run short
RATE = 5.0        # client requests per second, one at a time
MEASURE_S = 300   # from the first answer: past the first job's end (at 240 s) and its drain
ARMS = {"before": 0, "after": LEAD_S}   # successor_lead_s of each arm
WATCH_S = 1.0     # the jobs and sessions polled this often for the errors' timeline

# `vllm serve WEIGHTS --served-model-name NAME --tensor-parallel-size TP ...` as the vLLM
# template writes it, run by the emulated engine after the load
VLLM = f"""#!{PY}
import os, sys, time
time.sleep({LOAD_S})
args = ["--tp" if a == "--tensor-parallel-size" else a for a in sys.argv[3:]]
os.execv({PY!r}, [{PY!r}, {os.path.join(ROOT, "otela_sim.py")!r}, "serve", "--model", sys.argv[2]] + args)
"""


def alive(pidfile):
    try:
        with open(pidfile) as f, open(f"/proc/{f.read().strip()}/stat") as s:
            return s.read().split()[2] != "Z"
    except OSError:
        return False


def chat(url):
    """(status, why): 200 and "", an HTTP error and its body's error code and message, or None
    and the client's own error (a refused or dropped connection, a timeout)."""
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            resp.read()
            return resp.status, ""
    except urllib.error.HTTPError as e:
        try:
            error = json.loads(e.read())["error"]
            return e.code, f"{error.get('code') or error.get('type')}: {error.get('message')}"
        except (OSError, ValueError, KeyError, TypeError):
            return e.code, ""
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def our_jobs():
    out = place.slurm_command(["squeue", "--me", "-h", "-p", PARTITION, "-o", "%i"])
    return out.split()


def cancel_ours():
    ids = our_jobs()
    if ids:
        place.slurm_command(["scancel"] + ids)
    for _ in range(300):
        if not our_jobs():
            return
        time.sleep(0.2)


class Watch:
    """The jobs (squeue) and the ingress's sessions (/v1/registry), polled every WATCH_S from
    its own thread: each change is an event (seconds since `start`, what is now), for the
    timeline printed around each burst of errors."""

    def __init__(self, url, start):
        self.url, self.start, self.events, self.stop = url, start, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _jobs(self):
        out = place.slurm_command(["squeue", "-h", "-p", PARTITION, "-o", "%i %T %j %e"])
        return " ".join(sorted(f"job {i} {st} {name} ends {self._at(place._slurm_time(e))}"
                               for i, st, name, e in (line.split() for line in out.splitlines())))

    def _sessions(self):
        with urllib.request.urlopen(self.url + "/v1/registry", timeout=5) as resp:
            view = json.loads(resp.read())
        sessions = view.get("sessions", ())
        sessions = sessions.values() if isinstance(sessions, dict) else sessions
        return " ".join(sorted(f"session of job {(s.get('labels') or {}).get('slurm_job', '?')} {s.get('state')}"
                               f" ends {self._at(s.get('ends_at'))}{' unrouted' if s.get('unrouted') else ''}"
                               for s in sessions if s.get("role", "worker") == "worker"))

    def _at(self, unix):
        return "?" if unix is None else f"{unix - time.time() + time.monotonic() - self.start:.0f}"

    def _run(self):
        last = {}
        while not self.stop.wait(WATCH_S):
            for what, poll in (("jobs", self._jobs), ("sessions", self._sessions)):
                try:
                    now = poll()
                except (OSError, ValueError, place.PlacementError, place.SlurmError) as e:
                    now = f"unread ({e})"
                if now != last.get(what):
                    self.events.append((time.monotonic() - self.start, f"{what}: {now or 'none'}"))
                    last[what] = now


def bursts(samples, events, apart_s=5.0):
    """Failed requests grouped into bursts (no two more than apart_s apart), each with its
    errors by cause and the events from 30 s before it to 5 s after."""
    out = []
    for t, status, why in samples:
        if status == 200:
            continue
        if not out or t - out[-1]["until_s"] > apart_s:
            out.append({"at_s": round(t, 1), "until_s": t, "errors": 0, "causes": {}, "first": f"{status} {why}"})
        burst = out[-1]
        burst["until_s"], burst["errors"] = t, burst["errors"] + 1
        cause = cause_of(status, why)
        burst["causes"][cause] = burst["causes"].get(cause, 0) + 1
    for burst in out:
        burst["events"] = [f"{t:7.1f} {e}" for t, e in events if burst["at_s"] - 30 <= t <= burst["until_s"] + 5]
        burst["until_s"] = round(burst["until_s"], 1)
    return out


def cause_of(status, why):
    """An error's cause as the breakdown counts it: its status and code (or the client's error)."""
    return f"{status} {why.split(':')[0]}".strip()


def unserved(samples):
    """Seconds from each failed request to the next answered one, summed; and the longest."""
    total, longest, since = 0.0, 0.0, None
    for t, status, *_ in samples:
        if status != 200 and since is None:
            since = t
        elif status == 200 and since is not None:
            total, longest, since = total + t - since, max(longest, t - since), None
    if since is not None:
        total, longest = total + samples[-1][0] - since, max(longest, samples[-1][0] - since)
    return total, longest


def run_arm(work, ingress, lead_s, measure_s):
    """One arm: placer passes and a client across the first job's end. Returns its row."""
    site = {"gpus": [{"type": "H100", "count": 2, "per_node": 2, "gres": "", "partition": PARTITION,
                      "time_limit": str(TIME_LIMIT_MIN), "sbatch": [f"--signal=B:TERM@{SIGNAL_S}"]}],
            "engine_wrapper": f"env PATH={work}/bin:/usr/bin:/bin", "log_dir": f"{work}/logs",
            "successor_lead_s": lead_s, "catalogue": [{"name": MODEL, "min": 1, "max": 1}]}
    with open(f"{work}/site-{lead_s}.json", "w") as f:
        json.dump(site, f)
    argv = [PY, os.path.join(ROOT, "otela_place.py"), "plan", "--from-ingress", ingress["url"],
            "--site", f"{work}/site-{lead_s}.json", "--emit-sbatch", f"{work}/jobs-{lead_s}", "--submit",
            "--lock", f"{work}/lock-{lead_s}", "--no-reclaim", "--json",
            "--sbatch-var", f"KEY_FILE={ingress['key']}", "--sbatch-var", f"BOOTSTRAP={ingress['gossip']}",
            "--sbatch-var", "LISTEN_HOST=127.0.0.1"]
    stop, passes, submitted, watch = threading.Event(), [], [], None

    def cron():
        while not stop.is_set():
            out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            passes.append(out.returncode)
            if out.returncode == 0:
                submitted.extend(json.loads(out.stdout)["reconcile"]["submitted"])
            stop.wait(CRON_S)

    placer = threading.Thread(target=cron, daemon=True)
    placer.start()
    try:
        t0 = time.monotonic()
        while chat(ingress["url"])[0] != 200:       # the first instance: from an empty cluster
            if time.monotonic() - t0 > 180:
                raise RuntimeError("the first instance never served")
            time.sleep(0.5)
        first = time.monotonic() - t0
        samples, start = [], time.monotonic()
        watch = Watch(ingress["url"], start)
        watch.thread.start()
        while time.monotonic() - start < measure_s:
            sent = time.monotonic()
            samples.append((sent - start, *chat(ingress["url"])))
            time.sleep(max(0.0, 1 / RATE - (time.monotonic() - sent)))
    finally:
        stop.set()
        if watch is not None:
            watch.stop.set()
            watch.thread.join(timeout=10)
        placer.join(timeout=150)
        cancel_ours()
    gap, longest = unserved(samples)
    found = bursts(samples, watch.events)
    causes = {}
    for burst in found:
        for cause, n in burst["causes"].items():
            causes[cause] = causes.get(cause, 0) + n
    return {"arm": "after" if lead_s else "before", "successor_lead_s": lead_s, "requests": len(samples),
            "client_errors": sum(1 for _, s, _ in samples if s != 200), "unserved_s": round(gap, 1),
            "longest_gap_s": round(longest, 1), "first_200_s": round(first, 1), "jobs": len(submitted),
            "placer_passes": len(passes), "failed_passes": sum(1 for c in passes if c != 0),
            "causes": causes, "bursts": found}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="the same run (one job end per arm is the least)")
    ap.add_argument("--measure-s", type=float, default=MEASURE_S)
    ap.add_argument("--arms", default="before,after", help="the arms to run, of before,after (default both)")
    args = ap.parse_args()
    if not set(args.arms.split(",")) <= set(ARMS):
        ap.error(f"--arms: of {','.join(ARMS)}")
    if os.geteuid() != 0:
        print("bench_place_gap: skipped: needs root for a real Slurm (tests/lab/slurm_up.sh)")
        return 0
    started = not alive("/run/slurm/slurmctld.pid")
    up = subprocess.run(["bash", os.path.join(HERE, "lab", "slurm_up.sh")], capture_output=True, text=True,
                        timeout=900)
    if up.returncode != 0:
        print(f"bench_place_gap: skipped: Slurm did not come up: {(up.stdout + up.stderr).strip()[-200:]}")
        return 0
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    subprocess.run(["scontrol", "create", f"PartitionName={PARTITION}", f"Nodes={node}", "Default=NO",
                    "MaxTime=10", "State=UP"], capture_output=True)
    ingress_proc, rows = None, []
    with tempfile.TemporaryDirectory(prefix="otela-gap-") as work:
        try:
            os.makedirs(f"{work}/bin")
            with open(f"{work}/bin/vllm", "w") as f:
                f.write(VLLM)
            os.chmod(f"{work}/bin/vllm", 0o755)
            subprocess.run([PY, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", f"{work}/key"], check=True,
                           capture_output=True, timeout=60)
            port, gossip = free_port(), free_port(both=True)
            log = open(f"{work}/ingress.log", "w")
            ingress_proc = subprocess.Popen([PY, os.path.join(ROOT, "otela_ingress.py"), "serve", "--key-file",
                                             f"{work}/key/cluster.key", "--listen", f"127.0.0.1:{port}",
                                             "--gossip", f"127.0.0.1:{gossip}", "--db", f"{work}/usage.sqlite",
                                             "--no-auth"], stdout=log, stderr=subprocess.STDOUT)
            ingress = {"url": f"http://127.0.0.1:{port}", "gossip": f"127.0.0.1:{gossip}",
                       "key": f"{work}/key/cluster.key"}
            time.sleep(2)
            cancel_ours()
            for arm in args.arms.split(","):
                rows.append(run_arm(work, ingress, ARMS[arm], args.measure_s))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "bursts"}), flush=True)
                for burst in rows[-1]["bursts"]:
                    print(f"  {burst['errors']} errors {burst['at_s']}-{burst['until_s']} s: {burst['causes']}"
                          f"\n    first: {burst['first'][:200]}", flush=True)
                    for event in burst["events"]:
                        print(f"    {event}", flush=True)
        finally:
            cancel_ours()
            if ingress_proc is not None:   # the logs, for what the timeline does not say
                shutil.rmtree(os.path.join(args.out, "place_gap-logs"), ignore_errors=True)
                shutil.copytree(work, os.path.join(args.out, "place_gap-logs"),
                                ignore=shutil.ignore_patterns("key", "bin", "*.sqlite*", "lock-*"))
            subprocess.run(["scontrol", "delete", f"PartitionName={PARTITION}"], capture_output=True)
            if ingress_proc is not None:
                ingress_proc.terminate()
                ingress_proc.wait(20)
            if started:
                subprocess.run(["bash", os.path.join(HERE, "lab", "slurm_down.sh")], capture_output=True, timeout=120)
    print(f"\nA time limit's gap ({TIME_LIMIT_MIN}-minute jobs, drained {SIGNAL_S} s before the limit, load "
          f"{LOAD_S:g} s, a placer pass every {CRON_S:g} s, {RATE:g} req/s for {args.measure_s:g} s):")
    print(f"{'arm':<8}{'lead s':>8}{'requests':>10}{'errors':>8}{'unserved s':>12}{'longest s':>11}{'jobs':>6}")
    for r in rows:
        print(f"{r['arm']:<8}{r['successor_lead_s']:>8}{r['requests']:>10}{r['client_errors']:>8}"
              f"{r['unserved_s']:>12}{r['longest_gap_s']:>11}{r['jobs']:>6}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "place_gap.json"), "w") as f:
        json.dump({"rows": rows, "time_limit_min": TIME_LIMIT_MIN, "signal_s": SIGNAL_S, "load_s": LOAD_S,
                   "cron_s": CRON_S, "rate": RATE}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
