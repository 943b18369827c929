"""A site from zero, end to end on a real single-node Slurm: an empty cluster, an ingress that
reads the site file, and a catalogue of two emulated models (otela_sim.py serve, started by the
vLLM template through the site's engine wrapper) in a partition jobs must name: one with min 1,
one with min 0 that only its first requests bring (503 "starting" with Retry-After, counted as
demand). One placer pass submits both jobs; each job's node joins the ingress with its grant,
and a chat completion for each model is answered, with no job submitted by hand. Prints the
seconds from the first request to each model's first 200. Needs root (Slurm)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import poll
from test_place_e2e import ingress  # noqa: F401  (a real ingress on loopback)
from test_place_slurm import _cancel_ours, partition, slurm  # noqa: F401  (real Slurm, a non-default partition)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.slow]
PY = sys.executable
MODELS = ("meta-llama/Llama-3.2-1B", "Qwen/Qwen3-0.6B")

# `vllm serve WEIGHTS --served-model-name NAME --tensor-parallel-size TP ...` as the template
# writes it, run by the emulated engine (whose flag for tp is --tp): a site's own engine
VLLM = f"""#!{PY}
import os, sys
args = ["--tp" if a == "--tensor-parallel-size" else a for a in sys.argv[3:]]
os.execv({PY!r}, [{PY!r}, {os.path.join(ROOT, "otela_sim.py")!r}, "serve", "--model", sys.argv[2]] + args)
"""


def chat(url, model):
    body = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return None, None


@pytest.fixture
def site_file(partition, tmp_path, monkeypatch):  # noqa: F811
    """The site file, which the ingress started after this reads too (OTELA_SITE: serve --site)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(VLLM)
    (bin_dir / "vllm").chmod(0o755)
    site = {"gpus": [{"type": "H100", "count": 2, "per_node": 2, "gres": "", "partition": partition,
                      "time_limit": "10"}],
            "engine_wrapper": f"env PATH={bin_dir}:/usr/bin:/bin",
            "log_dir": str(tmp_path / "logs"),
            "catalogue": [{"name": MODELS[0], "min": 1, "max": 1}, {"name": MODELS[1], "min": 0, "max": 1}]}
    path = tmp_path / "site.json"
    path.write_text(json.dumps(site))
    monkeypatch.setenv("OTELA_SITE", str(path))
    return path


def starting(url, model):
    """The ingress's answer for a catalogued model nothing serves: (status, Retry-After, code)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, None, None
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("retry-after"), json.loads(e.read())["error"]["code"]


def test_a_fresh_site_serves_its_catalogue_after_one_placer_pass(partition, site_file, ingress, tmp_path):  # noqa: F811
    _cancel_ours()
    argv = [PY, os.path.join(ROOT, "otela_place.py"), "plan", "--from-ingress", ingress["url"],
            "--site", str(site_file), "--emit-sbatch", str(tmp_path / "jobs"), "--submit",
            "--lock", str(tmp_path / "lock"), "--json"]
    for k, v in {"KEY_FILE": ingress["key"], "BOOTSTRAP": ingress["gossip"], "LISTEN_HOST": "127.0.0.1"}.items():
        argv += ["--sbatch-var", f"{k}={v}"]
    try:
        # (an ingress heard from no peer yet is warming up: unknown names are 503 then, not demand)
        poll(lambda: starting(ingress["url"], "not-offered")[0] == 404, "the ingress's warm-up", 30, interval=0.5)
        t0 = time.monotonic()   # the first requests: nothing serves either model yet
        assert [starting(ingress["url"], m) for m in MODELS] == [(503, "30", "model_starting")] * 2
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)["reconcile"]
        assert len(report["submitted"]) == 2
        assert {j["key"][0] for j in place.slurm_jobs()} == set(MODELS)
        first = {}
        for model in MODELS:
            poll(lambda model=model: chat(ingress["url"], model)[0] == 200, f"{model} was not served", 180, interval=0.5)
            first[model] = time.monotonic() - t0
        status, answer = chat(ingress["url"], MODELS[0])
        assert status == 200 and answer["model"] == MODELS[0]
        print("\nsite from zero: first request (503 starting) to the first 200 after one placer pass, " + ", ".join(
            f"{m} {s:.1f} s" for m, s in first.items()) + " (real Slurm, emulated engines, no load time; "
            f"{MODELS[1]} brought by its 503s alone)")
        again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert json.loads(again.stdout)["reconcile"]["submitted"] == []   # max 1 each, both there
    finally:
        _cancel_ours()
