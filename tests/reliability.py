"""tests/reliability.py: `make reliability`, how the overlay and the ingress live through faults.

Each scenario starts real processes (`otela_ingress.py serve`, `otela_node.py start` wrapping
tests/fake_engine.py), sends a bounded load through the ingress, does one kind of harm, and
measures what the clients saw and how long the overlay took to heal. The rows make ONE table,
printed, and written as JSON to bench-results/reliability.json.

    scenario       what was run
    load           what the clients sent meanwhile (a bounded rate, or a number of streams)
    faults         what was done, with the timings used (OTELA_* variables)
    client errors  requests answered with anything but 200 within the window the row names
    stale routes   requests the ingress sent to a session that could not answer them then:
                   retried elsewhere (the ledger's attempts beyond each request's first), or
                   held until the fault ended (answered later than SLOW_S)
    time to heal   seconds from the end of the harm until the overlay serves as before
    data lost      requests answered 200 whose usage row is missing from the ledger

Adding a scenario: a function `(args) -> dict` with the COLUMNS keys (values as the table
shows them; numbers under "detail" for the JSON), appended to SCENARIOS. tests/reliability_sim.py,
when it exists, adds the simulator's rows through `rows(quick: bool) -> list[dict]`.

What this file must never do: send traffic anywhere but loopback and the network namespaces
it makes itself (tests/netns.py); leave a process, namespace or temporary file behind, even
when a scenario fails or is interrupted; assert on time (it measures and reports).
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Tuple

import netns
from netns import LOOPBACK, Place

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
MODEL = "fm"
COLUMNS = ("scenario", "load", "faults", "client_errors", "stale_routes", "time_to_heal", "data_lost")
HEADINGS = ("scenario", "load", "faults", "client errors", "stale routes", "time to heal", "data lost")

# Shorter failure-detector timings for --quick (the defaults are for real clusters): a member
# is suspected ~0.5 s after it goes silent and evicted 0.9-5.4 s later (grace = 3 x 0.3 s,
# times up to 6 for a lone suspector).
QUICK_TIMINGS = {"OTELA_PROBE_INTERVAL": "0.3", "OTELA_PROBE_TIMEOUT": "0.1", "OTELA_INDIRECT_TIMEOUT": "0.1",
                 "OTELA_SUSPICION_MULT": "3", "OTELA_PUSH_PULL_INTERVAL": "1"}


# =============================================================================================
# Waiting: poll a state with a deadline, never a bare sleep
# =============================================================================================
def until(predicate: Callable[[], Any], timeout: float, every: float = 0.2) -> Optional[float]:
    """Poll `predicate` until it is true: the monotonic time it was, or None after `timeout`.
    A predicate that raises OSError or ValueError (nothing listening yet, a half answer) is false."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return time.monotonic()
        except (OSError, ValueError, KeyError, http.client.HTTPException):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(every)


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> float:
    """`until`, or TimeoutError naming `what`."""
    reached = until(predicate, timeout)
    if reached is None:
        raise TimeoutError(f"{what}: not within {timeout:g} s")
    return reached


def get_json(url: str, timeout: float = 3.0) -> Tuple[int, Any]:
    """(status, parsed body) of a GET; an error status is an answer too, not an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, None


# =============================================================================================
# Fleet: the processes of one scenario, each in its Place, all stopped at the end
# =============================================================================================
class Member:
    """One `otela_ingress.py serve` or `otela_node.py start` process and its addresses."""

    def __init__(self, name: str, role: str, place: Place, argv: List[str], listen: str, gossip: str):
        self.name, self.role, self.place, self.argv = name, role, place, argv
        self.listen, self.gossip = listen, gossip
        self.url = f"http://{listen}"
        self.proc: Optional[subprocess.Popen] = None
        self.old: List[subprocess.Popen] = []   # earlier processes of this member (restarts)
        self.engines: List[int] = []            # engine pids seen, killed at the end too


class Fleet:
    """A cluster key, a key database with one admin key, and the members started from them.
    `close()` (or leaving the `with`) stops every process it started, engines included."""

    def __init__(self, tmp: str, timings: Optional[Dict[str, str]] = None):
        self.tmp = tmp
        self.timings = dict(timings or {})
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OTELA_")}
        self.env.update(self.timings, PYTHONUNBUFFERED="1")
        self.members: List[Member] = []
        self.starts: Dict[str, int] = {}
        keys = os.path.join(tmp, "keys")
        subprocess.run([PY, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", keys], env=self.env,
                       check=True, capture_output=True, timeout=60)
        self.key_file = os.path.join(keys, "cluster.key")
        self.db = os.path.join(tmp, "otela.sqlite")
        made = subprocess.run([PY, os.path.join(ROOT, "otela_ingress.py"), "keys", "create", "--user", "tester",
                               "--admin", "--db", self.db], env=self.env, check=True, capture_output=True,
                              text=True, timeout=60)
        self.token = made.stdout.strip()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, failed, *exc) -> None:
        self.close(grace=15.0 if failed is None else 2.0)   # interrupted: no waiting on drains

    # -- starting ----------------------------------------------------------------------------
    def ingress(self, place: Place = LOOPBACK, policy: str = "least_loaded", name: str = "ingress",
                bootstrap: Tuple[str, ...] = (), db: Optional[str] = None, flags: Tuple[str, ...] = ()) -> Member:
        """`otela_ingress.py serve` (without --bootstrap: the README's set-up; a second ingress
        bootstraps to the first and keeps its own `db`), with `flags` more; waits for /healthz."""
        listen = f"{place.host}:{place.port(8080)}"
        gossip = f"{place.host}:{place.port(7946)}"
        argv = [PY, os.path.join(ROOT, "otela_ingress.py"), "serve", "--key-file", self.key_file,
                "--listen", listen, "--gossip", gossip, "--db", db or self.db, "--policy", policy]
        for addr in bootstrap:
            argv += ["--bootstrap", addr]
        member = Member(name, "ingress", place, argv + list(flags), listen, gossip)
        self.members.append(member)
        self.start(member)
        wait(lambda: self.up() and self.get(member, "/healthz")[0] == 200, 60, f"{name} /healthz")
        return member

    def grant(self, name: str, models: Tuple[str, ...] = (MODEL,), *flags: str) -> str:
        """A grant for the job `name` (the login node's `otela_ingress.py grant`): its file's path."""
        path = os.path.join(self.tmp, f"{name}.grant")
        subprocess.run([PY, os.path.join(ROOT, "otela_ingress.py"), "grant", "--key-file", self.key_file,
                        "--out", path, "--job", name, *[f"--model={m}" for m in models], *flags],
                       env=self.env, check=True, capture_output=True, timeout=60)
        return path

    def node(self, name: str, place: Place = LOOPBACK, bootstrap: Tuple[str, ...] = (),
             engine_flags: str = "", flags: Tuple[str, ...] = (), engine: Optional[str] = None,
             grant: Optional[str] = "") -> Member:
        """`otela_node.py start` wrapping the fake engine serving MODEL (or the `engine` command,
        with {port}), with a grant for MODEL (`grant`: another grant file, or None for none);
        does not wait."""
        listen = f"{place.host}:{place.port(7700)}"
        gossip = f"{place.host}:{place.port(7946)}"
        engine = engine or f"{PY} {os.path.join(ROOT, 'tests', 'fake_engine.py')} --model {MODEL} --port {{port}} {engine_flags}"
        argv = [PY, os.path.join(ROOT, "otela_node.py"), "start", "--key-file", self.key_file,
                "--listen", listen, "--gossip", gossip, "--process", engine.strip()]
        if grant is not None:
            argv += ["--grant-file", grant or self.grant(name)]
        for addr in bootstrap:
            argv += ["--bootstrap", addr]
        member = Member(name, "worker", place, argv + list(flags), listen, gossip)
        self.members.append(member)
        self.start(member)
        return member

    def start(self, member: Member) -> None:
        """Start (or start again, with the same flags) the member's process; its log is
        TMP/NAME.N.log."""
        if member.proc is not None:
            member.old.append(member.proc)
        self.starts[member.name] = n = self.starts.get(member.name, 0) + 1
        with open(os.path.join(self.tmp, f"{member.name}.{n}.log"), "wb") as log:
            member.proc = subprocess.Popen(member.place.argv(member.argv), stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=self.env, cwd=ROOT)

    # -- stopping ----------------------------------------------------------------------------
    def stop(self, member: Member, sig: int = signal.SIGTERM, grace: float = 20.0) -> Optional[int]:
        """Send `sig` and wait for the exit (SIGKILL after `grace`); the exit code."""
        proc = member.proc
        if proc is None:
            return None
        self.engine_pid(member)
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)

    def engine_pid(self, member: Member) -> Optional[int]:
        """The engine the node runs now (its child), remembered so that close() can kill it."""
        pid = member.proc.pid if member.proc else None
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                children = [int(c) for c in fh.read().split()]
        except (OSError, TypeError, ValueError):
            return None
        member.engines += [c for c in children if c not in member.engines]
        return children[0] if children else None

    def close(self, grace: float = 15.0) -> None:
        """SIGTERM to every process still running, SIGKILL to those still there after `grace`."""
        for member in reversed(self.members):
            if member.proc is not None and member.proc.poll() is None:
                self.engine_pid(member)
                member.proc.terminate()
        deadline = time.monotonic() + grace
        for member in reversed(self.members):
            for proc in member.old + ([member.proc] if member.proc else []):
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            for pid in member.engines:       # dies with its node (PR_SET_PDEATHSIG); in case not
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    # -- looking -----------------------------------------------------------------------------
    def up(self) -> bool:
        """True; RuntimeError naming a member whose process exited (a wait for the cluster to come
        up then fails at once, with the reason, instead of at its deadline)."""
        for member in self.members:
            code = member.proc.poll() if member.proc else None
            if code is not None:
                last = (self.log(member).strip().splitlines() or ["(empty log)"])[-1]
                raise RuntimeError(f"{member.name} exited with {code}: {last}")
        return True

    def log(self, member: Member) -> str:
        """What the member's current process has written (stdout and stderr)."""
        with open(os.path.join(self.tmp, f"{member.name}.{self.starts[member.name]}.log"), "rb") as fh:
            return fh.read().decode("utf-8", "replace")

    def get(self, member: Member, path: str) -> Tuple[int, Any]:
        """GET a member's HTTP path (its --listen), from inside its place."""
        return member.place.call(get_json, member.url + path)

    def registry(self, member: Member) -> Dict[str, Any]:
        status, view = self.get(member, "/v1/registry")
        if status != 200 or not isinstance(view, dict):
            raise ValueError(f"{member.name} /v1/registry answered {status}")
        return view

    def serving(self, ingress: Member) -> set:
        """Worker sessions the ingress can route to: SERVING and not suspected."""
        return {s["session"] for s in self.registry(ingress)["sessions"]
                if s.get("role") == "worker" and s["state"] == "SERVING" and not s.get("suspected")}


def live(view: Dict[str, Any]) -> set:
    """The sessions a registry view holds live: SERVING and not suspected."""
    return {s["session"] for s in view["sessions"] if s["state"] == "SERVING" and not s.get("suspected")}


def agreed(fleet: Fleet, members: List[Member]) -> bool:
    """Every member's registry shows the same live sessions: exactly one per member, its own."""
    views = [fleet.registry(m) for m in members]
    selves = {v["self"] for v in views}
    return len(selves) == len(members) and all(live(v) == selves for v in views)


# =============================================================================================
# Load: chat completions through the ingress at a bounded rate, every outcome kept
# =============================================================================================
OK, REFUSED = "ok", "refused"
STREAM_GAP_S = 0.25                 # a stream thread's pause between streams: no spin on fast errors
SLOW_S = 5.0                        # an answer later than this is counted as slow in the details
CUT_WITH_ERROR, CUT_SILENT = "cut, error event", "cut, no error event"


def chat(conn: http.client.HTTPConnection, token: str, stream: bool) -> Tuple[str, str]:
    """One chat completion on `conn`: (outcome, serving session). Outcomes: OK; "http N" (no
    answer begun: for a stream, an error before it started); CUT_WITH_ERROR (a stream ended by
    an error event, then [DONE]); CUT_SILENT (a 200 that ended any other way)."""
    body = json.dumps({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "one two"}]})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"content-type": "application/json", "authorization": f"Bearer {token}"})
    resp = conn.getresponse()
    session = resp.getheader("x-otela-session", "")
    try:
        data = resp.read()
    except (http.client.HTTPException, OSError):
        if resp.status == 200:
            return CUT_SILENT, session
        raise
    if resp.status != 200:
        return f"http {resp.status}", session
    if not stream:
        return (OK if json.loads(data).get("choices") else CUT_SILENT), session
    events = [line[6:] for line in data.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
    if len(events) >= 2 and events[-1] == "[DONE]":
        try:
            last = json.loads(events[-2])
        except ValueError:
            return CUT_SILENT, session
        if "error" in last:
            return CUT_WITH_ERROR, session
        if any(c.get("finish_reason") for c in last.get("choices", [])) or "usage" in last:
            return OK, session
    return CUT_SILENT, session


class Load:
    """Plain requests at `rate` per second from `senders` threads (each at rate/senders, so one
    request hanging on a cut link does not stop the others), and `streams` streams in flight
    (one thread each, the next soon after the last), all from inside `place`. Each outcome is a
    record (sent, done, kind, outcome, session); a thread's connection is replaced after a failure."""

    def __init__(self, place: Place, url: str, token: str, rate: float = 5.0, streams: int = 0,
                 senders: int = 5):
        self.place, self.token = place, token
        self.host, self.port = url.rsplit("/", 1)[-1].rsplit(":", 1)
        self.records: List[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: Dict[int, http.client.HTTPConnection] = {}   # each thread's, to cut on failure
        senders = senders if rate else 0
        self._threads = [threading.Thread(target=self._run, args=(False, senders / rate, i / rate), daemon=True)
                         for i in range(senders)]
        self._threads += [threading.Thread(target=self._run, args=(True, STREAM_GAP_S, i * STREAM_GAP_S),
                                           daemon=True) for i in range(streams)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, failed, *exc) -> None:
        """Let the requests in flight finish (they are counted), unless the scenario failed or
        was interrupted: then cut them, so that cleaning up does not wait on a hung request."""
        self._stop.set()
        if failed is not None:
            for conn in list(self._conns.values()):
                with contextlib.suppress(OSError, AttributeError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(40)

    def _run(self, stream: bool, gap: float, offset: float) -> None:
        self.place.enter()
        conn = None
        me = threading.get_ident()
        next_at = time.monotonic() + offset - gap
        while not self._stop.is_set():
            next_at = max(next_at + gap, time.monotonic())    # bounded: never a burst to catch up
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            if self._stop.is_set():
                break
            if conn is None:
                conn = self._conns[me] = http.client.HTTPConnection(self.host, int(self.port), timeout=30)
            sent = time.monotonic()
            try:
                outcome, session = chat(conn, self.token, stream)
            except ConnectionRefusedError:
                outcome, session = REFUSED, ""
            except (OSError, http.client.HTTPException, ValueError) as exc:
                outcome, session = f"error: {type(exc).__name__}", ""
            if outcome != OK:
                conn.close()
                conn = None
            self.add(sent, "stream" if stream else "plain", outcome, session)
        if conn is not None:
            conn.close()

    def add(self, sent: float, kind: str, outcome: str, session: str) -> None:
        with self._lock:
            self.records.append((sent, time.monotonic(), kind, outcome, session))

    def probe(self, n: int) -> set:
        """`n` plain requests one after the other, now: the sessions that answered them."""
        def run():
            conn = http.client.HTTPConnection(self.host, int(self.port), timeout=30)
            try:
                for _ in range(n):
                    sent = time.monotonic()
                    outcome, session = chat(conn, self.token, False)
                    self.add(sent, "probe", outcome, session)
                    served.add(session if outcome == OK else "")
            finally:
                conn.close()
        served: set = set()
        self.place.call(run)
        return served - {""}

    def select(self, kind: Optional[str] = None, since: float = 0.0, until: float = float("inf")) -> List[tuple]:
        with self._lock:
            return [r for r in self.records if (kind is None or r[2] == kind) and since <= r[0] < until]

    def answered_ok(self) -> int:
        return sum(1 for r in self.select() if r[3] == OK)

    def slow(self) -> int:
        """Requests answered, but later than SLOW_S: held on a session that could not answer."""
        return sum(1 for r in self.select() if r[2] != "stream" and r[1] - r[0] > SLOW_S)

    def outcomes(self) -> Dict[str, int]:
        """How many records of each kind ended each way, e.g. {"plain ok": 590, "stream http 503": 1},
        and how many plain answers took longer than SLOW_S ("plain slow")."""
        counts: Dict[str, int] = {}
        for r in self.select():
            counts[f"{r[2]} {r[3]}"] = counts.get(f"{r[2]} {r[3]}", 0) + 1
            if r[2] != "stream" and r[1] - r[0] > SLOW_S:
                counts[f"{r[2]} slow"] = counts.get(f"{r[2]} slow", 0) + 1
        return counts


def errors(records: List[tuple], refused_too: bool = False) -> int:
    """Records that did not end OK (a refused connection only when `refused_too`)."""
    return sum(1 for r in records if r[3] != OK and (refused_too or r[3] != REFUSED))


def read_ledger(db: str) -> Tuple[int, int]:
    """(rows with status 200, attempts beyond each request's first) from a stopped ingress's ledger."""
    conn = sqlite3.connect(db, timeout=10)
    try:
        ok, extra = conn.execute("SELECT COALESCE(SUM(status = 200), 0), "
                                 "COALESCE(SUM(MAX(COALESCE(attempts, 1), 1) - 1), 0) FROM requests").fetchone()
    finally:
        conn.close()
    return int(ok), int(extra)


# =============================================================================================
# Scenarios: each (args) -> one row
# =============================================================================================
@contextlib.contextmanager
def workdir(args: argparse.Namespace, name: str):
    """A temporary directory for one scenario's keys, ledger and logs (kept under --keep)."""
    if getattr(args, "keep", None):
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
        path = os.path.join(args.keep, f"{slug}-{int(time.time())}")
        os.makedirs(path, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="otela-reliability-") as path:
            yield path


def timings_text(timings: Dict[str, str]) -> str:
    if not timings:
        return "default timings"
    return ", ".join(f"{k[len('OTELA_'):].lower()} {v}" for k, v in sorted(timings.items()))


def row(scenario: str, load: str, faults: str, client_errors: Any = "-", stale_routes: Any = "-",
        time_to_heal: Any = "-", data_lost: Any = "-", **detail) -> Dict[str, Any]:
    out = dict(zip(COLUMNS, (scenario, load, faults, client_errors, stale_routes, time_to_heal, data_lost)))
    out["detail"] = detail
    return out


def partition(args: argparse.Namespace, nodes: int = 5) -> Dict[str, Any]:
    """One ingress and `nodes` nodes, each in a network namespace of its own on one bridge; the
    ingress with two nodes split from the other three for longer than the suspicion grace, then
    healed. Heals when every member's GET /v1/registry shows the same live sessions (one per
    member) and the ingress routes requests to every node."""
    quick = args.quick
    timings = dict(QUICK_TIMINGS) if quick else {}
    split_s = 12.0 if quick else 30.0
    heal_s = 45.0 if quick else 90.0
    near = (nodes + 1) // 2                       # the ingress's side, the ingress included
    name = f"partition {near}|{nodes + 1 - near}, heal"
    load_text = "5 chat/s (round robin)"
    faults = f"bridge split {split_s:g} s ({timings_text(timings)})"
    reason = netns.unavailable()
    if reason:
        return row(name, load_text, faults, time_to_heal=f"skipped: {reason}", skipped=reason)
    with workdir(args, name) as tmp, netns.Lab(nodes + 1) as lab, Fleet(tmp, timings) as fleet:
        ingress = fleet.ingress(lab.places[0], policy="round_robin")
        workers = [fleet.node(f"n{i}", lab.places[i], bootstrap=(ingress.gossip,)) for i in range(1, nodes + 1)]
        members = [ingress] + workers
        wait(lambda: fleet.up() and agreed(fleet, members), 90, "every member SERVING in every registry")
        with Load(lab.places[0], ingress.url, fleet.token, rate=5) as load:
            time.sleep(1.0)
            far = list(range(near, nodes + 1))
            lab.partition(far)
            cut_at = time.monotonic()
            time.sleep(split_s)
            far_sessions = {fleet.registry(m)["self"] for m in members[near:]}
            still_live_at_ingress = len(far_sessions & live(fleet.registry(ingress)))
            lab.heal()
            healed_at = time.monotonic()
            workers_routed: set = set()

            def healed() -> bool:
                if not agreed(fleet, members):
                    return False
                workers_routed.update(load.probe(2 * nodes))
                return {fleet.registry(w)["self"] for w in workers} <= workers_routed
            done = until(healed, heal_s, every=0.5)
            end = done or time.monotonic()
            time.sleep(1.0)
        during_split = load.select("plain", cut_at, healed_at)
        during_heal = load.select("plain", healed_at, end)
        fleet.stop(ingress)                       # SIGTERM: the ledger reaches SQLite
        ledger_ok, stale = read_ledger(fleet.db)
    lost = max(0, load.answered_ok() - ledger_ok)
    return row(name, load_text, faults, errors(during_heal, True), stale + load.slow(),
               round(done - healed_at, 1) if done else f"not healed in {heal_s:g} s", lost,
               healed=done is not None, heal_s=round(done - healed_at, 2) if done else None,
               errors_during_split=errors(during_split, True), requests_during_split=len(during_split),
               requests_during_heal=len(during_heal), far_live_at_ingress_before_heal=still_live_at_ingress,
               split_s=split_s, timings=timings, nodes=nodes, ledger_ok=ledger_ok, outcomes=load.outcomes())


def ingress_restart(args: argparse.Namespace, sig: int, nodes: int = 3, down_s: float = 9.0,
                    serve_s: Optional[float] = None) -> Dict[str, Any]:
    """The README's set-up: the ingress without --bootstrap, `nodes` nodes bootstrapping to its
    gossip address. Stop the ingress with `sig`, leave it down `down_s` seconds (after a kill -9,
    at least until every node noticed), start it again with the same flags. Heals at the first
    chat completion answered 200 after its start (the target: within 10 s, no flag added)."""
    kind = "SIGTERM" if sig == signal.SIGTERM else "kill -9"
    name = f"ingress restart, {kind}"
    serve_s = serve_s or (20.0 if args.quick else 30.0)
    load_text = f"5 chat/s, {nodes} nodes"
    faults = f"ingress {kind}, down {down_s:g} s, same flags (default timings)"
    with workdir(args, name) as tmp, Fleet(tmp) as fleet:
        ingress = fleet.ingress()
        for i in range(nodes):
            fleet.node(f"n{i}", bootstrap=(ingress.gossip,))
        wait(lambda: fleet.up() and len(fleet.serving(ingress)) == nodes, 90, f"{nodes} nodes serving at the ingress")
        workers = [m for m in fleet.members if m.role == "worker"]
        with Load(LOOPBACK, ingress.url, fleet.token, rate=5) as load:
            time.sleep(1.0)
            gone = fleet.registry(ingress)["self"]
            fleet.stop(ingress, sig)
            stopped_at = time.monotonic()
            noticed = until(lambda: all(noticed_gone(fleet.registry(w), gone) for w in workers), down_s + 30)
            time.sleep(max(0.0, stopped_at + down_s - time.monotonic()))
            fleet.start(ingress)
            started_at = time.monotonic()
            served = until(lambda: any(r[3] == OK for r in load.select("plain", started_at)), serve_s, every=0.1)
            end = served or time.monotonic()
            time.sleep(2.0)
        while_up = load.select("plain", started_at)
        fleet.stop(ingress)
        ledger_ok, stale = read_ledger(fleet.db)
    lost = max(0, load.answered_ok() - ledger_ok)
    return row(name, load_text, faults, errors(while_up), stale + load.slow(),
               round(served - started_at, 1) if served else f"no 200 in {serve_s:g} s", lost,
               served=served is not None, serving_after_s=round(served - started_at, 2) if served else None,
               nodes_noticed_after_s=round(noticed - stopped_at, 2) if noticed else None,
               errors_until_serving=errors(load.select("plain", started_at, end)), requests_while_up=len(while_up),
               # 503 + Retry-After while it has not heard from a node yet: the openai client retries those
               retryable_503s_while_up=sum(1 for r in while_up if r[3] == "http 503"),
               down_s=round(started_at - stopped_at, 2), ledger_ok=ledger_ok, outcomes=load.outcomes())


def noticed_gone(view: Dict[str, Any], session: str) -> bool:
    """A node's view has `session` suspected, or no longer live (DOWN, LEFT, or forgotten)."""
    record = next((s for s in view["sessions"] if s["session"] == session), None)
    return record is None or record["state"] != "SERVING" or bool(record.get("suspected"))


def restart_sigterm(args: argparse.Namespace) -> Dict[str, Any]:
    return ingress_restart(args, signal.SIGTERM)


def restart_kill9(args: argparse.Namespace) -> Dict[str, Any]:
    return ingress_restart(args, signal.SIGKILL)


def churn(args: argparse.Namespace, nodes: int = 8) -> Dict[str, Any]:
    """`nodes` nodes behind one ingress; every `interval` seconds a random node, or its engine,
    is killed with SIGKILL and a new node started in its place, under plain and streaming load.
    Heals (per kill) when the ingress routes to `nodes` live sessions again, the dead one not
    among them."""
    duration = args.churn_seconds or (60.0 if args.quick else 120.0)
    interval = args.churn_interval or (15.0 if args.quick else 20.0)
    rng = random.Random(args.seed)
    streams = 4
    name = f"churn, {nodes} nodes"
    load_text = f"5 chat/s + {streams} streams (2 s each) in flight"
    with workdir(args, name) as tmp, Fleet(tmp) as fleet:
        ingress = fleet.ingress()
        flags = "--chunks 20 --chunk-delay 0.1"
        running = [fleet.node(f"n{i}", bootstrap=(ingress.gossip,), engine_flags=flags) for i in range(nodes)]
        wait(lambda: fleet.up() and len(fleet.serving(ingress)) == nodes, 120, f"{nodes} nodes serving at the ingress")
        kills = {"node": 0, "engine": 0}
        heals: List[Optional[float]] = []
        with Load(LOOPBACK, ingress.url, fleet.token, rate=5, streams=streams) as load:
            began = time.monotonic()
            for k in range(1, int((duration - interval / 2) // interval) + 1):
                time.sleep(max(0.0, began + k * interval - time.monotonic()))
                victim = running.pop(rng.randrange(len(running)))
                session = fleet.registry(victim)["self"]
                what = rng.choice(("node", "engine"))
                target = victim.proc.pid if what == "node" else fleet.engine_pid(victim)
                if target is None:
                    what, target = "node", victim.proc.pid
                os.kill(target, signal.SIGKILL)
                killed_at = time.monotonic()
                kills[what] += 1
                running.append(fleet.node(f"n{nodes + k - 1}", bootstrap=(ingress.gossip,), engine_flags=flags))
                healed = until(lambda s=session: heal_of_churn(fleet.serving(ingress), s, nodes),
                               max(1.0, began + (k + 1) * interval - time.monotonic() - 1.0), every=0.25)
                heals.append(round(healed - killed_at, 2) if healed else None)
            time.sleep(max(0.0, began + duration - time.monotonic()))
        fleet.stop(ingress)
        ledger_ok, stale = read_ledger(fleet.db)
    plain, streamed = load.select("plain"), load.select("stream")
    unstarted = sum(1 for r in streamed if r[3].startswith(("http", "error", REFUSED)))
    cut = [r for r in streamed if r[3] in (CUT_WITH_ERROR, CUT_SILENT)]
    cut_ok = sum(1 for r in cut if r[3] == CUT_WITH_ERROR)
    healed = [h for h in heals if h is not None]
    heal_text = (f"max {max(healed):.1f} s, mean {sum(healed) / len(healed):.1f} s" if healed else "never")
    if len(healed) < len(heals):
        heal_text += f"; {len(heals) - len(healed)} of {len(heals)} not healed"
    errors_text = (f"{errors(plain, True)}/{len(plain)} plain, {unstarted}/{len(streamed)} unstarted streams; "
                   f"{len(cut)} cut, {cut_ok} by error event")
    faults = (f"kill -9 every {interval:g} s for {duration:g} s: {kills['node']} nodes, {kills['engine']} "
              "engines; each replaced (default timings)")
    return row(name, load_text, faults, errors_text, stale + load.slow(), heal_text,
               max(0, load.answered_ok() - ledger_ok),
               plain_errors=errors(plain, True), plain_requests=len(plain), streams=len(streamed),
               streams_failed_before_start=unstarted, streams_cut=len(cut), streams_cut_with_error_event=cut_ok,
               heal_s=heals, kills=kills, ledger_ok=ledger_ok, outcomes=load.outcomes())


def heal_of_churn(serving: set, dead: str, nodes: int) -> bool:
    return dead not in serving and len(serving) == nodes


def hostile(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The rows of tests/reliability_hostile.py: attackers and broken engines against real
    processes."""
    import reliability_hostile
    return reliability_hostile.rows(args)


def simulator(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The rows of tests/reliability_sim.py (the overlay simulated at scale), when it exists."""
    try:
        import reliability_sim
    except ModuleNotFoundError as exc:
        if exc.name == "reliability_sim":
            return []
        raise
    rows = []
    for found in reliability_sim.rows(args.quick):
        named = {k.replace(" ", "_").lower(): v for k, v in found.items()}
        if "time_to_heal" not in named and "time_to_heal_s" in named:   # seconds, or None: never
            seconds = named["time_to_heal_s"]
            named["time_to_heal"] = "never" if seconds is None else seconds
        detail = named.pop("detail", {})
        columns = {c: named.pop(c, "-") for c in COLUMNS}
        rows.append(dict(columns, detail=dict(detail, **named)))
    return rows


def nat(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The NAT lab (tests/natlab.py): the ingress on a public host, two nodes behind NATs (cone,
    symmetric, UDP blocked, a leaky gateway; a standalone relay killed with SIGKILL while in
    use), 5 plain chat/s through the ingress. A row per scenario; heals when both private nodes
    serve (seconds from their start)."""
    import natlab
    timings = dict(QUICK_TIMINGS) if args.quick else {}
    seconds = 6.0 if args.quick else 20.0
    reason = natlab.unavailable()
    rows = []
    for name, (_, kill) in natlab.SCENARIOS.items():
        load_text = "5 chat/s, 2 private nodes"
        faults = f"NAT lab: {name}" + (" (SIGKILL at 1 s)" if kill else "") + f" ({timings_text(timings)})"
        if reason:
            rows.append(row(f"nat: {name}", load_text, faults, time_to_heal=f"skipped: {reason}", skipped=reason))
            continue
        with workdir(args, f"nat {name}") as tmp:
            out = natlab.run(name, tmp, timings, seconds)
        reach = ", ".join(f"{k}: {v}" for k, v in sorted(out["reach_at_ingress"].items()))
        rows.append(row(f"nat: {name} ({reach}; a->b {out['a_reaches_b']})", load_text, faults,
                        out["plain_errors"], "-", out["serving_after_s"], "-",
                        **{k: v for k, v in out.items() if k != "scenario"}))
    return rows


def nat_private_ingress(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The NAT lab with a private ingress (host A) and a node behind NAT B: the ingress's tunnel
    to the node punched (TCP simultaneous open) on cone NATs, relayed on symmetric ones; 5 plain
    chat/s from host A. Heals when the node serves at the private ingress."""
    import natlab
    timings = dict(QUICK_TIMINGS) if args.quick else {}
    seconds = 6.0 if args.quick else 20.0
    reason = natlab.unavailable()
    rows = []
    for name in natlab.PRIVATE_INGRESS_SCENARIOS:
        load_text = "5 chat/s, private ingress, 1 private node"
        faults = f"NAT lab: {name} ({timings_text(timings)})"
        if reason:
            rows.append(row(f"nat: {name}", load_text, faults, time_to_heal=f"skipped: {reason}", skipped=reason))
            continue
        with workdir(args, f"nat {name}") as tmp:
            out = natlab.run_private_ingress(name, tmp, timings, seconds)
        rows.append(row(f"nat: {name} (tunnel {out['tunnel']})", load_text, faults, out["plain_errors"], "-",
                        out["serving_after_s"], "-", **{k: v for k, v in out.items() if k != "scenario"}))
    return rows


def nat_punched_cut(args: argparse.Namespace) -> Dict[str, Any]:
    """The NAT lab's private ingress on cone NATs, its tunnel to the node punched, under 5 plain
    chat/s and 2 streams; every TCP packet between the NATs dropped at gateway B for 8 s (the
    relay's path untouched), then restored. Heals when the tunnel is punched again (seconds from
    the restore); client errors count plain requests, streams cut by an error event apart."""
    import natlab
    timings = dict(QUICK_TIMINGS) if args.quick else {}
    name = "nat: punched tunnel cut"
    load_text = "5 chat/s + 2 streams (2 s each), private ingress, 1 private node"
    faults = (f"TCP between the NATs dropped for 8 s, then restored ({timings_text(dict(timings, **natlab.PUNCH_CUT_TIMINGS))})")
    reason = natlab.unavailable()
    if reason:
        return row(name, load_text, faults, time_to_heal=f"skipped: {reason}", skipped=reason)
    with workdir(args, name) as tmp:
        out = natlab.run_punched_cut(tmp, timings)
    errors_text = (f"{out['plain_errors']}/{out['plain_requests']} plain; {out['streams_failed']}/{out['streams']} "
                   f"streams failed, {out['streams_cut_with_error_event']} cut by error event")
    heal = out["punched_again_after_s"] if out["punched_again_after_s"] is not None else "never"
    return row(f"{name} (tunnel {out['tunnel_before']} -> {out['tunnel_cut']} -> {out['tunnel_after']})", load_text,
               faults, errors_text, "-", heal, "-", **{k: v for k, v in out.items() if k != "scenario"})


def nat_no_relay_seed(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The NAT lab's ingress with --no-relay, a standalone relay beside it, and one node behind
    NAT A bootstrapping to the ingress only (node relay rule 7): the relay started before the
    node, or after it (once the node said no relay is reachable). 5 plain chat/s through the
    ingress; heals when the node serves through the relay (seconds from the node's start, or
    from the relay's)."""
    import natlab
    timings = dict(QUICK_TIMINGS) if args.quick else {}
    seconds = 6.0 if args.quick else 20.0
    reason = natlab.unavailable()
    rows = []
    for when in ("before", "after"):
        name = f"nat: ingress --no-relay, relay started {when} the node"
        load_text = "5 chat/s, 1 private node"
        faults = f"NAT lab, the node's only seed does not relay ({timings_text(timings)})"
        if reason:
            rows.append(row(name, load_text, faults, time_to_heal=f"skipped: {reason}", skipped=reason))
            continue
        with workdir(args, name) as tmp:
            out = natlab.run_no_relay_seed(tmp, timings, relay=when, seconds=seconds)
        heal = out["serving_after_s"] if out["joined"] else "never"
        rows.append(row(f"{name} (said no relay: {out['said_no_relay']})", load_text, faults,
                        out.get("plain_errors", "-"), "-", heal, "-", **{k: v for k, v in out.items() if k != "scenario"}))
    return rows


def registry_scale(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The registry at scale in the simulator (tests/bench_registry.py): a day of churn at 1,000
    nodes, a joiner, a join storm through one seed, and the ingress plane among workers."""
    import bench_registry
    found: Dict[str, Any] = {}
    churned = bench_registry.churn_phase(args.quick, found)
    bench_registry.joiner_phase(args.quick, found, churned)
    bench_registry.storm_phase(args.quick, found)
    bench_registry.planes_phase(args.quick, found)
    c, j, s, p = found["churn"], found["joiner"], found["storm"], found["planes"]
    return [
        row(f"registry: {c['hours']} h of 10 %/min churn, 1,000 sessions (sim)", "-", "100 leave + 100 join a minute",
            "n/a (sim)", "-", "-", 0, state_bytes_per_worker=c["state_bytes_per_worker"],
            largest_piece_bytes=c["largest_piece_bytes"], **{k: c[k] for k in ("entries", "remembered")}),
        row(f"registry: a joiner among {j['members']} (sim)", "-", f"{j['tombstones']} LEFT records",
            "n/a (sim)", "-", j["catch_up_s"], 0, largest_message_bytes=j["largest_message_bytes"]),
        row(f"registry: join storm of {s['members']} through one seed (sim)", "-", "all at once", "n/a (sim)", "-",
            s["converged_s"], 0, seed_cpu_s=s["seed_cpu_s"], members_cpu_s=s["members_cpu_s"]),
        row(f"registry: planes, {p['workers']} workers, 3 ingresses, {p['api_keys']} keys (sim)",
            "30 usage slots/s", "an ingress restarted", "n/a (sim)", "-", p["restarted_ingress_catch_up_s"], 0,
            worker_bytes_s=p["publishing_bytes_per_worker_s"], worker_idle_bytes_s=p["idle_bytes_per_worker_s"],
            ingress_entries_on_workers=p["ingress_entries_on_workers"]),
    ] + [usage_year(args)]


def usage_year(args: argparse.Namespace) -> Dict[str, Any]:
    """tests/bench_usage_year.py: a year of usage at real ingresses, a new one and a restarted one."""
    with workdir(args, "usage year") as tmp:
        subprocess.run([PY, os.path.join(ROOT, "tests", "bench_usage_year.py"), "--out", tmp]
                       + (["--quick"] if args.quick else []), check=False, timeout=900)
        with open(os.path.join(tmp, "bench_usage_year.json")) as f:
            y = json.load(f)
    return row(f"registry: a year of usage, {y['api_keys']:,} keys, {y['usage_counters']:,} counters (real)", "-",
               "a new ingress; then it restarted", "-", "-", f"{y['b_joined_s']} s; {y['b_restarted_s']} s", 0,
               **{k: y[k] for k in ("b_after_join", "b_after_restart", "a_from_its_db_s")})


SCENARIOS = [partition, restart_sigterm, restart_kill9, churn, hostile, simulator, registry_scale, nat,
             nat_private_ingress, nat_punched_cut, nat_no_relay_seed]


# =============================================================================================
# Failover: two ingresses on one overlay, one killed under load; lost requests per client kind
# =============================================================================================
# Three ways a client can live through an ingress dying, side by side under one load:
#   both URLs     the client knows both ingresses and sends a request that failed without an
#                 answer (refused, reset, a 5xx from the ingress) to the other one at once
#   DNS round robin  one name, both addresses, a new connection per request in turn; like
#                 socket.create_connection (curl too) it tries the next address when a connect
#                 is refused, but a request already sent to the dying one is lost
#   relay         nginx in front of both (when installed), its defaults but upstream keep-alive:
#                 a POST goes to the other upstream only when the first could not take it
#   one URL       the client knows only the ingress that dies (what it costs without failover)
FAILOVER_KINDS = (("both URLs", 15.0), ("DNS round robin", 15.0), ("relay", 10.0),
                  ("one URL", 10.0))   # requests/s: 50 in all


def _failover_chat(addrs: List[Tuple[str, int]], token: str, kind: str, turn: int) -> str:
    """One chat completion the way `kind` sends it: OK or what went wrong."""
    order = addrs[turn % len(addrs):] + addrs[:turn % len(addrs)] if kind == "DNS round robin" else addrs
    tries = order[:1] if kind in ("one URL", "relay") else order
    outcome = "not sent"
    for host, port in tries:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            outcome = chat(conn, token, False)[0]
        except ConnectionRefusedError:
            outcome = REFUSED
            continue                              # every kind tries the next address on a refusal
        except (OSError, http.client.HTTPException, ValueError) as exc:
            outcome = f"error: {type(exc).__name__}"
        finally:
            conn.close()
        if outcome == OK or kind != "both URLs":
            return outcome
    return outcome


def ingress_failover(args: argparse.Namespace, nodes: int = 2) -> List[Dict[str, Any]]:
    """Ingress A (the README's, no --bootstrap) and ingress B (its own --db, bootstrapping to
    A) on one overlay with `nodes` nodes; the admin key made at A works at B through the
    overlay. 50 chat/s for `window` seconds from the three client kinds above; A is killed
    (kill -9) a third of the way in. Each kind's row: its requests that did not end OK."""
    window = 20.0 if args.quick else 60.0
    kill_at = window / 3
    rows = []
    with workdir(args, "ingress failover") as tmp, Fleet(tmp) as fleet:
        a = fleet.ingress(name="ingress-a")
        listen, gossip = f"127.0.0.1:{LOOPBACK.port(8080)}", f"127.0.0.1:{LOOPBACK.port(7946)}"
        b = Member("ingress-b", "ingress", LOOPBACK,
                   [PY, os.path.join(ROOT, "otela_ingress.py"), "serve", "--key-file", fleet.key_file,
                    "--listen", listen, "--gossip", gossip, "--db", os.path.join(tmp, "b.sqlite"),
                    "--bootstrap", a.gossip], listen, gossip)
        fleet.members.append(b)
        b_started = time.monotonic()
        fleet.start(b)
        for i in range(nodes):
            fleet.node(f"n{i}", bootstrap=(a.gossip,))
        for ingress in (a, b):
            wait(lambda ingress=ingress: fleet.up() and len(fleet.serving(ingress)) == nodes, 90,
                 f"{nodes} nodes serving at {ingress.name}")
        key_at_b = wait(lambda: get_json_auth(b.url + "/v1/models", fleet.token) == 200, 30, "A's key at B")
        addrs = [(m.listen.rsplit(":", 1)[0], int(m.listen.rsplit(":", 1)[1])) for m in (a, b)]
        relay = _start_relay(tmp, addrs)
        kinds = [(kind, rate) for kind, rate in FAILOVER_KINDS if kind != "relay" or relay is not None]
        targets = {kind: [relay[1]] if kind == "relay" else addrs for kind, _ in kinds}
        records: Dict[str, List[tuple]] = {kind: [] for kind, _ in kinds}
        lock = threading.Lock()
        stop = threading.Event()

        def sender(kind: str, gap: float, offset: float, turn: int) -> None:
            next_at = time.monotonic() + offset
            while not stop.is_set():
                stop.wait(max(0.0, next_at - time.monotonic()))
                if stop.is_set():
                    break
                sent = time.monotonic()
                outcome = _failover_chat(targets[kind], fleet.token, kind, turn)
                turn += 1
                with lock:
                    records[kind].append((sent, time.monotonic(), outcome))
                next_at = max(next_at + gap, time.monotonic())   # bounded: no burst to catch up

        senders = 5   # per kind: one request hanging on the dead ingress stalls a fifth of its rate
        threads = [threading.Thread(target=sender, args=(kind, senders / rate, i / rate, i), daemon=True)
                   for kind, rate in kinds for i in range(senders)]
        try:
            started = time.monotonic()
            for thread in threads:
                thread.start()
            time.sleep(kill_at)
            fleet.stop(a, signal.SIGKILL)
            killed = time.monotonic()
            time.sleep(max(0.0, started + window - time.monotonic()))
        finally:
            stop.set()
            for thread in threads:
                thread.join(40)
            if relay is not None:
                relay[0].terminate()
                relay[0].wait(10)
    if relay is None:
        rows.append(row("ingress failover, relay", "-", "-", time_to_heal="skipped: no nginx installed"))
    for kind, rate in kinds:
        done = records[kind]
        lost = [r for r in done if r[2] != OK]
        after = [r for r in done if r[0] >= killed]
        first_ok = min((r[1] for r in after if r[2] == OK), default=None)
        outcomes: Dict[str, int] = {}
        for r in done:
            outcomes[r[2]] = outcomes.get(r[2], 0) + 1
        rows.append(row(f"ingress failover, {kind}", f"{rate:g} of 50 chat/s, 2 ingresses, {nodes} nodes",
                        f"ingress A kill -9 at {kill_at:.0f} s of {window:g} s (default timings)",
                        len(lost), "-",
                        round(first_ok - killed, 2) if first_ok is not None else "never",
                        "-", requests=len(done), lost=len(lost), lost_after_kill=sum(1 for r in after if r[2] != OK),
                        availability=round(1 - len(lost) / len(done), 4) if done else None,
                        key_at_b_after_s=round(key_at_b - b_started, 2), window_s=window, outcomes=outcomes))
    return rows


RELAY_CONF = """worker_processes 1;
daemon off;
pid {tmp}/relay.pid;
error_log {tmp}/relay-error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/rb; proxy_temp_path {tmp}/rp; fastcgi_temp_path {tmp}/rf;
  uwsgi_temp_path {tmp}/ru; scgi_temp_path {tmp}/rs;
  upstream ingresses {{ {servers} keepalive 32; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://ingresses; proxy_http_version 1.1; proxy_set_header Connection ""; }}
  }}
}}
"""


def _start_relay(tmp: str, addrs: List[Tuple[str, int]]) -> Optional[Tuple[subprocess.Popen, Tuple[str, int]]]:
    """nginx in front of the ingresses, when installed: (its process, its address), or None."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if binary is None:
        return None
    port = LOOPBACK.port(8080)
    conf = os.path.join(tmp, "relay.conf")
    with open(conf, "w") as fh:
        fh.write(RELAY_CONF.format(tmp=tmp, port=port,
                                   servers=" ".join(f"server {h}:{p};" for h, p in addrs)))
    proc = subprocess.Popen([binary, "-c", conf, "-p", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if until(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() is None, 10) is None:
        proc.terminate()
        proc.wait(10)
        return None
    return proc, ("127.0.0.1", port)


def get_json_auth(url: str, token: str) -> int:
    """The status of a GET with a bearer token."""
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


SCENARIOS.append(ingress_failover)


# =============================================================================================
# The overlay over a WAN: three sites 150 ms apart with 2 % loss, false evictions and detection
# =============================================================================================
WAN_SUSPECTED = "suspected: no ack on any path"    # otela_node's line for a suspicion of its own
WAN_EVICTED = "evicted: "                          # ... and for an eviction it wrote


def _log_count(fleet: Fleet, member: Member, needle: str) -> int:
    return fleet.log(member).count(needle)


def _seen_left(fleet: Fleet, watchers: List[Member], session: str, timeout: float) -> Dict[str, Any]:
    """Poll `watchers` (every ~0.1 s) until each holds `session` LEFT: when each did (wall
    clock), and the record's left_at, its writer's clock (one machine: one clock)."""
    seen: Dict[str, float] = {}
    stamp: Dict[str, float] = {}

    def all_know() -> bool:
        for m in watchers:
            if m.name not in seen:
                left_at = _left_at(fleet, m, session)
                if left_at is not None:
                    seen[m.name], stamp[m.name] = time.time(), left_at
        return len(seen) == len(watchers)
    until(all_know, timeout, every=0.1)
    return {"seen": seen, "left_at": min(stamp.values()) if stamp else None, "all": len(seen) == len(watchers)}


def _left_at(fleet: Fleet, member: Member, session: str) -> Optional[float]:
    """When `member` holds `session` LEFT (its record's left_at), or None (still live there, or
    the member did not answer)."""
    try:
        view = fleet.registry(member)
    except (OSError, ValueError, TimeoutError):
        return None
    for s in view["sessions"]:
        if s["session"] == session:
            return s.get("left_at") if s["state"] == "LEFT" else None
    return None


def run_wan_overlay(tmp: str, seconds: float, rtt_ms: float = 150.0, loss: float = 0.02, jitter_ms: float = 5.0,
                    timings: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Three sites (tests/wanlab.py), every pair `rtt_ms` apart with `loss` per packet and
    direction: an ingress on site a's login host, a relay on the login hosts of b and c, a node
    behind each site's NAT (--reach private, so its gossip goes through the relays). Once all
    serve, `seconds` of the overlay alone: each member's suspicions and evictions (its log), and
    whether every session is still the one it was. Then site c's node is killed (SIGKILL): when
    each other member holds it LEFT, from the kill, and the eviction's spread (the evictor's
    write, stamped left_at, until it is at every member); then site b's node drains (SIGTERM),
    and its own LEFT's spread likewise. A spread is within the ~0.1 s each poll of five members
    takes."""
    import wanlab
    sites = ("a", "b", "c")
    link = {"rtt_ms": rtt_ms, "loss": loss, "jitter_ms": jitter_ms}
    links = {"a-b": dict(link), "a-c": dict(link), "b-c": dict(link)}
    out: Dict[str, Any] = {"rtt_ms": rtt_ms, "loss": loss, "jitter_ms": jitter_ms, "seconds": seconds,
                           "timings": timings_text(timings or {})}
    with wanlab.WanLab(sites=3, links=links) as lab, Fleet(tmp, timings) as fleet:
        ingress = fleet.ingress(lab.login("a"), name="ingress-a", flags=("--site-name", "a"))
        relays = []
        for i, site in enumerate(sites[1:], 1):
            public = wanlab.login_public(i)
            argv = [PY, os.path.join(ROOT, "otela_node.py"), "relay", "--key-file", fleet.key_file,
                    "--gossip", f"{public}:7946", "--listen", f"{public}:7701", "--bootstrap", ingress.gossip,
                    "--site-name", site]
            relay = Member(f"relay-{site}", "relay", lab.login(site), argv, f"{public}:7701", f"{public}:7946")
            fleet.members.append(relay)
            fleet.start(relay)
            relays.append(relay)
        nodes = {site: fleet.node(f"node-{site}", lab.host(site), bootstrap=(ingress.gossip,),
                                  grant=fleet.grant(f"node-{site}", (MODEL,), "--label", f"site={site}"),
                                  flags=("--site-name", site, "--reach", "private"))
                 for site in sites}
        members = [ingress, *relays, *nodes.values()]

        def all_serving() -> bool:
            seen = live(fleet.registry(ingress))
            return len(seen) == len(members) and all(live(fleet.registry(m)) == seen for m in members[1:])
        started = time.monotonic()
        wait(lambda: fleet.up() and all_serving(), 120, "every member SERVING, alike at every member")
        out["serving_after_s"] = round(time.monotonic() - started, 1)
        before = {m.name: fleet.registry(m)["self"] for m in members}
        counted = {m.name: (_log_count(fleet, m, WAN_SUSPECTED), _log_count(fleet, m, WAN_EVICTED)) for m in members}
        time.sleep(seconds)
        fleet.up()
        out["suspicions"] = sum(_log_count(fleet, m, WAN_SUSPECTED) - counted[m.name][0] for m in members)
        out["evictions"] = sum(_log_count(fleet, m, WAN_EVICTED) - counted[m.name][1] for m in members)
        view = {s["session"]: s for s in fleet.registry(ingress)["sessions"]}
        out["sessions_kept"] = sum(1 for m in members
                                   if fleet.registry(m)["self"] == before[m.name]
                                   and view.get(before[m.name], {}).get("state") == "SERVING")
        out["sessions"] = len(before)

        # a node killed at site c: its eviction, written by a member of another site, is a write
        # whose spread to every site's members is measured too
        watchers = [ingress, *relays, nodes["a"], nodes["b"]]
        fleet.stop(nodes["c"], signal.SIGKILL)
        killed = time.time()
        got = _seen_left(fleet, watchers, before[nodes["c"].name], 60)
        out["detected_s"] = {name: round(t - killed, 2) for name, t in got["seen"].items()}
        out["detected_everywhere_s"] = round(max(got["seen"].values()) - killed, 2) if got["all"] else None
        if got["left_at"] is not None and got["all"]:
            out["evicted_written_s"] = round(got["left_at"] - killed, 2)
            out["eviction_spread_s"] = round(max(got["seen"].values()) - got["left_at"], 2)
        # site b's node drains (SIGTERM): its own LEFT, written at site b, to every other member
        nodes["b"].proc.send_signal(signal.SIGTERM)
        got = _seen_left(fleet, watchers[:-1], before[nodes["b"].name], 60)
        if got["left_at"] is not None and got["all"]:
            out["leave_spread_s"] = round(max(got["seen"].values()) - got["left_at"], 2)
        for member in reversed(members):
            fleet.stop(member)
    return out


def wan_overlay(args: argparse.Namespace) -> Dict[str, Any]:
    """The overlay across three sites 150 ms apart with 2 % loss (run_wan_overlay), default
    timings: 30 minutes (--quick: 60 s). Heals when every other member holds the killed node
    LEFT (seconds from the kill)."""
    import wanlab
    seconds = 60.0 if args.quick else 1800.0
    name = "wan overlay: 3 sites, 150 ms RTT, 2 % loss"
    load_text = "gossip only (ingress, 2 relays, 3 private nodes)"
    faults = f"{seconds:g} s, then a node SIGKILLed (default timings)"
    reason = wanlab.unavailable()
    if reason:
        return row(name, load_text, faults, time_to_heal=f"skipped: {reason}", skipped=reason)
    with workdir(args, name) as tmp:
        out = run_wan_overlay(tmp, seconds)
    name += (f": {out['evictions']} false evictions, {out['suspicions']} suspicions; a write at every member "
             f"{out.get('eviction_spread_s', '?')} s / {out.get('leave_spread_s', '?')} s after it was made")
    return row(name, load_text, faults, "-", "-", out["detected_everywhere_s"] or "not detected in 60 s", "-", **out)


SCENARIOS.append(wan_overlay)


def site_cut(args: argparse.Namespace) -> Dict[str, Any]:
    """Two sites 10 ms apart lose their link for 3 minutes (--quick: 20 s, quick timings), each
    serving the same model (wanlab.run_site_cut): client errors at either side during and after
    the cut; heals when a key made at a during the cut works at b and one revoked at b is refused
    at a; data lost: answers missing from the cluster's usage totals (or counted twice)."""
    import wanlab
    cut_s = 20.0 if args.quick else 180.0
    timings = dict(QUICK_TIMINGS) if args.quick else {}
    name = "site cut off: 2 sites, 10 ms RTT"
    load_text = "~20 chat/s per side, its own ingress"
    faults = f"WAN link down {cut_s:g} s; a key made at a, one revoked at b meanwhile ({timings_text(timings)})"
    reason = wanlab.unavailable()
    if reason:
        return row(name, load_text, faults, time_to_heal=f"skipped: {reason}", skipped=reason)
    with workdir(args, name) as tmp:
        out = wanlab.run_site_cut(tmp, timings, cut_s=cut_s)
    errors_seen = sum(v["errors"] for v in out["during"].values()) + sum(v["errors"] for v in out["after"].values())
    heal = [out["made_works_at_b_after_s"], out["doomed_refused_at_a_after_s"]]
    usage = out["usage"]
    lost = abs(usage["answered_in_test"] - usage["at_a"]["requests"]) + abs(usage["at_a"]["requests"] - usage["at_b"]["requests"])
    spent = out["budget"]["spent_total"]
    name += f"; a day budget of {out['budget']['budget_day']} tokens spent {spent['a']} in all (bound: 2 x what was left)"
    return row(name, load_text, faults, errors_seen, "-",
               max(heal) if None not in heal else "not within 60 s", lost, **out)


SCENARIOS.append(site_cut)


# =============================================================================================
# The table and the command line
# =============================================================================================
def table(rows: List[Dict[str, Any]]) -> str:
    cells = [HEADINGS] + [tuple(str(r.get(c, "-")) for c in COLUMNS) for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fault scenarios against real otela processes: one table "
                                            "(and OUT/reliability.json).")
    p.add_argument("--quick", action="store_true", help="shorter scenarios and timings (for tests)")
    p.add_argument("--only", action="append", default=None,
                   help="run only scenarios whose function name contains this (repeatable): "
                        + ", ".join(f.__name__ for f in SCENARIOS))
    p.add_argument("--out", default="bench-results", help="directory for reliability.json")
    p.add_argument("--churn-seconds", type=float, default=None, help="churn duration (default 120, quick 60)")
    p.add_argument("--churn-interval", type=float, default=None, help="seconds between kills (default 20, quick 15)")
    p.add_argument("--seed", type=int, default=11, help="which nodes churn kills")
    p.add_argument("--keep", default=None, help="keep each scenario's logs and ledger under this directory")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # SIGTERM (make, a CI timeout) unwinds like Ctrl-C, so every `with` cleans up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, failed = [], 0
    for scenario in SCENARIOS:
        if args.only and not any(o in scenario.__name__ for o in args.only):
            continue
        print(f"== {scenario.__name__}", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            found = scenario(args)
        except Exception as exc:                  # a broken scenario is a row, and a failed run
            failed += 1
            found = row(scenario.__name__, "-", "-", time_to_heal=f"failed: {type(exc).__name__}: {exc}")
        found = found if isinstance(found, list) else [found]
        rows += found
        print(f"   {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    print(table(rows))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "reliability.json")
    with open(path, "w") as fh:
        json.dump({"quick": args.quick, "columns": list(COLUMNS), "rows": rows}, fh, indent=1)
    print(f"rows written to {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
