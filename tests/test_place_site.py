"""The site file (plan --site FILE): what a site says once reaches every job script; a bad site
file is one line naming the file and the field; a model the simulator does not know is planned
from its config.json or left as it is; the catalogue's min instances start a model from zero,
its max is never exceeded; adapters ride their base; a successor is due before a job's end.
Everything here needs neither root nor Slurm (tests/test_place_slurm.py runs the real one)."""
from __future__ import annotations

import http.server
import itertools
import json
import os
import re
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 2048}
VARS = {"KEY_FILE": "/keys/cluster.key", "BOOTSTRAP": "login1:7946"}
GPU = {"type": "H100", "count": 8, "per_node": 4, "gres": "gpu:h100", "partition": "gpu", "account": "proj42",
       "qos": "normal", "constraint": "h100&ib", "reservation": "llm", "time_limit": "04:00:00",
       "sbatch": ["--mem=0"]}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A test writes only under its own temporary folder: the scripts' default log folder
    (~/.otela/logs, which emitting them creates) is then there too."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def site_doc(**over):
    doc = {"gpus": [dict(GPU)], "python": "/apps/python3.11/bin/python3",
           "setup": ["module load cuda/12.4", "source /apps/vllm/bin/activate"],
           "engine_wrapper": "apptainer exec --nv /images/vllm.sif",
           "engine_env": {"HF_HOME": "/scratch/hf", "HF_HUB_OFFLINE": "1"},
           "catalogue": [{"name": "org/tiny", "weights": "/models/tiny", "min": 1, "max": 2},
                         {"name": "tiny-sql", "base": "org/tiny", "weights": "/adapters/sql"},
                         {"name": "llama-2-7b", "template": "sglang"}]}
    doc.update(over)
    return doc


def bash_n(text, tmp_path, name="job.sbatch"):
    path = tmp_path / name
    path.write_text(text)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode


def plan_cli(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", *args,
                           "--lock", str(tmp_path / "lock")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PATH="/nonexistent", **(env or {})))  # no Slurm: a dry run


# ---------------------------------------------------------------- what a job script carries


def test_every_setting_of_the_site_file_reaches_the_job_script():
    site = place.check_site(site_doc(), "site.json")
    row = {"model": "org/tiny", "gpu": "H100", "tp": 2, "instances": 1}
    (_, name, text), = place.job_scripts([row], site, "vllm", VARS)
    directives = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert directives[-7:] == ["--gres=gpu:h100:2", "--partition=gpu", "--account=proj42", "--qos=normal",
                               "--constraint=h100&ib", "--reservation=llm", "--mem=0"]
    assert "--time=04:00:00" in directives
    assert re.search(r"^PYTHON=/apps/python3.11/bin/python3$", text, re.M)
    assert re.search(r"^WEIGHTS=/models/tiny$", text, re.M)
    assert re.search(r"^ENGINE_WRAPPER='apptainer exec --nv /images/vllm.sif'$", text, re.M)
    assert re.search(r"^ENGINE_ARGS='--enable-lora --lora-modules tiny-sql=/adapters/sql'$", text, re.M)
    setup = text[text.index("set +u\n"):text.index("if [[ -z $ENGINE_CMD")]
    assert setup.splitlines() == ["set +u", "module load cuda/12.4", "source /apps/vllm/bin/activate", "set -u",
                                  "export HF_HOME=/scratch/hf", "export HF_HUB_OFFLINE=1"]


def test_the_engine_command_a_site_job_hands_the_node(tmp_path):
    """Run a rendered script with stand-ins for the node (prints its argv) and the setup."""
    otela = tmp_path / "otela"
    (otela / "sbatch").mkdir(parents=True)
    (otela / "sbatch" / "node.sh").write_text(open(os.path.join(ROOT, "sbatch", "node.sh")).read())
    (otela / "otela_node.py").write_text("import json, os, sys\n"
                                         "print(json.dumps([sys.argv[1:], os.environ.get('HF_HOME')]))\n")
    site = place.check_site(site_doc(setup=["true"], python=sys.executable), "site.json")
    row = {"model": "org/tiny", "gpu": "H100", "tp": 2, "instances": 1}
    (_, _, text), = place.job_scripts([row], site, "vllm", dict(VARS, OTELA_DIR=str(otela)))
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, SLURM_JOB_ID="17"))
    assert out.returncode == 0, out.stderr
    argv, hf_home = json.loads(out.stdout.strip().splitlines()[-1])
    assert argv[argv.index("--process") + 1] == (
        "apptainer exec --nv /images/vllm.sif vllm serve /models/tiny --served-model-name org/tiny "
        "--tensor-parallel-size 2 --enable-lora --lora-modules tiny-sql=/adapters/sql --host 127.0.0.1 --port {port}")
    assert hf_home == "/scratch/hf"


@pytest.mark.parametrize("template", ["vllm", "sglang", "llamacpp"])
def test_every_combination_a_site_file_allows_passes_bash_n(template, tmp_path):
    """Each template with and without each optional part of the site file."""
    parts = {"setup": ["module load x"], "engine_wrapper": "apptainer exec --nv /i.sif",
             "engine_env": {"HF_HOME": "/h"}, "python": "/p/python3"}
    for n in range(len(parts) + 1):
        for chosen in itertools.combinations(parts, n):
            doc = {"gpus": [dict(GPU)], "catalogue": [{"name": "m", "weights": "/w/m.gguf", "template": template}]}
            doc.update({k: parts[k] for k in chosen})
            if template != "llamacpp":
                doc["catalogue"].append({"name": "a", "base": "m", "weights": "/w/a"})
            site = place.check_site(doc, "site.json")
            for _, name, text in place.job_scripts([{"model": "m", "gpu": "H100", "tp": 1, "instances": 1}],
                                                   site, "vllm", VARS):
                assert bash_n(text, tmp_path, name) == 0, (chosen, text)
                assert not re.search(r"\{\{[A-Z_]+\}\}", text)


def test_an_inventory_of_old_is_a_site_file(tmp_path):
    old = {"gpus": [{"type": "A", "count": 4, "per_node": 4, "gres": "", "partition": "p", "sbatch": ["--x=1"]}]}
    site = place.check_site(old, "inv.json")
    assert site["gpus"] == old["gpus"] and site["catalogue"] == [] and site["setup"] == []
    (_, _, text), = place.job_scripts([{"model": "m", "gpu": "A", "tp": 1, "instances": 1}], old, "vllm", VARS)
    assert re.findall(r"^#SBATCH (--partition.*|--x.*)$", text, re.M) == ["--partition=p", "--x=1"]


def test_emitting_scripts_creates_their_log_folder(tmp_path):
    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps({"gpus": [{"type": "A100-80GB-SXM4", "count": 1, "per_node": 1}],
                                    "models": {"m": TINY}, "workload": [{"model": "m", "rate_rps": 1,
                                                                         "input": {"mean": 50},
                                                                         "output": {"mean": 20}}]}))
    site = tmp_path / "site.json"
    site.write_text(json.dumps({"gpus": [{"type": "A100-80GB-SXM4", "count": 1, "per_node": 1, "gres": ""}],
                                "log_dir": str(tmp_path / "deep" / "logs")}))
    out = plan_cli(tmp_path, "--scenario", str(scenario), "--site", str(site), "--emit-sbatch",
                   str(tmp_path / "jobs"), *sum((["--sbatch-var", f"{k}={v}"] for k, v in VARS.items()), []))
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "jobs" / "otela-m-a100-80gb-sxm4-tp1-0.sbatch").read_text()
    assert f"#SBATCH --output={tmp_path}/deep/logs/%x-%j.out" in text
    assert (tmp_path / "deep" / "logs").is_dir()


# ---------------------------------------------------------------- bad site files: one line each

BAD = [
    ({"gpu": []}, "gpu: unknown key (known: gpus, python, setup, engine_wrapper, engine_env, log_dir, "
                  "successor_lead_s, catalogue, name)"),
    ({"name": "two words"}, "name: 'two words' is not 1-64 characters of [0-9A-Za-z_.-]"),
    ({"gpus": [{"type": "A", "count": 1, "partiton": "p"}]}, "gpus[0].partiton: unknown key (known: type, count, "
     "per_node, gres, partition, account, qos, constraint, reservation, time_limit, sbatch)"),
    ({"gpus": [{"type": "A", "count": "4"}]}, 'gpus[0].count: expected an integer, got "4"'),
    ({"gpus": [{"type": "A", "count": True}]}, "gpus[0].count: expected an integer, got true"),
    ({"gpus": [{"count": 1}]}, "gpus[0]: needs a 'type' or a 'partition'"),
    ({"gpus": [{"type": "A", "time_limit": "12h"}]}, "gpus[0].time_limit: '12h' is not a Slurm time "
                                                     "(M, H:M:S, D-H:M:S...)"),
    ({"gpus": [{"type": "A", "account": "a b"}]}, "gpus[0].account: 'a b' has characters unsafe in an #SBATCH line"),
    ({"gpus": [{"type": "A", "sbatch": ["--x\n#SBATCH --y"]}]}, "gpus[0].sbatch[0]: must be one line"),
    ({"setup": ["module load a\nrm -rf ~"]}, "setup[0]: must be one line"),
    ({"engine_env": {"HF HOME": "/h"}}, "engine_env.HF HOME: is not a variable name"),
    ({"engine_env": {"N": 0, "M": "a\nb"}}, "engine_env.M: must be one line"),
    ({"engine_wrapper": "apptainer exec 'x"}, "engine_wrapper: cannot be split as a command (No closing quotation)"),
    ({"successor_lead_s": -1}, "successor_lead_s: must be seconds >= 0"),
    ({"catalogue": [{"name": "m", "min": 3, "max": 2}]}, "catalogue[0].max: 2 is below min 3"),
    ({"catalogue": [{"name": "m", "mni": 1}]}, "catalogue[0].mni: unknown key (known: name, weights, template, "
                                               "min, max, base)"),
    ({"catalogue": [{"name": "m"}, {"name": "m"}]}, "catalogue[1].name: 'm' is listed twice"),
    ({"catalogue": [{"name": "a", "base": "nope", "weights": "/a"}]}, "catalogue[0].base: 'nope' is not a model "
                                                                      "of the catalogue"),
    ({"catalogue": [{"name": "m", "template": "llamacpp"}, {"name": "a", "base": "m", "weights": "/a"}]},
     "catalogue[1].base: llama.cpp serves no adapter under its own name"),
    ({"catalogue": [{"name": "m"}, {"name": "a", "base": "m", "weights": "/a", "min": 1}]},
     "catalogue[1].min: an adapter rides its base: only name, base and weights"),
]


@pytest.mark.parametrize("doc,why", BAD, ids=[w.split(":")[0] for _, w in BAD])
def test_a_bad_site_file_is_one_line_naming_the_file_and_the_field(doc, why, tmp_path):
    with pytest.raises(place.PlacementError) as err:
        place.check_site(doc, "site.json")
    assert str(err.value) == f"site.json: {why}"
    path = tmp_path / "site.json"
    path.write_text(json.dumps(doc))
    out = plan_cli(tmp_path, "--from-ingress", "http://127.0.0.1:9", "--site", str(path), "--emit-sbatch",
                   str(tmp_path / "jobs"))
    assert out.returncode == 2 and out.stderr == f"otela_place: {path}: {why}\n"
    assert not (tmp_path / "jobs").exists()


def test_a_template_that_does_not_render_is_the_site_files_error(tmp_path):
    tpl = tmp_path / "mine.sbatch"
    tpl.write_text("#!/bin/bash\n#SBATCH --job-name={{JOB_NAME}}\n# {{SBATCH_EXTRA}}\necho {{IMAGE}}\n")
    site = place.check_site({"gpus": [{"type": "A", "count": 1}], "catalogue": [{"name": "m", "template": str(tpl)}]},
                            "site.json")
    with pytest.raises(place.PlacementError) as err:
        place.check_site_templates(site, "vllm", VARS, site["gpus"])
    assert str(err.value) == (f"site.json: catalogue[0].template: {tpl}: template needs a value for IMAGE "
                              "(--sbatch-var IMAGE=...)")
    site = place.check_site({"gpus": [{"type": "A", "count": 1}], "setup": ["module load x"],
                             "catalogue": [{"name": "m", "template": str(tpl)}]}, "site.json")
    with pytest.raises(place.PlacementError) as err:
        place.check_site_templates(site, "vllm", dict(VARS, IMAGE="i"), site["gpus"])
    assert str(err.value).endswith("template has no '# {{SITE_SETUP}}' line for the site's setup and engine_env")


def test_a_value_missing_for_the_default_template_is_the_flags_error_not_the_site_files(tmp_path):
    site = place.check_site({"gpus": [{"type": "A", "count": 1}], "catalogue": [{"name": "m"}]}, "site.json")
    with pytest.raises(place.PlacementError) as err:
        place.check_site_templates(site, "vllm", {"KEY_FILE": "/k"}, site["gpus"])
    assert str(err.value) == "template needs a value for BOOTSTRAP (--sbatch-var BOOTSTRAP=...)"


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12), st.none() | st.integers() | st.text(max_size=8), max_size=4))
def test_any_json_object_is_a_site_file_or_one_line_naming_the_file(doc):
    try:
        place.check_site(doc, "site.json")
    except place.PlacementError as e:
        assert str(e).startswith("site.json: ") and "\n" not in str(e)


# ---------------------------------------------------------------- the jobs' interpreter


def test_the_jobs_interpreter_is_the_placers_own_when_it_imports_h11():
    assert place.check_interpreter(place.check_site({}), {}) == sys.executable
    assert place.check_interpreter(place.check_site({"python": "/p/python3"}), {}) == "/p/python3"
    assert place.check_interpreter(place.check_site({}), {"PYTHON": "/q/python3"}) == "/q/python3"


def test_a_placer_without_h11_names_an_interpreter_to_set(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "h11" else real(name, *a))
    with pytest.raises(place.PlacementError) as err:
        place.check_interpreter(place.check_site({}), {})
    assert str(err.value) == (f"the jobs' interpreter, the placer's own {sys.executable}, cannot import h11: name "
                              "one that can in the site file's \"python\" (or --sbatch-var PYTHON=...)")


SET_IT = 'set "python" in the site file (or --sbatch-var PYTHON=...)'
VERSION = "Python {}.{}.{}".format(*sys.version_info[:3])
PYTHONS = {
    # a RHEL 8 python3: answers -V, and any of otela's code is a SyntaxError on it
    "py36": ("#!/bin/sh\n[ \"$1\" = -V ] && { echo 'Python 3.6.8'; exit 0; }\n"
             "echo 'SyntaxError: future feature annotations is not defined' >&2; exit 1\n",
             f"is Python 3.6.8; otela needs Python 3.9 or newer; {SET_IT}"),
    "py27": ("#!/bin/sh\n[ \"$1\" = -V ] && { echo 'Python 2.7.18' >&2; exit 0; }\nexit 1\n",
             f"is Python 2.7.18; otela needs Python 3.9 or newer; {SET_IT}"),
    # this Python without site-packages: no h11
    "bare": (f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n",
             f"({VERSION}) cannot import h11: put its wheel on PYTHONPATH; {SET_IT}"),
    "missing": (None, f"is not found on {os.uname().nodename}; {SET_IT}"),
}


@pytest.mark.parametrize("kind", sorted(PYTHONS))
def test_a_job_whose_interpreter_cannot_run_otela_says_why_in_one_line(kind, tmp_path):
    body, why = PYTHONS[kind]
    py = tmp_path / kind
    if body is not None:
        py.write_text(body)
        py.chmod(0o755)
    site = place.check_site({"gpus": [{"type": "A", "count": 1, "gres": ""}], "python": str(py)})
    (_, _, text), = place.job_scripts([{"model": "m", "gpu": "A", "tp": 1, "instances": 1}], site, "vllm",
                                      dict(VARS, OTELA_DIR=ROOT))
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, SLURM_JOB_ID="4242"))
    assert out.returncode == 3 and out.stdout == ""
    assert out.stderr == f"otela job 4242: {py} {why}\n"


# ---------------------------------------------------------------- no model stops a run


def test_an_unknown_models_config_comes_from_its_weights_the_hf_cache_or_the_flag(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps(dict(TINY, hidden_size=128)))
    assert place.find_model_config("org/mine", str(weights))["hidden_size"] == 128
    snap = tmp_path / "hf" / "hub" / "models--org--mine" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(dict(TINY, hidden_size=256)))
    assert place.find_model_config("org/mine", hf_home=str(tmp_path / "hf"))["hidden_size"] == 256
    flag = tmp_path / "flag.json"
    flag.write_text(json.dumps(dict(TINY, hidden_size=512)))
    assert place.find_model_config("org/mine", str(weights), {"org/mine": str(flag)},
                                   str(tmp_path / "hf"))["hidden_size"] == 512
    assert place.find_model_config("org/unknown", hf_home=str(tmp_path / "hf")) is None
    assert place.find_model_config("llama-2-7b")["num_hidden_layers"] == 32   # the simulator's own


class FakeIngress:
    """/v1/usage/stats, /v1/registry and /v1/models as a test sets them."""

    def __init__(self):
        self.stats, self.sessions, self.models = {"window_s": 300, "models": {}}, [], []
        ingress = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = {"/v1/usage/stats": ingress.stats, "/v1/registry": {"sessions": ingress.sessions},
                        "/v1/models": {"object": "list", "data": ingress.models}}.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(json.dumps(body or {}).encode())

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def demand(self, **rates):
        self.stats["models"] = {m: {"requests": int(r * 300), "arrival_rate": r, "input_tokens": {"mean": 50, "std": 0},
                                    "output_tokens": {"mean": 20, "std": 0}} for m, r in rates.items()}


@pytest.fixture
def ingress():
    fake = FakeIngress()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def cron_plan(tmp_path, ingress, site, *extra):
    path = tmp_path / "site.json"
    path.write_text(json.dumps(site))
    out = plan_cli(tmp_path, "--from-ingress", ingress.url, "--site", str(path), "--emit-sbatch",
                   str(tmp_path / "jobs"), "--json", "--no-reclaim",
                   *sum((["--sbatch-var", f"{k}={v}"] for k, v in VARS.items()), []), *extra,
                   env={"HF_HOME": str(tmp_path / "hf")})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


SLOTS = {"gpus": [{"type": "A100-80GB-SXM4", "count": 4, "per_node": 4, "gres": ""}]}


def test_a_model_nobody_can_describe_is_named_once_and_the_rest_is_planned(tmp_path, ingress):
    ingress.demand(**{"llama-2-7b": 2.0, "org/mystery": 3.0})
    plan, err = cron_plan(tmp_path, ingress, SLOTS)
    assert {r["model"] for r in plan["ours"]["placement"]} == {"llama-2-7b"} and plan["kept"] == ["org/mystery"]
    assert [ln for ln in err.splitlines() if "mystery" in ln] == [
        "otela_place: warning: model org/mystery: the simulator does not know it and no config.json was found "
        "(catalogue weights, the HF cache, --model-config org/mystery=FILE): its instances are kept as they are"]
    flag = tmp_path / "mystery.json"
    flag.write_text(json.dumps(TINY))
    plan, _ = cron_plan(tmp_path, ingress, SLOTS, "--model-config", f"org/mystery={flag}")
    assert {r["model"] for r in plan["ours"]["placement"]} == {"llama-2-7b", "org/mystery"} and plan["kept"] == []


def test_the_jobs_of_a_kept_model_are_left_as_they_are():
    jobs = [{"id": "7", "state": "RUNNING", "key": ("mystery", "A", 1)},
            {"id": "8", "state": "RUNNING", "key": ("gone", "A", 1)}]
    actions = place.reconcile_actions([], jobs, kept={"mystery"})
    assert actions["cancel"] == ["8"] and actions["submit"] == {}


# ---------------------------------------------------------------- scale from zero, min and max


def test_a_catalogue_model_with_min_instances_gets_them_without_any_demand(tmp_path, ingress):
    site = dict(SLOTS, catalogue=[{"name": "llama-2-7b", "min": 2}, {"name": "org/tiny", "weights": str(tmp_path)}])
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    plan, _ = cron_plan(tmp_path, ingress, site)
    assert [(r["model"], r["instances"]) for r in plan["ours"]["placement"]] == [("llama-2-7b", 2)]
    assert len(plan["reconcile"]["submit"]) == 2


def test_requests_answered_503_starting_are_demand_and_bring_the_first_instance(tmp_path, ingress):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    site = dict(SLOTS, catalogue=[{"name": "org/tiny", "weights": str(tmp_path)}])
    plan, _ = cron_plan(tmp_path, ingress, site)
    assert plan["ours"]["placement"] == []          # nothing asked, min 0: nothing runs
    ingress.stats["models"] = {"org/tiny": {"requests": 0, "arrival_rate": 0.0, "unserved": 3}}
    plan, _ = cron_plan(tmp_path, ingress, site)
    assert [(r["model"], r["instances"]) for r in plan["ours"]["placement"]] == [("org/tiny", 1)]
    assert plan["reconcile"]["submit"] == ["otela-tiny-a100-80gb-sxm4-tp1-0.sbatch"]


def test_max_instances_are_never_exceeded_whatever_the_demand(tmp_path, ingress):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    site = dict(SLOTS, catalogue=[{"name": "org/tiny", "weights": str(tmp_path), "max": 1}])
    ingress.demand(**{"org/tiny": 500.0})
    plan, _ = cron_plan(tmp_path, ingress, site)
    assert [(r["model"], r["instances"], r["weight"]) for r in plan["ours"]["placement"]] == [("org/tiny", 1, 1.0)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.sampled_from([1, 2])), min_size=1, max_size=3),
       st.integers(0, 3), st.integers(0, 4))
def test_catalogue_bounds_keep_every_model_within_min_and_max_and_the_pool(rows, low, span):
    models = [f"m{i}" for i in range(len(rows))]
    plan = [{"model": m, "gpu": "A", "tp": tp, "instances": n, "weight": 1.0}
            for m, (n, _, tp) in zip(models, rows) if n]
    pool = 16
    if sum(r["tp"] * r["instances"] for r in plan) > pool:
        return
    site = place.check_site({"catalogue": [{"name": m, "min": low, "max": low + span} for m in models]})
    scenario = {"gpus": [{"type": "A", "count": pool, "per_node": 4}], "models": {m: TINY for m in models}}
    out, notes = place.catalogue_bounds(plan, site, scenario)
    for m in models:
        n = sum(r["instances"] for r in out if r["model"] == m)
        assert n <= low + span
        assert n >= low or any(m in note for note in notes)
        mine = [r for r in out if r["model"] == m]
        assert not mine or abs(sum(r["weight"] for r in mine) - 1) < 1e-3
    assert sum(r["tp"] * r["instances"] for r in out) <= pool


# ---------------------------------------------------------------- adapters ride their base


def test_an_adapters_demand_is_its_bases_and_it_never_gets_gpus_of_its_own(tmp_path, ingress):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    site = dict(SLOTS, catalogue=[{"name": "org/tiny", "weights": str(tmp_path)},
                                  {"name": "sql-lora", "base": "org/tiny", "weights": "/adapters/sql"}])
    ingress.demand(**{"org/tiny": 1.0, "sql-lora": 3.0})
    plan, _ = cron_plan(tmp_path, ingress, site)
    assert {r["model"] for r in plan["ours"]["placement"]} == {"org/tiny"}
    folded = place.fold_adapters([{"model": "org/tiny", "rate_rps": 1.0, "input": {"mean": 100}, "output": {"mean": 10}},
                                  {"model": "sql-lora", "rate_rps": 3.0, "input": {"mean": 20}, "output": {"mean": 50}}],
                                 {"sql-lora": ("org/tiny", "/a")})
    assert folded == [{"model": "org/tiny", "rate_rps": 4.0, "input": {"mean": 40.0, "std": 0},
                       "output": {"mean": 40.0, "std": 0}, "unserved": 0}]
    text = (tmp_path / "jobs" / "otela-tiny-a100-80gb-sxm4-tp1-0.sbatch").read_text()
    assert "ENGINE_ARGS='--enable-lora --lora-modules sql-lora=/adapters/sql'" in text


def test_an_engines_models_with_a_parent_are_adapters_of_that_parent(tmp_path, ingress):
    ingress.models = [{"id": "llama-2-7b", "object": "model"},
                      {"id": "chat-lora", "object": "model", "parent": "llama-2-7b"}]
    ingress.demand(**{"llama-2-7b": 1.0, "chat-lora": 2.0})
    plan, err = cron_plan(tmp_path, ingress, SLOTS)
    assert {r["model"] for r in plan["ours"]["placement"]} == {"llama-2-7b"} and "chat-lora" not in err


# ---------------------------------------------------------------- no gap at a time limit


def test_a_job_near_its_end_gets_a_successor_and_counts_for_nothing():
    rows = [{"model": "m", "gpu": "A", "tp": 1, "instances": 2}]
    jobs = [{"id": "7", "state": "RUNNING", "key": ("m", "A", 1), "name": "otela-m-a-tp1-0", "ends_at": 1000.0},
            {"id": "8", "state": "RUNNING", "key": ("m", "A", 1), "name": "otela-m-a-tp1-1", "ends_at": 5000.0}]
    before = place.reconcile_actions(rows, jobs, now=1000.0 - 601, lead_s=600)
    assert before["submit"] == {} and before["ending"] == []
    due = place.reconcile_actions(rows, jobs, now=1000.0 - 599, lead_s=600)
    assert due["submit"] == {("m", "A", 1): 1} and due["ending"] == ["7"] and due["successors"] == {("m", "A", 1): 1}
    assert due["slots"] == {("m", "A", 1): {1}}   # slot 0 is free for the successor
    assert due["cancel"] == [] and due["duplicates"] == []


def test_a_job_near_its_end_of_a_model_no_longer_wanted_is_cancelled_not_succeeded():
    jobs = [{"id": "7", "state": "RUNNING", "key": ("m", "A", 1), "name": "otela-m-a-tp1-0", "ends_at": 1000.0}]
    actions = place.reconcile_actions([], jobs, now=900.0, lead_s=600)
    assert actions["cancel"] == ["7"] and actions["ending"] == [] and actions["submit"] == {}


def test_a_session_near_its_end_is_no_instance_either():
    rows = [{"model": "m", "gpu": "A", "tp": 1, "instances": 1}]
    session = {"state": "SERVING", "ends_at": 1000.0, "labels": {"otela.model": "m", "otela.gpu": "A", "otela.tp": "1"}}
    assert place.reconcile_actions(rows, [], [session], now=0, lead_s=600)["submit"] == {}
    assert place.reconcile_actions(rows, [], [session], now=500, lead_s=600)["submit"] == {("m", "A", 1): 1}


def test_squeue_end_times_are_read_for_running_jobs():
    jobs = place.parse_squeue("7 RUNNING otela-m-a-tp1-0 2026-12-07T00:40:00 2026-12-07T04:40:00 otela|m|A|1\n"
                              "8 PENDING otela-m-a-tp1-1 N/A N/A otela|m|A|1\n")
    assert jobs[0]["ends_at"] == place.time.mktime((2026, 12, 7, 4, 40, 0, 0, 0, -1))
    assert jobs[0]["ends_at"] - jobs[0]["starts_at"] == 4 * 3600
    assert jobs[1]["ends_at"] is None and jobs[1]["name"] == "otela-m-a-tp1-1"


def test_a_lead_longer_than_half_a_jobs_time_limit_waits_for_its_second_half():
    job = {"state": "RUNNING", "starts_at": 0.0, "ends_at": 600.0}
    assert not place.ending(job, now=299, lead_s=3600) and place.ending(job, now=301, lead_s=3600)


def test_sinfo_partitions_come_with_the_gpus_and_the_site_adds_its_settings():
    text = ("n1|idle|gpu:a100:4|gpu:a100:0|gpu|\nn1|idle|gpu:a100:4|gpu:a100:0|debug*|\n"
            "n2|mix|gpu:h100:4|gpu:h100:1|h100|\n")
    found = place.parse_sinfo(text)
    assert {g["type"]: g["partitions"] for g in found["gpus"]} == {"a100": ["gpu", "debug"], "h100": ["h100"]}
    site = place.check_site({"gpus": [{"type": "a100", "account": "p", "partition": "debug"},
                                      {"partition": "h100", "qos": "high", "time_limit": "30"}]})
    pool = {g["type"]: g for g in place.site_gpus(site, found)}
    assert pool["a100"] == {"type": "a100", "count": 4, "per_node": 4, "gres": "gpu:a100", "partition": "debug",
                            "account": "p"}
    assert pool["h100"] == {"type": "h100", "count": 3, "per_node": 3, "gres": "gpu:h100", "partition": "h100",
                            "qos": "high", "time_limit": "30"}
    printed = {"gpus": place.site_gpus(place.check_site({}), found)}   # what `plan inventory` prints
    assert place.check_site(printed)["gpus"][0]["partition"] == "gpu"      # is a site file
    with pytest.raises(place.PlacementError) as err:
        place.check_site_partitions(dict(site, path="site.json"), {"gpu", "debug"})
    assert str(err.value) == "site.json: gpus[1].partition: 'h100' is not a partition sinfo lists (debug, gpu)"


# ---------------------------------------------------------------- grants: what each job may serve
def test_every_job_gets_a_private_grant_for_its_model_and_adapters_issued_once(tmp_path, ingress):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", str(keys)],
                   check=True, capture_output=True, timeout=60)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    site = dict(SLOTS, name="lrz", catalogue=[{"name": "org/tiny", "weights": str(tmp_path), "min": 1},
                                              {"name": "sql-lora", "base": "org/tiny", "weights": "/adapters/sql"}])
    key_var = ("--sbatch-var", f"KEY_FILE={keys / 'cluster.key'}")
    cron_plan(tmp_path, ingress, site, *key_var)
    text = (tmp_path / "jobs" / "otela-tiny-a100-80gb-sxm4-tp1-0.sbatch").read_text()
    path = keys / "grants" / "otela-tiny-a100-80gb-sxm4-tp1-0.grant"   # beside the cluster key
    assert f"GRANT_FILE={path}" in text
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    grant = json.loads(path.read_text())["grant"]
    assert grant["models"] == ["org/tiny", "sql-lora"] and grant["labels"]["otela.model"] == "org/tiny"
    assert grant["labels"]["site"] == "lrz"               # the site file's word, not the job's
    assert grant["job"] == "otela-tiny-a100-80gb-sxm4-tp1-0"
    cron_plan(tmp_path, ingress, site, *key_var)          # the next pass: the same grant, not a new one
    assert json.loads(path.read_text())["grant"]["id"] == grant["id"]
    os.utime(keys / "ingress.key")                        # a rotation step since: issued anew
    cron_plan(tmp_path, ingress, site, *key_var)
    assert json.loads(path.read_text())["grant"]["id"] != grant["id"]
    renamed = dict(site, name="lrz-2")                    # the site renamed: issued anew, with its name
    cron_plan(tmp_path, ingress, renamed, *key_var)
    assert json.loads(path.read_text())["grant"]["labels"]["site"] == "lrz-2"
    (keys / "ingress.key").unlink()                       # no ingress secret on this host
    path.unlink()
    _, warned = cron_plan(tmp_path, ingress, site, *key_var)
    assert "GRANT_FILE=''" in (tmp_path / "jobs" / "otela-tiny-a100-80gb-sxm4-tp1-0.sbatch").read_text()
    assert len([line for line in warned.splitlines() if "no grants for the jobs" in line]) == 1
