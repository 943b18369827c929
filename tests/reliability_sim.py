"""The overlay's reliability scenarios in the simulator (tests/simnet.py): 128
members in one process on a fake clock, with loss, partitions, restarts and a lagging member.

    python tests/reliability_sim.py [--quick]     # prints the rows; `make reliability` shows them
                                                  # in its one table

Each scenario returns one row: scenario, load, faults, client errors, stale routes, time to
heal, data lost (plus the figures behind them). "Stale routes" counts sessions that a live
member still lists as routable (SERVING, unsuspected) although their process is gone, or that
it does not list although their process is alive, once the scenario has settled; "data lost"
counts sessions of members alive throughout that ended LEFT (evicted while healthy).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import simnet  # noqa: E402

import crdt  # noqa: E402
import otela_node as on  # noqa: E402

N = 128


def network(n: int = N, seed: int = 1, loss: float = 0.0, settle: float = 15.0,
            roles: Optional[Dict[int, str]] = None) -> simnet.SimulatedNetwork:
    """n members bootstrapping to the first (the ingress when roles say so), settled."""
    net = simnet.SimulatedNetwork(seed=seed, loss=loss)
    roles = roles or {}
    first = net.add(role=roles.get(0, "worker"))
    for i in range(1, n):
        net.add([first.addr], role=roles.get(i, "worker"))
    net.run(settle)
    return net


def routable(member: on.Overlay) -> Dict[str, str]:
    """sid -> gossip address of the sessions `member` would route to (or gossip with)."""
    return {sid: r["gossip"] for sid, r in member.map.items()
            if r["state"] < crdt.LEFT and not member.is_suspected(sid)}


def converged(net: simnet.SimulatedNetwork) -> bool:
    """One registry everywhere, in which every live process has exactly its current session
    live and unsuspected, and no dead one is routable."""
    live = net.live()
    if len({m.map.digest()["root"] for m in live}) != 1:
        return False
    want = {m.sid: m.addr for m in live}
    return all(routable(m) == want for m in live)


def stale_routes(net: simnet.SimulatedNetwork) -> int:
    want = {m.sid: m.addr for m in net.live()}
    stale = 0
    for m in net.live():
        seen = routable(m)
        stale += len(set(seen) ^ set(want))
    return stale


def time_to(net: simnet.SimulatedNetwork, predicate, limit: float, step: float = 0.05) -> float:
    start = net.now
    while not predicate():
        if net.now - start >= limit:
            return math.inf
        net.run(step)
    return net.now - start


def healthy_evicted(net: simnet.SimulatedNetwork, sids: List[str]) -> int:
    """How many of these sessions (of processes alive throughout) some live member holds LEFT."""
    left = set()
    for m in net.live():
        for sid in sids:
            r = m.map.get(sid)
            if r is not None and r["state"] == crdt.LEFT:
                left.add(sid)
    return len(left)


def row(scenario: str, load: str, faults: str, heal: float, stale: int, lost: int, **extra) -> Dict[str, Any]:
    out = {"scenario": scenario, "load": load, "faults": faults, "client_errors": "n/a (sim)",
           "stale_routes": stale, "time_to_heal_s": None if math.isinf(heal) else round(heal, 2),
           "data_lost": lost}
    out.update(extra)
    return out


# ---------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------
def partition(split_s: float, seed: int = 1) -> Dict[str, Any]:
    """Two halves of 128 cut apart for split_s, then healed: time until one registry with every
    live session routable everywhere; healthy sessions evicted."""
    net = network(seed=seed)
    addrs = list(net.members)
    sids = [m.sid for m in net.live()]
    net.partition(addrs[: N // 2], addrs[N // 2:])
    net.run(split_s)
    net.heal()
    heal = time_to(net, lambda: converged(net), 120.0)
    net.run(5.0)
    return row(f"partition {split_s:g} s (sim)", f"{N} members idle", "two halves cut, then healed",
               heal, stale_routes(net), healthy_evicted(net, sids) + sum(m.sid not in sids for m in net.live()))


def restart(kill9: bool, down_s: float, seed: int = 2) -> Dict[str, Any]:
    """The README's set-up: an ingress without bootstrap, every node bootstrapping to it. The
    ingress stops (LEFT, or killed), comes back at the same address after down_s with a new
    session and no bootstrap: time from its start until it routes to every node again."""
    net = network(seed=seed, roles={0: "ingress"})
    ingress = net.live()[0]
    addr = ingress.addr
    if not kill9:
        net.send(addr, ingress.leave(net.now))
        net.run(0.5)
    net.kill(addr)
    net.run(down_s)
    new = net.add(addr=addr, role="ingress")
    want = {m.sid for m in net.live() if m is not new}
    heal = time_to(net, lambda: want <= set(routable(new)), 60.0)
    settle = time_to(net, lambda: converged(net), 60.0)
    return row(f"ingress restart, {'kill -9' if kill9 else 'SIGTERM'}, {down_s:g} s down (sim)",
               f"{N - 1} nodes", "ingress restarted without --bootstrap", heal, stale_routes(net), 0,
               time_to_one_registry_s=None if math.isinf(settle) else round(heal + settle, 2))


def write_tail(loss: float, n: int = N, writes: int = 20, seed: int = 3) -> Dict[str, Any]:
    """`writes` owner writes at random members; the time each takes to reach every member."""
    net = network(n=n, seed=seed, loss=loss)
    rng = random.Random(seed)
    delays = []
    for i in range(writes):
        writer = rng.choice(net.live())
        t0 = net.now
        seen = len(net.changes)
        net.send(writer.addr, writer.update(net.now, labels={"w": str(i)}))
        version = writer.record["version"]

        def everywhere(writer=writer, version=version):
            return all((m.map.get(writer.sid) or {}).get("version", -1) >= version for m in net.live())
        time_to(net, everywhere, 30.0, step=0.05)
        arrivals = {at: t for t, at, sid, rec in net.changes[seen:]
                    if sid == writer.sid and rec is not None and rec.get("version", -1) >= version}
        delays.append(max(arrivals.values()) - t0 if len(arrivals) >= n - 1 else math.inf)
        net.run(max(0.0, 1.0 - (net.now - t0)))
    delays.sort()
    return row(f"write to {n}, {loss:.0%} loss (sim)", f"{writes} writes", f"{loss:.0%} datagram loss",
               delays[-1], 0, 0, p50_ms=round(delays[len(delays) // 2] * 1000, 1),
               max_ms=round(delays[-1] * 1000, 1))


def detection(trials: int = 10, loss: float = 0.0, seed: int = 4) -> Dict[str, Any]:
    """kill -9 one member: the time until every other member suspects it (p50/p99 over trials)."""
    times = []
    for t in range(trials):
        net = network(seed=seed + t, loss=loss)
        victim = random.Random(t).choice(net.live()[1:])
        net.kill(victim.addr)
        t0 = net.now
        for m in net.live():
            done = time_to(net, lambda m=m, v=victim.sid: m.is_suspected(v) or
                           (m.map.get(v) or {}).get("state") == crdt.LEFT, 30.0, step=0.02)
            times.append(net.now - t0 if not math.isinf(done) else math.inf)
    times.sort()
    p99 = times[int(0.99 * (len(times) - 1))]
    return row(f"failure -> suspected everywhere, {N} (sim)", f"{trials} kills", f"kill -9, {loss:.0%} loss",
               times[-1], 0, 0, p50_s=round(times[len(times) // 2], 2), p99_s=round(p99, 2),
               max_s=round(times[-1], 2))


def steady(minutes: float, loss: float = 0.0, slow: bool = False, seed: int = 5) -> Dict[str, Any]:
    """Idle for `minutes` under loss or with one member lagging 0.3-1.5 s: false evictions,
    refutations and idle traffic per member."""
    net = network(seed=seed, loss=loss)
    sids = [m.sid for m in net.live()]
    if slow:
        net.slow[net.live()[7].addr] = (0.3, 1.5)
    before = sum(net.bytes_sent.values())
    refutes0 = sum(m.record["version"] for m in net.live())
    suspected_time = 0.0
    seconds = minutes * 60
    step = 1.0
    for _ in range(int(seconds / step)):
        net.run(step)
        suspected_time += step * sum(len(m.suspects) for m in net.live()) / N
    rate = (sum(net.bytes_sent.values()) - before) / seconds / N / 1000
    refutes = sum(m.record["version"] for m in net.live()) - refutes0
    faults = ("one member lagging 0.3-1.5 s" if slow else f"{loss:.0%} datagram loss")
    return row(f"idle {minutes:g} min, {faults} (sim)", f"{N} members idle", faults, 0.0,
               stale_routes(net), healthy_evicted(net, sids), idle_kb_s_per_member=round(rate, 3),
               refutations=refutes, suspected_session_s_per_member=round(suspected_time, 1))


def rows(quick: bool = False) -> List[Dict[str, Any]]:
    minutes = 1.0 if quick else 10.0
    out = [partition(60.0), partition(2.0), restart(False, 9.0), restart(True, 9.0), restart(True, 0.5)]
    out += [write_tail(loss) for loss in (0.0, 0.01, 0.05, 0.20)]
    if not quick:
        out.append(write_tail(0.20, n=300, writes=5))
    out.append(detection(trials=3 if quick else 10))
    out += [steady(minutes, loss=0.05), steady(minutes, loss=0.20), steady(minutes, slow=True)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in rows(args.quick):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
