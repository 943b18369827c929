"""The overlay over a WAN: failure detection that follows each member's measured round trip
(otela_node.RoundTrip, FailureDetector's "Timeouts that follow the round trip").

Without sockets: the estimator, the timeouts it gives with a clock passed in, and members of
three sites 150 ms apart on a simulated network (tests/simnet.py, with a delay and a loss per
pair of sites), for 30 simulated minutes in about a second. As root: the same in the WAN lab
(tests/wanlab.py, real processes behind NATs and relays), for a minute.

Bounds stated here and in otela_node (default settings, 9 members, 160 simulated runs):
    LAN            a killed member suspected within 2 s, LEFT at every member within 4.75 s (p50
                   4.15 s), as with fixed timeouts
    150 ms, 2 %    suspected within 4 s (p50 1.45 s), LEFT at every member within 7.85 s (p50
                   5.1 s, p95 6.4 s); 0 suspicions of live members in 30 minutes
    either         at most Lifeguard's longest grace after the first suspicion (a lone suspector:
                   16.8 s, plus 4 of the suspect's capped RTOs)
    a write        at every site's members within RTT/2 + jitter + 6 resend rounds of 0.15 s:
                   0.98 s at 150 ms (300 writes: p50 0.085 s, p99 0.38 s, max 0.68 s); a far
                   member's round waits its ack timeout (~0.17 s), so 0.98 s covers 5 resends
                   (a member missing 5 in a row at 2 % loss each way: p ~ 1e-7); measured
                   with those waits, 300 writes: p50 0.085 s, max 0.42 s. Each far member gets
                   a write once when nothing is lost (a fixed 0.15 s: 1.7 times, 2.6 at 300 ms)
In the WAN lab at 150 ms and 2 % (an ingress, two relays, three private nodes): 0 suspicions and
0 evictions in three 60 s runs and one of 300 s; a killed node LEFT at every member 4.7-7.6 s
after the kill; an eviction and a drained node's LEFT at every member 0.09-0.32 s after they
were written (polled every ~0.1 s). At 300 ms and 5 %, 90 s: 1 suspicion (fixed timeouts: 15).
"""
import heapq
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import simnet  # noqa: E402
import wanlab  # noqa: E402

import crdt  # noqa: E402
import otela_node as on  # noqa: E402

T0 = 1_700_000_000.0
KEY = b"k" * 32


# ---- the estimator ---------------------------------------------------------------------------
def test_a_first_sample_is_the_mean_and_half_of_it_the_deviation():
    measured = on.RoundTrip(0.2)
    assert (measured.srtt, measured.rttvar) == (0.2, 0.1)
    assert measured.timeout() == pytest.approx(0.6)


def test_steady_acks_bring_the_timeout_down_to_the_round_trip_plus_a_margin():
    measured = on.RoundTrip(0.150)
    for i in range(60):
        measured.add(0.150 + (0.005 if i % 2 else -0.005))
    assert measured.srtt == pytest.approx(0.150, abs=0.002)
    assert 0.155 < measured.timeout() < 0.185


def test_a_round_trip_that_grows_raises_the_timeout_above_it_at_the_first_slow_ack():
    measured = on.RoundTrip(0.001)
    for _ in range(30):
        measured.add(0.001)
    measured.add(0.300)
    assert measured.timeout() > 0.300


# ---- a simulated network of sites ---------------------------------------------------------------
class Sites(simnet.SimulatedNetwork):
    """simnet with sites: a datagram between two sites is due after rtt/2 +- jitter and lost with
    `wan_loss` (a TCP frame then comes one RTO later, as TCP retransmits it); within a site,
    simnet's LAN delay."""

    def __init__(self, rtt: float, wan_loss: float, jitter: float = 0.005, **kw):
        super().__init__(**kw)
        self.site, self.rtt, self.jitter, self.wan_loss = {}, rtt, jitter, wan_loss

    def send(self, src, outs):
        for o in outs:
            size = len(crdt.dumps(o.msg)) + on.ENVELOPE
            self.bytes_sent[src] += size
            if o.addr in self.dead or o.addr not in self.members or self._blocked(src, o.addr):
                continue
            at = self.now + self.rng.uniform(*self.delay)
            if self.site.get(src) != self.site.get(o.addr):
                at += max(0.0, self.rtt / 2 + self.rng.uniform(-self.jitter, self.jitter))
                if self.rng.random() < self.wan_loss:
                    if not o.tcp:
                        continue
                    at += max(0.2, 2 * self.rtt)    # TCP's retransmission, after its RTO
            self._n += 1
            heapq.heappush(self.queue, (at, self._n, o.addr, o.msg, src, o.tcp))
        member = self.members.get(src)
        if member is not None:
            heapq.heappush(self.wakeups, (member.next_wakeup(), src))


def sites(rtt=0.150, loss=0.02, count=3, per_site=3, seed=1, settle=30.0, config=None):
    net = Sites(rtt, loss, seed=seed, config=config or on.Config(key=KEY), start=T0)
    if rtt < 0.01:
        net.jitter = 0.0
    first = None
    for s in range(count):
        for k in range(per_site):
            addr = f"10.{s}.0.{k + 1}:7946"
            net.site[addr] = s
            member = net.add(bootstrap=[first.addr] if first else [], addr=addr)
            first = first or member
    net.run(settle)
    assert all(len(m.members) == count * per_site - 1 for m in net.live())
    return net


def by_site(net, site):
    return [m for m in net.live() if net.site[m.addr] == site]


def test_rtt_is_the_measured_round_trip_per_member_and_none_before_an_ack():
    net = sites()
    here, near, far = by_site(net, 0)[0], by_site(net, 0)[1], by_site(net, 2)[0]
    assert here.rtt(near.sid) < 0.005
    assert here.rtt(far.sid) == pytest.approx(0.150, abs=0.01)
    assert here.rtt("f" * 32) is None


def test_a_lan_member_keeps_the_settings_timeouts_and_a_wan_member_gets_its_round_trip_and_more():
    net = sites()
    cfg = net.config
    here, near, far = by_site(net, 0)[0], by_site(net, 0)[1], by_site(net, 1)[0]
    assert here._timeout("probe_timeout", near.sid) == cfg.probe_timeout
    assert here._grace(0, near.sid) == pytest.approx(here._grace(0), abs=0.05)
    assert here.rtt(far.sid) + 0.05 < here._timeout("probe_timeout", far.sid) <= cfg.probe_timeout_max
    assert here._grace(0, far.sid) - here._grace(0) >= 4 * here.rtt(far.sid)


def test_a_wan_peer_slower_than_the_floor_gets_a_timeout_above_its_round_trip():
    net = sites(rtt=0.600)
    here, far = by_site(net, 0)[0], by_site(net, 1)[0]
    assert here.rtt(far.sid) == pytest.approx(0.600, abs=0.02)
    assert 0.62 < here._timeout("probe_timeout", far.sid) <= net.config.probe_timeout_max


def start_round(prober, target, now):
    """A probe round of `prober` aimed at `target` (whatever the ring says): its ping."""
    prober.probe = None
    prober.ring = None
    others = {s: a for s, a in prober.members.items()}
    prober.members = {target.sid: target.addr}
    [ping] = prober._start_probe(now)
    prober.members = others
    return ping


def test_an_ack_relayed_by_a_helper_is_no_sample_of_the_targets_round_trip():
    net = sites()
    here, far, helper = by_site(net, 0)[0], by_site(net, 2)[0], by_site(net, 1)[0]
    before = here.round_trips[far.sid].srtt
    ping = start_round(here, far, net.now)
    here.receive({"t": "a", "n": ping.msg["n"]}, helper.addr, net.now + 2.0)
    assert here.round_trips[far.sid].srtt == before
    ping = start_round(here, far, net.now + 3.0)
    here.receive({"t": "a", "n": ping.msg["n"]}, far.addr, net.now + 3.5)
    assert here.round_trips[far.sid].srtt > before


def test_the_indirect_phase_waits_for_its_slowest_helpers_path():
    net = sites()
    cfg = net.config
    here, far = by_site(net, 0)[0], by_site(net, 2)[0]
    now = net.now + 1.0
    start_round(here, far, now)
    here.lhm = 0
    here._advance_probe(here.probe["deadline"])     # no ack: ping-reqs to helpers, the TCP ping
    p = here.probe
    helpers = p["helper_ids"]
    far_helper = max(helpers, key=lambda h: here._rto(h))
    assert here.rtt(far_helper) > 0.1               # (3 helpers of 7 others: one is across the WAN)
    waited = p["deadline"] - p["start"] - here._timeout("probe_timeout", far.sid)
    assert waited + 1e-6 >= 2 * here._rto(far_helper) + here._rto(far.sid) > cfg.indirect_timeout   # (unix time: ~1e-7 s)


def test_a_helper_nacks_only_once_the_targets_round_trip_is_over():
    net = sites(rtt=0.400)
    cfg = net.config
    helper, far = by_site(net, 0)[0], by_site(net, 1)[0]
    helper.receive({"t": "i", "n": 7, "to": far.sid[:on.SHORT_ID], "a": far.addr}, by_site(net, 2)[0].addr, net.now)
    [req] = [r for r in helper.relays.values() if r.seq == 7]
    assert req.nack_at - net.now == pytest.approx(min(helper._rto(far.sid), cfg.probe_timeout_max))
    assert req.nack_at - net.now > cfg.nack_after * cfg.indirect_timeout


def stand_in_overlay(round_trips):
    """A lone Overlay whose members are `round_trips`' (addr -> a steady round trip in seconds, or
    None: never measured), their round trips as if measured: no network, no timing."""
    record = {"owner": "sim@here", "state": crdt.SERVING, "version": 0, "started": T0, "role": "worker",
              "gossip": "10.0.0.1:7946", "addr": "10.0.0.1:7700"}
    overlay = on.Overlay(on.Config(key=KEY), "a" * 32, record, T0, rng=simnet.random.Random(1))
    for i, (addr, rtt) in enumerate(round_trips.items()):
        sid = f"{i + 1:032x}"
        overlay.members[sid], overlay.by_addr[addr] = addr, sid
        if rtt is not None:
            overlay.round_trips[sid] = measured = on.RoundTrip(rtt)
            for _ in range(40):
                measured.add(rtt)
    return overlay


def test_the_writer_waits_a_far_members_round_trip_and_more_before_resending_and_the_setting_for_a_near_one():
    overlay = stand_in_overlay({"near": 0.0005, "far": 0.150, "unmeasured": None})
    setting = overlay.cfg.push_resend_interval
    assert overlay._resend_wait("near") == setting
    assert overlay._resend_wait("unmeasured") == setting
    assert overlay._resend_wait("a stranger") == setting
    far = overlay.round_trips[overlay.by_addr["far"]]
    assert overlay._resend_wait("far") == pytest.approx(far.timeout()) and far.timeout() > 0.150
    overlay.lhm = 2                                 # we are slow ourselves: the setting stretched wins
    assert overlay._resend_wait("far") == pytest.approx(3 * setting)


def test_each_member_is_resent_a_push_on_its_own_wait_and_an_ack_ends_only_its_own():
    overlay = stand_in_overlay({"near": 0.0005, "far": 0.300})
    setting = overlay.cfg.push_resend_interval
    [pushed] = {o.msg["k"] for o in overlay._push([on.Rumour("r", overlay.sid)], ["near", "far"], T0)}
    assert overlay.next_resend == T0 + setting
    assert [o.addr for o in overlay._resend(T0 + setting)] == ["near"]     # the far one's ack is not due
    far_due = T0 + overlay._resend_wait("far")
    assert overlay.next_resend == pytest.approx(min(far_due, T0 + 2 * setting))
    overlay.receive({"t": "k", "k": pushed}, "near", T0 + setting + 0.001)
    assert [o.addr for o in overlay._resend(far_due)] == ["far"]
    overlay.receive({"t": "k", "k": pushed}, "far", far_due + 0.01)
    assert not overlay.pushes


@pytest.mark.parametrize("rtt", [0.150, 0.300])
def test_a_write_reaches_a_far_member_once_when_nothing_is_lost(rtt):
    net = sites(rtt=rtt, loss=0.0, seed=3)
    writer = by_site(net, 0)[0]
    far = {m.addr for m in net.live() if net.site[m.addr] != 0}
    sent = []
    deliver = net.send

    def count(src, outs):
        if src == writer.addr:
            sent.extend(o.addr for o in outs if o.addr in far and o.msg.get("t") == "r" and "k" in o.msg)
        return deliver(src, outs)
    net.send = count
    for i in range(20):
        net.send(writer.addr, writer.update(net.now, labels={"w": str(i)}))
        net.run(2.0)
    assert len(sent) == 20 * len(far)               # (a wait of 0.15 s: 1.7 copies at 150 ms, 2.6 at 300)


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_a_relay_link_errors_after_relay_link_timeout_without_an_ack_instead_of_tcps_15_minutes():
    class Link:                                     # what _keepalive reads of a link: its socket
        def __init__(self, sock):
            self.sock = sock

        def get_extra_info(self, name):
            return self.sock if name == "socket" else None
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    try:
        on._keepalive(Link(client), on.Config().relay_link_timeout)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
    finally:
        client.close()
        server.close()


def test_a_relay_links_give_up_time_is_the_setting_until_its_peers_round_trip_needs_longer():
    setting = on.Config().relay_link_timeout
    assert on.Reach.link_timeout(setting, None) == setting          # not measured yet
    assert on.Reach.link_timeout(setting, 0.0005) == setting        # a LAN
    assert on.Reach.link_timeout(setting, 0.170) == setting         # 150 ms: 16 x 0.17 s is under 10 s
    assert on.Reach.link_timeout(setting, 1.2) == 20.0              # 1 s away: 16 of its ack timeouts


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_a_relay_links_watch_is_set_again_on_its_socket_only_when_it_changes():
    class Link:
        def __init__(self, sock):
            self.sock, self.watched = sock, 0

        def get_extra_info(self, name):
            if name == "socket":
                self.watched += 1
            return self.sock if name == "socket" else None
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())

    async def watch():
        link = on._MuxLink(Link(client), 1)
        link.watch(10.0)
        link.watch(10.0)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
        link.watch(20.0)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20_000
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
        return link.writer.watched
    try:
        assert on.asyncio.run(watch()) == 2
    finally:
        client.close()
        server.close()


# ---- sites on the simulated network: no false suspicion, bounded detection, writes ----------------
def suspicions(net, since):
    """Suspicions of live members (listener notices with a record) since `since`."""
    return sum(1 for t, _, _, record in net.changes if t >= since and record is not None)


@pytest.mark.parametrize("rtt,loss", [(0.150, 0.02), (0.300, 0.05)], ids=["150ms-2pct", "300ms-5pct"])
def test_no_live_member_is_suspected_or_evicted_in_30_minutes_across_sites(rtt, loss):
    net = sites(rtt=rtt, loss=loss)
    sids = sorted(m.sid for m in net.live())
    since = net.now
    net.run(1800.0)
    assert suspicions(net, since) == 0
    assert all(m.map.get(s)["state"] == crdt.SERVING for m in net.live() for s in sids)
    assert sum(len(m.retired) for m in net.live()) == 0


def detection(rtt, loss, count, per_site, seed):
    """A member killed at the last site: (seconds to its first suspicion, to LEFT at every member)."""
    net = sites(rtt=rtt, loss=loss, count=count, per_site=per_site, seed=seed)
    victim = net.live()[-1]
    net.kill(victim.addr)
    killed, suspected = net.now, None
    while net.now - killed < 30:
        net.run(0.05)
        if suspected is None and any(m.is_suspected(victim.sid) for m in net.live()):
            suspected = net.now - killed
        if all(m.map.get(victim.sid)["state"] == crdt.LEFT for m in net.live()):
            return suspected, net.now - killed
    return suspected, None


@pytest.mark.parametrize("rtt,loss,count,per_site,suspected_s,median_left_s", [
    (0.0005, 0.0, 1, 9, 2.5, 4.5),
    (0.150, 0.02, 3, 3, 5.0, 6.0),
], ids=["lan", "150ms-2pct"])
def test_a_killed_member_is_evicted_everywhere_within_the_stated_bound(rtt, loss, count, per_site, suspected_s,
                                                                     median_left_s):
    cfg = on.Config(key=KEY)
    # past its first suspicion: Lifeguard's longest grace (a lone suspector; 9 members: log10 < 1),
    # the suspect's refutation round trips at their cap, a backup evictor's delay, a second to spread
    longest = (cfg.suspicion_max_mult * cfg.suspicion_mult * cfg.probe_interval
               + on.FailureDetector.REFUTE_ROUND_TRIPS * cfg.probe_timeout_max + 2 * cfg.probe_interval + 1.0)
    runs = [detection(rtt, loss, count, per_site, seed) for seed in range(10)]
    assert all(s is not None and s <= suspected_s for s, _ in runs), runs
    assert all(left is not None and left <= s + longest for s, left in runs), runs
    assert sorted(left for _, left in runs)[len(runs) // 2] <= median_left_s, runs


def test_a_write_at_one_site_reaches_every_sites_members_within_rtt_and_resend_rounds():
    net = sites(seed=3)
    cfg = net.config
    writer = by_site(net, 0)[0]
    others = [m for m in net.live() if m is not writer]
    took = []
    for i in range(100):
        net.send(writer.addr, writer.update(net.now, labels={"w": str(i)}))
        wrote, missing = net.now, set(others)
        while missing and net.now - wrote < 10:
            net.run(0.005)
            missing = {m for m in missing if (m.map.get(writer.sid).get("labels") or {}).get("w") != str(i)}
        took.append(net.now - wrote)
        net.run(1.0)
    bound = net.rtt / 2 + net.jitter + 6 * cfg.push_resend_interval    # 0.98 s
    took.sort()
    assert took[-1] <= bound, took[-5:]
    assert took[50] <= net.rtt / 2 + net.jitter + 0.015         # most writes: one crossing


# ---- the WAN lab, as root ---------------------------------------------------------------------
REASON = wanlab.unavailable()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.root
@pytest.mark.slow
def test_three_sites_150ms_apart_with_2_percent_loss_evict_no_live_member_and_detect_a_killed_one(tmp_path, capsys):
    import reliability
    out = reliability.run_wan_overlay(str(tmp_path), seconds=60.0)
    with capsys.disabled():          # figures to read; the bound below is the stated one
        print(f"\nwan overlay {out['rtt_ms']:g} ms / {out['loss']:.0%}: {out['evictions']} evictions, "
              f"{out['suspicions']} suspicions in {out['seconds']:g} s; a killed node LEFT everywhere after "
              f"{out['detected_everywhere_s']} s ({out['detected_s']}), the eviction written after "
              f"{out.get('evicted_written_s')} s and everywhere {out.get('eviction_spread_s')} s later; a drained "
              f"node's LEFT everywhere {out.get('leave_spread_s')} s after it was written")
    assert out["evictions"] == 0
    assert out["sessions_kept"] == out["sessions"]
    assert out["detected_everywhere_s"] is not None and out["detected_everywhere_s"] <= 12.0   # simulated: p95 6.4 s
    assert out["eviction_spread_s"] <= 1.2 and out["leave_spread_s"] <= 1.2   # RTT/2 + 6 resends + a poll
    assert not [n for n in wanlab.netns.existing() if n.startswith(f"{wanlab.PREFIX}{os.getpid()}-")]
