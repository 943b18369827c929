"""Data residency: a key whose requests must not leave a set of sites (its settings entry's
`sites`, beside its limits, never in its key record), enforced at the ingress by the site a
session's grant gives it: every attempt (retries, fallbacks) goes to a session at one of them, and
none left is a 503 that names them."""
from __future__ import annotations

import json
import time

import pytest
from test_ingress_support import Client, Stack, key_with_settings
from test_key_settings import keys_and_flow, release_before_crdt

import crdt
import otela_ingress
import otela_node

MODEL = "m-res"
PREVIOUS = "03c9f9c"   # main before residency


@pytest.fixture
def stack(tmp_path):
    stack = Stack(str(tmp_path / "otela.sqlite"))
    yield stack
    stack.close()


def settings_of(every, version=1):
    """A key's settings entry: its limits, and its sites when `every` names them."""
    return crdt.key_settings_record(version, {f: every.get(f, 0) for f in crdt.LIMIT_FIELDS},
                                    sites=every.get("sites", ()))


def granted(stack, tier, sid, labels):
    """The session's grant, as a login node issued it: its labels are the ones routing believes."""
    record = stack.node.registry.get(sid)
    record.update(version=record["version"] + 1,
                  grant=tier.issue([MODEL], labels, "1", time.time() + 600, time.time())[0])
    stack.node.registry.put(sid, record)
    stack.node._changed(sid)


def sites_of(stack, placed):
    """Engines at their sites, each granted the site it says: {site or None: (session, engine)}."""
    tier = crdt.Authority([b"i" * 32])
    stack.call(stack.ingress.grants.use, tier)
    out = {}
    for site, (claimed, mode) in placed.items():
        sid, engine = stack.engine(MODEL, labels={"site": claimed} if claimed else None, mode=mode)
        stack.call(granted, stack, tier, sid, {"site": site} if site else {})
        out[site] = (sid, engine)
    return out


def served(stack, token, n):
    client = Client(stack.url, token)
    try:
        answers = [client.chat(MODEL) for _ in range(n)]
    finally:
        client.close()
    return [(status, headers.get("x-otela-session"), body) for status, headers, body in answers]


def test_a_key_bound_to_a_site_is_served_there_only_and_never_retried_elsewhere(stack):
    engines = sites_of(stack, {"a": ("a", "ok"), "b": ("b", "ok"), None: (None, "ok")})
    bound = key_with_settings(stack, "alice", queueing={"sites": ["a"]})
    answers = served(stack, bound, 30)
    assert [(s, sid) for s, sid, _ in answers] == [(200, engines["a"][0])] * 30
    assert engines["b"][1].requests == 0 and engines[None][1].requests == 0   # 0 % left its site
    free = key_with_settings(stack, "bob")
    assert {sid for _, sid, _ in served(stack, free, 30)} == {engines[s][0] for s in ("a", "b", None)}


def test_a_key_lists_only_the_models_served_at_its_sites(stack):
    sites_of(stack, {"b": ("b", "ok")})
    for token, listed in ((key_with_settings(stack, "alice", queueing={"sites": ["a"]}), []),
                          (key_with_settings(stack, "bob", queueing={"sites": ["b"]}), [MODEL])):
        client = Client(stack.url, token)
        try:
            status, _, body = client.request("GET", "/v1/models")
        finally:
            client.close()
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == listed


def test_a_failing_engine_at_the_keys_site_is_not_retried_at_another_site(stack):
    engines = sites_of(stack, {"a": ("a", "error500"), "b": ("b", "ok")})
    bound = key_with_settings(stack, "alice", queueing={"sites": ["a"]})
    answers = served(stack, bound, 10)
    assert all(status >= 500 for status, _, _ in answers) and engines["b"][1].requests == 0
    assert engines["a"][1].requests >= 10
    free = key_with_settings(stack, "bob")   # a key with no sites: retried at b, served
    assert {(status, sid) for status, sid, _ in served(stack, free, 10)} == {(200, engines["b"][0])}


def test_no_session_at_the_keys_sites_is_a_503_naming_them_with_retry_after(stack):
    sites_of(stack, {"a": ("a", "ok")})
    bound = key_with_settings(stack, "alice", queueing={"sites": ["c", "d"]})
    client = Client(stack.url, bound)
    try:
        status, headers, body = client.chat(MODEL)
    finally:
        client.close()
    error = json.loads(body)["error"]
    assert status == 503 and headers.get("retry-after") == str(otela_ingress.RETRY_AFTER_S)
    assert error["code"] == "no_session_in_sites" and "(c, d)" in error["message"]


def test_a_session_claiming_a_site_its_grant_does_not_give_is_outside_it_and_one_with_none_is_outside_all(stack):
    engines = sites_of(stack, {"b": ("a", "ok"), None: ("a", "ok")})   # both claim a: one granted b, one nothing
    bound = key_with_settings(stack, "alice", queueing={"sites": ["a"]})
    assert {status for status, _, _ in served(stack, bound, 5)} == {503}
    assert engines["b"][1].requests == engines[None][1].requests == 0
    to_b = key_with_settings(stack, "carol", queueing={"sites": ["b"]})
    assert {(s, sid) for s, sid, _ in served(stack, to_b, 5)} == {(200, engines["b"][0])}


def test_an_admin_pinning_a_session_outside_its_keys_sites_is_refused(stack):
    engines = sites_of(stack, {"a": ("a", "ok"), "b": ("b", "ok")})
    admin = key_with_settings(stack, "root", admin=True, queueing={"sites": ["a"]})
    client = Client(stack.url, admin)
    try:
        status, _, body = client.chat(MODEL, headers={"x-otela-session": engines["b"][0]})
        assert status == 403 and json.loads(body)["error"]["code"] == "outside_sites"
        status, headers, _ = client.chat(MODEL, headers={"x-otela-session": engines["a"][0]})
        assert (status, headers.get("x-otela-session")) == (200, engines["a"][0])
    finally:
        client.close()


def test_an_admin_sets_and_clears_a_keys_sites_and_requests_follow(stack):
    engines = sites_of(stack, {"a": ("a", "ok"), "b": ("b", "ok")})
    admin = Client(stack.url, stack.key("root", admin=True))
    try:
        status, _, body = admin.request("POST", "/v1/admin/keys", {"user": "dora", "sites": "b"})
        made = json.loads(body)
        assert status == 200 and made["sites"] == ["b"]
        assert {sid for _, sid, _ in served(stack, made["key"], 6)} == {engines["b"][0]}
        status, _, body = admin.request("PUT", f"/v1/admin/keys/{made['id']}/limits", {"sites": ["a"], "rpm": 100})
        assert status == 200 and json.loads(body)["sites"] == ["a"]
        assert {sid for _, sid, _ in served(stack, made["key"], 6)} == {engines["a"][0]}
        listed = json.loads(admin.request("GET", "/v1/admin/keys")[2])["data"]
        assert [k["sites"] for k in listed if k["id"] == made["id"]] == [["a"]]
        status, _, body = admin.request("PUT", f"/v1/admin/keys/{made['id']}/limits", {"sites": ["no such/site"]})
        assert status == 400 and "sites" in json.loads(body)["error"]["message"]
        assert admin.request("PUT", f"/v1/admin/keys/{made['id']}/limits", {})[0] == 200   # cleared: anywhere
        assert {sid for _, sid, _ in served(stack, made["key"], 12)} == {engines["a"][0], engines["b"][0]}
    finally:
        admin.close()


def test_keys_create_takes_sites_and_keys_list_shows_them(tmp_path, capsys):
    db = str(tmp_path / "k.sqlite")
    assert otela_ingress.main(["keys", "create", "--user", "eve", "--sites", "lrz,jsc", "--db", db, "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["sites"] == ["jsc", "lrz"]
    assert otela_ingress.main(["keys", "list", "--db", db, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["sites"] == ["jsc", "lrz"]
    assert otela_ingress.main(["keys", "create", "--user", "eve", "--sites", "a b", "--db", db]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--sites must list site names" in err


def test_a_compute_job_holding_the_cluster_key_cannot_change_which_sites_a_key_may_use():
    from test_authority import fleet
    net, ins, ws = fleet()
    authority = crdt.Authority([b"i" * 32])   # test_authority's tier secret
    entry = crdt.limit_entry(crdt.subject_of(authority.subject_key(), "k", "9a" * 32))
    net.send(ins[0].addr, ins[0].publish(entry, settings_of({"sites": ["a"]}, version=5), net.now))
    net.run(2.0)
    assert ins[1].map.get(entry)["sites"] == ["a"] and all(entry not in w.map for w in ws)
    attacker = ws[0]   # a job: the cluster key, not the tier's secret
    widened = {entry: settings_of({}, version=99)}                     # cleared: anywhere
    moved = {entry: dict(settings_of({"sites": ["evil"]}, version=100), sig="f" * 64)}
    for target in ins:
        for forged in (widened, moved):
            net.send(attacker.addr, [otela_node.Out(target.addr, {"t": "r", "r": forged}, False)])
            net.send(attacker.addr, [otela_node.Out(target.addr, {"t": "st", "r": forged}, True)])
    net.run(3.0)
    for ingress in ins:
        assert ingress.map.get(entry) == dict(ingress.map.get(entry), version=5, sites=["a"])
        assert ingress.refused["unsigned"] >= 4


def test_sites_replicate_with_a_keys_settings_and_a_bad_list_is_refused():
    cluster, flow = keys_and_flow()
    token, digest, record = otela_ingress.new_key("fred")
    flow.set_key_settings(digest, otela_ingress.key_settings(time.time(), None, sites=["b", "a"]))
    cluster.publish(crdt.key_entry(digest), record)
    assert cluster.keys[digest].sites == frozenset({"a", "b"})
    entry = crdt.limit_entry(flow.subject("k", digest))
    for bad in ([], ["a", "a"], ["b", "a"], ["x/y"], [""], [1], "a", [f"s{i}" for i in range(crdt.MAX_SITES + 1)]):
        with pytest.raises(crdt.RecordError):
            crdt.validate_limit(entry, dict(settings_of({}, version=9), sites=bad))
    with pytest.raises(crdt.RecordError):   # a user's limits name no sites
        crdt.validate_limit(crdt.limit_entry(flow.subject("u", "fred")), crdt.limit_record(1, {}, sites=["a"]))
    largest = crdt.key_settings_record(2**52, dict.fromkeys(crdt.LIMIT_FIELDS, 2**52), 3.5, "batch", ["standard"],
                                       ["s" * 60 + f"{i:04d}" for i in range(crdt.MAX_SITES)])
    crdt.validate_limit(entry, dict(largest, sig="f" * 64))   # fits a record with every other setting


def test_an_ingress_of_the_release_before_refuses_a_settings_entry_with_sites_so_ingresses_upgrade_first():
    old = release_before_crdt(PREVIOUS)
    entry = crdt.limit_entry("k-" + "1" * 16)
    old.validate_limit(entry, settings_of({"rpm": 3}))                 # without sites: taken
    with pytest.raises(old.RecordError):                                # with them: refused (README: upgrade
        old.validate_limit(entry, settings_of({"rpm": 3, "sites": ["a"]}))   # every ingress first)


def test_a_models_sites_bind_every_keys_requests_for_it_and_meet_a_keys_own(stack):
    engines = sites_of(stack, {"a": ("a", "ok"), "b": ("b", "ok")})
    admin = Client(stack.url, stack.key("root", admin=True))
    try:
        status, _, body = admin.request("PUT", f"/v1/admin/limits/models/{MODEL}", {"sites": "a"})
        assert status == 200 and json.loads(body)["sites"] == ["a"]
        anyone = key_with_settings(stack, "bob")
        assert {(s, sid) for s, sid, _ in served(stack, anyone, 10)} == {(200, engines["a"][0])}
        to_b = key_with_settings(stack, "carol", queueing={"sites": ["b"]})   # the key's b, the model's a: none
        status, _, body = served(stack, to_b, 1)[0]
        assert status == 503 and "none in common" in json.loads(body)["error"]["message"]
        assert engines["b"][1].requests == 0
        listed = json.loads(admin.request("GET", "/v1/admin/limits")[2])["data"]
        assert [(v["model"], v["sites"]) for v in listed] == [(MODEL, ["a"])]
        status, _, body = admin.request("PUT", "/v1/admin/limits/users/bob", {"sites": ["a"]})
        assert status == 400 and "sites" in json.loads(body)["error"]["message"]
        assert admin.request("DELETE", f"/v1/admin/limits/models/{MODEL}")[0] == 200   # anywhere again
        assert {sid for _, sid, _ in served(stack, anyone, 12)} == {engines["a"][0], engines["b"][0]}
    finally:
        admin.close()


def test_limits_set_gives_a_model_sites_that_the_running_ingress_follows(stack, capsys):
    engines = sites_of(stack, {"a": ("a", "ok"), "b": ("b", "ok")})
    db = stack.db_path
    assert otela_ingress.main(["limits", "set", "--model", MODEL, "--sites", "b", "--db", db]) == 0
    assert otela_ingress.main(["limits", "list", "--json", "--db", db]) == 0
    assert json.loads(capsys.readouterr().out) == [{"model": MODEL, "rpm": 0, "tpm": 0, "concurrency": 0, "sites": ["b"]}]
    anyone = key_with_settings(stack, "bob")
    deadline = time.monotonic() + 10
    while stack.call(lambda: stack.ingress.flow.model_sites.get(MODEL)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {(s, sid) for s, sid, _ in served(stack, anyone, 8)} == {(200, engines["b"][0])}
    assert otela_ingress.main(["limits", "set", "--user", "bob", "--sites", "b", "--db", db]) != 0
    assert "not a user's" in capsys.readouterr().err
