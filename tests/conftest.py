"""Shared fixtures: the real tiny engine (llama.cpp's server from the xllamacpp wheel +
SmolLM2-135M, tests/lab/engine_serve.py), free ports."""
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# `make test` runs the registry tests a second time as a bare cluster Python would: with the
# optional accelerators made unimportable.
if os.environ.get("OTELA_BLOCK_ACCEL"):
    sys.modules["orjson"] = None
    sys.modules["uvloop"] = None

ENGINE_DIR = Path(os.environ.get("OTELA_ENGINE_DIR", ROOT / ".cache" / "engine"))
ENGINE_PYTHON = ENGINE_DIR / "venv" / "bin" / "python"
ENGINE_MODEL = ENGINE_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINE_ALIAS = "smollm2-135m"


def free_port(kind=socket.SOCK_STREAM):
    from fake_engine import free_port as below_ephemeral  # (see there)
    return below_ephemeral(kind)


ENGINE_SERVE = ROOT / "tests" / "lab" / "engine_serve.py"


def engine_command(port="{port}"):
    """The command line that starts the real engine on loopback at `port` (llama-server's
    flags; engine_serve.py hands them to llama-cpp-python where that is the installed one)."""
    return " ".join(shlex.quote(str(p)) for p in (
        ENGINE_PYTHON, ENGINE_SERVE, "-m", ENGINE_MODEL, "--alias", ENGINE_ALIAS,
        "--host", "127.0.0.1", "--port")) + f" {port}"


def engine_installed():
    return ENGINE_PYTHON.exists() and ENGINE_MODEL.exists()


def wait_http(url, timeout=60.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def poll(check, what, timeout=30.0, interval=0.2):
    """Call `check` until it returns a true value, and return that value; fail saying `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout} s")


def stop_process(proc, grace):
    """SIGTERM, then SIGKILL after `grace` seconds: what every test does with what it started."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RealEngine:
    def __init__(self, url, model, cmd, proc):
        self.url, self.model, self.cmd, self.proc = url, model, cmd, proc


@pytest.fixture(scope="session")
def real_engine():
    """A real llama.cpp server with SmolLM2-135M on a free loopback port."""
    if not engine_installed():
        pytest.skip(f"real engine not installed in {ENGINE_DIR}: run `make engine` (seconds; minutes where it must build from source)")
    port = free_port()
    proc = subprocess.Popen(shlex.split(engine_command(port)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=120, proc=proc)
        yield RealEngine(f"http://127.0.0.1:{port}", ENGINE_ALIAS, engine_command(), proc)
    finally:
        stop_process(proc, 10)


@pytest.fixture
def stack(tmp_path):
    """An ingress in a background event loop with fake engines to add (test_ingress_support.Stack)."""
    from test_ingress_support import Stack
    s = Stack(str(tmp_path / "otela.sqlite"))
    try:
        yield s
    finally:
        s.close()
