"""The ingress's fair queue: requests wait at the ingress while engines are saturated, and go out
by weighted fair share of service between tenants, by class, first come first served within one."""
from __future__ import annotations

import collections
import json
import socket
import threading
import time
import types

import pytest
from test_ingress_support import Client, Stack, key_with_settings, sse_events

import crdt
import otela_ingress
import otela_node
from otela_ingress import FairQueue, HTTPError, Key, Limits, Waiting


# -- the order, sans I/O ------------------------------------------------------------------------------
def key(user: str, weight: float = 1.0, priority: str = "standard", priorities=(), key_id: str = "") -> Key:
    record = crdt.key_record(key_id or user, user, 0.0)
    return Key.of_record("0" * 64, record, crdt.key_settings_record(1, weight=weight, priority=priority,
                                                                    priorities=priorities))


def queue(**limits) -> FairQueue:
    return FairQueue(Limits(**limits), {})


def wait(q: FairQueue, k: Key, now: float, rank: int = 1, size: int = 100, model: str = "m",
         warm: bool = False) -> Waiting:
    entry = Waiting(q, lambda: True, k, rank, now, size, model, None, warm=warm)
    assert q.refusal(k, size) is None
    q.add(entry)
    return entry


def serve(q: FairQueue, n: int, now: float = 0.0, tokens: float = 100.0) -> list:
    """Send the next `n` in fair order, each charged `tokens`; their tenants in that order."""
    out = []
    for _ in range(n):
        entry = q.order(now)
        q.went(entry, tokens, now)
        out.append(entry.tenant)
    return out


def test_backlogged_tenants_share_service_by_their_weights():
    q = queue()
    light, heavy = key("light"), key("heavy", weight=3.0)
    for _ in range(100):
        wait(q, light, 0.0)
        wait(q, heavy, 0.0)
    served = collections.Counter(serve(q, 80))
    assert served == {"heavy": 60, "light": 20}


def test_within_a_tenant_requests_go_first_come_first_served():
    q = queue()
    alice = key("alice")
    entries = [wait(q, alice, float(i)) for i in range(5)]
    assert [q.order(10.0) for _ in range(1)] == [entries[0]]
    order = []
    while q.count:
        entry = q.order(10.0)
        q.went(entry, 10, 10.0)
        order.append(entry)
    assert order == entries


def test_a_tenant_that_starts_waiting_gets_no_credit_for_the_service_it_did_not_ask_for():
    q = queue()
    flood, late = key("flood"), key("late")
    for _ in range(50):
        wait(q, flood, 0.0)
    serve(q, 20)   # flood's counter: 2,000 tokens
    for _ in range(20):
        wait(q, late, 1.0)
    # lifted to the least counter among the waiting (flood's), it alternates rather than taking 20 in a row
    assert serve(q, 6, 1.0).count("late") == 3


def test_service_given_without_waiting_counts_against_the_tenant():
    q = queue()
    a, b = key("a"), key("b")
    wait(q, a, 0.0)
    wait(q, b, 0.0)
    q.charge("a", 5000)   # e.g. the completion tokens of a request that went out at once
    assert q.order(0.0).tenant == "b"


def test_remote_service_counts_in_the_order_by_what_it_grew_since_last_heard():
    q = queue()
    a, b = key("a"), key("b")
    remote = {"a": 50000.0, "b": 0.0}   # a's total from long before it waited here: no debt
    q.remote_service = lambda tenant: remote[tenant]
    wait(q, a, 0.0)
    wait(q, b, 1.0)
    assert q.order(1.0).tenant == "a"   # (equal counters: the older head)
    remote["a"] += 1000.0               # served elsewhere while it waits here: it counts
    assert q.order(1.0).tenant == "b"
    assert q.counters["a"] == pytest.approx(q.counters["b"] + 1000.0)


def test_a_remote_total_that_falls_is_no_credit():
    q = queue()
    a, b = key("a"), key("b", weight=2.0)
    remote = {"a": 3000.0, "b": 0.0}
    q.remote_service = lambda tenant: remote[tenant]
    wait(q, a, 0.0)
    wait(q, b, 0.0)
    q.order(0.0)
    before = q.counters["a"]
    remote["a"] = 0.0   # a peer restarted (or went stale): its total is gone, not given back
    q.order(0.0)
    remote["a"] = 500.0
    q.order(0.0)
    assert q.counters["a"] == pytest.approx(before + 500.0)
    remote["b"] = 1000.0   # charged by weight, as service here is
    q.order(0.0)
    assert q.counters["b"] == pytest.approx(500.0)   # (both started at 0)


def test_service_given_here_is_noted_for_the_other_ingresses():
    q = queue()
    noted = []
    q.note = lambda tenant, tokens: noted.append((tenant, tokens))
    wait(q, key("a"), 0.0)
    serve(q, 1, tokens=120.0)
    q.charge("a", -20.0)
    assert noted == [("a", 120.0), ("a", -20.0)]


def test_two_ingresses_share_service_through_their_flows():
    """A tenant served at one ingress stands behind at the other, by what it was served since."""
    maps = [crdt.GMap(), crdt.GMap()]
    flows = [otela_ingress.ClusterFlow(lambda i=i: f"s{i}", maps[i].put, maps[i].get) for i in range(2)]
    queues = [queue(), queue()]
    for q, flow in zip(queues, flows):
        q.remote_service, q.remote_inflight, q.note = flow.remote_service, flow.remote_inflight, flow.note_service

    def gossip():
        now = time.time()
        for flow, other in ((flows[0], flows[1]), (flows[1], flows[0])):
            flow.publish(now)
            entry = crdt.flow_entry(flow.session_id())
            other.on_entry(entry, maps[flows.index(flow)].get(entry))
    flood, small = key("flood"), key("small")
    for _ in range(10):
        wait(queues[0], flood, 0.0)
        wait(queues[1], flood, 0.0)
    wait(queues[1], small, 1.0)
    gossip()
    queues[1].order(1.0)   # (heard: the baseline)
    assert serve(queues[0], 5, 1.0) == ["flood"] * 5   # 500 tokens at the first ingress
    gossip()
    assert queues[1].order(1.0).tenant == "small"
    flows[0].note_inflight("flood", 1)
    gossip()
    assert flows[1].remote_inflight("flood") == 1
    assert queues[1].engine_priority(flood, 1) == 1 and queues[1].engine_priority(small, 1) == 0


def test_the_engine_priority_ranks_a_tenant_by_its_requests_in_flight():
    q = queue()
    flood, newcomer, heavy = key("flood"), key("new"), key("heavy", weight=4.0)
    for _ in range(100):
        q.began("flood")
        q.began("heavy")
    assert q.engine_priority(newcomer, 1) == 0                # none in flight: the class's base
    assert q.engine_priority(flood, 1) == 7                   # 100 in flight: 7 bits
    assert q.engine_priority(heavy, 1) == 5                   # ... a weight of 4: 25
    for _ in range(10000):
        q.began("flood")
    assert q.engine_priority(flood, 0) == -1                  # capped to its band: still interactive's
    assert q.engine_priority(newcomer, 2) == 10
    for _ in range(10100):
        q.ended("flood")
    assert "flood" not in q.inflight and q.engine_priority(flood, 1) == 0
    q.ended("nobody")   # (never below none)
    assert q.inflight == {"heavy": 100}


def test_a_tenant_with_little_at_priority_engines_goes_at_once():
    est = types.SimpleNamespace(outstanding=3)
    q = FairQueue(Limits(queue_session_depth=4), {"s": est})
    prio = type("C", (), {"session": "s", "by_priority": True})()
    fcfs = type("C", (), {"session": "f", "by_priority": False})()
    newcomer, flood, heavy = key("new"), key("flood"), key("heavy", weight=4.0)
    assert q.overtakes(prio, [prio], newcomer)
    assert not q.overtakes(fcfs, [fcfs], newcomer)         # an engine that cannot put it first
    assert not q.overtakes(prio, [prio, fcfs], newcomer)   # ... nor one it may be retried on
    for _ in range(2):
        q.began("flood")
        q.began("heavy")
    assert not q.overtakes(prio, [prio], flood)            # ENGINE_PRIORITY_FIRST in flight there
    assert q.overtakes(prio, [prio], heavy)                # ... by its weight: 2 / 4
    wait(q, newcomer, 0.0)
    assert not q.overtakes(prio, [prio], newcomer)         # its own waiting requests go first
    est.outstanding = 4
    assert not q.overtakes(prio, [prio], heavy)            # the session holds QUEUE_SESSION_DEPTH


def test_a_session_is_full_at_its_running_slots_but_for_a_tenant_below_its_share_of_them():
    fit = types.SimpleNamespace(per_token=lambda: 0.001)
    est = types.SimpleNamespace(fit=fit, outstanding=3, queued=0.0)   # (no prefill queued yet)
    q = FairQueue(Limits(queue_session_slots=4, queue_session_depth=12, queue_wait_s=0.05), {"s": est})
    fcfs = type("C", (), {"session": "s", "by_priority": False})()
    flood, newcomer, light, heavy = key("flood"), key("new"), key("light"), key("heavy", weight=4.0)
    assert q.slotted and not q.full(fcfs, None)
    est.outstanding = 4
    for _ in range(8):
        q.holds(flood)
    assert not q.full(fcfs, None)                          # the flood alone here: the slots do not bind
    wait(q, newcomer, 0.0)
    assert q.full(fcfs, None)                              # another waits: QUEUE_SESSION_SLOTS of this ingress's
    q.remove(q.order(0.0))
    assert not q.full(fcfs, None)
    assert q.overtakes(fcfs, [fcfs, fcfs], newcomer)       # none in flight: it goes past the slots
    for _ in range(4):
        q.holds(light)
    assert q.full(fcfs, None)                              # two tenants hold requests from here
    # 4 slots x 2 sessions between the flood and light: 4 each, and light holds 4
    assert q.slot_share(light, 2) == 4.0 and not q.overtakes(fcfs, [fcfs, fcfs], light)
    assert q.overtakes(fcfs, [fcfs] * 3, light)            # 12 slots: 6 each
    est.queued = 100.0                                     # 0.1 s of prefill queued there: full ...
    assert q.full(fcfs, None) and q.overtakes(fcfs, [fcfs] * 3, light)   # ... but not for a tenant below its share
    est.queued = 0.0
    assert not q.overtakes(fcfs, [fcfs] * 3, flood)        # ... and the flood holds 8
    for _ in range(3):
        q.holds(heavy)   # 12 slots over weights 1 + 1 + 4: 2 a unit of weight; heavy holds 3 / 4
    assert q.slot_share(heavy, 3) == 2.0 and q.overtakes(fcfs, [fcfs] * 3, heavy)
    assert not q.overtakes(fcfs, [fcfs] * 3, light)
    for _ in range(3):
        q.released("light", q.held)
    assert q.overtakes(fcfs, [fcfs], light)                # below ENGINE_PRIORITY_FIRST whatever its share
    wait(q, newcomer, 0.0)
    assert not q.overtakes(fcfs, [fcfs, fcfs], newcomer)   # its own waiting requests go first
    est.outstanding = 12
    assert not q.overtakes(fcfs, [fcfs], light)            # never past QUEUE_SESSION_DEPTH
    assert q.held == {"flood": 8, "light": 1, "heavy": 3} and q.inflight == {}   # (not the priority count)


def test_a_tenant_alone_goes_past_no_bound_for_its_share_of_the_slots():
    est = types.SimpleNamespace(fit=types.SimpleNamespace(per_token=lambda: 0.001), outstanding=8, queued=100.0)
    q = FairQueue(Limits(queue_session_slots=4, queue_session_depth=12, queue_wait_s=0.05), {"s": est})
    fcfs = type("C", (), {"session": "s", "by_priority": False})()
    solo = key("solo")
    for _ in range(3):
        q.holds(solo)
    assert q.full(fcfs, None)                              # 0.1 s of prefill queued: the bound holds it
    assert q.slot_share(solo, 2) == 8.0 and not q.overtakes(fcfs, [fcfs, fcfs], solo)   # alone: no share
    q.holds(key("other"))
    assert q.overtakes(fcfs, [fcfs, fcfs], solo)           # 4 each of 8 slots, it holds 3


def test_without_slots_below_the_depth_nothing_overtakes_at_a_fcfs_engine_nor_is_counted():
    est = types.SimpleNamespace(fit=types.SimpleNamespace(per_token=lambda: 0.0), outstanding=5, queued=0.0)
    q = FairQueue(Limits(), {"s": est})   # QUEUE_SESSION_SLOTS as QUEUE_SESSION_DEPTH: off
    fcfs = type("C", (), {"session": "s", "by_priority": False})()
    assert not q.slotted and not q.full(fcfs, None)
    assert not q.overtakes(fcfs, [fcfs], key("new"))
    assert not FairQueue(Limits(queue_session_slots=1), None).slotted   # (no queue: no count either)


def test_a_flood_is_guarded_to_its_tighter_bound_only_while_a_tenant_with_none_waiting_has_requests_out():
    est = types.SimpleNamespace(fit=types.SimpleNamespace(per_token=lambda: 0.001), outstanding=3, queued=20.0)
    q = FairQueue(Limits(queue_wait_s=0.05, queue_guard_wait_s=0.01), {"s": est})   # 0.02 s of prefill queued
    fcfs = type("C", (), {"session": "s", "by_priority": False})()
    flood, light = key("flood"), key("light")
    assert q.guarding and q.counting and not q.slotted and not q.full(fcfs, None)
    floods = [wait(q, flood, 0.0) for _ in range(3)]
    q.holds(flood)
    assert not q.guarded(floods[0], fcfs)                  # the flood alone: only the prefill bound
    mine = wait(q, light, 1.0)
    assert not q.guarded(floods[0], fcfs)                  # light waits: none of its requests is out yet
    assert q.unguarded({"m"}) == [mine] and q.unguarded({"other"}) == []   # (the one head no guard holds)
    q.went(mine, 100, 1.0)
    q.holds(light)
    assert q.guarded(floods[0], fcfs)                      # out, none waiting: the flood is held there
    est.queued = 5.0
    assert not q.guarded(floods[0], fcfs)                  # under the guard's bound: it may go
    est.queued = 20.0
    again = wait(q, light, 2.0)
    assert not q.guarded(floods[0], fcfs)                  # light waits again: it is served in fair order
    assert not q.guarded(again, fcfs)                      # (and a tenant's one waiting request is never held)
    q.remove(again)
    q.went(floods[0], 100, 2.0)
    assert q.guarded(floods[1], fcfs)                      # the flood still has 2 waiting
    q.released("light", q.held)
    assert q.held == {"flood": 1} and not q.guarded(floods[1], fcfs)   # light's ended: nothing to guard


def test_while_guarding_a_tenant_waiting_for_none_goes_at_once_below_its_share_of_the_requests_out():
    est = types.SimpleNamespace(fit=types.SimpleNamespace(per_token=lambda: 0.001), outstanding=3, queued=200.0)
    q = FairQueue(Limits(queue_wait_s=0.05, queue_guard_wait_s=0.01), {"s": est})
    fcfs = type("C", (), {"session": "s", "by_priority": False})()
    flood, light, heavy = key("flood"), key("light"), key("heavy", weight=2.0)
    wait(q, flood, 0.0)
    for _ in range(6):
        q.holds(flood)
    assert q.full(fcfs, None) and not q.overtakes(fcfs, [fcfs], flood)   # it waits for its own
    assert q.held_share(light) == 3.0 and q.overtakes(fcfs, [fcfs], light)   # 6 out between two: past the bound
    for _ in range(5):
        q.holds(light)
    assert q.overtakes(fcfs, [fcfs], light)                # 11 out between two: 5 is below its 5.5
    q.holds(light)
    assert not q.overtakes(fcfs, [fcfs], light)            # 12 between two: it holds its 6
    for _ in range(4):
        q.holds(heavy)   # 16 out over weights 1 + 1 + 2: 4 a unit of weight; heavy holds 4 / 2
    assert q.held_share(heavy) == 4.0 and q.overtakes(fcfs, [fcfs], heavy) and not q.overtakes(fcfs, [fcfs], light)
    off = FairQueue(Limits(queue_wait_s=0.05), {"s": est})   # QUEUE_GUARD_WAIT_S as QUEUE_WAIT_S: off
    assert not off.guarding and not off.counting and not off.overtakes(fcfs, [fcfs], light)


def test_a_session_of_a_priority_engine_is_full_at_the_looser_bound():
    est = types.SimpleNamespace(fit=types.SimpleNamespace(per_token=lambda: 0.001), outstanding=3, queued=200.0)
    q = FairQueue(Limits(queue_wait_s=0.05, queue_priority_wait_s=0.5), {"s": est})   # 0.2 s of prefill queued
    fcfs = type("C", (), {"session": "s", "by_priority": False})()
    prio = type("C", (), {"session": "s", "by_priority": True})()
    assert q.full(fcfs, None) and not q.full(prio, None)
    est.queued = 600.0
    assert q.full(prio, None)


def test_whole_answers_show_an_engine_faster_than_the_prior_and_it_is_not_full():
    fit = otela_node.SpeedFit(0.05)   # a CPU's prior: 3.3 ms per prompt token, full at 15 queued
    est = types.SimpleNamespace(fit=fit, outstanding=3, queued=60.0)
    q = FairQueue(Limits(queue_wait_s=0.05), {"s": est})
    fcfs = type("C", (), {"session": "s", "by_priority": False})()
    assert q.full(fcfs, None)
    fit.bound(600.0, 0.006)   # a whole answer 6 ms after it went, 600 tokens to compute first
    assert fit.per_token() == pytest.approx(1e-5) and not q.full(fcfs, None)
    fit.bound(0.5, 0.006)     # (less than a token ahead: shows nothing)
    for _ in range(400):      # answers that do not renew it: the ceiling rises back to the fit
        fit.bound(10.0, 1.0)
    assert fit.per_token() == fit.theta[1] and q.full(fcfs, None)


def test_a_conversations_next_turn_goes_before_its_tenants_cold_requests_until_they_age():
    q = queue(queue_age_s=10.0)
    agent, other = key("agent"), key("other")
    cold = [wait(q, agent, 0.0) for _ in range(2)]
    turn = wait(q, agent, 1.0, warm=True)   # an agent's tool call back, after the tenant's cold ones
    assert q.order(2.0) is turn
    theirs = wait(q, other, 2.0)
    assert q.order(2.0) is turn            # (between tenants of one share: the older request's, the agent's)
    q.charge("agent", 1000)
    assert q.order(2.0) is theirs          # (between tenants the share decides first)
    q.went(theirs, 0, 2.0)
    assert q.order(10.0) is cold[0]        # a cold request that waited QUEUE_AGE_S: first come first served
    assert q.order(2.0) is turn
    q.went(turn, 0, 2.0)
    assert q.order(2.0) is cold[0]
    q.went(cold[0], 0, 2.0)
    assert q.order(2.0) is cold[1] and q.count == 1


def test_with_the_warm_rule_off_a_tenants_turns_and_cold_requests_go_first_come_first_served():
    q = queue(queue_age_s=10.0)
    q._warm_first = False   # (the routing bench's warm case measures the rule against this)
    agent = key("agent")
    cold = wait(q, agent, 0.0)
    turn = wait(q, agent, 1.0, warm=True)
    assert q.order(2.0) is cold
    q.went(cold, 0, 2.0)
    assert q.order(2.0) is turn


def test_a_turn_is_warm_when_its_body_holds_an_assistant_message():
    first = {"messages": [{"role": "user", "content": "hi"}]}
    turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "calling"},
                         {"role": "tool", "content": "42"}]}
    assert otela_ingress.earlier_turns(first)[0] == 0 and otela_ingress.earlier_turns(turn)[0] > 0


def test_a_higher_class_waits_only_behind_its_own_class():
    q = queue()
    batch, chat = key("batch", priority="batch"), key("chat", priority="interactive")
    for _ in range(10):
        wait(q, batch, 0.0, rank=2)
    q.charge("chat", 10**6)   # however much service it had, its class goes first
    first = wait(q, chat, 1.0, rank=0)
    assert q.order(1.0) is first


def test_a_lower_class_rises_a_class_per_age_step_and_is_not_starved():
    q = queue(queue_age_s=10.0)
    old = wait(q, key("batch"), 0.0, rank=2)
    fresh = wait(q, key("chat"), 15.0, rank=1)   # a standard request, newer
    assert q.rank(old, 15.0) == 1
    assert q.order(15.0) is old   # the same class now, and the batch tenant has had less service
    assert q.rank(old, 25.0) == 0 and q.rank(fresh, 25.0) == 0


def test_an_old_backlog_does_not_overtake_a_newcomer_of_its_own_class():
    q = queue(queue_age_s=10.0)
    flood, newcomer = key("flood"), key("new")
    for _ in range(20):
        wait(q, flood, 0.0)
    serve(q, 5, 1.0)
    for _ in range(3):
        wait(q, newcomer, 30.0)   # the flood's backlog has waited 30 s: its class rose, and the newcomer's with it
    assert serve(q, 6, 30.0) == ["flood", "new"] * 3   # (lifted to the flood's counter: a tie, the older first)


def test_bounds_per_key_and_overall_refuse_with_429_and_retry_after():
    q = queue(queue_max=3, queue_max_per_key=2, queue_key_bytes=1000)
    a, b = key("a"), key("b")
    wait(q, a, 0.0)
    wait(q, a, 0.0)
    refused = q.refusal(a, 10)
    assert isinstance(refused, HTTPError) and refused.status == 429
    assert (b"retry-after", b"2") in refused.headers
    assert q.refusal(b, 2000).status == 429   # bytes of one key
    wait(q, b, 0.0)
    assert q.refusal(b, 10).status == 429     # the whole queue
    assert q.throttled == {"a": 1, "b": 2}


def test_a_request_that_waited_too_long_is_taken_out():
    q = queue(queue_timeout_s=5.0)
    a = key("a")
    old, new = wait(q, a, 0.0), wait(q, a, 4.0)
    assert q.expired(6.0) == [old]
    assert q.count == 1 and q.order(6.0) is new


def test_a_cancelled_entry_leaves_the_queue_and_frees_its_key_share():
    q = queue(queue_max_per_key=1)
    a = key("a")
    entry = wait(q, a, 0.0)
    entry.cancel()
    assert q.count == 0 and q.bytes == 0 and not q.lanes and not q.per_key
    assert q.aborted == {"a": 1}
    assert q.refusal(a, 10) is None


def test_requests_of_a_model_whose_sessions_are_full_are_passed_over():
    q = queue()
    a, b = key("a"), key("b")
    wait(q, a, 0.0, model="busy")
    other = wait(q, b, 1.0, model="free")
    q.charge("b", 100)
    assert q.order(1.0, {"busy"}) is other



def test_a_request_whose_picked_session_is_full_stops_only_itself_the_next_in_line_may_go():
    """A conversation's own engine full while another of the model's is not: its turn waits for
    it, and the requests behind it (of its own tenant too) go where there is room, up to
    QUEUE_LOOKAHEAD passed over; a model whose every session is full is passed over at once."""
    now = time.monotonic()   # (dispatch_waiting reads the clock: none has waited too long)
    q = queue()
    alice = key("alice")
    outcome = {}
    entries = []
    for i in range(otela_ingress.QUEUE_LOOKAHEAD + 3):
        entry = wait(q, alice, now + i * 1e-3)
        entry.send = (lambda e=entry: outcome.get(e, True) and (q.went(e, 10, 20.0) or True))
        entries.append(entry)
    blocked = entries[0]
    outcome[blocked] = False                        # its picked session is full, another is not
    ingress = types.SimpleNamespace(queue=q, limits=q.limits, _queue_tick=None, _loop=None)
    otela_ingress.Ingress.dispatch_waiting(ingress)
    assert list(q.lanes.values())[0][0] is blocked and q.count == 1   # the rest went past it
    for entry in entries[1:]:
        assert entry.lane is None
    # the lookahead is bounded: past QUEUE_LOOKAHEAD blocked ones, the model waits for the next dispatch
    q2 = queue()
    stuck = [wait(q2, alice, now + i * 1e-3) for i in range(otela_ingress.QUEUE_LOOKAHEAD + 2)]
    tried = []
    for entry in stuck:
        entry.send = (lambda e=entry: tried.append(e) or False)
    otela_ingress.Ingress.dispatch_waiting(types.SimpleNamespace(queue=q2, limits=q2.limits, _queue_tick=None,
                                                                 _loop=None))
    assert tried == stuck[:otela_ingress.QUEUE_LOOKAHEAD] and q2.count == len(stuck)
    # every session full (None): the first try passes the model over
    q3 = queue()
    full = [wait(q3, alice, now + i * 1e-3) for i in range(3)]
    calls = []
    for entry in full:
        entry.send = (lambda e=entry: calls.append(e))
    otela_ingress.Ingress.dispatch_waiting(types.SimpleNamespace(queue=q3, limits=q3.limits, _queue_tick=None,
                                                                 _loop=None))
    assert calls == full[:1]

# -- the request class -----------------------------------------------------------------------------
def test_request_class_from_header_body_and_key():
    plain = key("u")
    allowed = key("v", priorities=["interactive"])
    rc = otela_ingress.request_class
    assert rc(plain, {}, {}) == 1
    assert rc(plain, {b"x-otela-priority": b"batch"}, {}) == 2   # a lower class: always
    with pytest.raises(HTTPError) as refused:
        rc(plain, {b"x-otela-priority": b"interactive"}, {})
    assert refused.value.status == 403
    with pytest.raises(HTTPError) as bad:
        rc(plain, {b"x-otela-priority": b"urgent"}, {})
    assert bad.value.status == 400
    assert rc(allowed, {b"x-otela-priority": b"interactive"}, {}) == 0
    assert rc(plain, {}, {"priority": -5}) == 1   # the body's asks, capped at the key's class
    assert rc(allowed, {}, {"priority": -5}) == 0
    assert rc(plain, {}, {"priority": 3}) == 2


def test_the_engine_gets_its_priority_field():
    body = b'{"model":"m","priority":-100}'
    out = otela_ingress.with_engine_priority(body, json.loads(body), 13)
    assert json.loads(out) == {"model": "m", "priority": 13}
    body = b'{"model":"m"}'
    assert json.loads(otela_ingress.with_engine_priority(body, json.loads(body), -10)) == {"priority": -10, "model": "m"}
    assert json.loads(otela_ingress.with_engine_priority(b"{ }", {}, 0)) == {"priority": 0}


def test_engine_scheduling_is_read_from_the_engine_command():
    assert otela_node.engine_scheduling(["vllm", "serve", "m", "--scheduling-policy", "priority"]) == \
        {"scheduling": "priority"}
    assert otela_node.engine_scheduling(["python", "-m", "sglang.launch_server", "--enable-priority-scheduling"]) == \
        {"scheduling": "priority"}
    assert otela_node.engine_scheduling(["vllm", "serve", "m", "--scheduling-policy", "fcfs"]) == {}


# -- key records ----------------------------------------------------------------------------------------
def test_a_key_record_is_the_record_of_before_and_refuses_the_settings_fields():
    record = crdt.key_record("k1", "alice", 1.0)
    assert set(record) == {"state", "version", "id", "user", "created"}
    assert set(otela_ingress.new_key("bob")[2]) == {"state", "version", "id", "user", "created"}
    assert otela_ingress.key_settings(1.0, {}, weight=1.0, priority="standard", priorities=[]) == \
        {"state": 0, "version": 1000}   # every default: nothing set
    entry = crdt.key_entry("ab" * 32)
    for field, value in (("weight", 2.0), ("priority", "batch"), ("priorities", ["batch"]), ("rpm", 1),
                         ("tpm", 1), ("concurrency", 1)):   # (an ingress of the release before: the same)
        with pytest.raises(crdt.RecordError, match=field):
            crdt.validate_key(entry, dict(record, **{field: value}))


def test_key_queue_fields_are_validated_in_the_keys_settings_entry_and_only_there():
    entry = crdt.KEY_SETTINGS_ENTRY + "ab" * 8
    good = crdt.key_settings_record(1, weight=2.5, priority="batch", priorities=["standard"])
    crdt.validate(entry, good)
    assert good["weight"] == 2.5 and good["priority"] == "batch" and good["priorities"] == ["standard"]
    for bad in ({"weight": 0}, {"weight": -1}, {"weight": True}, {"priority": "urgent"},
                {"priorities": ["x"]}, {"priorities": "interactive"}, {"priorities": ["batch", "batch"]}):
        with pytest.raises(crdt.RecordError):
            crdt.validate(entry, dict(crdt.key_settings_record(1), **bad))
    for other in ("lim:u-" + "ab" * 8, "lim:m-" + "ab" * 8):   # a user's or a model's: limits only
        with pytest.raises(crdt.RecordError, match="priority"):
            crdt.validate(other, dict(crdt.limit_record(1, {"rpm": 1}, "m" if "m-" in other else None),
                                      priority="batch"))
    with pytest.raises(ValueError):
        otela_ingress.queue_spec(weight=float("nan"))
    assert otela_ingress.queue_spec(2, "interactive", "batch, standard") == \
        {"weight": 2.0, "priority": "interactive", "priorities": ["batch", "standard"]}


# -- through the ingress (fake engines) --------------------------------------------------------------------
@pytest.fixture
def deep1(tmp_path):
    """An ingress whose sessions are full with one request of its own in flight."""
    s = Stack(str(tmp_path / "otela.sqlite"), limits=Limits(queue_session_depth=1, queue_max_per_key=3))
    try:
        yield s
    finally:
        s.close()


def in_threads(*calls):
    """Run each call in its own thread, started in order 50 ms apart; their results in that order."""
    results = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = []
    for i, call in enumerate(calls):
        t = threading.Thread(target=run, args=(i, call))
        t.start()
        threads.append(t)
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    return results


def chat_at(url, token, done, tag, **extra):
    def call():
        c = Client(url, token)
        try:
            answer = c.chat(**extra)
            done.append((tag, time.monotonic()))
            return answer
        finally:
            c.close()
    return call


def test_requests_wait_at_the_ingress_while_the_session_is_full(deep1):
    _, engine = deep1.engine("m1", mode="slow", slow_delay=0.3)
    token = deep1.key("alice")
    done: list = []
    answers = in_threads(*(chat_at(deep1.url, token, done, i) for i in range(3)))
    assert [a[0] for a in answers] == [200, 200, 200]
    assert [tag for tag, _ in done] == [0, 1, 2]   # first come first served within the tenant
    # one at a time at the engine: each waited for the one before
    assert done[2][1] - done[0][1] >= 0.5
    metrics = Client(deep1.url).request("GET", "/metrics")[2].decode()
    assert 'otela_queue_wait_seconds_count{tenant="alice"} 2' in metrics
    assert 'otela_queue_service_tokens_total{tenant="alice"}' in metrics
    waits = sorted((w for (w,) in deep1.sql("SELECT waited_ms FROM requests")), key=lambda w: w or 0)
    assert waits[0] is None and 150 < waits[1] < waits[2]   # the first went at once; the others' waits
    admin = Client(deep1.url, deep1.key("root", admin=True))
    usage = json.loads(admin.request("GET", "/v1/usage")[2])
    assert usage["totals"]["waited_ms"] == pytest.approx(waits[1] + waits[2], rel=1e-3)
    admin.close()


def test_a_newcomer_tenant_goes_before_a_floods_backlog(deep1):
    deep1.engine("m1", mode="slow", slow_delay=0.3)
    flood, other = deep1.key("flood"), deep1.key("other")
    done: list = []
    calls = [chat_at(deep1.url, flood, done, "flood") for _ in range(3)] + [chat_at(deep1.url, other, done, "other")]
    answers = in_threads(*calls)
    assert all(a[0] == 200 for a in answers)
    # the first flood request was at the engine; "other" came last but went next
    assert [tag for tag, _ in done][:2] == ["flood", "other"]


def by_priority(stack, sid):
    """The session's record as a node whose engine runs `--scheduling-policy priority` publishes it."""
    def change():
        record = dict(stack.node.registry.get(sid), scheduling="priority")
        record["version"] = stack.node._versions[sid] = record["version"] + 1
        stack.node.registry.put(sid, record)
        stack.node._changed(sid)
    stack.call(change)


def test_a_newcomer_does_not_wait_where_the_engine_puts_it_first(tmp_path):
    s = Stack(str(tmp_path / "otela.sqlite"), limits=Limits(queue_wait_s=0.0, queue_priority_wait_s=0.0))
    try:
        sid, engine = s.engine("m1", mode="slow", slow_delay=0.3)
        by_priority(s, sid)
        flood, other = s.key("flood"), s.key("other")
        done: list = []
        calls = [chat_at(s.url, flood, done, "flood") for _ in range(4)] + [chat_at(s.url, other, done, "other")]
        answers = in_threads(*calls)
        assert all(a[0] == 200 for a in answers)
        metrics = Client(s.url).request("GET", "/metrics")[2].decode()
        # the flood's first ENGINE_PRIORITY_FIRST went at once, the others waited; the newcomer did not
        assert 'otela_queue_wait_seconds_count{tenant="flood"} 2' in metrics, \
            [line for line in metrics.splitlines() if "otela_queue" in line]
        assert 'otela_queue_wait_seconds_count{tenant="other"}' not in metrics
        assert [tag for tag, _ in done][:3] == ["flood", "flood", "other"]
        assert s.call(lambda: dict(s.ingress.queue.inflight)) == {}
    finally:
        s.close()


def test_past_a_keys_share_of_the_queue_the_answer_is_429_with_retry_after(deep1):
    deep1.engine("m1", mode="slow", slow_delay=0.5)
    token = deep1.key("alice")
    done: list = []
    answers = in_threads(*(chat_at(deep1.url, token, done, i) for i in range(5)))   # 1 sent, 3 wait, 1 over
    statuses = sorted(a[0] for a in answers)
    assert statuses == [200, 200, 200, 200, 429]
    refused = next(a for a in answers if a[0] == 429)
    assert refused[1]["retry-after"] == "2"
    assert json.loads(refused[2])["error"]["code"] == "rate_limit_exceeded"


def test_a_client_that_leaves_while_waiting_is_removed_at_once(deep1):
    _, engine = deep1.engine("m1", mode="slow", slow_delay=0.5)
    token = deep1.key("alice")
    first = threading.Thread(target=lambda: Client(deep1.url, token).chat())
    first.start()
    time.sleep(0.1)
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
    sock = socket.create_connection(("127.0.0.1", deep1.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (token.encode(), len(body), body))
    deadline = time.monotonic() + 5
    while deep1.call(lambda: deep1.ingress.queue.count) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deep1.call(lambda: deep1.ingress.queue.count) == 1
    sock.close()
    deadline = time.monotonic() + 5
    while deep1.call(lambda: deep1.ingress.queue.count) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deep1.call(lambda: deep1.ingress.queue.count) == 0
    assert deep1.call(lambda: dict(deep1.ingress.queue.aborted)) == {"alice": 1}
    first.join(10)
    time.sleep(0.2)
    assert engine.requests == 1   # the one that left never reached the engine
    assert deep1.sql("SELECT count(*) FROM requests") == [(1,)]   # no row for it


def test_a_stream_goes_through_the_queue(deep1):
    deep1.engine("m1", chunks=4, chunk_delay=0.1)
    token = deep1.key("alice")
    done: list = []
    answers = in_threads(chat_at(deep1.url, token, done, 0, stream=True), chat_at(deep1.url, token, done, 1, stream=True))
    for status, _, body in answers:
        assert status == 200 and sse_events(body)[-1] == "[DONE]"
        assert len(sse_events(body)) == 5
    assert deep1.call(lambda: deep1.ingress.queue.waited["alice"][1]) == 1


def test_a_newcomer_goes_past_a_session_full_at_its_slots_while_the_flood_waits(tmp_path):
    s = Stack(str(tmp_path / "otela.sqlite"), limits=Limits(queue_session_slots=1, queue_max_per_key=5))
    try:
        s.engine("m1", mode="slow", slow_delay=0.6)
        flood, other = s.key("flood"), s.key("other")
        done: list = []
        answers = in_threads(chat_at(s.url, other, done, "o1"), *(chat_at(s.url, flood, done, f"f{i}") for i in range(3)),
                             chat_at(s.url, other, done, "o2"))
        assert [a[0] for a in answers] == [200] * 5
        # two tenants hold requests: past the one slot the flood holds ENGINE_PRIORITY_FIRST (2) at most,
        # its third waited for a request to end; the other's second, one in flight, went at once
        assert [tag for tag, _ in done] == ["o1", "f0", "f1", "o2", "f2"]
        assert s.call(lambda: (s.ingress.queue.waited["flood"][1], s.ingress.queue.waited["other"][1])) == (1, 0)
        assert s.call(lambda: dict(s.ingress.queue.held)) == {}   # out of the count at their ends
    finally:
        s.close()


def test_while_guarding_requests_go_in_fair_order_and_the_counts_in_flight_end_with_them(tmp_path):
    s = Stack(str(tmp_path / "otela.sqlite"), limits=Limits(queue_session_depth=2, queue_max_per_key=5,
                                                            queue_guard_wait_s=0.01))
    try:
        s.engine("m1", mode="slow", slow_delay=0.6)
        flood, other = s.key("flood"), s.key("other")
        done: list = []
        answers = in_threads(*(chat_at(s.url, flood, done, f"f{i}") for i in range(3)), chat_at(s.url, other, done, "o1"))
        assert [a[0] for a in answers] == [200] * 4
        # the session full at its depth, the other tenant's request went before the flood's third
        assert [tag for tag, _ in done] == ["f0", "f1", "o1", "f2"]
        assert s.call(lambda: (s.ingress.queue.guarding, dict(s.ingress.queue.held))) == (True, {})
    finally:
        s.close()


def test_a_retry_after_a_failed_attempt_does_not_wait_again(tmp_path):
    s = Stack(str(tmp_path / "otela.sqlite"), limits=Limits(queue_session_depth=1))
    try:
        s.engine("m1", mode="error500")
        good, _ = s.engine("m1", mode="slow", slow_delay=0.6)
        admin, token = s.key("root", admin=True), s.key("alice")
        # the good session is full (one request in flight, pinned there by an admin) ...
        busy = threading.Thread(target=lambda: Client(s.url, admin).chat(headers={"x-otela-session": good}))
        busy.start()
        time.sleep(0.2)
        # ... so alice's request goes to the other, which refuses it with a 500: its retry goes to the
        # full session at once, as an attempt of a request already sent, not behind the queue
        status, headers, _ = Client(s.url, token).chat(content="another question")
        busy.join(10)
        assert status == 200 and headers["x-otela-session"] == good
        assert s.call(lambda: s.ingress.metrics.retries) == 1
        assert s.call(lambda: s.ingress.queue.waited["alice"][1]) == 0
    finally:
        s.close()


def test_the_engine_gets_the_keys_class_where_it_schedules_by_priority(stack):
    sid, engine = stack.engine("m1")
    def by_priority():   # what a node whose engine runs `--scheduling-policy priority` publishes
        record = dict(stack.node.registry.get(sid), scheduling="priority")
        record["version"] = stack.node._versions[sid] = record["version"] + 1
        stack.node.registry.put(sid, record)
        stack.node._changed(sid)
    stack.call(by_priority)
    token = key_with_settings(stack, "batchy", queueing={"priority": "batch"})
    c = Client(stack.url, token)
    status, _, _ = c.chat(priority=-50)
    assert status == 200
    assert json.loads(engine.last_body)["priority"] == 10   # batch's, not what the client asked
    assert stack.call(lambda: dict(stack.ingress.queue.inflight)) == {}   # out of its tenant's count at its end
    status, _, body = c.chat(headers={"x-otela-priority": "interactive"})
    assert status == 403 and json.loads(body)["error"]["code"] == "priority_not_allowed"
    c.close()


def test_admin_api_and_cli_make_keys_with_weight_and_priority(stack, tmp_path):
    admin = stack.key("root", admin=True)
    c = Client(stack.url, admin)
    status, _, body = c.request("POST", "/v1/admin/keys", {"user": "lab", "weight": 4, "priority": "batch",
                                                          "priorities": ["standard"]})
    answer = json.loads(body)
    assert status == 200
    assert (answer["weight"], answer["priority"], answer["priorities"]) == (4.0, "batch", ["standard"])
    status, _, body = c.request("POST", "/v1/admin/keys", {"user": "lab", "weight": 0})
    assert status == 400 and "weight" in json.loads(body)["error"]["message"]
    c.close()
    import subprocess
    import sys
    db = str(tmp_path / "cli.sqlite")
    made = subprocess.run([sys.executable, otela_ingress.__file__, "keys", "create", "--user", "u", "--db", db,
                           "--weight", "2", "--priority", "interactive", "--json"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["weight"] == 2.0 and json.loads(made.stdout)["priority"] == "interactive"
    bad = subprocess.run([sys.executable, otela_ingress.__file__, "keys", "create", "--user", "u", "--db", db,
                          "--weight", "-1"], capture_output=True, text=True)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


def test_a_database_from_before_the_queue_gets_the_waited_columns(tmp_path):
    import sqlite3
    path = str(tmp_path / "old.sqlite")
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE requests (ts REAL NOT NULL, day TEXT NOT NULL, key_id TEXT, user TEXT, model TEXT,
            session TEXT, provider TEXT, status INTEGER, prompt_tokens INTEGER, completion_tokens INTEGER,
            latency_ms REAL, stream INTEGER, attempts INTEGER, request_id TEXT, trace_id TEXT);
        CREATE TABLE daily (day TEXT NOT NULL, user TEXT NOT NULL, model TEXT NOT NULL,
            requests INTEGER NOT NULL DEFAULT 0, errors INTEGER NOT NULL DEFAULT 0,
            opted_out INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, user, model));
        INSERT INTO daily VALUES ('2026-01-01', 'u', 'm', 1, 0, 0, 2, 3);""")
    old.close()
    db = otela_ingress.open_db(path)
    try:
        assert [r[1] for r in db.execute("PRAGMA table_info(requests)")][-1] == "waited_ms"
        assert db.execute("SELECT waited_ms FROM daily").fetchall() == [(0,)]
    finally:
        db.close()
