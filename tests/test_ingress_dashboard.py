"""The dashboard renders in headless Chromium with no console errors and shows the registry."""
from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest
from test_ingress_support import Client, Stack

import crdt

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `apt-get install -y chromium` (make sysdeps)")
def test_dashboard_renders_sessions_and_usage_without_console_errors(tmp_path):
    stack = Stack(str(tmp_path / "otela.sqlite"))
    try:
        serving, _ = stack.engine("m-dash", labels={"site": "lrz"}, hardware={"gpu": "H100", "count": 4})
        suspected, _ = stack.engine("m-dash")
        stack.engine("m-dash", hardware={"gpu": "H100", "count": 8, "nodes": ["gpu1", "gpu2"], "tp": 4, "pp": 2})
        stack.call(stack.node.suspect, suspected)
        ungranted, _ = stack.engine("m-dash")   # the others' grants from the login node; none for it
        tier = crdt.Authority([b"i" * 32])

        def grant(sid):
            record = stack.node.registry.get(sid)
            record.update(version=record["version"] + 1, grant=tier.issue(["m-dash"], {}, "1", time.time() + 600,
                                                                           time.time())[0])
            stack.node.registry.put(sid, record)
            stack.node._changed(sid)
        stack.call(stack.ingress.grants.use, tier)
        for sid in (serving, suspected):
            stack.call(grant, sid)
        client = Client(stack.url, stack.key())
        assert client.chat("m-dash")[0] == 200
        profile = tmp_path / "chromium-profile"
        done = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-extensions", "--no-first-run",
             "--disable-component-update", "--disable-sync", "--metrics-recording-only",
             f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=5000", "--dump-dom", stack.url + "/dashboard"],
            capture_output=True, text=True, timeout=90)
    finally:
        stack.close()
    dom, log = done.stdout, done.stderr
    console = [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not [line for line in console if re.search(r"Uncaught|Error|error", line)], console
    assert done.returncode == 0, log[-2000:]
    assert serving[:12] in dom and suspected[:12] in dom
    assert "4 x H100" in dom and "site=lrz" in dom and "suspected" in dom
    assert "<td> (claims lrz)</td>" in dom       # its grant names no site: its record's claim, shown apart
    assert "8 x H100 on 2 nodes (gpu1, gpu2), tp 4 x pp 2" in dom   # a model bigger than a node
    assert ungranted[:12] in dom and "unrouted: ungranted" in dom
    assert re.search(r"<td>m-dash</td><td>1</td>", dom), "the usage stats row is missing"
    assert re.search(r'id="status">updated ', dom), "the page did not finish a refresh"
