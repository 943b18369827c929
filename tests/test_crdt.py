"""The registry's specification: lattice laws, lifecycle monotonicity, validation, anti-entropy."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import crdt
from crdt import DOWN, JOIN, LEFT, SERVING, GMap, RecordError

PROPERTY = settings(max_examples=500, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SESSION_IDS = [f"{i:032x}" for i in range(1, 9)]


def record(state=SERVING, version=1, **extra):
    base = {"owner": "alice@node1", "state": state, "version": version, "started": 1000.0,
            "role": "worker", "addr": "127.0.0.1:7700", "models": ["llama-3-8b"]}
    if state == LEFT:
        base["left_at"] = 2000.0
    base.update(extra)
    return base


EVIDENCE = {"since": 1990.0, "grace": 5.0, "by": ["b" * 32]}   # an eviction by b, 10 s after the suspicion


# A write is (session id, record); the strategy covers every state, version ties, and
# concurrent evictions by different members (same state and version, different content).
writes = st.builds(
    lambda sid, state, version, model, evictor: (
        sid,
        record(state, version, models=[model],
               **({"evicted_by": evictor, "left_at": 2000.0 + version,
                   "evidence": {"since": 1990.0, "grace": 5.0, "by": [evictor]}} if state >= DOWN else {}))),
    st.sampled_from(SESSION_IDS), st.sampled_from([JOIN, SERVING, DOWN, LEFT]),
    st.integers(0, 3), st.sampled_from(["m1", "m2", "m3"]),
    st.sampled_from(["e" * 32, "f" * 32]))
write_lists = st.lists(writes, max_size=25)


def replica(entries):
    gmap = GMap()
    for sid, rec in entries:
        gmap.merge([(sid, rec)])
    return gmap


def state_of(gmap):
    return {sid: crdt.encode(rec) for sid, rec in gmap.items()}


# -- lattice laws ------------------------------------------------------------------------------
@PROPERTY
@given(write_lists, write_lists)
def test_merge_is_commutative(a, b):
    assert state_of(replica(a + b)) == state_of(replica(b + a))


@PROPERTY
@given(write_lists, write_lists, write_lists)
def test_merge_is_associative(a, b, c):
    left = replica(a)
    left.merge(list(replica(b).items()))
    left.merge(list(replica(c).items()))
    bc = replica(b)
    bc.merge(list(replica(c).items()))
    right = replica(a)
    right.merge(list(bc.items()))
    assert state_of(left) == state_of(right)


@PROPERTY
@given(write_lists)
def test_merge_is_idempotent(a):
    gmap = replica(a)
    before = state_of(gmap)
    assert gmap.merge(list(gmap.items())) == []
    assert gmap.merge(a) == []
    assert state_of(gmap) == before


@PROPERTY
@given(write_lists)
def test_states_never_go_backwards(a):
    gmap = GMap()
    seen = {}
    for sid, rec in a:
        gmap.merge([(sid, rec)])
        now = gmap.get(sid)
        assert (now["state"], now["version"]) >= seen.get(sid, (-1, -1))
        seen[sid] = (now["state"], now["version"])


@PROPERTY
@given(write_lists, st.randoms(use_true_random=False))
def test_ten_replicas_fed_random_subsets_in_random_orders_converge(a, rnd):
    replicas = []
    for _ in range(10):
        subset = [w for w in a if rnd.random() < 0.6]
        rnd.shuffle(subset)
        replicas.append(replica(subset))
    # then each replica receives everything, in its own random order, in random batches
    for gmap in replicas:
        rest = list(a)
        rnd.shuffle(rest)
        while rest:
            cut = rnd.randint(1, len(rest))
            gmap.merge(rest[:cut])
            rest = rest[cut:]
    digests = {r.digest()["root"] for r in replicas}
    assert len(digests) == 1
    assert len({tuple(sorted(state_of(r).items())) for r in replicas}) == 1


@PROPERTY
@given(write_lists, write_lists, st.sampled_from(["root", "buckets", "summary"]))
def test_diff_applied_both_ways_makes_replicas_equal(a, b, depth):
    left, right = replica(a), replica(b)

    def remote_view(gmap, other):
        if depth == "root":
            return gmap.digest()
        if depth == "buckets":
            return gmap.digest(buckets=True)
        return gmap.summary(gmap.differing_buckets(other.digest(buckets=True)))

    to_right = left.diff(remote_view(right, left))
    to_left = right.diff(remote_view(left, right))
    right.merge(to_right)
    left.merge(to_left)
    assert left.digest() == right.digest()
    assert state_of(left) == state_of(right)


@PROPERTY
@given(write_lists)
def test_diff_of_equal_replicas_is_empty(a):
    left, right = replica(a), replica(list(reversed(a)))
    assert left.diff(right.digest()) == {}
    assert left.diff(right.summary(range(crdt.BUCKETS))) == {}


@PROPERTY
@given(write_lists, st.floats(0, 200_000))
def test_compacted_left_records_never_come_back(a, now):
    gmap = GMap(retention=100.0)
    gmap.merge(a)
    gmap.compact(now)
    dropped = {sid for sid, rec in a if rec["state"] == LEFT and rec["left_at"] < now - 100.0}
    for sid in dropped:
        assert sid not in gmap
    gmap.merge(a)                                  # every record arrives again
    for sid in dropped:
        assert sid not in gmap
    assert all(rec["state"] != LEFT or rec["left_at"] >= now - 100.0 for _, rec in gmap.items())


# -- lifecycle and ownership ---------------------------------------------------------------------
def test_higher_state_wins_whatever_the_version():
    gmap = GMap()
    gmap.put("a" * 32, record(SERVING, version=9))
    gmap.put("a" * 32, record(DOWN, version=0, evicted_by="b" * 32, evidence=EVIDENCE), writer="b" * 32)
    assert gmap.get("a" * 32)["state"] == DOWN
    assert gmap.put("a" * 32, record(SERVING, version=10)) is False
    assert gmap.get("a" * 32)["state"] == DOWN


def test_within_a_state_the_owners_version_wins():
    gmap = GMap()
    gmap.put("a" * 32, record(SERVING, version=2, models=["new"]))
    assert gmap.put("a" * 32, record(SERVING, version=1, models=["old"])) is False
    assert gmap.get("a" * 32)["models"] == ["new"]


def test_only_the_owner_writes_join_and_serving():
    gmap = GMap()
    with pytest.raises(RecordError, match="only its owner"):
        gmap.put("a" * 32, record(SERVING), writer="b" * 32)
    assert len(gmap) == 0


def test_an_eviction_names_its_writer():
    gmap = GMap()
    with pytest.raises(RecordError, match="evicted_by"):
        gmap.put("a" * 32, record(LEFT), writer="b" * 32)
    assert gmap.put("a" * 32, record(LEFT, evicted_by="b" * 32, evidence=EVIDENCE), writer="b" * 32) is True
    assert gmap.get("a" * 32)["evicted_by"] == "b" * 32


def test_live_view_holds_join_and_serving_only():
    gmap = GMap()
    for i, state in enumerate([JOIN, SERVING, DOWN, LEFT]):
        gmap.put(SESSION_IDS[i], record(state))
    assert sorted(gmap.live()) == SESSION_IDS[:2]


def test_lifecycle_table_names_owner_only_and_routable_states():
    assert crdt.OWNER_ONLY == {JOIN, SERVING}
    assert crdt.ROUTABLE == {SERVING}
    assert JOIN < SERVING < DOWN < LEFT


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sid, bad, message", [
    ("a" * 32, {"owner": "x", "state": 7, "version": 0, "started": 0}, "unknown state"),
    ("a" * 32, {"owner": "x", "state": "SERVING", "version": 0, "started": 0}, "unknown state"),
    ("a" * 32, {"owner": "x", "state": 1, "version": -1, "started": 0}, "version"),
    ("a" * 32, {"owner": "x", "state": 1, "version": True, "started": 0}, "version"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0}, "missing field 'started'"),
    ("a" * 32, {"owner": 5, "state": 1, "version": 0, "started": 0}, "owner must be a string"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0, "started": float("nan")}, "started"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0, "started": 0, "models": "m"}, "models"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0, "started": 0,
                "models": ["m" * 300]}, "longer than"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0, "started": 0,
                "blob": "x" * 3000}, "over 2048"),
    ("a" * 32, {"owner": "x", "state": 3, "version": 0, "started": 0}, "left_at"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0, "started": 0,
                "evicted_by": "b"}, "cannot carry evicted_by"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0, "started": 0, "role": "boss"}, "role"),
    ("a" * 32, {"owner": "x", "state": 1, "version": 0, "started": 0,
                "hardware": {"count": -1}}, "hardware.count"),
    ("not a session!", {"owner": "x", "state": 1, "version": 0, "started": 0}, "session id"),
    ("a" * 32, ["not", "a", "dict"], "must be an object"),
])
def test_malformed_record_raises_and_leaves_the_map_untouched(sid, bad, message):
    gmap = GMap()
    gmap.put("c" * 32, record())
    before = gmap.digest(buckets=True)
    with pytest.raises(RecordError, match=message):
        gmap.merge([("d" * 32, record(SERVING, 5)), (sid, bad)])
    with pytest.raises(RecordError, match=message):
        gmap.put(sid, bad)
    assert gmap.digest(buckets=True) == before
    assert "d" * 32 not in gmap


def test_unknown_extra_fields_are_kept_for_newer_versions():
    gmap = GMap()
    gmap.put("a" * 32, record(future_field={"x": 1}))
    assert gmap.get("a" * 32)["future_field"] == {"x": 1}


def test_get_returns_a_copy():
    gmap = GMap()
    gmap.put("a" * 32, record())
    gmap.get("a" * 32)["state"] = LEFT
    assert gmap.get("a" * 32)["state"] == SERVING


# -- digests and encoding ------------------------------------------------------------------------
def test_digest_is_small_and_tracks_content():
    gmap = GMap()
    empty = gmap.digest()
    for i in range(1000):
        gmap.put(f"{i:032x}", record())
    assert gmap.digest()["n"] == 1000
    assert gmap.digest() != empty
    assert len(crdt.dumps(gmap.digest())) < 64
    assert len(crdt.dumps(gmap.digest(buckets=True))) < 256 * 30


def test_diff_by_summary_sends_only_what_the_remote_lacks_or_has_older():
    ours, theirs = GMap(), GMap()
    for i in range(200):
        ours.put(f"{i:032x}", record(version=1))
        theirs.put(f"{i:032x}", record(version=1))
    ours.put(f"{5:032x}", record(version=2))          # newer here
    ours.put("f" * 32, record())                      # missing there
    theirs.put(f"{6:032x}", record(version=3))        # newer there: not ours to send
    buckets = ours.differing_buckets(theirs.digest(buckets=True))
    sent = ours.diff(theirs.summary(buckets))
    assert sorted(sent) == sorted([f"{5:032x}", "f" * 32])


def test_canonical_encoding_is_key_order_independent():
    assert crdt.encode({"b": 1, "a": [1, "é"]}) == crdt.encode({"a": [1, "é"], "b": 1})
    assert crdt.loads(crdt.dumps({"a": [1, "é"]})) == {"a": [1, "é"]}


def test_session_ids_are_128_random_bits():
    ids = {crdt.new_session_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 32 for i in ids)


def test_compaction_keeps_recent_left_and_all_live_records():
    gmap = GMap(retention=10.0)
    gmap.put("a" * 32, record(LEFT, left_at=100.0))
    gmap.put("b" * 32, record(LEFT, left_at=195.0))
    gmap.put("c" * 32, record(SERVING))
    assert gmap.compact(now=200.0) == 1
    assert sorted(sid for sid, _ in gmap.items()) == ["b" * 32, "c" * 32]
    assert gmap.merge([("a" * 32, record(LEFT, left_at=100.0, version=9))]) == []


def test_random_bytes_decoded_as_records_are_rejected_not_crashing():
    rnd = random.Random(7)
    gmap = GMap()
    for _ in range(500):
        junk = {rnd.choice(["owner", "state", "version", "started", "models"]):
                rnd.choice([None, 1, "x", [], {}, 1.5, True]) for _ in range(5)}
        with pytest.raises(RecordError):
            gmap.merge([("a" * 32, junk)])
    assert len(gmap) == 0


def test_json_pair_uses_orjson_only_when_importable():
    import os
    blocked = bool(os.environ.get("OTELA_BLOCK_ACCEL"))
    assert (crdt.dumps.__code__.co_names == ("_orjson", "dumps")) is not blocked
    assert crdt.dumps({"b": [1.5, None, "é"]}) == '{"b":[1.5,null,"é"]}'.encode()


# -- keys and usage: entries of their own kinds in the same map ------------------------------
KEY_HASHES = [f"{i:064x}" for i in range(1, 4)]
SLOTS = ["a" * 32, "b" * 32, "c" * 32]
KEYED = settings(max_examples=200, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def key_write(key_hash, state, version, user, rate):
    record = crdt.key_record(key_hash[-8:], user, 1000.0, rate=rate, version=version)
    if state == crdt.KEY_REVOKED:
        record.update(state=crdt.KEY_REVOKED, revoked_at=2000.0 + version)
    return crdt.key_entry(key_hash), record


def usage_write(key_hash, model, slot, version):
    # a slot's counts grow with its version (its one writer only adds)
    record = crdt.usage_record(key_hash, model, "2026-12-01", slot, version, version * 2,
                               version * 10, version * 7)
    return crdt.usage_entry(key_hash, model, "2026-12-01", slot), record


key_writes = st.builds(key_write, st.sampled_from(KEY_HASHES),
                       st.sampled_from([crdt.KEY_ACTIVE, crdt.KEY_REVOKED]), st.integers(0, 3),
                       st.sampled_from(["alice", "bob"]), st.sampled_from([0.0, 5.0]))
usage_writes = st.builds(usage_write, st.sampled_from(KEY_HASHES), st.sampled_from(["m1", "m2"]),
                         st.sampled_from(SLOTS), st.integers(0, 5))
mixed_lists = st.lists(st.one_of(writes, key_writes, usage_writes), max_size=30)


def full_state(gmap):
    return {eid: crdt.encode(rec) for eid, rec in gmap.all_items()}


@KEYED
@given(mixed_lists, mixed_lists)
def test_merge_of_sessions_keys_and_usage_is_commutative(a, b):
    assert full_state(replica(a + b)) == full_state(replica(b + a))


@KEYED
@given(mixed_lists, mixed_lists, mixed_lists)
def test_merge_of_sessions_keys_and_usage_is_associative(a, b, c):
    left = replica(a)
    left.merge(list(replica(b).all_items()))
    left.merge(list(replica(c).all_items()))
    bc = replica(b)
    bc.merge(list(replica(c).all_items()))
    right = replica(a)
    right.merge(list(bc.all_items()))
    assert full_state(left) == full_state(right)


@KEYED
@given(mixed_lists)
def test_merge_of_sessions_keys_and_usage_is_idempotent(a):
    gmap = replica(a)
    before = full_state(gmap)
    assert gmap.merge(list(gmap.all_items())) == []
    assert gmap.merge(a) == []
    assert full_state(gmap) == before


@KEYED
@given(mixed_lists, mixed_lists)
def test_anti_entropy_carries_keys_and_usage_like_sessions(a, b):
    left, right = replica(a), replica(b)
    right.merge(left.diff(right.digest(buckets=True)))
    left.merge(right.diff(left.digest(buckets=True)))
    assert full_state(left) == full_state(right)


@KEYED
@given(st.lists(key_writes, min_size=1, max_size=20))
def test_a_revocation_wins_every_merge_whatever_the_versions(a):
    gmap = replica(a)
    for key_hash, record in gmap.key_records():
        writes_for_key = [r for eid, r in a if eid == crdt.key_entry(key_hash)]
        if any(r["state"] == crdt.KEY_REVOKED for r in writes_for_key):
            assert record["state"] == crdt.KEY_REVOKED
            assert not crdt.key_accepts(record, 0.0)


@KEYED
@given(st.lists(usage_writes, max_size=30), st.randoms(use_true_random=False))
def test_usage_totals_are_the_sum_of_each_slots_highest_count_in_any_order(a, rnd):
    shuffled = list(a)
    rnd.shuffle(shuffled)
    expected = {}
    for _, rec in a:
        slot = (rec["key"], rec["model"], rec["slot"])
        expected[slot] = max(expected.get(slot, 0), rec["prompt_tokens"])
    for order in (a, shuffled):
        totals = crdt.usage_totals(replica(order).usage_records())
        for (key_hash, model, _day), sums in totals.items():
            assert sums["prompt_tokens"] == sum(v for (k, m, _), v in expected.items()
                                                if k == key_hash and m == model)


@KEYED
@given(st.lists(usage_writes, max_size=20), st.lists(usage_writes, max_size=20))
def test_usage_totals_never_fall_when_more_is_merged(a, b):
    gmap = replica(a)
    before = crdt.usage_totals(gmap.usage_records())
    gmap.merge(b)
    after = crdt.usage_totals(gmap.usage_records())
    for counter, sums in before.items():
        assert all(after[counter][f] >= sums[f] for f in crdt.USAGE_COUNTS)


def test_items_and_live_show_sessions_only_while_all_items_show_every_kind():
    gmap = GMap()
    gmap.put("a" * 32, record())
    gmap.put(*key_write(KEY_HASHES[0], crdt.KEY_REVOKED, 1, "alice", 0.0))
    gmap.put(*usage_write(KEY_HASHES[0], "m1", SLOTS[0], 1))
    assert [sid for sid, _ in gmap.items()] == ["a" * 32]
    assert list(gmap.live()) == ["a" * 32]
    assert len(list(gmap.all_items())) == 3 == len(gmap)
    assert [h for h, _ in gmap.key_records()] == [KEY_HASHES[0]]


@pytest.mark.parametrize("extra, message", [
    ({"token": "sk-otela-secret"}, "unknown field 'token'"),
    ({"state": 2}, "unknown key state"),
    ({"budget_day": -1}, "budget_day must be an integer"),
    ({"admin": 1}, "admin must be true or false"),
    ({"allow": "m1"}, "allow must be a list"),
    ({"expires": float("inf")}, "expires must be a finite number"),
])
def test_a_key_record_carries_no_secret_and_only_sane_fields(extra, message):
    eid, rec = key_write(KEY_HASHES[0], crdt.KEY_ACTIVE, 0, "alice", 0.0)
    gmap = GMap()
    with pytest.raises(RecordError, match=message):
        gmap.put(eid, dict(rec, **extra))
    assert len(gmap) == 0


def test_a_key_entry_id_is_its_tokens_sha256():
    rec = crdt.key_record("k1", "alice", 1.0)
    with pytest.raises(RecordError, match="64 hex digits"):
        GMap().put("key:sk-otela-plain", rec)


def test_a_usage_slot_id_must_match_what_it_counts_and_only_its_session_writes_it():
    eid, rec = usage_write(KEY_HASHES[0], "m1", SLOTS[0], 1)
    with pytest.raises(RecordError, match="does not match"):
        GMap().put(eid, dict(rec, model="m2"))
    with pytest.raises(RecordError, match="only session"):
        GMap().put(eid, rec, writer=SLOTS[1])
    assert GMap().put(eid, rec, writer=SLOTS[0])


def test_revoking_twice_changes_nothing_and_expiry_refuses_from_its_time():
    rec = crdt.key_record("k1", "alice", 1.0, expires=500.0)
    assert crdt.key_accepts(rec, 499.9) and not crdt.key_accepts(rec, 500.0)
    gone = crdt.revoked(rec, 10.0)
    assert gone["state"] == crdt.KEY_REVOKED and gone["version"] == 1
    assert crdt.revoked(gone, 20.0) == gone


def test_usage_slots_older_than_the_retention_are_compacted_and_refused_after():
    gmap = GMap()
    old = crdt.usage_record(KEY_HASHES[0], "m1", "2026-01-01", SLOTS[0], 1, 1, 1, 1)
    new = crdt.usage_record(KEY_HASHES[0], "m1", "2026-12-01", SLOTS[0], 1, 1, 1, 1)
    for rec in (old, new):
        gmap.put(crdt.usage_entry(rec["key"], rec["model"], rec["day"], rec["slot"]), rec)
    now = crdt.day_start("2026-12-02")
    gmap.compact(now)
    assert [r["day"] for r in gmap.usage_records()] == ["2026-12-01"]
    assert gmap.merge([(crdt.usage_entry(old["key"], "m1", old["day"], old["slot"]), old)]) == []


def test_day_and_month_counters_are_kept_by_their_own_retention():
    gmap = GMap(usage_days=2, usage_months=2)
    periods = ["2026-10", "2026-11", "2026-12", "2026-11-30", "2026-12-01", "2026-12-02"]
    for period in periods:
        rec = crdt.usage_record(KEY_HASHES[0], crdt.ALL_MODELS, period, SLOTS[0], 1, 1, 1, 1)
        gmap.put(crdt.usage_entry(rec["key"], rec["model"], period, rec["slot"]), rec)
    gmap.compact(crdt.day_start("2026-12-02") + 3600.0)
    assert sorted(r["day"] for r in gmap.usage_records()) == ["2026-11", "2026-12", "2026-12-01", "2026-12-02"]
    late = crdt.usage_record(KEY_HASHES[1], crdt.ALL_MODELS, "2026-10", SLOTS[0], 1, 1, 1, 1)
    assert gmap.merge([(crdt.usage_entry(late["key"], "", "2026-10", late["slot"]), late)]) == []


@pytest.mark.parametrize("period", ["2026-12-1", "2026", "2026-12-01T00", "12-2026", ""])
def test_a_usage_period_is_a_day_or_a_month(period):
    rec = crdt.usage_record(KEY_HASHES[0], crdt.ALL_MODELS, period, SLOTS[0], 1, 1, 1, 1)
    with pytest.raises(crdt.RecordError, match="YYYY-MM"):
        crdt.validate(crdt.usage_entry(rec["key"], "", period, rec["slot"]), rec)


def test_spent_counts_day_counters_month_counters_and_a_release_befores_per_model_days_once():
    key = KEY_HASHES[0]
    records = [crdt.usage_record(key, "", "2026-12-04", SLOTS[0], 1, 1, 10, 5),     # today, all models
               crdt.usage_record(key, "", "2026-12", SLOTS[0], 1, 3, 40, 20),       # its month (today in it)
               crdt.usage_record(key, "m1", "2026-12-04", SLOTS[1], 1, 1, 100, 0),  # an older ingress's slot
               crdt.usage_record(key, "m1", "2026-12-01", SLOTS[1], 1, 1, 1000, 0),
               crdt.usage_record(key, "", "2026-11", SLOTS[0], 1, 1, 7, 0),
               crdt.usage_record(KEY_HASHES[1], "", "2026-12-04", SLOTS[0], 1, 1, 9, 9)]
    assert crdt.usage_spent(records, key, "2026-12-04") == (15 + 100, 60 + 100 + 1000)


def test_days_convert_both_ways_in_utc():
    assert crdt.time_day(crdt.day_start("2026-02-28") + 86399.0) == "2026-02-28"
    assert crdt.day_start("1970-01-02") == 86400.0


def test_a_records_adapters_are_kept_with_their_base_and_path():
    rec = record(models=["base", "sql"], adapters={"sql": ["base", "/adapters/sql"]}, max_model_len=4096)
    crdt.validate("a" * 32, rec)
    m = GMap()
    m.put("a" * 32, rec)
    assert m.get("a" * 32)["adapters"] == {"sql": ["base", "/adapters/sql"]}


@pytest.mark.parametrize("adapters", [
    {f"a{i}": ["base", ""] for i in range(crdt.MAX_ADAPTERS + 1)},   # more than the bound
    {"x" * (crdt.MAX_STRING + 1): ["base", ""]},                      # a name past the bound
    {"sql": ["base", "p" * (crdt.MAX_STRING + 1)]},                   # a path past the bound
    {"sql": "base"}, {"sql": ["base"]}, {"sql": ["base", 7]}, ["sql"],   # not {name: [base, path]}
])
def test_a_forged_records_adapters_beyond_the_bounds_or_out_of_shape_are_refused(adapters):
    with pytest.raises(RecordError, match="adapter"):
        crdt.validate("a" * 32, record(adapters=adapters))


@pytest.mark.parametrize("window", [0, -1, 2**31, 4096.0, True, "4096"])
def test_a_records_context_window_is_a_positive_integer(window):
    with pytest.raises(RecordError, match="max_model_len"):
        crdt.validate("a" * 32, record(max_model_len=window))
