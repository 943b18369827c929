"""Mixed versions: clusters upgrade one Slurm job at a time.

The release before authority in tiers and the registry in planes (PREVIOUS_RELEASE, read out
of this repository's history) runs beside this one, as real processes on loopback: a new
ingress with an old and a new node, and an old ingress with new nodes. Each cluster serves
every request, from both kinds of node.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_ingress_support import Client, Cluster, free_port

pytestmark = pytest.mark.slow
PREVIOUS_RELEASE = "65a6477"   # main before the ingress tier and the planes
FILES = ("otela_node.py", "crdt.py", "otela_ingress.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = f"{sys.executable} tests/fake_engine.py --model fm --port"


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """A folder with the previous release's files, or a skip where history is not at hand."""
    folder = tmp_path_factory.mktemp("previous")
    for name in FILES:
        shown = subprocess.run(["git", "-C", ROOT, "show", f"{PREVIOUS_RELEASE}:{name}"],
                               capture_output=True, timeout=60)
        if shown.returncode != 0:
            pytest.skip(f"the previous release ({PREVIOUS_RELEASE}) is not in this clone's history "
                        "(a shallow clone?): git fetch --unshallow")
        (folder / name).write_bytes(shown.stdout)
    return str(folder)


def engine_requests(port: int) -> int:
    client = Client(f"http://127.0.0.1:{port}")
    try:
        return json.loads(client.request("GET", "/fake/stats")[2])["requests"]
    finally:
        client.close()


def serve_from_both(cluster: Cluster, roots, n: int = 60):
    """Start one node per root; n chat requests through the ingress: their statuses, and how
    many each engine got."""
    ports = []
    for i, root in enumerate(roots):
        port = free_port()
        cluster.node(f"node{i}", f"{ENGINE} {port}", port, "fm", root=root)
        ports.append(port)
    client = Client(cluster.url, cluster.token)
    statuses = [client.chat("fm")[0] for _ in range(n)]
    client.close()
    return statuses, [engine_requests(p) for p in ports]


def test_a_new_ingress_serves_through_nodes_of_the_previous_release_and_of_this_one(tmp_path, previous):
    # the upgrade's middle step (README): ingresses first, believing jobs without a grant
    cluster = Cluster(str(tmp_path), policy="round_robin", ingress_flags=("--allow-ungranted",))
    try:
        statuses, served = serve_from_both(cluster, [previous, None])
        assert statuses == [200] * len(statuses)
        assert all(n > 0 for n in served)
    finally:
        cluster.close()


def test_an_ingress_of_the_previous_release_serves_through_nodes_of_this_one(tmp_path, previous):
    cluster = Cluster(str(tmp_path), policy="round_robin", ingress_root=previous)
    try:
        statuses, served = serve_from_both(cluster, [None, None, previous])
        assert statuses == [200] * len(statuses)
        assert all(n > 0 for n in served)
    finally:
        cluster.close()


def member_of(release: str, folder):
    """A folder with a member's files (otela_node.py, crdt.py) of `release`, or a skip."""
    folder.mkdir()
    for name in ("otela_node.py", "crdt.py"):
        shown = subprocess.run(["git", "-C", ROOT, "show", f"{release}:{name}"], capture_output=True, timeout=60)
        if shown.returncode != 0:
            pytest.skip(f"{release} is not in this clone's history (a shallow clone?)")
        (folder / name).write_bytes(shown.stdout)
    return folder


BEFORE_VOUCHERS = "ae5ad5f"   # main before evictions carried their confirmers' vouchers
OLD_MEMBER = """
import sys
import crdt, otela_node as on
new = __import__("json").loads(sys.stdin.read())
member = on.Overlay(on.Config(key=b"k" * 32), "b" * 32, {"owner": "me", "state": crdt.SERVING, "version": 0,
                    "started": 1.0, "gossip": "10.0.0.2:7946"}, 1.0)
member.receive({"t": "r", "r": {"a" * 32: new["victim"]}}, "10.0.0.3:7946", 2.0)
member.receive(new["rumour"], "10.0.0.3:7946", 2.0)          # a suspicion and its voucher
print(sorted(member.suspects["a" * 32].confirmers))
crdt.validate("a" * 32, new["eviction"])
member.receive({"t": "r", "r": {"a" * 32: new["eviction"]}}, "10.0.0.3:7946", 3.0)
print(crdt.STATE_NAMES[member.map.get("a" * 32)["state"]], sorted(member.map.get("a" * 32)["vouch"]))
"""


def test_a_member_of_the_release_before_vouchers_takes_their_rumours_and_evictions(tmp_path):
    import crdt
    import otela_node as on
    folder = member_of(BEFORE_VOUCHERS, tmp_path / "before")
    victim = {"owner": "job", "state": crdt.SERVING, "version": 1, "started": 1.0, "gossip": "10.0.0.4:7946"}
    prober = on.Overlay(on.Config(key=b"k" * 32), "c" * 32, {"owner": "me", "state": crdt.SERVING, "version": 0,
                                                             "started": 1.0, "gossip": "10.0.0.3:7946"}, 1.0)
    prober.map.merge({"a" * 32: victim})
    prober._suspect("a" * 32, 1, prober.sid, 2.0, None)
    rumour = prober._payload([on.Rumour("s", "a" * 32, prober.sid)])
    prober._evict("a" * 32, 60.0)
    eviction = prober.map.get("a" * 32)
    assert "vo" in rumour and eviction["vouch"] == {prober.sid: rumour["vo"][0][3]}
    done = subprocess.run([sys.executable, "-c", OLD_MEMBER], input=json.dumps(
        {"victim": victim, "rumour": rumour, "eviction": eviction}), capture_output=True, text=True,
        cwd=str(folder), env=dict(os.environ, PYTHONPATH=str(folder)), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [str(["c" * 32]), f"LEFT {['c' * 32]}"]


BEFORE_ADAPTERS = "9607e9c"   # main before records carried adapters and max_model_len
OLD_READER = """
import sys
import crdt, otela_node as on
new = __import__("json").loads(sys.stdin.read())
crdt.validate("a" * 32, new)
member = on.Overlay(on.Config(key=b"k" * 32), "b" * 32, {"owner": "me", "state": crdt.SERVING, "version": 0,
                    "started": 1.0, "gossip": "10.0.0.2:7946"}, 1.0)
member.receive({"t": "r", "r": {"a" * 32: new}}, "10.0.0.3:7946", 2.0)
print(member.map.get("a" * 32)["models"])
"""


def test_a_member_of_the_release_before_adapters_reads_a_record_with_adapters_and_a_window(tmp_path):
    import crdt
    import otela_node as on
    folder = member_of(BEFORE_ADAPTERS, tmp_path / "before-adapters")
    catalog = on.engine_catalog([{"id": "base", "max_model_len": 4096, "root": "base"},
                                 {"id": "sql", "parent": "base", "root": "/adapters/sql", "max_model_len": 4096}])
    record = {"owner": "job", "state": crdt.SERVING, "version": 1, "started": 1.0, "gossip": "10.0.0.4:7946",
              "role": "worker", "addr": "10.0.0.4:7700", **catalog}
    crdt.validate("a" * 32, record)
    assert record["adapters"] == {"sql": ["base", "/adapters/sql"]} and record["max_model_len"] == 4096
    done = subprocess.run([sys.executable, "-c", OLD_READER], input=json.dumps(record), capture_output=True,
                          text=True, cwd=str(folder), env=dict(os.environ, PYTHONPATH=str(folder)), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(["base", "sql"])   # the adapter, a model to it


def test_a_member_of_the_previous_release_carries_a_session_site_as_the_label_it_is(tmp_path):
    import argparse

    import crdt
    import otela_node as on
    folder = member_of(PREVIOUS_RELEASE, tmp_path / "previous")
    parser = argparse.ArgumentParser()
    on.add_overlay_args(parser)
    key = on.keygen(str(tmp_path / "keys"))[0]
    labels = on.config_from_args(parser.parse_args(["--key-file", key, "--site-name", "lrz"])).labels
    record = {"owner": "job", "state": crdt.SERVING, "version": 1, "started": 1.0, "gossip": "10.0.0.4:7946",
              "role": "worker", "addr": "10.0.0.4:7700", "models": ["m"], "labels": labels}
    reader = OLD_READER.replace('["models"]', '["labels"]')
    done = subprocess.run([sys.executable, "-c", reader], input=json.dumps(record), capture_output=True,
                          text=True, cwd=str(folder), env=dict(os.environ, PYTHONPATH=str(folder)), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str({"site": "lrz"})
