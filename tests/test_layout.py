"""The project's promises about its shape: the top level, Python 3.9 syntax, and that the node
and the ingress run on a bare interpreter with only the h11 wheel on PYTHONPATH."""
import ast
import subprocess
import sys
import venv

import pytest
from conftest import ROOT

ROLE_FILES = ["crdt.py", "otela_node.py", "otela_ingress.py", "otela_sim.py", "otela_place.py"]
ALLOWED_TOP = {"crdt.py", "otela_node.py", "otela_ingress.py", "otela_place.py", "otela_sim.py",
               "tests", "sbatch", "Makefile", "README.md", "pyproject.toml", ".gitignore", ".ci",
               "requirements.txt", "requirements-dev.txt", "requirements-optional.txt"}


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def test_top_level_holds_only_the_roles_and_project_files():
    top = {path.split("/")[0] for path in tracked_files()}
    assert top <= ALLOWED_TOP, f"unexpected at the top level: {sorted(top - ALLOWED_TOP)}"
    assert {"crdt.py", "Makefile", "README.md", ".ci"} <= top


@pytest.mark.parametrize("path", [p for p in ROLE_FILES if (ROOT / p).exists()]
                         + ["tests/fake_engine.py"])
def test_python_files_parse_as_python_3_9(path):
    source = (ROOT / path).read_text()
    ast.parse(source, filename=path, feature_version=(3, 9))


def test_readme_gives_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme


def test_node_and_ingress_run_on_a_bare_python_with_only_the_h11_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "h11",
                          "-d", str(wheels)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot download the h11 wheel here: {got.stderr.strip()[-200:]}")
    wheel = next(wheels.glob("h11-*.whl"))
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)          # stdlib only: no h11, orjson or uvloop
    python = str(bare / "bin" / "python")
    env = {"PYTHONPATH": str(wheel), "PATH": "/usr/bin:/bin"}
    probe = subprocess.run([python, "-c", "import h11, crdt, otela_node; import orjson"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
    assert "No module named 'orjson'" in probe.stderr      # h11, crdt, node imported fine
    keys = subprocess.run([python, "otela_node.py", "keygen", "--out", str(tmp_path / "k")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert keys.returncode == 0, keys.stderr
    assert (tmp_path / "k" / "cluster.key").stat().st_mode & 0o077 == 0
    helped = subprocess.run([python, "otela_ingress.py", "serve", "--help"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert helped.returncode == 0 and "--listen" in helped.stdout, helped.stderr
