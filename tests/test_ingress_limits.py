"""Limits per key, per user and per model: requests and tokens per sliding minute, requests in
flight; OpenAI's 429 and x-ratelimit-* headers; the admin API and CLI that set them; the "lim:"
and "flow:" entries that carry them between ingresses (ClusterFlow, crdt "Limits and flows")."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
from test_ingress_support import Client, Stack
from test_ingress_support import key_with_settings as limited_key

import crdt
import otela_ingress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def stack(tmp_path):
    s = Stack(str(tmp_path / "o.sqlite"))
    s.engine("m1")
    s.engine("m2")
    yield s
    s.close()


def statuses(client: Client, n: int, model: str = "m1", **extra):
    return [client.chat(model, **extra) for _ in range(n)]


def test_a_keys_rpm_is_hit_exactly_and_every_answer_carries_the_openai_headers(stack):
    client = Client(stack.url, limited_key(stack, rpm=5))
    answers = statuses(client, 7)
    assert [a[0] for a in answers] == [200] * 5 + [429] * 2
    assert [a[1]["x-ratelimit-remaining-requests"] for a in answers[:5]] == ["4", "3", "2", "1", "0"]
    assert all(a[1]["x-ratelimit-limit-requests"] == "5" for a in answers)
    reset = answers[0][1]["x-ratelimit-reset-requests"]
    assert reset in ("59s", "1m0s", "1m1s")   # the window empties a minute (and its second) on
    status, headers, body = answers[5]
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "5 requests per minute" in error["message"]
    assert 1 <= int(headers["retry-after"]) <= 61
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in headers   # no token limit: no token headers


def test_a_key_without_limits_gets_no_ratelimit_headers(stack):
    client = Client(stack.url, stack.key())
    status, headers, _ = client.chat("m1")
    assert status == 200 and not [h for h in headers if h.startswith("x-ratelimit")]


def test_a_keys_tpm_reserves_prompt_and_max_tokens_then_books_what_was_served(stack):
    probe = Client(stack.url, stack.key("bob"))
    served = json.loads(probe.chat("m1", max_tokens=50)[2])["usage"]["total_tokens"]
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 50})
    reserved = math.ceil(len(body) / 4) + 50
    tpm = 2 * served + reserved            # room for the third request's reservation, not a fourth's
    client = Client(stack.url, limited_key(stack, tpm=tpm))
    answers = statuses(client, 4, max_tokens=50)
    assert [a[0] for a in answers] == [200, 200, 200, 429]
    assert answers[0][1]["x-ratelimit-limit-tokens"] == str(tpm)
    assert answers[0][1]["x-ratelimit-remaining-tokens"] == str(tpm - reserved)
    error = json.loads(answers[3][2])["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert answers[3][1]["x-ratelimit-remaining-tokens"] == str(tpm - 3 * served)
    status, _, body = client.chat("m1", max_tokens=tpm)   # could never fit: no Retry-After to wait for
    assert status == 429 and "Request too large" in json.loads(body)["error"]["message"]


def test_a_users_limit_counts_all_of_its_keys_together(stack):
    admin = Client(stack.url, stack.key("root", admin=True))
    status, _, body = admin.request("PUT", "/v1/admin/limits/users/carol", {"rpm": 4})
    assert status == 200 and json.loads(body)["rpm"] == 4
    one, two = Client(stack.url, stack.key("carol")), Client(stack.url, stack.key("carol"))
    other = Client(stack.url, stack.key("dave"))
    got = [c.chat("m1")[0] for c in (one, two, one, two, one, two)]
    assert got == [200, 200, 200, 200, 429, 429]
    assert other.chat("m1")[0] == 200                       # another user is not limited
    listed = json.loads(admin.request("GET", "/v1/admin/limits")[2])["data"]
    assert [(d.get("user"), d["rpm"]) for d in listed] == [("carol", 4)]
    assert admin.request("DELETE", "/v1/admin/limits/users/carol")[0] == 200
    assert one.chat("m1")[0] == 200                          # cleared: no limit any more
    assert json.loads(admin.request("GET", "/v1/admin/limits")[2])["data"] == []


def test_a_models_limit_counts_every_keys_requests_to_that_model_only(stack):
    admin = Client(stack.url, stack.key("root", admin=True))
    assert admin.request("PUT", "/v1/admin/limits/models/m2", {"rpm": 3})[0] == 200
    a, b = Client(stack.url, stack.key("erin")), Client(stack.url, stack.key("frank"))
    assert [c.chat("m2")[0] for c in (a, b, a, b)] == [200, 200, 200, 429]
    assert a.chat("m1")[0] == 200                            # another model
    listed = json.loads(admin.request("GET", "/v1/admin/limits")[2])["data"]
    assert [(d["model"], d["rpm"], d["tpm"], d["concurrency"]) for d in listed] == [("m2", 3, 0, 0)]


class FakeConn:
    extra = b""


def flow_on(session_id: str = "ab" * 16, registry: crdt.GMap | None = None) -> otela_ingress.ClusterFlow:
    """A ClusterFlow on a map of its own, wired as the ingress wires its node's: what it writes is
    told back to it at once, as the overlay tells a change."""
    registry = crdt.GMap() if registry is None else registry

    def publish(entry_id, record):
        if registry.put(entry_id, record):
            flow.on_entry(entry_id, registry.get(entry_id))
    flow = otela_ingress.ClusterFlow(lambda: session_id, publish, registry.get)
    return flow


class FakeClient:
    def __init__(self):
        self.conn = FakeConn()


def test_concurrency_counts_requests_in_flight_until_they_finish():
    flow = flow_on()
    key = otela_ingress.Key.of_record("ab" * 32, crdt.key_record("k1", "u", 0.0),
        crdt.key_settings_record(1, {"concurrency": 2}))
    tickets = [flow.admit(key, "m", b"{}", 1, FakeClient()) for _ in range(2)]
    with pytest.raises(otela_ingress.HTTPError) as refused:
        flow.admit(key, "m", b"{}", 1, FakeClient())
    assert refused.value.status == 429 and refused.value.etype == "requests"
    assert "2 requests in flight" in refused.value.message
    flow.release(tickets[0], 5)
    assert flow.admit(key, "m", b"{}", 1, FakeClient()) is not None


def test_the_window_slides_a_request_counts_for_a_minute_and_no_more_than_a_second_longer(monkeypatch):
    clock = [1000.2]
    monkeypatch.setattr(otela_ingress.time, "time", lambda: clock[0])
    flow = flow_on()
    key = otela_ingress.Key.of_record("cd" * 32, crdt.key_record("k2", "u", 0.0),
        crdt.key_settings_record(1, {"rpm": 2}))
    admitted = []
    for t in (1000.2, 1000.7, 1030.0, 1060.5, 1061.0, 1061.1, 1061.2):
        clock[0] = t
        try:
            flow.release(flow.admit(key, "m", b"{}", 0, FakeClient()), 1)
            admitted.append(t)
        except otela_ingress.HTTPError:
            pass
    # two in the first second; refused until that second has left the window (61 s buckets: no
    # 60 s span ever holds three); then two again
    assert admitted == [1000.2, 1000.7, 1061.0, 1061.1]


@pytest.mark.parametrize("field", ["rpm", "tpm"])
def test_two_ingresses_share_a_window_within_the_stated_bound(field):
    """Two flows exchanging their entries every FLOW_PUBLISH_S (as the overlay does, with no delay):
    a key flooding both at a known rate is admitted at most limit + R * FLOW_PUBLISH_S over the
    minute, R the rate (of requests, or of tokens) at the other ingress."""
    clock = [2000.0]
    real = otela_ingress.time.time
    otela_ingress.time.time = lambda: clock[0]
    try:
        maps = [crdt.GMap(), crdt.GMap()]
        flows = [flow_on(f"s{i}", maps[i]) for i in range(2)]
        # rpm 100, or tpm 1,000 with 10 tokens a request (a 2-byte body: 1, and max_tokens 9)
        key = otela_ingress.Key.of_record("ef" * 32, crdt.key_record("k3", "u", 0.0), crdt.key_settings_record(
            1, {field: 100 if field == "rpm" else 1000}))
        rate = 40.0                     # requests/s at each ingress: R = 40 for the other's view
        admitted, step, next_publish = 0, 1.0 / rate, clock[0]
        for i in range(int(rate * 30)):   # 30 s of flood at each ingress, alternating
            clock[0] = 2000.0 + i * step
            for flow in flows:
                try:
                    flow.release(flow.admit(key, "m", b"{}", 9, FakeClient()), 10)
                    admitted += 1
                except otela_ingress.HTTPError:
                    pass
            if clock[0] >= next_publish:
                next_publish += otela_ingress.FLOW_PUBLISH_S
                for flow, mine, theirs in ((flows[0], maps[0], maps[1]), (flows[1], maps[1], maps[0])):
                    flow.publish(clock[0])
                    entry = crdt.flow_entry(flow.session_id())
                    if theirs.merge({entry: mine.get(entry)}):
                        (flows[1] if flow is flows[0] else flows[0]).on_entry(entry, theirs.get(entry))
        bound = 100 + rate * otela_ingress.FLOW_PUBLISH_S
        print(f"{field}: admitted {admitted} requests in 30 s (100 a minute) over two ingresses at {rate:g}/s each "
              f"(bound {bound:g})")
        assert 100 <= admitted <= bound
    finally:
        otela_ingress.time.time = real


def test_the_admin_api_and_the_cli_refuse_bad_limits_with_a_clear_error(stack, tmp_path):
    admin = Client(stack.url, stack.key("root", admin=True))
    for path, body, word in (("/v1/admin/limits/users/x", {"rpm": -1}, "rpm"),
                             ("/v1/admin/limits/users/x", {"tpm": 1.5}, "tpm"),
                             ("/v1/admin/limits/users/x", {"rpm": 1, "burst": 2}, "burst"),
                             ("/v1/admin/limits/models/" + "m" * 300, {"rpm": 1}, "name"),
                             ("/v1/admin/limits/users/x", "[1]", "JSON object")):
        status, _, answer = admin.request("PUT", path, body)
        assert status == 400 and word in json.loads(answer)["error"]["message"], (path, answer)
    assert admin.request("PUT", "/v1/admin/limits/groups/x", {"rpm": 1})[0] == 404
    status, _, answer = admin.request("POST", "/v1/admin/keys", {"user": "g", "concurrency": "2"})
    assert status == 400 and "concurrency" in json.loads(answer)["error"]["message"]
    status, _, answer = admin.request("POST", "/v1/admin/keys", {"user": "g", "rpm": 7, "tpm": 900})
    made = json.loads(answer)
    assert status == 200 and (made["rpm"], made["tpm"], made["concurrency"]) == (7, 900, 0)
    assert Client(stack.url, made["key"]).chat("m1")[1]["x-ratelimit-limit-requests"] == "7"
    user = Client(stack.url, stack.key("nobody"))
    assert user.request("PUT", "/v1/admin/limits/users/x", {"rpm": 1})[0] == 403

    db = str(tmp_path / "cli.sqlite")
    run = [sys.executable, os.path.join(ROOT, "otela_ingress.py")]
    for args, word in ((["limits", "set", "--user", "u", "--rpm", "-3"], "rpm"),
                       (["limits", "set", "--user", "u"], "--rpm"),
                       (["limits", "set", "--rpm", "3"], "--user"),
                       (["keys", "create", "--user", "u", "--tpm", "-1"], "tpm")):
        done = subprocess.run(run + args + ["--db", db], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and word in done.stderr.strip().splitlines()[-1], done   # (argparse: usage first)
    made = subprocess.run(run + ["keys", "create", "--user", "h", "--rpm", "12", "--concurrency", "3", "--json",
                                 "--db", db], capture_output=True, text=True, timeout=60)
    assert (json.loads(made.stdout)["rpm"], json.loads(made.stdout)["concurrency"]) == (12, 3)
    listed = subprocess.run(run + ["keys", "list", "--db", db], capture_output=True, text=True, timeout=60)
    assert "rpm=12 concurrency=3" in listed.stdout
    ok = subprocess.run(run + ["limits", "set", "--model", "m/x", "--tpm", "5000", "--db", db],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    listed = subprocess.run(run + ["limits", "list", "--json", "--db", db], capture_output=True, text=True,
                            timeout=60)
    assert json.loads(listed.stdout) == [{"model": "m/x", "rpm": 0, "tpm": 5000, "concurrency": 0}]


def test_a_limit_set_with_the_cli_reaches_the_running_ingress(stack):
    db = otela_ingress.open_db(stack.db_path)
    try:
        otela_ingress.store_limit(db, "u", "gina", {"rpm": 2, "tpm": 0, "concurrency": 0}, time.time())
    finally:
        db.close()
    client = Client(stack.url, stack.key("gina"))
    deadline = time.monotonic() + 10
    while not stack.call(lambda: stack.ingress.flow.active) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [client.chat("m1")[0] for _ in range(3)] == [200, 200, 429]


def test_limit_and_flow_records_are_closed_bounded_and_name_no_user():
    authority = crdt.Authority([b"s" * 32])
    subject = crdt.subject_of(authority.subject_key(), "u", "alice")
    assert "alice" not in subject and subject.startswith("u-")
    entry = crdt.limit_entry(subject)
    crdt.validate(entry, crdt.limit_record(1, {"rpm": 3}))
    bad = [({"state": 0, "version": 1, "rpm": -1}, "rpm"), ({"state": 0, "version": 1, "user": "alice"}, "user"),
           ({"state": 0, "version": 1, "model": "m"}, "only a model"), ({"state": 1, "version": 1}, "state")]
    for record, word in bad:
        with pytest.raises(crdt.RecordError, match=word):
            crdt.validate(entry, record)
    with pytest.raises(crdt.RecordError, match="names its model"):
        crdt.validate(crdt.limit_entry("m-" + "0" * 16), {"state": 0, "version": 1, "rpm": 1})
    flow = crdt.flow_entry("ab" * 16)
    too_many = {f"k-{i:016x}": [1, 1, 0, 1] for i in range(crdt.MAX_FLOW_SUBJECTS + 1)}
    with pytest.raises(crdt.RecordError, match="at most"):
        crdt.validate(flow, crdt.flow_record(1, 1.0, too_many))
    with pytest.raises(crdt.RecordError, match="subject"):
        crdt.validate(flow, crdt.flow_record(1, 1.0, {"alice": [1, 1, 1, 1]}))
    # the publisher keeps what fits one record: the busiest subjects, whatever their counts
    flow_of = flow_on("ab" * 16)
    for i in range(40):
        window = flow_of.windows[f"k-{i:016x}"] = otela_ingress.Window()
        window.add(int(time.time()), 2**40)
        window.served = 2**40 + i
    flow_of.publish(time.time())
    published = flow_of.record_of(flow)
    assert 15 < len(published["n"]) <= crdt.MAX_FLOW_SUBJECTS
    assert len(crdt.validate(flow, authority.sign(flow, published))) <= crdt.MAX_RECORD_BYTES
    # a replica holds at most MAX_FLOWS flows and MAX_LIMITS limits; a flow gone quiet is compacted
    gmap = crdt.GMap()
    gmap.merge({crdt.flow_entry(f"s{i}"): crdt.flow_record(1, 100.0, {}) for i in range(crdt.MAX_FLOWS + 5)})
    assert gmap.refused["flows_full"] == 5
    gmap.compact(100.0 + crdt.FLOW_RETENTION_S + 1)
    assert not [e for e, _ in gmap.all_items() if e.startswith("flow:")]
    assert gmap.merge({crdt.flow_entry("s1"): crdt.flow_record(2, 100.0, {})}) == []   # too old now


def test_limits_and_flows_reach_every_ingress_and_no_worker_and_a_job_cannot_forge_them():
    """The ingress plane takes only what the tier signed: a job holding the cluster key alone
    writes no limit, and a flow of its making cannot raise anyone's counts."""
    from test_authority import fleet

    import otela_node
    net, ins, ws = fleet()
    authority = crdt.Authority([b"i" * 32])   # test_authority's tier secret
    subject = crdt.subject_of(authority.subject_key(), "u", "alice")
    limit, flow = crdt.limit_entry(subject), crdt.flow_entry(ins[0].sid)
    net.send(ins[0].addr, ins[0].publish(limit, crdt.limit_record(5, {"rpm": 3}), net.now))
    net.send(ins[0].addr, ins[0].publish(flow, crdt.flow_record(1, net.now, {subject: [2, 9, 1, 9]}), net.now))
    net.run(2.0)
    assert ins[1].map.get(limit)["rpm"] == 3 and ins[1].map.get(flow)["n"] == {subject: [2, 9, 1, 9]}
    assert all(limit not in w.map and flow not in w.map for w in ws)
    attacker = ws[0]
    forged = {limit: crdt.limit_record(99, {"rpm": 1}),
              crdt.limit_entry("m-" + "0" * 16): crdt.limit_record(1, {"rpm": 1}, "m"),
              crdt.flow_entry(attacker.sid): crdt.flow_record(1, net.now, {subject: [10**6, 0, 0, 0]}),
              flow: dict(crdt.flow_record(2, net.now, {subject: [10**6, 0, 0, 0]}), sig="f" * 64)}
    for target in ins:
        net.send(attacker.addr, [otela_node.Out(target.addr, {"t": "r", "r": forged}, False)])
        net.send(attacker.addr, [otela_node.Out(target.addr, {"t": "st", "r": forged}, True)])
    net.run(3.0)
    for ingress in ins:
        assert ingress.map.get(limit)["rpm"] == 3 and ingress.map.get(flow)["version"] == 1
        assert crdt.flow_entry(attacker.sid) not in ingress.map
        assert ingress.refused["unsigned"] >= 8


@pytest.mark.slow
def test_two_ingresses_on_one_overlay_admit_a_key_within_the_stated_bound(tmp_path):
    """A key's rpm at two real ingresses (one overlay, one node): a flood paced at RATE requests/s
    at each is admitted at most rpm + RATE * (FLOW_PUBLISH_S + d) over the minute (see "Limits"),
    d the push's delay, taken here as 0.1 s for a loaded test box; measured, printed."""
    import threading

    from test_ingress_multi import ENGINE, TwoIngresses, poll
    from test_ingress_support import free_port
    rpm, rate, seconds = 30, 20.0, 4.0
    two = TwoIngresses(str(tmp_path))
    try:
        port = free_port()
        two.node("n1", f"{ENGINE} {port}", port, "fm")
        admin = Client(two.url, two.token)
        status, _, body = admin.request("POST", "/v1/admin/keys", {"user": "flood", "rpm": rpm})
        assert status == 200, body
        token = json.loads(body)["key"]
        poll(lambda: Client(two.url_b, token).request("GET", "/v1/models")[0] == 200, "the key at B")
        poll(lambda: Client(two.url_b, two.token).chat("fm")[0] == 200, "B routing to the node")
        results = {two.url: [], two.url_b: []}

        def flood(url):
            client = Client(url, token)
            start = next_at = time.monotonic()
            while time.monotonic() - start < seconds:
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at + 1 / rate, time.monotonic())   # never faster than RATE, no bursts
                results[url].append(client.chat("fm", max_tokens=4)[0])
            client.close()

        threads = [threading.Thread(target=flood, args=(url,)) for url in results]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        admitted = sum(r.count(200) for r in results.values())
        others = sum(len(r) for r in results.values()) / 2 / seconds   # the measured rate at each
        bound = rpm + others * (otela_ingress.FLOW_PUBLISH_S + 0.1)
        print(f"rpm {rpm}: admitted {admitted} of {sum(map(len, results.values()))} at two ingresses "
              f"({others:.1f} req/s at each; bound {bound:.1f}); at A {results[two.url].count(200)}, "
              f"at B {results[two.url_b].count(200)}")
        assert all(s in (200, 429) for r in results.values() for s in r)
        assert rpm <= admitted <= bound
    finally:
        two.close()


RELEASE_BEFORE_LIMITS = "fcec822"   # main before limit and flow entries


def test_an_ingress_of_the_release_before_carries_limits_and_flows_and_learns_nothing_private_from_them():
    """The release before takes "lim:" and "flow:" as kinds it does not know: it applies them (no
    batch that holds one is refused, so keys and usage still sync with it), holds them on its
    routing plane and hands them to workers. So they name no user and no key: only keyed hashes,
    counts, limits and a model's name."""
    import importlib.util
    shown = subprocess.run(["git", "-C", ROOT, "show", f"{RELEASE_BEFORE_LIMITS}:crdt.py"],
                           capture_output=True, timeout=60)
    if shown.returncode != 0:
        pytest.skip(f"{RELEASE_BEFORE_LIMITS} is not in this clone's history")
    spec = importlib.util.spec_from_loader("crdt_before_limits", loader=None)
    old = importlib.util.module_from_spec(spec)
    exec(compile(shown.stdout, "crdt_before_limits.py", "exec"), old.__dict__)
    authority = crdt.Authority([b"s" * 32])
    user, key_hash = "alice@uni.example", "12" * 32
    subjects = {kind: crdt.subject_of(authority.subject_key(), kind, name)
                for kind, name in (("u", user), ("k", key_hash), ("m", "llama-70b"))}
    entries = {crdt.limit_entry(subjects["u"]): crdt.limit_record(5, {"rpm": 3}),
               crdt.limit_entry(subjects["m"]): crdt.limit_record(5, {"tpm": 9000}, "llama-70b"),
               crdt.flow_entry("ab" * 16): crdt.flow_record(1, time.time(), {s: [1, 2, 0, 3] for s in subjects.values()}),
               crdt.key_entry(key_hash): crdt.key_record("k1", user, 1.0)}
    signed = {e: authority.sign(e, r) for e, r in entries.items()}
    replica = old.GMap()
    assert sorted(replica.merge(signed)) == sorted(signed) and not replica.refused
    carried = dict(replica.plane_items(old.ROUTING))
    assert sorted(carried) == sorted(e for e in signed if not e.startswith("key:"))
    text = json.dumps(carried)
    assert user not in text and key_hash not in text and "alice" not in text
    worker = old.GMap(planes=(old.ROUTING,))   # a worker of that release carries them, at most MAX_UNKNOWN
    assert len(worker.merge({e: r for e, r in signed.items() if not e.startswith("key:")})) == 3


def test_streams_carry_the_headers_and_leave_the_in_flight_count_when_they_end(stack):
    client = Client(stack.url, limited_key(stack, rpm=100, concurrency=1))
    for _ in range(3):   # one in flight at a time: each must have left before the next comes
        status, headers, body = client.chat("m1", stream=True)
        assert status == 200 and b"[DONE]" in body
        assert headers["x-ratelimit-limit-requests"] == "100"
    assert client.chat("m1")[1]["x-ratelimit-remaining-requests"] == "96"
    page = Client(stack.url).request("GET", "/metrics")[2].decode()
    assert 'otela_rate_limited_total{subject="key",type="requests"} 0' in page


def test_refusals_are_counted_on_metrics_by_subject_and_type(stack):
    client = Client(stack.url, limited_key(stack, rpm=1))
    assert [client.chat("m1")[0] for _ in range(3)] == [200, 429, 429]
    page = Client(stack.url).request("GET", "/metrics")[2].decode()
    assert 'otela_rate_limited_total{subject="key",type="requests"} 2' in page


def test_remote_service_sums_the_tokens_other_ingresses_served_a_tenant():
    """The fair queue's cluster-wide counter: what the other sessions published for a tenant,
    never this ingress's own."""
    a, b = flow_on("s0"), flow_on("s1")
    a.note_service("team-x", 300)
    a.note_service("team-x", 200)
    b.note_service("team-x", 7)
    now = time.time()
    for flow, other in ((a, b), (b, a)):
        flow.publish(now)
        entry = crdt.flow_entry(flow.session_id())
        other.on_entry(entry, flow.record_of(entry))
    assert (b.remote_service("team-x"), a.remote_service("team-x")) == (500, 7)
    assert b.remote_service("team-y") == 0


def beside_the_release_before(tmp_path):
    """A (the release before limits, with the cluster's admin key) and B (this release, serving at
    the returned URL) on one overlay, and a node serving "fm" that B reaches: (cluster, B's URL)."""
    from test_ingress_multi import ENGINE, poll
    from test_ingress_support import Cluster, free_port
    folder = tmp_path / "before"
    folder.mkdir()
    for name in ("otela_node.py", "crdt.py", "otela_ingress.py"):
        shown = subprocess.run(["git", "-C", ROOT, "show", f"{RELEASE_BEFORE_LIMITS}:{name}"],
                               capture_output=True, timeout=60)
        if shown.returncode != 0:
            pytest.skip(f"{RELEASE_BEFORE_LIMITS} is not in this clone's history")
        (folder / name).write_bytes(shown.stdout)
    cluster = Cluster(str(tmp_path), ingress_root=str(folder))
    try:
        port_b = free_port()
        url_b = f"http://127.0.0.1:{port_b}"
        cluster._spawn("ingress-b", [os.path.join(ROOT, "otela_ingress.py"), "serve", "--key-file", cluster.key_file,
                                     "--listen", f"127.0.0.1:{port_b}", "--gossip", f"127.0.0.1:{free_port()}",
                                     "--db", str(tmp_path / "b.sqlite"), "--bootstrap", f"127.0.0.1:{cluster.gossip}"])
        cluster._wait(lambda: Client(url_b).request("GET", "/healthz")[0] == 200, "ingress B")
        port = free_port()
        cluster.node("n1", f"{ENGINE} {port}", port, "fm")
        poll(lambda: Client(url_b, cluster.token).chat("fm")[0] == 200, "A's admin key and the node at B")
    except BaseException:
        cluster.close()
        raise
    return cluster, url_b


@pytest.mark.slow
def test_an_ingress_of_the_release_before_keeps_serving_beside_one_that_limits(tmp_path):
    """A (the release before limits) and B (this one) on one overlay: B enforces a user's limit
    and publishes its flow; A takes those entries as kinds it does not know and keeps serving,
    and the keys made at A still work at B."""
    from test_ingress_multi import poll
    cluster, url_b = beside_the_release_before(tmp_path)
    folder = tmp_path / "before"
    try:
        admin_b = Client(url_b, cluster.token)
        assert admin_b.request("PUT", "/v1/admin/limits/users/tester", {"rpm": 5})[0] == 200
        answers = [Client(url_b, cluster.token).chat("fm") for _ in range(8)]
        assert [a[0] for a in answers] == [200] * 5 + [429] * 3
        def carried_at_a():   # A's routing plane holds the sessions and, as unknown kinds, B's lim: and flow:
            page = Client(cluster.url).request("GET", "/metrics")[2].decode()
            held = [line for line in page.splitlines() if line.startswith('otela_registry_entries{plane="routing"}')]
            sessions = json.loads(Client(cluster.url).request("GET", "/v1/registry")[2])["sessions"]
            return held and int(float(held[0].split()[-1])) - len(sessions) >= 2
        poll(carried_at_a, "B's limit and flow carried at A")
        made = subprocess.run([sys.executable, str(folder / "otela_ingress.py"), "keys", "create", "--user", "zed",
                               "--db", cluster.db], capture_output=True, text=True, timeout=60, check=True)
        token = made.stdout.strip()
        poll(lambda: Client(url_b, token).chat("fm")[0] == 200, "a key made at A, used at B")
        assert [Client(cluster.url, token).chat("fm")[0] for _ in range(5)] == [200] * 5   # A serves on
        with open(tmp_path / "ingress.log", "rb") as log:
            assert b"Traceback" not in log.read()
    finally:
        cluster.close()
