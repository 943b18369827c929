"""Registry at scale, in the simulator: figures, not assertions.

    python tests/bench_registry.py [--quick] [--out bench-results]

Phases:
  churn     one replica's map through 24 simulated hours of 1,000 sessions with 10 %/min churn
            (100 leave and 100 join a minute), compacted every minute: entries, bytes of
            records, remembered ids, and the largest piece of a join answer.
  joiner    a member joining a settled overlay of N members (plus that churn's tombstones):
            simulated seconds until its routing plane equals the seed's, largest message.
  storm     N members joining through one seed at the same instant: CPU seconds in the seed,
            the busiest joiner and all members' code until every member holds every session.
  planes    3 ingresses and N workers; the ingresses publish usage slots at 30 a second and
            hold 5,000 API keys: bytes a second a worker receives (against the same overlay
            idle), ingress-plane entries on workers, and a restarted ingress's catch-up time.
  fanout    bytes a member receives for one write above 256 members: pushed by the writer to
            every member (origin_fanout's default) or as a rumour (256, the limit before).
Writes <out>/registry.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import simnet  # noqa: E402

import crdt  # noqa: E402
import otela_node as on  # noqa: E402

T0 = 1_700_000_000.0
TIER = b"t" * 32


class MeteredNetwork(simnet.SimulatedNetwork):
    """The simulator, counting bytes each member receives and the largest message sent."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.received = {}
        self.largest = 0

    def send(self, src, outs):
        for o in outs:
            size = len(crdt.dumps(o.msg)) + on.ENVELOPE
            self.largest = max(self.largest, size)
            self.received[o.addr] = self.received.get(o.addr, 0) + size
        super().send(src, outs)


def session(i: int, now: float, state=crdt.SERVING) -> dict:
    return {"owner": f"u{i % 50}@node{i}", "state": state, "version": 1, "started": now, "role": "worker",
            "gossip": f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}:7946",
            "addr": f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}:7700", "models": ["meta-llama/Llama-3.1-8B-Instruct"],
            "hardware": {"gpu": "NVIDIA H100 80GB HBM3", "count": 4, "memory_gb": 79.6},
            "labels": {"partition": "normal"}, "code_hash": "0123456789abcdef"}


def churn_phase(quick: bool, results: dict) -> dict:
    hours = 2 if quick else 24
    gmap = crdt.GMap()
    rng = random.Random(1)
    live, n = [], 0
    now = T0
    for _ in range(1000):
        sid = f"{n:032x}"
        gmap.put(sid, session(n, now))
        live.append(sid)
        n += 1
    peak = {"entries": 0, "record_bytes": 0, "remembered": 0}
    t0 = time.process_time()
    for minute in range(hours * 60):
        now += 60.0
        for sid in rng.sample(live, 100):
            gmap.put(sid, dict(gmap.get(sid), state=crdt.LEFT, left_at=now - rng.uniform(0, 60), version=2))
            live.remove(sid)
        for _ in range(100):
            sid = f"{n:032x}"
            gmap.put(sid, session(n, now))
            live.append(sid)
            n += 1
        gmap.compact(now)
        if minute % 30 == 29:
            size = sum(len(crdt.encode(r)) for _, r in gmap.all_items())
            peak = {"entries": max(peak["entries"], len(gmap)), "record_bytes": max(peak["record_bytes"], size),
                    "remembered": max(peak["remembered"], len(gmap._forgotten))}
    member = on.Overlay(on.Config(key=b"k" * 32), "f" * 32, session(10**6, now), now)
    member.map.merge(list(gmap.all_items()))
    pieces = member.receive({"t": "j", "r": {}}, "10.9.9.9:7946", now, tcp=True)
    state_bytes = peak["record_bytes"] + peak["remembered"] * 48   # an id and a time remembered
    out = {"hours": hours, "sessions_seen": n, **peak, "state_bytes_per_worker": state_bytes,
           "join_answer_pieces": len(pieces),
           "largest_piece_bytes": max(len(crdt.dumps(o.msg)) for o in pieces) + on.ENVELOPE,
           "cpu_s": round(time.process_time() - t0, 1)}
    results["churn"] = out
    print(f"churn {hours} h, 1,000 sessions, 10 %/min: at most {peak['entries']} entries, "
          f"{peak['record_bytes'] / 1e6:.2f} MB of records, {peak['remembered']} ids remembered "
          f"(~{state_bytes / 1e6:.2f} MB per worker); a join answer in {len(pieces)} pieces, the largest "
          f"{out['largest_piece_bytes'] / 1024:.0f} KiB", flush=True)
    return gmap


def settled(n: int, cfg: on.Config, tombstones=None, seed: int = 5) -> MeteredNetwork:
    """N members whose registries are pre-seeded (a join storm is the storm phase's), settled."""
    net = MeteredNetwork(seed=seed, config=cfg)
    members = [net.add() for _ in range(n)]
    records = {m.sid: m.record for m in members}
    for m in members:
        m.map.merge(records)
        if tombstones:
            m.map.merge(tombstones)
        for sid, rec in records.items():
            m._track(sid, rec, net.now)
    net.run(3.0)
    return net


def converged(a: on.Overlay, b: on.Overlay, plane=crdt.ROUTING) -> bool:
    return a.map.digest(plane=plane)["root"] == b.map.digest(plane=plane)["root"]


def run_until(net, done, limit: float, step: float = 0.1) -> float:
    start = net.now
    while net.now - start < limit:
        net.run(step)
        if done():
            return net.now - start
    return float("inf")


def joiner_phase(quick: bool, results: dict, churned: crdt.GMap) -> None:
    n = 300 if quick else 1000
    tombstones = [(sid, r) for sid, r in churned.all_items() if r["state"] == crdt.LEFT]
    net = settled(n, on.Config(key=b"k" * 32), tombstones)
    seed = net.live()[0]
    net.largest = 0
    joiner = net.add([seed.addr])
    took = run_until(net, lambda: converged(joiner, seed), 60.0)
    results["joiner"] = {"members": n, "tombstones": len(tombstones), "catch_up_s": round(took, 2),
                         "largest_message_bytes": net.largest}
    print(f"joiner, {n} members and {len(tombstones)} LEFT records: caught up in {took:.2f} simulated s; "
          f"largest message {net.largest / 1024:.0f} KiB", flush=True)


class Timed:
    """CPU seconds spent in the members' own code (receive, tick): what real nodes would spend,
    without the simulator's queue and its per-message size accounting."""

    def __init__(self):
        self.cpu = 0.0
        self.by_member: dict = {}

    def wrap(self, member: on.Overlay) -> None:
        for name in ("receive", "tick"):
            inner = getattr(member, name)

            def timed(*args, _inner=inner, _addr=member.addr, **kw):
                t = time.process_time()
                try:
                    return _inner(*args, **kw)
                finally:
                    spent = time.process_time() - t
                    self.cpu += spent
                    self.by_member[_addr] = self.by_member.get(_addr, 0.0) + spent
            setattr(member, name, timed)


def storm_phase(quick: bool, results: dict) -> None:
    n = 300 if quick else 1000
    net = MeteredNetwork(seed=9, config=on.Config(key=b"k" * 32))
    timed = Timed()
    t0 = time.process_time()
    seed = net.add()
    timed.wrap(seed)
    members = []
    for _ in range(n - 1):
        members.append(net.add([seed.addr]))
        timed.wrap(members[-1])
    took = run_until(net, lambda: all(len(m.map) == n for m in members[:: max(1, n // 50)]) and len(seed.map) == n,
                     120.0, step=0.5)
    cpu = time.process_time() - t0
    seed_cpu = timed.by_member.get(seed.addr, 0.0)
    busiest = max(v for a, v in timed.by_member.items() if a != seed.addr)
    results["storm"] = {"members": n, "converged_s": round(took, 1), "cpu_s": round(cpu, 1),
                        "members_cpu_s": round(timed.cpu, 1), "seed_cpu_s": round(seed_cpu, 2),
                        "busiest_joiner_cpu_s": round(busiest, 2)}
    print(f"join storm, {n} members through one seed: every sampled member holds all {n} sessions after "
          f"{took:.1f} simulated s; CPU: the seed {seed_cpu:.2f} s, the busiest joiner {busiest:.2f} s, all "
          f"members together {timed.cpu:.1f} s ({cpu:.1f} s with the simulator's own)", flush=True)


def planes_phase(quick: bool, results: dict) -> None:
    n = 100 if quick else 300
    cfg = on.Config(key=b"k" * 32)
    tier = on.Config(key=b"k" * 32, ingress_keys=[TIER])
    net = settled(n, cfg)
    ingresses = [net.add([net.live()[0].addr], config=tier, role="ingress") for _ in range(3)]
    net.run(5.0)
    workers = [m for m in net.live() if m not in ingresses]
    rng = random.Random(3)
    keys = [hashlib.sha256(f"sk-{i}".encode()).hexdigest() for i in range(5000 if not quick else 1000)]
    for i, digest in enumerate(keys):
        writer = ingresses[i % 3]
        net.send(writer.addr, writer.publish(crdt.key_entry(digest), crdt.key_record(f"k{i}", f"user{i % 700}",
                                                                                     net.now), net.now))
    net.run(5.0)
    # A year of dense use (1,000 keys x 150 models every day, at 3 ingresses) as the ingresses
    # replicate it: per key, the kept days' and months' counters of each ingress (the models are
    # in each ingress's SQLite rows, not here). Written straight into the three maps, signed.
    authority = crdt.Authority([TIER])
    year = []
    t0 = time.perf_counter()
    periods = [crdt.time_day(net.now - d * 86400.0) for d in range(crdt.USAGE_RETENTION_DAYS)]
    periods += sorted({crdt.time_day(net.now - d * 86400.0)[:7] for d in range(0, 396, 28)})[-crdt.USAGE_RETENTION_MONTHS:]
    for ing in ingresses:
        for digest in keys[:1000]:
            for period in periods:
                scale = 30 if len(period) == 7 else 1
                entry = crdt.usage_entry(digest, crdt.ALL_MODELS, period, ing.sid)
                year.append((entry, authority.sign(entry, crdt.usage_record(
                    digest, crdt.ALL_MODELS, period, ing.sid, 150 * scale, 150 * scale, 10**5 * scale, 10**4 * scale))))
    for ing in ingresses:
        ing.map.merge(year)
    load_s = time.perf_counter() - t0
    net.run(5.0)

    def window(seconds: float, publish: bool) -> float:
        before = sum(net.received.get(w.addr, 0) for w in workers)
        start = net.now
        version = {}
        while net.now - start < seconds:
            if publish:
                for _ in range(3):                  # 30 slot writes a second from the three ingresses
                    ing = rng.choice(ingresses)
                    digest = rng.choice(keys[:1000])
                    day = crdt.time_day(net.now)
                    for period in (day, day[:7]):
                        entry = crdt.usage_entry(digest, crdt.ALL_MODELS, period, ing.sid)
                        v = version[entry] = version.get(entry, 150 * 30) + 1
                        record = crdt.usage_record(digest, crdt.ALL_MODELS, period, ing.sid, v, v, 100 * v, 50 * v)
                        net.send(ing.addr, ing.publish(entry, record, net.now))
            net.run(0.1)
        return (sum(net.received.get(w.addr, 0) for w in workers) - before) / len(workers) / seconds

    idle = window(20.0, publish=False)
    busy = window(20.0, publish=True)
    on_workers = sum(w.map.plane_size(crdt.INGRESS) for w in workers)
    net.kill(ingresses[2].addr)
    net.run(2.0)
    cpu = time.process_time()
    restarted = net.add([ingresses[0].addr], config=tier, role="ingress")
    took = run_until(net, lambda: converged(restarted, ingresses[0], crdt.INGRESS), 120.0, step=0.25)
    cpu = time.process_time() - cpu
    results["planes"] = {"workers": n, "api_keys": len(keys), "idle_bytes_per_worker_s": round(idle, 1),
                         "publishing_bytes_per_worker_s": round(busy, 1), "ingress_entries_on_workers": on_workers,
                         "ingress_entries": ingresses[0].map.plane_size(crdt.INGRESS),
                         "year_of_usage_counters": len(year), "year_written_in_s": round(load_s, 2),
                         "usage_days_kept": crdt.USAGE_RETENTION_DAYS, "usage_months_kept": crdt.USAGE_RETENTION_MONTHS,
                         "restarted_ingress_catch_up_s": round(took, 2), "catch_up_cpu_s": round(cpu, 2)}
    print(f"planes, {n} workers, 3 ingresses, {len(keys)} keys, a year of usage ({len(year)} counters: "
          f"{crdt.USAGE_RETENTION_DAYS} days and {crdt.USAGE_RETENTION_MONTHS} months x 1,000 keys x 3 ingresses), "
          f"30 usage slots/s: a worker receives {busy:.0f} B/s (idle {idle:.0f} B/s) and holds {on_workers} "
          f"ingress entries; a restarted ingress holds all {ingresses[0].map.plane_size(crdt.INGRESS)} after "
          f"{took:.2f} simulated s ({cpu:.1f} s of CPU for the whole simulated cluster meanwhile)", flush=True)


def fanout_phase(quick: bool, results: dict) -> None:
    """Bytes each member receives for one write, pushed by its writer to all (origin_fanout at
    its default) or as a rumour (origin_fanout 256, the limit before), above 256 members."""
    n = 300 if quick else 600
    out = {}
    for fanout in (256, on.Config().origin_fanout):
        net = settled(n, on.Config(key=b"k" * 32, origin_fanout=fanout))
        base = sum(net.received.values())
        net.run(4.0)
        idle = sum(net.received.values()) - base
        base = sum(net.received.values())
        members = net.live()
        for k in range(5):
            writer = members[k * 7]
            net.send(writer.addr, writer.update(net.now, labels={"w": str(k)}))
            net.run(0.8)
        per_write = (sum(net.received.values()) - base - idle) / 5 / n
        reached = sum(1 for m in members if (m.map.get(members[28].sid).get("labels") or {}).get("w") == "4")
        out[str(fanout)] = {"bytes_per_member_per_write": round(per_write), "reached": reached}
        print(f"fanout, {n} members, origin_fanout {fanout}: {per_write:.0f} bytes per member per write, "
              f"the last write reached {reached}/{n}", flush=True)
    results["fanout"] = dict(out, members=n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("churn", "joiner", "storm", "planes", "fanout"))
    args = parser.parse_args()
    results: dict = {}
    churned = None
    if args.only in (None, "churn", "joiner"):
        churned = churn_phase(args.quick, results)
    if args.only in (None, "joiner"):
        joiner_phase(args.quick, results, churned)
    if args.only in (None, "storm"):
        storm_phase(args.quick, results)
    if args.only in (None, "planes"):
        planes_phase(args.quick, results)
    if args.only in (None, "fanout"):
        fanout_phase(args.quick, results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "registry.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
