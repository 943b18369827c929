"""The whole cron path on a real single-node Slurm with the real tiny engine: plan ->
sbatch -> the job runs otela_node.py wrapping the engine -> the session registers at an
ingress -> a chat completion is answered through the ingress -> a second plan submits
nothing -> demand gone -> scancel -> the node drains and its session is LEFT.
Needs root (Slurm), otela_node.py, otela_ingress.py and the engine (`make engine`)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request

import pytest
from conftest import ENGINE_ALIAS, engine_command, engine_installed, free_port, poll, stop_process, wait_http
from test_place_slurm import _cancel_ours, slurm  # noqa: F401  (the module-scoped Slurm fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402

PY = sys.executable
pytestmark = [pytest.mark.root, pytest.mark.engine, pytest.mark.slow,
              pytest.mark.skipif(not all(os.path.exists(os.path.join(ROOT, f))
                                         for f in ("otela_node.py", "otela_ingress.py")),
                                 reason="needs otela_node.py and otela_ingress.py"),
              pytest.mark.skipif(not engine_installed(), reason="real engine not installed: run `make engine`")]


@contextlib.contextmanager
def real_ingress(tmp_path, host="127.0.0.1"):
    """A real ingress (its own cluster key, no client auth) listening on `host`."""
    subprocess.run([PY, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", str(tmp_path / "key")],
                   check=True, capture_output=True, timeout=60)
    port, gossip = free_port(), free_port()
    log = open(tmp_path / "ingress.log", "w")
    proc = subprocess.Popen([PY, os.path.join(ROOT, "otela_ingress.py"), "serve", "--key-file",
                             str(tmp_path / "key" / "cluster.key"), "--listen", f"{host}:{port}",
                             "--gossip", f"{host}:{gossip}", "--db", str(tmp_path / "usage.sqlite"),
                             "--no-auth"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://{host}:{port}/healthz", timeout=60, proc=proc)
        yield {"url": f"http://{host}:{port}", "gossip": f"{host}:{gossip}",
               "key": str(tmp_path / "key" / "cluster.key")}
    finally:
        stop_process(proc, 20)
        log.close()


@pytest.fixture
def ingress(tmp_path):
    with real_ingress(tmp_path) as found:
        yield found


def plan(tmp_path, ingress, rate):
    scenario = {"gpus": [{"type": "cpu", "count": 1, "per_node": 1, "gres": ""}],
                "models": {ENGINE_ALIAS: {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                                          "num_key_value_heads": 3, "intermediate_size": 1536,
                                          "vocab_size": 49152, "tie_word_embeddings": True}},
                "workload": [{"model": ENGINE_ALIAS, "rate_rps": rate, "input": {"mean": 20}, "output": {"mean": 16}}],
                "measured_instance_capacity_rps": {ENGINE_ALIAS: {"tp": 1, "cpu": 2.0}}}
    path = tmp_path / f"scenario-{rate}.json"
    path.write_text(json.dumps(scenario))
    argv = [PY, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario", str(path),
            "--template", "llamacpp", "--emit-sbatch", str(tmp_path / "jobs"), "--submit",
            "--lock", str(tmp_path / "lock"), "--cooldown", "0", "--json"]  # demand gone: scale to zero at once
    for k, v in {"ENGINE_CMD": engine_command(), "MODEL_FILE": "-", "PYTHON": PY, "OTELA_DIR": ROOT,
                 "KEY_FILE": ingress["key"], "BOOTSTRAP": ingress["gossip"], "LISTEN_HOST": "127.0.0.1",
                 "LOG_DIR": str(tmp_path / "logs")}.items():
        argv += ["--sbatch-var", f"{k}={v}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["reconcile"]


def sessions_of_job(ingress, job):
    with urllib.request.urlopen(ingress["url"] + "/v1/registry", timeout=5) as resp:
        view = json.loads(resp.read())
    return [s for s in view.get("sessions", []) if str((s.get("labels") or {}).get("slurm_job")) == str(job)]


def test_plan_submit_serve_then_scale_to_zero_leaves_the_overlay(slurm, ingress, tmp_path):  # noqa: F811
    _cancel_ours()
    try:
        first = plan(tmp_path, ingress, 1.0)
        assert len(first["submitted"]) == 1
        job = first["submitted"][0]
        assert plan(tmp_path, ingress, 1.0)["submitted"] == []  # reconcile is idempotent

        def serving():
            mine = sessions_of_job(ingress, job)
            if any(s["state"] in ("DOWN", "LEFT") for s in mine):  # the engine failed: stop waiting
                return ["failed"]
            return [s for s in mine if s["state"] == "SERVING"]
        session = poll(serving, f"job {job}'s node did not register SERVING", 180, interval=0.5)[0]
        if session == "failed":
            logs = "".join(p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*"))
            raise AssertionError(f"job {job}'s session went DOWN; job log tail:\n{logs}")
        assert place.session_key(session) == (ENGINE_ALIAS, "cpu", 1)

        body = json.dumps({"model": ENGINE_ALIAS, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Say hello"}]}).encode()
        req = urllib.request.Request(ingress["url"] + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]

        gone = plan(tmp_path, ingress, 0.0)  # demand gone: the plan wants nothing
        assert gone["cancelled"] == [job] and gone["submitted"] == []
        poll(lambda: [s for s in sessions_of_job(ingress, job) if s["state"] == "LEFT"],
             f"job {job}'s session did not become LEFT after scancel", 90, interval=0.5)
        poll(lambda: not place.slurm_jobs(), f"job {job} did not leave squeue", 60, interval=0.5)
    finally:
        _cancel_ours()
