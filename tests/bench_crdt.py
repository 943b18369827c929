"""Registry benchmark: merge throughput, digest and diff sizes, memory per session, and what
binding records to their writers costs (a grant's key binds each record; an ingress checks
the grant and the binding of each record it merges).

Prints one line per size and writes bench-results/crdt.json. Figures, never assertions.
    python tests/bench_crdt.py [--out DIR] [--quick]
"""
import argparse
import gc
import json
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import crdt  # noqa: E402


def make_record(i, version=1):
    return {"owner": f"user{i % 50}@nid{i:05d}", "state": crdt.SERVING, "version": version,
            "started": 1.7e9 + i, "role": "worker", "addr": f"10.0.{i // 250}.{i % 250}:7700",
            "gossip": f"10.0.{i // 250}.{i % 250}:7946", "models": ["meta-llama/Llama-3.1-8B-Instruct"],
            "hardware": {"gpu": "NVIDIA GH200 480GB", "count": 4, "memory_gb": 96},
            "labels": {"cluster": "clariden", "tenant": "swiss-ai"}, "code_hash": "ab" * 8}


def bench(n, repeats):
    ids = [f"{i:032x}" for i in range(n)]
    records = [(sid, make_record(i)) for i, sid in enumerate(ids)]
    best = float("inf")
    for _ in range(repeats):
        gmap = crdt.GMap()
        t0 = time.perf_counter()
        gmap.merge(records)
        best = min(best, time.perf_counter() - t0)
    merge_rate = n / best
    # re-merging known records (the common gossip case: duplicates)
    t0 = time.perf_counter()
    gmap.merge(records)
    dup_rate = n / (time.perf_counter() - t0)

    other = crdt.GMap()
    other.merge(records)
    changed = max(1, n // 100)               # 1% of sessions changed on one side
    other.merge([(ids[i], make_record(i, version=2)) for i in range(changed)])
    root = crdt.dumps(gmap.digest())
    buckets = crdt.dumps(gmap.digest(buckets=True))
    differing = other.differing_buckets(gmap.digest(buckets=True))
    summary = crdt.dumps(gmap.summary(differing))
    delta = other.diff(crdt.loads(summary))
    delta_bytes = len(crdt.dumps(delta))
    full = len(crdt.dumps(dict(other.items())))
    t0 = time.perf_counter()
    for _ in range(100):
        gmap.digest(buckets=True)
    digest_us = (time.perf_counter() - t0) / 100 * 1e6

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fresh = crdt.GMap()
    fresh.merge([(sid, make_record(i)) for i, sid in enumerate(ids)])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"sessions": n, "merge_records_per_s": round(merge_rate),
            "remerge_duplicates_per_s": round(dup_rate),
            "digest_root_bytes": len(root), "digest_buckets_bytes": len(buckets),
            "digest_buckets_us": round(digest_us, 1), "changed_sessions": changed,
            "differing_buckets": len(differing), "summary_bytes": len(summary),
            "diff_records": len(delta), "diff_bytes": delta_bytes, "full_state_bytes": full,
            "memory_bytes_per_session": round(used / n)}


def bench_binding(n):
    """Granted, bound records: the writer's cost to bind one, and an ingress's merge of n of them
    (each grant and binding checked) against the same merge with no checks."""
    tier = crdt.Authority([b"i" * 32])
    ids = [f"{i:032x}" for i in range(n)]
    grants = [tier.issue(["meta-llama/Llama-3.1-8B-Instruct"], {"cluster": "clariden"}, str(i), 2e9, 1.7e9)
              for i in range(n)]
    t0 = time.perf_counter()
    records = [(sid, crdt.bound(key, sid, dict(make_record(i), grant=grant)))
               for i, (sid, (grant, key)) in enumerate(zip(ids, grants))]
    bind_us = (time.perf_counter() - t0) / n * 1e6
    plain = crdt.GMap()
    t0 = time.perf_counter()
    plain.merge(records)
    plain_s = time.perf_counter() - t0
    checked = crdt.GMap()
    checked.binder = crdt.Binder(tier)
    t0 = time.perf_counter()
    checked.merge(records)
    checked_s = time.perf_counter() - t0
    return {"sessions": n, "bind_us_per_record": round(bind_us, 1),
            "merge_unchecked_s": round(plain_s, 3), "merge_checked_s": round(checked_s, 3),
            "check_us_per_record": round((checked_s - plain_s) / n * 1e6, 1), "held": len(checked),
            "refused": dict(checked.refused)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = [bench(n, 1 if args.quick else 3) for n in (100, 1000, 10000)]
    print(f"crdt (orjson={'yes' if sys.modules.get('orjson') else 'no'})")
    for r in rows:
        print(f"  {r['sessions']:>6} sessions: merge {r['merge_records_per_s']:>9,} rec/s, "
              f"duplicates {r['remerge_duplicates_per_s']:>9,} rec/s, root digest "
              f"{r['digest_root_bytes']} B, bucket digest {r['digest_buckets_bytes']:,} B, "
              f"1% changed -> summary {r['summary_bytes']:,} B + diff {r['diff_records']} rec "
              f"{r['diff_bytes']:,} B (full state {r['full_state_bytes']:,} B), "
              f"{r['memory_bytes_per_session']:,} B/session")
    binding = [bench_binding(n) for n in ((1000, 10000) if args.quick else (1000, 10000, crdt.MAX_SESSIONS))]
    for r in binding:
        print(f"  binding, {r['sessions']:>6} granted sessions: bind {r['bind_us_per_record']} us/record at its "
              f"writer; an ingress's merge {r['merge_checked_s']} s checked vs {r['merge_unchecked_s']} s "
              f"unchecked ({r['check_us_per_record']} us/record for the grant and binding)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "crdt.json"), "w") as f:
        json.dump({"orjson": bool(sys.modules.get("orjson")), "sizes": rows, "binding": binding}, f, indent=2)


if __name__ == "__main__":
    main()
