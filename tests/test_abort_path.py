"""Specification of dropping work nobody waits for: a client that closes its connection while
its request waits in the engine's queue, while its prompt is being computed, or while its answer
is being generated (plain or streamed) has that request aborted at once: out of the emulated
engine's queue or batch, its KV blocks freed, as vLLM does. First against `otela_sim.py serve`
alone, then along the whole path: ingress -> its upstream connection -> the node's tunnel -> the
node's engine connection -> the engine. And the emulator's priority scheduling
(--scheduling-policy priority), as vLLM V1's."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port, poll, stop_process, wait_http

import otela_sim as sim

MODEL = "llama-3.1-8b"
# The emulator slowed so that a request stays in each phase long enough to leave in it: one
# request runs at a time (--max-num-seqs 1: a second one waits), a prompt is computed 64 tokens
# a step (a 1,500-token prompt prefills for ~24 steps), each step 20 times its H100 time
# (~0.1-0.2 s a step: seconds in a phase, yet a poll sees each phase within it).
SLOW = ["--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--time-scale", "20"]
LONG_ANSWER = 4000            # tokens: ~10 minutes at the slowed step, far past any test
LONG_PROMPT = " ".join(f"w{i}" for i in range(1500))
# How long a left request may stay at the engine: generous for a loaded 2-core box; the abort
# itself is one loop pass at each hop.
GONE_WITHIN_S = 10.0
PHASES = ("waiting", "prefilling", "generating")


def metrics(url):
    """The engine's /metrics as {name: value} (names without the label set)."""
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{", 1)[0]] = float(value)
    return values


def send(addr, path, body, headers=b""):
    """A raw HTTP/1.1 request on a new connection, its answer not read: the socket."""
    sock = socket.create_connection(addr, timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
                 % (path, headers, len(data), data))
    return sock


def chat(content, stream, max_tokens=LONG_ANSWER, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, **extra}


def idle(engine):
    m = metrics(engine)
    return m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0 and \
        m["vllm:kv_cache_usage_perc"] == 0


def leave_in(phase, stream, engine, client_addr, headers=b""):
    """A request (sent to client_addr: the engine itself or the ingress in front of it) that its
    client closes while it is in `phase` at the engine; returns the engine's metrics once it is
    gone there. A request holding the engine's one running place makes the next one wait."""
    poll(lambda: idle(engine), "the engine idle before the test", GONE_WITHIN_S)
    aborted = metrics(engine)["vllm:num_aborted_requests_total"]
    holder = send(client_addr, b"/v1/chat/completions", chat("hold the engine", True), headers) \
        if phase == "waiting" else None
    try:
        if holder is not None:
            poll(lambda: metrics(engine)["vllm:num_requests_running"] == 1, "the holder running")
        prompt = LONG_PROMPT if phase == "prefilling" else f"leave while {phase}"
        before = metrics(engine)
        sock = send(client_addr, b"/v1/chat/completions", chat(prompt, stream), headers)
        if phase == "waiting":
            poll(lambda: metrics(engine)["vllm:num_requests_waiting"] == 1, "the request waiting")
        elif phase == "prefilling":
            poll(lambda: metrics(engine)["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"],
                 "the prompt being computed")
            assert metrics(engine)["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
        elif stream:
            got = b""
            while b"data: " not in got:                 # its first token came
                got += sock.recv(65536)
        else:
            # a short prompt is one step, then decode steps; the engine books a run of decode
            # steps planned at once at its end (/metrics lags), so: running, then a few steps
            poll(lambda: metrics(engine)["vllm:num_requests_running"] == 1, "the request running")
            time.sleep(1.0)
        sock.close()
        if phase == "waiting":
            left = poll(lambda: (lambda m: m if m["vllm:num_requests_waiting"] == 0 else None)(metrics(engine)),
                        "the waiting request gone", GONE_WITHIN_S)
            assert left["vllm:num_requests_running"] == 1           # the holder runs on
        else:
            left = poll(lambda: (lambda m: m if m["vllm:num_requests_running"] == 0 else None)(metrics(engine)),
                        f"the {phase} request gone", GONE_WITHIN_S)
            assert left["vllm:kv_cache_usage_perc"] == 0            # its blocks back in the pool
        assert left["vllm:num_aborted_requests_total"] == aborted + 1
        if phase == "prefilling":                                   # aborted, not finished
            assert left["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
        return left
    finally:
        if holder is not None:
            holder.close()


def start_engine(port, *flags):
    proc = subprocess.Popen([sys.executable, str(ROOT / "otela_sim.py"), "serve", "--model", MODEL, "--gpu", "H100",
                             "--port", str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=30, proc=proc)
    except BaseException:
        stop_process(proc, 5)
        raise
    return proc


# --- the emulated engine alone ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    port = free_port()
    proc = start_engine(port, *SLOW)
    try:
        yield port
    finally:
        stop_process(proc, 5)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_client_that_closes_has_its_request_aborted_by_the_engine_in_every_phase(engine, phase, stream):
    leave_in(phase, stream, f"http://127.0.0.1:{engine}", ("127.0.0.1", engine))


def test_a_client_that_half_closes_is_gone_as_vllms_server_takes_it(engine):
    """An EOF is the end of the client, as uvicorn (vLLM's server) and nginx take it."""
    url = f"http://127.0.0.1:{engine}"
    poll(lambda: idle(url), "the engine idle")
    sock = send(("127.0.0.1", engine), b"/v1/chat/completions", chat("half close", False))
    poll(lambda: metrics(url)["vllm:num_requests_running"] == 1, "the request running")
    sock.shutdown(socket.SHUT_WR)
    assert sock.recv(65536) == b""                  # no answer: the connection ends
    poll(lambda: idle(url), "the request gone", GONE_WITHIN_S)
    sock.close()


def test_a_client_that_sends_and_closes_at_once_has_its_request_aborted_as_it_is_queued(engine):
    """Its EOF may be read before its request is parsed: the request is aborted all the same."""
    url = f"http://127.0.0.1:{engine}"
    poll(lambda: idle(url), "the engine idle")
    aborted = metrics(url)["vllm:num_aborted_requests_total"]
    send(("127.0.0.1", engine), b"/v1/chat/completions", chat("send and go", False)).close()
    poll(lambda: metrics(url)["vllm:num_aborted_requests_total"] == aborted + 1, "the request aborted",
         GONE_WITHIN_S)
    assert idle(url)


# --- the whole path: ingress, tunnel, node, engine -------------------------------------------------

@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from test_ingress_support import Cluster
    cluster = Cluster(str(tmp_path_factory.mktemp("abort")))
    try:
        port = free_port()
        process = " ".join([sys.executable, "otela_sim.py", "serve", "--model", MODEL, "--gpu", "H100",
                            "--port", str(port), *SLOW])
        argv = [os.path.join(cluster.root, "otela_node.py"), "start", "--key-file", cluster.key_file,
                "--bootstrap", f"127.0.0.1:{cluster.gossip}", "--listen", f"127.0.0.1:{free_port()}",
                "--gossip", f"127.0.0.1:{free_port()}", "--process", process, *cluster.grant("sim", [MODEL])]
        cluster.nodes["sim"] = cluster._spawn("sim", argv)
        cluster._wait(lambda: cluster.serving(MODEL) == 1, f"node serving {MODEL}", 60)
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        cluster.close()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_client_that_closes_at_the_ingress_has_its_request_aborted_at_the_engine(path, phase, stream):
    cluster, engine = path
    auth = b"authorization: Bearer %s\r\n" % cluster.token.encode()
    leave_in(phase, stream, engine, ("127.0.0.1", cluster.port), auth)


def test_a_client_that_closes_its_socket_at_the_ingress_frees_the_upstream_connection_never_pooled_again(stack):
    """A closed socket reads as an EOF at the ingress (only a write to it is reset): with the
    request at a slow engine, the upstream connection is dropped at once, not returned to the
    pool, and the request is booked 499; a new and a pooled upstream connection alike."""
    from test_ingress_paths import CHAT, request
    stack.engine("m1", mode="slow", slow_delay=3.0)
    key = stack.key()
    pool = stack.ingress.pool

    def close_while_at_the_engine():
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            sock.sendall(request(key, CHAT))
            upstream = poll(lambda: stack.call(lambda: next(iter(pool.active), None)), "the request upstream")
        # the engine answers after 3 s; the connection is gone long before
        poll(lambda: not stack.call(lambda: bool(pool.active)), "the upstream connection dropped", 2.5)
        assert upstream.transport.is_closing()
        assert all(upstream not in idle for idle in stack.call(lambda: list(pool._idle.values())))
        time.sleep(3.2)                             # the engine's handler wakes to a closed connection

    close_while_at_the_engine()                     # on a new upstream connection
    from test_ingress_support import Client
    client = Client(stack.url, key)
    try:
        assert client.chat()[0] == 200              # leaves a pooled connection
    finally:
        client.close()
    close_while_at_the_engine()                     # on the pooled one
    assert stack.inflight_settled() == 0
    assert sorted(stack.sql("SELECT status FROM requests")) == [(200,), (499,), (499,)]


def test_a_client_that_closes_on_a_plain_tunnel_has_its_request_aborted_at_the_engine(path, tmp_path):
    """The node's own hop without TLS: an EOF on the tunnel while the engine works is the end of
    the ingress's upstream connection (it never half-closes one), and the node drops the engine's."""
    import otela_node as on
    cluster, _ = path
    folder = tmp_path / "plain"                 # the cluster key alone: the node runs the plain tunnel
    folder.mkdir()
    key = folder / "cluster.key"
    key.write_bytes(open(cluster.key_file, "rb").read())
    key.chmod(0o600)
    port, listen = free_port(), free_port()
    process = " ".join([sys.executable, "otela_sim.py", "serve", "--model", MODEL, "--gpu", "H100",
                        "--port", str(port), *SLOW])
    node = cluster._spawn("plain", [os.path.join(cluster.root, "otela_node.py"), "start", "--key-file", str(key),
                                    "--bootstrap", f"127.0.0.1:{cluster.gossip}", "--listen", f"127.0.0.1:{listen}",
                                    "--gossip", f"127.0.0.1:{free_port()}", "--process", process])
    engine = f"http://127.0.0.1:{port}"
    credential = b"%s: %s\r\n" % (on.TUNNEL_HEADER.encode(), on.tunnel_credential(on.load_key(str(key))).encode())

    def tunnel_serves():
        try:
            with socket.create_connection(("127.0.0.1", listen), timeout=5) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n%sconnection: close\r\n\r\n" % credential)
                return sock.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False
    poll(tunnel_serves, "the node's plain tunnel serving", 60)
    wait_http(engine + "/health", timeout=30, proc=node)
    for phase in PHASES:
        for stream in (False, True):
            leave_in(phase, stream, engine, ("127.0.0.1", listen), credential)


# --- priority scheduling ---------------------------------------------------------------------------

class FlatCost:
    def step(self, tokens, seqs, decode_ctx=0.0, prefill_pairs=0.0, prefill_tokens=0):
        return 0.01


def _request(rid, priority, arrival, tokens=8, max_tokens=4):
    req = sim.EmulatedRequest(rid, [f" r{rid}t{i}" for i in range(tokens)], max_tokens, arrival)
    req.priority = priority
    return req


def _admitted_order(core):
    order, clock = [], 0.0
    while not core.idle():
        step = core.schedule()
        order += [req.id for req, _ in step.items if req.id not in order]
        clock += step.seconds
        core.complete(step, clock)
    return order


def test_under_priority_scheduling_the_lowest_priority_value_is_admitted_first_and_ties_go_by_arrival():
    core = sim.EngineCore(FlatCost(), num_blocks=100, block_size=16, max_num_seqs=1, policy="priority")
    for rid, priority, arrival in ((1, 5, 0.0), (2, 0, 1.0), (3, 5, 0.5), (4, -1, 2.0), (5, 0, 0.9)):
        core.add(_request(rid, priority, arrival))
    assert _admitted_order(core) == [4, 5, 2, 1, 3]


def test_first_come_first_served_ignores_nothing_and_admits_in_arrival_order():
    core = sim.EngineCore(FlatCost(), num_blocks=100, block_size=16, max_num_seqs=1)
    for rid in (1, 2, 3):
        core.add(_request(rid, 0, float(rid)))
    assert _admitted_order(core) == [1, 2, 3]


def test_under_priority_scheduling_a_full_pool_preempts_the_least_urgent_running_request():
    # 4 blocks of 4 tokens: two requests of 7 prompt tokens hold 2 blocks each; the first to
    # need a third block finds none, and the victim is the less urgent one, not the youngest
    core = sim.EngineCore(FlatCost(), num_blocks=4, block_size=4, max_num_seqs=2, policy="priority")
    urgent, lax = _request(1, 0, 1.0, tokens=7, max_tokens=6), _request(2, 9, 0.0, tokens=7, max_tokens=6)
    core.add(lax)
    core.add(urgent)
    step = core.schedule()
    assert [r.id for r, _ in step.items] == [1, 2]          # the urgent one first, though it came later
    clock = 0.01
    core.complete(step, clock)
    while core.preemptions == 0:
        step = core.schedule()
        clock += step.seconds
        core.complete(step, clock)
    assert lax.state == "preempted" and urgent.state == "running"
    while not core.idle():
        step = core.schedule()
        clock += step.seconds
        core.complete(step, clock)
    assert urgent.finished_at < lax.finished_at
    assert len(core.cache.free) == 4


def test_the_serve_flag_orders_requests_by_the_bodys_priority_and_fcfs_refuses_one_as_vllm_does(tmp_path):
    import http.client
    port, fcfs_port, log = free_port(), free_port(), tmp_path / "requests.jsonl"
    proc = start_engine(port, "--max-num-seqs", "1", "--time-scale", "5", "--scheduling-policy", "priority",
                        "--request-log", str(log))
    fcfs = start_engine(fcfs_port)
    socks = []
    try:
        url = f"http://127.0.0.1:{port}"
        socks.append(send(("127.0.0.1", port), b"/v1/completions", {"model": MODEL, "prompt": "hold", "max_tokens": 40}))
        poll(lambda: metrics(url)["vllm:num_requests_running"] == 1, "the holder running")
        sent = (3, 1, 2)                               # ids 2, 3, 4 (the engine numbers arrivals)
        for p in sent:
            socks.append(send(("127.0.0.1", port), b"/v1/completions",
                              {"model": MODEL, "prompt": f"p{p}", "max_tokens": 2, "priority": p}))
            poll(lambda: metrics(url)["vllm:num_requests_waiting"] == len(socks) - 1, "it waiting")
        lines = poll(lambda: (lambda ls: ls if len(ls) == 4 else None)(log.read_text().splitlines()),
                     "every request ended")
        ended = [int(json.loads(line)["id"].rsplit("-", 1)[1]) for line in lines]     # in the order they ended
        assert [sent[i - 2] for i in ended[1:]] == [1, 2, 3]
        assert all(json.loads(line)["state"] == "finished" for line in lines)
        conn = http.client.HTTPConnection("127.0.0.1", fcfs_port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "priority": 1}),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        assert (resp.status, error["param"]) == (400, "priority")
        assert "Priority scheduling is not enabled" in error["message"]
        conn.close()
    finally:
        for sock in socks:
            sock.close()
        stop_process(proc, 5)
        stop_process(fcfs, 5)
