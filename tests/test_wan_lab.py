"""The WAN lab's link emulator (tests/wanlab.py): its link model without I/O, and, as root, the
lab's links delivering the RTT and loss they were set to between a compute host behind site A's
NAT and site B's login host. Every namespace a test made is gone at its end."""
import math
import os
import random
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import netns  # noqa: E402
import wanlab  # noqa: E402

REASON = wanlab.unavailable()
root_only = pytest.mark.skipif(REASON is not None, reason=REASON or "")
ECHO_PORT = 7000


def packet(src: str, dst: str) -> bytes:
    """An IPv4 header from src to dst: all the emulator reads."""
    return bytes([0x45]) + bytes(11) + bytes(map(int, src.split("."))) + bytes(map(int, dst.split(".")))


def emulator(**link) -> wanlab.Emulator:
    spec = {"sites": {"a": wanlab.public_block(0), "b": wanlab.public_block(1)}, "links": {"a-b": link}}
    return wanlab.Emulator(spec, random.Random(46))


A_TO_B = packet(wanlab.router_wan(0), wanlab.login_public(1))
B_TO_A = packet(wanlab.login_public(1), wanlab.router_wan(0))


def binomial_bound(n: int, p: float, sigmas: float = 4.0) -> float:
    return sigmas * math.sqrt(n * p * (1 - p))


# ---- the link model -------------------------------------------------------------------------
def test_a_packet_between_sites_is_due_half_the_rtt_later_in_each_direction():
    emu = emulator(rtt_ms=40)
    assert emu.admit(A_TO_B, 100.0) == pytest.approx(100.020)
    assert emu.admit(B_TO_A, 100.0) == pytest.approx(100.020)


def test_a_packet_within_a_site_or_not_ipv4_crosses_at_once():
    emu = emulator(rtt_ms=40, loss=0.5)
    same_site = packet(wanlab.router_wan(0), wanlab.login_public(0))
    assert all(emu.admit(same_site, 5.0) == 5.0 for _ in range(100))
    assert emu.admit(bytes([0x60]) + bytes(39), 5.0) == 5.0


def test_loss_drops_each_direction_within_a_binomial_bound():
    emu, n, p = emulator(rtt_ms=40, loss=0.02), 20000, 0.02
    dropped = sum(emu.admit(A_TO_B, i * 0.001) is None for i in range(n))
    assert abs(dropped - n * p) <= binomial_bound(n, p)


def test_jitter_spreads_the_delay_but_one_direction_keeps_its_order():
    emu = emulator(rtt_ms=40, jitter_ms=5)
    dues = [emu.admit(A_TO_B, i * 0.001) for i in range(2000)]
    assert dues == sorted(dues)
    delays = [due - i * 0.001 for i, due in enumerate(dues)]
    assert 0.015 <= min(delays) and max(delays) - min(delays) > 0.008


def test_reorder_holds_some_packets_so_later_ones_pass_them():
    emu, n = emulator(rtt_ms=40, reorder=0.1), 5000
    dues = [emu.admit(A_TO_B, i * 0.001) for i in range(n)]
    passed = sum(later < earlier for earlier, later in zip(dues, dues[1:]))
    assert abs(emu.counts["held"] - n * 0.1) <= binomial_bound(n, 0.1)
    assert passed >= emu.counts["held"] * 0.9       # a held packet is passed by the next one (2 ms on, 1 ms apart)


def test_a_timer_aims_early_by_the_lateness_it_measured_so_packets_go_out_at_their_due_time():
    aim = wanlab.TimerAim(early=0.0)
    for i in range(200):                            # timers that fire 0.8 ms after they were set
        due = 10.0 + i * 0.01
        aim.fired(due, aim.timer_for(due) + 0.0008)
    assert aim.early == pytest.approx(0.0008, abs=1e-5)
    due = 20.0
    assert aim.timer_for(due) + 0.0008 == pytest.approx(due)


def test_a_timer_never_aims_more_than_two_ms_early_after_a_stall():
    aim = wanlab.TimerAim()
    for i in range(100):
        due = 1.0 + i
        aim.fired(due, aim.timer_for(due) + 0.5)    # a box stalled half a second each time
    assert aim.early == wanlab.TimerAim.MAX_EARLY
    assert aim.mean_error_ms() > 0


def test_a_bare_tcp_exchange_sends_and_reads_the_tunnels_sizes_each_time():
    port = netns.free_port_pair()
    server = subprocess.Popen(wanlab.tcp_echo_argv(port, 325, 457, host="127.0.0.1"), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "echoing"
        out = wanlab.tcp_exchange("127.0.0.1", port, 5, 0.0)
        assert len(out["ms"]) == 5 and all(ms > 0 for ms in out["ms"])
    finally:
        server.kill()
        server.wait()


def test_a_link_can_be_changed_while_running():
    emu = emulator(rtt_ms=40)
    emu.configure({"sites": {"a": wanlab.public_block(0), "b": wanlab.public_block(1)},
                   "links": {"b-a": {"rtt_ms": 10, "loss": 1.0}}})
    assert all(emu.admit(A_TO_B, 1.0) is None for _ in range(50))


# ---- the lab, as root -------------------------------------------------------------------------
@pytest.fixture
def lab_of(request):
    labs = []

    def make(**kwargs):
        lab = wanlab.WanLab(**kwargs)
        labs.append(lab)
        return lab
    yield make
    for lab in labs:
        lab.close()
    assert not [n for n in netns.existing() if n.startswith(f"{wanlab.PREFIX}{os.getpid()}-")]


def echo_at(lab, place):
    server = subprocess.Popen(place.argv(wanlab.echo_argv(ECHO_PORT)), stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "echoing"
    return server


def p50(values):
    values = sorted(values)
    return values[len(values) // 2]


@root_only
@pytest.mark.root
@pytest.mark.slow
def test_a_40ms_link_gives_a_natted_host_a_40ms_round_trip_to_the_far_login(lab_of):
    lab = lab_of(sites=2, links={"a-b": {"rtt_ms": 40}})
    echo_at(lab, lab.login("b"))
    out = lab.host("a").call(wanlab.probe, wanlab.login_public(1), ECHO_PORT, 200, 0.005)
    assert len(out["rtts_ms"]) == 200
    assert abs(p50(out["rtts_ms"]) - 40) <= 2, sorted(out["rtts_ms"])[::20]
    local = lab.host("b").call(wanlab.probe, wanlab.login_lan(1), ECHO_PORT, 20, 0.005)
    assert p50(local["rtts_ms"]) < 2           # within site B: over its LAN, no WAN crossed


@root_only
@pytest.mark.root
@pytest.mark.slow
def test_a_2_percent_link_loses_round_trips_within_a_binomial_bound(lab_of):
    lab = lab_of(sites=2, links={"a-b": {"rtt_ms": 10, "loss": 0.02}})
    echo_at(lab, lab.login("b"))
    n, round_trip = 1500, 1 - (1 - 0.02) ** 2       # lost on the way out or on the way back
    out = lab.host("a").call(wanlab.probe, wanlab.login_public(1), ECHO_PORT, n, 0.002, timeout=60)
    lost = n - len(out["rtts_ms"])
    assert abs(lost - n * round_trip) <= binomial_bound(n, round_trip), lost


@root_only
@pytest.mark.root
@pytest.mark.slow
def test_tcp_crosses_a_lossy_link_whole_and_a_cut_link_passes_nothing_until_healed(lab_of):
    lab = lab_of(sites=3, links={"a-b": {"rtt_ms": 20, "loss": 0.05}, "a-c": {"rtt_ms": 10}})
    sink = subprocess.Popen(lab.login("b").argv(
        [sys.executable, "-c", "import socket,hashlib;s=socket.create_server(('0.0.0.0',7001));c,_=s.accept();"
         "h=hashlib.sha256()\nwhile True:\n d=c.recv(65536)\n if not d: break\n h.update(d)\n"
         "c.sendall(h.hexdigest().encode());c.close()"]), stdout=subprocess.PIPE)
    payload = random.Random(1).randbytes(300_000)

    def send_all():
        import hashlib
        import socket
        import time
        for _ in range(50):                     # the sink may not listen yet
            try:
                conn = socket.create_connection((wanlab.login_public(1), 7001), timeout=10)
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        got = conn.recv(100).decode()
        conn.close()
        return got == hashlib.sha256(payload).hexdigest()
    assert lab.host("a").call(send_all, timeout=60)        # 5 % of segments lost, all bytes arrive
    sink.wait(timeout=10)

    echo_at(lab, lab.login("c"))
    lab.set_link("a", "c", loss=1.0)
    cut = lab.host("a").call(wanlab.probe, wanlab.login_public(2), ECHO_PORT, 20, 0.01, 0.3)
    lab.set_link("a", "c", loss=0.0)
    healed = lab.host("a").call(wanlab.probe, wanlab.login_public(2), ECHO_PORT, 20, 0.01, 0.3)
    assert (len(cut["rtts_ms"]), len(healed["rtts_ms"])) == (0, 20)


@root_only
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, True], ids=["relayed", "direct"])
def test_a_request_through_site_a_ingress_reaches_site_b_node_40ms_away(tmp_path, capsys, direct):
    import reliability
    out = wanlab.run_cross_site(str(tmp_path), dict(reliability.QUICK_TIMINGS), rtt_ms=40, requests=20, direct=direct)
    with capsys.disabled():      # a figure to read, never asserted: this box runs other work
        print(f"\n{'direct' if direct else 'relayed'}: cross-site p50 {out['cross']['p50_ms']} ms, local p50 "
              f"{out['local']['p50_ms']} ms, added {out['added_ms']} ms over a link of {out['rtt_ms']:g} ms RTT "
              f"({out['link_rtt_p50_ms']} ms measured): {out['added_over_link_ms']} ms beyond it; each an RTT apart: "
              f"{out['added_paced_ms']} ms over a bare TCP exchange's {out['link_tcp_p50_ms']} ms: "
              f"{out['added_over_tcp_link_ms']} ms beyond it")
    assert [out[name]["ok"] for name in ("cross", "local", "cross_paced", "local_paced")] == [20] * 4
    assert set(out["sites"]) == {"ingress@a", "ingress@b", "worker@a", "worker@b"}
    assert out["cross"]["served_by"] == [out["sites"]["worker@b"]]
    assert out["local"]["served_by"] == [out["sites"]["worker@a"]]
    assert out["reach_after"]["b"] == ("direct" if direct else "relayed")
    assert not [n for n in netns.existing() if n.startswith(f"{wanlab.PREFIX}{os.getpid()}-")]


@root_only
@pytest.mark.root
@pytest.mark.slow
def test_requests_through_each_sites_ingress_stay_on_its_site_and_a_key_bound_to_a_site_never_leaves_it(tmp_path, capsys):
    import reliability
    out = wanlab.run_locality(str(tmp_path), dict(reliability.QUICK_TIMINGS), rtt_ms=40, requests=100)
    with capsys.disabled():      # the figure (issue: >= 95 %); the bound asserted is wider, being counts
        print(f"\nlocality at 40 ms: site a kept {out['a']['share_stayed']:.1%}, site b {out['b']['share_stayed']:.1%}"
              f" of {out['requests']} requests ({out['parallel']} at a time; round trips a {out['a']['round_trip_ms']},"
              f" b {out['b']['round_trip_ms']})")
    for site in "ab":
        assert out[site]["ok"] == 100
        assert out[site]["stayed"] >= 90, out[site]
        assert len(out[site]["reach"]) == 4 and all(r.endswith(":relayed") for r in out[site]["reach"])
        assert out[site]["bound_to_a"] == {"ok": 100, "of": 100, "left_site_a": 0}   # through b's: all cross
    assert not [n for n in netns.existing() if n.startswith(f"{wanlab.PREFIX}{os.getpid()}-")]
