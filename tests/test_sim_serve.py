"""Specification of `otela_sim.py serve`, the emulated engine: the prefix cache (hits, LRU
eviction), the scheduler (token budget, chunked prefill, preemption) and its step times, driven
as pure objects with a fake clock; then the server on loopback (streaming, usage, metrics,
errors), and the server wrapped as an engine by a real node behind a real ingress."""
import json
import math
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port, stop_process, wait_http
from hypothesis import given, settings
from hypothesis import strategies as st

import crdt
import otela_sim as sim

# --- pure objects: a fake clock, a fixed step cost ----------------------------------------------


class FlatCost:
    """Every step 10 ms: the core's decisions, not its times, are under test."""

    def __init__(self):
        self.calls = []

    def step(self, tokens, seqs, decode_ctx=0.0, prefill_pairs=0.0, prefill_tokens=0):
        self.calls.append((tokens, seqs, decode_ctx, prefill_tokens))
        return 0.01


def words(n, tag="w"):
    """n distinct tokens (the core compares tokens as strings; any string is one token)."""
    return [f" {tag}{i}" for i in range(n)]


def run_until_idle(core, clock=0.0, limit=10000):
    """Schedule and complete steps until nothing is left; the fake clock advances by the step
    times. Returns (clock, steps)."""
    steps = []
    for _ in range(limit):
        step = core.schedule()
        if step is None:
            return clock, steps
        clock += step.seconds
        core.complete(step, clock)
        steps.append(step)
    raise AssertionError("the core never went idle")


def test_the_token_rule_cuts_four_characters_per_piece_with_the_space_before_them():
    assert sim.tokenize("hello there") == ["hell", "o", " ther", "e"]
    assert sim.count_tokens("hello there") == 4
    # prefix-stable: a longer text starts with the tokens of its prefix, but for the last piece
    assert sim.tokenize("hello there, and more")[:3] == sim.tokenize("hello there")[:3]


def test_a_repeated_prompt_finds_its_full_blocks_in_the_prefix_cache():
    core = sim.EngineCore(FlatCost(), num_blocks=100, block_size=16, max_batched_tokens=2048)
    first = sim.EmulatedRequest(1, words(40), max_tokens=4)
    core.add(first)
    run_until_idle(core)
    again = sim.EmulatedRequest(2, words(40), max_tokens=4)
    core.add(again)
    run_until_idle(core)
    assert first.cached_tokens == 0
    assert again.cached_tokens == 32              # 2 full blocks of 16; the 40th token is computed
    assert (core.cache.queries, core.cache.hits) == (80, 32)
    assert again.output_text() == first.output_text() == "".join(sim.output_token(0, i) for i in range(4))


def test_a_prompt_sharing_only_a_prefix_hits_the_shared_blocks_and_no_more():
    core = sim.EngineCore(FlatCost(), num_blocks=100, block_size=16, max_batched_tokens=2048)
    core.add(sim.EmulatedRequest(1, words(48) + words(20, "a"), max_tokens=1))
    run_until_idle(core)
    other = sim.EmulatedRequest(2, words(48) + words(20, "b"), max_tokens=1)
    core.add(other)
    run_until_idle(core)
    assert other.cached_tokens == 48


def test_a_prefix_hit_is_never_handed_out_again_as_a_fresh_block_of_the_same_request():
    core = sim.EngineCore(FlatCost(), num_blocks=6, block_size=4, max_batched_tokens=64)
    core.add(sim.EmulatedRequest("a", words(4, "s") + words(5, "a"), max_tokens=1))
    run_until_idle(core)                                     # blocks 0-2 freed; 0 holds "s"
    other = sim.EmulatedRequest("c", words(11, "c"), max_tokens=3)
    core.add(other)
    core.complete(core.schedule(), 0.0)                      # c holds the 3 never-used blocks
    hit = sim.EmulatedRequest("b", words(4, "s") + words(9, "b"), max_tokens=2)
    core.add(hit)
    core.schedule()          # b would need its hit and 3 fresh blocks: only 2 others are free
    held = [b for r in core.running for b in r.blocks]
    assert len(held) == len(set(held))
    assert hit.state == "waiting" and core.cache.match([hit.block_hash(0, 4)]) != []


def test_the_least_recently_freed_cached_block_is_evicted_first():
    cache = sim.PrefixCache(2, block_size=16)
    a = cache.allocate(1)
    cache.register(a[0], "A")
    cache.release(a)
    b = cache.allocate(1)
    cache.register(b[0], "B")
    cache.release(b)
    assert cache.match(["A"]) == a and cache.match(["B"]) == b
    cache.take(a)                  # a hit on A makes it the most recently used once freed again
    cache.release(a)
    cache.allocate(1)              # the pool is full of cached blocks: B, freed longest ago, goes
    assert cache.match(["B"]) == [] and cache.match(["A"]) == a
    assert cache.evictions == 1
    assert cache.allocate(2) is None            # one block is held: no room for two


def test_a_full_kv_pool_preempts_the_most_recently_admitted_request_which_is_recomputed():
    # 4 blocks of 4 tokens: two requests of 6 prompt + 8 output tokens need 4 blocks each
    core = sim.EngineCore(FlatCost(), num_blocks=4, block_size=4, max_batched_tokens=64)
    older = sim.EmulatedRequest(1, words(6, "o"), max_tokens=8)
    newer = sim.EmulatedRequest(2, words(6, "n"), max_tokens=8)
    core.add(older)
    core.add(newer)
    run_until_idle(core)
    assert core.preemptions >= 1
    assert older.state == newer.state == "finished"
    assert older.finished_at < newer.finished_at
    assert (older.generated, newer.generated) == (8, 8)
    assert core.cache.usage() == 0.0


def test_in_llama_cpp_mode_a_prompt_reuses_only_the_prefix_cached_in_the_slot_it_takes():
    core = sim.EngineCore(FlatCost(), num_blocks=1000, block_size=16, max_batched_tokens=4096, max_num_seqs=2,
                          slots=True)
    for group in ("a", "b"):
        core.add(sim.EmulatedRequest(group, words(100, group) + words(10, group + "1"), max_tokens=2))
        run_until_idle(core)
    # two more of group a at once: one takes a's slot (its 100 shared tokens), the other the
    # idle slot holding b's prompt (nothing shared): one prefix per slot, not shared blocks
    again = sim.EmulatedRequest("a2", words(100, "a") + words(10, "a2"), max_tokens=2)
    third = sim.EmulatedRequest("a3", words(100, "a") + words(10, "a3"), max_tokens=2)
    core.add(again)
    core.add(third)
    run_until_idle(core)
    assert (again.cached_tokens, third.cached_tokens) == (100, 0)
    # a's prefix now lives in both slots: the next one hits whichever it takes
    fourth = sim.EmulatedRequest("a4", words(100, "a") + words(10, "a4"), max_tokens=2)
    core.add(fourth)
    run_until_idle(core)
    assert fourth.cached_tokens == 100
    assert core.cache.usage() == 0.0


def _slot_core(slots=3):
    return sim.EngineCore(FlatCost(), num_blocks=1000, block_size=16, max_batched_tokens=4096, max_num_seqs=slots,
                          slots=True)


def _served(core, rid, tokens):
    req = sim.EmulatedRequest(rid, tokens, max_tokens=1)
    core.add(req)
    run_until_idle(core)
    return req


def test_in_llama_cpp_mode_a_slot_is_chosen_as_llama_server_chooses_it():
    core = _slot_core()
    # never used, all alike: llama-server's LRU scan (t_last_used <= the best so far) takes the last
    first = _served(core, "x", words(40, "x"))
    assert first.cached_tokens == 0 and core.slots[2][0][:40] == words(40, "x")
    # the slots released longest ago next: the two still empty, the last of them first
    _served(core, "y", words(40, "y"))
    _served(core, "z", words(40, "z"))
    assert [s[0][:1] for s in core.slots] == [words(1, "z"), words(1, "y"), words(1, "x")]
    # a prompt whose common prefix with a slot is above 10 % of the prompt takes that slot,
    # however long the slot's own tokens (the share is of the prompt: 30 of 35)
    short = _served(core, "y2", words(30, "y") + words(5, "q"))
    assert short.cached_tokens == 30 and core.slots[1][0][:35] == short.tokens[:35]


def test_in_llama_cpp_mode_a_prefix_of_at_most_a_tenth_of_the_prompt_is_not_a_reason_to_take_a_slot():
    core = _slot_core(2)
    _served(core, "a", words(10, "a") + words(90, "a1"))      # slot 1 (the last never used)
    _served(core, "b", words(60, "b"))                        # slot 0
    # 10 of 100 tokens shared with slot 1: not above 0.1, so the slot released longest ago (1)
    # is taken by age, and its prefix still counts
    edge = _served(core, "e", words(10, "a") + words(90, "e"))
    assert core.slots[1][0][:1] == words(1, "a") and edge.cached_tokens == 10
    # 11 of 100 with slot 1 beats slot 0 (released longest ago now) by similarity
    core.slots[1][0] = words(11, "a") + words(5, "z")
    above = _served(core, "f", words(11, "a") + words(89, "f"))
    assert above.cached_tokens == 11 and core.slots[0][0][:1] == words(1, "b")


def test_in_llama_cpp_mode_equal_prefixes_go_to_the_first_slot():
    core = _slot_core(2)
    _served(core, "a1", words(50, "a") + words(5, "x"))       # slot 1
    _served(core, "b", words(50, "b"))                        # slot 0
    _served(core, "a2", words(50, "a") + words(5, "y"))       # slot 1 again, by similarity
    core.slots[0][0] = words(50, "a") + words(5, "z")         # both now share 50 with group a
    last = _served(core, "a3", words(50, "a") + words(5, "w"))
    assert last.cached_tokens == 50 and core.slots[0][0][50:55] == words(5, "w")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 80), st.integers(1, 12), st.integers(0, 20)),
                min_size=1, max_size=12),
       st.integers(6, 40), st.sampled_from([4, 16]), st.integers(8, 64), st.booleans())
def test_every_request_ends_with_its_tokens_within_budget_and_the_pool_is_whole_again(
        reqs, num_blocks, block_size, budget, slots):
    """Requests (a shared prefix of 0-3 x 8 tokens, their own tokens, tokens out, the step they
    arrive at) on a small pool: whatever preempts and evicts, all finish and all KV returns."""
    core = sim.EngineCore(FlatCost(), num_blocks=num_blocks, block_size=block_size, max_batched_tokens=budget,
                          max_num_seqs=4, slots=slots)
    made = []
    last = max(at for *_, at in reqs)
    for step_no in range(20000):
        for i, (prefix, own, out, at) in enumerate(reqs):
            r = sim.EmulatedRequest(i, words(prefix * 8, "p") + words(own, f"q{i}"), max_tokens=out)
            if at == step_no and r.prompt_len + out <= core.max_model_len:
                core.add(r)
                made.append(r)
        step = core.schedule()
        if step is None and step_no > last:
            break
        if step is not None:
            assert step.tokens <= budget
            core.complete(step, float(step_no))
    assert all(r.state == "finished" and r.generated == r.max_tokens for r in made)
    assert all(0 <= r.cached_tokens <= r.prompt_len - 1 for r in made)
    if not slots:
        assert all(r.cached_tokens % block_size == 0 for r in made)
    assert core.cache.usage() == 0.0 and len(core.cache.free) == num_blocks
    assert sorted(core.cache.free) == list(range(num_blocks))


def test_a_step_stays_within_the_token_budget_and_chunks_a_long_prompt():
    cost = FlatCost()
    core = sim.EngineCore(cost, num_blocks=1000, block_size=16, max_batched_tokens=64)
    long = sim.EmulatedRequest(1, words(200), max_tokens=3)
    core.add(long)
    steps = []
    for _ in range(4):
        step = core.schedule()
        core.complete(step, 0.0)
        steps.append(step.tokens)
    assert steps == [64, 64, 64, 8]
    assert long.generated == 1                   # the first token comes with the last chunk


def test_running_decodes_are_scheduled_before_a_new_prompt_fills_the_rest_of_the_budget():
    cost = FlatCost()
    core = sim.EngineCore(cost, num_blocks=1000, block_size=16, max_batched_tokens=64)
    core.add(sim.EmulatedRequest(1, words(10), max_tokens=5))
    core.complete(core.schedule(), 0.0)          # prefill: request 1 now decodes
    core.add(sim.EmulatedRequest(2, words(200, "x"), max_tokens=5))
    step = core.schedule()
    assert [(r.id, n) for r, n in step.items] == [(1, 1), (2, 63)]
    assert step.decodes == 1


def test_no_more_requests_run_than_max_num_seqs():
    core = sim.EngineCore(FlatCost(), num_blocks=1000, block_size=16, max_batched_tokens=4096, max_num_seqs=3)
    for i in range(5):
        core.add(sim.EmulatedRequest(i, words(20, f"r{i}"), max_tokens=4))
    core.complete(core.schedule(), 0.0)
    assert (len(core.running), len(core.waiting)) == (3, 2)


def test_a_request_longer_than_the_model_is_refused():
    core = sim.EngineCore(FlatCost(), num_blocks=10, block_size=16, max_model_len=100)
    with pytest.raises(sim.SimError, match="maximum context length is 100"):
        core.add(sim.EmulatedRequest(1, words(90), max_tokens=20))


def test_the_step_times_of_a_static_batch_are_the_estimate_of_the_same_batch():
    core = sim.serve_core("llama-3.1-8b", "H100", engine="vllm-v1")
    for i in range(4):
        core.add(sim.EmulatedRequest(i, words(512, f"b{i}"), max_tokens=64))
    clock, steps = run_until_idle(core)
    e = sim.estimate("llama-3.1-8b", "H100", 1, 4, 512, 64, engine="vllm-v1")
    assert steps[0].seconds * 1e3 == pytest.approx(e["ttft_ms"], rel=1e-9)
    decode = [s.seconds for s in steps[1:]]
    assert len(decode) == 63
    assert sum(decode) / len(decode) * 1e3 == pytest.approx(e["decode_ms_per_token"], rel=1e-9)
    assert clock * 1e3 == pytest.approx(e["e2e_ms"], rel=1e-9)



@pytest.mark.parametrize("cost", [sim.serve_core("llama-3.1-8b", "H100", engine="vllm-v1").cost,
                                  sim.LinearStepCost(0.002, 0.0007, 0.0009, 3e-7, 8e-9, 0.07)])
def test_a_decode_step_is_timed_by_the_per_batch_constant_and_beta_as_the_full_step_cost_would(cost):
    core = sim.EngineCore(cost, 4096)
    for i in range(3):
        core.add(sim.EmulatedRequest(i, words(100 + 7 * i, f"d{i}"), max_tokens=5))
    core.complete(core.schedule(), 0.0)        # the prefill
    step = core.schedule()
    assert step.decodes == 3 and core.decode_alpha is not None
    assert step.seconds == pytest.approx(cost.step(3, 3, 3 * 101 + 7 + 14, 0.0, 0), rel=1e-12)


def test_in_llama_cpp_mode_a_step_holding_a_prefix_hit_and_a_decode_costs_both_as_one_batch():
    # llama-server decodes every slot's tokens in one batch: a hit's 22 new tokens after 136 cached
    # and another slot's decode token are one step, each term of the profile counted once
    cost = sim.LinearStepCost(overhead=0.002, per_token=0.006, per_seq=0.0004, per_ctx=2e-6, per_pair=4e-6,
                              prefill_overhead=0.01)
    core = sim.EngineCore(cost, 1000, max_batched_tokens=2048, max_num_seqs=2, slots=True)
    core.add(sim.EmulatedRequest("a", words(136, "s") + words(10, "a"), max_tokens=1))
    run_until_idle(core)                           # slot 1 now holds the 136 shared tokens
    decoding = sim.EmulatedRequest("d", words(50, "d"), max_tokens=8)
    core.add(decoding)
    core.complete(core.schedule(), 0.0)            # its prefill; it decodes from now on
    core.add(sim.EmulatedRequest("hit", words(136, "s") + words(22, "h"), max_tokens=8))
    step = core.schedule()
    assert [(r.id, n) for r, n in step.items] == [("d", 1), ("hit", 22)]
    pairs = 22 * (136 + 23 / 2)
    assert step.seconds == pytest.approx(cost.overhead + cost.per_token * 23 + cost.per_seq * 2 + cost.per_ctx * 51
                                         + cost.per_pair * pairs + cost.prefill_overhead, rel=1e-12)


def test_the_chat_template_costs_what_llama_servers_chatml_costs_in_tokens():
    # measured on llama.cpp's server with SmolLM2 (/apply-template, /tokenize): "<|im_start|>",
    # role, "\n" per message; "<|im_end|>", "\n" after it; "<|im_start|>", "ass", "istant", "\n"
    system = {"role": "system", "content": " was down come or so"}
    user = {"role": "user", "content": " one back long it"}
    assert sim.count_tokens(sim.chat_prompt([system, user])) == 23
    first = sim.tokenize(sim.chat_prompt([system, user]))
    second = sim.tokenize(sim.chat_prompt([system, {"role": "user", "content": " the time day year"}]))
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert (shared, len(second) - shared) == (13, 10)      # llama.cpp's cache_n and prompt_n of the hit


def test_the_kv_pool_is_what_the_gpu_leaves_after_weights_and_activations():
    core = sim.serve_core("llama-3.1-8b", "H100")
    c = sim._cost_for(sim.resolve_model("llama-3.1-8b"), sim.resolve_gpu("H100"), 1, None, "vllm-v1")
    assert core.max_batched_tokens == 8192                  # vLLM V1's default on an 80 GB GPU
    assert core.cache.num_blocks == c.kv_capacity_tokens(8192) // 16
    assert 20000 < core.cache.num_blocks < 30000            # ~400k tokens of 128 KiB each in ~53 GB


def test_a_step_profile_fitted_on_measurements_recovers_the_terms_that_made_them():
    truth = sim.LinearStepCost(overhead=0.004, per_token=0.002, per_seq=0.001, per_pair=1e-5, prefill_overhead=0.03)
    prefill = []
    for new, cached in ((32, 0), (128, 0), (384, 0), (32, 384), (96, 128)):
        pairs = new * (cached + (new + 1) / 2)
        prefill.append((new, pairs, truth.step(new, 1, 0.0, pairs, new)))
    decode = {b: truth.step(b, b) for b in (1, 4)}
    fitted = sim.LinearStepCost.fit(prefill, decode)
    for name in ("overhead", "per_token", "per_seq", "per_pair", "prefill_overhead"):
        assert fitted[name] == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name


def test_a_step_profile_whose_batch_2_decode_costs_over_twice_batch_1_keeps_a_lone_decode_exact():
    # llama.cpp's server: 13.0 ms at batch 1, 29.6 at batch 2 (each slot a forward pass of its
    # own, plus the box's noise): no negative overhead, and batch 1 as measured
    prefill = [(n, n * (n + 1) / 2, 0.02 + 0.005 * n) for n in (32, 128, 384)]
    fitted = sim.LinearStepCost.fit(prefill, {1: 0.013, 2: 0.0296})
    cost = sim.LinearStepCost.from_profile(fitted)
    assert fitted["overhead"] == 0.0
    assert cost.decode_alpha(1) == pytest.approx(0.013, rel=1e-9)
    assert cost.decode_alpha(2) == pytest.approx(0.026, rel=1e-9)


def test_the_workload_presets_have_the_reuse_the_trace_reports():
    import workload
    assert workload.reusable_share(workload.preset("reasoning")) == pytest.approx(0.90, abs=0.02)
    assert workload.reusable_share(workload.preset("instruct")) == pytest.approx(0.15, abs=0.02)
    chat = workload.preset("chat", conversations=2, turns=3)
    # turn k of a conversation starts with every message of turn k - 1
    first, second = [r["messages"] for r in chat if r["group"] == 0][:2]
    assert second[:len(first)] == first and len(second) == len(first) + 2


# --- the server on loopback ------------------------------------------------------------------------

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def request_log(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(request_log):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "otela_sim.py"), "serve", "--model", MODEL, "--gpu", "H100",
                             "--port", str(port), "--request-log", str(request_log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=30, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 5)


def http(url, method="GET", path="/", body=None, raw=None):
    import http.client
    host, port = url.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        conn.request(method, path, data, {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def chat(content, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def metric(url, name):
    text = http(url, path="/metrics")[1].decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def test_a_second_identical_chat_reports_its_cached_prompt_tokens_in_usage(server):
    prompt = " ".join(f"q{i:03d}" for i in range(100))
    status, body = http(server, "POST", "/v1/chat/completions", chat(prompt, max_tokens=4))
    first = json.loads(body)
    status2, body2 = http(server, "POST", "/v1/chat/completions", chat(prompt, max_tokens=4))
    second = json.loads(body2)
    assert (status, status2) == (200, 200)
    n = first["usage"]["prompt_tokens"]
    assert n == sim.count_tokens(sim.chat_prompt([{"role": "user", "content": prompt}]))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert second["usage"]["completion_tokens"] == 4
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert second["choices"][0]["finish_reason"] == "length"


def test_a_continued_answer_goes_on_with_the_text_of_the_answer_never_cut(server):
    whole = json.loads(http(server, "POST", "/v1/chat/completions", chat("go on", max_tokens=12))[1])
    text = whole["choices"][0]["message"]["content"]
    start = "".join(sim.tokenize(text)[:5])
    body = {"model": MODEL, "max_tokens": 7, "continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "go on"}, {"role": "assistant", "content": start}]}
    rest = json.loads(http(server, "POST", "/v1/chat/completions", body)[1])
    assert start + rest["choices"][0]["message"]["content"] == text
    assert rest["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + 5   # the start is prompt


def test_a_stream_sends_one_event_per_token_then_usage_then_done(server):
    status, body = http(server, "POST", "/v1/chat/completions",
                        chat("tell me", max_tokens=6, stream=True, stream_options={"include_usage": True}))
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]
               and c["choices"][0]["delta"].get("content")]
    assert len(content) == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_the_request_log_has_a_line_per_request_with_its_engine_side_times_and_tokens(server, request_log):
    prompt = " ".join(f"r{i:03d}" for i in range(60))
    whole = json.loads(http(server, "POST", "/v1/chat/completions", chat(prompt, max_tokens=5))[1])
    status, body = http(server, "POST", "/v1/chat/completions",
                        chat(prompt, max_tokens=9, stream=True, stream_options={"include_usage": True}))
    chunks = [json.loads(line[6:]) for line in body.decode().split("\n")
              if line.startswith("data: ") and line[6:] != "[DONE]"]
    assert status == 200 and whole["id"] != chunks[0]["id"]
    lines = {e["id"]: e for e in map(json.loads, request_log.read_text().splitlines())}
    for answer, usage in ((whole, whole["usage"]), (chunks[0], chunks[-1]["usage"])):
        e = lines[answer["id"]]             # ids are unique, as vLLM's are: a client can find its line
        assert e["state"] == "finished" and 0 < e["ttft_ms"] <= e["e2e_ms"]
        assert (e["prompt_tokens"], e["cached_tokens"], e["completion_tokens"]) == \
            (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"])


def test_a_request_log_that_cannot_be_opened_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "otela_sim.py"), "serve", "--model", MODEL, "--port", "0",
                           "--request-log", str(tmp_path / "no" / "such" / "dir.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--request-log" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_text_completion_counts_its_prompt_by_the_token_rule(server):
    status, body = http(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "abcdefgh ij", "max_tokens": 2})
    answer = json.loads(body)
    assert status == 200 and answer["object"] == "text_completion"
    assert answer["usage"]["prompt_tokens"] == 3          # "abcd", "efgh", " ij"
    assert sim.count_tokens(answer["choices"][0]["text"]) == 2


def test_metrics_show_a_running_request_and_the_kv_it_holds(server):
    import threading
    done = []
    t = threading.Thread(target=lambda: done.append(http(server, "POST", "/v1/chat/completions",
                                                         chat("long one " * 50, max_tokens=300))))
    t.start()
    try:
        deadline = time.monotonic() + 5
        while metric(server, "vllm:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metric(server, "vllm:num_requests_running") == 1
        assert metric(server, "vllm:num_requests_waiting") == 0
        assert 0 < metric(server, "vllm:kv_cache_usage_perc") < 0.01
        assert metric(server, "vllm:gpu_cache_usage_perc") == metric(server, "vllm:kv_cache_usage_perc")
    finally:
        t.join(30)
    assert done and done[0][0] == 200
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:prefix_cache_queries_total") >= metric(server, "vllm:prefix_cache_hits_total")


def test_an_arrival_while_decode_steps_are_slept_through_joins_at_the_next_step(server):
    import threading
    done = []

    def send_long():
        answer = http(server, "POST", "/v1/chat/completions", chat("one long answer", max_tokens=200))
        done.append((time.monotonic(), answer))
    long = threading.Thread(target=send_long)
    t0 = time.monotonic()
    long.start()
    try:
        time.sleep(0.3)                  # the long request's decode steps are slept through now
        t1 = time.monotonic()
        status, body = http(server, "POST", "/v1/chat/completions", chat("short", max_tokens=2, stream=True))
        short = time.monotonic() - t1
    finally:
        long.join(30)
    e = sim.estimate(MODEL, "H100", 1, 1, 10, 200, engine="vllm-v1")
    assert status == 200 and body.decode().rstrip().endswith("data: [DONE]")
    assert short < 0.1                   # three ~7 ms steps, not the ~1 s left of the long request
    assert done[0][1][0] == 200
    # no step lost to the arrival; the last wake is armed early by the lateness measured (at most
    # TIMER_LATE_CAP_S), so the answer may leave that much before the modelled end
    assert e["e2e_ms"] / 1e3 - sim.TIMER_LATE_CAP_S <= done[0][0] - t0 < e["e2e_ms"] / 1e3 * 1.25


def test_a_stream_whose_client_leaves_is_aborted_and_its_kv_freed(server):
    import socket
    host, port = server.rsplit("/", 1)[-1].split(":")
    body = json.dumps(chat("leave early", max_tokens=2000, stream=True)).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: " not in got:
            got += sock.recv(65536)
        assert metric(server, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 5
    while metric(server, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("body,status,kind", [
    ("{not json", 400, "invalid_request_error"),
    (json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}), 404, "NotFoundError"),
    (json.dumps({"model": MODEL, "messages": []}), 400, "invalid_request_error"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), 400,
     "invalid_request_error"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 7}), 400,
     "invalid_request_error"),
])
def test_a_bad_request_gets_an_openai_error_body_and_status(server, body, status, kind):
    got, raw = http(server, "POST", "/v1/chat/completions", raw=body)
    error = json.loads(raw)["error"]
    assert got == status and error["type"] == kind and error["message"]


def test_the_model_list_and_health_answer(server):
    status, body = http(server, path="/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [MODEL]
    assert http(server, path="/health")[0] == 200
    assert http(server, path="/nope")[0] == 404




class LateLoop:
    """The loop's clock and timers as the step timer uses them; the test fires each timer as
    late as it likes."""

    def __init__(self):
        self.now, self.due = 0.0, None

    def time(self):
        return self.now

    def call_at(self, when, callback):
        self.due = (when, callback)
        return self

    def call_later(self, delay, callback):
        return self.call_at(self.now + delay, callback)

    def cancel(self):
        self.due = None

    def fire(self, late):
        when, callback = self.due
        self.now = max(self.now, when + late)
        self.due = None
        callback()


def test_the_step_timer_is_armed_early_by_the_lateness_its_wakes_measured_and_a_stall_barely_moves_it():
    server = sim.EmulatedServer(sim.EngineCore(FlatCost(), 4096), "m")
    server.loop, server.tick = LateLoop(), 0.0     # a clock of its own: no whole-ms sleeps to snap to
    req = sim.EmulatedRequest(1, words(40), 200)
    written = []
    req.sink = lambda upto=None: written.append(req.generated if upto is None else upto) or True
    server._submit(req)
    server.loop.fire(0.0)                      # the admission window
    for _ in range(120):
        server.loop.fire(0.0017)               # every wake 1.7 ms after it was due
    assert server.early == pytest.approx(0.0017, abs=2e-5)
    assert server.loop.due[0] == pytest.approx(server.ends[server.at] - server.early)
    before = server.early
    server.loop.fire(0.050)                    # a stalled box: 50 ms late once
    assert server.early - before <= (sim.TIMER_LATE_CAP_S - before) * sim.TIMER_LATE_WEIGHT + 1e-12
    # a stream: one wake per step, one token per wake (the first: the prefill's)
    assert written == list(range(1, 120 + 2))


def test_the_step_timer_is_snapped_to_the_whole_milliseconds_the_selector_sleeps():
    """The selector sleeps whole ms rounded up (13 for a timer 12.5 ms out), under EpollSelector one
    more where k * 1e-3 s is a hair above k ms (14 for those 13): the timer is due half a ms under
    the sleep nearest the wake wanted, of the sleeps the selector takes."""
    def sleeps(now, wake):                     # what the selector sleeps for the due time
        return sim.selector_sleep_ms(math.ceil(round((sim.timer_due(now, wake, 1e-3) - now) * 1e3, 9)))
    for want in (0.0, 0.3, 6.77, 11.4, 11.6, 15.47):
        assert abs(sleeps(10.0, 10.0 + want * 1e-3) - want) <= 0.5
    epoll = sim.selector_sleep_ms(13) == 14
    assert sleeps(10.0, 10.0 + 12.6e-3) == (12 if epoll else 13)     # 13 is no sleep epoll takes
    assert sim.timer_due(10.0, 10.0123, 0.0) == 10.0123                 # no ticks: the wake itself


def test_a_run_without_streams_wakes_once_at_its_end():
    server = sim.EmulatedServer(sim.EngineCore(FlatCost(), 4096), "m")
    server.loop, server.tick = LateLoop(), 0.0     # a clock of its own: no whole-ms sleeps to snap to
    req = sim.EmulatedRequest(1, words(40), 200)
    server._submit(req)
    wakes = 0
    while server.loop.due:
        server.loop.fire(0.0)
        wakes += 1
    assert req.state == "finished" and req.generated == 200
    assert wakes == 2          # the admission window, then one run: the prefill and 199 decodes
    assert server.step_end == pytest.approx(200 * 0.01)     # 200 steps of 10 ms, back to back


def _timed_tokens(core, requests, joins):
    """When each token (request id, i-th generated) is made, the core driven one step at a time
    on a fake clock; a request in `joins` {arrival: request} joins at the first step boundary
    after its arrival, as the server's step timer admits it."""
    for req in requests:
        core.add(req)
    clock, made = 0.0, {}
    while True:
        for at in [a for a in joins if a < clock]:
            core.add(joins.pop(at))
        step = core.schedule()
        if step is None:
            return made
        clock += step.seconds
        for req in core.complete(step, clock):
            made[req.id, req.generated] = clock


def test_tokens_planned_ahead_reach_each_stream_at_the_end_of_their_own_step():
    def requests():
        return [sim.EmulatedRequest(1, words(100, "a"), 40), sim.EmulatedRequest(2, words(300, "b"), 70),
                sim.EmulatedRequest(3, words(50, "c"), 10)]
    late = requests()
    want = _timed_tokens(sim.serve_core(MODEL, "H100", engine="vllm-v1"), late[:2], {0.15: late[2]})

    server = sim.EmulatedServer(sim.serve_core(MODEL, "H100", engine="vllm-v1"), "m")
    server.loop, server.tick = LateLoop(), 0.0     # a clock of its own: no whole-ms sleeps to snap to
    planned = []
    schedule = server.core.schedule
    server.core.schedule = lambda: planned.append(1) or schedule()
    reqs = requests()
    got = _stamp_tokens(server, reqs)
    server._submit(reqs[0])
    server._submit(reqs[1])
    server.loop.fire(0.0)                      # the admission window
    while server.loop.due[0] + server.early < 0.15:
        server.loop.fire(server.early)         # each wake exactly at the end it was armed for
    server.loop.now = 0.15                     # an arrival in the middle of a run
    assert len(server.ends) > server.at + 1
    server._submit(reqs[2])
    while server.loop.due:
        server.loop.fire(server.early)
    assert got.keys() == want.keys() and len(got) == 40 + 70 + 10
    assert [k for k in want if got[k] != pytest.approx(want[k], abs=1e-9)] == []
    assert [r.tokens for r in reqs] == [r.tokens for r in late]
    assert len(planned) < len(set(want.values())) / 4     # steps were planned ahead, in runs


def _stamp_tokens(server, reqs):
    """{(request id, token number): the loop time it was written}, filled as streams write."""
    got = {}
    for req in reqs:
        def sink(upto=None, req=req):
            upto = req.generated if upto is None else upto
            for i in range(1 + max([i for r, i in got if r == req.id], default=0), upto + 1):
                got[req.id, i] = server.loop.now
            return True
        req.sink = sink
    return got


def test_a_fleet_slowed_k_times_makes_the_same_tokens_and_hits_each_k_times_later():
    """--time-scale K: every step's end K times later than the core's own plan (so TTFT and
    inter-token latency K times longer), an arrival K times later joining at the same step;
    tokens, cache hits and counters as at full speed."""
    k = 3.0

    def requests():                            # the third shares the first's prompt: a cache hit
        return [sim.EmulatedRequest(1, words(100, "a"), 40), sim.EmulatedRequest(2, words(300, "b"), 70),
                sim.EmulatedRequest(3, words(100, "a"), 10)]
    full = requests()
    plan = sim.serve_core(MODEL, "H100", engine="vllm-v1")
    want = _timed_tokens(plan, full[:2], {0.15: full[2]})

    server = sim.EmulatedServer(sim.serve_core(MODEL, "H100", engine="vllm-v1"), "m", time_scale=k)
    server.loop, server.tick = LateLoop(), 0.0     # a clock of its own: no whole-ms sleeps to snap to
    reqs = requests()
    got = _stamp_tokens(server, reqs)
    server._submit(reqs[0])
    server._submit(reqs[1])
    server.loop.fire(0.0)                      # the admission window (wall time: not scaled)
    while server.loop.due[0] + server.early < 0.15 * k:
        server.loop.fire(server.early)
    server.loop.now = 0.15 * k                 # the same arrival, K times later
    server._submit(reqs[2])
    while server.loop.due:
        server.loop.fire(server.early)
    assert got.keys() == want.keys()
    assert [key for key in want if got[key] != pytest.approx(want[key] * k, abs=1e-9)] == []
    assert [r.tokens for r in reqs] == [r.tokens for r in full]
    assert [r.cached_tokens for r in reqs] == [r.cached_tokens for r in full] and reqs[2].cached_tokens > 0
    assert [r.first_token_at for r in reqs] == pytest.approx([r.first_token_at * k for r in full], abs=1e-9)
    core = server.core
    assert (core.cache.hits, core.cache.queries, core.prompt_tokens, core.generation_tokens) == \
        (plan.cache.hits, plan.cache.queries, plan.prompt_tokens, plan.generation_tokens)


def test_the_time_scale_flag_reads_its_setting_and_refuses_a_faster_than_gpu_fleet(capsys):
    parse = sim.build_parser()
    argv = ["serve", "--model", MODEL, "--port", "0"]
    assert crdt.parse_settings(parse, argv, None, {}).time_scale == 1.0
    assert crdt.parse_settings(parse, argv + ["--time-scale", "4"], None, {}).time_scale == 4.0
    assert crdt.parse_settings(sim.build_parser(), argv, None, {"OTELA_TIME_SCALE": "2.5"}).time_scale == 2.5
    with pytest.raises(SystemExit):
        crdt.parse_settings(sim.build_parser(), argv + ["--time-scale", "0.5"], None, {})
    assert "must be >= 1" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(2, 60)), min_size=1, max_size=5),
       st.integers(112, 400), st.sampled_from([2, 4, 16]), st.booleans())
def test_a_run_completed_at_once_leaves_the_core_as_its_steps_one_by_one_would(shapes, pool, block_size, slots):
    # (a pool of at least 112 tokens in whole blocks of 16 holds the longest request, 100 tokens:
    # from 100, 100 // 16 blocks held 96, and hypothesis found a 97-token one refused)
    reqs = {}

    def core():                                # pools from one request's worth of KV: preemptions too
        c = sim.EngineCore(FlatCost(), pool // block_size, block_size, max_batched_tokens=256, max_num_seqs=8,
                           slots=slots)
        reqs[c] = [sim.EmulatedRequest(i, words(prompt, "p" if i % 2 else "q"), out, prompt_key=i % 2)
                   for i, (prompt, out) in enumerate(shapes)]
        for req in reqs[c]:
            c.add(req)
        return c
    once, by_step = core(), core()
    clock = 0.0
    while True:
        step, twin = once.schedule(), by_step.schedule()
        if step is None:
            assert twin is None
            break
        ends = sim.EmulatedServer(once, "m")._run_ahead(step, clock)
        once.complete_run(step, ends)
        by_step.complete(twin, ends[0])
        for end in ends[1:]:
            by_step.complete(by_step.schedule(), end)
        clock = ends[-1]
        for a, b in zip(reqs[once], reqs[by_step]):
            assert (a.tokens, a.computed, a.registered, a.blocks, a.state, a.first_token_at, a.finished_at) == \
                (b.tokens, b.computed, b.registered, b.blocks, b.state, b.first_token_at, b.finished_at)
        assert list(once.cache.free) == list(by_step.cache.free) and once.cache.by_hash == by_step.cache.by_hash
        assert [s[0] for s in once.slots or ()] == [s[0] for s in by_step.slots or ()]
        assert (once.generation_tokens, once.prompt_tokens, once.preemptions) == \
            (by_step.generation_tokens, by_step.prompt_tokens, by_step.preemptions)


# --- the server in this process: what it writes, and when it says a request arrived -------------

def in_process(check, served='odd "@@" name'):
    """Run `check(server, port)` (a coroutine) against an EmulatedServer on a FlatCost core;
    every request the core is handed is kept in server.submitted."""
    import asyncio

    class Kept(sim.EmulatedServer):
        def _submit(self, req):
            self.submitted.append(req)
            super()._submit(req)

    async def main():
        server = Kept(sim.EngineCore(FlatCost(), 4096, max_batched_tokens=2048), served)
        server.submitted = []
        port = await server.start("127.0.0.1", 0)
        try:
            return await check(server, port)
        finally:
            await server.close()
    return asyncio.run(main())


async def _exchange(port, head, body, pause=0.0):
    """Send a request's head, then after `pause` its body; the whole answer, read to close."""
    import asyncio
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    await asyncio.sleep(pause)
    writer.write(body)
    await writer.drain()
    sent = asyncio.get_running_loop().time()
    answer = await reader.read()
    writer.close()
    return sent, answer


def _request(path, obj):
    body = json.dumps(obj).encode()
    return (b"POST %s HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (path.encode(), len(body)), body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_streamed_token_event_is_the_json_of_its_chunk_whatever_the_model_is_called(path):
    chat_route = path == "/v1/chat/completions"
    name = 'odd "@@" name'
    obj = {"model": name, "max_tokens": 40, "stream": True}
    obj.update({"messages": [{"role": "user", "content": "splice"}]} if chat_route else {"prompt": "splice"})

    async def check(server, port):
        return (await _exchange(port, *_request(path, obj)))[1], server.submitted[0]
    answer, req = in_process(check, served=name)
    events = [line[6:] for line in answer.decode().split("\n") if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = chunks[:40]
    kind = "chat.completion.chunk" if chat_route else "text_completion"
    assert all(c["model"] == name and c["object"] == kind and c["id"] == tokens[0]["id"] for c in chunks)
    pieces = [c["choices"][0]["delta"]["content"] if chat_route else c["choices"][0]["text"] for c in tokens]
    assert pieces == req.tokens[req.prompt_len:]
    for c in tokens[1:]:
        field = {"delta": {"content": c["choices"][0]["delta"]["content"]}} if chat_route else \
            {"text": c["choices"][0]["text"]}
        assert c["choices"] == [{"index": 0, **field, "logprobs": None, "finish_reason": None}]
    if chat_route:
        assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


def test_a_request_arrives_with_its_last_bytes_not_with_its_head():
    head, body = _request("/v1/completions", {"model": 'odd "@@" name', "prompt": "late body", "max_tokens": 2})

    async def check(server, port):
        sent, answer = await _exchange(port, head, body, pause=0.2)
        return sent, answer, server.submitted[0].arrival
    sent, answer, arrival = in_process(check)
    assert answer.startswith(b"HTTP/1.1 200")
    # one loop, one clock: the body went out 0.2 s after the head, and was read after it was sent
    assert sent <= arrival


# --- wrapped as an engine by a real node, behind a real ingress ----------------------------------

def test_a_node_wraps_serve_as_its_engine_and_the_ingress_routes_to_it(tmp_path):
    from test_ingress_support import Client, Cluster
    cluster = Cluster(str(tmp_path))
    try:
        process = f"{sys.executable} otela_sim.py serve --model {MODEL} --gpu H100 --port {{port}}"
        argv = [os.path.join(cluster.root, "otela_node.py"), "start", "--key-file", cluster.key_file,
                "--bootstrap", f"127.0.0.1:{cluster.gossip}", "--listen", f"127.0.0.1:{free_port()}",
                "--gossip", f"127.0.0.1:{free_port()}", "--process", process, *cluster.grant("sim", [MODEL])]
        cluster.nodes["sim"] = cluster._spawn("sim", argv)
        cluster._wait(lambda: cluster.serving(MODEL) == 1, f"node serving {MODEL}", 60)
        client = Client(cluster.url, cluster.token)
        try:
            status, _, body = client.chat(MODEL, "hello through the overlay", max_tokens=5)
            assert status == 200
            answer = json.loads(body)
            assert answer["usage"]["completion_tokens"] == 5
            assert answer["usage"]["prompt_tokens"] == sim.count_tokens(
                sim.chat_prompt([{"role": "user", "content": "hello through the overlay"}]))
        finally:
            client.close()
    finally:
        cluster.close()


# --- a multi-node engine: node ranks and their links ------------------------------------------------

LAYOUT = "m on g tp=8 pp=2 nnodes=3"


def test_a_group_is_ready_only_when_every_rank_has_joined_with_the_same_layout():
    g = sim.DistGroup(3, LAYOUT, now=0.0)
    assert not g.ready
    assert g.hello({"rank": 1, "nnodes": 3, "layout": LAYOUT}, 0.1) == ({"ok": True}, 1)
    assert not g.ready
    reply, rank = g.hello({"rank": 2, "nnodes": 3, "layout": "m on g tp=8 pp=1 nnodes=3"}, 0.2)
    assert rank is None and "started as" in reply["error"]
    assert g.hello({"rank": 1, "nnodes": 3, "layout": LAYOUT}, 0.2)[0] == {"error": "node rank 1 has already joined"}
    assert "outside 1..2" in g.hello({"rank": 3, "nnodes": 3, "layout": LAYOUT}, 0.2)[0]["error"]
    assert g.hello({"rank": 2, "nnodes": 3, "layout": LAYOUT}, 0.3)[1] == 2
    assert g.ready and g.tick(1.0) is None


def test_a_closed_link_fails_the_group_at_once_and_a_silent_one_after_the_timeout():
    g = sim.DistGroup(3, LAYOUT, now=0.0, stall_s=2.0)
    for r in (1, 2):
        g.hello({"rank": r, "nnodes": 3, "layout": LAYOUT}, 0.0)
    g.heard(1, 1.5)
    assert g.tick(2.4) and "node rank 2 silent for 2.4 s" in g.failed
    h = sim.DistGroup(2, LAYOUT.replace("3", "2"), now=0.0)
    h.hello({"rank": 1, "nnodes": 2, "layout": LAYOUT.replace("3", "2")}, 0.0)
    h.closed(1, 0.5)
    assert not h.ready and "node rank 1 closed its link" in h.tick(0.5)


def test_ranks_that_never_come_fail_the_group_after_the_start_timeout():
    g = sim.DistGroup(3, LAYOUT, now=0.0, start_s=10.0)
    g.hello({"rank": 2, "nnodes": 3, "layout": LAYOUT}, 1.0)
    g.heard(2, 9.0)
    assert g.tick(9.5) is None
    g.heard(2, 10.5)
    assert "node rank(s) 1 did not join within --dist-start-timeout 10 s" in g.tick(10.6)


def _rank(rank, dist, port, *extra):
    return subprocess.Popen([sys.executable, str(ROOT / "otela_sim.py"), "serve", "--model", "llama-3.1-70b",
                             "--gpu", "H100", "--tp", "8", "--pp", "2", "--nnodes", "2", "--node-rank", str(rank),
                             "--dist-init-addr", f"127.0.0.1:{dist}", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _health(port):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def _exits_within(proc, seconds):
    t = time.monotonic()
    proc.wait(seconds + 5)
    return time.monotonic() - t, proc.returncode, proc.stderr.read().strip().splitlines()


@pytest.fixture
def two_ranks():
    port, dist = free_port(), free_port()
    r0 = _rank(0, dist, port)
    procs = [r0]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if _health(port) == 503:
                    break
            except OSError:
                time.sleep(0.05)
        assert _health(port) == 503                        # up, but rank 1 has not joined
        r1 = _rank(1, dist, 0)
        procs.append(r1)
        wait_http(f"http://127.0.0.1:{port}/health", timeout=30, proc=r0)
        yield port, r0, r1
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process(p, 5)


def test_two_ranks_up_answer_health_and_a_chat_and_rank_0_ends_within_2_s_when_rank_1_dies(two_ranks):
    port, r0, r1 = two_ranks
    status, body = http(f"http://127.0.0.1:{port}", "POST", "/v1/chat/completions",
                        {"model": "llama-3.1-70b", "messages": [{"role": "user", "content": "hello there"}],
                         "max_tokens": 4})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    r1.kill()
    took, code, err = _exits_within(r0, 2)
    assert took < 2 and code != 0
    assert err[-1] == "otela_sim.py: error: node rank 1 closed its link (the rank is gone; a multi-node engine " \
                      "cannot go on)"


def test_a_rank_ends_when_rank_0_goes_away(two_ranks):
    port, r0, r1 = two_ranks
    r0.kill()
    took, code, err = _exits_within(r1, 2)
    assert took < 2 and code != 0 and "rank 0 at 127.0.0.1:" in err[-1] and "went away" in err[-1]


def test_a_silent_rank_ends_the_engine_after_the_dist_timeout():
    import signal
    port, dist = free_port(), free_port()
    r0, r1 = _rank(0, dist, port, "--dist-timeout", "1"), _rank(1, dist, 0, "--dist-timeout", "1")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=30, proc=r0)
        r1.send_signal(signal.SIGSTOP)                     # hung, its socket still open
        took, code, err = _exits_within(r0, 3)
        assert 0.9 < took < 3 and code != 0 and "node rank 1 silent for" in err[-1] and "--dist-timeout 1 s" in err[-1]
    finally:
        r1.send_signal(signal.SIGCONT)
        for p in (r0, r1):
            if p.poll() is None:
                stop_process(p, 5)


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2"], "needs --dist-init-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1"], "outside 0..1"),
    (["--pp", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"], "puts 12 GPUs on a node"),
    (["--tp", "1", "--pp", "5", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"], "do not split evenly"),
    (["--pp", "3", "--tp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"], "pp=3 does not divide the 80"),
    (["--nnodes", "2", "--dist-init-addr", "nowhere"], "not HOST:PORT"),
])
def test_a_bad_multi_node_layout_is_a_one_line_error(args, message):
    p = subprocess.run([sys.executable, str(ROOT / "otela_sim.py"), "serve", "--model", "llama-3.1-70b", "--gpu",
                        "H100", "--tp", "8", "--port", "0", *args], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_the_emulated_step_of_a_pipeline_is_the_roofline_of_that_layout():
    one = sim.serve_core("llama-3.1-70b", "H100", 8)
    two = sim.serve_core("llama-3.1-70b", "H100", 8, pp=2)
    assert two.cost is sim._cost_for(sim.MODELS["llama-3.1-70b"], sim.GPUS["H100-SXM5-80GB"], 8, None,
                                     sim.SERVE_ENGINE, None, 2, None)
    assert two.cost.p2p_lat > 0 and two.cache.num_blocks > 2 * one.cache.num_blocks
