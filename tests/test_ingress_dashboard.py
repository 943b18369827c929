"""The dashboard renders in headless Chromium with no console errors and shows the registry."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from test_ingress_support import Client, Stack

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `apt-get install -y chromium` (make sysdeps)")
def test_dashboard_renders_sessions_and_usage_without_console_errors(tmp_path):
    stack = Stack(str(tmp_path / "otela.sqlite"))
    try:
        serving, _ = stack.engine("m-dash", labels={"site": "lrz"}, hardware={"gpu": "H100", "count": 4})
        suspected, _ = stack.engine("m-dash")
        stack.call(stack.node.suspect, suspected)
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
    assert re.search(r"<td>m-dash</td><td>1</td>", dom), "the usage stats row is missing"
    assert re.search(r'id="status">updated ', dom), "the page did not finish a refresh"
