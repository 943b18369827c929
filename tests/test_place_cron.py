"""Dynamic reclamation from cron: the Reclaimer's rules between runs that share only a state
file. A fake clock and a fake Slurm (jobs run while GPUs are free, else pend) drive several
simulated cron runs of plan -> reconcile; no root, no real Slurm."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402

COOLDOWN = place.RECLAIM_COOLDOWN_S
POOL = {"A": (4, 4)}
INVENTORY = {"gpus": [{"type": "A", "count": 4, "per_node": 4, "gres": ""}]}
VARS = {"KEY_FILE": "/k", "BOOTSTRAP": "b:1"}


class FakeSlurm:
    """sbatch / squeue / scancel / scontrol over a pool of GPUs: a job runs when its GPUs
    are free, else pends (started in submission order); a drained job's node exits at once."""

    def __init__(self, gpus=4):
        self.gpus, self.jobs, self.next_id, self.log = gpus, {}, 100, []

    def __call__(self, argv, timeout=60):
        self.log.append(argv)
        if argv[0] == "sbatch":
            with open(argv[-1]) as f:
                comment = re.search(r"^#SBATCH --comment=(\S+)", f.read(), re.M).group(1)
            self.next_id += 1
            self.jobs[str(self.next_id)] = {"state": "PENDING", "comment": comment}
            self._schedule()
            return f"{self.next_id}\n"
        if argv[0] == "squeue":
            return "".join(f"{i} {j['state']} {j['comment']}\n" for i, j in self.jobs.items())
        if argv[0] == "scontrol":
            jid = argv[2].split("=", 1)[1]
            self.jobs[jid]["comment"] = argv[3].split("=", 1)[1]
            return ""
        if argv[0] == "scancel":
            for jid in (a for a in argv[1:] if not a.startswith("-")):
                self.jobs.pop(jid, None)
            self._schedule()
            return ""
        raise AssertionError(argv)

    def _tp(self, job):
        return int(job["comment"].split("|")[-1])

    def _schedule(self):
        used = sum(self._tp(j) for j in self.jobs.values() if j["state"] == "RUNNING")
        for j in self.jobs.values():  # submission order
            if j["state"] == "PENDING" and used + self._tp(j) <= self.gpus:
                j["state"], used = "RUNNING", used + self._tp(j)

    def count(self, model, state=None):
        return sum(1 for j in self.jobs.values() if j["comment"].split("|")[1] == model
                   and (state is None or j["state"] == state))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A test writes only under its own temporary directory: the default log directory of the
    scripts (~/.otela/logs, which a submit creates) is then there too."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_submitting_creates_the_log_directory_under_the_tests_own_folder(slurm, tmp_path, home):
    cron_run(tmp_path, 0, {"hot": 30.0}, reclaim=False)
    assert (tmp_path / "logs").is_dir() and not home.exists()


@pytest.fixture
def slurm(monkeypatch):
    fake = FakeSlurm()
    monkeypatch.setattr(place, "slurm_command", fake)
    return fake


def cands(*models):
    return [place.Candidate(m, "A", 1, 10.0) for m in models]


def cron_run(tmp_path, now, demand, load_s=None, submit=True, reclaim=True, **kw):
    """One cron run: plan on the demand, reconcile against the fake Slurm."""
    live = {m: d for m, d in demand.items() if d > 0}
    rows = place.solve(live, POOL, cands(*live)).rows if live else []
    gate = None
    if reclaim:
        gate = place.CronReclaim(str(tmp_path / "state.json"), demand, {("hot", "A", 1): 10.0, ("cold", "A", 1): 10.0,
                                                                         ("big", "A", 1): 10.0, ("small", "A", 1): 10.0},
                                 load_s or {}, POOL, now=now, **kw)
    return place.reconcile(rows, INVENTORY, "vllm", dict(VARS, LOG_DIR=str(tmp_path / "logs")),
                           str(tmp_path / "jobs"), submit, jobs=place.slurm_jobs(), reclaim=gate)  # as cmd_plan does


def test_a_cold_model_gives_gpus_to_a_starved_one_only_after_its_cooldown(slurm, tmp_path):
    first = cron_run(tmp_path, 0, {"cold": 30.0})
    assert len(first["submitted"]) == 4 and slurm.count("cold", "RUNNING") == 4
    # demand moves: cold falls to 2 req/s, hot wants 25. hot's jobs are queued at once
    # (they pend: no GPU is free); cold keeps its GPUs for the whole cooldown.
    t, runs = 60, []
    while t < 60 + COOLDOWN:
        runs.append(cron_run(tmp_path, t, {"cold": 2.0, "hot": 25.0}))
        assert slurm.count("cold") == 4, t
        t += 60
    assert len(runs[0]["submitted"]) == 3 and slurm.count("hot", "PENDING") == 3
    assert all(r["cancelled"] == [] for r in runs)
    assert runs[-1]["held"][0]["why"] == f"demand low for {COOLDOWN - 60} s of the {COOLDOWN} s cooldown"
    # the cooldown is over: three cold jobs go (one stays, the plan's share), hot runs
    done = cron_run(tmp_path, t, {"cold": 2.0, "hot": 25.0})
    assert [r["donor"] for r in done["reclaimed"]] == ["cold"] * 3 and all(r["for"] == ["hot"] for r in done["reclaimed"])
    assert done["submitted"] == [] and len(done["cancelled"]) == 3
    assert slurm.count("cold") == 1 and slurm.count("hot", "RUNNING") == 3
    # steady now: the next run changes nothing
    after = cron_run(tmp_path, t + 60, {"cold": 2.0, "hot": 25.0})
    assert after["submitted"] == [] and after["cancelled"] == [] and after["reclaimed"] == []


def test_a_low_model_keeps_its_gpus_when_no_other_model_needs_them(slurm, tmp_path):
    cron_run(tmp_path, 0, {"cold": 30.0})
    for k in range(1, 30):  # half an hour of low demand, nobody else asking
        report = cron_run(tmp_path, 60 * k, {"cold": 2.0})
        assert report["cancelled"] == []
    assert report["held"][0]["why"] == "no other model needs its A GPUs" and slurm.count("cold") == 4


def test_release_idle_hands_surplus_back_after_the_cooldown(slurm, tmp_path):
    cron_run(tmp_path, 0, {"cold": 30.0})
    cancelled_at = [60 * k for k in range(1, 20)
                    if cron_run(tmp_path, 60 * k, {"cold": 2.0}, release_idle=True)["cancelled"]]
    assert cancelled_at == [60 + COOLDOWN] and slurm.count("cold") == 1


def test_a_model_without_demand_is_scaled_to_zero_after_the_cooldown(slurm, tmp_path):
    cron_run(tmp_path, 0, {"cold": 12.0})
    gone = [60 * k for k in range(1, 20) if cron_run(tmp_path, 60 * k, {"cold": 0.0})["cancelled"]]
    assert gone == [60 + COOLDOWN] and slurm.count("cold") == 0


def test_demand_swinging_every_run_does_not_flap(slurm, tmp_path):
    moves = []
    for k in range(40):  # 25 req/s and 5 req/s on alternate minutes
        r = cron_run(tmp_path, 60 * k, {"hot": 25.0 if k % 2 == 0 else 5.0})
        moves.append(len(r["submitted"]) + len(r["cancelled"]))
    assert moves[0] >= 3 and sum(moves[1:]) == 0  # scaled up once, never down


def test_without_reclamation_the_same_swings_flap(slurm, tmp_path):
    moves = [len(r["submitted"]) + len(r["cancelled"])
             for r in (cron_run(tmp_path, 60 * k, {"hot": 25.0 if k % 2 == 0 else 5.0}, reclaim=False)
                       for k in range(10))]
    assert all(m > 0 for m in moves)  # every run submits or cancels: what the state file prevents


def test_scale_up_waits_until_demand_is_above_the_high_watermark(slurm, tmp_path):
    cron_run(tmp_path, 0, {"hot": 12.0})         # 12 x 1.25 = 15 -> 2 instances, 20 req/s
    assert slurm.count("hot") == 2
    held = cron_run(tmp_path, 60, {"hot": 17.0})  # the plan wants 3 (21.25 > 20), but 85% < 90%
    assert held["submitted"] == [] and held["held"][0]["action"] == "submit"
    assert held["held"][0]["why"] == "demand 17 req/s is 85% of its capacity 20 req/s: scale-up waits for 90%"
    up = cron_run(tmp_path, 120, {"hot": 19.0})   # 95%: go
    assert len(up["submitted"]) == 1 and slurm.count("hot") == 3


def test_load_time_counts_the_cheapest_reload_donates_first(slurm, tmp_path):
    cron_run(tmp_path, 0, {"big": 12.0, "small": 12.0})  # 2 + 2 instances fill the pool
    assert slurm.count("big") == 2 and slurm.count("small") == 2
    load = {"big": 300.0, "small": 30.0}  # same demand, big reloads 10x slower
    demand = {"big": 2.0, "small": 2.0, "hot": 8.0}
    for k in range(1, 12):
        cron_run(tmp_path, 60 * k, demand, load_s=load)
    # hot's one instance needed one GPU: the small model gave it, the big one kept its two
    assert slurm.count("hot", "RUNNING") == 1 and slurm.count("small") == 1 and slurm.count("big") == 2


def test_a_dry_run_records_demand_but_changes_nothing(slurm, tmp_path):
    cron_run(tmp_path, 0, {"cold": 30.0})
    for k in range(1, 15):
        report = cron_run(tmp_path, 60 * k, {"cold": 2.0, "hot": 25.0}, submit=False)
    # a real run would reclaim now; the dry run says so and did nothing
    assert report["dry_run"] and len(report["cancel"]) == 3 and report["cancelled"] == []
    assert slurm.count("cold") == 4 and slurm.count("hot") == 0
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["models"]["cold"]["last_change"] == 0 and state["models"]["cold"]["below_since"] == 60
    assert len(state["models"]["cold"]["history"]) == 15


# ---------------------------------------------------------------- the state file


@pytest.mark.parametrize("content", ["{not json", "[]", '{"version": 99, "models": {}}', "\x00\x01"])
def test_a_corrupt_state_starts_fresh_with_a_warning(tmp_path, capsys, content):
    path = tmp_path / "state.json"
    path.write_text(content)
    assert place.load_state(str(path)) == {"version": place.STATE_VERSION, "models": {}}
    err = capsys.readouterr().err
    assert err.startswith(f"otela_place: warning: reclamation state {path}") and err.count("\n") == 1


def test_a_missing_state_starts_fresh_with_a_warning(tmp_path, capsys):
    assert place.load_state(str(tmp_path / "nope.json"))["models"] == {}
    assert "starting fresh" in capsys.readouterr().err


def test_bad_entries_in_a_state_are_dropped_not_fatal(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "models": {"m": {"below_since": "x", "last_change": 5,
                                                             "history": [[1, 2], ["a", 1], 3]}, "n": 7}}))
    state = place.load_state(str(path))
    assert state["models"]["m"] == {"below_since": None, "last_change": 5.0, "history": [[1.0, 2.0]]}
    assert state["models"]["n"] == {"below_since": None, "last_change": None, "history": []}


def test_the_state_is_replaced_atomically_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "state.json")
    place.save_state(path, {"version": 1, "models": {"m": {"below_since": 1.0, "last_change": None, "history": []}}})
    old = open(path).read()

    def broken(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(place.os, "replace", broken)
    place.save_state(path, {"version": 1, "models": {}})
    assert open(path).read() == old and os.listdir(tmp_path) == ["state.json"]  # no temp file left
    assert "cannot save reclamation state" in capsys.readouterr().err


def test_history_is_bounded(slurm, tmp_path):
    for k in range(place.STATE_HISTORY + 20):
        cron_run(tmp_path, 60 * k, {"hot": 5.0})
    state = json.loads((tmp_path / "state.json").read_text())
    assert len(state["models"]["hot"]["history"]) == place.STATE_HISTORY


def test_plan_cli_keeps_its_state_next_to_the_lock(tmp_path):
    scenario = {"gpus": [{"type": "A", "count": 2, "per_node": 2, "gres": ""}],
                "models": {"tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 1000}},
                "workload": [{"model": "tiny", "rate_rps": 1.5, "input": {"mean": 50}, "output": {"mean": 20}}],
                "measured_instance_capacity_rps": {"tiny": {"tp": 1, "A": 1.0}}}
    (tmp_path / "s.json").write_text(json.dumps(scenario))
    argv = [sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario", str(tmp_path / "s.json"),
            "--emit-sbatch", str(tmp_path / "jobs"), "--lock", str(tmp_path / "run" / "place.lock"),
            "--sbatch-var", "KEY_FILE=k", "--sbatch-var", "BOOTSTRAP=b:1"]
    env = dict(os.environ, PATH="/nonexistent")  # no Slurm: a dry run
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr
    assert "no reclamation state" in first.stderr and "would submit 2" in first.stdout
    state = json.loads((tmp_path / "run" / "place-state.json").read_text())
    assert state["models"]["tiny"]["history"][0][1] == 1.5
    second = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    # (KEY_FILE=k is no file here: the jobs get no grant, said once a run)
    assert second.returncode == 0 and [line for line in second.stderr.splitlines() if "no grants" not in line] == []
    bad = subprocess.run(argv + ["--cooldown", "-1"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2
    assert bad.stderr == "otela_place.py plan: error: argument --cooldown: -1 must be >= 0 (--help for usage)\n"
