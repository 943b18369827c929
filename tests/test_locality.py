"""Several sites: the round trip of the path to a session in the `ttft` policy's choice (measured by
the overlay's probes), with stand-in round trips; the overlay's own measure in the simulated
network (no processes; the same over a WAN lab: tests/wanlab.py locality)."""
import pytest
from simnet import SimulatedNetwork
from test_routing import chat, policy_with, routed, serve, words

import otela_node as on

NEAR, FAR = 0.0005, 0.040   # seconds: an engine at this ingress's site, one at a site 40 ms away


def with_paths(policy, paths):
    policy.round_trip = paths.get
    return policy


def test_an_engine_at_the_ingress_site_wins_over_an_as_idle_one_a_crossing_away():
    policy, _, candidates = policy_with(["far0", "near", "far1"])
    with_paths(policy, {"near": NEAR, "far0": FAR, "far1": FAR})
    chosen = [serve(policy, candidates, chat(words(300, 10 + i), words(20, i))).session for i in range(100)]
    assert chosen.count("near") == 100


def test_another_site_wins_once_its_queue_saves_more_than_the_crossing_costs():
    policy, _, candidates = policy_with(["near", "far"])
    with_paths(policy, {"near": NEAR, "far": FAR})
    held = []
    for i in range(200):   # requests in flight at the near engine, none answered yet
        request = routed(chat(words(2000, 500 + i), "q"))
        choice = policy.pick(candidates, request)
        policy.on_request_start(choice, request)
        held.append(choice.session)
        if choice.session == "far":
            break
    assert held[0] == "near" and held[-1] == "far"   # the near queue grew past the crossing
    near, far = policy.estimates(candidates, routed(chat(words(2000, 9), "q")))
    assert near[6] == NEAR and far[6] == FAR and near[0] - NEAR > FAR   # its queue alone costs more


def test_a_conversation_key_does_not_keep_its_turns_a_crossing_away_while_its_site_has_room():
    policy, _, candidates = policy_with([f"s{i}" for i in range(6)])
    with_paths(policy, {"s0": NEAR, "s1": NEAR, "s2": FAR, "s3": FAR, "s4": FAR, "s5": FAR})
    chosen = []
    for k in range(40):   # keyed conversations: rendezvous would send 2 of 3 to the far site
        body = dict(chat(words(300, 70), words(10, k)), prompt_cache_key=f"conversation-{k}")
        chosen.append(serve(policy, candidates, body).session)
    assert set(chosen) <= {"s0", "s1"}


def test_a_session_not_measured_yet_costs_the_farthest_round_trip_measured():
    policy, _, candidates = policy_with(["near", "new", "far"])
    with_paths(policy, {"near": NEAR, "far": FAR})
    assert policy.paths(candidates) == [NEAR, FAR, FAR]
    with_paths(policy, {})
    assert policy.paths(candidates) == [0.0, 0.0, 0.0]   # nothing measured: no path costs anything
    with_paths(policy, {"near": float("nan"), "far": -1.0, "new": True})   # never a bad number
    assert policy.paths(candidates) == [0.0, 0.0, 0.0]


def test_the_fit_learns_the_engine_time_not_the_crossing():
    fits = []
    for path, first_byte in ((FAR, 0.050), (0.0, 0.010)):   # 40 ms of the far one's 50 the crossing
        policy, _, candidates = policy_with(["s"])
        with_paths(policy, {"s": path})
        for i in range(30):
            serve(policy, candidates, chat(words(50, 900 + i), "q"), ttft=first_byte)
        fits.append(policy.engines["s"].ttft(100.0, 0.0))
    assert fits[0] == pytest.approx(fits[1], rel=0.01)
    assert policy.stats()["s"]["round_trip_seconds"] == 0.0


def test_the_overlay_measures_each_members_round_trip_on_its_direct_path():
    net = SimulatedNetwork(seed=3, delay=(0.0005, 0.0005))
    ingress = net.add()
    near = net.add([ingress.record["gossip"]])
    far = net.add([ingress.record["gossip"]])
    net.slow[far.record["gossip"]] = (0.040, 0.040)   # what reaches it, 40 ms late: a site away
    net.run(30.0)
    assert ingress.rtt(near.sid) == pytest.approx(0.001, abs=0.0002)
    assert ingress.rtt(far.sid) == pytest.approx(0.041, abs=0.002)
    assert ingress.rtt("nobody") is None
    net.kill(far.record["gossip"])
    net.run(60.0)   # evicted: forgotten with its other probe state
    assert ingress.rtt(far.sid) is None and ingress.rtt(near.sid) is not None


def test_a_node_reads_its_overlays_round_trips_and_none_without_one():
    node = on.Node.__new__(on.Node)
    node.overlay = None
    assert node.round_trip("x") is None


class Link:
    """A relay link as RelayClient._send_private uses it: its writer's frames, and whether it closes."""

    def __init__(self, closing=False):
        self.frames = []
        self.writer = self
        self.transport = self
        self.closing = closing

    def is_closing(self):
        return self.closing

    def write(self, data):
        self.frames.append(data)


def test_a_private_member_sends_to_one_of_its_relays_down_that_relays_own_link():
    import collections
    import types
    far, near = Link(), Link()   # linked first to a relay at another site, then to its own site's
    member = types.SimpleNamespace(links={"10.80.0.129:7946": far, "10.80.1.129:7946": near},
                                   traffic=collections.Counter())
    on.RelayClient._send_private(member, "10.80.1.129:7946", b"ack")
    assert (len(near.frames), len(far.frames)) == (1, 0)   # not across the WAN and back
    on.RelayClient._send_private(member, "10.80.2.7:7946", b"gossip")   # any other member: the first link
    assert (len(near.frames), len(far.frames)) == (1, 1)
    near.closing = True
    on.RelayClient._send_private(member, "10.80.1.129:7946", b"ack")   # its link closing: another carries it
    assert (len(near.frames), len(far.frames)) == (1, 2)
