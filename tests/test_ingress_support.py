"""Harness for the ingress tests and benchmark (no tests here).

`Stack` runs an Ingress in a background event loop with fake engines (tests/fake_engine.py)
and a stand-in for the overlay node whose registry the test writes directly, so the HTTP,
routing, retry and ledger behaviour can be tested without gossip. The tests that need the
real overlay use otela_node itself.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import sqlite3
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from fake_engine import free_port, start_fake_engine

import crdt
import otela_ingress


class StandInNode:
    """What the ingress needs of otela_node.Node: a registry, suspicion, a tunnel header."""

    tunnel_header = ("x-otela-tunnel", "stand-in")
    whole_registry = True   # every record is here from the start: the ingress needs no warm-up

    def __init__(self):
        self.session_id = crdt.new_session_id()
        self.registry = crdt.GMap()
        self.suspected: set = set()
        self._callbacks: list = []
        self._versions: Dict[str, int] = {}

    def is_suspected(self, sid: str) -> bool:
        return sid in self.suspected

    def on_change(self, callback) -> None:
        self._callbacks.append(callback)

    def registry_view(self) -> Dict[str, Any]:
        return {"self": self.session_id,
                "sessions": {sid: dict(r, suspected=sid in self.suspected) for sid, r in self.registry.items()},
                "suspected": sorted(self.suspected)}

    def publish(self, entry_id: str, record: Dict[str, Any]) -> None:
        """A key record, usage slot, limit or flow the ingress writes: told back at once, as the
        overlay tells a change."""
        if self.registry.put(entry_id, record):
            self._changed(entry_id)

    def adopt(self, entries: List[Tuple[str, Dict[str, Any]]]) -> None:
        """The ingress plane's entries kept in its --db, taken back (a malformed one skipped)."""
        for entry_id, record in entries:
            try:
                self.publish(entry_id, record)
            except crdt.RecordError:
                pass

    def _changed(self, sid: str) -> None:
        for callback in self._callbacks:
            callback(sid, self.registry.get(sid))

    def add_worker(self, addr: str, models: List[str], labels: Optional[Dict[str, str]] = None,
                   owner: str = "alice@gpu1", hardware: Optional[Dict[str, Any]] = None,
                   capacity: Optional[float] = None, state: int = crdt.SERVING) -> str:
        sid = crdt.new_session_id()
        record = {"owner": owner, "state": state, "version": 1, "started": time.time(), "role": "worker",
                  "addr": addr, "models": models, "labels": labels or {},
                  "hardware": hardware or {"gpu": "CPU", "count": 1, "memory_gb": 8}}
        if capacity is not None:
            record["capacity"] = capacity
        self._versions[sid] = 1
        self.registry.put(sid, record)
        self._changed(sid)
        return sid

    def set_state(self, sid: str, state: int) -> None:
        record = self.registry.get(sid)
        self._versions[sid] += 1
        record.update(state=state, version=self._versions[sid])
        if state >= crdt.DOWN:
            record["left_at"] = time.time()
        self.registry.put(sid, record)
        self._changed(sid)

    def suspect(self, sid: str, on: bool = True) -> None:
        (self.suspected.add if on else self.suspected.discard)(sid)
        self._changed(sid)


class Stack:
    """An ingress on a free loopback port, with fake engines, in a background loop."""

    def __init__(self, db_path: str, uvloop: bool = False, node: Optional[StandInNode] = None, **ingress_opts):
        """`uvloop`: run on uvloop's event loop (as `serve` does where it is installed); `node`:
        the stand-in node (a new one by default); `ingress_opts`: otela_ingress.Ingress's."""
        if uvloop:
            import uvloop as _uvloop
            self.loop = _uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node = node or StandInNode()
        self.db_path = db_path
        self.engines: Dict[str, Any] = {}
        self.ingress = otela_ingress.Ingress(self.node, db_path=db_path, **ingress_opts)
        self.port = self.run(self.ingress.start("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args, **kwargs):
        async def wrapper():
            return fn(*args, **kwargs)
        return self.run(wrapper())

    def engine(self, model: str = "m1", labels: Optional[Dict[str, str]] = None, owner: str = "alice@gpu1",
               register: bool = True, **opts) -> Tuple[str, Any]:
        """Start a fake engine and register it as a SERVING worker; returns (session id, engine)."""
        hardware = opts.pop("hardware", None)
        port = free_port()
        engine = self.run(start_fake_engine(port, model=model, **opts))
        sid = self.call(self.node.add_worker, f"127.0.0.1:{port}", [model], labels, owner,
                        hardware) if register else ""
        self.engines[sid or str(port)] = engine
        return sid, engine

    def inflight_settled(self, timeout: float = 5.0) -> int:
        """The in-flight count once it stops falling: a request's bookkeeping ends just after its
        client has the answer, so a test that reads the count at once can look too early."""
        deadline = time.monotonic() + timeout
        while self.call(lambda: self.ingress.metrics.inflight) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.call(lambda: self.ingress.metrics.inflight)

    def key(self, user: str = "alice", allow=(), admin: bool = False, rate: float = 0.0) -> str:
        db = otela_ingress.open_db(self.db_path)
        try:
            _, token = otela_ingress.create_key(db, user, list(allow), admin, rate)
            records = otela_ingress.load_key_records(db)
        finally:
            db.close()
        self.call(self.ingress.cluster.read_records, records)
        return token

    def sql(self, query: str, *args) -> list:
        """Query the ledger database once every completed request has reached it. A row is queued
        for SQLite just after the client's last byte, in the same callback on the loop: a turn
        of the loop first, so a request this thread has its answer to is queued before the flush."""
        self.run(asyncio.sleep(0))
        self.ingress.ledger.flush()
        db = sqlite3.connect(self.db_path, timeout=10)
        try:
            return db.execute(query, args).fetchall()
        finally:
            db.close()

    def close(self) -> None:
        try:
            for engine in self.engines.values():
                self.run(engine.close())
            self.run(self.ingress.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def read_to_close(sock: socket.socket, deadline_s: float = 10.0) -> Tuple[bytes, bool]:
    """Everything the ingress sends until it closes (True), or what came before the deadline
    (False: still open)."""
    sock.settimeout(0.2)
    data = b""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, True
        if not piece:
            return data, True
        data += piece
    return data, False


class Client:
    """A keep-alive HTTP/1.1 client (http.client) with the OpenAI body conventions."""

    def __init__(self, url: str, key: Optional[str] = None, timeout: float = 30.0,
                 source: Optional[str] = None):
        """`source`: the local address to connect from (any of 127.0.0.0/8 works on Linux)."""
        host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout,
                                               source_address=(source, 0) if source else None)
        self.key = key

    def request(self, method: str, path: str, body: Any = None, headers: Optional[Dict[str, str]] = None,
                key: Optional[str] = None) -> Tuple[int, Dict[str, str], bytes]:
        hdrs = {"content-type": "application/json"}
        key = key if key is not None else self.key
        if key:
            hdrs["authorization"] = f"Bearer {key}"
        hdrs.update(headers or {})
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        self.conn.request(method, path, body=body, headers=hdrs)
        resp = self.conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data

    def chat(self, model: str = "m1", content: str = "hello there", **extra) -> Tuple[int, Dict[str, str], bytes]:
        headers = extra.pop("headers", None)
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        return self.request("POST", "/v1/chat/completions", body, headers=headers)

    def close(self) -> None:
        self.conn.close()


def sse_events(body: bytes) -> List[str]:
    """The data fields of an SSE body, in order."""
    return [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]


class Cluster:
    """A real local overlay from the command lines: `otela_ingress.py serve` and
    `otela_node.py start` processes on loopback, with a fresh cluster key and key database."""

    def __init__(self, tmp_dir: str, policy: str = "least_loaded", ingress_root: Optional[str] = None,
                 ingress_flags: Tuple[str, ...] = ()):
        """`ingress_root`: a folder holding another release's files to run the ingress from."""
        import os
        import subprocess
        import sys
        self.tmp = tmp_dir
        self.root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        ingress_root = ingress_root or self.root
        self.python = sys.executable
        self.procs: list = []
        self.nodes: Dict[str, Any] = {}
        self.orphans: List[int] = []   # engines whose node was killed with SIGKILL
        subprocess.run([self.python, os.path.join(ingress_root, "otela_node.py"), "keygen", "--out", tmp_dir],
                       check=True, capture_output=True, timeout=60)
        self.key_file = os.path.join(tmp_dir, "cluster.key")
        self.db = os.path.join(tmp_dir, "otela.sqlite")
        made = subprocess.run([self.python, os.path.join(ingress_root, "otela_ingress.py"), "keys", "create",
                               "--user", "tester", "--admin", "--db", self.db],
                              check=True, capture_output=True, text=True, timeout=60)
        self.token = made.stdout.strip()
        self.port, self.gossip = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ingress = self._spawn("ingress", [os.path.join(ingress_root, "otela_ingress.py"), "serve",
                                               "--key-file", self.key_file, "--listen", f"127.0.0.1:{self.port}",
                                               "--gossip", f"127.0.0.1:{self.gossip}", "--db", self.db,
                                               "--policy", policy, *ingress_flags])
        self._started(lambda: self._wait(lambda: Client(self.url).request("GET", "/healthz")[0] == 200,
                                         "ingress /healthz"))

    def _started(self, step) -> None:
        """Run a step of the start; when it fails, what was started is stopped before the error
        goes on (a fixture whose setup raises never reaches its own cleanup)."""
        try:
            step()
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, argv: List[str]):
        import subprocess
        log = open(f"{self.tmp}/{name}.log", "wb")
        proc = subprocess.Popen([self.python, *argv], stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        log.close()
        self.procs.append(proc)
        return proc

    def _wait(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{what} not ready within {timeout} s (logs in {self.tmp})")

    def node(self, name: str, process: str, engine_port: int, model: str, labels=(), timeout: float = 120.0,
             root: Optional[str] = None, granted: bool = True):
        """Start `otela_node.py start` wrapping `process`; wait until the ingress routes `model`.
        `root`: a folder holding another release's files to run the node from."""
        import os
        argv = [os.path.join(root or self.root, "otela_node.py"), "start", "--key-file", self.key_file,
                "--bootstrap", f"127.0.0.1:{self.gossip}", "--listen", f"127.0.0.1:{free_port()}",
                "--gossip", f"127.0.0.1:{free_port()}", "--process", process,
                "--engine-url", f"http://127.0.0.1:{engine_port}"]
        for label in labels:
            argv += ["--label", label]
        if root is None and granted:   # (a node of a release before grants takes none)
            argv += self.grant(name, [model], labels)
        before = self.serving(model)
        self.nodes[name] = self._spawn(name, argv)
        self._wait(lambda: self.serving(model) > before, f"node {name} serving {model}", timeout)
        return self.nodes[name]

    def grant(self, name: str, models: List[str], labels=()) -> List[str]:
        """The flags that give the job `name` its grant from the login node (`otela_ingress.py
        grant`'s file): [] where the cluster has no ingress secret."""
        import os
        secrets_ = otela_ingress.ingress_secrets(None, self.key_file)
        if not secrets_:
            return []
        grant = os.path.join(self.tmp, f"{name}.grant")
        with open(os.open(grant, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
            fh.write(otela_ingress.grant_file(crdt.Authority(secrets_), models, dict(
                label.split("=", 1) for label in labels), name, time.time() + 3600, time.time(), self.key_file))
        return ["--grant-file", grant]

    def serving(self, model: str) -> int:
        client = Client(self.url)
        try:
            view = json.loads(client.request("GET", "/v1/registry")[2])
        finally:
            client.close()
        return sum(1 for s in view["sessions"] if s["state"] == "SERVING" and model in s.get("models", [])
                   and not s.get("suspected"))

    def close(self) -> None:
        import signal
        for pid in self.orphans:
            kill_pid(pid)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except Exception:
                proc.kill()
                proc.wait()


def child_pids(parents, marker: bytes) -> List[int]:
    """Processes whose parent is one of `parents` and whose command line holds `marker` (the
    engines that nodes started)."""
    import os
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid in parents and marker in argv:
            found.append(int(entry))
    return found


def pids_listening_on(port: int) -> List[int]:
    """Processes (of ours) whose command line carries `--port PORT`: the fake engines we started."""
    import os
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"fake_engine.py" in b" ".join(argv) and b"--port" in argv:
            i = argv.index(b"--port")
            if i + 1 < len(argv) and argv[i + 1] == str(port).encode():
                found.append(int(entry))
    return found


def kill_pid(pid: int) -> None:
    import os
    import signal
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Collector:
    """An OTLP/HTTP collector on loopback: `hang` accepts and never answers; `keep`: what it was
    sent is in `documents` (else it is read and let go, as a benchmark's collector)."""

    def __init__(self, hang: bool = False, keep: bool = True):
        import http.server
        self.documents: list = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                if keep:
                    owner.documents.append((self.path, json.loads(body)))
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        if hang:
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(64)   # connections wait in the backlog: never read, never answered
            self.port = self.sock.getsockname()[1]
            self.server = None
        else:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            self.port = self.server.server_address[1]
            threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        else:
            self.sock.close()


class RecordingTransport:
    """A transport with no socket for driving the ingress's protocol callbacks in process: it
    keeps what is written to it (taken() returns and clears it)."""

    def __init__(self):
        self.out, self.closing = [], False

    def write(self, data):
        self.out.append(data)

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 5555) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def is_closing(self):
        return self.closing

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def abort(self):
        self.closing = True

    close = abort

    def can_write_eof(self):
        return True

    def write_eof(self):
        pass

    def taken(self) -> bytes:
        data, self.out = b"".join(self.out), []
        return data


def key_with_settings(stack, user: str = "alice", admin: bool = False, queueing=None, **limits) -> str:
    """A new key of `user` with its settings (limits: rpm, tpm, concurrency; `queueing`: weight,
    priority, priorities), made as `keys create` makes it (SQLite) and read by the running ingress."""
    db = otela_ingress.open_db(stack.db_path)
    try:
        token, digest, record = otela_ingress.new_key(user, admin=admin)
        otela_ingress.store_limit(db, "k", digest, dict(dict.fromkeys(crdt.LIMIT_FIELDS, 0), **limits), time.time(),
                                  queueing)
        otela_ingress.store_key_record(db, digest, record)
        records, settings = otela_ingress.load_key_records(db), otela_ingress.load_key_settings(db)
    finally:
        db.close()
    stack.call(stack.ingress.cluster.read_settings, settings)
    stack.call(stack.ingress.cluster.read_records, records)
    return token
