"""The real tiny engine as tests/lab/engine_serve.py starts it: what the README's path needs from
it (model list, readiness, chat and completions with and without streaming are in
test_ingress_engine.py), and a clean stop on SIGTERM. Skips when the engine is not installed."""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import urllib.request

import pytest
from conftest import ENGINE_ALIAS, engine_command, engine_installed, free_port, stop_process, wait_http

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not engine_installed(), reason="real engine not installed: run `make engine`")]


def get(url):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def test_engine_lists_its_alias_is_ready_and_stops_with_exit_0_on_sigterm():
    port = free_port()
    proc = subprocess.Popen(shlex.split(engine_command(port)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=120, proc=proc)
        status, models = get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [ENGINE_ALIAS]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            stop_process(proc, 5)


def test_engine_check_generates_tokens_on_this_cpu():
    # the prebuilt wheel is AVX2: on a CPU that advertises AVX-512/AMX yet refuses them, a
    # native build dies with SIGILL at the first token; this one must generate
    cmd = shlex.split(engine_command(0))
    check = subprocess.run(cmd[:2] + ["--check", "-m", cmd[cmd.index("-m") + 1]],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-2000:]
