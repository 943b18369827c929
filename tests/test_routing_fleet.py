"""The `ttft` policy end to end: a real ingress and real nodes wrapping emulated engines
(`otela_sim.py serve`, which reports cached tokens as vLLM does). What a user sees: a prompt
prefix stays on the engine that holds it, the nodes publish what their engines were sent and
their load, /metrics and /v1/registry show the hit rates, and a node killed under load moves
its prefixes elsewhere with no failed request, and a stream cut by it goes on from another
engine with the text it would have had. Figures (hit rates, TTFT against the peers) are
the benchmark's (tests/bench_routing.py), never asserted here."""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import sys
import threading
import time

import pytest
from conftest import poll
from test_ingress_support import Client, Cluster, child_pids, free_port

import otela_ingress
import otela_node

pytestmark = pytest.mark.slow
MODEL = "sm"
SIM = (f"{sys.executable} otela_sim.py serve --model meta-llama/Llama-3.1-8B-Instruct --served-model-name {MODEL} "
       "--gpu H100 --engine vllm-v1 --port")


def words(n, seed):
    rng = random.Random(seed)
    return "".join(" " + "".join(rng.choices("abcdefgh", k=4)) for _ in range(n))


def ask(client, system, question, stream=False):
    body = {"model": MODEL, "max_tokens": 4, "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    status, headers, answer = client.request("POST", "/v1/chat/completions", body)
    return status, headers.get(otela_ingress.SESSION_HEADER.decode()), answer


@pytest.fixture
def fleet(tmp_path):
    cluster = Cluster(str(tmp_path), policy="ttft")
    try:
        for i in range(3):
            port = free_port()
            cluster.node(f"n{i}", f"{SIM} {port}", port, MODEL)
        yield cluster
    finally:
        cluster.close()


def queued(cluster):
    """Requests that waited in the ingress's fair queue (its /metrics)."""
    client = Client(cluster.url)
    try:
        text = client.request("GET", "/metrics")[2].decode()
    finally:
        client.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("otela_queue_wait_seconds_count"))


def registry(cluster):
    client = Client(cluster.url)
    try:
        return json.loads(client.request("GET", "/v1/registry")[2])
    finally:
        client.close()


def test_prefixes_stay_home_and_the_nodes_publish_them(fleet):
    client = Client(fleet.url, fleet.token)
    systems = [words(600, g) for g in range(4)]
    homes, cached = {}, 0
    for round_ in range(3):
        for g, system in enumerate(systems):
            status, session, answer = ask(client, system, words(20, 100 * g + round_), stream=bool(round_ % 2))
            assert status == 200, answer
            homes.setdefault(g, set()).add(session)
            if not round_ % 2:
                cached += json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert all(len(h) == 1 for h in homes.values()), homes
    assert cached > 0   # the third round hit the cache its first round filled

    # each home node publishes the prefixes it was sent (keyed by the ingress tier's secret)
    tier = os.path.join(os.path.dirname(fleet.key_file), otela_node.KEY_FILES["ingress"])
    key = otela_node.prefix_key(otela_node.load_secrets(tier, "ingress key")[0])
    for g, system in enumerate(systems):
        chain = otela_node.prompt_chain(otela_node.prompt_text(
            {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}), key)
        home = next(iter(homes[g]))

        def published(home=home, chain=chain):
            record = next(s for s in registry(fleet)["sessions"] if s["session"] == home)
            published = otela_ingress.PublishedPrefixes(limit=1)
            published.update(home, record)
            return published.match(chain).get(home, (0, False))[0] >= 8
        poll(published, f"group {g}'s prefix published by its node")

    # and, once it has streamed a few answers, its engine's speed as its node measured it
    home = next(iter(homes[0]))
    for i in range(otela_node.EngineSpeed.MIN_ANSWERS + 2):
        assert ask(client, systems[0], words(20, 7000 + i), stream=True)[0] == 200

    def speed():
        record = next(s for s in registry(fleet)["sessions"] if s["session"] == home)
        found = record.get("speed") or {}
        return found.get("prefill", 0) > 0 and found.get("decode", 0) > 0 and found
    poll(speed, "the home node's speed published")

    view = registry(fleet)["ingress"]["routing"]
    assert {next(iter(h)) for h in homes.values()} <= set(view)
    assert all(v["cache_hit_rate"] > 0 for s, v in view.items() if v["prompt_tokens"])
    status, _, metrics = client.request("GET", "/metrics")
    text = metrics.decode()
    assert status == 200 and "otela_session_cached_tokens_total{session=" in text
    assert "otela_session_ttft_estimate_seconds{session=" in text
    client.close()


def test_a_node_killed_under_load_moves_its_prefixes_with_no_failed_request(fleet):
    systems = [words(600, 50 + g) for g in range(6)]
    results, lock, stop = [], threading.Lock(), threading.Event()

    def user(i):
        client = Client(fleet.url, fleet.token, timeout=60)
        n = 0
        while not stop.is_set():
            g = (i + n) % len(systems)
            status, session, answer = ask(client, systems[g], words(10, 1000 * i + n))
            with lock:
                results.append((time.monotonic(), g, status, session, answer[:200]))
            n += 1
        client.close()

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        poll(lambda: len(results) >= 24, "24 answers before the kill", 60)
        # under load: the nodes publish how many requests they hold, from every ingress, or (where
        # the engines are full by the ingress's own count) requests wait in its fair queue
        poll(lambda: any(isinstance(s.get("load"), int) for s in registry(fleet)["sessions"]) or queued(fleet),
             "a node's load published, or requests waiting at the ingress", 30)
        with lock:
            victim = max({r[3] for r in results}, key=lambda s: sum(r[3] == s for r in results))
        killed_at = time.monotonic()
        kill_node_of(fleet, victim)
        poll(lambda: sum(r[0] > killed_at + 1 for r in results) >= 24, "24 answers after the kill", 90)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    failed = [r for r in results if r[2] != 200]
    assert not failed, failed[:3]
    after = [r for r in results if r[0] > killed_at + 1]
    assert victim not in {r[3] for r in after}
    moved = {r[1] for r in after}
    assert len(moved) == len(systems)   # every prefix is served elsewhere


def test_a_stream_whose_node_is_killed_goes_on_elsewhere_with_the_text_it_would_have_had(fleet):
    body = {"model": MODEL, "max_tokens": 300, "stream": True,
            "messages": [{"role": "system", "content": words(300, 9)}, {"role": "user", "content": words(20, 10)}]}
    host, port = fleet.url.rsplit("/", 1)[-1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json", "authorization": f"Bearer {fleet.token}"})
        response = conn.getresponse()
        assert response.status == 200
        events = []
        while len(events) < 10:   # 10 tokens of 300 (~8 ms each): the stream is well under way
            line = response.readline()
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
        kill_node_of(fleet, response.getheader(otela_ingress.SESSION_HEADER.decode()))
        events += [line[6:].strip() for line in response.read().split(b"\n") if line.startswith(b"data: ")]
    finally:
        conn.close()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    # the emulator's answer is a function of the prompt: asked again, whole, elsewhere
    client = Client(fleet.url, fleet.token, timeout=60)
    try:
        status, _, whole = client.request("POST", "/v1/chat/completions", {**body, "stream": False})
        metrics = client.request("GET", "/metrics")[2].decode()
    finally:
        client.close()
    assert status == 200
    assert text == json.loads(whole)["choices"][0]["message"]["content"]
    assert "otela_stream_resumes_total 1" in metrics and "otela_stream_cuts_total 0" in metrics


def kill_node_of(cluster, session):
    """SIGKILL the node serving `session`, and its engine (a node killed so leaves it behind)."""
    addr = next(s["addr"] for s in registry(cluster)["sessions"] if s["session"] == session)
    name = next(n for n, proc in cluster.nodes.items() if addr in _cmdline(proc.pid))   # its --listen
    engines = child_pids({cluster.nodes[name].pid}, b"otela_sim.py")
    os.kill(cluster.nodes[name].pid, signal.SIGKILL)
    for engine in engines:
        cluster.orphans.append(engine)
        os.kill(engine, signal.SIGKILL)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return []
