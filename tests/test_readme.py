"""The README's commands run as written (issue 30): its code blocks are read out of README.md
and run here where they can be (the cluster parts need a cluster: their flags are parsed)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

README = (ROOT / "README.md").read_text()


def block(after_heading: str) -> list:
    """The command lines of the first ```sh block under a heading: comments dropped, lines
    continued with a backslash joined."""
    section = README[README.index(after_heading):]
    body = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    lines = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def sh(lines, home, cwd, python=sys.executable, timeout=120):
    """Run README lines with bash, .venv/bin/python being this interpreter, in a temporary HOME."""
    script = "set -e\n" + "\n".join(re.sub(r"(?<![\w/])\.venv/bin/python", shlex.quote(python), line)
                                      for line in lines)
    env = dict(os.environ, HOME=str(home))
    for name in ("OTELA_DB", "OTELA_KEY_FILE", "OTELA_BOOTSTRAP", "OTELA_USER"):
        env.pop(name, None)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def test_readme_using_it_makes_a_cluster_key_and_keys_with_the_commands_shown(tmp_path):
    lines = block("## Using it")
    wanted = [line for line in lines if " keygen " in line or " keys create " in line]
    assert len(wanted) == 3 and wanted[1].startswith("KEY=$(")
    run = [line.replace("otela_", f"{ROOT}/otela_", 1) for line in wanted] + ['echo "$KEY"']
    done = sh(run, tmp_path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".otela" / "cluster.key").is_file()
    assert done.stdout.strip().splitlines()[-1].startswith("sk-otela-")
    listed = subprocess.run([sys.executable, str(ROOT / "otela_ingress.py"), "keys", "list", "--json"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=60, env=dict(os.environ, HOME=str(tmp_path)))
    keys = {k["user"]: k for k in json.loads(listed.stdout)}
    assert keys["admin"]["admin"] is True and keys["alice"]["allow"] == ["cluster=clariden"]


def test_readme_cluster_commands_parse_with_the_flags_they_name():
    import otela_ingress
    import otela_node
    import otela_place
    parsers = {"otela_node.py": otela_node.build_parser(), "otela_ingress.py": otela_ingress.build_parser(),
               "otela_place.py": otela_place.build_parser()}
    checked = 0
    for line in block("## Using it"):
        if line.startswith("KEY=$("):   # the command inside $(...)
            line = line[len("KEY=$("):line.rindex(")")]
        argv = shlex.split(line.split(" #")[0].rstrip(" &"))
        script = next((a for a in argv if a in parsers), None)
        if script is None:
            continue
        args, unknown = parsers[script].parse_known_args(argv[argv.index(script) + 1:])
        assert unknown == [], line
        checked += 1
    assert checked == 7   # keygen, serve, two keys, grant, start, plan


def copy_list():
    """{source in this checkout: destination folder under ~/otela} from the scp lines of "On a
    cluster, without pip" (globs kept: the wheels are made by the test)."""
    copied = {}
    for line in block("## On a cluster, without pip"):
        if line.startswith("scp "):
            args = [a for a in shlex.split(line)[1:] if not a.startswith("-")]
            folder = args[-1].split(":", 1)[1].rstrip("/")
            copied.update({a: folder.replace("otela", "", 1).lstrip("/") for a in args[:-1]})
    return copied


def test_readme_copy_list_holds_what_every_role_needs_and_each_runs_from_it(tmp_path):
    """Copy exactly the README's list into an empty folder (the h11 wheel made here from the
    installed package; pulp is installed, as the README says), then: each role's --help, keygen,
    a plan with --emit-sbatch and bash -n on every script, on a Python without site-packages
    where the role needs only h11."""
    import h11
    copied = copy_list()
    assert set(copied) == {"crdt.py", "otela_node.py", "otela_ingress.py", "otela_place.py", "otela_sim.py",
                           "sbatch", "wheels/h11-*.whl", "wheels/pulp-*.whl", "tests/data/calibration.json"}
    otela = tmp_path / "otela"
    for source, folder in copied.items():
        (otela / folder).mkdir(parents=True, exist_ok=True)
        if source == "wheels/h11-*.whl":    # what pip download gives: a zip of the package
            with zipfile.ZipFile(otela / folder / "h11-0.0.0-py3-none-any.whl", "w") as wheel:
                for path in Path(h11.__file__).parent.glob("*.py"):
                    wheel.write(path, f"h11/{path.name}")
        elif source == "sbatch":
            (otela / "sbatch").mkdir()
            for path in (ROOT / "sbatch").iterdir():
                (otela / "sbatch" / path.name).write_bytes(path.read_bytes())
        elif "*" not in source:
            (otela / folder / Path(source).name).write_bytes((ROOT / source).read_bytes())
    lines = block("## On a cluster, without pip")
    on_cluster = lines[lines.index("cd ~/otela"):]
    assert on_cluster[1] == "export PYTHONPATH=$(ls ~/otela/h11-*.whl)"
    bare = f"{sys.executable} -S"   # no site-packages: a bare cluster Python without h11
    scenario = {"gpus": [{"type": "A100-80GB-SXM4", "count": 2, "per_node": 2}],
                "models": {"tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "intermediate_size": 128, "vocab_size": 1000}},
                "workload": [{"model": "tiny", "rate_rps": 1.0, "input": {"mean": 200},
                                            "output": {"mean": 50}}]}
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    run = [line.replace("python3", bare) for line in on_cluster[:3]] + [
        f"{bare} otela_node.py start --help >/dev/null",
        f"{bare} otela_ingress.py serve --help >/dev/null",        # serve runs until stopped: --help
        f"{sys.executable} otela_sim.py --help >/dev/null",
        f"{sys.executable} otela_place.py plan --help >/dev/null",
        f"{sys.executable} otela_place.py plan --scenario ~/scenario.json --emit-sbatch ~/jobs --lock ~/lock "
        "--sbatch-var KEY_FILE=~/.otela/cluster.key --sbatch-var BOOTSTRAP=login1:7946 2>~/plan.err",
        "for f in ~/jobs/*.sbatch sbatch/*.sbatch sbatch/*.sh; do bash -n \"$f\"; done"]
    done = sh(run, tmp_path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".otela" / "cluster.key").is_file()
    jobs = sorted((tmp_path / "jobs").glob("*.sbatch"))
    assert jobs and all(f"OTELA_DIR={otela}\n" in job.read_text() for job in jobs)   # node.sh is there
    assert "calibration" not in (tmp_path / "plan.err").read_text()   # the copied one is in use


@pytest.mark.slow
def test_readme_placer_and_simulator_examples_run(tmp_path):
    lines = block("## The placer and the simulator, offline")
    jobs = tmp_path / "jobs"
    run = [line.replace("/tmp/otela-jobs", str(jobs)) for line in lines]
    done = sh(run, tmp_path, ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(list(jobs.glob("*.sbatch"))) > 0
    assert re.search(r"^fits\s+True$", done.stdout, re.M)
    assert "A100-80GB-SXM4" in done.stdout


def test_readme_site_file_is_valid_and_renders_a_script_for_every_model_and_gpu(tmp_path):
    import otela_place
    section = README[README.index("## A site from zero"):]
    doc = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    site = otela_place.check_site(doc, "site.json")
    assert [m["name"] for m in site["catalogue"]] == ["meta-llama/Llama-3.1-8B-Instruct", "qwen3-32b", "sql-lora"]
    values = {"KEY_FILE": "/k", "BOOTSTRAP": "login1:7946"}
    otela_place.check_site_templates(site, "vllm", values, site["gpus"])
    rows = [{"model": m, "gpu": "A100-80GB-SXM4", "tp": 1, "instances": 1} for m in otela_place.catalogue_of(site)]
    for _, name, text in otela_place.job_scripts(rows, site, "vllm", values):
        (tmp_path / name).write_text(text)
        assert subprocess.run(["bash", "-n", str(tmp_path / name)]).returncode == 0
        assert "#SBATCH --partition=gpu\n#SBATCH --account=proj42\n#SBATCH --qos=normal\n" in text
    # the table names every field the placer reads, and the commands parse with the flags they name
    for field in list(otela_place.SITE_FIELDS) + list(otela_place.GPU_FIELDS) + list(otela_place.MODEL_FIELDS):
        assert f"`{field}`" in section, field
    plan = next(line for line in block("## A site from zero") if "otela_place.py plan" in line)
    args = otela_place.build_parser().parse_args(shlex.split(plan)[2:])
    assert args.site == "~/.otela/site.json" and args.from_slurm and args.emit_sbatch
