"""Authority in tiers, the registry in planes.

The cluster key (every compute job has it) admits a member; only the ingress tier's secret
writes API keys and usage, and only ingresses hold them. Checked in the simulated overlay
(sans-IO: workers, ingresses and an attacker in one process) and against a real ingress
attacked over loopback by tests/attack_registry.py with nothing but the cluster key.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest
import simnet

import crdt
import otela_node as on

KEY = b"c" * 32
TIER = b"i" * 32
T0 = 1_700_000_000.0


def config(**kw):
    cfg = on.Config(key=KEY, probe_interval=0.5, probe_timeout=0.2, indirect_timeout=0.2, push_pull_interval=2.0)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def fleet(workers=3, ingresses=2):
    """Ingresses holding the tier's secret and workers without it, joined through ingress 0."""
    net = simnet.SimulatedNetwork(seed=7, config=config(), start=T0)
    first = net.add(config=config(ingress_keys=[TIER]), role="ingress")
    ins = [first] + [net.add([first.addr], config=config(ingress_keys=[TIER]), role="ingress")
                     for _ in range(ingresses - 1)]
    ws = [net.add([first.addr]) for _ in range(workers)]
    net.run(4.0)
    return net, ins, ws


def key_write(member, net, token="sk-1", **fields):
    digest = crdt.hashlib.sha256(token.encode()).hexdigest()
    record = crdt.key_record("k1", "alice", net.now, **fields)
    net.send(member.addr, member.publish(crdt.key_entry(digest), record, net.now))
    return crdt.key_entry(digest)


def test_a_key_written_at_one_ingress_reaches_the_other_ingresses_and_no_worker():
    net, ins, ws = fleet()
    entry = key_write(ins[0], net)
    net.run(2.0)
    assert ins[1].map.get(entry)["user"] == "alice"
    assert all(entry not in w.map for w in ws)
    assert all(w.map.plane_size(crdt.INGRESS) == 0 for w in ws)
    # what workers compare in push-pull is what both sides hold: the routing plane
    assert {w.map.digest(plane=crdt.ROUTING)["root"] for w in ws} == \
        {ins[0].map.digest(plane=crdt.ROUTING)["root"]}
    assert ins[0].ingresses.keys() == {ins[1].sid} and not ws[0].ingresses


def test_records_from_a_member_holding_only_the_cluster_key_are_never_applied_at_an_ingress():
    net, ins, ws = fleet()
    victim = key_write(ins[0], net, budget_day=1000)
    net.run(2.0)
    attacker = ws[0]
    now = net.now
    real = ins[1].map.get(victim)
    forged = {
        victim: dict(crdt.unsigned(real), version=99, admin=True),             # promoted, unbudgeted
        crdt.key_entry("ab" * 32): crdt.key_record("evil", "mallory", now, admin=True),
        crdt.usage_entry("ab" * 32, "m", crdt.time_day(now), "s1"):
            crdt.usage_record("ab" * 32, "m", crdt.time_day(now), "s1", 1, 1, 10**9, 0),
    }
    forged_sig = {victim: dict(crdt.revoked(crdt.unsigned(real), now), sig="f" * 64)}
    for target in ins:
        for batch in (forged, forged_sig):
            net.send(attacker.addr, [on.Out(target.addr, {"t": "r", "r": batch}, False)])
            net.send(attacker.addr, [on.Out(target.addr, {"t": "st", "r": batch}, True)])
    net.run(3.0)
    for ingress in ins:
        assert ingress.map.get(victim)["version"] == real["version"]
        assert ingress.map.get(victim)["state"] == crdt.KEY_ACTIVE and "admin" not in ingress.map.get(victim)
        assert ingress.map.get(victim)["budget_day"] == 1000
        assert crdt.key_entry("ab" * 32) not in ingress.map
        assert ingress.map.plane_size(crdt.INGRESS) == 1
        assert ingress.refused["unsigned"] >= 8


def test_a_peer_ingress_usage_slot_claiming_more_than_a_context_window_a_request_is_refused():
    # signed by the tier (an ingress of an older release booked an engine's 10^15 as given): still
    # no slot may say a request used more than crdt.MAX_REQUEST_TOKENS tokens either way
    net, ins, _ = fleet(workers=0, ingresses=2)
    authority = crdt.Authority([TIER])
    day = crdt.time_day(net.now)

    def slot(name, requests, prompt, completion):
        entry = crdt.usage_entry("ab" * 32, crdt.ALL_MODELS, day, name)
        return entry, authority.sign(entry, crdt.usage_record("ab" * 32, crdt.ALL_MODELS, day, name, 1, requests,
                                                              prompt, completion))

    absurd = [slot("s1", 1, 10**15, 0), slot("s2", 1, 0, 10**15),
              slot("s3", 2, 2 * crdt.MAX_REQUEST_TOKENS + 1, 0)]
    for entry, record in absurd:   # the node counts the message malformed and drops it
        with pytest.raises(crdt.RecordError, match="a request"):
            ins[1].receive({"t": "r", "r": {entry: record}}, ins[0].addr, net.now)
    honest = slot("s4", 2, 2 * crdt.MAX_REQUEST_TOKENS, 5)    # two requests at the bound: believed
    net.send(ins[0].addr, [on.Out(ins[1].addr, {"t": "r", "r": {honest[0]: honest[1]}}, False)])
    net.run(1.0)
    assert [entry in ins[1].map for entry, _ in absurd] == [False, False, False]
    assert ins[1].map.get(honest[0])["prompt_tokens"] == 2 * crdt.MAX_REQUEST_TOKENS


def test_a_worker_claiming_to_be_an_ingress_gets_no_keys_or_usage():
    net, ins, ws = fleet(workers=1, ingresses=1)
    key_write(ins[0], net)
    net.run(1.0)
    impostor = net.add([ins[0].addr], role="ingress")            # the cluster key, no tier secret
    net.run(4.0)
    assert impostor.map.plane_size(crdt.INGRESS) == 0
    assert impostor.sid not in ins[0].ingresses
    # and asking outright for the ingress plane's differences is refused
    before = ins[0].refused["plane"]
    digest = {"n": 0, "root": "0" * 32, "b": {}}
    net.send(impostor.addr, [on.Out(ins[0].addr, {"t": "db", "pl": "i", "d": digest}, True)])
    net.run(1.0)
    assert ins[0].refused["plane"] == before + 1 and impostor.map.plane_size(crdt.INGRESS) == 0


def test_an_ingress_that_was_away_catches_up_on_keys_by_anti_entropy():
    net, ins, ws = fleet(workers=2, ingresses=2)
    net.partition([ins[1].addr], [m.addr for m in net.live() if m is not ins[1]])
    entries = [key_write(ins[0], net, token=f"sk-{i}") for i in range(20)]
    net.run(2.0)
    assert not any(e in ins[1].map for e in entries)
    net.heal()
    net.run(12.0)
    assert all(e in ins[1].map for e in entries)


def test_a_join_answer_goes_in_pieces_no_bigger_than_the_state_chunk():
    cfg = config(state_chunk=4096)
    member = on.Overlay(cfg, "a" * 32, {"owner": "o", "state": crdt.SERVING, "version": 0, "started": T0,
                                        "role": "worker", "gossip": "10.0.0.1:7946"}, T0)
    sessions = {f"{i:032x}": {"owner": "o", "state": crdt.SERVING, "version": 0, "started": T0,
                              "role": "worker", "gossip": f"10.0.1.{i}:7946", "models": ["m" * 40]}
                for i in range(1, 200)}
    member.receive({"t": "st", "r": sessions}, "10.0.0.9:7946", T0)
    joiner = {"b" * 32: {"owner": "o", "state": crdt.JOIN, "version": 0, "started": T0,
                         "gossip": "10.0.0.2:7946"}}
    outs = member.receive({"t": "j", "r": joiner}, "10.0.0.2:7946", T0, tcp=True)
    answers = [o for o in outs if o.msg["t"] == "st"]
    assert len(answers) >= 8
    assert max(len(crdt.dumps(o.msg["r"])) for o in answers) <= 4096 + 2048
    received = {}
    for o in answers:
        received.update(o.msg["r"])
    assert set(sessions) <= set(received)


def _two(seed):
    net = simnet.SimulatedNetwork(seed=seed, config=config(), start=T0)
    a = net.add()
    b = net.add([a.addr])
    net.run(3.0)
    return net, a, b


def test_only_the_owner_ends_its_session_as_its_owner_a_forged_left_or_new_seal_is_refused():
    net, a, b = _two(3)
    old = b.sid
    held = b.map.get(old)
    zombie = dict(held, state=crdt.LEFT, left_at=net.now, version=b.record["version"] + 1)   # no unseal
    reseal = dict(held, version=held["version"] + 5, seal="0" * 32, models=["forged"])
    net.send(a.addr, [on.Out(b.addr, {"t": "r", "r": {old: zombie}}, False),
                      on.Out(a.addr, {"t": "r", "r": {old: reseal}}, False)])
    net.run(3.0)
    assert b.sid == old and a.map.get(old)["state"] == crdt.SERVING and a.map.get(old).get("models") != ["forged"]
    assert a.map.refused["seal"] >= 1 and b.map.refused["seal"] >= 1
    net.send(b.addr, b.leave(net.now))                       # the owner's own LEFT unseals: taken
    net.run(3.0)
    left = a.map.get(old)
    assert left["state"] == crdt.LEFT and crdt.seal_of(left["unseal"]) == left["seal"]


def test_an_eviction_needs_the_failure_detectors_evidence():
    net, a, b = _two(4)
    old = b.sid
    bare = dict(b.map.get(old), state=crdt.LEFT, left_at=net.now, evicted_by=a.sid)
    net.send(a.addr, [on.Out(b.addr, {"t": "r", "r": {old: bare}}, False)])
    net.run(3.0)
    assert b.sid == old and b.map.refused["eviction_without_evidence"] == 1
    with pytest.raises(crdt.RecordError, match="grace"):     # sooner than its own grace: malformed
        crdt.validate(old, dict(bare, evidence={"since": bare["left_at"], "grace": 5.0, "by": [a.sid]}))
    # Evidence can be made up by a key holder: the live member then rejoins as a new session
    evicted = dict(bare, left_at=net.now, evidence={"since": net.now - 5.0, "grace": 4.0, "by": [a.sid]})
    net.send(a.addr, [on.Out(b.addr, {"t": "r", "r": {old: evicted}}, False)])
    net.run(3.0)
    assert b.sid != old and a.map.get(b.sid)["state"] == crdt.SERVING


def test_a_dead_member_is_evicted_with_the_evidence_of_its_suspicion():
    net = simnet.SimulatedNetwork(seed=6, config=config(), start=T0)
    members = [net.add()]
    members += [net.add([members[0].addr]) for _ in range(4)]
    net.run(5.0)
    victim = members[-1]
    net.kill(victim.addr)
    net.run(30.0)
    record = members[0].map.get(victim.sid)
    evidence = record["evidence"]
    assert record["state"] == crdt.LEFT and record["evicted_by"] in evidence["by"]
    assert set(evidence["by"]) <= {m.sid for m in members[:-1]}
    assert record["left_at"] >= evidence["since"] + evidence["grace"] > evidence["since"]


def test_entries_of_a_kind_this_release_does_not_know_are_carried_and_bounded():
    net = simnet.SimulatedNetwork(seed=5, config=config(), start=T0)
    a = net.add()
    b = net.add([a.addr])
    net.run(3.0)
    future = {"zz:one": {"state": 0, "version": 3, "anything": [1, 2]}}
    net.send(a.addr, [on.Out(b.addr, {"t": "r", "r": dict(future, **{a.sid: a.map.get(a.sid)})}, False)])
    net.run(3.0)
    assert a.map.get("zz:one") is None or a.map.get("zz:one")["version"] == 3
    assert b.map.get("zz:one")["anything"] == [1, 2]
    gmap = crdt.GMap()
    gmap.merge({f"zz:{i}": {"state": 0, "version": 0} for i in range(crdt.MAX_UNKNOWN + 10)})
    assert gmap.plane_size(crdt.ROUTING) == crdt.MAX_UNKNOWN and gmap.refused["unknown_full"] == 10


def test_the_ingress_tier_rotates_without_an_outage():
    old, new = crdt.Authority([b"o" * 32]), crdt.Authority([b"n" * 32, b"o" * 32])
    entry = crdt.key_entry("cd" * 32)
    signed_old = old.sign(entry, crdt.key_record("k", "u", T0))
    only_new = crdt.Authority([b"n" * 32])
    assert new.verify(entry, signed_old) and not only_new.verify(entry, signed_old)
    signed_new = new.sign(entry, signed_old)
    assert only_new.verify(entry, signed_new) and not old.verify(entry, signed_new)
    assert not crdt.Authority([b"n" * 32]).verify(entry, signed_old)   # retired: refused
    # the cluster key: a member that has the new key first still hears one sealing with the old
    cfg = on.Config(key=b"n" * 32, accept_keys=[b"o" * 32])
    sealed = on.Wire(b"o" * 32, on.Config(key=b"o" * 32)).seal({"t": "a", "n": 1}, T0)
    assert on.Wire(cfg.key, cfg).open(sealed, T0) == {"t": "a", "n": 1}
    assert on.Wire(b"n" * 32, on.Config(key=b"n" * 32)).open(sealed, T0) is None


def test_keygen_rotates_in_three_steps_each_of_which_every_holder_of_the_step_before_accepts(tmp_path):
    written = on.keygen(str(tmp_path))
    assert [os.path.basename(p) for p in written[:2]] == ["cluster.key", "ingress.key"]
    path = str(tmp_path / "cluster.key")
    steps = [on.load_secrets(path)]
    for step in on.ROTATION_STEPS:
        on.rotate(str(tmp_path), "cluster", step)
        steps.append(on.load_secrets(path))
    old, new = steps[0][0], steps[1][1]
    assert steps[1] == [old, new] and steps[2] == [new, old] and steps[3] == [new]
    for before, after in zip(steps, steps[1:]):   # a holder still at the step before hears one at the next
        sealer = on.Wire(after[0], on.Config(key=after[0]))
        hearer = on.Config(key=before[0], accept_keys=before[1:])
        assert on.Wire(hearer.key, hearer).open(sealer.seal({"t": "a", "n": 1}, T0), T0) == {"t": "a", "n": 1}
    assert (tmp_path / "cluster.key").stat().st_mode & 0o077 == 0


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> bool:
    """Whether a tunnel server and client with these contexts complete mutual TLS (socketpair)."""
    a, b = socket.socketpair()
    served = []

    def serve():
        try:
            with server.wrap_socket(a, server_side=True) as tls:
                served.append(tls.recv(1))
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(b, server_hostname=on.TLS_SERVER_NAME) as tls:
            tls.sendall(b"x")
    except (ssl.SSLError, OSError):
        b.close()
    thread.join(10)
    a.close()
    return served == [b"x"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="keygen needs openssl for the certificate")
def test_keygen_rotation_renews_the_tunnel_certificate_and_each_step_handshakes_with_the_one_before(tmp_path):
    # before: the steps left cluster.crt and cluster-tls.key as they were, so a stolen pair stayed valid
    on.keygen(str(tmp_path / "keys"))
    snapshots = []

    def snapshot():
        folder = tmp_path / f"step{len(snapshots)}"
        folder.mkdir()
        for name in ("cluster.crt", "cluster-tls.key"):
            shutil.copy(tmp_path / "keys" / name, folder / name)
        cfg = on.Config()
        cfg.tls_cert, cfg.tls_key = str(folder / "cluster.crt"), str(folder / "cluster-tls.key")
        snapshots.append(on.tunnel_tls(cfg))   # (server, client) contexts, as a member makes them

    snapshot()
    for step in on.ROTATION_STEPS:
        written = on.rotate(str(tmp_path / "keys"), "cluster", step)
        assert [os.path.basename(p) for p in written] == ["cluster.key", "cluster.crt", "cluster-tls.key"]
        assert os.stat(tmp_path / "keys" / "cluster-tls.key").st_mode & 0o077 == 0
        snapshot()
    # a member restarted at step n meets members still at step n - 1, both ways
    for before, after in zip(snapshots, snapshots[1:]):
        assert handshake(before[0], after[1]) and handshake(after[0], before[1])
    # once retired everywhere, the first pair (stolen, say) is refused both ways
    assert not handshake(snapshots[3][0], snapshots[0][1]) and not handshake(snapshots[0][0], snapshots[3][1])
    first, last = (open(tmp_path / f"step{n}" / "cluster.crt").read() for n in (0, 3))
    assert first.count("BEGIN CERTIFICATE") == last.count("BEGIN CERTIFICATE") == 1 and first != last


@pytest.mark.skipif(shutil.which("openssl") is None, reason="keygen needs openssl for the certificate")
def test_a_tunnel_pair_that_does_not_pair_up_stops_the_rotation_in_one_line_before_the_key_changes(tmp_path):
    on.keygen(str(tmp_path))
    before = (tmp_path / "cluster.key").read_text()
    with open(tmp_path / "cluster.crt", "a") as fh:   # a certificate without its key
        fh.write((tmp_path / "cluster.crt").read_text())
    done = subprocess.run([sys.executable, "otela_node.py", "keygen", "--out", str(tmp_path), "--rotate", "cluster"],
                          capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "do not pair up" in done.stderr
    assert (tmp_path / "cluster.key").read_text() == before


def test_keygen_takes_one_rotation_step_at_a_time(tmp_path):
    on.keygen(str(tmp_path))
    done = subprocess.run([sys.executable, "otela_node.py", "keygen", "--out", str(tmp_path), "--rotate", "ingress",
                           "--retire", "ingress"], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "one of" in done.stderr


# ---------------------------------------------------------------------------------------------
# A real ingress, attacked with the cluster key alone
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_compute_job_with_the_cluster_key_cannot_create_change_or_revoke_keys_or_usage(tmp_path):
    from test_ingress_support import Client, Cluster
    cluster = Cluster(str(tmp_path))
    try:
        root = cluster.root
        made = subprocess.run([sys.executable, os.path.join(root, "otela_ingress.py"), "keys", "create",
                               "--user", "bob", "--budget-day", "1000", "--json", "--db", cluster.db],
                              capture_output=True, text=True, timeout=60, check=True)
        bob = json.loads(made.stdout)["key"]
        admin = Client(cluster.url, cluster.token)
        time.sleep(1.5)   # the new key reaches the ingress through its --db
        before = json.loads(admin.request("GET", "/v1/admin/keys")[2])
        view = json.loads(Client(cluster.url).request("GET", "/v1/registry")[2])
        attack = subprocess.run([sys.executable, os.path.join(root, "tests", "attack_registry.py"),
                                 "--key-file", cluster.key_file, "--gossip", f"127.0.0.1:{cluster.gossip}",
                                 "--db", cluster.db, "--slot", view["self"]],
                                capture_output=True, text=True, timeout=60, check=True)
        report = json.loads(attack.stdout)
        time.sleep(1.0)
        forged_admin = Client(cluster.url, report["token"])
        assert forged_admin.request("GET", "/v1/admin/keys")[0] == 401
        assert Client(cluster.url, bob).request("GET", "/v1/models")[0] == 200        # not revoked
        assert Client(cluster.url, bob).request("GET", "/v1/admin/keys")[0] in (401, 403)   # not admin
        after = json.loads(admin.request("GET", "/v1/admin/keys")[2])
        assert after == before                                   # nothing renamed, expired, unbudgeted
        usage = json.loads(Client(cluster.url, bob).request("GET", "/v1/usage")[2])
        assert usage.get("tokens_today", 0) == 0
        metrics = Client(cluster.url).request("GET", "/metrics")[2].decode()
        refused = [line for line in metrics.splitlines() if line.startswith('otela_registry_refused_total{why="unsigned"}')]
        assert refused and int(refused[0].split()[-1]) >= report["sent"] - 1
    finally:
        cluster.close()


def test_a_flood_of_forged_sessions_is_bounded_in_count_and_bytes_and_counted():
    gmap = crdt.GMap()
    big = {"owner": "x" * 200, "state": crdt.SERVING, "version": 0, "started": T0, "gossip": "10.1.1.1:1",
           "labels": {f"l{i}": "v" * 40 for i in range(25)}}
    flood = {f"{i:032x}": big for i in range(30_000)}
    gmap.merge(flood)
    held = gmap.plane_size(crdt.ROUTING)
    assert held < crdt.MAX_SESSIONS and gmap._session_bytes <= crdt.MAX_SESSION_BYTES
    assert gmap.refused["sessions_full"] == 30_000 - held
    assert gmap.put("f" * 32, dict(big, owner="me"))    # a member's own record always goes in
    gmap.compact(T0)                                    # nothing LEFT: still full, still bounded
    assert gmap.plane_size(crdt.ROUTING) == held + 1


def test_a_member_that_joins_itself_gets_in_when_forged_sessions_fill_the_registry():
    member = on.Overlay(config(), "a" * 32, {"owner": "o", "state": crdt.SERVING, "version": 0, "started": T0,
                                             "role": "ingress", "gossip": "10.0.0.1:7946"}, T0)
    forged = {f"{i:032x}": {"owner": "m" * 200, "state": crdt.JOIN, "version": 0, "started": T0,
                            "gossip": f"10.9.{i // 250 % 250}.{i % 250}:9"} for i in range(1, crdt.MAX_SESSIONS + 50)}
    member.receive({"t": "r", "r": forged}, "10.0.0.66:7946", T0)
    assert member.map.refused["sessions_full"] > 0
    joiner = {"b" * 32: {"owner": "o", "state": crdt.JOIN, "version": 0, "started": T0, "gossip": "10.0.0.2:7946"}}
    member.receive({"t": "r", "r": {"c" * 32: joiner["b" * 32]}}, "10.0.0.66:7946", T0)
    assert "c" * 32 not in member.map                  # gossiped in: still refused
    member.receive({"t": "j", "r": joiner}, "10.0.0.2:7946", T0, tcp=True)
    assert member.map.get("b" * 32)["gossip"] == "10.0.0.2:7946"
