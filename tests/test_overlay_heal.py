"""The overlay heals (issue 11): a restarted ingress is found again with no flag added, a
bootstrap that never answers is named where its operator looks, and the two halves of a
partition longer than the suspicion grace merge again.

Real processes on the fake engine (tests/reliability.py's Fleet), in the README's set-up: the
ingress without --bootstrap, nodes bootstrapping to its gossip address. Default timings unless
a test says otherwise; every wait polls a state with a deadline. The partition needs root
(network namespaces, tests/netns.py) and skips with the reason otherwise.
"""
from __future__ import annotations

import http.client
import os
import signal
import socket
import time

import netns
import pytest
from reliability import OK, Fleet, chat, noticed_gone, parse_args, partition, until, wait

pytestmark = pytest.mark.slow
DOWN_S = 9.0                        # the downtime: long enough that the nodes noticed
SERVE_WITHIN_S = 10.0               # the promise: serving within 10 s of the restart


@pytest.fixture
def fleet(tmp_path):
    with Fleet(str(tmp_path)) as f:
        yield f


def readme_setup(fleet: Fleet, nodes: int = 2):
    ingress = fleet.ingress()
    workers = [fleet.node(f"n{i}", bootstrap=(ingress.gossip,)) for i in range(nodes)]
    wait(lambda: fleet.up() and len(fleet.serving(ingress)) == nodes, 60, f"{nodes} nodes serving at the ingress")
    return ingress, workers


def chat_ok(fleet: Fleet, ingress) -> bool:
    host, port = ingress.listen.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        return chat(conn, fleet.token, False)[0] == OK
    finally:
        conn.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_a_restarted_ingress_serves_again_within_10_s_of_its_start_with_the_same_flags(fleet, sig):
    ingress, workers = readme_setup(fleet)
    assert chat_ok(fleet, ingress)
    gone = fleet.registry(ingress)["self"]
    fleet.stop(ingress, sig)
    stopped = time.monotonic()
    wait(lambda: all(noticed_gone(fleet.registry(w), gone) for w in workers), DOWN_S + 20,
         "both nodes noticed the ingress is gone")
    time.sleep(max(0.0, stopped + DOWN_S - time.monotonic()))
    fleet.start(ingress)
    served = until(lambda: chat_ok(fleet, ingress), SERVE_WITHIN_S, every=0.1)
    assert served is not None, f"no chat completion answered 200 within {SERVE_WITHIN_S:g} s of the restart"
    both = until(lambda: len(fleet.serving(ingress)) == 2, 5)
    assert both is not None, f"the restarted ingress routes to {len(fleet.serving(ingress))} of the 2 nodes"


def test_a_bootstrap_that_never_answers_is_named_in_the_log_and_on_healthz(fleet):
    silent = f"127.0.0.1:{netns.free_port_pair()}"        # nothing listens there
    node = fleet.node("lonely", bootstrap=(silent,))
    warned = until(lambda: any("WARNING" in line and silent in line for line in fleet.log(node).splitlines()), 10)
    assert warned is not None, f"no WARNING naming {silent} in the log within 10 s:\n{fleet.log(node)[-2000:]}"
    health: dict = {}

    def isolated() -> bool:
        health.update(fleet.get(node, "/healthz")[1] or {})
        return health.get("status") == "isolated"
    until(isolated, 10)
    assert health.get("status") == "isolated", health
    assert [w for w in health.get("warnings", []) if silent in w], health


def test_an_unresolvable_bootstrap_host_is_named_in_the_log(fleet):
    place = netns.isolated()            # resolving the name must not query this machine's DNS server
    if place is None:
        pytest.skip("no network namespace of its own for the node (unshare refused)")
    node = fleet.node("unresolved", place, bootstrap=("no-such-host.invalid:7946",))
    warned = until(lambda: any("WARNING" in line and "no-such-host.invalid" in line
                               for line in fleet.log(node).splitlines()), 10)
    assert warned is not None, f"no WARNING naming no-such-host.invalid within 10 s:\n{fleet.log(node)[-2000:]}"


@pytest.mark.root
def test_a_lab_partition_cuts_between_the_sides_and_nowhere_else():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Lab(3) as lab:
        lab.partition([2])
        assert reachable(lab, 0, 1) and not reachable(lab, 0, 2) and not reachable(lab, 2, 1)
        lab.heal()
        assert reachable(lab, 0, 2) and reachable(lab, 2, 1)


def reachable(lab: netns.Lab, src: int, dst: int) -> bool:
    """A TCP connection from member `src` to a listener in member `dst`, within 1 s."""
    server = lab.places[dst].call(lambda: socket.create_server((lab.places[dst].host, 0)))
    try:
        def connect() -> bool:
            try:
                socket.create_connection(server.getsockname(), timeout=1.0).close()
                return True
            except OSError:
                return False
        return lab.places[src].call(connect)
    finally:
        server.close()


@pytest.mark.root
def test_a_partition_longer_than_the_suspicion_grace_heals_everywhere(tmp_path):
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    result = partition(parse_args(["--quick", "--keep", str(tmp_path)]))
    detail = result["detail"]
    assert detail["far_live_at_ingress_before_heal"] == 0     # the split was real: the far side was out
    assert detail["healed"], f"registries still differ or the ingress skips a node {result['time_to_heal']}" \
                             f" after the heal (logs in {tmp_path})"
    assert not [n for n in netns.existing() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")]
