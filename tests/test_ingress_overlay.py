"""The ingress on the real overlay: `otela_ingress.py serve` and `otela_node.py start` processes on
loopback, the node wrapping tests/fake_engine.py, requests going ingress -> node tunnel -> engine."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from test_ingress_support import Client, Cluster, free_port, pids_listening_on, sse_events

pytestmark = pytest.mark.slow
ENGINE = f"{sys.executable} tests/fake_engine.py --model fm --chunks 6 --port"


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(str(tmp_path))
    try:
        yield c
    finally:
        c.close()


def test_requests_go_through_a_real_node_to_its_engine(cluster):
    port = free_port()
    cluster.node("n1", f"{ENGINE} {port}", port, "fm", labels=["site=a"])
    client = Client(cluster.url, cluster.token)
    raw = b'{"model":"fm","messages":[{"role":"user","content":"one two three"}],"user":"u1"}'
    status, headers, body = client.request("POST", "/v1/chat/completions", raw)
    assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == 3
    engine = Client(f"http://127.0.0.1:{port}")
    assert engine.request("GET", "/fake/stats")[2].decode().count("one two three") == 1
    assert json.loads(engine.request("GET", "/fake/stats")[2])["last_body"] == raw.decode()
    status, _, body = client.chat("fm", stream=True)
    events = sse_events(body)
    assert status == 200 and len(events) == 7 and events[-1] == "[DONE]"
    assert json.loads(body.split(b"\n")[0][6:])["choices"]
    status, _, body = client.request("GET", "/v1/usage", key=cluster.token)
    assert json.loads(body)["totals"]["requests"] == 2


def test_a_node_killed_with_sigkill_costs_clients_nothing(cluster):
    p1, p2 = free_port(), free_port()
    cluster.node("n1", f"{ENGINE} {p1}", p1, "fm")
    doomed = cluster.node("n2", f"{ENGINE} {p2}", p2, "fm")
    client = Client(cluster.url, cluster.token)
    assert [client.chat("fm")[0] for _ in range(10)] == [200] * 10
    cluster.orphans += pids_listening_on(p2)
    doomed.send_signal(signal.SIGKILL)
    for pid in cluster.orphans:   # the engine dies with its node, as in a cancelled Slurm job
        os.kill(pid, signal.SIGKILL)
    statuses = [client.chat("fm")[0] for _ in range(40)]
    stream_statuses = [client.chat("fm", stream=True)[0] for _ in range(10)]
    assert statuses == [200] * 40 and stream_statuses == [200] * 10
    deadline = time.monotonic() + 30   # the failure detector then takes it out of the view
    while cluster.serving("fm") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.5)
