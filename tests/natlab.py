"""A NAT test bed in network namespaces (root only): two private networks behind NATs (iptables
MASQUERADE) and a public host, built on top of tests/netns.py.

    {tag}pub  public host (ingress, relays)      10.79.0.100/24 eth0
        |
    {tag}wan  the "internet": bridge br0, no address
        |                                   |
    {tag}ra  wan0 10.79.0.11 (NAT A)       {tag}rb  wan0 10.79.0.12 (NAT B)
             lan0 10.79.1.1                         lan0 10.79.2.1
        |                                   |
    {tag}ha  eth0 10.79.1.2 (private A)    {tag}hb  eth0 10.79.2.2 (private B)

NAT modes per router (iptables inside the router's namespace):
  cone       MASQUERADE: Linux keeps the source port when it is free, so the mapping is
             endpoint-independent (port-restricted cone): hole punching works.
  symmetric  MASQUERADE --random-fully: a fresh port per 5-tuple: punching fails, relay.
Routers drop unsolicited inbound (FORWARD: only ESTABLISHED,RELATED from wan); `block_udp`
drops all forwarded UDP; `leaky` leaves the router's INPUT chain open (a bare Linux gateway:
an unsolicited packet gets a conntrack entry and may make the NAT remap a flow). `routed`: the
public host routes each private network to its NAT (as a cloud's VPC router would), so a dial of
a private address is dropped at the NAT and times out instead of failing at once (no route).

Names are "otn-<pid>-<n>-…": unique per lab, so labs of parallel runs never meet; `close()`
(also on failure, as a context manager) kills every process inside and deletes the namespaces;
a lab whose creator died is swept by the next one. Nothing is attached to this machine's own
network, so no packet leaves the lab.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import types
from typing import Any, Dict, List, Optional

import netns

PREFIX = "otn-"
PUBLIC = "10.79.0.100"
ROUTER_WAN = {"a": "10.79.0.11", "b": "10.79.0.12"}
PRIVATE = {"a": "10.79.1.2", "b": "10.79.2.2"}
GATEWAY = {"a": "10.79.1.1", "b": "10.79.2.1"}
MODES = ("cone", "symmetric")
_count = itertools.count()


def unavailable() -> Optional[str]:
    """Why a NAT lab cannot be built here, or None."""
    why = netns.unavailable()
    if why:
        return why
    if shutil.which("iptables") is None:
        return "iptables is not installed (make netdeps)"
    return None


def _run(ns: str, *argv: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=15)
    if done.returncode != 0:
        raise RuntimeError(f"{ns}: {' '.join(argv)}: {done.stderr.strip()}")


def nat_firewall(router: str, mode: str, block_udp: bool = False, leaky: bool = False) -> None:
    """Make namespace `router` a NAT from its lan0 to its wan0 (mode "cone" or "symmetric"),
    dropping unsolicited inbound; `block_udp` drops all forwarded UDP, `leaky` leaves INPUT open."""
    ipt = ["iptables", "-w"]
    masquerade = [*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"]
    if mode == "symmetric":
        masquerade.append("--random-fully")
    _run(router, *masquerade)
    _run(router, *ipt, "-P", "FORWARD", "DROP")
    if block_udp:
        _run(router, *ipt, "-A", "FORWARD", "-p", "udp", "-j", "DROP")
    _run(router, *ipt, "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
    _run(router, *ipt, "-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack",
         "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
    if not leaky:
        _run(router, *ipt, "-A", "INPUT", "-i", "wan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(router, *ipt, "-A", "INPUT", "-i", "wan0", "-p", "icmp", "--icmp-type", "echo-request",
             "-j", "ACCEPT")
        _run(router, *ipt, "-A", "INPUT", "-i", "wan0", "-j", "DROP")


class NatLab:
    """One public host and two private hosts behind NATs A and B. A context manager."""

    def __init__(self, nat_a: str = "cone", nat_b: str = "cone", block_udp: str = "", leaky: str = "",
                 routed: bool = False):
        for mode in (nat_a, nat_b):
            if mode not in MODES:
                raise ValueError(f"NAT mode {mode!r}: use one of {MODES}")
        self.tag = f"{PREFIX}{os.getpid()}-{next(_count)}-"
        self.names: Dict[str, str] = {n: self.tag + n for n in ("wan", "pub", "ra", "rb", "ha", "hb")}
        self.nat = {"a": nat_a, "b": nat_b}
        self.block_udp, self.leaky, self.routed = block_udp, leaky, routed
        self.places: Dict[str, netns.Place] = {}
        netns.sweep_orphans(PREFIX)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        ip, n = netns.ip, self.names
        for name in n.values():
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", n["wan"], "link", "add", "br0", "type", "bridge")
        ip("-n", n["wan"], "link", "set", "br0", "up")
        ip("-n", n["wan"], "link", "add", "pub0", "type", "veth", "peer", "name", "eth0", "netns", n["pub"])
        for side in "ab":
            ip("-n", n["wan"], "link", "add", f"r{side}0", "type", "veth", "peer", "name", "wan0",
               "netns", n["r" + side])
            ip("-n", n["r" + side], "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
               "netns", n["h" + side])
        for port in ("pub0", "ra0", "rb0"):
            ip("-n", n["wan"], "link", "set", port, "master", "br0", "up")
        ip("-n", n["pub"], "addr", "add", f"{PUBLIC}/24", "dev", "eth0")
        ip("-n", n["pub"], "link", "set", "eth0", "up")
        for side in "ab":
            router, host = n["r" + side], n["h" + side]
            ip("-n", router, "addr", "add", f"{ROUTER_WAN[side]}/24", "dev", "wan0")
            ip("-n", router, "link", "set", "wan0", "up")
            ip("-n", router, "addr", "add", f"{GATEWAY[side]}/24", "dev", "lan0")
            ip("-n", router, "link", "set", "lan0", "up")
            ip("-n", host, "addr", "add", f"{PRIVATE[side]}/24", "dev", "eth0")
            ip("-n", host, "link", "set", "eth0", "up")
            ip("-n", host, "route", "add", "default", "via", GATEWAY[side])
            _run(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._firewall(side)
            if self.routed:
                ip("-n", n["pub"], "route", "add", PRIVATE[side].rsplit(".", 1)[0] + ".0/24", "via", ROUTER_WAN[side])
        self.places = {"pub": netns.Place(PUBLIC, n["pub"]), "a": netns.Place(PRIVATE["a"], n["ha"]),
                       "b": netns.Place(PRIVATE["b"], n["hb"])}

    def _firewall(self, side: str) -> None:
        nat_firewall(self.names["r" + side], self.nat[side], side in self.block_udp, side in self.leaky)

    def place(self, host: str) -> netns.Place:
        """"pub", "a" or "b"."""
        return self.places[host]

    def pids(self) -> List[int]:
        out = []
        for name in self.names.values():
            done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
            out += [int(p) for p in done.stdout.split()]
        return out

    def close(self) -> None:
        for place in self.places.values():
            place.close()
        netns.remove(list(self.names.values()))

    def __enter__(self) -> NatLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# =============================================================================================
# Scenarios: the ingress (a relay) on the public host, nodes wrapping the fake engine on the
# private hosts; shared by tests/test_nat_lab.py and `make reliability` (tests/reliability.py)
# =============================================================================================
SCENARIOS = {               # name: (NatLab arguments, a standalone relay that is killed midway)
    "cone/cone": (dict(nat_a="cone", nat_b="cone"), False),
    "symmetric": (dict(nat_a="symmetric", nat_b="symmetric"), False),
    "udp blocked at A": (dict(block_udp="a"), False),
    "leaky gateway at B": (dict(leaky="b"), False),
    "relay in use killed": (dict(), True),
}
RELAY_GOSSIP_PORT = 7947            # the standalone relay beside the ingress on the public host


def run(name: str, tmp: str, timings: Dict[str, str], seconds: float = 6.0) -> Dict[str, Any]:
    """Build scenario `name`'s lab, start the members, send 5 plain chat/s through the ingress
    for `seconds` (killing the standalone relay, with SIGKILL, a second in), and return what
    happened: outcomes, sessions served, how each member reaches the others, relay links."""
    import reliability as rel
    lab_args, kill_relay = SCENARIOS[name]
    out: Dict[str, Any] = {"scenario": name}
    with NatLab(**lab_args) as lab, rel.Fleet(tmp, timings) as fleet:
        pub, a, b = lab.place("pub"), lab.place("a"), lab.place("b")
        ingress = fleet.ingress(pub)
        relay = None
        if kill_relay:
            gossip = f"{PUBLIC}:{RELAY_GOSSIP_PORT}"
            argv = [rel.PY, os.path.join(rel.ROOT, "otela_node.py"), "relay", "--key-file", fleet.key_file,
                    "--gossip", gossip, "--listen", f"{PUBLIC}:7701", "--bootstrap", ingress.gossip]
            relay = rel.Member("relay", "relay", pub, argv, f"{PUBLIC}:7701", gossip)
            fleet.members.append(relay)
            fleet.start(relay)
            rel.wait(lambda: fleet.up() and any(s.get("role") == "relay" and s["state"] == "SERVING"
                                                for s in fleet.registry(ingress)["sessions"]), 30, "relay SERVING")
        nodes = [fleet.node(side, place, bootstrap=(ingress.gossip,)) for side, place in (("a", a), ("b", b))]
        want = 2 if kill_relay else 1

        first = f"{PUBLIC}:{RELAY_GOSSIP_PORT}" if kill_relay else None

        def ready() -> bool:
            # with a standalone relay, the scenario starts once it is the relay in use: a node whose
            # state transfer came after its reach check linked the ingress first, and re-ranks its
            # links at its next relay check (a loaded box)
            view = {s["session"]: s for s in fleet.registry(ingress)["sessions"]}
            workers = [s for s in view.values() if s.get("role") == "worker" and s["state"] == "SERVING"
                       and not s.get("suspected")]
            return len(workers) == 2 and all(len(s.get("relay", "").split(",")) >= want and
                                             (first is None or s["relay"].split(",")[0] == first) for s in workers)
        started = time.monotonic()
        rel.wait(lambda: fleet.up() and ready(), 60, "both private nodes SERVING at the ingress, relayed")
        out["serving_after_s"] = round(time.monotonic() - started, 2)
        sessions = {m.name: fleet.registry(m)["self"] for m in nodes}

        def punch_settled() -> bool:
            counts = [fleet.get(m, "/healthz")[1].get("gossip", {}).get("punches", {}) for m in nodes]
            return any(c.get("ok") or c.get("failed") for c in counts)
        settled = rel.until(lambda: fleet.up() and punch_settled(), 15)
        out["punch_settled_after_s"] = round(settled - started, 2) if settled else None
        view = {s["session"]: s for s in fleet.registry(ingress)["sessions"]}
        out["relays_before"] = {n: view[sid].get("relay", "") for n, sid in sessions.items()}
        with rel.Load(pub, ingress.url, fleet.token, rate=5) as load:
            time.sleep(1.0)
            if relay is not None:
                fleet.stop(relay, signal.SIGKILL)
                out["relay_killed_at_s"] = 1.0
            time.sleep(seconds)
        outcomes = load.outcomes()
        out["outcomes"] = outcomes
        out["plain_requests"] = len(load.select("plain"))
        out["plain_errors"] = rel.errors(load.select("plain"), True)
        out["served_by"] = sorted({r[4] for r in load.select("plain") if r[3] == rel.OK} & set(sessions.values()))
        out["both_served"] = set(out["served_by"]) == set(sessions.values())
        view = {s["session"]: s for s in fleet.registry(ingress)["sessions"]}
        out["reach_at_ingress"] = {n: view[sid]["reach"] for n, sid in sessions.items()}
        out["relays"] = {n: view[sid].get("relay", "") for n, sid in sessions.items()}
        a_view = {s["session"]: s for s in fleet.registry(nodes[0])["sessions"]}
        out["a_reaches_b"] = a_view.get(sessions["b"], {}).get("reach")
        b_view = {s["session"]: s for s in fleet.registry(nodes[1])["sessions"]}
        out["b_reaches_a"] = b_view.get(sessions["a"], {}).get("reach")
        health = [fleet.get(m, "/healthz")[1].get("gossip", {}) for m in nodes]
        out["punches"] = [h.get("punches") for h in health]
        out["punch_ms"] = [h.get("punch_ms") for h in health]
        out["private"] = [h.get("private") for h in health]
        out["observed"] = [h.get("observed") for h in health]
        fleet.stop(ingress)
    return out


# A private ingress: the public host runs the relay (an ingress), host A an ingress that is itself
# behind NAT A (OTELA_REACH=private) and host B a node behind NAT B. The private ingress's tunnel
# to the node punches (TCP simultaneous open) when both NATs are cone, and is spliced through the
# relay otherwise; clients on host A send to the private ingress.
PRIVATE_INGRESS_SCENARIOS = {
    "private ingress, cone/cone": dict(nat_a="cone", nat_b="cone"),
    "private ingress, symmetric": dict(nat_a="symmetric", nat_b="symmetric"),
    "private ingress, leaky gateway at A": dict(leaky="a"),   # the dialer's side: its SYN must go first
}


def is_relayed_addr(addr: str) -> bool:
    return addr.startswith("relay/")


@contextlib.contextmanager
def _private_ingress(lab_args: Dict[str, Any], tmp: str, timings: Dict[str, str], engine_flags: str = ""):
    """The lab, the relay (an ingress) on the public host, a private ingress on host A and a
    node behind NAT B, the node SERVING at the private ingress and its UDP punch settled: a
    namespace of lab, fleet, relay, ingress, node, token, worker_view() and the times."""
    import reliability as rel
    with NatLab(**lab_args) as lab, rel.Fleet(tmp, timings) as fleet:
        pub, a, b = lab.place("pub"), lab.place("a"), lab.place("b")
        relay = fleet.ingress(pub)
        listen, gossip = f"{a.host}:{a.port(8080)}", f"{a.host}:{a.port(7946)}"
        db = os.path.join(tmp, "private-ingress.sqlite")    # each ingress its own ledger, its own key
        token = subprocess.run([rel.PY, os.path.join(rel.ROOT, "otela_ingress.py"), "keys", "create", "--user",
                                "tester", "--db", db], env=fleet.env, check=True, capture_output=True, text=True,
                               timeout=60).stdout.strip()
        argv = ["env", "OTELA_REACH=private", rel.PY, os.path.join(rel.ROOT, "otela_ingress.py"), "serve",
                "--key-file", fleet.key_file, "--listen", listen, "--gossip", gossip, "--db", db,
                "--bootstrap", relay.gossip]
        ingress = rel.Member("private-ingress", "ingress", a, argv, listen, gossip)
        fleet.members.append(ingress)
        fleet.start(ingress)
        node = fleet.node("b", b, bootstrap=(relay.gossip,), engine_flags=engine_flags)
        started = time.monotonic()

        def worker_view() -> Optional[Dict[str, Any]]:
            for s in fleet.registry(ingress)["sessions"]:
                if s.get("role") == "worker" and s["state"] == "SERVING" and not s.get("suspected"):
                    return s
            return None
        rel.wait(lambda: fleet.up() and worker_view() is not None, 60, "the node SERVING at the private ingress")
        serving_after_s = round(time.monotonic() - started, 2)

        def punch_settled() -> bool:
            counts = fleet.get(node, "/healthz")[1].get("gossip", {}).get("punches", {})
            return bool(counts.get("ok") or counts.get("failed") or counts.get("answered"))
        settled = rel.until(lambda: fleet.up() and punch_settled(), 15)
        yield types.SimpleNamespace(
            lab=lab, fleet=fleet, relay=relay, ingress=ingress, node=node, token=token, worker_view=worker_view,
            serving_after_s=serving_after_s,
            punch_settled_after_s=round(settled - started, 2) if settled else None)
        fleet.stop(ingress)
        fleet.stop(relay)


def run_private_ingress(name: str, tmp: str, timings: Dict[str, str], seconds: float = 6.0) -> Dict[str, Any]:
    """Build the lab, start the three members, wait for the node SERVING at the private
    ingress and for its UDP punch to settle, send 5 plain chat/s for `seconds` from host A, and
    return the outcomes and how the private ingress's tunnel reaches the node."""
    import reliability as rel
    out: Dict[str, Any] = {"scenario": name}
    with _private_ingress(PRIVATE_INGRESS_SCENARIOS[name], tmp, timings) as bed:
        fleet, ingress, node = bed.fleet, bed.ingress, bed.node
        out["serving_after_s"], out["punch_settled_after_s"] = bed.serving_after_s, bed.punch_settled_after_s
        with rel.Load(bed.lab.place("a"), ingress.url, bed.token, rate=5) as load:
            time.sleep(seconds)
        out["outcomes"] = load.outcomes()
        out["plain_requests"] = len(load.select("plain"))
        out["plain_errors"] = rel.errors(load.select("plain"), True)
        view = bed.worker_view() or {}
        out["reach"], out["tunnel"] = view.get("reach"), view.get("tunnel")
        own = fleet.registry(ingress)
        out["private"] = is_relayed_addr(next(s for s in own["sessions"] if s["session"] == own["self"])["gossip"])
        health = fleet.get(node, "/healthz")[1].get("gossip", {})   # the node's side of the punches
        out["tunnel_punches"] = health.get("tunnel_punches")
        out["tunnel_punch_ms"] = health.get("tunnel_punch_ms")
        out["punch_after_join_ms"] = health.get("punch_after_join_ms")
    return out


# A punched tunnel broken under load (rule 6 of the node's "NAT traversal and relay"): the private
# ingress of PRIVATE_INGRESS_SCENARIOS on cone NATs, its tunnel to the node punched, then every TCP
# packet between the two NATs dropped at gateway B (the relay's path, through the public host,
# untouched; the UDP punched path too), then the rule removed.
PUNCH_CUT_TIMINGS = {"OTELA_PUNCHED_TCP_TIMEOUT": "2",   # a dead punched connection errors in ~2 s
                     "OTELA_PUNCH_RETRY": "4"}           # the re-punch probe within the test's time
PUNCH_CUT_STREAM_FLAGS = "--chunks 20 --chunk-delay 0.1"   # 2 s streams: some are mid-answer at the cut


def _cut_rules(action: str) -> List[List[str]]:
    other = ROUTER_WAN["a"]
    return [["iptables", "-w", action, "FORWARD", *(["1"] if action == "-I" else []), "-p", "tcp", side, other,
             "-j", "DROP"] for side in ("-s", "-d")]


def run_punched_cut(tmp: str, timings: Dict[str, str], before: float = 3.0, cut: float = 8.0,
                    restored: float = 12.0) -> Dict[str, Any]:
    """Plain (5/s) and streaming (2 in flight) chats from host A through the private ingress
    while its tunnel to the node is punched; `before` s in, TCP between the NATs is dropped for
    `cut` s, then restored; the load goes on until the tunnel is punched again (at most
    `restored` s). Returns the outcomes per phase and how the tunnel went in each."""
    import reliability as rel
    out: Dict[str, Any] = {"scenario": "punched tunnel cut"}
    timings = dict(timings, **PUNCH_CUT_TIMINGS)
    with _private_ingress(dict(nat_a="cone", nat_b="cone"), tmp, timings, PUNCH_CUT_STREAM_FLAGS) as bed:
        fleet, node, gateway = bed.fleet, bed.node, bed.lab.names["rb"]
        out["serving_after_s"] = bed.serving_after_s

        def tunnel() -> Optional[str]:
            return (bed.worker_view() or {}).get("tunnel")

        def node_counts() -> Dict[str, int]:
            health = fleet.get(node, "/healthz")[1].get("gossip", {})
            relayed = health.get("relayed", {})     # the node's relayed tunnel connections: dial-backs or streams
            return dict(health.get("tunnel_punches", {}), relayed=relayed.get("dialed_back", 0) + relayed.get("streams", 0))
        with rel.Load(bed.lab.place("a"), bed.ingress.url, bed.token, rate=5, streams=2) as load:
            out["punched_before"] = rel.until(lambda: tunnel() == "punched", 10) is not None
            time.sleep(before)
            out["tunnel_before"], out["counts_before"] = tunnel(), node_counts()
            cut_at = time.monotonic()
            for rule in _cut_rules("-I"):
                _run(gateway, *rule)
            try:
                time.sleep(cut)
                out["tunnel_cut"], out["counts_cut"] = tunnel(), node_counts()
            finally:
                for rule in _cut_rules("-D"):
                    _run(gateway, *rule)
            restored_at = time.monotonic()
            again = rel.until(lambda: tunnel() == "punched", restored)
            out["punched_again_after_s"] = round(again - restored_at, 2) if again else None
            time.sleep(1.0)                         # requests on the punched path again
            out["tunnel_after"], out["counts_after"] = tunnel(), node_counts()
        plain, streams = load.select("plain"), load.select("stream")
        out["outcomes"] = load.outcomes()
        out["plain_requests"], out["plain_errors"] = len(plain), rel.errors(plain, True)
        out["plain_requests_during_cut"] = len(load.select("plain", cut_at, restored_at))
        out["streams"] = len(streams)
        out["streams_cut_with_error_event"] = sum(1 for r in streams if r[3] == rel.CUT_WITH_ERROR)
        out["streams_failed"] = sum(1 for r in streams if r[3] not in (rel.OK, rel.CUT_WITH_ERROR))
        out["slowest_plain_s"] = round(max((r[1] - r[0] for r in plain), default=0.0), 2)
    return out


# An ingress that does not relay (--no-relay), a standalone relay beside it on the public host,
# and one node behind NAT A that bootstraps to the ingress only: the node learns of the relay
# from the ingress's answer to its reachability check ("rs" names the relays it knows: relay
# rule 7 of the node), links to it and is served through it.
NO_RELAY_TEXT = "no relay reachable: start `otela_node.py relay` or drop --no-relay on the ingress"


def run_no_relay_seed(tmp: str, timings: Dict[str, str], relay: str = "before", seconds: float = 4.0,
                      join_s: float = 45.0) -> Dict[str, Any]:
    """Start the ingress, then the standalone relay and the node: `relay` "before" the node,
    "after" it (once the node said NO_RELAY_TEXT), or "none". Wait up to `join_s` for the node
    SERVING at the ingress, relayed by the standalone relay; if it is, send 5 plain chat/s for
    `seconds`. Returns whether it joined, the outcomes, its relays and how often the node said
    NO_RELAY_TEXT."""
    import reliability as rel
    out: Dict[str, Any] = {"scenario": f"ingress --no-relay, relay {relay}"}
    with NatLab() as lab, rel.Fleet(tmp, timings) as fleet:
        pub, a = lab.place("pub"), lab.place("a")
        ingress = rel.Member("ingress", "ingress", pub,
                             [rel.PY, os.path.join(rel.ROOT, "otela_ingress.py"), "serve", "--key-file",
                              fleet.key_file, "--listen", f"{PUBLIC}:8080", "--gossip", f"{PUBLIC}:7946",
                              "--db", fleet.db, "--no-relay"], f"{PUBLIC}:8080", f"{PUBLIC}:7946")
        fleet.members.append(ingress)
        fleet.start(ingress)
        rel.wait(lambda: fleet.up() and fleet.get(ingress, "/healthz")[0] == 200, 60, "ingress /healthz")
        relay_gossip = f"{PUBLIC}:{RELAY_GOSSIP_PORT}"
        node_log = os.path.join(tmp, "a.1.log")

        def said() -> int:
            with open(node_log, errors="replace") as fh:
                return fh.read().count(NO_RELAY_TEXT)

        def start_relay() -> None:
            argv = [rel.PY, os.path.join(rel.ROOT, "otela_node.py"), "relay", "--key-file", fleet.key_file,
                    "--gossip", relay_gossip, "--listen", f"{PUBLIC}:7701", "--bootstrap", ingress.gossip]
            standalone = rel.Member("relay", "relay", pub, argv, f"{PUBLIC}:7701", relay_gossip)
            fleet.members.append(standalone)
            fleet.start(standalone)
            rel.wait(lambda: fleet.up() and any(s.get("role") == "relay" and s["state"] == "SERVING"
                                                for s in fleet.registry(ingress)["sessions"]), 30, "relay SERVING")
        if relay == "before":
            start_relay()
        node = fleet.node("a", a, bootstrap=(ingress.gossip,))
        if relay == "after":
            rel.wait(lambda: said() > 0, 30, "the node saying no relay is reachable")
            start_relay()

        def worker() -> Optional[Dict[str, Any]]:
            for s in fleet.registry(ingress)["sessions"]:
                if s.get("role") == "worker" and s["state"] == "SERVING" and not s.get("suspected") \
                        and s.get("reach") == "relayed" and s.get("relay", "").startswith(relay_gossip):
                    return s                # relayed by the standalone relay, not the ingress
            return None
        started = time.monotonic()
        joined = rel.until(lambda: fleet.up() and worker() is not None, join_s)
        out["joined"] = joined is not None
        out["serving_after_s"] = round(joined - started, 2) if joined else None
        if joined:
            out["relay"] = worker().get("relay", "")
            with rel.Load(pub, ingress.url, fleet.token, rate=5) as load:
                time.sleep(seconds)
            out["outcomes"] = load.outcomes()
            out["plain_requests"] = len(load.select("plain"))
            out["plain_errors"] = rel.errors(load.select("plain"), True)
            out["failed"] = [(round(r[0] - joined, 2), r[3], r[4]) for r in load.select("plain") if r[3] != rel.OK]
            out["sessions"] = [(s["session"][:8], s.get("role"), s["state"], s.get("reach"), s.get("relay"))
                               for s in fleet.registry(ingress)["sessions"]]
        out["private"] = fleet.get(node, "/healthz")[1].get("gossip", {}).get("private")
        out["said_no_relay"] = said()
        fleet.stop(node)
        fleet.stop(ingress)
    return out


# Two private nodes started together (issue 26): the ingress on the public host, a node behind
# each NAT, both started at once with --listen on their private address and --bootstrap to the
# ingress, as a new user would. The load starts as soon as the ingress routes to any worker; each
# node must be served within a few seconds of the ingress seeing it SERVING, and no request fail
# (their first records name private addresses the ingress cannot dial).
def run_started_together(mode: str, tmp: str, timings: Dict[str, str], seconds: float = 10.0,
                         routed: bool = True, within: float = 5.0) -> Dict[str, Any]:
    """Build a lab with both NATs `mode`, start the ingress, then both nodes at once; send 5
    plain chat/s from the public host from the moment the ingress sees a worker SERVING, for
    `seconds`. Returns the outcomes, the failures (when, what) and, per node, seconds from the
    ingress first seeing it SERVING to its first answered request (None: never served).
    `routed` (NatLab's): a dial of a private address times out, as on a cloud's network. The
    load goes on until `within` s after the second node was seen SERVING (20 s more at most)."""
    import reliability as rel
    out: Dict[str, Any] = {"scenario": f"started together, {mode}"}
    with NatLab(nat_a=mode, nat_b=mode, routed=routed) as lab, rel.Fleet(tmp, timings) as fleet:
        pub = lab.place("pub")
        ingress = fleet.ingress(pub)
        nodes = [fleet.node(side, lab.place(side), bootstrap=(ingress.gossip,)) for side in "ab"]
        started = time.monotonic()
        serving_at: Dict[str, float] = {}           # session -> when the ingress first saw it SERVING

        def look() -> bool:
            now = time.monotonic()
            for s in fleet.registry(ingress)["sessions"]:
                if s.get("role") == "worker" and s["state"] == "SERVING" and not s.get("suspected"):
                    serving_at.setdefault(s["session"], now)
            return bool(serving_at)
        rel.wait(lambda: fleet.up() and look(), 60, "a private node SERVING at the ingress")
        out["first_serving_after_s"] = round(time.monotonic() - started, 2)
        with rel.Load(pub, ingress.url, fleet.token, rate=5) as load:
            until_ = time.monotonic() + seconds
            while time.monotonic() < until_ or len(serving_at) < 2 and time.monotonic() < until_ + 20:
                with contextlib.suppress(OSError, ValueError):
                    look()
                if len(serving_at) == 2:            # the last one SERVING gets `within` s too
                    until_ = max(until_, max(serving_at.values()) + within)
                time.sleep(0.1)
        plain = load.select("plain")
        sessions = {m.name: fleet.registry(m)["self"] for m in nodes}
        out["outcomes"] = load.outcomes()
        out["plain_requests"], out["plain_errors"] = len(plain), rel.errors(plain, True)
        t0 = min(serving_at.values())
        out["failed"] = [(round(r[0] - t0, 2), r[3]) for r in plain if r[3] != rel.OK]
        first_ok: Dict[str, float] = {}
        for r in sorted(plain):
            if r[3] == rel.OK:
                first_ok.setdefault(r[4], r[1])
        out["served_after_serving_s"] = {}
        for name, sid in sessions.items():   # its session now: a node that rejoined counts from its last one
            seen = serving_at.get(sid)
            served = first_ok.get(sid)
            out["served_after_serving_s"][name] = (round(max(0.0, served - seen), 2)
                                                   if seen is not None and served is not None else None)
        out["sessions_seen"] = len(serving_at)
        out["serving_seen_after_s"] = {name: round(serving_at[sid] - t0, 2) if sid in serving_at else None
                                       for name, sid in sessions.items()}
        out["served_by"] = {name: sum(1 for r in plain if r[3] == rel.OK and r[4] == sid)
                            for name, sid in sessions.items()}
        view = {s["session"]: s for s in fleet.registry(ingress)["sessions"]}
        out["reach_at_ingress"] = {n: view.get(sid, {}).get("reach") for n, sid in sessions.items()}
        fleet.stop(ingress)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """`tests/natlab.py together --runs 20 --nat cone --nat symmetric` (as root): the
    started-together scenario N times per NAT mode; one line per run, a count at the end, and
    the runs as JSON with --out."""
    import reliability as rel
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("scenario", choices=["together"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--nat", action="append", choices=MODES, help="NAT mode (repeat; default both)")
    parser.add_argument("--seconds", type=float, default=10.0, help="load after the first SERVING")
    parser.add_argument("--within", type=float, default=5.0, help="a node must be served this soon after SERVING")
    parser.add_argument("--unrouted", action="store_true", help="no route to the private networks")
    parser.add_argument("--default-timings", action="store_true", help="the real defaults, not QUICK_TIMINGS")
    parser.add_argument("--out", help="write the runs as JSON here")
    parser.add_argument("--keep", help="copy a failed run's logs into this folder")
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        print(f"natlab: {why}")
        return 2
    timings = {} if args.default_timings else dict(rel.QUICK_TIMINGS)
    runs, passed = [], 0
    for mode in args.nat or list(MODES):
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="otela-natlab-") as tmp:
                try:
                    out = run_started_together(mode, tmp, timings, args.seconds, not args.unrouted, args.within)
                except (RuntimeError, TimeoutError) as exc:
                    out = {"scenario": f"started together, {mode}", "error": str(exc)}
                delays = out.get("served_after_serving_s", {})
                ok = ("error" not in out and out["plain_errors"] == 0 and len(delays) == 2
                      and all(d is not None and d <= args.within for d in delays.values()))
                if not ok and args.keep:            # its members' logs, for a look
                    kept = os.path.join(args.keep, f"{mode}-{i + 1}")
                    shutil.copytree(tmp, kept, ignore=shutil.ignore_patterns("*.sqlite*", "keys"))
                    out["logs"] = kept
            passed += ok
            runs.append(dict(out, mode=mode, run=i, ok=ok))
            print(f"{mode:9} run {i + 1:2}: {'ok  ' if ok else 'FAIL'} served after {delays} "
                  f"(SERVING seen at {out.get('serving_seen_after_s')}, requests {out.get('served_by')}) "
                  f"errors {out.get('plain_errors')}/{out.get('plain_requests')} {out.get('failed', out.get('error'))}",
                  flush=True)
    print(f"{passed} of {len(runs)} runs: both private nodes served within {args.within:g} s of SERVING, "
          f"0 requests failed")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(runs, fh, indent=1)
    return 0 if passed == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
