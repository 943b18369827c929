"""A compute job is not believed: records bound to their writers, grants, and what an ingress
routes to, attacked as a job holding only `cluster.key` would (issue 38).

The registry's checks are pure (crdt.Binder, crdt.Authority's grants) and tested as such; the
attacks on whole processes send forged gossip, sealed with the cluster key, to a real ingress
on loopback, and count what reached an address the attacker listens on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from fake_engine import free_port, start_fake_engine
from reliability_hostile import Listener
from test_ingress_support import Client, Cluster, child_pids

import crdt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
TIER = crdt.Authority([b"i" * 32])
NOW = 1_800_000_000.0


def granted_record(sid: str = "a" * 32, models=("m1",), addr: str = "10.0.0.1:7700"):
    grant, key = TIER.issue(models, {"site": "lrz"}, "4242", NOW + 3600, NOW)
    record = {"owner": "job@node1", "state": crdt.SERVING, "version": 3, "started": NOW, "role": "worker",
              "models": list(models), "addr": addr, "gossip": "10.0.0.1:7946", "grant": grant,
              "seal": crdt.seal_of("b" * 32)}
    return crdt.bound(key, sid, record), key


def ingress_map() -> crdt.GMap:
    registry = crdt.GMap()
    registry.binder = crdt.Binder(TIER)
    return registry


# -- the registry's checks ----------------------------------------------------------------------
def test_an_ingress_refuses_a_live_record_republished_with_another_address():
    sid = "a" * 32
    honest, _ = granted_record(sid)
    registry = ingress_map()
    registry.merge({sid: honest})
    forged = dict(honest, version=honest["version"] + 100, addr="10.6.6.6:7700")   # same seal, same grant
    for bind_key in (b"k" * 32, crdt.Authority.ingress_binding(b"c" * 32)):       # keys a job can make
        registry.merge({sid: crdt.bound(bind_key, sid, forged)})
    registry.merge({sid: {k: v for k, v in forged.items() if k not in ("bind", "grant")}})   # unbound
    assert registry.get(sid)["addr"] == "10.0.0.1:7700"
    assert registry.refused["bind"] == 2 and registry.refused["unbound"] == 1


def test_the_owner_refuses_a_record_of_its_own_session_it_did_not_write():
    sid = "a" * 32
    honest, key = granted_record(sid)
    owner = crdt.GMap()
    owner.binder = crdt.Binder()                     # a worker: no ingress secret
    owner.binder.own[sid] = key
    owner.put(sid, honest)
    owner.merge({sid: crdt.bound(b"x" * 32, sid, dict(honest, version=99, addr="10.6.6.6:1"))})
    assert owner.get(sid) == honest and owner.refused["forged_own"] == 1


def test_a_grant_cannot_be_widened_nor_moved_to_another_session():
    sid = "a" * 32
    honest, key = granted_record(sid)
    widened = dict(honest["grant"], models=["m1", "secret-model"])
    registry = ingress_map()
    assert registry.merge({sid: crdt.bound(key, sid, dict(honest, grant=widened))}) == []
    assert registry.refused["grant"] == 1
    other = "c" * 32          # the grant and its binding copied onto another session id
    assert registry.merge({other: dict(honest)}) == [] and registry.refused["bind"] == 1


def test_an_ingress_record_keeps_its_tier_and_binding():
    sid = "d" * 32
    ingress = {"owner": "ingress@login1", "state": crdt.SERVING, "version": 1, "started": NOW,
               "role": "ingress", "gossip": "10.0.0.9:7946", "tier": TIER.proof(sid, "10.0.0.9:7946")}
    ingress = crdt.bound(crdt.Authority.ingress_binding(TIER.secrets[0]), sid, ingress)
    registry = ingress_map()
    registry.merge({sid: ingress})
    tierless = {k: v for k, v in ingress.items() if k not in ("tier", "bind")}
    registry.merge({sid: dict(tierless, version=5)})
    assert TIER.proven(sid, registry.get(sid)) and registry.refused["unbound"] == 1


def test_an_eviction_is_another_members_write_and_needs_no_binding():
    sid = "a" * 32
    honest, _ = granted_record(sid)
    registry = ingress_map()
    registry.merge({sid: honest})
    evicted = dict({k: v for k, v in honest.items() if k != "bind"}, state=crdt.LEFT, left_at=NOW + 9,
                   evicted_by="e" * 32, evidence={"since": NOW, "grace": 5.0, "by": ["e" * 32]})
    assert registry.merge({sid: evicted}) == [sid]


def test_grant_refusal_names_expiry_and_revocation_of_the_grant_or_its_job():
    grant, _ = TIER.issue(["m1"], {}, "4242", NOW + 60, NOW)
    assert crdt.grant_refusal(grant, set(), NOW) is None
    assert crdt.grant_refusal(grant, set(), NOW + 60) == "expired"
    assert crdt.grant_refusal(grant, {grant["id"]}, NOW) == "revoked"
    assert crdt.grant_refusal(grant, {"job-4242"}, NOW) == "revoked"


def test_a_grants_newer_session_takes_over_once_it_serves_not_while_it_loads():
    import otela_ingress
    grants = otela_ingress.Grants(TIER)
    old, _ = granted_record("a" * 32)
    successor = dict(old, state=crdt.JOIN, started=NOW + 120)   # a job's successor, under its slot's grant
    grants.seen("a" * 32, old)
    grants.seen("c" * 32, successor)
    assert grants.refusal("a" * 32, old, NOW) is None
    grants.seen("c" * 32, dict(successor, state=crdt.SERVING))
    assert grants.refusal("a" * 32, old, NOW) == "grant_reused"
    assert grants.refusal("c" * 32, dict(successor, state=crdt.SERVING), NOW) is None
    grants.seen("c" * 32, dict(successor, state=crdt.LEFT))
    assert grants.refusal("a" * 32, old, NOW) is None


def test_an_adapter_a_job_names_after_another_model_is_not_routed_under_its_bases_grant():
    import otela_ingress
    grants = otela_ingress.Grants(TIER)
    record, _ = granted_record("a" * 32)   # granted m1
    claim = dict(record, models=["m1", "secret-model"], adapters={"secret-model": ["m1", "/x"]})
    assert grants.models(claim) == ["m1"]
    grant, _ = TIER.issue(["m1", "sql-lora"], {}, "4242", NOW + 60, NOW)   # an adapter granted by name
    named = dict(claim, grant=grant, models=["m1", "sql-lora"], adapters={"sql-lora": ["m1", "/y"]})
    assert grants.models(named) == ["m1", "sql-lora"]


def test_an_overlay_member_binds_every_write_of_its_own_and_a_forged_copy_does_not_survive_them():
    import otela_node as on
    config = on.Config(key=b"k" * 32, grant=granted_record()[0]["grant"])
    config.grant_key = TIER.grant_key(config.grant)
    overlay = on.Overlay(config, "f" * 32, {"owner": "me", "state": crdt.SERVING, "version": 0, "started": NOW,
                                          "models": ["m1"], "addr": "10.0.0.1:7700", "gossip": "10.0.0.1:7946"}, NOW)
    forged = dict(overlay.record, version=50, addr="10.6.6.6:7700")
    overlay.receive({"t": "r", "r": {"f" * 32: forged}}, "10.0.0.5:7946", NOW)
    overlay.update(NOW + 1, models=["m1"])
    mine = overlay.map.get("f" * 32)
    assert mine["addr"] == "10.0.0.1:7700" and crdt.is_bound(config.grant_key, "f" * 32, mine)
    registry = ingress_map()
    assert registry.merge({"f" * 32: mine}) == ["f" * 32]


# -- evictions vouched for by their confirmers (crdt, "The end of a session") ----------------------
def ingress_record(sid: str = "d" * 32):
    record = {"owner": "ingress@login1", "state": crdt.SERVING, "version": 1, "started": NOW, "role": "ingress",
              "gossip": "10.0.0.9:7946", "tier": TIER.proof(sid, "10.0.0.9:7946")}
    return crdt.bound(crdt.Authority.ingress_binding(TIER.secrets[0]), sid, record)


def eviction(victim, by, vouch=None, version=None):
    """`victim` evicted by by[0] on the word of `by`, as any holder of cluster.key can write it."""
    record = dict({k: v for k, v in victim.items() if k != "bind"}, state=crdt.LEFT, left_at=NOW + 9,
                  evicted_by=by[0], evidence={"since": NOW, "grace": 5.0, "by": list(by)})
    if version is not None:
        record["version"] = version
    if vouch is not None:
        record["vouch"] = vouch
    return record


def test_a_voucher_checks_only_under_its_confirmers_binding_key_for_that_suspect_and_version():
    victim, _ = granted_record("a" * 32)
    worker, worker_key = granted_record("c" * 32, addr="10.0.0.2:7700")
    ungranted = {"owner": "job@node3", "state": crdt.SERVING, "version": 1, "started": NOW, "role": "worker"}
    held = {"c" * 32: worker, "d" * 32: ingress_record("d" * 32), "e" * 32: ungranted}.get
    version = victim["version"]
    mac = crdt.voucher(worker_key, "a" * 32, version, "c" * 32)
    ingress_mac = crdt.voucher(crdt.Authority.ingress_binding(TIER.secrets[0]), "a" * 32, version, "d" * 32)

    def vouched(by, vouch, revoked=(), **kw):
        return TIER.vouched("a" * 32, eviction(victim, by, vouch, **kw), held, revoked)
    assert len(mac) == crdt.VOUCHER_HEX and crdt.is_voucher(mac)
    assert vouched(["c" * 32], {"c" * 32: mac}) is True
    assert vouched(["e" * 32, "d" * 32], {"d" * 32: ingress_mac}) is True          # an ingress's word
    assert vouched(["c" * 32], {"c" * 32: crdt.voucher(b"k" * 32, "a" * 32, version, "c" * 32)}) is False
    assert vouched(["c" * 32], {"c" * 32: mac}, version=version + 1) is False     # another version's
    assert vouched(["d" * 32], {"d" * 32: mac}) is False                          # another confirmer's
    assert vouched(["c" * 32, "d" * 32], None) is False                           # honest names, no word
    assert vouched(["c" * 32], {"c" * 32: mac}, revoked={worker["grant"]["id"]}) is False
    assert vouched(["e" * 32, "f" * 32], {"e" * 32: mac}) is None                  # ungranted, unknown here


def test_vouchers_ride_beside_the_evidence_only_for_its_confirmers_and_of_one_size():
    victim, _ = granted_record("a" * 32)
    mac = "0" * crdt.VOUCHER_HEX
    crdt.validate("a" * 32, eviction(victim, ["c" * 32], {"c" * 32: mac}))
    for bad in ({"e" * 32: mac}, {"c" * 32: mac[:16]}, {"c" * 32: "A" * 32}, ["c" * 32], {"c" * 32: 7}):
        with pytest.raises(crdt.RecordError, match="vouch"):
            crdt.validate("a" * 32, eviction(victim, ["c" * 32], bad))
    with pytest.raises(crdt.RecordError, match="vouch"):
        crdt.validate("a" * 32, dict(victim, vouch={"c" * 32: mac}))           # only beside evidence
    by = [f"{i:032x}" for i in range(crdt.MAX_CONFIRMERS)]                     # the most there can be
    crdt.validate("a" * 32, eviction(victim, by, {c: mac for c in by}))


def overlay_of(sid: str, grant=None, key=None):
    import otela_node as on
    config = on.Config(key=b"k" * 32, grant=grant)
    config.grant_key = key or b""
    return on.Overlay(config, sid, {"owner": "me", "state": crdt.SERVING, "version": 0, "started": NOW,
                                    "addr": "10.0.0.1:7700", "gossip": f"10.0.0.{sid[0]}:7946"}, NOW)


def test_a_member_vouches_for_its_own_failed_probe_alone_and_the_voucher_rides_beside_the_suspicion():
    import otela_node as on
    victim, _ = granted_record("a" * 32)
    record, key = granted_record("c" * 32, addr="10.0.0.2:7700")
    prober = overlay_of("c" * 32, record["grant"], key)
    evictor = overlay_of("b" * 32)
    for member in (prober, evictor):
        member.map.merge({"a" * 32: victim})
    prober._suspect("a" * 32, victim["version"], prober.sid, NOW, None)      # its own probe failed
    msg = prober._payload([on.Rumour("s", "a" * 32, prober.sid)])
    mac = crdt.voucher(key, "a" * 32, victim["version"], prober.sid)
    assert msg["s"] == [["a" * 32, victim["version"], prober.sid]]            # as a release before reads it
    assert on._suspicions(msg) == msg["s"] and msg["vo"] == [["a" * 32, victim["version"], prober.sid, mac]]
    evictor.receive(msg, prober.addr, NOW)
    evictor.receive({"t": "r", "s": [["a" * 32, victim["version"], evictor.sid]],   # its name, said by another
                     "vo": [["a" * 32, victim["version"], evictor.sid, "0" * 32], ["a" * 32, 1, "x"]]},
                    prober.addr, NOW)
    assert evictor.suspects["a" * 32].vouchers == {prober.sid: (victim["version"], mac)}
    evictor._evict("a" * 32, NOW + 60)
    left = evictor.map.get("a" * 32)
    assert left["evidence"]["by"] == [evictor.sid, prober.sid] and left["vouch"] == {prober.sid: mac}
    assert TIER.vouched("a" * 32, left, {prober.sid: record}.get) is True and "a" * 32 in evictor.retired


def test_an_eviction_of_a_record_near_the_cap_names_fewer_confirmers_and_keeps_the_vouched_ones():
    victim, _ = granted_record("a" * 32, models=tuple(f"org/model-{i:03d}-instruct-long-name" for i in range(12)))
    victim = dict(victim, labels={f"label{i}": "x" * 20 for i in range(10)})     # ~1,650 bytes
    evictor = overlay_of("b" * 32)
    evictor.map.merge({"a" * 32: victim})
    heard = [f"{i:032x}" for i in range(1, 12)]                                  # eleven more confirmers,
    for by in heard:                                                             # the last one vouching
        evictor._suspect("a" * 32, victim["version"], by, NOW, "10.0.0.5:7946")
    evictor._take_vouchers([["a" * 32, victim["version"], heard[-1], "1" * 32]])
    evictor._suspect("a" * 32, victim["version"], evictor.sid, NOW, None)         # and its own probe
    evictor._evict("a" * 32, NOW + 100)
    left = evictor.map.get("a" * 32)
    assert len(crdt.encode(left)) <= crdt.MAX_RECORD_BYTES < len(crdt.encode(victim)) + 8 * 35 + 8 * 70
    assert left["evidence"]["by"][:2] == [evictor.sid, heard[-1]] and set(left["vouch"]) == {evictor.sid, heard[-1]}


def test_a_dead_granted_member_is_evicted_with_a_voucher_the_ingress_checks():
    import simnet

    import otela_node as on
    base = dict(key=b"c" * 32, probe_interval=0.5, probe_timeout=0.2, indirect_timeout=0.2, push_pull_interval=2.0)
    net = simnet.SimulatedNetwork(seed=6, config=on.Config(**base), start=NOW)
    ingress = net.add(config=on.Config(**base, ingress_keys=[b"i" * 32]), role="ingress")
    workers = []
    for i in range(4):
        grant, key = TIER.issue(["m1"], {}, f"job{i}", NOW + 3600, NOW)
        workers.append(net.add([ingress.addr], config=on.Config(**base, grant=grant, grant_key=key)))
    net.run(5.0)
    victim = workers[-1]
    net.kill(victim.addr)
    net.run(30.0)
    record = ingress.map.get(victim.sid)
    assert record["state"] == crdt.LEFT and set(record["vouch"]) <= set(record["evidence"]["by"])
    assert TIER.vouched(victim.sid, record, ingress.map.get) is True


# -- what an ingress believes of an eviction, on a stand-in registry (conftest's stack) -------------
def granted_worker(stack, model: str, version: int = 1):
    """A granted session serving `model` on a fake engine, as its own node would write it."""
    port = free_port()
    engine = stack.run(start_fake_engine(port, model=model))
    stack.engines[str(port)] = engine
    sid = crdt.new_session_id()
    grant, key = TIER.issue([model], {}, sid[:8], time.time() + 3600, time.time())
    record = crdt.bound(key, sid, {"owner": "job@gpu1", "state": crdt.SERVING, "version": version,
                                   "started": time.time(), "role": "worker", "addr": f"127.0.0.1:{port}",
                                   "models": [model], "grant": grant})
    stack.call(put_record, stack, sid, record)
    return sid, key, engine


def put_record(stack, sid: str, record) -> None:
    stack.node.registry.put(sid, record)
    stack.node._changed(sid)


def forge_eviction(stack, sid: str, by, vouch=None, version=None) -> None:
    stack.call(lambda: put_record(stack, sid, eviction(stack.node.registry.get(sid), by, vouch, version)))


def test_an_ingress_believes_an_eviction_of_an_idle_session_only_on_a_voucher_it_can_check(stack):
    stack.call(stack.ingress.grants.use, TIER)
    confirmer, confirmer_key, _ = granted_worker(stack, "c")
    stack.call(put_record, stack, "d" * 32, ingress_record("d" * 32))          # an honest ingress
    victims = {model: granted_worker(stack, model, version=2) for model in ("v1", "v2", "v3", "v4")}
    client = Client(stack.url, stack.key())

    def word(model, version=2):
        return crdt.voucher(confirmer_key, victims[model][0], version, confirmer)
    # none of them has answered here: only vouchers speak for or against them
    forge_eviction(stack, victims["v1"][0], [confirmer, "d" * 32])                   # honest names, no word
    forge_eviction(stack, victims["v2"][0], [confirmer], {confirmer: "0" * 32})      # a made-up word
    forge_eviction(stack, victims["v3"][0], [confirmer], {confirmer: word("v3", 1)}, version=1)   # an old one
    for model in ("v1", "v2", "v3"):
        assert [client.chat(model)[0] for _ in range(3)] == [200] * 3 and victims[model][2].requests == 3
    assert stack.call(lambda: dict(stack.ingress.doubts.by)) == {"unvouched": 3}
    forge_eviction(stack, victims["v4"][0], ["d" * 32, confirmer], {confirmer: word("v4")})   # its real word
    assert client.chat("v4")[0] in (404, 503) and victims["v4"][2].requests == 0
    assert stack.call(lambda: stack.ingress.doubts.total) == 3
    text = client.request("GET", "/metrics")[2].decode()
    assert 'otela_evictions_doubted_total{reason="unvouched"} 3' in text
    assert 'otela_evictions_doubted_total{reason="unverifiable"} 0' in text


def test_an_ungranted_members_word_counts_only_where_ungranted_sessions_are_believed(stack):
    stack.call(stack.ingress.grants.use, TIER)
    first, _, engine = granted_worker(stack, "v1")
    second, _, _ = granted_worker(stack, "v2")
    client = Client(stack.url, stack.key())
    forge_eviction(stack, first, ["e" * 32])                    # a member nothing here can check
    assert client.chat("v1")[0] == 200 and engine.requests == 1
    assert stack.call(lambda: dict(stack.ingress.doubts.by)) == {"unverifiable": 1}
    stack.ingress.grants.allow_ungranted = True
    forge_eviction(stack, second, ["e" * 32])
    assert client.chat("v2")[0] in (404, 503)
    assert stack.call(lambda: stack.ingress.doubts.total) == 1


# -- whole processes: an ingress, honest nodes, and an attacker with cluster.key alone -------------
def send_forged(cluster: Cluster, records) -> None:
    import attack_registry
    attack_registry.send(cluster.key_file, f"127.0.0.1:{cluster.gossip}", [{sid: r} for sid, r in records.items()])


def registry(cluster: Cluster):
    return {s["session"]: s for s in json.loads(Client(cluster.url).request("GET", "/v1/registry")[2])["sessions"]}


def metric(cluster: Cluster, name: str) -> float:
    text = Client(cluster.url).request("GET", "/metrics")[2].decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(str(tmp_path))
    yield c
    c.close()


def start_node(cluster: Cluster, name: str, granted: bool = True):
    port = free_port()
    cluster.node(name, f"{sys.executable} tests/fake_engine.py --model fm --port {port}", port, "fm",
                 granted=granted)
    return port


def test_hijack_and_sybil_sessions_draw_no_request_and_are_counted(cluster):
    start_node(cluster, "honest")
    attacker = Listener()
    try:
        (sid, honest), = [(s, r) for s, r in registry(cluster).items() if r.get("role") == "worker"]
        record = {k: v for k, v in honest.items()
                  if k not in ("session", "suspected", "reach", "tunnel", "unrouted")}
        record["state"] = crdt.SERVING
        hijack = dict(record, version=record["version"] + 1000, addr=attacker.addr)
        sybils = {crdt.new_session_id(): dict({k: v for k, v in record.items() if k not in ("grant", "bind", "seal")},
                                              addr=attacker.addr, gossip=f"127.0.0.1:{free_port()}", started=time.time())
                  for _ in range(20)}
        send_forged(cluster, {sid: hijack, **sybils})
        time.sleep(1.0)
        client = Client(cluster.url, cluster.token)
        statuses = [client.chat("fm")[0] for _ in range(40)]
        client.close()
        view = registry(cluster)
        assert statuses == [200] * 40 and attacker.connections == 0
        assert view[sid]["addr"] != attacker.addr
        assert all(view[s].get("unrouted") == "ungranted" for s in sybils if s in view)
        assert metric(cluster, 'otela_registry_refused_total{why="bind"}') >= 1
    finally:
        attacker.close()


def test_an_ungranted_session_is_shown_apart_and_a_revoked_grant_stops_routing_within_a_second(cluster):
    start_node(cluster, "ungranted", granted=False)
    client = Client(cluster.url, cluster.token)
    assert client.chat("fm")[0] == 404          # nothing granted serves it, nor ever did
    start_node(cluster, "granted")
    assert client.chat("fm")[0] == 200
    reasons = sorted(s.get("unrouted", "") for s in registry(cluster).values() if s.get("role") == "worker")
    assert reasons == ["", "ungranted"]
    assert metric(cluster, 'otela_sessions_unrouted{reason="ungranted"}') == 1
    revoked = subprocess.run([sys.executable, os.path.join(ROOT, "otela_ingress.py"), "grant", "revoke", "--job",
                              "granted", "--db", cluster.db], capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    start, status = time.monotonic(), 200
    while status == 200 and time.monotonic() - start < 5.0:
        status, _, body = client.chat("fm")
    took = time.monotonic() - start
    assert status == 503 and json.loads(body)["error"]["code"] == "no_healthy_provider", body
    assert took < 2.0       # (a bound, not a measure: the poll is 0.25 s, the sweep 1 s)
    client.close()


def test_grant_cli_refuses_bad_input_in_one_line(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "otela_node.py"), "keygen", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=60)
    cli = [sys.executable, os.path.join(ROOT, "otela_ingress.py"), "grant"]
    for argv, words in ((["--key-file", str(tmp_path / "cluster.key")], "--model"),
                        (["--model", "m"], "ingress secret"),
                        (["revoke", "nothex"], "grant id"),
                        (["revoke", "--job", "1", "--db", str(tmp_path / "none.sqlite")], "no such database")):
        done = subprocess.run(cli + argv, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1
    out = tmp_path / "job.grant"
    done = subprocess.run(cli + ["--key-file", str(tmp_path / "cluster.key"), "--model", "m", "--label", "a=b",
                                 "--until", "2h", "--job", "77", "--out", str(out)], capture_output=True, timeout=60)
    assert done.returncode == 0 and oct(out.stat().st_mode & 0o777) == "0o600"
    grant = json.loads(out.read_text())["grant"]
    assert grant["models"] == ["m"] and grant["labels"] == {"a": "b"} and grant["job"] == "77"


# -- absences and job ends, on a stand-in registry (conftest's stack) ------------------------------
def test_a_session_in_its_jobs_last_minutes_gets_nothing_new_while_another_serves(stack):
    ending, old = stack.engine("m1")
    _, fresh = stack.engine("m1")
    alone, last = stack.engine("m2")

    def end_soon(sid):
        record = stack.node.registry.get(sid)
        stack.node._versions[sid] += 1
        record.update(version=stack.node._versions[sid], started=time.time() - 3600, ends_at=time.time() + 30)
        stack.node.registry.put(sid, record)
        stack.node._changed(sid)
    stack.call(end_soon, ending)
    stack.call(end_soon, alone)
    client = Client(stack.url, stack.key())
    assert [client.chat("m1")[0] for _ in range(10)] == [200] * 10
    assert old.requests == 0 and fresh.requests == 10
    assert [client.chat("m2")[0] for _ in range(3)] == [200] * 3 and last.requests == 3   # the only one serves


def test_a_session_is_ending_in_its_jobs_last_two_minutes_or_second_half_whichever_is_shorter():
    from otela_ingress import job_ending
    long_job = {"started": 0.0, "ends_at": 4 * 3600.0}
    assert not job_ending(long_job, 4 * 3600.0 - 121) and job_ending(long_job, 4 * 3600.0 - 119)
    three_minutes = {"started": 0.0, "ends_at": 180.0}   # its successor, due at 90 s, is not ending beside it
    assert not job_ending(three_minutes, 89) and job_ending(three_minutes, 91)
    assert not job_ending({"started": 0.0}, 1e12) and job_ending({"ends_at": 100.0}, 0)


def test_a_model_served_minutes_ago_is_absent_not_unknown(stack):
    sid, _ = stack.engine("m1")
    client = Client(stack.url, stack.key())
    assert client.chat("m1")[0] == 200
    stack.call(stack.node.set_state, sid, crdt.LEFT)
    status, headers, body = client.chat("m1")
    assert status == 503 and headers.get("retry-after") and json.loads(body)["error"]["code"] == "no_healthy_provider"
    assert client.chat("never-served")[0] == 404


def test_an_eviction_of_a_session_that_just_answered_is_doubted_and_it_keeps_serving(stack):
    sid, engine = stack.engine("m1")
    client = Client(stack.url, stack.key())
    assert client.chat("m1")[0] == 200

    def evict():     # made-up evidence, as any holder of cluster.key can write
        record = stack.node.registry.get(sid)
        record.update(state=crdt.LEFT, version=record["version"] + 1, left_at=time.time(), evicted_by="e" * 32,
                      evidence={"since": time.time() - 5, "grace": 3.0, "by": ["e" * 32]})
        stack.node.registry.put(sid, record)
        stack.node._changed(sid)
    stack.call(evict)
    assert [client.chat("m1")[0] for _ in range(5)] == [200] * 5 and engine.requests == 6
    assert stack.call(lambda: stack.ingress.doubts.total) == 1


def test_a_catalogued_model_nothing_serves_is_starting_and_counts_as_demand(stack):
    stack.ingress.catalogue = frozenset({"offered"})
    client = Client(stack.url, stack.key())
    for _ in range(3):
        status, headers, body = client.chat("offered")
        assert status == 503 and headers.get("retry-after") == "30"
        assert json.loads(body)["error"]["code"] == "model_starting"
    assert client.chat("not-offered")[0] == 404
    stats = json.loads(client.request("GET", "/v1/usage/stats")[2])
    assert stats["models"]["offered"]["unserved"] == 3 and "not-offered" not in stats["models"]


def test_an_ingress_talks_only_to_the_job_whose_grant_pins_the_certificate(tmp_path):
    """Every member holds the cluster's TLS pair, so anything listening at a granted session's
    address (a job squatting the port of one that died) would pass the cluster's pinned
    handshake; the job's own certificate, pinned by its grant, does not let it."""
    import asyncio
    import ssl

    import otela_ingress
    import otela_node as on
    key_file = on.keygen(str(tmp_path / "keys"))[0]
    config = on.Config(key=b"k" * 32)
    config.tls_cert, config.tls_key = on.find_tunnel_tls(key_file)
    cert, key = on.job_certificate(key_file, time.time() + 3600, time.time())
    pin = on.certificate_fingerprint(cert)
    impostor_ctx, client_ctx = on.tunnel_tls(config)          # what any job can show
    config.job_tls = (cert, key)
    genuine_ctx, _ = on.tunnel_tls(config)                     # what the granted job shows

    async def run():
        async def answer(reader, writer):
            writer.close()
        results = []
        for ctx in (genuine_ctx, impostor_ctx):
            server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=ctx)
            addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
            pool = otela_ingress.UpstreamPool(client_ctx)
            try:
                up = await pool.acquire(addr, True, pin)
                results.append(("connected", up.pin))
                up.close()
            except otela_ingress.UpstreamFailure as exc:
                results.append(("refused", str(exc)))
            results.append(pool.impostors)
            server.close()
        return results
    genuine, genuine_cut, impostor, impostor_cut = asyncio.run(run())
    assert genuine == ("connected", pin) and genuine_cut == 0
    assert impostor[0] == "refused" and "certificate" in impostor[1] and impostor_cut == 1
    assert isinstance(client_ctx, ssl.SSLContext)


def test_a_killed_granted_node_is_evicted_on_a_voucher_and_the_ingress_believes_it(cluster):
    start_node(cluster, "kept")
    start_node(cluster, "killed")
    (victim,) = [s for s, r in registry(cluster).items() if r.get("grant", {}).get("job") == "killed"]
    node = cluster.nodes["killed"]
    cluster.orphans += child_pids([node.pid], b"fake_engine")     # (its engine outlives it)
    node.kill()
    deadline = time.monotonic() + 90
    while registry(cluster)[victim]["state"] != "LEFT" and time.monotonic() < deadline:
        time.sleep(0.2)
    record = registry(cluster)[victim]
    assert record["state"] == "LEFT" and record["evicted_by"] in record["evidence"]["by"]
    assert record["vouch"] and set(record["vouch"]) <= set(record["evidence"]["by"])
    assert metric(cluster, "otela_evictions_doubted_total") == 0
    client = Client(cluster.url, cluster.token)
    assert [client.chat("fm")[0] for _ in range(10)] == [200] * 10
    client.close()


def test_a_forged_eviction_of_an_idle_session_naming_the_ingress_is_doubted_and_it_keeps_serving(cluster):
    start_node(cluster, "honest")
    view = json.loads(Client(cluster.url).request("GET", "/v1/registry")[2])
    (sid, honest), = [(s, r) for s, r in registry(cluster).items() if r.get("role") == "worker"]
    record = {k: v for k, v in honest.items()
              if k not in ("session", "suspected", "reach", "tunnel", "unrouted", "bind")}
    now = time.time()
    record.update(state=crdt.LEFT, left_at=now, evicted_by=view["self"], vouch={view["self"]: "0" * 32},
                  evidence={"since": now - 5.0, "grace": 3.0, "by": [view["self"]]})   # the ingress's name
    send_forged(cluster, {sid: record})
    deadline = time.monotonic() + 30
    while metric(cluster, "otela_evictions_doubted_total") == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    client = Client(cluster.url, cluster.token)
    assert [client.chat("fm")[0] for _ in range(10)] == [200] * 10           # (it never answered before)
    client.close()
    assert metric(cluster, 'otela_evictions_doubted_total{reason="unvouched"}') == 1
