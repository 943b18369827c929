"""Reconcile against a real single-node Slurm (tests/lab/slurm_up.sh): plan -> sbatch ->
squeue -> a second run submits nothing -> demand falls -> scancel of the surplus only.
The jobs are trivial (sleep): the engine path is tests/test_place_e2e.py. Needs root."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB = os.path.join(ROOT, "tests", "lab")
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.slow]

SLEEP_TEMPLATE = """#!/bin/bash
#SBATCH --job-name={{JOB_NAME}}
#SBATCH --comment={{COMMENT}}
#SBATCH --ntasks=1
#SBATCH --time=00:10:00
#SBATCH --signal=B:TERM@60
#SBATCH --output={{LOG_DIR}}/%x-%j.out
# {{SBATCH_EXTRA}}
MODEL={{MODEL}}
exec sleep 600
"""


def _alive(pidfile):
    try:
        with open(pidfile) as f:
            pid = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("needs root to run slurmctld/slurmd (tests/lab/slurm_up.sh)")
    started = not _alive("/run/slurm/slurmctld.pid")
    up = subprocess.run(["bash", os.path.join(LAB, "slurm_up.sh")], capture_output=True, text=True, timeout=900)
    if up.returncode != 0 or not shutil.which("sbatch"):
        subprocess.run(["bash", os.path.join(LAB, "slurm_down.sh")], capture_output=True, timeout=120)
        pytest.skip(f"could not bring up Slurm: {(up.stdout + up.stderr).strip().splitlines()[-1:]}")
    try:
        yield
    finally:
        _cancel_ours()
        if started:
            subprocess.run(["bash", os.path.join(LAB, "slurm_down.sh")], capture_output=True, timeout=120)


def _cancel_ours():
    ids = [j["id"] for j in place.parse_squeue(place.slurm_command(["squeue", "--me", "-h", "-o", "%i %T %k"]))]
    if ids:
        subprocess.run(["scancel"] + ids, capture_output=True, timeout=60)
        for _ in range(150):
            if not place.parse_squeue(place.slurm_command(["squeue", "--me", "-h", "-o", "%i %T %k"])):
                break
            time.sleep(0.2)


TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "vocab_size": 1000}


def scenario(tmp_path, rate):
    """rate: req/s of the model "tiny", or {model: req/s}; every model serves 1 req/s per slot."""
    rates = rate if isinstance(rate, dict) else {"tiny": rate}
    doc = {"gpus": [{"type": "slot", "count": 2, "per_node": 2}],
           "models": {m: TINY for m in rates},
           "workload": [{"model": m, "rate_rps": r, "input": {"mean": 50}, "output": {"mean": 20}}
                        for m, r in rates.items()],
           "measured_instance_capacity_rps": {m: {"tp": 1, "slot": 1.0} for m in rates}}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(doc))
    return str(path)


# no cooldown, surplus handed back at once: the reconcile arithmetic alone
AT_ONCE = ("--cooldown", "0", "--release-idle")


def plan(tmp_path, rate, submit=True, extra=AT_ONCE):
    inv = tmp_path / "inventory.json"
    inv.write_text(json.dumps({"gpus": [{"type": "slot", "count": 2, "per_node": 2, "gres": ""}]}))
    tpl = tmp_path / "sleep.sbatch"
    tpl.write_text(SLEEP_TEMPLATE)
    argv = [sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario", scenario(tmp_path, rate),
            "--inventory", str(inv), "--template", str(tpl), "--emit-sbatch", str(tmp_path / "jobs"),
            "--lock", str(tmp_path / "lock"), "--sbatch-var", f"LOG_DIR={tmp_path / 'logs'}", "--json"]
    out = subprocess.run(argv + list(extra) + (["--submit"] if submit else []), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["reconcile"]


def our_jobs():
    return place.slurm_jobs()


def test_reconcile_submits_once_then_nothing_then_cancels_the_surplus(slurm, tmp_path):
    _cancel_ours()
    # 1.5 req/s at 1 req/s per instance and 1.25 headroom -> 2 instances
    first = plan(tmp_path, 1.5)
    assert len(first["submitted"]) == 2 and first["cancelled"] == []
    jobs = our_jobs()
    assert sorted(j["id"] for j in jobs) == sorted(first["submitted"])
    assert all(j["key"] == ("tiny", "slot", 1) for j in jobs)

    second = plan(tmp_path, 1.5)
    assert second["submit"] == [] and second["submitted"] == [] and second["cancel"] == []
    assert len(our_jobs()) == 2

    for _ in range(100):  # let them start, so the cancel takes a running one
        if all(j["state"] == "RUNNING" for j in our_jobs()):
            break
        time.sleep(0.2)
    third = plan(tmp_path, 0.5)  # demand fell: one instance is enough
    assert len(third["cancelled"]) == 1 and third["submitted"] == []
    assert third["cancelled"][0] == max(first["submitted"], key=int)  # the newest goes first
    # a running job drains: marked in its comment, SIGTERM to the batch shell only
    draining = [j for j in our_jobs() if j["id"] == third["cancelled"][0]]
    assert draining == [] or draining[0]["draining_since"] is not None
    assert plan(tmp_path, 0.5)["cancelled"] == []  # a draining job is not cancelled twice
    for _ in range(100):
        if len(our_jobs()) == 1:
            break
        time.sleep(0.2)
    assert [j["id"] for j in our_jobs()] == [min(first["submitted"], key=int)]


def _wait(predicate, what, tries=150):
    for _ in range(tries):
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(what)


def test_reclamation_moves_a_cold_models_slot_to_a_starved_one_after_the_cooldown(slurm, tmp_path):
    _cancel_ours()
    cooldown = ("--cooldown", "2")
    first = plan(tmp_path, {"cold": 1.5}, extra=cooldown)  # 2 instances fill both slots
    assert len(first["submitted"]) == 2
    _wait(lambda: [j["state"] for j in our_jobs()] == ["RUNNING"] * 2, "cold jobs did not start")
    # cold falls to 0.3 req/s, hot asks 1.5: the plan gives each one slot. hot's job is
    # queued at once and pends; cold keeps both slots while its cooldown runs.
    shift = {"cold": 0.3, "hot": 1.5}
    held = plan(tmp_path, shift, extra=cooldown)
    assert len(held["submitted"]) == 1 and held["cancelled"] == [] and held["reclaimed"] == []
    assert held["held"][0]["model"] == "cold" and "cooldown" in held["held"][0]["why"]
    hot = held["submitted"][0]
    assert {j["id"]: j["state"] for j in our_jobs()}[hot] == "PENDING"
    time.sleep(2.5)
    moved = plan(tmp_path, shift, extra=cooldown)
    assert moved["submitted"] == [] and len(moved["reclaimed"]) == 1
    assert moved["reclaimed"][0]["donor"] == "cold" and moved["reclaimed"][0]["for"] == ["hot"]
    assert moved["cancelled"] == [max(first["submitted"], key=int)]
    _wait(lambda: {j["id"]: j["state"] for j in our_jobs()}.get(hot) == "RUNNING", "hot's job did not start")
    assert sorted(j["key"][0] for j in our_jobs()) == ["cold", "hot"]
    assert plan(tmp_path, shift, extra=cooldown)["cancelled"] == []  # steady: nothing more moves


def test_a_dry_run_against_real_slurm_changes_nothing(slurm, tmp_path):
    _cancel_ours()
    report = plan(tmp_path, 1.5, submit=False)
    assert report["dry_run"] and len(report["submit"]) == 2 and report["submitted"] == []
    assert our_jobs() == []


def test_free_gpus_from_sinfo_parse_on_a_real_cluster(slurm):
    # this lab node has no GPU GRES: a real sinfo parses to an empty inventory, not an error
    assert place.slurm_inventory() == {"gpus": []}


# ---------------------------------------------------------------- placers that cannot collide
# Two login nodes (two lock files, two state files) running cron at once, and a run killed
# half-way: Slurm's job names (one per slot) with --dependency=singleton are the lease.


def slow_sbatch(tmp_path, delay, barrier=0):
    """A PATH with an sbatch that waits `delay` s before the real one, and with barrier=N a
    squeue whose first call in each placer waits until N placers made theirs: every run then
    reads the queue before any submits, the race two cron runs on two login nodes can have."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "sbatch"
    wrapper.write_text(f"#!/bin/sh\nsleep {delay}\nexec {shutil.which('sbatch')} \"$@\"\n")
    wrapper.chmod(0o755)
    if barrier:
        seen = tmp_path / "squeue-callers"
        seen.mkdir(exist_ok=True)
        squeue = bin_dir / "squeue"
        squeue.write_text(f"#!/bin/sh\nif [ ! -e {seen}/$PPID ]; then touch {seen}/$PPID; i=0\n"
                          f"  while [ $(ls {seen} | wc -l) -lt {barrier} ] && [ $i -lt 600 ]; do sleep 0.05; "
                          f"i=$((i+1)); done\nfi\nexec {shutil.which('squeue')} \"$@\"\n")
        squeue.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def plan_argv(tmp_path, node, rates, gpus=4):
    """A plan --submit run as login node `node` would start it: its own lock and state."""
    inv = tmp_path / "inventory.json"
    inv.write_text(json.dumps({"gpus": [{"type": "slot", "count": gpus, "per_node": gpus, "gres": ""}]}))
    tpl = tmp_path / "sleep.sbatch"
    tpl.write_text(SLEEP_TEMPLATE)
    doc = {"gpus": [{"type": "slot", "count": gpus, "per_node": gpus}], "models": {m: TINY for m in rates},
           "workload": [{"model": m, "rate_rps": r, "input": {"mean": 50}, "output": {"mean": 20}}
                        for m, r in rates.items()],
           "measured_instance_capacity_rps": {m: {"tp": 1, "slot": 1.0} for m in rates}}
    (tmp_path / "scenario.json").write_text(json.dumps(doc))
    return [sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario", str(tmp_path / "scenario.json"),
            "--inventory", str(inv), "--template", str(tpl), "--emit-sbatch", str(tmp_path / "jobs"),
            "--lock", str(tmp_path / f"{node}.lock"), "--sbatch-var", f"LOG_DIR={tmp_path / 'logs'}",
            "--json", "--submit"] + list(AT_ONCE)


def _slots():
    """{job name: [job ids]} of our live jobs."""
    out = {}
    for j in our_jobs():
        out.setdefault(j["name"], []).append(j["id"])
    return out


def test_two_placers_started_together_submit_every_job_once(slurm, tmp_path):
    _cancel_ours()
    env = dict(os.environ, PATH=slow_sbatch(tmp_path, 0.2, barrier=2))
    # 2 req/s at 1 req/s per instance with 1.25 headroom: 3 instances
    runs = [subprocess.Popen(plan_argv(tmp_path, node, {"race": 2.0}), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for node in ("login1", "login2")]
    outs = [r.communicate(timeout=120) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [o[1] for o in outs]
    reports = [json.loads(o[0])["reconcile"] for o in outs]
    assert all(len(r["submit"]) == 3 for r in reports), reports  # both saw an empty queue: the race happened
    slots = _slots()
    assert sorted(slots) == ["otela-race-slot-tp1-0", "otela-race-slot-tp1-1", "otela-race-slot-tp1-2"]
    assert all(len(ids) == 1 for ids in slots.values())
    # each duplicate was cancelled by a run (by both, when both looked after both had submitted:
    # scancel of a job already cancelled is harmless), and every run keeps the lowest id of a slot
    cancelled = set().union(*(r["duplicates"] for r in reports))
    assert len(cancelled) + 3 == sum(len(r["submit"]) for r in reports)
    # a third run finds nothing to do
    third = subprocess.run(plan_argv(tmp_path, "login1", {"race": 2.0}), capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr
    assert json.loads(third.stdout)["reconcile"]["submitted"] == [] and _slots() == slots


def test_a_placer_killed_mid_run_is_finished_by_the_next_run_with_every_job_once(slurm, tmp_path):
    _cancel_ours()
    env = dict(os.environ, PATH=slow_sbatch(tmp_path, 1.0))
    run = subprocess.Popen(plan_argv(tmp_path, "login1", {"kill": 2.0}), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(lambda: len(our_jobs()) >= 1, "the first run submitted nothing", tries=300)
    finally:
        os.killpg(run.pid, 9)  # the placer and the sbatch it is waiting on, mid-run
        run.wait(timeout=30)
    before = {j["id"] for j in our_jobs()}
    assert 1 <= len(before) < 3
    again = subprocess.run(plan_argv(tmp_path, "login1", {"kill": 2.0}), capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    slots = _slots()
    assert sorted(slots) == ["otela-kill-slot-tp1-0", "otela-kill-slot-tp1-1", "otela-kill-slot-tp1-2"]
    assert all(len(ids) == 1 for ids in slots.values())
    assert before <= {j["id"] for j in our_jobs()}  # what the killed run submitted stays, once


# ---------------------------------------------------------------- a site file on real Slurm
# A partition that is not the default one, which jobs must name (created at run time by
# scontrol, deleted after: slurm.conf is left as slurm_up.sh wrote it), and time limits of
# minutes.

SITE_TEMPLATE = """#!/bin/bash
#SBATCH --job-name={{JOB_NAME}}
#SBATCH --comment={{COMMENT}}
#SBATCH --ntasks=1
#SBATCH --time={{TIME_LIMIT}}
#SBATCH --output={{LOG_DIR}}/%x-%j.out
# {{SBATCH_EXTRA}}
MODEL={{MODEL}}
# {{SITE_SETUP}}
echo "serving $MODEL with HF_HOME=$HF_HOME"
exec sleep 600
"""


@pytest.fixture
def partition(slurm):
    name = "otela-site"
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    made = subprocess.run(["scontrol", "create", f"PartitionName={name}", f"Nodes={node}", "Default=NO",
                           "MaxTime=10", "State=UP"], capture_output=True, text=True)
    if made.returncode != 0 and "already exists" not in made.stderr.lower():
        pytest.skip(f"scontrol cannot create a partition here: {made.stderr.strip()}")
    try:
        yield name
    finally:
        _cancel_ours()
        subprocess.run(["scontrol", "delete", f"PartitionName={name}"], capture_output=True, timeout=60)


def site_plan(tmp_path, site, submit=True, template=SITE_TEMPLATE):
    """A cron run on a fresh site: no demand, a catalogue, the site file."""
    (tmp_path / "config").mkdir(exist_ok=True)
    (tmp_path / "config" / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "site.json").write_text(json.dumps(site))
    (tmp_path / "scenario.json").write_text(json.dumps({"gpus": [], "models": {}, "workload": []}))
    tpl = tmp_path / "site.sbatch"
    tpl.write_text(template)
    argv = [sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario", str(tmp_path / "scenario.json"),
            "--site", str(tmp_path / "site.json"), "--template", str(tpl), "--emit-sbatch", str(tmp_path / "jobs"),
            "--lock", str(tmp_path / "lock"), "--json", "--sbatch-var", "KEY_FILE=/k", "--sbatch-var", "BOOTSTRAP=b:1"]
    return subprocess.run(argv + (["--submit"] if submit else []), capture_output=True, text=True, timeout=120)


def fresh_site(tmp_path, partition, **over):
    gpu = {"type": "slot", "count": 2, "per_node": 2, "gres": "", "partition": partition, "account": "proj42",
           "time_limit": "3"}
    gpu.update(over.pop("gpu", {}))
    site = {"gpus": [gpu], "engine_env": {"HF_HOME": str(tmp_path / "hf")}, "log_dir": str(tmp_path / "logs"),
            "catalogue": [{"name": "tiny", "weights": str(tmp_path / "config"), "min": 1, "max": 2}]}
    site.update(over)
    return site


def _squeue(fields):
    out = place.slurm_command(["squeue", "--me", "-h", "-o", f"%i|{fields}|%k"])
    return [line.split("|")[:-4] for line in out.splitlines() if "|otela|" in line]


def test_a_fresh_site_gets_its_catalogues_first_instance_in_the_partition_it_names(partition, tmp_path):
    _cancel_ours()
    out = site_plan(tmp_path, fresh_site(tmp_path, partition))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)["reconcile"]
    assert len(report["submitted"]) == 1                       # min 1, no demand: the first instance
    (job, part, account, limit), = _squeue("%P|%a|%l")
    assert (job, part, account, limit) == (report["submitted"][0], partition, "proj42", "3:00")
    _wait(lambda: os.path.exists(tmp_path / "logs" / f"otela-tiny-slot-tp1-0-{job}.out")
          and "serving" in open(tmp_path / "logs" / f"otela-tiny-slot-tp1-0-{job}.out").read(), "no log")
    assert open(tmp_path / "logs" / f"otela-tiny-slot-tp1-0-{job}.out").read() == \
        f"serving tiny with HF_HOME={tmp_path}/hf\n"


def test_a_site_file_naming_a_partition_sinfo_does_not_list_changes_nothing_in_slurm(partition, tmp_path):
    _cancel_ours()
    out = site_plan(tmp_path, fresh_site(tmp_path, partition, gpu={"partition": "gpus-typo"}))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"otela_place: {tmp_path}/site.json: gpus[0].partition: 'gpus-typo' is not a "
                                 "partition sinfo lists (") and out.stderr.count("\n") == 1
    assert our_jobs() == [] and not (tmp_path / "jobs").exists()


def test_a_job_whose_python_is_too_old_says_so_in_its_log_with_its_job_id(partition, tmp_path):
    _cancel_ours()
    py36 = tmp_path / "python3"
    py36.write_text("#!/bin/sh\n[ \"$1\" = -V ] && { echo 'Python 3.6.8'; exit 0; }\n"
                    "echo 'SyntaxError: future feature annotations is not defined' >&2; exit 1\n")
    py36.chmod(0o755)
    with open(os.path.join(ROOT, "sbatch", "vllm.sbatch")) as f:
        vllm = f.read()
    out = site_plan(tmp_path, fresh_site(tmp_path, partition, python=str(py36)), template=vllm)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["reconcile"]["submitted"][0]
    log = tmp_path / "logs" / f"otela-tiny-slot-tp1-0-{job}.out"
    _wait(lambda: log.exists() and log.read_text(), "the job wrote no log")
    assert log.read_text() == (f"otela job {job}: {py36} is Python 3.6.8; otela needs Python 3.9 or newer; "
                               "set \"python\" in the site file (or --sbatch-var PYTHON=...)\n")


def test_a_successor_starts_beside_a_job_near_its_time_limit_and_the_slot_stays_once(partition, tmp_path):
    _cancel_ours()
    # a 1-minute job is ending in its second half (the lead of 175 s is capped at half its time
    # limit): the next run's successor must run beside it (its singleton may not wait for it)
    site = fresh_site(tmp_path, partition, successor_lead_s=175, gpu={"time_limit": "1"})
    first = json.loads(site_plan(tmp_path, site).stdout)["reconcile"]
    _wait(lambda: [j["state"] for j in our_jobs()] == ["RUNNING"], "the first job did not start")
    assert json.loads(site_plan(tmp_path, site).stdout)["reconcile"]["ending"] == []
    time.sleep(max(0.0, our_jobs()[0]["starts_at"] + 31 - time.time()))
    second = site_plan(tmp_path, site)
    assert second.returncode == 0, second.stderr
    report = json.loads(second.stdout)["reconcile"]
    assert report["ending"] == first["submitted"] and len(report["submitted"]) == 1
    _wait(lambda: [j["state"] for j in our_jobs()] == ["RUNNING", "RUNNING"], "the successor did not start beside")
    names = {j["id"]: j["name"] for j in our_jobs()}
    assert names == {first["submitted"][0]: "otela-tiny-slot-tp1-0-ending",
                     report["submitted"][0]: "otela-tiny-slot-tp1-0"}
    third = json.loads(site_plan(tmp_path, site).stdout)["reconcile"]
    assert third["submitted"] == [] and third["cancelled"] == [] and len(our_jobs()) == 2
