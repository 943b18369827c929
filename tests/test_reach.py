"""Reach, the NAT and relay rules of otela_node as a pure object (no I/O, times passed in):
for each NAT the lab has (tests/natlab.py: cone, symmetric, UDP blocked, a leaky gateway), what
the rules decide from what the punches did. The same decisions over real NATs: test_nat_lab."""
import math

import pytest

import otela_node as on

A, B = "relay/0a", "relay/0b"           # A's link id is the smaller: A asks for the UDP punch


def reach(**fields) -> on.Reach:
    return on.Reach(on.Config(key=b"k" * 32, punch_retry=30.0, max_punched=4, **fields))


def path(r, addr=B, private=True, punched=True, holds_link=False, spare_age=None, now=0.0):
    return r.tunnel_path(addr, private, punched, holds_link, spare_age, 10.0, now)


def test_a_peer_is_learned_once_with_its_relays_and_forgotten_when_it_leaves():
    r = reach()
    assert r.learned(B, ["10.0.0.1:7946"], since=5.0) is True
    assert r.learned(B, ["10.0.0.2:7946", "10.0.0.1:7946"], since=9.0) is False   # a new version
    assert r.relays(B) == ["10.0.0.2:7946", "10.0.0.1:7946"] and r.member_since(B, 0.0) == 5.0
    r.forget(B)
    assert r.relays(B) == [] and r.member_since(B, 7.0) == 7.0 and r.tunnel_reach(B) == "relayed"


def test_the_smaller_link_id_asks_for_the_udp_punch_once_per_punch_retry():
    ra, rb = reach(), reach()
    for r in (ra, rb):
        r.learned(A, ["s"], 0.0)
        r.learned(B, ["s"], 0.0)
    assert ra.punches_due(A, {}, now=100.0) == [B]    # never ourselves
    assert rb.punches_due(B, {}, now=100.0) == []     # B waits for A's request
    assert ra.punches_due(A, {}, now=110.0) == []     # tried 10 s ago
    assert ra.punches_due(A, {}, now=130.0) == [B]
    assert ra.punches_due(A, {B: object()}, now=200.0) == []   # punched already


def test_no_more_punches_than_max_punched():
    r = reach()
    peers = [f"relay/1{i}" for i in range(6)]
    for p in peers:
        r.learned(p, ["s"], 0.0)
    assert r.punches_due(A, {p: 1 for p in peers[:4]}, now=1.0) == []


@pytest.mark.parametrize("nat", ["symmetric", "udp blocked"])
def test_where_the_udp_punch_fails_the_tunnel_is_relayed_and_never_punched(nat):
    r = reach()
    r.learned(B, ["s"], 0.0)
    assert path(r, punched=False) == "splice"                     # through one of its relays
    assert path(r, punched=False, holds_link=True) == "dial-back"  # we are its relay
    assert path(r, private=False, punched=False) == "splice"       # a public dialer: no punch either


def test_on_cone_nats_the_tunnel_punches_and_keeps_the_order_that_worked():
    r = reach()
    first, kept = r.punch_plan(B, now=1.0)
    assert (first, kept) == (True, None)                # attempt 1: the member first
    r.punch_worked(B, first, now=1.0)
    assert r.tunnel_reach(B) == "punched" and path(r) == "punch"
    assert r.punch_plan(B, now=2.0) == (True, True)     # kept, attempt after attempt


def test_behind_a_leaky_gateway_the_orders_alternate_until_one_works_and_that_one_is_kept():
    r = reach()
    first, kept = r.punch_plan(B, now=1.0)
    r.punch_failed(B, kept, now=1.0)                    # the member first: its gateway remapped
    first, kept = r.punch_plan(B, now=2.0)
    assert (first, kept) == (False, None)               # attempt 2: the dialer first
    r.punch_worked(B, first, now=2.0)
    assert r.punch_plan(B, now=3.0) == (False, False)
    r.punch_failed(B, False, now=3.0)                   # the kept order failed: alternate again
    assert r.peers[B].order is None and r.punch_plan(B, now=4.0)[1] is None


def test_two_failed_tunnel_punches_send_the_pair_to_the_relay_for_punch_retry():
    r = reach()
    for now in (1.0, 2.0):
        r.punch_failed(B, r.punch_plan(B, now)[1], now)
    assert path(r, now=3.0) == "splice" and path(r, holds_link=True, now=3.0) == "dial-back"
    assert path(r, now=32.0) == "punch" and r.peers[B].failures == 0   # its conntrack entries are gone


def test_a_fresh_spare_from_a_probe_goes_first_and_a_stale_one_does_not():
    r = reach()
    assert path(r, spare_age=1.0) == "spare"
    assert path(r, spare_age=6.0) == "punch"            # older than half the head timeout
    assert path(r, punched=False, spare_age=6.0) == "splice"


def test_a_relayed_tunnel_over_a_punched_udp_path_is_probed_once_until_it_punches_again():
    r = reach()
    r.learned(B, ["s"], 0.0)
    for now in (1.0, 2.0):
        r.punch_failed(B, r.punch_plan(B, now)[1], now)
    r.went(B, "relayed", 2.0)
    assert r.probes_due({B: 1}, {}, private=True, now=10.0) == []   # within punch_retry
    assert r.probes_due({B: 1}, {}, private=True, now=40.0) == [B]
    assert r.probes_due({B: 1}, {}, private=True, now=41.0) == []   # one probe at a time
    r.probe_done(B, worked=False, now=42.0)
    assert r.peers[B].failures == 2 and not r.peers[B].probing
    assert r.probes_due({B: 1}, {B: 1}, private=True, now=80.0) == []   # a spare waits already
    assert r.probes_due({B: 1}, {}, private=False, now=80.0) == []      # a public dialer never


def test_the_tunnel_rules_table_ends_in_a_rule_that_always_holds():
    assert on.Reach.TUNNEL_RULES[-1][1] is None
    assert math.isinf(on.PeerReach().given_up)


MINE = {"10.81.0.10", "127.0.0.1", "::1"}   # this host's own addresses, as the bind test says


def dialable(*answers):
    return on.Reach.dialable(list(answers), MINE.__contains__)


def test_a_seed_that_dials_back_and_sees_our_own_address_makes_us_public():
    assert dialable({"seen": "10.81.0.10:40112", "back": True}) is True
    assert dialable({"seen": "[::1]:40112", "back": True}) is True
    assert dialable({"seen": "::ffff:10.81.0.10:40112", "back": True}) is True   # a dual-stack seed's view


def test_a_login_host_that_dials_back_over_the_lan_but_sees_a_nat_leaves_us_private():
    # the compute host reached its login's public address through its site's NAT (seen), and the
    # login dialled it back over the site's LAN: another site would dial the same private address
    assert dialable({"seen": "10.80.0.1:51000", "back": True}) is False
    assert dialable({"seen": "10.80.0.1:51000", "back": True}, {"seen": "10.80.1.129:7946", "back": False}) is False
    # one seed that sees us as we are is enough
    assert dialable({"seen": "10.80.0.1:51000", "back": True}, {"seen": "10.81.0.10:40000", "back": True}) is True


def test_no_dial_back_is_private_and_a_seed_that_says_no_seen_is_believed_as_before():
    assert dialable({"seen": "10.81.0.10:40112", "back": False}) is False
    assert dialable() is False
    assert dialable({"back": True}) is True and dialable({"seen": "", "back": True}) is True
    assert dialable({"seen": "a-host-name:40112", "back": True}) is True


def test_the_dialable_rules_end_in_a_rule_that_always_holds():
    assert on.Reach.DIALABLE_RULES[-1] == (False, None)


def test_this_hosts_own_addresses_are_the_ones_a_socket_binds():
    assert on.own_address("127.0.0.1") is True
    assert on.own_address("192.0.2.77") is False   # TEST-NET-1: never this host's


# ---- which relays a private member links to ------------------------------------------------------
HERE_RELAY, HERE_INGRESS = "10.81.0.3:7946", "10.81.0.2:7946"       # its own site's login host
NEAR_SITE, FAR_SITE = "10.80.1.129:7946", "10.80.2.129:7946"       # other sites, 40 and 150 ms away


def test_without_round_trips_relays_rank_by_role_then_address_as_before():
    offers = [("10.0.0.9:7946", "worker", None), ("10.0.0.5:7946", "ingress", None), ("10.0.0.7:7946", "relay", None)]
    assert on.Reach.rank_relays(offers) == ["10.0.0.7:7946", "10.0.0.5:7946", "10.0.0.9:7946"]


def test_a_relay_at_our_own_site_goes_before_another_sites_whatever_their_roles():
    offers = [(FAR_SITE, "relay", 0.150), (NEAR_SITE, "relay", 0.040), (HERE_INGRESS, "ingress", 0.0004)]
    assert on.Reach.rank_relays(offers) == [HERE_INGRESS, NEAR_SITE, FAR_SITE]


def test_within_our_own_site_the_role_decides_not_a_fraction_of_a_millisecond():
    offers = [(HERE_INGRESS, "ingress", 0.0003), (HERE_RELAY, "relay", 0.0009)]
    assert on.Reach.rank_relays(offers) == [HERE_RELAY, HERE_INGRESS]


def test_a_relay_not_measured_yet_goes_after_our_own_sites_and_before_far_ones():
    offers = [(FAR_SITE, "relay", 0.150), ("10.0.0.5:7946", "ingress", None), (HERE_INGRESS, "ingress", 0.0004)]
    assert on.Reach.rank_relays(offers) == [HERE_INGRESS, "10.0.0.5:7946", FAR_SITE]


def test_a_held_relay_whose_round_trip_wavers_at_a_bands_edge_keeps_its_rank():
    offers = [("10.0.0.1:7946", "relay", 0.039), ("10.0.0.2:7946", "relay", 0.041)]   # 40 ms: a band's edge
    assert on.Reach.rank_relays(offers) == ["10.0.0.1:7946", "10.0.0.2:7946"]
    assert on.Reach.rank_relays(offers, held={"10.0.0.2:7946"}) == ["10.0.0.2:7946", "10.0.0.1:7946"]
    truly_farther = [("10.0.0.1:7946", "relay", 0.039), ("10.0.0.2:7946", "relay", 0.150)]
    assert on.Reach.rank_relays(truly_farther, held={"10.0.0.2:7946"}) == ["10.0.0.1:7946", "10.0.0.2:7946"]
