"""Real node processes on loopback with real UDP sockets, each wrapping tests/fake_engine.py.

Timings are shortened through OTELA_* variables so failures are detected in about a second;
the defaults (probe every 0.7 s, grace >= 2.8 s) are for real clusters."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import otela_node as on  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import fake_engine  # noqa: E402

FAST = {"OTELA_PROBE_INTERVAL": "0.3", "OTELA_PROBE_TIMEOUT": "0.1", "OTELA_INDIRECT_TIMEOUT": "0.1", "OTELA_SUSPICION_MULT": "3",
        "OTELA_PUSH_PULL_INTERVAL": "1", "OTELA_ENGINE_CHECK_INTERVAL": "0.2",
        "OTELA_ENGINE_CHECK_FAILURES": "2", "OTELA_LEAVE_LINGER": "0.3", "OTELA_LOG_LEVEL": "WARNING"}
FUZZ_SECONDS = float(os.environ.get("OTELA_FUZZ_SECONDS", "30"))


def free_port_pair():
    """A port free for both TCP and UDP on loopback (gossip uses both)."""
    return fake_engine.free_port_pair()


def get_json(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def tunnel_context(key_file):
    """The TLS client context a member dials a node's tunnel with (keygen's cluster certificate)."""
    cfg = on.Config(key=on.load_key(key_file))
    cfg.tls_cert, cfg.tls_key = on.find_tunnel_tls(key_file)
    return on.tunnel_tls(cfg)[1]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


class NodeProc:
    def __init__(self, key_file, bootstrap=None, engine_flags="", node_flags=(), engine_cmd=None):
        self.gossip = f"127.0.0.1:{free_port_pair()}"
        self.listen = f"127.0.0.1:{free_port_pair()}"
        engine = engine_cmd or f"{sys.executable} {ROOT / 'tests' / 'fake_engine.py'} --port {{port}} {engine_flags}"
        argv = [sys.executable, str(ROOT / "otela_node.py"), "start", "--key-file", key_file,
                "--gossip", self.gossip, "--listen", self.listen, "--process", engine]
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        argv += list(node_flags)
        env = dict(os.environ, **FAST)
        env.pop("OTELA_BOOTSTRAP", None)
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.session = wait_for(lambda: self.view()["self"], 20, "node up")

    def view(self):
        return get_json(f"http://{self.listen}/v1/registry")

    def sessions(self):
        return {s["session"]: s for s in self.view()["sessions"]}

    def engine_pid(self):
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as fh:
            return int(fh.read().split()[0])

    def stop(self):
        if self.proc.poll() is None:
            try:
                engine = self.engine_pid()
            except (OSError, IndexError, ValueError):
                engine = None
            self.proc.kill()
            self.proc.wait()
            if engine:
                try:
                    os.kill(engine, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.stderr:
            self.proc.stderr.close()


def _state(node):
    """A node's exit code and last words, or what its registry says of every session."""
    if node.proc.poll() is not None:
        return {"exited": node.proc.returncode, "stderr": node.proc.stderr.read()[-600:].decode(errors="replace")}
    try:
        return {s["session"][:8]: (s["state"], s.get("suspected")) for s in node.view()["sessions"]}
    except (OSError, ValueError, KeyError) as exc:
        return {"view": repr(exc)}


@pytest.fixture
def cluster(tmp_path):
    """start(n, engine_flags) -> [NodeProc]; every process is killed at the end."""
    key_file = on.keygen(str(tmp_path / "keys"))[0]
    nodes = []

    def start(n, flags=None, node_flags=None):
        flags, node_flags = flags or {}, node_flags or {}
        for i in range(n):
            boot = nodes[0].gossip if nodes else None
            nodes.append(NodeProc(key_file, boot, flags.get(i, ""), node_flags.get(i, ())))
        for node in nodes:
            try:
                wait_for(lambda node=node: len([s for s in node.view()["sessions"] if s["state"] == "SERVING"]) == n,
                         20, f"{n} SERVING sessions at {node.listen}")
            except AssertionError as exc:   # say what each node was doing (a rare failure under load)
                raise AssertionError(f"{exc}; the nodes: {[_state(other) for other in nodes]}") from None
        return nodes

    start.key = on.load_key(key_file)
    start.key_file = key_file
    try:
        yield start
    finally:
        for node in nodes:
            node.stop()


def test_three_nodes_wrapping_engines_reach_serving_everywhere(cluster):
    nodes = cluster(3)
    ids = {n.session for n in nodes}
    for node in nodes:
        sessions = node.sessions()
        assert set(sessions) == ids
        for s in sessions.values():
            assert (s["state"], s["models"], s["role"], s["suspected"]) == ("SERVING", ["fake-model"], "worker", False)
            assert s["hardware"]["count"] >= 1 and s["addr"].startswith("127.0.0.1:")


def test_engine_killed_9_makes_its_session_down_everywhere_and_the_node_exit_nonzero(cluster):
    nodes = cluster(3)
    victim = nodes[2]
    os.kill(victim.engine_pid(), signal.SIGKILL)
    assert victim.proc.wait(timeout=15) == on.EXIT_ENGINE_FAILED
    for node in nodes[:2]:
        wait_for(lambda node=node: node.sessions()[victim.session]["state"] in ("DOWN", "LEFT"), 10,
                 "DOWN at peers")
    # DOWN was written by its owner, not inferred: it carries no evicted_by
    assert "evicted_by" not in nodes[0].sessions()[victim.session] or \
        nodes[0].sessions()[victim.session]["state"] == "LEFT"


def test_engine_failure_with_restart_rejoins_as_a_new_session_and_the_old_one_leaves(cluster):
    nodes = cluster(2, node_flags={1: ["--restart"]})
    victim = nodes[1]
    old = victim.session
    os.kill(victim.engine_pid(), signal.SIGKILL)
    new = wait_for(lambda: victim.view()["self"] != old and victim.view()["self"], 15, "new session")
    wait_for(lambda: nodes[0].sessions()[new]["state"] == "SERVING", 15, "new session SERVING at peer")
    assert nodes[0].sessions()[old]["state"] in ("DOWN", "LEFT")
    wait_for(lambda: nodes[0].sessions()[old]["state"] == "LEFT", 5, "old session LEFT")
    assert victim.proc.poll() is None


def test_node_killed_9_is_suspected_then_left_and_its_engine_dies_with_it(cluster):
    nodes = cluster(3)
    victim = nodes[2]
    engine = victim.engine_pid()
    victim.proc.kill()
    victim.proc.wait()
    killed = time.time()
    wait_for(lambda: not os.path.exists(f"/proc/{engine}") or
             open(f"/proc/{engine}/stat").read().split()[2] == "Z", 5, "engine gone")
    for node in nodes[:2]:
        wait_for(lambda node=node: node.sessions()[victim.session]["suspected"] or
                 node.sessions()[victim.session]["state"] == "LEFT", 10, "suspected")
    for node in nodes[:2]:
        record = wait_for(lambda node=node: node.sessions()[victim.session]["state"] == "LEFT" and
                          node.sessions()[victim.session], 20, "LEFT")
        assert record["evicted_by"] in {nodes[0].session, nodes[1].session}
        assert record["left_at"] >= killed - 1 and record["suspected"] is False


def test_sigterm_drains_in_flight_request_then_leaves_and_exits_0(cluster):
    nodes = cluster(3, {2: "--mode slow --slow-delay 1.5"})
    victim = nodes[2]
    tls = tunnel_context(cluster.key_file)
    result = {}

    def slow_request():
        req = urllib.request.Request(f"https://{victim.listen}/v1/completions", data=b'{"prompt":"a b c"}',
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10, context=tls) as resp:
            result["status"] = resp.status
            result["body"] = json.loads(resp.read())

    thread = threading.Thread(target=slow_request)
    thread.start()
    time.sleep(0.5)
    victim.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: nodes[0].sessions()[victim.session]["state"] == "DOWN", 5, "DOWN while draining")
    req = urllib.request.Request(f"https://{victim.listen}/v1/completions", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=5, context=tls)
    assert refused.value.code == 503
    thread.join(10)
    assert result["status"] == 200 and result["body"]["usage"]["prompt_tokens"] == 3
    assert victim.proc.wait(timeout=15) == 0
    for node in nodes[:2]:
        record = wait_for(lambda node=node: node.sessions()[victim.session]["state"] == "LEFT" and
                          node.sessions()[victim.session], 5, "LEFT")
        assert "evicted_by" not in record           # it left by itself, not evicted


@pytest.mark.slow
def kernel_drops(port: int) -> int:
    """Datagrams the kernel dropped for the UDP sockets bound to `port` (a full receive queue),
    from /proc/net/udp; 0 where it cannot be read."""
    total = 0
    try:
        with open("/proc/net/udp") as f:
            next(f)
            for line in f:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port:
                    total += int(cols[-1])
    except (OSError, ValueError, IndexError, StopIteration):
        return 0
    return total


def test_random_bytes_and_mutated_packets_at_the_gossip_port_leave_node_and_registry_unchanged(cluster):
    nodes = cluster(2)
    target = nodes[1]
    host, port = on.split_addr(target.gossip)
    before = {sid: (s["state"], s["version"]) for sid, s in target.sessions().items()}
    wire = on.Wire(cluster.key, on.Config(key=cluster.key))
    rng = random.Random(7)
    valid = [wire.seal(m, time.time()) for m in (
        {"t": "r", "r": {"evil": {"owner": "x", "state": 3, "version": 9, "started": 0, "left_at": 0}}},
        {"t": "p", "n": 1, "to": target.session[:8]}, {"t": "d", "d": {"n": 1, "root": "00"}})]
    nonsense = ({"t": "r", "r": [1, 2]}, {"t": "st", "r": {"x": {"owner": 1}}}, {"t": "i", "n": "x"}, {"t": "d"})
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sent = 0
    end = time.monotonic() + FUZZ_SECONDS
    try:
        while time.monotonic() < end:
            kind = sent % 4
            if kind == 0:
                data = os.urandom(rng.randint(0, 9000))
            elif kind == 1:                          # a valid packet with one byte flipped
                data = bytearray(rng.choice(valid))
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                data = bytes(data)
            elif kind == 2:                          # truncated valid packet
                packet = rng.choice(valid)
                data = packet[: rng.randrange(len(packet))]
            else:                                    # exact replay of a packet already accepted
                data = rng.choice(valid[1:])
            try:
                sock.sendto(data, (host, port))
            except OSError:
                pass
            sent += 1
            if sent % 200 == 0:
                time.sleep(0.02)                     # ~10,000 packets/s at most: bounded load
        time.sleep(1.0)   # the flood's queue drains first: a full socket queue drops what follows
        for message in nonsense:   # authentic, and sealed now: a seal older than the window is stale
            sock.sendto(wire.seal(message, time.time()), (host, port))
            time.sleep(0.01)
        with socket.create_connection((host, port), timeout=2) as tcp:   # garbage TCP frames too
            tcp.sendall(b"\xff\xff\xff\xff" + os.urandom(100))
    finally:
        sock.close()
    time.sleep(1.0)
    assert target.proc.poll() is None
    after = {sid: (s["state"], s["version"]) for sid, s in target.sessions().items()}
    assert after == before and "evil" not in after
    health = get_json(f"http://{target.listen}/healthz")
    assert health["status"] == "ok"
    dropped = health["gossip"]["dropped"]
    # what the node never read (its socket's queue overflowed: the kernel's drops) it cannot count
    assert dropped["forged"] + dropped["truncated"] + dropped["oversized"] + kernel_drops(port) > sent // 2
    assert dropped["replayed"] > 0 and health["gossip"]["malformed"] >= 3


@pytest.mark.engine
def test_node_wrapping_the_real_engine_serves_its_model_through_the_tunnel(real_engine, tmp_path):
    key_file = on.keygen(str(tmp_path / "keys"))[0]
    node = NodeProc(key_file, engine_cmd=real_engine.cmd)
    try:
        me = wait_for(lambda: node.sessions()[node.session]["state"] == "SERVING" and node.sessions()[node.session],
                      180, "real engine SERVING")
        assert me["models"] == [real_engine.model]
        body = json.dumps({"model": real_engine.model, "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Say hi"}]}).encode()
        req = urllib.request.Request(f"https://{node.listen}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120, context=tunnel_context(key_file)) as resp:
            answer = json.loads(resp.read())
        assert resp.status == 200 and answer["usage"]["completion_tokens"] >= 1
        assert answer["choices"][0]["message"]["role"] == "assistant"
    finally:
        node.stop()
