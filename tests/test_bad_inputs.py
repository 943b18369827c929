"""Every bad input a new user can type to otela_sim.py and otela_place.py (flags, values,
OTELA_* variables, files): one line on stderr, a non-zero exit, no traceback. Each case runs
the command's main() in this process (an exception escaping it fails the test) and a sample
runs as a real process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place  # noqa: E402
import otela_sim  # noqa: E402

TABLE1 = os.path.join(ROOT, "tests", "data", "table1_scenario.json")
EST = ["estimate", "--model", "llama-2-7b", "--gpu", "H100"]


@pytest.fixture
def files(tmp_path):
    """Bad files a user may point at: missing, not JSON, JSON of the wrong shape."""
    paths = {"missing": str(tmp_path / "missing.json"), "dir": str(tmp_path)}
    for name, text in {"notjson": "{not json", "list": "[1, 2]", "empty": "",
                       "gpus_str": json.dumps({"gpus": "x", "models": {}, "workload": []}),
                       "count_str": json.dumps({"gpus": [{"type": "H100", "count": "many"}], "models": {},
                                                "workload": []}),
                       "rate_str": json.dumps({"gpus": [{"type": "H100", "count": 8}],
                                               "models": {"m": {"hidden_size": 64}},
                                               "workload": [{"model": "m", "rate_rps": "fast"}]}),
                       "rate_nan": json.dumps({"gpus": [{"type": "H100", "count": 8}],
                                               "models": {"m": {"hidden_size": 64}},
                                               "workload": [{"model": "m", "rate_rps": float("nan")}]}),
                       "models_list": json.dumps({"gpus": [{"type": "H100", "count": 8}], "models": [],
                                                  "workload": []}),
                       "half_config": json.dumps({"gpus": [{"type": "H100", "count": 8}],
                                                  "models": {"m": {"hidden_size": 64}},
                                                  "workload": [{"model": "m", "rate_rps": 1}]}),
                       "workload_str": json.dumps({"gpus": [{"type": "H100", "count": 8}], "models": {},
                                                   "workload": ["m"]}),
                       "csv": "a,b\n1,2\n"}.items():
        (tmp_path / name).write_text(text)
        paths[name] = str(tmp_path / name)
    return paths


SIM_CASES = [
    ([], {}), (["estimate"], {}), (["estimate", "--gpu", "H100"], {}), (["nonsense"], {}),
    (["estimate", "--model", "no-such-model", "--gpu", "H100"], {}),
    (["estimate", "--model", "llama-2-7b", "--gpu", "no-such-gpu"], {}),
    (EST + ["--tp", "abc"], {}), (EST + ["--tp", "0"], {}), (EST + ["--tp", "3"], {}), (EST + ["--tp", "1.5"], {}),
    (EST + ["--batch", "-1"], {}), (EST + ["--input", "0"], {}), (EST + ["--output", "x"], {}),
    (EST + ["--replicas", "-3"], {}), (EST + ["--replicas", "0"], {}), (EST + ["--dtype", "int3"], {}),
    (EST + ["--batch", "100000"], {}), (["estimate", "--model", "llama-2-70b", "--gpu", "A100-40GB"], {}),
    (EST + ["--engine", "nope"], {}), (EST + ["--engine", "vllm", "--engine-version", "abc"], {}),
    (EST + ["--engine-version", "0.6"], {}), (EST + ["--engine", "vllm", "--engine-version", "0.1"], {}),
    (EST + ["--bogus"], {}), (EST + ["--tp"], {}),
    (["estimate", "--config", "{missing}", "--gpu", "H100"], {}),
    (["estimate", "--config", "{notjson}", "--gpu", "H100"], {}),
    (["estimate", "--config", "{list}", "--gpu", "H100"], {}),
    (["estimate", "--config", "{dir}", "--gpu", "H100"], {}),
    (EST, {"OTELA_TP": "abc"}), (EST, {"OTELA_REPLICAS": "-3"}), (EST, {"OTELA_JSON": "maybe"}),
    (EST, {"OTELA_BATCH": ""}), (["estimate", "--model", "llama-2-7b"], {"OTELA_GPU": "nope"}),
    (EST, {"OTELA_CALIBRATION": "{missing}"}), (EST, {"OTELA_CALIBRATION": "{notjson}"}),
    (EST, {"OTELA_CALIBRATION": "{list}"}), (EST, {"OTELA_ENGINE": "nope"}),
    (["replay"], {}), (["replay", "--scenario", "{missing}"], {}), (["replay", "--scenario", "{notjson}"], {}),
    (["replay", "--scenario", "{list}"], {}), (["replay", "--scenario", "{workload_str}"], {}),
    (["replay", "--scenario", TABLE1, "--placement", "{list}"], {}),
    (["replay", "--scenario", TABLE1, "--placement", "{missing}"], {}),
    (["replay", "--scenario", TABLE1, "--prefix-hit", "1.5"], {}), (["replay", "--scenario", TABLE1, "--cv", "0"], {}),
    (["replay", "--scenario", TABLE1, "--duration", "-1"], {}),
    (["replay", "--scenario", TABLE1, "--duration", "nan"], {}),
    (["replay", "--scenario", TABLE1, "--arrival", "uniform"], {}),
    (["replay", "--scenario", TABLE1, "--disaggregate", "2"], {}),
    (["replay", "--scenario", TABLE1, "--chunk-tokens", "0"], {}),
    (["replay", "--scenario", TABLE1], {"OTELA_ARRIVAL": "uniform"}),
    (["validate", "{missing}"], {}), (["validate", "{csv}", "--no-logo"], {}), (["validate", "--iters", "0"], {}),
    (["calibrate", "--iters", "-2"], {}), (["calibrate", "--csv", "{notjson}"], {}),
    (["probe", "--url", "http://127.0.0.1:9", "--model", "llama-2-7b", "--gpu", "H100", "--seconds", "0"], {}),
    (["probe", "--url", "http://127.0.0.1:9", "--model", "llama-2-7b", "--gpu", "H100", "--engine", "vllm",
      "--seconds", "0.2"], {}),
    (["probe", "--url", "not a url", "--model", "llama-2-7b", "--gpu", "H100", "--engine", "vllm"], {}),
    (["gpus", "--all"], {}),
]

PLAN = ["plan", "--scenario", TABLE1, "--replay", "fluid", "--baseline", "none"]
PLACE_CASES = [
    ([], {}), (["plan"], {}), (["plan", "--scenario", "{missing}"], {}), (["plan", "--scenario", "{notjson}"], {}),
    (["plan", "--scenario", "{empty}"], {}), (["plan", "--scenario", "{list}"], {}),
    (["plan", "--scenario", "{dir}"], {}), (["plan", "--scenario", "{gpus_str}"], {}),
    (["plan", "--scenario", "{count_str}"], {}), (["plan", "--scenario", "{rate_str}"], {}),
    (["plan", "--scenario", "{rate_nan}"], {}), (["plan", "--scenario", "{models_list}"], {}),
    (["plan", "--scenario", "{half_config}"], {}), (["plan", "--scenario", "{workload_str}"], {}),
    (PLAN + ["--headroom", "0"], {}), (PLAN + ["--headroom", "x"], {}), (PLAN + ["--slack", "1.5"], {}),
    (PLAN + ["--slack", "-0.1"], {}), (PLAN + ["--time-limit", "-1"], {}), (PLAN + ["--time-limit", "inf"], {}),
    (PLAN + ["--capacity", "foo"], {}), (PLAN, {"OTELA_CAPACITY": "foo"}), (PLAN + ["--objective", "cost"], {}),
    (PLAN + ["--seed", "x"], {}), (PLAN + ["--engine", "nope"], {}), (PLAN + ["--probes", "{missing}"], {}),
    (PLAN + ["--probes", "{list}"], {}), (PLAN + ["--inventory", "{missing}"], {}),
    (PLAN + ["--inventory", "{list}"], {}), (PLAN + ["--gpu-alias", "a100"], {}),
    (PLAN + ["--emit-sbatch", "{dir}/jobs", "--template", "nope", "--lock", "{dir}/lock"], {}),
    (PLAN + ["--emit-sbatch", "{dir}/jobs", "--sbatch-var", "NOVALUE", "--lock", "{dir}/lock"], {}),
    (PLAN + ["--emit-sbatch", "{notjson}", "--lock", "{dir}/lock"], {}),
    (PLAN + ["--emit-sbatch", "{dir}/jobs", "--lock", "/proc/no/such/lock"], {}),
    (PLAN + ["--cooldown", "-5"], {}), (PLAN, {"OTELA_COOLDOWN": "abc"}),
    (PLAN + ["--submit"], {}), (PLAN + ["--bogus"], {}),
    (["plan", "--from-ingress", "http://127.0.0.1:9"], {}), (["plan", "--from-ingress", "not a url"], {}),
    (["replay"], {}), (["replay", "--scenario", "{missing}"], {}), (["replay", "--scenario", TABLE1, "--hours", "0"], {}),
    (["replay", "--scenario", TABLE1, "--load", "-1"], {}), (["inventory", "--gpu-alias", "a100"], {}),
]


def run_main(main, argv, env, files, monkeypatch, capsys):
    """(exit code, stderr) of main(argv) under env, paths filled in from `files`."""
    argv = [a.format(**files) for a in argv]
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(**files))
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line_refusal(code, err, argv, env):
    lines = err.strip().splitlines()
    assert code not in (0, None), (argv, env, err)
    assert len(lines) == 1, (argv, env, err)
    assert "Traceback" not in err and lines[0].strip()


@pytest.mark.parametrize("argv, env", SIM_CASES, ids=[f"{i}: {' '.join(a[-3:])} {e or ''}" for i, (a, e) in enumerate(SIM_CASES)])
def test_every_bad_input_to_otela_sim_is_one_line_and_a_nonzero_exit(argv, env, files, monkeypatch, capsys):
    otela_sim._ACTIVE.clear()  # OTELA_CALIBRATION is read at first use
    code, err = run_main(otela_sim.main, argv, env, files, monkeypatch, capsys)
    otela_sim._ACTIVE.clear()
    assert_one_line_refusal(code, err, argv, env)


@pytest.mark.parametrize("argv, env", PLACE_CASES, ids=[f"{i}: {' '.join(a[-3:])} {e or ''}" for i, (a, e) in enumerate(PLACE_CASES)])
def test_every_bad_input_to_otela_place_is_one_line_and_a_nonzero_exit(argv, env, files, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")  # no Slurm: a dry run, never a submit
    code, err = run_main(otela_place.main, argv, env, files, monkeypatch, capsys)
    assert_one_line_refusal(code, err, argv, env)


@pytest.mark.parametrize("script, argv, env", [
    ("otela_sim.py", EST, {"OTELA_TP": "abc"}),
    ("otela_sim.py", EST + ["--replicas", "-3"], {}),
    ("otela_sim.py", EST + ["--engine", "vllm", "--engine-version", "abc"], {}),
    ("otela_place.py", ["plan", "--scenario", TABLE1, "--slack", "2"], {}),
    ("otela_place.py", ["plan", "--scenario", TABLE1], {"OTELA_CAPACITY": "foo"}),
])
def test_a_bad_input_in_a_real_process_prints_one_line_and_exits_2(script, argv, env):
    out = subprocess.run([sys.executable, os.path.join(ROOT, script)] + argv, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, **env))
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_replicas_below_one_is_refused_not_reported_as_negative_gpus():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_sim.py")] + EST + ["--replicas", "-3", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--replicas: -3 must be >= 1" in out.stderr


@pytest.mark.parametrize("ingress_key", ["the cluster key itself", "a copy of it"])
def test_an_ingress_key_that_is_the_cluster_key_is_refused_in_one_line(tmp_path, ingress_key):
    import shutil

    import otela_node
    cluster_key = otela_node.keygen(str(tmp_path / "keys"))[0]
    given = cluster_key
    if ingress_key == "a copy of it":
        given = str(tmp_path / "private" / "ingress.key")
        os.makedirs(os.path.dirname(given), mode=0o700)
        shutil.copy(cluster_key, given)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_ingress.py"), "serve", "--key-file", cluster_key,
                          "--ingress-key-file", given, "--listen", "127.0.0.1:0", "--gossip", "127.0.0.1:0",
                          "--db", str(tmp_path / "o.sqlite")], capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "is the cluster key" in lines[0] and given in lines[0]
    assert not os.path.exists(tmp_path / "o.sqlite")   # refused before anything started
