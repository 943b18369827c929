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
