"""`make run` as a newcomer uses it: the cluster comes up, the printed curl and openai snippets
work, and Ctrl-C stops every process it started (ingress, nodes, engines)."""
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, engine_installed

pytestmark = pytest.mark.skipif(not engine_installed(),
                                reason="real engine not installed: run `make engine`")


def _descendants(pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children = {}
    pairs = [tuple(map(int, row.split())) for row in out.strip().splitlines()]
    for child, parent in pairs:
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def test_make_run_serves_the_printed_curl_and_stops_cleanly_on_ctrl_c(tmp_path):
    base, gossip = _free_block(3), _free_block(3)
    env = dict(os.environ, OTELA_RUN_PORT=str(base), OTELA_RUN_GOSSIP=str(gossip),
               OTELA_RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.Popen([str(ROOT / "tests/lab/local_cluster.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        text = "".join(lines)
        assert "otela is up" in text, text
        # what jobs read (the cluster key) and what only the ingress reads are apart
        run = tmp_path / "run"
        assert (run / "cluster" / "cluster.key").is_file() and not (run / "cluster" / "ingress.key").exists()
        assert [oct(os.stat(p).st_mode & 0o777) for p in (run / "ingress", run / "ingress" / "ingress.key")] == \
            [oct(0o700), oct(0o600)]
        curl = re.search(r"^curl -s .*?-d '.*?'$", text, re.S | re.M).group(0)
        answer = subprocess.run(["bash", "-c", curl.replace("\\\n", " ")], capture_output=True,
                                text=True, timeout=120)
        assert '"choices"' in answer.stdout, answer.stdout
        assert '"object":"chat.completion"' in answer.stdout.replace(" ", "")
        snippet = re.search(r"<<'PY'\n(.*?)\nPY\n", text, re.S).group(1)
        streamed = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                                  timeout=120, cwd=ROOT)
        assert streamed.returncode == 0, streamed.stderr
        assert streamed.stdout.strip(), "the streamed answer is empty"
        started = _descendants(proc.pid)
        assert len(started) >= 5          # ingress, two nodes, two engines
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0 or proc.returncode in (130, -signal.SIGINT)
        time.sleep(0.5)
        alive = [pid for pid in started if os.path.exists(f"/proc/{pid}")
                 and "zombie" not in _status(pid)]
        assert alive == [], f"still running after Ctrl-C: {alive}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _free_block(n):
    """n consecutive ports free for TCP and UDP, below the ephemeral range (32768+), so that
    outgoing connections of other processes cannot take one between the check and the bind."""
    rnd = random.Random()
    for _ in range(200):
        base = rnd.randrange(20000, 32000 - n)
        if all(_bindable(base + i, kind) for i in range(n)
               for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM)):
            return base
    raise RuntimeError("no block of free ports")


def _bindable(port, kind):
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _status(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "zombie"
