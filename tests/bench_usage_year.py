"""A year of dense usage at real ingresses: how fast a new or restarted ingress holds it all.

Issue 25's scale target with real processes on loopback: 5,000 API keys and a year of daily use
by 1,000 keys of 150 models each at 3 ingresses. The ingresses replicate per-key counters (the
models stay in each ingress's SQLite rows): for each of the 3 ingress sessions, each of the 1,000
keys, the kept days (crdt.USAGE_RETENTION_DAYS) and months (USAGE_RETENTION_MONTHS), 63,000
counters. Ingress A starts from a --db that holds them (written here, signed as an ingress would
have); then

  join     ingress B starts with an empty --db and --bootstrap A: seconds until B holds every
           entry of the ingress plane (A's /metrics otela_registry_entries{plane="ingress"});
  restart  B is stopped (SIGTERM) and started again on its --db: seconds until it holds them all.

Figures printed and written to OUT/bench_usage_year.json: each phase's seconds, B's CPU seconds
and peak RSS. Traffic: loopback only; processes and files removed at the end.

    python tests/bench_usage_year.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_ingress_support import free_port  # noqa: E402

import crdt  # noqa: E402
import otela_ingress  # noqa: E402

PY = sys.executable


def fill_db(path: str, secret: bytes, keys: int, active: int, now: float) -> int:
    """`keys` key records and the year of counters of the `active` first ones at 3 ingresses."""
    authority = crdt.Authority([secret])
    db = otela_ingress.open_db(path)
    digests = []
    for i in range(keys):
        _, digest, record = otela_ingress.new_key(f"user{i % 700}", [], False, 0.0, 0, 0, None)
        otela_ingress.store_key_record(db, digest, record)
        digests.append(digest)
    periods = [crdt.time_day(now - d * 86400.0) for d in range(crdt.USAGE_RETENTION_DAYS)]
    periods += sorted({crdt.time_day(now - d * 86400.0)[:7] for d in range(0, 400, 27)})[-crdt.USAGE_RETENTION_MONTHS:]
    rows = []
    for slot in (crdt.new_session_id() for _ in range(3)):
        for digest in digests[:active]:
            for period in periods:
                n = 30 * 150 if len(period) == 7 else 150   # 150 models a day, a month of days
                entry = crdt.usage_entry(digest, crdt.ALL_MODELS, period, slot)
                record = authority.sign(entry, crdt.usage_record(digest, crdt.ALL_MODELS, period, slot, n, n,
                                                                 2000 * n, 500 * n))
                rows.append((entry, crdt.encode(record).decode()))
    db.executemany("INSERT INTO usage_slots VALUES (?, ?)", rows)
    db.commit()
    db.close()
    return keys + len(rows)


def entries(port: int) -> Optional[int]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    found = re.search(r'^otela_registry_entries\{plane="ingress"\} (\d+)$', text, re.M)
    return int(found.group(1)) if found else None


def until_holds(port: int, want: int, limit: float) -> Optional[float]:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if (entries(port) or 0) >= want:
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def usage_of(pid: int) -> Dict[str, float]:
    """CPU seconds and peak RSS (MB) of a running process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return {"cpu_s": round((int(fields[11]) + int(fields[12])) / ticks, 2), "peak_rss_mb": round(peak / 1024, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 keys, 200 active (for tests)")
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--keep", default=None, help="copy the ingresses' logs into this directory")
    args = parser.parse_args()
    keys, active = (1000, 200) if args.quick else (5000, 1000)
    procs: List[subprocess.Popen] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with tempfile.TemporaryDirectory(prefix="otela-year-") as tmp:
        subprocess.run([PY, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", tmp], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        secret = otela_ingress.ingress_secrets(os.path.join(tmp, "ingress.key"), os.path.join(tmp, "cluster.key"))[0]
        t0 = time.monotonic()
        want = fill_db(os.path.join(tmp, "a.sqlite"), secret, keys, active, time.time())
        fill_s = time.monotonic() - t0
        ports = {name: (free_port(), free_port()) for name in "ab"}

        def start(name: str, bootstrap: Optional[str] = None) -> subprocess.Popen:
            listen, gossip = ports[name]
            argv = [PY, os.path.join(ROOT, "otela_ingress.py"), "serve", "--key-file", os.path.join(tmp, "cluster.key"),
                    "--listen", f"127.0.0.1:{listen}", "--gossip", f"127.0.0.1:{gossip}",
                    "--db", os.path.join(tmp, f"{name}.sqlite")]
            if bootstrap:
                argv += ["--bootstrap", bootstrap]
            log = open(os.path.join(tmp, f"{name}.log"), "ab")
            proc = subprocess.Popen(argv, stdout=log, stderr=log, env=dict(os.environ, OTELA_LOG_LEVEL="WARNING"))
            procs.append(proc)
            return proc

        results: Dict[str, object] = {"api_keys": keys, "active_keys": active, "models": 150, "ingresses": 3,
                                      "usage_counters": want - keys, "entries": want, "db_written_s": round(fill_s, 1)}
        try:
            start("a")
            took = until_holds(ports["a"][0], want, 300)
            results["a_from_its_db_s"] = round(took, 2) if took is not None else None
            b = start("b", f"127.0.0.1:{ports['a'][1]}")
            took = until_holds(ports["b"][0], want, 300)
            results["b_joined_s"] = round(took, 2) if took is not None else None
            results["b_after_join"] = usage_of(b.pid)
            time.sleep(2.0)   # B's ledger thread writes what it took to its --db
            b.send_signal(signal.SIGTERM)
            b.wait(30)
            b = start("b", f"127.0.0.1:{ports['a'][1]}")
            took = until_holds(ports["b"][0], want, 300)
            results["b_restarted_s"] = round(took, 2) if took is not None else None
            results["b_after_restart"] = usage_of(b.pid)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                for name in "ab":
                    shutil.copy(os.path.join(tmp, f"{name}.log"), args.keep)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_usage_year.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"a year of usage at real ingresses: {keys:,} keys, {results['usage_counters']:,} counters "
          f"({active:,} keys x 150 models x 3 ingresses, {crdt.USAGE_RETENTION_DAYS} days + "
          f"{crdt.USAGE_RETENTION_MONTHS} months kept): A holds them {results['a_from_its_db_s']} s after its start; "
          f"a new ingress B {results['b_joined_s']} s after its start ({results['b_after_join']}); B restarted "
          f"{results['b_restarted_s']} s ({results['b_after_restart']})", flush=True)
    return 0 if all(results[k] is not None for k in ("a_from_its_db_s", "b_joined_s", "b_restarted_s")) else 1


if __name__ == "__main__":
    sys.exit(main())
