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


def test_readme_without_pip_recipe_runs_on_a_python_without_site_packages(tmp_path):
    import h11
    lines = block("## On a cluster, without pip")
    on_cluster = lines[lines.index("cd ~/otela"):]
    assert on_cluster[1] == "export PYTHONPATH=$(ls ~/otela/h11-*.whl)"
    # what pip download and scp leave in ~/otela: the three files and an h11 wheel (a zip of it)
    otela = tmp_path / "otela"
    otela.mkdir()
    for name in ("crdt.py", "otela_node.py", "otela_ingress.py"):
        (otela / name).write_bytes((ROOT / name).read_bytes())
    package = Path(h11.__file__).parent
    with zipfile.ZipFile(otela / "h11-0.0.0-py3-none-any.whl", "w") as wheel:
        for path in package.glob("*.py"):
            wheel.write(path, f"h11/{path.name}")
    # python3 -S: no site-packages, as a bare cluster Python without h11; serve is left out (it
    # runs until stopped): --help shows the ingress imports
    run = [line.replace("python3", f"{sys.executable} -S") for line in on_cluster[:3]]
    run.append(f"{sys.executable} -S otela_ingress.py serve --help >/dev/null")
    done = sh(run, tmp_path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".otela" / "cluster.key").is_file()


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
