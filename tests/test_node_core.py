"""The node's pure parts: wire format, the sans-IO overlay on a simulated lossy network, config."""
import os
import random
import socket
import stat
import struct

import pytest
import simnet

import crdt
import otela_node as on

KEY = bytes(range(32))
T0 = 1_700_000_000.0


# ---------------------------------------------------------------------------------------------
# Wire format
# ---------------------------------------------------------------------------------------------
def wire():
    return on.Wire(KEY, on.Config(key=KEY))


def test_sealed_message_opens_to_the_same_message():
    w = wire()
    msg = {"t": "p", "n": 7, "to": "abcd1234"}
    assert w.open(w.seal(msg, T0), T0 + 1) == msg
    assert w.accepted == 1


def test_forged_tag_and_wrong_key_are_dropped_and_counted():
    w = wire()
    data = bytearray(w.seal({"t": "a", "n": 1}, T0))
    data[-1] ^= 1
    assert w.open(bytes(data), T0) is None
    other = on.Wire(b"x" * 32, on.Config(key=b"x" * 32))
    assert w.open(other.seal({"t": "a", "n": 1}, T0), T0) is None
    assert w.dropped["forged"] == 2


def test_replayed_datagram_is_dropped_once_seen():
    w = wire()
    data = w.seal({"t": "a", "n": 1}, T0)
    assert w.open(data, T0) is not None
    assert w.open(data, T0 + 0.5) is None
    assert w.dropped["replayed"] == 1


def test_datagram_outside_replay_window_is_stale():
    w = wire()
    assert w.open(w.seal({"t": "a", "n": 1}, T0), T0 + 120) is None
    assert w.open(w.seal({"t": "a", "n": 1}, T0 + 120), T0) is None
    assert w.dropped["stale"] == 2


def test_a_sender_flooding_6k_fresh_datagrams_a_second_for_60_s_leaves_others_honest_gossip_accepted():
    """The issue's flood at its rate (a holder of the key, one address) against the default
    cache: it fills its own share; a member's 10 datagrams a second all get in throughout."""
    w = wire()
    flood = {"t": "p", "n": 1, "to": "x"}
    honest_accepted = honest_sent = 0
    for tick in range(600):                            # 60 s in steps of 0.1 s
        now = T0 + tick / 10
        for _ in range(600):
            w.open(w.seal(flood, now), now, sender="10.0.0.66:7946")
        honest_sent += 1
        honest_accepted += w.open(w.seal({"t": "a", "n": tick}, now), now, sender="10.0.0.2:7946") is not None
    assert honest_accepted == honest_sent == 600
    assert w.flooders["10.0.0.66:7946"] == w.dropped["flooded"] > 300000 and w.dropped["replayed"] == 0
    assert len(w._nonces) <= on.Config().nonce_cache


def test_when_the_whole_replay_cache_is_full_only_senders_under_their_share_get_in():
    w = on.Wire(KEY, on.Config(key=KEY, nonce_cache=1000, nonce_cache_per_sender=300))
    for i in range(4):                                 # 4 flooding addresses, 400 each
        for _ in range(400):
            w.open(w.seal({"t": "p", "n": 1}, T0), T0, sender=f"10.0.1.{i}:1")
    flooded, held = w.dropped["flooded"], len(w._nonces)
    quiet = [w.open(w.seal({"t": "a", "n": n}, T0), T0, sender="10.0.0.2:1") for n in range(20)]
    again = w.open(w.seal({"t": "p", "n": 1}, T0), T0, sender="10.0.1.0:1")
    assert flooded == 4 * 100 and held == 4 * 300           # each its own share, the last past the cap
    assert all(m is not None for m in quiet) and again is None
    assert w.flooders == {f"10.0.1.{i}:1": 100 + (i == 0) for i in range(4)}


def test_a_datagram_replayed_from_another_address_is_still_a_replay_and_nonces_go_once_stale():
    w = wire()
    data = w.seal({"t": "a", "n": 1}, T0 - 20)
    assert w.open(data, T0, sender="10.0.0.2:1") is not None
    assert w.open(data, T0 + 1, sender="10.0.0.3:1") is None and w.dropped["replayed"] == 1
    w._prune(T0 + 13)                                  # sealed 33 s before: stale from now on
    assert data[10:18] not in w._nonces and w.open(data, T0 + 13, sender="10.0.0.2:1") is None
    assert w.dropped["stale"] == 1


def test_truncated_oversized_and_malformed_datagrams_are_counted():
    w = wire()
    assert w.open(b"o1", T0) is None
    assert w.open(w.seal({"t": "a"}, T0)[:-5], T0) is None             # tag cut: forged
    assert w.open(b"o1" + b"\0" * 9000, T0) is None
    head = struct.pack(">2sI8s", b"o1", int(T0), os.urandom(8))
    import hashlib
    import hmac
    for body in (b"[1,2]", b"{not json", b'{"t":"zz"}'):
        data = head[:-8] + os.urandom(8) + body
        assert w.open(data + hmac.new(KEY, data, hashlib.sha256).digest(), T0) is None
    assert (w.dropped["truncated"], w.dropped["forged"], w.dropped["oversized"], w.dropped["malformed"]) == (1, 1, 1, 3)


def test_every_message_type_round_trips_through_the_wire():
    w = wire()
    for t in on.MESSAGE_TYPES:
        assert w.open(w.seal({"t": t, "x": [1, "y"]}, T0), T0)["t"] == t


def test_every_message_type_names_its_handler_and_every_handler_has_a_row():
    """MESSAGE_TYPES is the one table of who handles what: each row's handler exists on the part
    it names, the node routes exactly the routed rows (to those handlers; a join through
    GossipTCP.answer_join, which polices its answer), and no part has a handler that no row names."""
    parts = {"overlay": on.Overlay, "gossip_tcp": on.GossipTCP, "relay_server": on.RelayServer,
             "punch": on.HolePunch, "path": on._PunchSocket}
    for t, row in on.MESSAGE_TYPES.items():
        owner, name = row.handler.split(".") if row.part == "reader" else (parts[row.part].__name__, row.handler)
        assert callable(getattr(getattr(on, owner), name)), (t, row.handler)
    node = on.Node(on.Config(key=KEY))
    routed = {t: row for t, row in on.MESSAGE_TYPES.items() if row.part not in ("path", "reader")}
    assert set(node.routes) == set(routed)
    bound = {"gossip_tcp": node.gossip_tcp, "relay_server": node.relay_server, "punch": node.punch}
    for t, row in routed.items():
        handler, anyone = node.routes[t]
        expected = node._to_overlay if row.part == "overlay" else getattr(bound[row.part], row.handler)
        assert handler == (node.gossip_tcp.answer_join if t == "j" else expected) and anyone == row.anyone, t
    named = {(row.part, row.handler) for row in on.MESSAGE_TYPES.values()}
    handlers = {(part, name) for part, cls in parts.items() for name in dir(cls) if name.startswith("_on_")}
    assert handlers == {(part, name) for part, name in named if part in parts}


# ---------------------------------------------------------------------------------------------
# The overlay on the simulated network
# ---------------------------------------------------------------------------------------------
def fast_config(**kw):
    cfg = on.Config(key=KEY, probe_interval=0.5, probe_timeout=0.2, indirect_timeout=0.2, push_pull_interval=2.0)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def cluster(n, seed=1, loss=0.0, config=None, settle=5.0):
    net = simnet.SimulatedNetwork(seed=seed, loss=loss, config=config or fast_config(), start=T0)
    first = net.add()
    for _ in range(n - 1):
        net.add(bootstrap=[first.addr])
    net.run(settle)
    return net


def roots(net):
    return {m.map.digest()["root"] for m in net.live()}


def test_members_joining_through_one_seed_converge_to_one_registry():
    net = cluster(50)
    assert roots(net) == {net.live()[0].map.digest()["root"]}
    assert {len(m.map) for m in net.live()} == {50}
    assert {len(m.members) for m in net.live()} == {49}


def test_a_write_reaches_every_member_despite_20_percent_loss():
    net = cluster(60, loss=0.2, settle=10)
    writer = net.live()[3]
    net.send(writer.addr, writer.update(net.now, labels={"zone": "b"}))
    net.run(3.0)
    seen = [m.map.get(writer.sid)["labels"] for m in net.live()]
    assert seen == [{"zone": "b"}] * 60
    assert sum(len(m.suspects) for m in net.live()) == 0


def test_anti_entropy_repairs_a_partition_after_it_heals():
    net = cluster(20)
    side_a = [m.addr for m in net.live()[:10]]
    side_b = [m.addr for m in net.live()[10:]]
    net.partition(side_a, side_b)
    writer = net.members[side_a[0]]
    net.send(writer.addr, writer.update(net.now, labels={"v": "2"}))
    net.run(0.3)                                     # shorter than any suspicion grace
    assert net.members[side_b[0]].map.get(writer.sid).get("labels") is None
    net.heal()
    net.run(5.0)
    assert len(roots(net)) == 1
    assert net.members[side_b[0]].map.get(writer.sid).get("labels") == {"v": "2"}


def test_killed_member_is_suspected_by_all_then_evicted_as_left():
    net = cluster(30)
    victim = net.live()[7]
    net.kill(victim.addr)
    killed = net.now
    net.run(3.0)
    suspecting = [m.is_suspected(victim.sid) or m.map.get(victim.sid)["state"] == crdt.LEFT for m in net.live()]
    assert all(suspecting)
    net.run(15.0)
    records = [m.map.get(victim.sid) for m in net.live()]
    assert {r["state"] for r in records} == {crdt.LEFT}
    assert all(r["evicted_by"] in {m.sid for m in net.live()} for r in records)
    assert all(r["left_at"] > killed for r in records)
    assert not any(m.is_suspected(victim.sid) for m in net.live())
    assert all(victim.sid not in m.members for m in net.live())


def test_a_false_suspicion_is_refuted_by_a_version_bump():
    net = cluster(10)
    accuser, target = net.live()[0], net.live()[1]
    version = target.map.get(target.sid)["version"]
    net.send(accuser.addr, accuser._suspect(target.sid, version, accuser.sid, net.now, None))
    assert accuser.is_suspected(target.sid)
    net.run(1.0)
    assert target.map.get(target.sid)["version"] == version + 1
    assert not any(m.is_suspected(target.sid) for m in net.live())
    net.run(20.0)
    assert {m.map.get(target.sid)["state"] for m in net.live()} == {crdt.SERVING}


def test_member_partitioned_away_is_evicted_and_rejoins_as_a_new_session_after_heal():
    net = cluster(12)
    lonely = net.live()[5]
    old_sid = lonely.sid
    others = [m.addr for m in net.live() if m is not lonely]
    net.partition([lonely.addr], others)
    net.run(20.0)
    assert {net.members[a].map.get(old_sid)["state"] for a in others} == {crdt.LEFT}
    net.heal()
    net.run(8.0)
    assert lonely.sid != old_sid
    assert {m.map.get(lonely.sid)["state"] for m in net.live()} == {crdt.SERVING}
    assert {m.map.get(old_sid)["state"] for m in net.live()} == {crdt.LEFT}


def test_leave_spreads_left_and_stops_probing_the_leaver():
    net = cluster(15)
    leaver = net.live()[2]
    net.send(leaver.addr, leaver.leave(net.now))
    net.run(0.5)
    net.kill(leaver.addr)
    net.run(10.0)
    records = [m.map.get(leaver.sid) for m in net.live() if m is not leaver]
    assert {r["state"] for r in records} == {crdt.LEFT}
    assert all("evicted_by" not in r for r in records)           # it left by itself


def test_own_down_state_reaches_everyone_and_down_member_is_still_probed():
    net = cluster(10)
    sick = net.live()[4]
    net.send(sick.addr, sick.update(net.now, state=crdt.DOWN))
    net.run(1.0)
    assert {m.map.get(sick.sid)["state"] for m in net.live()} == {crdt.DOWN}
    assert all(sick.sid in m.members for m in net.live() if m is not sick)


def test_a_member_that_lost_every_peer_keeps_knocking_at_bootstrap():
    net = simnet.SimulatedNetwork(seed=3, config=fast_config(), start=T0)
    seed = net.add()
    net.kill(seed.addr)
    orphan = net.add(bootstrap=[seed.addr])
    net.run(20.0)
    joins = orphan.sent["j"]
    assert 3 <= joins <= 8                           # backoff 1, 2, 4, 8, 16 s: not a flood
    net.dead.discard(seed.addr)
    net.run(40.0)
    assert seed.sid in orphan.map and orphan.sid in seed.map


def test_idle_traffic_per_member_is_flat_in_cluster_size():
    per_node = {}
    for n in (10, 40):
        net = cluster(n, config=fast_config(probe_interval=1.0, probe_timeout=0.4, push_pull_interval=5.0))
        before = sum(net.bytes_sent.values())
        net.run(30.0)
        per_node[n] = (sum(net.bytes_sent.values()) - before) / n / 30.0
    assert per_node[40] < 1.3 * per_node[10]
    assert per_node[40] < 300                        # bytes/s: a ping, an ack and a digest


def test_lifeguard_grace_shrinks_with_confirmations_and_grows_with_size():
    small = cluster(4)
    m = small.live()[0]
    assert m._grace(0) > m._grace(1) > m._grace(2) == m._grace(5)
    big = cluster(60)
    assert big.live()[0]._grace(2) > m._grace(2)


def test_malformed_authentic_messages_raise_without_changing_state():
    net = cluster(3)
    m = net.live()[0]
    root = m.map.digest()["root"]
    bad = [{"t": "r", "r": {"x": {"owner": "a"}}}, {"t": "r", "r": [1]}, {"t": "r", "s": [["a", "b"]]},
           {"t": "p"}, {"t": "i", "n": 1, "to": "x", "a": "nohostport"}, {"t": "d", "d": 5},
           {"t": "st", "r": {m.sid: {"owner": "x", "state": 9, "version": 0, "started": 0}}}]
    for msg in bad:
        with pytest.raises((KeyError, TypeError, ValueError, AttributeError)):
            m.receive(msg, "10.0.0.9:1", net.now)
    assert m.map.digest()["root"] == root


def test_probe_round_follows_the_table_direct_then_indirect_and_tcp_then_suspect():
    cfg = fast_config()
    a = on.Overlay(cfg, "a" * 32, {"owner": "x", "state": 1, "version": 0, "started": T0, "gossip": "h:1"}, T0,
                   rng=random.Random(1))
    for i, sid in enumerate(("b" * 32, "c" * 32, "d" * 32)):
        a.receive({"t": "st", "r": {sid: {"owner": "x", "state": 1, "version": 0, "started": T0,
                                          "gossip": f"h:{i + 2}"}}}, "h:2", T0)
    out = a.tick(a.next_probe)
    ping = [o for o in out if o.msg["t"] == "p"]
    assert len(ping) == 1 and not ping[0].tcp
    target = a.probe["sid"]
    out = a.tick(a.probe["deadline"])
    probes = sorted((o.msg["t"], o.tcp) for o in out if o.msg["t"] in ("i", "p"))
    assert probes == [("i", False), ("i", False), ("p", True)]
    out = a.tick(a.probe["deadline"])
    assert a.is_suspected(target)
    assert any(o.msg["t"] == "r" and o.msg["s"][0][0] == target for o in out)


# ---------------------------------------------------------------------------------------------
# Config, keys, CLI bits
# ---------------------------------------------------------------------------------------------
def test_timing_defaults_can_be_overridden_from_the_environment():
    cfg = on.config_from_env(on.Config(), {"OTELA_PROBE_INTERVAL": "0.2", "OTELA_INDIRECT_CHECKS": "5"})
    assert (cfg.probe_interval, cfg.indirect_checks) == (0.2, 5)
    names = [f.name for f in on.KNOBS]
    assert "probe_timeout" in names and "key" not in names


def test_every_knob_is_a_flag_and_a_variable_with_its_unit_and_reason(capsys):
    import crdt
    parser = on.build_parser()
    env = {"OTELA_PUNCH_IDLE": "7", "OTELA_MAX_LINK_STREAMS": "9"}
    args = crdt.parse_settings(parser, ["start", "--process", "e", "--join-retry-max", "12"], on.SETTING_NAMES, env)
    cfg = on.tuned(on.Config(), args)
    assert (cfg.punch_idle, cfg.max_link_streams, cfg.join_retry_max) == (7.0, 9, 12.0)
    assert type(cfg.max_link_streams) is int
    for f in on.KNOBS:
        assert f.metadata["unit"] and len(f.metadata["why"]) > 20, f.name
    with pytest.raises(SystemExit):
        crdt.parse_settings(parser, ["start", "--process", "e", "--punch-idle", "-1"], on.SETTING_NAMES, {})
    assert "is negative" in capsys.readouterr().err
    with pytest.raises(on.ConfigError, match="OTELA_PUNCH_IDLE"):
        on.config_from_env(on.Config(), {"OTELA_PUNCH_IDLE": "soon"})


def test_keygen_writes_a_private_key_that_load_key_reads(tmp_path):
    paths = on.keygen(str(tmp_path / "k"))
    key_path = paths[0]
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert len(on.load_key(key_path)) == 32
    with pytest.raises(on.ConfigError, match="exists"):
        on.keygen(str(tmp_path / "k"))


def test_load_key_refuses_missing_short_and_world_readable_keys(tmp_path):
    with pytest.raises(on.ConfigError, match="cannot read"):
        on.load_key(str(tmp_path / "nope"))
    p = tmp_path / "k"
    p.write_text("ab" * 32)
    os.chmod(p, 0o644)
    with pytest.raises(on.ConfigError, match="chmod 600"):
        on.load_key(str(p))
    os.chmod(p, 0o600)
    assert on.load_key(str(p)) == bytes.fromhex("ab" * 32)
    p.write_text("short")
    with pytest.raises(on.ConfigError, match="too short"):
        on.load_key(str(p))


def test_overlay_args_read_flags_and_environment(tmp_path, monkeypatch):
    import argparse
    key = on.keygen(str(tmp_path))[0]
    monkeypatch.setenv("OTELA_KEY_FILE", key)
    monkeypatch.setenv("OTELA_BOOTSTRAP", "10.0.0.1:7946,10.0.0.2:7946")
    monkeypatch.setenv("OTELA_LABEL", "site=a,tier=gold")
    parser = argparse.ArgumentParser()
    on.add_overlay_args(parser)
    cfg = on.config_from_args(crdt.parse_settings(parser, ["--gossip", "127.0.0.1:9000"], on.SETTING_NAMES, os.environ))
    assert cfg.bootstrap == ["10.0.0.1:7946,10.0.0.2:7946"]
    assert cfg.labels == {"site": "a", "tier": "gold"}
    assert (cfg.gossip, cfg.listen) == ("127.0.0.1:9000", on.DEFAULT_LISTEN)
    with pytest.raises(on.ConfigError, match="label"):
        on.config_from_args(crdt.parse_settings(parser, ["--label", "novalue"], on.SETTING_NAMES, os.environ))


def test_bootstrap_resolves_lists_files_and_skips_bad_entries(tmp_path):
    import asyncio
    f = tmp_path / "peers"
    f.write_text("10.0.0.3:1\n10.0.0.4:2, 10.0.0.5:3\n")
    got = asyncio.run(on.resolve_bootstrap(["10.0.0.1:7946,10.0.0.2:7946", str(f), "garbage"]))
    assert got == ["10.0.0.1:7946", "10.0.0.2:7946", "10.0.0.3:1", "10.0.0.4:2", "10.0.0.5:3"]


def test_cli_errors_are_one_line_with_exit_2(tmp_path, capsys):
    assert on.main(["start", "--key-file", str(tmp_path / "none"), "--process", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster key" in err[0]


def test_hardware_detection_falls_back_to_cpu_without_gpu_tools(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    hw = on.detect_hardware()
    assert hw["gpu"] == "cpu" and hw["count"] >= 1 and hw["memory_gb"] > 0


def test_bootstrap_url_returning_a_json_list_or_text_is_followed():
    import asyncio
    import http.server
    import threading

    bodies = {"/json": b'["10.1.0.1:7946", "10.1.0.2:7946"]', "/text": b"10.1.0.3:7946\n"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = bodies.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        got = asyncio.run(on.resolve_bootstrap([f"{base}/json", f"{base}/text", f"{base}/missing"]))
    finally:
        server.shutdown()
        server.server_close()
    assert got == ["10.1.0.1:7946", "10.1.0.2:7946", "10.1.0.3:7946"]


# ---------------------------------------------------------------------------------------------
# The overlay heals: partitions, restarts, loss, a slow member (issue 11)
# ---------------------------------------------------------------------------------------------
def converged(net):
    """One registry, in which every live process has its session live and unsuspected."""
    want = {m.sid for m in net.live()}
    return len(roots(net)) == 1 and all(
        {sid for sid, r in m.map.items() if r["state"] < crdt.LEFT and not m.is_suspected(sid)} == want
        for m in net.live())


def run_until(net, predicate, limit, step=0.1):
    start = net.now
    while not predicate() and net.now - start < limit:
        net.run(step)
    return net.now - start


def test_halves_split_longer_than_the_suspicion_grace_merge_again_without_evicting_anyone():
    net = cluster(24)
    sids = [m.sid for m in net.live()]
    addrs = [m.addr for m in net.live()]
    net.partition(addrs[:12], addrs[12:])
    net.run(40.0)                                   # the lone-suspector grace here is ~12 s
    assert all(m.is_suspected(sid) for m in net.live()[:12] for sid in sids[12:])
    net.heal()
    assert run_until(net, lambda: converged(net), 10.0) < 10.0
    assert [m.sid for m in net.live()] == sids       # nobody was evicted, nobody rejoined
    assert all(m.map.get(sid)["state"] == crdt.SERVING for m in net.live() for sid in sids)


def test_evicted_members_are_redialled_so_a_lopsided_split_merges_when_it_heals():
    net = cluster(16)
    lonely = net.live()[0]                          # the member everybody bootstrapped to
    old = lonely.sid
    net.partition([lonely.addr], [m.addr for m in net.live()[1:]])
    net.run(30.0)
    assert all(m.map.get(old)["state"] == crdt.LEFT for m in net.live()[1:])
    net.heal()
    assert run_until(net, lambda: converged(net), 15.0) < 15.0
    assert lonely.sid != old


@pytest.mark.parametrize("kill9, down", [(False, 9.0), (True, 9.0), (True, 0.3)])
def test_a_restarted_seed_without_bootstrap_is_found_again_within_seconds(kill9, down):
    net = simnet.SimulatedNetwork(seed=3, config=fast_config(), start=T0)
    ingress = net.add(role="ingress")
    for _ in range(10):
        net.add(bootstrap=[ingress.addr])
    net.run(5.0)
    old = ingress.sid
    if not kill9:
        net.send(ingress.addr, ingress.leave(net.now))
        net.run(0.5)
    net.kill(ingress.addr)
    net.run(down)
    new = net.add(addr=ingress.addr, role="ingress")     # same flags: no --bootstrap
    nodes = {m.sid for m in net.live() if m is not new}
    took = run_until(net, lambda: nodes <= {s for s, r in new.map.items() if r["state"] == crdt.SERVING}, 30.0)
    assert took < 10.0
    assert run_until(net, lambda: converged(net), 10.0) < 10.0
    assert all(m.map.get(old)["state"] == crdt.LEFT for m in net.live())


def test_a_suspicion_the_suspect_missed_reaches_it_by_anti_entropy_and_is_refuted():
    net = cluster(10)
    accuser, target = net.live()[0], net.live()[1]
    version = target.record["version"]
    accuser._suspect(target.sid, version, accuser.sid, net.now, None)   # its rumour is lost
    assert accuser.is_suspected(target.sid)
    net.run(12.0)                                   # push-pull every 2 s, probes every 0.5 s
    assert target.record["version"] > version
    assert not any(m.is_suspected(target.sid) for m in net.live())
    assert target.map.get(target.sid)["state"] == crdt.SERVING


def test_an_ack_from_a_suspect_clears_the_suspicion_and_the_ping_asks_it_to_refute():
    net = cluster(5)
    prober, target = net.live()[0], net.live()[1]
    prober._suspect(target.sid, target.record["version"], prober.sid, net.now, None)
    prober.ring = [prober.sid, target.sid]          # make the next probe go to the suspect
    prober.members = {target.sid: target.addr}
    out = prober._start_probe(net.now)
    assert out[0].msg["sv"] == target.record["version"]
    answer = target.receive(out[0].msg, prober.addr, net.now)
    assert [o.msg["t"] for o in answer][0] == "a" and target.record["version"] == 1
    prober.receive(answer[0].msg, target.addr, net.now)
    assert not prober.is_suspected(target.sid)


def test_every_member_is_probed_in_every_round_with_one_view():
    net = cluster(40)
    probed = []
    for m in net.live():
        m.probe = None
        out = m._start_probe(net.now)
        probed.append(out[0].addr)
    assert sorted(probed) == sorted(m.addr for m in net.live())


def test_a_lagging_member_is_not_evicted_and_stops_being_accused():
    net = cluster(30, settle=8)
    slow = net.live()[4]
    net.slow[slow.addr] = (0.3, 1.5)
    sids = [m.sid for m in net.live()]
    net.run(120.0)
    early = slow.record["version"]
    net.run(120.0)
    assert [m.sid for m in net.live()] == sids
    assert all(m.map.get(s)["state"] == crdt.SERVING for m in net.live() for s in sids)
    assert slow.record["version"] - early <= 2      # the refutations die out


def test_no_false_eviction_at_20_percent_loss():
    net = cluster(30, loss=0.2, settle=10)
    sids = [m.sid for m in net.live()]
    net.run(180.0)
    assert all(m.map.get(s)["state"] == crdt.SERVING for m in net.live() for s in sids)


def test_writes_reach_every_member_in_resend_rounds_not_at_anti_entropy():
    net = cluster(60, loss=0.2, settle=10, config=fast_config(push_pull_interval=3600.0))
    writer = net.live()[3]
    net.send(writer.addr, writer.update(net.now, labels={"zone": "c"}))
    net.run(2.0)
    assert [m.map.get(writer.sid)["labels"] for m in net.live()] == [{"zone": "c"}] * 60
    assert not writer.pushes                        # every member acked


def test_a_join_answer_carries_live_and_recent_records_only_and_compaction_prunes_known():
    net = cluster(4)
    seed = net.live()[0]
    gone = {"owner": "x", "state": crdt.LEFT, "version": 3, "started": net.now - 9000,
            "left_at": net.now - 7200, "gossip": "10.9.9.9:1"}
    recent = dict(gone, left_at=net.now - 60)
    seed.map.merge({"a" * 32: gone, "b" * 32: recent})
    seed.known["a" * 32] = on.Known(gone)
    answer = seed.receive({"t": "j", "r": {}}, "10.0.0.99:7946", net.now)
    state = [o.msg for o in answer if o.msg["t"] == "st"][0]["r"]
    assert "a" * 32 not in state and "b" * 32 in state and len(state) == 5
    seed.tick(net.now + seed.cfg.retention + seed.cfg.compact_interval)
    assert "a" * 32 not in seed.known


def test_an_alone_member_names_the_bootstrap_that_never_answered():
    net = simnet.SimulatedNetwork(seed=1, config=fast_config(), start=T0)
    lonely = net.add(bootstrap=["10.99.0.1:7946"])
    net.run(1.0)
    assert lonely.health(net.now) == []
    net.run(3.0)
    [warning] = lonely.health(net.now)
    assert "10.99.0.1:7946 has not answered" in warning


def test_the_port_a_node_picks_for_its_engine_is_below_the_ephemeral_range_and_free(monkeypatch):
    # an engine that binds its port tens of seconds after the node chose it must not find it
    # taken by an outgoing connection's source port (those come from the ephemeral range)
    low = on._ephemeral_low()
    ports = [on.free_port() for _ in range(50)]
    assert all(max(1024, low - 20000) <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    monkeypatch.setattr(on, "_ephemeral_low", lambda: 1024)   # no room below the range: port 0's pick
    assert 0 < on.free_port() < 65536
    cfg = on.Config(key=bytes(32))
    sup = on.EngineSupervisor("engine --port {port}", None, cfg)
    port = int(sup.argv[-1])
    assert sup.url == f"http://127.0.0.1:{port}"


def test_an_engines_model_list_gives_its_adapters_with_their_base_and_its_context_window():
    vllm = [{"id": "base", "root": "/models/base", "max_model_len": 8192},
            {"id": "sql", "root": "/adapters/sql", "parent": "base", "max_model_len": 8192}]
    assert on.engine_catalog(vllm) == {"models": ["base", "sql"], "adapters": {"sql": ["base", "/adapters/sql"]},
                                       "max_model_len": 8192}
    llama_cpp = [{"id": "smollm2-135m", "owned_by": "llamacpp", "meta": {"n_ctx": 2048, "n_ctx_train": 8192}}]
    assert on.engine_catalog(llama_cpp) == {"models": ["smollm2-135m"], "adapters": {}, "max_model_len": 2048}


def test_an_engines_model_list_past_the_registrys_bounds_is_cut_to_them():
    data = [{"id": "base"}, {"id": "x" * 300, "parent": "base"},                 # a name past MAX_STRING
            {"id": "far", "parent": "base", "root": "/" + "p" * 300}]           # a path past it: kept without
    data += [{"id": f"a{i}", "parent": "base"} for i in range(100)]            # more than MAX_LIST
    catalog = on.engine_catalog(data)
    assert len(catalog["models"]) == crdt.MAX_LIST and "x" * 300 not in catalog["models"]
    assert catalog["adapters"]["far"] == ["base", ""]
    assert len(catalog["adapters"]) <= crdt.MAX_ADAPTERS


def test_a_probes_number_cannot_be_guessed_so_a_forged_ack_neither_refutes_nor_looks_near():
    """An ack counts for the member probed whoever sends it (a helper's does): a key holder that
    could guess the number would keep a dead member alive, or answer before the probe arrives and
    look closer than it is to the locality rule."""
    cfg = fast_config()
    a = on.Overlay(cfg, "a" * 32, {"owner": "x", "state": 1, "version": 0, "started": T0, "gossip": "h:1"}, T0)
    b = "b" * 32
    a.receive({"t": "st", "r": {b: {"owner": "x", "state": 1, "version": 0, "started": T0, "gossip": "h:2"}}},
              "h:2", T0)
    seen = []
    now = T0
    for _ in range(3):
        a.probe = None
        now += 1.0
        out = a._start_probe(now)
        seen.append(out[0].msg["n"])
    a._suspect(b, 0, a.sid, now, None)
    guesses = {seen[-1] + k for k in range(-1000, 1001)} | set(range(1, 1001))
    for n in sorted(guesses - {a.probe["seq"]}):
        a.receive({"t": "a", "n": n}, "h:9", now + 0.001)
    assert a.is_suspected(b) and b not in a.round_trips
    assert len(set(seen)) == 3 and all(0 <= n < 2 ** 53 for n in seen)
    assert max(seen) - min(seen) > 10 ** 6          # not a counter
