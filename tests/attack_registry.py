"""The registry attacks of a member holding only `cluster.key` (what every Slurm job holds).

Each attack seals ordinary gossip with the cluster key and sends it to an ingress's gossip
port on loopback, as a compromised compute job could: a key record it wrote itself (an admin
key with a token of its choosing), a real key re-published as admin, without its budget,
revoked, renamed or expired, and usage slots that inflate another user's use or freeze an
ingress's own slot. The ingress tier (crdt.Authority) must refuse every one of them: the test
and `make reliability` check what the ingress then does, not only that it said no.

    python tests/attack_registry.py --key-file K --gossip 127.0.0.1:PORT --db D.sqlite
prints one JSON line: the attacks sent and the token of the forged admin key.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sqlite3
import sys
import time
from typing import Any, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import crdt  # noqa: E402
import otela_node  # noqa: E402


def _real_keys(db_path: str) -> List[Tuple[str, Dict[str, Any]]]:
    """The key records the ingress holds (read from its --db, as an attacker on the same
    cluster learns them from gossip on a release before the planes)."""
    db = sqlite3.connect(db_path)
    try:
        import otela_ingress
        return list(otela_ingress.load_key_records(db).items())
    finally:
        db.close()


def forged_records(db_path: str, slot: str, now: float) -> Tuple[List[Dict[str, Dict[str, Any]]], str]:
    """One batch of records per attack, and the forged admin key's token."""
    token = "sk-otela-attacker-" + os.urandom(8).hex()
    digest = hashlib.sha256(token.encode()).hexdigest()
    batches: List[Dict[str, Dict[str, Any]]] = []
    admin = crdt.key_record("evil", "mallory", now, admin=True, version=5)
    batches.append({crdt.key_entry(digest): admin})
    batches.append({crdt.key_entry(digest): dict(admin, sig="0" * 64)})   # a made-up signature
    for key_hash, record in _real_keys(db_path):
        entry = crdt.key_entry(key_hash)
        newer = dict(crdt.unsigned(record), version=record["version"] + 100)
        newer.pop("budget_day", None)
        newer.pop("budget_month", None)
        batches.append({entry: dict(newer, admin=True)})                 # promoted, unbudgeted
        batches.append({entry: dict(newer, user="someone-else")})        # renamed: bills another
        batches.append({entry: dict(newer, expires=now - 1)})            # expired remotely
        batches.append({entry: crdt.revoked(dict(newer), now)})          # revoked
        day = crdt.time_day(now)
        for model, period in (("fm", day), (crdt.ALL_MODELS, day), (crdt.ALL_MODELS, day[:7])):
            big = crdt.usage_record(key_hash, model, period, crdt.new_session_id(), 1, 1, 10**12, 10**12)
            batches.append({crdt.usage_entry(key_hash, model, period, big["slot"]): big})   # inflated
            frozen = crdt.usage_record(key_hash, model, period, slot, 2**53 - 1, 0, 0, 0)
            batches.append({crdt.usage_entry(key_hash, model, period, slot): frozen})       # frozen slot
    return batches, token


def send(key_file: str, gossip: str, batches: List[Dict[str, Dict[str, Any]]]) -> int:
    """Each batch as one rumour datagram, sealed with the cluster key; returns how many."""
    config = otela_node.Config(key=otela_node.load_key(key_file))
    wire = otela_node.Wire(config.key, config)
    host, port = otela_node.split_addr(gossip)
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for batch in batches:
            sock.sendto(wire.seal({"t": "r", "r": batch}, time.time()), (host, port))
            sent += 1
            time.sleep(0.002)
    return sent


def flood_batches(keys: int, sessions: int, now: float, per: int = 8) -> List[Dict[str, Dict[str, Any]]]:
    """An insider's floods: `keys` valid-looking key records (unsigned: the cluster key is all it
    has) and `sessions` session records of members that do not exist (JOIN, no models, at
    addresses nobody listens on), `per` records to a datagram."""
    records: List[Tuple[str, Dict[str, Any]]] = []
    for i in range(keys):
        digest = hashlib.sha256(f"flood-{i}-{now}".encode()).hexdigest()
        records.append((crdt.key_entry(digest), crdt.key_record(f"f{i}", "mallory" * 30, now, allow=["m" * 200] * 5)))
    for i in range(sessions):
        addr = f"127.{64 + i // 65536 % 64}.{i // 256 % 256}.{i % 256}:9"
        records.append((crdt.new_session_id(), {"owner": "mallory@" + "x" * 200, "state": crdt.JOIN, "version": 0,
                                                "started": now, "role": "worker", "gossip": addr, "addr": addr}))
    return [dict(records[i:i + per]) for i in range(0, len(records), per)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--key-file", required=True)
    parser.add_argument("--gossip", required=True, help="the ingress's gossip HOST:PORT")
    parser.add_argument("--db", required=True, help="the ingress's --db (to name real keys)")
    parser.add_argument("--slot", default=crdt.new_session_id(), help="the ingress's session id")
    args = parser.parse_args()
    batches, token = forged_records(args.db, args.slot, time.time())
    print(json.dumps({"sent": send(args.key_file, args.gossip, batches), "token": token}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
