"""Job templates, Slurm output parsing, reconcile arithmetic, the lock and --from-ingress:
everything of the cron path that needs neither root nor a real Slurm."""
from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402

SBATCH = os.path.join(ROOT, "sbatch")
ROWS = [{"model": "meta-llama/Llama-2-13b-hf", "gpu": "A100-80GB-SXM4", "tp": 4, "instances": 2, "weight": 1.0}]
INVENTORY = {"gpus": [{"type": "A100-80GB-SXM4", "count": 8, "per_node": 4, "gres": "gpu:a100", "partition": "gpu"}]}
VARS = {"KEY_FILE": "/keys/cluster.key", "BOOTSTRAP": "login1:7946"}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A test writes only under its own temporary folder: the scripts' default log folder
    (~/.otela/logs, which emitting them creates) is then there too."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def bash_n(path):
    return subprocess.run(["bash", "-n", path], capture_output=True, text=True)


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(SBATCH) if f.endswith((".sbatch", ".sh"))))
def test_every_template_as_shipped_passes_bash_n(name):
    out = bash_n(os.path.join(SBATCH, name))
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("template", ["vllm", "sglang", "llamacpp"])
def test_rendered_scripts_pass_bash_n_and_carry_signal_gres_and_comment(template, tmp_path):
    values = dict(VARS, MODEL_FILE="/models/x.gguf")
    scripts = place.job_scripts(ROWS, INVENTORY, template, values)
    assert len(scripts) == 2  # one script per instance
    for _, name, text in scripts:
        path = tmp_path / name
        path.write_text(text)
        assert bash_n(str(path)).returncode == 0
        assert "#SBATCH --signal=B:TERM@120" in text
        assert "#SBATCH --gres=gpu:a100:4" in text
        assert "#SBATCH --partition=gpu" in text
        assert "#SBATCH --comment=otela|meta-llama/Llama-2-13b-hf|A100-80GB-SXM4|4" in text
        assert not re.search(r"\{\{[A-Z_]+\}\}", text)


def test_node_is_execed_so_the_batch_shell_signal_reaches_it():
    with open(os.path.join(SBATCH, "node.sh")) as f:
        lines = [ln.strip() for ln in f if ln.strip().startswith("exec ")]
    assert lines and "otela_node.py" in lines[0] and "start" in lines[0]


def test_a_job_on_a_slurm_that_does_not_say_its_end_hands_the_node_squeues(tmp_path):
    """Slurm before 23.02 sets no SLURM_JOB_END_TIME: the script asks squeue for the job's end."""
    otela, bin_dir = tmp_path / "otela", tmp_path / "bin"
    (otela / "sbatch").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(os.path.join(SBATCH, "node.sh"), otela / "sbatch" / "node.sh")
    (otela / "otela_node.py").write_text("import os\nprint(os.environ.get('SLURM_JOB_END_TIME', 'none'))\n")
    _, name, text = place.job_scripts(ROWS, INVENTORY, "vllm", dict(VARS, OTELA_DIR=str(otela),
                                                                     PYTHON=sys.executable))[0]
    (tmp_path / name).write_text(text)
    ends = {}
    for said in ("2026-12-07T04:40:00", "N/A"):
        (bin_dir / "squeue").write_text(f"#!/bin/sh\necho {said}\n")
        (bin_dir / "squeue").chmod(0o755)
        for env in ({}, {"SLURM_JOB_END_TIME": "1796000000"}):
            out = subprocess.run(["bash", str(tmp_path / name)], capture_output=True, text=True, timeout=30,
                                 env=dict(os.environ, SLURM_JOB_ID="4242", PATH=f"{bin_dir}:{os.environ['PATH']}",
                                          **env))
            assert out.returncode == 0, out.stderr
            ends[said, bool(env)] = out.stdout.strip().splitlines()[-1]
    assert ends == {("2026-12-07T04:40:00", False): str(int(place.time.mktime((2026, 12, 7, 4, 40, 0, 0, 0, -1)))),
                    ("2026-12-07T04:40:00", True): "1796000000", ("N/A", False): "none", ("N/A", True): "1796000000"}


def test_a_template_value_missing_is_a_one_line_error():
    with pytest.raises(place.PlacementError) as err:
        place.job_scripts(ROWS, INVENTORY, "llamacpp", VARS)
    assert str(err.value) == "template needs a value for MODEL_FILE (--sbatch-var MODEL_FILE=...)"


def test_unsafe_directive_values_are_refused():
    with pytest.raises(place.PlacementError):
        place.render("#SBATCH --job-name={{JOB_NAME}}\n", {"JOB_NAME": "x y; rm -rf /"})


def test_rendered_script_hands_the_node_exactly_the_planned_values(tmp_path):
    """Run a rendered vLLM script with a stand-in otela_node.py that records its argv."""
    otela = tmp_path / "otela"
    (otela / "sbatch").mkdir(parents=True)
    shutil.copy(os.path.join(SBATCH, "node.sh"), otela / "sbatch" / "node.sh")
    (otela / "otela_node.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    values = dict(VARS, OTELA_DIR=str(otela), PYTHON=sys.executable, BOOTSTRAP="a b'c:1")
    _, name, text = place.job_scripts(ROWS, INVENTORY, "vllm", values)[0]
    script = tmp_path / name
    script.write_text(text)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, SLURM_JOB_ID="4242"))
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout.strip().splitlines()[-1])
    assert argv[0] == "start"
    assert argv[argv.index("--bootstrap") + 1] == "a b'c:1"
    assert argv[argv.index("--process") + 1] == \
        ("vllm serve meta-llama/Llama-2-13b-hf --served-model-name meta-llama/Llama-2-13b-hf "
         "--tensor-parallel-size 4 --host 127.0.0.1 --port {port}")
    labels = [argv[i + 1] for i, a in enumerate(argv) if a == "--label"]
    assert labels == ["slurm_job=4242", "otela.model=meta-llama/Llama-2-13b-hf",
                      "otela.gpu=A100-80GB-SXM4", "otela.tp=4"]


def login_node(tmp_path, *args, python=sys.executable):
    """Run sbatch/login-node.sh with stand-ins for otela_node.py and otela_place.py that
    print their argv, and a fresh state directory."""
    otela = tmp_path / "otela"
    (otela / "sbatch").mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(SBATCH, "login-node.sh"), otela / "sbatch" / "login-node.sh")
    for name in ("otela_node.py", "otela_place.py", "otela_ingress.py"):
        (otela / name).write_text("import json, sys\nprint(json.dumps(sys.argv))\n")
    env = dict(os.environ, OTELA_STATE=str(tmp_path / "state"), PYTHON=python, OTELA_LISTEN="127.0.0.1:8089",
               OTELA_INGRESS_STATE=str(tmp_path / "local"))
    return subprocess.run(["bash", str(otela / "sbatch" / "login-node.sh"), *args], capture_output=True, text=True,
                          timeout=30, env=env)


def test_login_node_relay_starts_the_standalone_relay_with_the_cluster_key(tmp_path):
    out = login_node(tmp_path, "relay", "start")
    assert out.returncode == 0, out.stderr
    state = tmp_path / "state"
    log = state / "logs" / "relay.log"
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    argv = json.loads(log.read_text().strip().splitlines()[-1])
    assert argv[1:] == ["relay", "--key-file", f"{state}/cluster.key", "--gossip", "0.0.0.0:7946",
                        "--listen", "127.0.0.1:7701"]


def test_login_node_ingress_keeps_its_secret_and_database_off_the_shared_state_folder(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ingress.key").write_text("ab" * 32 + "\n")   # where keygen wrote it
    out = login_node(tmp_path, "ingress", "start")
    assert out.returncode == 0, out.stderr
    state, local = tmp_path / "state", tmp_path / "local"
    log = state / "logs" / "ingress.log"
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    argv = json.loads(log.read_text().strip().splitlines()[-1])
    assert argv[argv.index("--ingress-key-file") + 1] == f"{local}/ingress.key"
    assert argv[argv.index("--db") + 1] == f"{local}/usage.sqlite"
    assert (local / "ingress.key").read_text() == "ab" * 32 + "\n" and not (state / "ingress.key").exists()
    assert local.stat().st_mode & 0o077 == 0
    login_node(tmp_path, "ingress", "stop")


def test_login_node_runs_the_checkouts_venv_python_when_no_python_is_given(tmp_path):
    venv_python = tmp_path / "otela" / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f"#!/bin/sh\necho venv >> {tmp_path}/used\nexec {sys.executable} \"$@\"\n")
    venv_python.chmod(0o755)
    out = login_node(tmp_path, "place", python="")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "used").read_text().split() == ["venv", "venv"]   # keygen, then the placer


def test_login_node_unknown_role_prints_usage(tmp_path):
    out = login_node(tmp_path, "bogus")
    assert out.returncode == 2 and out.stderr.startswith("usage: ") and "ingress|relay" in out.stderr


def test_login_node_place_runs_the_cron_plan_with_lock_and_state_next_to_it(tmp_path):
    out = login_node(tmp_path, "place", "--cooldown", "300")
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout.strip().splitlines()[-1])
    state = str(tmp_path / "state")
    assert argv[1:4] == ["plan", "--from-ingress", "http://127.0.0.1:8089"]
    assert "--submit" in argv and argv[argv.index("--lock") + 1] == state + "/place.lock"
    assert argv[argv.index("--emit-sbatch") + 1] == state + "/jobs" and argv[-2:] == ["--cooldown", "300"]


def test_login_node_place_reads_the_site_file_in_its_state_folder_and_leaves_the_logs_to_it(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "site.json").write_text("{}")
    argv = json.loads(login_node(tmp_path, "place").stdout.strip().splitlines()[-1])
    assert argv[argv.index("--site") + 1] == str(tmp_path / "state" / "site.json")
    assert not any(a.startswith("LOG_DIR=") for a in argv) and not any(a.startswith("PYTHON=") for a in argv)


def test_login_node_scrontab_prints_a_line_that_runs_the_placer_against_this_login_node(tmp_path):
    out = login_node(tmp_path, "scrontab")
    assert out.returncode == 0, out.stderr
    options, line = out.stdout.splitlines()
    assert options == "#SCRON --job-name=otela-place --time=00:10:00"
    fields = line.split(None, 5)
    assert fields[:5] == ["*/5", "*", "*", "*", "*"]
    # scrontab runs the line's command in a job on another node: run it as that job would
    ran = subprocess.run(["bash", "-c", fields[5]], capture_output=True, text=True, timeout=30,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert ran.returncode == 0, ran.stderr
    argv = json.loads(ran.stdout.strip().splitlines()[-1])
    host = subprocess.run(["hostname", "-f"], capture_output=True, text=True).stdout.strip()
    assert argv[argv.index("--from-ingress") + 1] == f"http://{host}:8089"
    assert f"BOOTSTRAP={host}:7946" in argv and argv[argv.index("--lock") + 1] == f"{tmp_path}/state/place.lock"
    assert argv[0].endswith("otela_place.py") and "--submit" in argv


def test_kubernetes_manifest_runs_the_same_node_with_a_grace_period():
    with open(os.path.join(SBATCH, "k8s-node.yaml")) as f:
        text = f.read()
    assert "\t" not in text
    assert "otela_node.py start" in text and "terminationGracePeriodSeconds: 120" in text
    assert "exec python3" in text


# ---------------------------------------------------------------- Slurm output


def test_gres_strings_count_gpus_per_type():
    assert place.parse_gres("gpu:a100:4(S:0-1),shard:8") == {"a100": 4}
    assert place.parse_gres("gpu:2") == {"gpu": 2}
    assert place.parse_gres("gpu:a100:2(IDX:0-1),gpu:h100:1(IDX:3)") == {"a100": 2, "h100": 1}
    assert place.parse_gres("(null)") == {}


SINFO = """\
nid001|idle|gpu:a100:4(S:0-1)|gpu:a100:0(IDX:N/A)|
nid001|idle|gpu:a100:4(S:0-1)|gpu:a100:0(IDX:N/A)|
nid002|mix|gpu:a100:4(S:0-1)|gpu:a100:3(IDX:0-2)|
nid003|drain|gpu:a100:4(S:0-1)|gpu:a100:0(IDX:N/A)|
nid004|alloc|gpu:gh200:4|gpu:gh200:4(IDX:0-3)|
nid005|idle*|gpu:gh200:4|gpu:gh200:0|
nid006|idle|gpu:gh200:4|gpu:gh200:0|
"""


def test_sinfo_free_gpus_skip_drained_unresponsive_and_duplicate_nodes():
    inv = place.parse_sinfo(SINFO, {"a100": "A100-80GB-SXM4"})
    by_type = {g["type"]: g for g in inv["gpus"]}
    assert by_type["A100-80GB-SXM4"] == {"type": "A100-80GB-SXM4", "count": 5, "per_node": 4, "gres": "gpu:a100"}
    # nid004 is full, nid005 idle* (not responding): only nid006's 4 count
    assert by_type["gh200"] == {"type": "gh200", "count": 4, "per_node": 4, "gres": "gpu:gh200"}


SQUEUE = """\
101 RUNNING otela|meta-llama/Llama-2-13b-hf|A100-80GB-SXM4|1
102 PENDING otela|meta-llama/Llama-2-13b-hf|A100-80GB-SXM4|1
103 RUNNING (null)
104 RUNNING someone else's comment
"""


def test_squeue_lists_only_jobs_with_the_otela_comment():
    jobs = place.parse_squeue(SQUEUE)
    assert [(j["id"], j["state"], j["key"]) for j in jobs] == [
        ("101", "RUNNING", ("meta-llama/Llama-2-13b-hf", "A100-80GB-SXM4", 1)),
        ("102", "PENDING", ("meta-llama/Llama-2-13b-hf", "A100-80GB-SXM4", 1))]


def test_a_draining_job_counts_for_nothing_and_is_killed_after_the_grace():
    jobs = place.parse_squeue("201 RUNNING otela-drain|1000|m|A|1\n202 RUNNING otela|m|A|1\n")
    assert jobs[0]["draining_since"] == 1000 and jobs[0]["key"] == KEY and jobs[1]["draining_since"] is None
    early = place.reconcile_actions(row(2), jobs, now=1000 + 60)
    assert early["have"] == {KEY: 1} and early["submit"] == {KEY: 1} and early["hard_cancel"] == []
    late = place.reconcile_actions(row(2), jobs, now=1000 + place.DRAIN_GRACE_S)
    assert late["hard_cancel"] == ["201"]


# ---------------------------------------------------------------- reconcile


KEY = ("m", "A", 1)


def row(n):
    return [{"model": "m", "gpu": "A", "tp": 1, "instances": n, "weight": 1.0}]


def test_reconcile_submits_the_difference_and_nothing_once_it_is_there():
    first = place.reconcile_actions(row(3), [{"id": "1", "state": "RUNNING", "key": KEY}])
    assert first["submit"] == {KEY: 2} and first["cancel"] == []
    jobs = [{"id": str(i), "state": "PENDING", "key": KEY} for i in (1, 2, 3)]
    second = place.reconcile_actions(row(3), jobs)
    assert second["submit"] == {} and second["cancel"] == []


def test_reconcile_cancels_pending_jobs_before_running_ones_newest_first():
    jobs = [{"id": "10", "state": "RUNNING", "key": KEY}, {"id": "11", "state": "RUNNING", "key": KEY},
            {"id": "12", "state": "PENDING", "key": KEY}]
    assert place.reconcile_actions(row(1), jobs)["cancel"] == ["11", "12"]


def test_reconcile_cancels_every_job_of_a_model_no_longer_planned():
    jobs = [{"id": "7", "state": "RUNNING", "key": ("old", "A", 2)}]
    assert place.reconcile_actions(row(0), jobs) == {"submit": {}, "cancel": ["7"], "hard_cancel": [],
                                                     "have": {("old", "A", 2): 1}, "want": {}, "duplicates": [],
                                                     "ending": [], "successors": {},
                                                     "slots": {("old", "A", 2): set()}}


def test_live_sessions_started_elsewhere_count_but_our_own_jobs_count_once():
    labels = {"otela.model": "m", "otela.gpu": "A", "otela.tp": "1"}
    sessions = [{"state": "SERVING", "labels": dict(labels, slurm_job="1")},   # our job 1: already counted
                {"state": "SERVING", "labels": dict(labels, k8s_pod="p")},      # a pod: counts
                {"state": "LEFT", "labels": dict(labels, k8s_pod="q")}]         # gone: does not
    got = place.reconcile_actions(row(3), [{"id": "1", "state": "RUNNING", "key": KEY}], sessions)
    assert got["have"] == {KEY: 2} and got["submit"] == {KEY: 1}


def test_a_second_run_while_the_lock_is_held_refuses(tmp_path):
    lock = str(tmp_path / "place.lock")
    with place.run_lock(lock):
        with pytest.raises(place.LockHeld) as err:
            with place.run_lock(lock):
                pass
        assert str(os.getpid()) in str(err.value)
    with place.run_lock(lock):  # released: the next run gets it
        pass


def test_dry_run_writes_scripts_and_says_what_it_would_submit(tmp_path):
    report = place.reconcile(row(2), {"gpus": [{"type": "A", "count": 2, "gres": ""}]}, "vllm", VARS,
                             str(tmp_path / "jobs"), submit=False, jobs=[])
    assert report["dry_run"] and len(report["submit"]) == 2 and report["submitted"] == []
    assert sorted(os.listdir(tmp_path / "jobs")) == ["otela-m-a-tp1-0.sbatch", "otela-m-a-tp1-1.sbatch"]
    assert "--gres" not in (tmp_path / "jobs" / "otela-m-a-tp1-0.sbatch").read_text()
    assert (tmp_path / "home" / ".otela" / "logs").is_dir()   # the scripts' log folder, made with them


# ---------------------------------------------------------------- --from-ingress


@pytest.fixture
def fake_ingress():
    stats = {"window_s": 300, "models": {"meta-llama/Llama-2-13b-hf": {
        "requests": 300, "arrival_rate": 12.0, "input_tokens": {"mean": 600, "std": 100},
        "output_tokens": {"mean": 80, "std": 20}}}}
    registry = {"sessions": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/v1/usage/stats": stats, "/v1/registry": registry}.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body or {}).encode())

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", registry
    finally:
        server.shutdown()
        server.server_close()


def test_demand_and_sessions_come_from_the_ingress(fake_ingress, tmp_path):
    url, registry = fake_ingress
    inv = tmp_path / "inv.json"
    inv.write_text(json.dumps({"gpus": [{"type": "A100-80GB-SXM4", "count": 4, "per_node": 4, "gres": ""}]}))

    def plan():
        out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--from-ingress", url,
                              "--inventory", str(inv), "--emit-sbatch", str(tmp_path / "jobs"), "--lock",
                              str(tmp_path / "lock"), "--sbatch-var", "KEY_FILE=k", "--sbatch-var", "BOOTSTRAP=b:1",
                              "--json"], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PATH="/nonexistent"))  # no squeue: a dry run compares with nothing
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first = plan()
    rows = first["ours"]["placement"]
    row = rows[0]
    planned = sum(r["instances"] for r in rows)     # the calibration decides how many rows (tp choices)
    assert {r["model"] for r in rows} == {"meta-llama/Llama-2-13b-hf"} and len(first["reconcile"]["submit"]) == planned
    # a live session labelled with the planned (model, gpu, tp) counts as one instance already there
    registry["sessions"].append({"session": "s1", "state": "SERVING", "models": [row["model"]],
                                 "labels": {"otela.model": row["model"], "otela.gpu": row["gpu"],
                                            "otela.tp": str(row["tp"])}})
    second = plan()
    assert second["ours"]["placement"] == rows
    assert len(second["reconcile"]["submit"]) == planned - 1


def test_an_unreachable_ingress_is_a_one_line_error(tmp_path):
    inv = tmp_path / "inv.json"
    inv.write_text(json.dumps({"gpus": [{"type": "A100-80GB-SXM4", "count": 4, "per_node": 4}]}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--from-ingress",
                          "http://127.0.0.1:9", "--inventory", str(inv)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("otela_place: http://127.0.0.1:9/v1/usage/stats") and out.stderr.count("\n") == 1
