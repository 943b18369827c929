"""The `ttft` policy's parts: prompt chains, the prefix index, a node's published summary, the
per-session estimate, and the policy's choices (no processes; the end-to-end path is in
tests/test_routing_fleet.py)."""
import json
import random
import time

from hypothesis import given, settings
from hypothesis import strategies as st

import crdt
import otela_ingress
import otela_node
from otela_ingress import (
    Candidate,
    PrefixIndex,
    PublishedPrefixes,
    RoutedRequest,
    SpeedFit,
    TTFTPolicy,
    cached_of,
)
from otela_node import (
    PREFIX_BLOCK_CHARS,
    PREFIX_PUBLISHED,
    PrefixSummary,
    decode_prefixes,
    encode_prefixes,
    prefix_anchors,
    prefix_key,
    prompt_chain,
    prompt_text,
)

KEY = prefix_key(b"k" * 32)


def chat(system, question):
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def words(n, seed):
    rng = random.Random(seed)
    return "".join(" " + "".join(rng.choices("abcdefgh", k=4)) for _ in range(n))


def test_prompt_text_renders_every_message_in_order():
    a = prompt_text({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]})
    b = prompt_text({"messages": [{"role": "user", "content": "S"}, {"role": "user", "content": "Q"}]})
    assert a != b and a.index("S") < a.index("Q")
    parts = prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                   {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert "hi" in parts and "image_url" in parts
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "" and prompt_text({"messages": "no"}) == ""
    assert prompt_text({"messages": [None, {"role": "user", "content": None}]}) == "user\x1f\x1e"


def test_chains_share_exactly_their_common_blocks_and_are_keyed():
    system = words(300, 1)
    a = prompt_chain(prompt_text(chat(system, words(200, 2))), KEY)
    b = prompt_chain(prompt_text(chat(system, words(200, 3))), KEY)
    common = len(prompt_text(chat(system, ""))) // PREFIX_BLOCK_CHARS
    assert a[:common] == b[:common] and a[common + 1:] != b[common + 1:]
    assert prompt_chain(prompt_text(chat(system, "")), prefix_key(b"other" * 8))[0] != a[0]
    assert prompt_chain("short", KEY) == []


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=2000), st.text(max_size=2000))
def test_chain_match_is_the_common_prefix_in_whole_blocks(x, y):
    a, b = prompt_chain(x, KEY), prompt_chain(y, KEY)
    bx, by = x.encode("utf-8", "surrogatepass"), y.encode("utf-8", "surrogatepass")
    same = 0
    while same < min(len(bx), len(by)) and bx[same] == by[same]:
        same += 1
    shared = sum(1 for i in range(min(len(a), len(b))) if a[i] == b[i])
    assert shared == min(same // PREFIX_BLOCK_CHARS, len(a), len(b))


def test_prefix_index_matches_per_session_and_stays_bounded():
    index = PrefixIndex(limit=50)
    chain = prompt_chain(words(2000, 4), KEY)
    index.add(chain[:10], "s1")
    index.add(chain[:4], "s2")
    assert index.match(chain, ["s1", "s2", "s3"]) == {"s1": (10, True), "s2": (4, True)}
    index.add(chain[:6], "s1")   # a prompt that ended inside s1's longer one
    assert index.match(chain[:6], ["s1"]) == {"s1": (6, True)}
    assert index.match(chain[:5], ["s1"]) == {"s1": (5, False)}
    for i in range(20):
        index.add(prompt_chain(words(200, 100 + i), KEY), "s3")
    assert len(index.where) <= 50
    assert index.match(chain, ["s1", "s2"]) == {}   # the oldest went first


def test_anchors_and_published_prefixes_match_the_deepest_anchor_and_whether_a_prompt_ended_there():
    chain = prompt_chain(words(1100, 5), KEY)   # 5.5 k bytes: 21 blocks
    anchors = prefix_anchors(chain)
    assert anchors == [chain[0], chain[1], chain[3], chain[7], chain[15], chain[-1]]
    published = PublishedPrefixes(limit=3)
    published.update("s1", {"prefixes": encode_prefixes(anchors[:4])})   # a node of the last release
    published.update("s2", {"prefixes": encode_prefixes([chain[12]] + anchors[:2]), "prefix_ends": 1})
    assert published.match(chain) == {"s1": (8, False), "s2": (13, True)}
    assert published.match(chain[:3]) == {"s1": (2, False), "s2": (2, False)}
    # a record that changed replaces its anchors; one gone is forgotten; odd fields count nothing
    other = prompt_chain(words(300, 6), KEY)
    published.update("s1", {"prefixes": encode_prefixes(other), "prefix_ends": True})
    assert published.match(chain) == {"s2": (13, True)} and published.match(other)["s1"][1] is False
    published.forget("s2")
    published.update("s3", {"prefixes": "%%%"})
    assert published.match(chain) == {}
    for i in range(10):   # bounded by the sessions it holds
        published.update(f"x{i}", {"prefixes": encode_prefixes(prompt_chain(words(100, 40 + i), KEY))})
    assert len(published.sessions) <= 3 and len(published.where) <= 3 * PREFIX_PUBLISHED


def sent(summary: PrefixSummary, request) -> None:
    """A request forwarded to the node's engine, with the anchors its ingress hashed (PREFIX_HEADER)."""
    summary.add(prefix_anchors(prompt_chain(prompt_text(request), KEY)))


def test_decode_prefixes_refuses_what_is_not_a_summary():
    assert decode_prefixes(None) == {} and decode_prefixes(7) == {} and decode_prefixes("%%%") == {}
    assert decode_prefixes("A" * 10_000) == {}


def test_summary_publishes_shared_prefixes_and_the_latest_ends_and_fits_a_record():
    summary = PrefixSummary()
    systems = [words(400, 10 + g) for g in range(3)]
    for g, system in enumerate(systems):
        for i in range(4):
            sent(summary, chat(system, words(60, 1000 * g + i)))
    for i in range(200):   # one-off prompts after: they do not push the shared ones out
        sent(summary, chat(words(300, 5000 + i), "q"))
    text, ends = summary.published()
    published = PublishedPrefixes(limit=8)
    published.update("s", {"prefixes": text, "prefix_ends": ends})
    assert len(published.sessions["s"][1]) == PREFIX_PUBLISHED and not summary.changed
    assert PREFIX_PUBLISHED // 2 <= ends < PREFIX_PUBLISHED
    for system in systems:
        chain = prompt_chain(prompt_text(chat(system, words(60, 99))), KEY)
        assert published.match(chain)["s"][0] >= 4
    last = prompt_chain(prompt_text(chat(words(300, 5199), "q")), KEY)   # the latest prompt ended here
    assert published.match(last) == {"s": (len(last), True)}
    # the summary leaves room in a record: crdt.MAX_RECORD_BYTES with a worker's usual fields
    record = {"state": crdt.SERVING, "addr": "10.0.0.1:8000", "gossip": "10.0.0.1:7946", "models": ["m"] * 4,
              "labels": {"node": "nid001234", "gpu": "H100"}, "hardware": {"gpu": "NVIDIA H100", "count": 4},
              "owner": "alice@login1", "version": 12345, "load": 17, "prefixes": text, "prefix_ends": ends,
              "seal": "x" * 64, "speed": {"prefill": 12000.0, "decode": 95.0}}
    assert len(crdt.encode(record)) < crdt.MAX_RECORD_BYTES - 500


def test_summary_publishes_where_each_conversation_ended_last():
    """Chats: every turn's end goes first, so another ingress continues each chat where its last
    turn went, not where the chat began."""
    summary = PrefixSummary()
    chats = [[{"role": "user", "content": words(120, 900 + c)}] for c in range(20)]
    for turn in range(3):
        for c, messages in enumerate(chats):
            sent(summary, {"model": "m", "messages": messages})
            messages += [{"role": "assistant", "content": words(120, 5000 + 100 * c + turn)},
                         {"role": "user", "content": words(120, 7000 + 100 * c + turn)}]
    text, ends = summary.published()
    published = PublishedPrefixes(limit=8)
    published.update("s", {"prefixes": text, "prefix_ends": ends})
    for messages in chats:   # the next turn holds the last one whole
        last = prompt_chain(prompt_text({"messages": messages[:-2]}), KEY)
        assert published.match(prompt_chain(prompt_text({"messages": messages}), KEY)) == {"s": (len(last), True)}


def test_cached_of_reads_vllm_and_llama_cpp():
    assert cached_of(b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":7}}}') == 7
    assert cached_of(b'{"timings":{"cache_n": 12,"prompt_n":3}}') == 12
    assert cached_of(b'{"usage":{"prompt_tokens":9}}') is None


def test_speed_fit_learns_base_rate_and_stream_cost_from_answers():
    fit = SpeedFit(weight=3.35)
    rng = random.Random(1)
    for _ in range(300):
        prefill, streams = rng.choice((50, 500, 2000, 4000)), rng.randrange(0, 60)
        fit.learn(prefill, streams, 0.01 + prefill / 20000 + 0.002 * streams)
    base, per_token, per_stream = fit.theta
    assert abs(base - 0.01) < 0.004 and abs(1 / per_token - 20000) < 1000 and abs(per_stream - 0.002) < 2e-4


def test_speed_fit_of_one_size_keeps_the_prior_rate_and_fits_the_level():
    fit = SpeedFit(weight=1.0)
    for _ in range(200):
        fit.learn(1000, 0, 0.5)
    assert abs(fit.predict(1000, 0) - 0.5) < 0.02
    assert 0.2 < fit.theta[1] * 6000 < 5   # the rate stays near the prior's


class Registry(dict):
    pass


def policy_with(sessions, weight_gpu="H100"):
    policy = TTFTPolicy()
    policy.key = KEY
    registry = Registry()
    policy.registry = registry
    candidates = []
    for sid in sessions:
        record = {"state": crdt.SERVING, "addr": f"127.0.0.1:{len(candidates) + 1}", "models": ["m"],
                  "hardware": {"gpu": weight_gpu}}
        registry[sid] = record
        candidates.append(Candidate(sid, record))
    return policy, registry, candidates


def routed(body):
    return RoutedRequest("m", "u", "k", True, "/v1/chat/completions", body=body)


def serve(policy, candidates, body, ttft=0.05, cached=None, prompt=None):
    request = routed(body)
    choice = policy.pick(candidates, request)
    policy.on_request_start(choice, request)
    request.first_at = request.memo.started + ttft
    policy.on_first_byte(choice, request)
    request.prompt_tokens, request.completion_tokens = prompt or 600, 20
    request.cached_tokens = cached
    policy.on_request_end(choice, request, True)
    return choice


def test_a_group_stays_on_one_engine_and_new_groups_spread():
    policy, _, candidates = policy_with([f"s{i}" for i in range(4)])
    systems = [words(500, 20 + g) for g in range(8)]
    homes = {}
    for round_ in range(3):
        for g, system in enumerate(systems):
            choice = serve(policy, candidates, chat(system, words(30, 100 * g + round_)))
            homes.setdefault(g, set()).add(choice.session)
    assert all(len(h) == 1 for h in homes.values())
    assert len({next(iter(h)) for h in homes.values()}) >= 3   # not all on one


def test_two_policies_that_share_nothing_send_a_new_prefix_to_the_same_engine():
    sessions = [f"s{i}" for i in range(8)]
    a, _, ca = policy_with(sessions)
    b, _, cb = policy_with(sessions)
    for g in range(16):
        body = chat(words(500, 300 + g), "q")
        assert a.pick(ca, routed(body)).session == b.pick(cb, routed(body)).session


def test_a_hot_prefix_spreads_when_its_queue_grows():
    policy, _, candidates = policy_with(["s0", "s1", "s2"])
    system = words(2000, 7)
    used = []
    for i in range(30):   # all outstanding, none answered yet: each question's prefill queues
        request = routed(chat(system, words(400, i)))
        choice = policy.pick(candidates, request)
        policy.on_request_start(choice, request)
        used.append(choice.session)
    assert len(set(used)) >= 2 and used[0] == used[1]


def test_published_prefixes_and_load_of_other_ingresses_count():
    policy, registry, candidates = policy_with(["s0", "s1"])
    body = chat(words(1000, 8), "question")
    chain = prompt_chain(prompt_text(body), KEY)
    home = "s1" if policy.pick(candidates, routed(body)).session == "s0" else "s0"
    registry[home] = dict(registry[home], prefixes=encode_prefixes(prefix_anchors(chain)))
    assert policy.pick(candidates, routed(body)).session == home
    registry[home] = dict(registry[home], load=400)   # another ingress keeps it busy
    assert policy.pick(candidates, routed(body)).session != home


def test_trust_falls_when_answers_show_the_cache_was_evicted():
    policy, _, candidates = policy_with(["s0"])
    system = words(1000, 9)
    serve(policy, candidates, chat(system, "a"))
    for i in range(20):
        serve(policy, candidates, chat(system, words(5, i)), cached=0, prompt=1100)
    assert policy.engines["s0"].trust < 0.3
    stats = policy.stats()["s0"]
    assert stats["cache_hit_rate"] == 0.0 and stats["outstanding"] == 0


def test_a_failed_attempt_releases_its_queue():
    policy, _, candidates = policy_with(["s0", "s1"])
    request = routed(chat(words(800, 11), "x"))
    choice = policy.pick(candidates, request)
    policy.on_request_start(choice, request)
    assert policy.engines[choice.session].queued > 0
    policy.on_request_end(choice, request, False)
    assert policy.engines[choice.session].queued == 0 and policy.engines[choice.session].outstanding == 0


def test_ttft_is_a_built_in_policy_and_ingests_bodies_without_one():
    assert isinstance(otela_ingress.load_policy("ttft"), TTFTPolicy)
    policy, _, candidates = policy_with(["s0", "s1"])
    request = RoutedRequest("m", "u", "k", False, "/v1/completions")   # no body: no chain
    assert policy.pick(candidates, request) in candidates


def test_engine_speed_reads_streamed_answers_and_publishes_only_real_changes():
    speed = otela_node.EngineSpeed()
    assert speed.changed() is None
    tail = (b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,'
            b'"prompt_tokens_details":{"cached_tokens":%d}}}\n\ndata: [DONE]\n\n')
    rng = random.Random(2)
    for _ in range(40):
        prompt, cached = rng.choice((200, 2000, 4000)), rng.choice((0, 100))
        watch = otela_node.EngineSpeed.watch()
        sent = time.monotonic() - 0.5
        watch.seen(b"data: {}\n\n")
        watch.first_at = sent + 0.01 + (prompt - cached) / 10000
        watch.seen(tail % (prompt, 21, cached))
        speed.answered(watch, sent, others=0)
    view = speed.changed()
    assert view is not None and 5000 < view["prefill"] < 20000 and view["decode"] > 0
    assert speed.changed() is None   # nothing moved since
    empty = otela_node.EngineSpeed.watch()
    empty.seen(b"no usage here")
    speed.answered(empty, time.monotonic(), 0)   # teaches nothing, breaks nothing
    assert speed.answers == 40


def test_a_conversation_stays_on_its_engine_while_others_are_as_busy():
    policy, _, candidates = policy_with([f"s{i}" for i in range(4)])
    chats = [[{"role": "user", "content": words(120, 900 + c)}] for c in range(12)]
    homes = {}
    for turn in range(4):
        for c, messages in enumerate(chats):
            body = {"model": "m", "messages": list(messages)}
            request = routed(body)
            choice = policy.pick(candidates, request)
            policy.on_request_start(choice, request)   # left in flight: the engines stay busy
            homes.setdefault(c, []).append(choice.session)
            messages += [{"role": "assistant", "content": words(120, 5000 + 100 * c + turn)},
                         {"role": "user", "content": words(120, 7000 + 100 * c + turn)}]
    assert sum(len(set(h)) == 1 for h in homes.values()) >= 10
    # a long conversation's bonus makes its home's score negative: still one near the best
    long_chat = [{"role": "user", "content": words(3000, 77)}]
    serve(policy, candidates, {"model": "m", "messages": long_chat})
    long_chat.append({"role": "user", "content": "more"})
    assert policy.pick(candidates, routed({"model": "m", "messages": long_chat})) in candidates
    assert len({h[0] for h in homes.values()}) == 4   # new chats spread


def test_a_workers_published_view_alone_keeps_the_ingress_candidates():
    """load, prefixes and speed change every few seconds: the candidate cache stays (the policy
    reads them from the registry); any other change (its models) rebuilds it."""
    from test_ingress_support import StandInNode
    node = StandInNode()
    ingress = otela_ingress.Ingress(node, db_path=":memory:", no_auth=True)
    sid = node.add_worker("127.0.0.1:9", ["m"])
    key = otela_ingress.ANONYMOUS
    first = ingress.candidates("m", key)
    record = dict(node.registry.get(sid))
    for field, value in (("load", 3), ("prefixes", encode_prefixes([b"x" * 8])), ("speed", {"prefill": 9e3, "decode": 40.0})):
        # (each of its writes is bound anew: the binding changes with them)
        record = crdt.bound(b"k" * 32, sid, dict(record, version=record["version"] + 1, **{field: value}))
        node.registry.put(sid, record)
        node._changed(sid)
        assert ingress.candidates("m", key) is first
    node.registry.put(sid, dict(record, version=record["version"] + 1, models=["m", "n"]))
    node._changed(sid)
    assert ingress.candidates("m", key) is not first


def test_a_conversation_continues_where_another_ingress_sent_its_last_turn():
    """Two ingresses alternate a chat's turns: this one sent turn 1 to one engine, the other sent
    turn 2 to another, whose node publishes that turn's end: turn 3 goes there, not back."""
    policy, registry, candidates = policy_with([f"s{i}" for i in range(4)])
    messages = [{"role": "user", "content": words(120, 31)}]
    first = serve(policy, candidates, {"model": "m", "messages": list(messages)})
    messages += [{"role": "assistant", "content": words(120, 32)}, {"role": "user", "content": words(120, 33)}]
    there = next(c.session for c in candidates if c.session != first.session)
    summary = PrefixSummary()
    sent(summary, {"model": "m", "messages": list(messages)})   # turn 2, by the other ingress
    text, ends = summary.published()
    registry[there] = dict(registry[there], prefixes=text, prefix_ends=ends, load=1)
    messages += [{"role": "assistant", "content": words(120, 34)}, {"role": "user", "content": words(120, 35)}]
    assert policy.pick(candidates, routed({"model": "m", "messages": messages})).session == there


def test_other_ingresses_requests_weigh_as_this_ingresss_do():
    """An engine busy with another ingress's requests (its node's load) and one as busy with this
    ingress's are the same work: neither looks cheaper (two ingresses piled onto the engines that
    looked cheaper to each)."""
    policy, registry, candidates = policy_with(["s0", "s1"])
    for i in range(10):   # 10 of ours in flight at s1, 4 of them still waiting for a first byte
        request = routed(chat(words(200, 50 + i), "q"))
        policy.on_request_start(candidates[1], request)
        if i >= 4:
            policy.on_first_byte(candidates[1], request)
    registry["s0"] = dict(registry["s0"], load=10)   # and 10 of another ingress's at s0
    s0, s1 = policy.estimates(candidates, routed(chat(words(200, 99), "q")))
    assert abs(s0[1] - s1[1]) < 1e-6 * s1[1] and s0[5] == s1[5] == 10


def test_a_worker_over_the_record_bound_publishes_fewer_prefixes_and_ends_among_them():
    import asyncio

    summary = PrefixSummary()
    for i in range(100):
        sent(summary, chat(words(300, 700 + i), "q"))

    class Worker:   # what publish_engine_view reads of a Node; its record takes 20 hashes at most
        overlay = type("Overlay", (), {"record": {"state": crdt.SERVING}})()
        prefixes, speed, inflight, draining = summary, None, 0, False
        written = []

        def update(self, **fields):
            if len(decode_prefixes(fields.get("prefixes", ""))) > 20:
                raise crdt.RecordError("over")
            self.written.append(fields)

    async def run():
        task = asyncio.ensure_future(otela_node.publish_engine_view(Worker(), every=0.01))
        await asyncio.sleep(0.1)
        task.cancel()
    asyncio.run(run())
    fields = Worker.written[0]
    assert 0 < len(decode_prefixes(fields["prefixes"])) <= 20
    assert 0 < fields["prefix_ends"] <= len(decode_prefixes(fields["prefixes"]))


def test_a_job_that_knows_a_system_prompt_cannot_claim_it_with_the_cluster_key():
    """A compute job publishes the anchors of an application's system prompt, hashed as it can
    (under the cluster key): the ingress hashes under the ingress tier's secret, so the claim
    matches nothing and the application's requests go where they would without it. (Hashed under
    the ingress's own key, as before this release, the same claim draws every one of them.)"""
    system = words(400, 77)
    requests = [chat(system, words(20, 100 + i)) for i in range(30)]

    def run(claim_key):
        policy, registry, candidates = policy_with([f"s{i}" for i in range(3)])
        if claim_key is not None:
            forged = PrefixSummary()
            for i in range(20):
                forged.add(prefix_anchors(prompt_chain(prompt_text(chat(system, words(20, i))), claim_key)))
            text, ends = forged.published()
            registry["s0"] = dict(registry["s0"], prefixes=text, prefix_ends=ends)
        return [serve(policy, candidates, body).session for body in requests]
    baseline = run(None)
    assert baseline.count("s0") == 0
    assert run(prefix_key(b"c" * 32)) == baseline       # what any holder of cluster.key derives
    assert run(KEY).count("s0") == 30                   # the ingress's own key: the claim would win


# -- affinity that needs no news (issue 44) ------------------------------------------------------
def agent_turns(seed, turns=4, key=None, system=None):
    """The bodies of one tool-calling loop's turns: each the conversation so far, the tool's
    output appended (and `prompt_cache_key` when given); its own system prompt unless given."""
    messages = [{"role": "system", "content": system or words(600, seed + 1)},
                {"role": "user", "content": words(80, seed)}]
    out = []
    for turn in range(turns):
        out.append(dict({"model": "m", "messages": list(messages)}, **({"prompt_cache_key": key} if key else {})))
        messages += [{"role": "assistant", "content": words(40, seed * 100 + turn)},
                     {"role": "tool", "content": words(200 + 150 * turn, seed * 1000 + turn)}]
    return out


def test_two_ingresses_that_never_spoke_send_each_turn_of_a_conversation_to_the_same_engine():
    """Turns alternate between two policies that share nothing (no index, no published view):
    every turn of every conversation meets the same engine at both, and the conversations spread."""
    sessions = [f"s{i}" for i in range(4)]
    a, _, ca = policy_with(sessions)
    b, _, cb = policy_with(sessions)
    homes = []
    for c in range(16):
        turns = agent_turns(10 + c)
        chosen = [serve(*((a, ca) if t % 2 == 0 else (b, cb)), body).session for t, body in enumerate(turns)]
        assert len(set(chosen)) == 1, (c, chosen)
        homes.append(chosen[0])
    assert len(set(homes)) >= 3


def test_a_prompt_cache_key_holds_a_conversation_from_its_first_turn_even_where_its_system_prompt_is_not():
    """Every turn, the first too, at either ingress, goes to the key's engine: its rendezvous
    choice, not the engine that already holds the app's shared system prompt."""
    sessions = [f"s{i}" for i in range(4)]
    a, _, ca = policy_with(sessions)
    b, _, cb = policy_with(sessions)
    system = words(600, 3)
    for c in range(12):
        turns = agent_turns(50 + c, turns=5, key=f"conv-{c}", system=system)
        chosen = [serve(*((a, ca) if t % 2 == 0 else (b, cb)), body).session for t, body in enumerate(turns)]
        home = sessions[otela_ingress.rendezvous(b"kconv-%d" % c, [s.encode() for s in sessions])]
        assert chosen == [home] * 5, (c, chosen)


def test_keyed_loops_of_one_app_spread_over_the_engines_rather_than_pile_onto_its_system_prompt():
    """24 agent loops of 4 apps open one after another (their first turns, each app's system
    prompt cached after its first): each goes to its key's engine, so no engine opens more of
    them than hashing gives; unkeyed, the same openings follow the cached system prompt."""
    sessions = [f"s{i}" for i in range(8)]
    systems = [words(1500, 900 + app) for app in range(4)]

    def opened(keyed):
        policy, _, candidates = policy_with(sessions)
        counts = {}
        for loop in range(24):
            body = agent_turns(700 + loop, turns=1, key=f"agent-{loop}" if keyed else None,
                               system=systems[loop % 4])[0]
            session = serve(policy, candidates, body).session
            counts[session] = counts.get(session, 0) + 1
        return counts
    keyed = opened(True)
    hashed = {}
    for loop in range(24):
        home = sessions[otela_ingress.rendezvous(b"kagent-%d" % loop, [s.encode() for s in sessions])]
        hashed[home] = hashed.get(home, 0) + 1
    assert keyed == hashed and len(keyed) >= 6
    assert len(opened(False)) <= 4   # the shared system prompt draws them: what a key is for


def test_an_opening_keeps_its_keys_engine_within_the_margin_of_its_whole_prompt():
    """A key's first request on a system prompt another key brought first goes to the key's
    engine while the queue there and the prompt's own prefill are within AFFINITY_TIE of the
    best engine's: a few requests more queued there than elsewhere do not send it away (the
    next turn's ingress would not know where it went); a full engine does."""
    sessions = [f"s{i}" for i in range(4)]
    for k in range(4):
        key = f"conv-{k}"
        home = sessions[otela_ingress.rendezvous(b"k" + key.encode(), [s.encode() for s in sessions])]
        system = words(600, 300 + k)
        opening = agent_turns(300 + k, turns=1, key=key, system=system)[0]
        for load, stays in ((3, True), (200, False)):
            policy, registry, candidates = policy_with(sessions)
            serve(policy, candidates, agent_turns(400 + k, turns=1, key=f"other-{k}", system=system)[0])
            registry[home] = dict(registry[home], load=load)   # another ingress's requests there
            assert (policy.pick(candidates, routed(opening)).session == home) == stays, (k, load)


def test_a_keys_later_one_shot_prompts_are_scored_as_unkeyed_ones_are():
    """Only a key's first request here opens a conversation at the key's engine; the key's
    later prompts with no earlier turns (a group of one-shot prompts under one key) go where
    their prefix is held, as unkeyed ones do, and to the key's engine on a tie only."""
    sessions = [f"s{i}" for i in range(4)]
    for k in range(6):
        policy, _, candidates = policy_with(sessions)
        system = words(1500, 600 + k)
        held = serve(policy, candidates, chat(system, words(200, 800 + k))).session
        key = f"app-{k}"
        home = sessions[otela_ingress.rendezvous(b"k" + key.encode(), [s.encode() for s in sessions])]
        if home == held:
            continue
        opening = serve(policy, candidates, dict(chat(words(300, 700 + k), "q1"), prompt_cache_key=key))
        later = serve(policy, candidates, dict(chat(system, words(200, 900 + k)), prompt_cache_key=key))
        assert (opening.session, later.session) == (home, held)


def test_an_opening_is_a_new_key_on_a_first_block_another_key_brought_and_both_are_bounded():
    policy, _, _ = policy_with(["s0", "s1"])
    policy.OPENED_KEYS = 4
    assert not policy._opens(b"k0", b"system")        # the first key on it: its group's own prefix
    assert [policy._opens(b"k%d" % i, b"system") for i in range(1, 6)] == [True] * 5
    assert not policy._opens(b"k5", b"system")        # seen: a later request of the key
    assert len(policy.opened) == 4 and len(policy.openers) == 1
    assert policy._opens(b"k1", b"system")            # the oldest, forgotten: it opens again
    assert not policy._opens(b"k9", b"other") and not policy._opens(b"k9", b"other")
    for i in range(6):
        policy._opens(b"x%d" % i, b"block%d" % i)
    assert len(policy.openers) == 4
    assert not policy._opens(b"o-opening", b"system") and not policy._opens(None, b"system")   # a client's key only


def test_the_affinity_key_is_prompt_cache_key_then_the_session_header_then_the_opening():
    opening = agent_turns(5)
    keyed = routed(dict(opening[2], prompt_cache_key="conv-1"))
    keyed.session_key = b"other"
    assert otela_ingress.affinity_key(keyed) == b"kconv-1"
    header = routed(opening[2])
    header.session_key = b"conv-1"
    assert otela_ingress.affinity_key(header) == b"hconv-1"
    # every turn of a conversation opens alike; another conversation does not; `user` is not a key
    keys = {otela_ingress.affinity_key(routed(dict(body, user="alice"))) for body in opening}
    assert len(keys) == 1 and keys != {otela_ingress.affinity_key(routed(agent_turns(6)[0]))}
    assert otela_ingress.affinity_key(routed({"model": "m", "prompt": "bare"})) is None


def test_a_prompt_cache_key_sends_unrelated_prompts_to_one_engine_at_two_ingresses():
    sessions = [f"s{i}" for i in range(8)]
    a, _, ca = policy_with(sessions)
    b, _, cb = policy_with(sessions)
    for k in range(8):
        key = f"agent-{k}"
        picks = {p.pick(c, routed(dict(chat(words(300, 40 + i), "q"), prompt_cache_key=key))).session
                 for i, (p, c) in enumerate([(a, ca), (b, cb)] * 3)}
        assert len(picks) == 1


def test_a_conversations_engine_is_left_when_its_queue_is_far_above_the_best():
    sessions = [f"s{i}" for i in range(4)]
    policy, registry, candidates = policy_with(sessions)
    turns = agent_turns(77)
    home = policy.pick(candidates, routed(turns[1])).session
    registry[home] = dict(registry[home], load=200)   # another ingress fills it
    assert policy.pick(candidates, routed(turns[1])).session != home
    registry[home] = dict(registry[home], load=1)     # one request more than the rest: still its engine
    assert policy.pick(candidates, routed(turns[1])).session == home


def test_a_keyed_conversation_that_moved_off_a_full_engine_stays_where_it_went():
    """Its key's engine was full for one turn: that turn went elsewhere, and this ingress knows
    it; the next turn follows it there rather than back to an engine that never saw it."""
    policy, registry, candidates = policy_with([f"s{i}" for i in range(4)])
    turns = agent_turns(91, key="conv-9")
    home = serve(policy, candidates, turns[0])
    registry[home.session] = dict(registry[home.session], load=200)
    moved = serve(policy, candidates, turns[1])
    assert moved.session != home.session
    registry[home.session] = dict(registry[home.session], load=0)
    assert policy.pick(candidates, routed(turns[2])).session == moved.session


def test_a_session_joining_or_leaving_moves_only_its_share_of_conversations():
    """Rendezvous hashing: with N sessions, one joining takes ~1/(N+1) of the keys (and only
    those move), one leaving gives up only its own ~1/N."""
    keys = [b"conv-%d" % i for i in range(4000)]
    sessions = [b"s%d" % i for i in range(8)]
    before = [sessions[otela_ingress.rendezvous(k, sessions)] for k in keys]
    joined = sessions + [b"s8"]
    after = [joined[otela_ingress.rendezvous(k, joined)] for k in keys]
    moved = [(x, y) for x, y in zip(before, after) if x != y]
    assert all(y == b"s8" for _, y in moved)
    assert abs(len(moved) / len(keys) - 1 / 9) < 0.02        # measured share: 1/(N+1) = 0.111
    left = sessions[1:]
    after = [left[otela_ingress.rendezvous(k, left)] for k in keys]
    moved = [x for x, y in zip(before, after) if x != y]
    assert set(moved) == {b"s0"} and abs(len(moved) / len(keys) - 1 / 8) < 0.02   # 1/N = 0.125


def test_prompt_cache_key_and_the_session_header_reach_the_engine_untouched(stack):
    _, engine = stack.engine("m1")
    from test_ingress_support import Client
    client = Client(stack.url, stack.key())
    try:
        status, _, _ = client.chat(prompt_cache_key="agent-7 ü", user="alice",
                                   headers={"x-session-id": "sess-42"})
    finally:
        client.close()
    assert status == 200
    sent = json.loads(engine.last_body)
    assert (sent["prompt_cache_key"], sent["user"]) == ("agent-7 ü", "alice")
    assert engine.last_headers["x-session-id"] == "sess-42"
