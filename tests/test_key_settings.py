"""A key's settings (its limits per minute and in flight, its weight and classes in the fair queue)
live in an entry of their own, "lim:k-<subject>", beside its key record: an ingress of the release
before admits the key as it admits any (its closed key record refuses those fields, and with them
the whole batch), carries the settings as a kind it does not know, and every ingress of this release
applies them, whichever of the two entries came first (crdt "Limits and flows", ClusterKeys)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from test_ingress_support import Client

import crdt
import otela_ingress
import otela_node

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE_BEFORE = "fcec822"   # main before limits, flows and the fair queue
EVERY_SETTING = {"rpm": 2, "tpm": 90000, "concurrency": 3, "weight": 4.0, "priority": "batch",
                 "priorities": ["standard"]}


def release_before_crdt(release: str = RELEASE_BEFORE):
    """crdt.py as `release` had it (a skip where history is not at hand)."""
    shown = subprocess.run(["git", "-C", ROOT, "show", f"{release}:crdt.py"], capture_output=True, timeout=60)
    if shown.returncode != 0:
        pytest.skip(f"{release} is not in this clone's history")
    spec = importlib.util.spec_from_loader("crdt_release_before", loader=None)
    old = importlib.util.module_from_spec(spec)
    exec(compile(shown.stdout, "crdt_release_before.py", "exec"), old.__dict__)
    return old


def settings_of(every=EVERY_SETTING, version=1):
    limits = {f: every.get(f, 0) for f in crdt.LIMIT_FIELDS}
    return crdt.key_settings_record(version, limits, **{f: every[f] for f in crdt.KEY_QUEUE_FIELDS if f in every})


def keys_and_flow():
    """Keys and limits on a map of their own, wired as the ingress wires its node's: what they
    write is told back to them at once (Ingress._registry_changed), as the overlay tells a change."""
    registry = crdt.GMap()

    def publish(entry_id, record):
        if registry.put(entry_id, record):
            changed = registry.get(entry_id)
            if crdt.kind_of(entry_id) in (crdt.LIMIT, crdt.FLOW):
                flow.on_entry(entry_id, changed)
            else:
                cluster.on_entry(entry_id, changed)

    def adopt(entries):
        for entry_id, record in entries:
            publish(entry_id, record)
    session = lambda: "ab" * 16   # noqa: E731
    cluster = otela_ingress.ClusterKeys(session, publish, adopt, lambda: None)
    flow = otela_ingress.ClusterFlow(session, publish, registry.get, crdt.Authority([b"s" * 32]))
    cluster.use_flow(flow)
    return cluster, flow


def test_a_key_with_every_setting_replicates_to_an_ingress_of_the_release_before_in_one_batch():
    old = release_before_crdt()
    authority = crdt.Authority([b"s" * 32])
    key_hash, other_hash = "12" * 32, "34" * 32
    settings_entry = crdt.limit_entry(crdt.subject_of(authority.subject_key(), "k", key_hash))
    entries = {crdt.key_entry(key_hash): crdt.key_record("k1", "alice", 1.0),
               settings_entry: settings_of(),
               crdt.key_entry(other_hash): crdt.key_record("k2", "bob", 1.0),   # a key without settings
               crdt.usage_entry(other_hash, "", "2026-12-07", "cd" * 16):
                   crdt.usage_record(other_hash, "", "2026-12-07", "cd" * 16, 1, 1, 10, 20)}
    signed = {e: authority.sign(e, r) for e, r in entries.items()}
    for entry_id, record in signed.items():
        crdt.validate(entry_id, record)   # what this release writes
    replica = old.GMap()
    assert sorted(replica.merge(signed)) == sorted(signed) and not replica.refused   # no batch lost
    assert old.key_accepts(replica.get(crdt.key_entry(key_hash)), time.time())
    carried = replica.get(settings_entry)   # carried as a kind it does not know, naming no one
    assert carried["rpm"] == 2 and "alice" not in json.dumps(carried) and key_hash not in settings_entry
    # why: the same key with its settings in its record (as this release first wrote it) costs the
    # release before the whole batch
    inline = dict(entries[crdt.key_entry(key_hash)], **{f: v for f, v in EVERY_SETTING.items()})
    with pytest.raises(old.RecordError, match="unknown field"):
        old.GMap().merge({crdt.key_entry(key_hash): inline, crdt.key_entry(other_hash): entries[crdt.key_entry(other_hash)]})


def test_settings_that_arrive_before_their_key_apply_when_it_comes_and_follow_every_change():
    cluster, flow = keys_and_flow()
    digest = "56" * 32
    flow.set_key_settings(digest, settings_of(version=10))
    assert digest not in cluster.keys   # waiting for their key
    cluster.publish(crdt.key_entry(digest), crdt.key_record("k1", "alice", 1.0))
    key = cluster.keys[digest]
    assert (key.rpm, key.tpm, key.concurrency, key.limited) == (2, 90000, 3, True)
    assert (key.weight, key.priority, key.priorities) == (4.0, otela_ingress.PRIORITY_RANK["batch"],
                                                          frozenset({otela_ingress.PRIORITY_RANK["standard"]}))
    flow.set_key_settings(digest, settings_of({"rpm": 7}, version=11))   # changed later: the key follows
    assert (cluster.keys[digest].rpm, cluster.keys[digest].weight, cluster.keys[digest].limited) == (7, 1.0, True)
    flow.set_key_settings(digest, settings_of({}, version=12))   # cleared: the defaults, nothing to check
    assert not cluster.keys[digest].limited and cluster.keys[digest].priority == otela_ingress.PRIORITY_RANK["standard"]
    assert not cluster.settings and not flow.limits   # (a key's settings are never a user's limit)
    # a key edited (its record) keeps its settings
    flow.set_key_settings(digest, settings_of({"concurrency": 1}, version=13))
    cluster.publish(crdt.key_entry(digest), dict(crdt.key_record("k1", "alice", 1.0), version=1, rate=5.0))
    assert (cluster.keys[digest].concurrency, cluster.keys[digest].rate) == (1, 5.0)
    # an older copy of the settings changes nothing; one set again at an older clock still wins
    assert flow.set_key_settings(digest, settings_of({"rpm": 1}, version=5), now=False)["version"] == 13
    assert flow.set_key_settings(digest, settings_of({"rpm": 1}, version=5))["version"] == 14
    assert cluster.keys[digest].rpm == 1


def test_a_key_without_settings_costs_the_request_path_nothing_more():
    cluster, flow = keys_and_flow()
    digest = "78" * 32
    cluster.publish(crdt.key_entry(digest), crdt.key_record("k1", "alice", 1.0))
    key = cluster.keys[digest]
    assert not key.limited and key.weight == 1.0 and not cluster.settings
    assert flow.admit(key, "m", b"{}", 1, None) is None   # no window looked up, no header


def test_a_forged_key_settings_entry_is_refused_and_a_signed_one_reaches_every_ingress_only():
    from test_authority import fleet
    net, ins, ws = fleet()
    authority = crdt.Authority([b"i" * 32])   # test_authority's tier secret
    entry = crdt.limit_entry(crdt.subject_of(authority.subject_key(), "k", "9a" * 32))
    net.send(ins[0].addr, ins[0].publish(entry, settings_of({"rpm": 3}, version=5), net.now))
    net.run(2.0)
    assert ins[1].map.get(entry)["rpm"] == 3 and all(entry not in w.map for w in ws)
    attacker = ws[0]   # a job: the cluster key, not the tier's secret
    unsigned = {entry: settings_of({"weight": 1e6, "priority": "interactive"}, version=99),
                crdt.limit_entry("k-" + "0" * 16): settings_of({"weight": 1e6})}
    badly_signed = {entry: dict(settings_of({"weight": 1e6}, version=100), sig="f" * 64)}
    for target in ins:
        for forged in (unsigned, badly_signed):
            net.send(attacker.addr, [otela_node.Out(target.addr, {"t": "r", "r": forged}, False)])
            net.send(attacker.addr, [otela_node.Out(target.addr, {"t": "st", "r": forged}, True)])
    net.run(3.0)
    for ingress in ins:
        assert ingress.map.get(entry)["version"] == 5 and "weight" not in ingress.map.get(entry)
        assert crdt.limit_entry("k-" + "0" * 16) not in ingress.map
        assert ingress.refused["unsigned"] >= 4


def test_keys_settings_have_their_own_cap_and_are_compacted_with_their_key():
    gmap = crdt.GMap()
    users = {crdt.limit_entry(f"u-{i:016x}"): crdt.limit_record(1, {"rpm": 1}) for i in range(crdt.MAX_LIMITS)}
    gmap.merge(users)
    keys = {crdt.limit_entry(f"k-{i:016x}"): settings_of() for i in range(100)}
    assert len(gmap.merge(keys)) == 100 and not gmap.refused   # users' limits full: keys' still have room
    assert gmap.merge({crdt.limit_entry("u-" + "f" * 16): crdt.limit_record(1, {"rpm": 1})}) == []
    assert gmap.refused["limits_full"] == 1
    # a revoked key's settings go with it, and no copy brings them back
    subject = "k-" + "ab" * 8
    gmap.key_subject = lambda digest: subject if digest == "cd" * 32 else "k-" + "0" * 16
    gmap.merge({crdt.key_entry("cd" * 32): crdt.revoked(crdt.key_record("k1", "alice", 1.0), 1000.0),
                crdt.limit_entry(subject): settings_of()})
    gmap.compact(1000.0 + crdt.KEY_RETENTION_S + 1)
    assert crdt.key_entry("cd" * 32) not in gmap and crdt.limit_entry(subject) not in gmap
    assert gmap.merge({crdt.limit_entry(subject): settings_of(version=2)}) == []
    assert len([e for e, _ in gmap.all_items() if e.startswith(crdt.KEY_SETTINGS_ENTRY)]) == 100


def test_keys_settings_past_their_cap_are_refused_and_counted(monkeypatch):
    monkeypatch.setattr(crdt, "MAX_KEY_SETTINGS", 3)
    gmap = crdt.GMap()
    changed = gmap.merge({crdt.limit_entry(f"k-{i:016x}"): settings_of() for i in range(5)})
    assert len(changed) == 3 and gmap.refused["key_settings_full"] == 2
    assert gmap.merge({crdt.limit_entry("u-" + "0" * 16): crdt.limit_record(1, {"rpm": 1})})   # users': apart


@pytest.fixture
def stack(tmp_path):
    from test_ingress_support import Stack
    s = Stack(str(tmp_path / "o.sqlite"))
    s.engine("m1")
    yield s
    s.close()


def test_an_admin_replaces_a_keys_settings_and_keys_list_shows_them(stack):
    from test_ingress_multi import poll
    admin = Client(stack.url, stack.key("root", admin=True))
    status, _, body = admin.request("POST", "/v1/admin/keys", {"user": "ann", "rpm": 1})
    made = json.loads(body)
    user = Client(stack.url, made["key"])
    assert [user.chat("m1")[0] for _ in range(2)] == [200, 429]
    status, _, body = admin.request("PUT", f"/v1/admin/keys/{made['id']}/limits", {"rpm": 5, "weight": 2})
    changed = json.loads(body)
    assert status == 200 and (changed["id"], changed["rpm"], changed["weight"], changed["tpm"]) == (made["id"], 5, 2.0, 0)
    assert "key" not in changed   # the token is shown once, when the key is made
    assert user.chat("m1")[1]["x-ratelimit-limit-requests"] == "5"
    for spec, word in (({"rpm": -1}, "rpm"), ({"burst": 2}, "burst"), ({"priority": "urgent"}, "priority")):
        status, _, body = admin.request("PUT", f"/v1/admin/keys/{made['id']}/limits", spec)
        assert status == 400 and word in json.loads(body)["error"]["message"]
    assert admin.request("PUT", "/v1/admin/keys/nope/limits", {"rpm": 1})[0] == 404
    listed = json.loads(admin.request("GET", "/v1/admin/keys")[2])["data"]
    assert [k["rpm"] for k in listed if k["id"] == made["id"]] == [5]
    def listed_by_the_cli():   # the --db keeps what the overlay said, for `keys list`
        done = subprocess.run([sys.executable, os.path.join(ROOT, "otela_ingress.py"), "keys", "list", "--json",
                               "--db", stack.db_path], capture_output=True, text=True, timeout=60)
        return [k["rpm"] for k in json.loads(done.stdout) if k["id"] == made["id"]] == [5]
    poll(listed_by_the_cli, "the settings in keys list")


def test_a_key_made_by_the_cli_beside_a_running_ingress_never_works_there_without_its_settings(stack):
    made = subprocess.run([sys.executable, os.path.join(ROOT, "otela_ingress.py"), "keys", "create", "--user", "cli",
                           "--rpm", "1", "--priority", "batch", "--json", "--db", stack.db_path],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    client = Client(stack.url, json.loads(made.stdout)["key"])
    deadline = time.monotonic() + 20
    while (answer := client.chat("m1"))[0] == 401 and time.monotonic() < deadline:   # not read yet
        time.sleep(0.05)
    assert answer[0] == 200 and answer[1]["x-ratelimit-limit-requests"] == "1"   # its first answer
    assert client.chat("m1")[0] == 429
    digest = next(d for d, r in stack.call(lambda: dict(stack.ingress.cluster.records)).items() if r["user"] == "cli")
    assert stack.call(lambda: stack.ingress.cluster.keys[digest].priority) == otela_ingress.PRIORITY_RANK["batch"]


@pytest.mark.slow
def test_a_key_made_with_every_setting_at_this_release_works_at_an_ingress_of_the_release_before(tmp_path):
    """A (the release before) and B (this one) on one overlay: a key made at B with every setting
    reaches A, which admits it (no refusal, no batch lost: a key made after it arrives too), and
    B applies its settings."""
    from test_ingress_limits import beside_the_release_before
    from test_ingress_multi import poll
    cluster, url_b = beside_the_release_before(tmp_path)
    try:
        status, _, body = Client(url_b, cluster.token).request("POST", "/v1/admin/keys",
                                                               dict(EVERY_SETTING, user="zoe"))
        made = json.loads(body)
        assert status == 200 and {f: made[f] for f in EVERY_SETTING} == EVERY_SETTING
        poll(lambda: Client(cluster.url, made["key"]).chat("fm")[0] == 200, "the key with settings, used at A")
        status, _, body = Client(url_b, cluster.token).request("POST", "/v1/admin/keys", {"user": "yan"})
        poll(lambda: Client(cluster.url, json.loads(body)["key"]).chat("fm")[0] == 200, "a later key, used at A")
        at_b = Client(url_b, made["key"])
        answers = [at_b.chat("fm") for _ in range(3)]   # rpm 2 at B (A's request counts only at A)
        assert [a[0] for a in answers][-1] == 429 and answers[0][1]["x-ratelimit-limit-requests"] == "2"
        listed = json.loads(Client(url_b, cluster.token).request("GET", "/v1/admin/keys")[2])["data"]
        assert [(k["rpm"], k["tpm"], k["concurrency"]) for k in listed if k["user"] == "zoe"] == [(2, 90000, 3)]
    finally:
        cluster.close()
