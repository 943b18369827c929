"""Specification of `otela_sim.py load`: a workload run through the emulator's engine core
(vLLM V1's scheduler) in virtual time, its latency report, and its one-line answers."""
import csv
import json
import subprocess
import sys

import pytest
from conftest import ROOT

import otela_sim as sim


def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "otela_sim.py"), "load", *args], capture_output=True,
                          text=True, timeout=120)


def test_a_lone_request_takes_the_estimate_of_a_batch_of_one_behind_the_serving_stack():
    est = sim.estimate("llama-3.1-8b", "H100", 1, 1, 1024, 128, engine="vllm-v1")
    r = sim.load_test("llama-3.1-8b", "H100", 1, [(0.0, 1024, 128)])
    stack = sim.LOAD_REQUEST_OVERHEAD_S * 1e3
    assert r["ttft_ms"]["mean"] == pytest.approx(est["ttft_ms"] + stack, rel=0.02)
    assert r["itl_ms"]["mean"] == pytest.approx(est["decode_ms_per_token"], rel=0.02)
    assert r["e2e_ms"]["mean"] == pytest.approx(est["e2e_ms"] + stack, rel=0.02)
    assert r["requests"] == 1 and not r["saturated"]


def test_sglang_runs_prompts_in_steps_of_their_own_and_vllm_v1_mixes_them_into_decodes():
    def steps(engine):
        core = sim.serve_core("llama-3.1-8b", "H100", engine=engine)
        core.add(sim.EmulatedRequest(0, list(range(64)), 50))
        core.complete(core.schedule(), 0.0)
        core.add(sim.EmulatedRequest(1, list(range(100, 164)), 50))
        return [(r.id, n) for r, n in core.schedule().items]
    assert steps("vllm-v1") == [(0, 1), (1, 64)]
    assert steps("sglang") == [(1, 64)]


def test_the_load_test_times_every_request_as_the_core_stepped_one_step_at_a_time():
    arrivals = sim.load_arrivals(8, 5, {"dist": "normal", "mean": 600, "std": 200}, {"dist": "normal", "mean": 60,
                                                                                      "std": 20}, seed=3)
    reqs, _ = sim.run_load(sim.serve_core("llama-3.1-8b", "H100"), arrivals)
    core = sim.serve_core("llama-3.1-8b", "H100")
    mine = [sim._load_request(i, t, inp, out, 0) for i, (t, inp, out) in enumerate(arrivals)]
    now, i = 0.0, 0
    while i < len(mine) or not core.idle():
        while i < len(mine) and mine[i].arrival <= now:
            core.add(mine[i])
            i += 1
        step = core.schedule()
        if step is None:
            now = mine[i].arrival
            continue
        now += step.seconds
        core.complete(step, now)
    for a, b in zip(reqs, mine):
        assert a.first_token_at == pytest.approx(b.first_token_at, abs=1e-9)
        assert a.finished_at == pytest.approx(b.finished_at, abs=1e-9)


def test_a_rate_the_engine_holds_is_not_saturated_and_twice_its_capacity_is():
    light = sim.load_test("llama-3.1-8b", "H100", 1, sim.load_arrivals(5, 60, 1024, 128), duration_s=60)
    assert not light["saturated"]
    assert light["throughput_req_s"] == pytest.approx(light["offered_req_s"], rel=0.1)
    heavy = sim.load_test("llama-3.1-8b", "H100", 1, sim.load_arrivals(80, 60, 1024, 128), duration_s=60)
    assert heavy["saturated"]
    assert heavy["throughput_req_s"] < 0.7 * heavy["offered_req_s"]
    assert heavy["ttft_ms"]["p90"] > 20 * light["ttft_ms"]["p90"]


def test_a_shared_system_prompt_is_served_from_the_prefix_cache():
    r = sim.load_test("llama-3.1-8b", "H100", 1, sim.load_arrivals(4, 30, 1024, 64), shared_prefix=768)
    assert r["prefix_hit_rate"] == pytest.approx(768 / 1024, abs=0.03)    # all but the first request's
    cold = sim.load_test("llama-3.1-8b", "H100", 1, sim.load_arrivals(4, 30, 1024, 64))
    assert cold["prefix_hit_rate"] == 0
    stack = sim.LOAD_REQUEST_OVERHEAD_S * 1e3                  # the same in both
    assert r["ttft_ms"]["mean"] - stack < 0.6 * (cold["ttft_ms"]["mean"] - stack)


def test_load_prints_percentiles_and_the_engine_calibration_it_used():
    p = cli("--model", "llama-3.1-8b", "--gpu", "H100", "--rate", "2", "--duration", "20", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert set(r["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"]
    assert r["calibration"]["row"] == "vllm-v1"


def test_load_from_a_trace_file(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": t, "input_len": 512, "output_len": 32}) + "\n"
                             for t in (0.0, 0.5, 1.0)))
    p = cli("--model", "llama-3.1-8b", "--gpu", "H100", "--trace", str(trace), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["requests"] == 3


def test_a_rate_the_engine_cannot_hold_says_saturated_in_one_line_with_status_3():
    p = cli("--model", "llama-3.1-8b", "--gpu", "H100", "--rate", "80", "--duration", "30")
    assert p.returncode == sim.LOAD_SATURATED_EXIT
    assert p.stderr.count("\n") == 1 and "cannot keep up" in p.stderr and "saturated" in p.stderr
    assert "saturated          True" in p.stdout


@pytest.mark.parametrize("args, says", [
    (["--input-len", "200000"], "maximum context length is 131072"),
    (["--trace", "x.jsonl"], "not both"),
    (["--input-len", "0"], "--input-len"),
    (["--output-len", "a:b"], "MEAN:STD"),
])
def test_bad_load_input_gets_one_line(args, says):
    p = cli("--model", "llama-3.1-8b", "--gpu", "H100", "--rate", "1", "--duration", "5", *args)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and says in p.stderr
    assert p.stdout == ""


def decode_step(engine, n, ctx=200):
    c = sim._cost_for(sim.resolve_model("llama-3-70b"), sim.resolve_gpu("H100"), 4, None, engine)
    return c.decode_alpha(n) + c.decode_beta(n) * n * ctx


def test_70b_tp4_decode_under_v1_grows_with_its_bytes_not_with_nccl_protocols():
    v1 = decode_step("vllm-v1", 84) / decode_step("vllm-v1", 1)
    v0 = decode_step("vllm-0.6", 84) / decode_step("vllm-0.6", 1)
    assert v1 < 1.3 < v0                         # V0 keeps its fitted NCCL rows: +57 %; V1 +24 %


def test_v1_all_reduce_is_latency_bound_below_the_custom_all_reduce_size():
    c = sim._cost_for(sim.resolve_model("llama-3-70b"), sim.resolve_gpu("H100"), 4, None, "vllm-v1")
    assert c.allreduce(84) - c.allreduce(1) < 0.3 * c.allreduce(1)
    big = sim.CUSTOM_ALLREDUCE_MAX_BYTES // (8192 * 2) + 1
    assert c.allreduce(big) > c.ar_lat + c.ar_byte * big     # past it, NCCL's protocols


def test_a_v1_decode_step_runs_the_cuda_graph_of_the_next_captured_size():
    c = sim._cost_for(sim.resolve_model("llama-3.1-8b"), sim.resolve_gpu("H100"), 1, None, "vllm-v1")
    assert [c.graph_tokens(n) for n in (1, 3, 5, 9, 512, 600)] == [1, 4, 8, 16, 512, 600]
    def body(n):                                  # the layers: what the graph runs
        return c.decode_alpha(n) - c.per_seq * n - c._lm_head(n)
    assert body(9) == pytest.approx(body(16)) and body(16) < body(17)


def test_a_vllm_release_with_no_fit_of_its_own_is_flagged_in_the_load_report():
    p = cli("--model", "llama-3.1-8b", "--gpu", "H100", "--rate", "2", "--duration", "5", "--engine", "vllm",
            "--engine-version", "0.15.0", "--json")
    assert p.returncode == 0, p.stderr
    coverage = json.loads(p.stdout)["calibration"]
    assert coverage["fitted"] is False and "vllm 0.15.0" in coverage["note"]
    assert "warning: no fitted calibration row for vllm 0.15.0" in p.stderr


def test_a_config_field_that_changes_the_cost_is_refused_by_name(tmp_path):
    cfg = dict(sim.BUILTIN_CONFIGS["mixtral-8x22b"], sliding_window_pattern=4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    p = cli("--config", str(path), "--gpu", "H100", "--tp", "8", "--rate", "1", "--duration", "5")
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "sliding_window_pattern" in p.stderr


@pytest.mark.parametrize("gpu, defaults", [("H100", (8192, 1024)), ("H200", (8192, 1024)),
                                           ("A100-80GB", (2048, 256)), ("L40S", (2048, 256))])
def test_vllm_v1_admits_by_its_defaults_for_the_gpu(gpu, defaults):
    assert sim.v1_batch_defaults(gpu) == defaults
    core = sim.serve_core("llama-3.1-8b", gpu, max_num_seqs=defaults[1])
    assert core.max_batched_tokens == defaults[0]
    row = {"tp": "1", "max_num_seqs": "", "max_num_batched_tokens": "", "gpu_memory_utilization": ""}
    model, g = sim.resolve_model("llama-3.1-8b"), sim.resolve_gpu(gpu)
    assert sim._load_row_core_args(row, model, g, "vllm-v1")["max_num_seqs"] == defaults[1]


def test_the_front_end_takes_one_request_at_a_time():
    assert sim.frontend_times([0.0, 0.0, 0.0, 1.0], 0.01) == pytest.approx([0.0, 0.01, 0.02, 1.0])
    assert sim.frontend_times([0.0, 0.5, 1.0], 0.01) == [0.0, 0.5, 1.0]      # spaced: no wait


def test_a_burst_queues_at_the_front_end_and_is_saturated():
    n = 200
    r = sim.load_test("qwen3-0.6b", "H100", 1, [(0.0, 256, 16)] * n)
    each = sim.LOAD_FRONTEND_FIXED_S + 16 * sim.LOAD_FRONTEND_TOKEN_S
    turns = each * (n - 1) / 2 * 1e3          # the mean wait for a turn
    assert r["saturated"]
    assert r["ttft_ms"]["mean"] == pytest.approx(turns + sim.LOAD_REQUEST_OVERHEAD_S * 1e3, rel=0.15)
    assert r["throughput_req_s"] < 1.05 / each


def test_the_front_end_charges_a_request_and_each_token_it_streams():
    # a ShareGPT request (201.6 tokens out on average) costs what PR 17546's ShareGPT run measured
    share = sim.frontend_seconds([(0.0, 217, 201.6)])[0]
    assert share == pytest.approx(sim.LOAD_FRONTEND_REQUEST_S)
    # a short answer costs less: 1000 prompts with 4 tokens out went through in 5.44 s (fit split)
    assert sim.frontend_seconds([(0.0, 128, 4)])[0] * 1000 < 5.6
    assert sim.frontend_times([0.0, 0.0, 0.0], [0.01, 0.02, 0.01]) == pytest.approx([0.0, 0.01, 0.03])


# vLLM V1's host time per step, fitted on published V1 runs outside the held-out GPU: AccelMark's
# verified vLLM 0.20.1 submission on one A100-SXM4-80GB (Qwen2.5-0.5B at batch 1 and with 32
# requests in flight, Llama-3-8B at batch 1 and 8; measured_calibration.csv).
V1_ROWS = ("accelmark_a100_80_qwen05b_v1_tpot", "accelmark_a100_80_qwen05b_v1_c32",
           "accelmark_a100_80_8b_v1_tpot", "accelmark_a100_80_8b_v1_c8")


def test_v1_host_time_per_step_and_per_request_is_fitted_on_published_v1_rows():
    rows = [r for r in sim.load_calibration() if r["id"] in V1_ROWS]
    assert len(rows) == 4 and {sim.row_engine(r).key for r in rows} == {"vllm-v1"}
    assert not any(sim.held_out(r) for r in rows) and all("H100" not in r["gpu"] for r in rows)
    errors = {o["id"]: o["error"] for o in sim.validate(rows, quick=True, logo=False)["rows"]}
    assert max(abs(e) for e in errors.values()) <= 0.05, errors
    v1 = sim.active_calibration()["engines"]["vllm-v1"]
    # a 0.5B model's step grows 1.83 -> 2.76 ms from 1 to 32 requests where its bytes barely move:
    # the per-request host time is what the data show, above its prior of 0.01 ms
    assert v1["per_seq_overhead_ms"] > 2 * sim.engine_prior("vllm-v1", "per_seq_overhead_ms")[0]
    assert 1.0 < v1["overhead_ms"] < 1.5


def test_published_load_tests_are_reported_on_both_splits():
    v = sim.validate_load_tests()
    fit, held = v["splits"]["fit"], v["splits"]["held_out"]
    with open(sim.LOAD_TESTS_CSV, newline="") as f:
        split_of_gpu = {(r["gpu"].startswith("H100"), r["split"]) for r in csv.DictReader(f)}
    assert split_of_gpu == {(True, "held_out"), (False, "fit")}      # split by GPU: H100 held out
    # the V1 rows of the fit split (AccelMark, A100-80GB: Qwen2.5-0.5B at 10 and 40 req/s, Llama-3-8B at 5)
    am = {o["id"]: o["error"] for o in v["rows"] if o["id"].startswith("am_a100_80")}
    assert len(am) == 3 and max(abs(e) for e in am.values()) <= 0.10, am
    # as measured when GPUStack's burst runs of vLLM 0.10-0.11 came in (H100 held out, A100 fit) and
    # the KV pool was planned from the device's memory in GiB, the front end charged per request and per
    # token, the routed experts' grouped GEMM priced, Marlin's padding of MXFP4 experts and Triton's
    # prefill of attention with sinks on the A100 (MOE_GEMM_EFF and SINK_PREFILL_ATTN_SLOWDOWN fitted on
    # the A100 rows): held out median 38.6 %, worst 203 % (gpt-oss-120b's inter-token time on one H100,
    # 145 % before the experts were priced); fit 8.7 %, worst 70 %: the honest figure, far from the
    # targets on the held-out split
    assert held["all"]["n"] >= 42 and fit["all"]["n"] >= 59
    assert held["all"]["median_abs_error"] <= 0.40 and held["all"]["max_abs_error"] <= 2.10
    assert fit["all"]["median_abs_error"] <= 0.10 and fit["all"]["max_abs_error"] <= 0.75


def test_the_kv_pool_is_planned_from_the_memory_the_device_reports():
    # Qwen3-32B on one 80 GB board: vLLM ran 32k-token prompts there (GPUStack's burst runs), which
    # the data sheet's 80e9 bytes could not hold (a ~14k-token pool); the A100's long-prompt runs are
    # now predicted within 15 % (they were +50 % / +34 % TTFT with the smaller pool)
    v = sim.validate_load_tests()
    assert not [o for o in v["rows"] if o["error"] is None]
    a100_32b = [o["error"] for o in v["rows"] if o["id"].startswith("gs_a100_qwen332b") and "128" not in o["id"]]
    assert len(a100_32b) == 6 and max(abs(e) for e in a100_32b) <= 0.15, a100_32b
    assert sim.device_memory_bytes(sim.resolve_gpu("H100-SXM5-80GB")) == 79.6 * 2 ** 30
    assert sim.device_memory_bytes(sim.resolve_gpu("L40S")) == 48e9      # not listed: the data sheet's


def test_a_published_run_the_simulator_refuses_is_counted_apart_not_dropped(tmp_path):
    with open(sim.LOAD_TESTS_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    row = next(r for r in rows if r["id"] == "kvc_h100_qwen06b_r16")
    beyond = {**row, "id": "beyond_context", "input_len": "50000"}    # Qwen3-0.6B holds 40,960 positions
    path = tmp_path / "load.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        w.writeheader()
        w.writerows([row, beyond])
    v = sim.validate_load_tests(str(path))
    refused = [o for o in v["rows"] if o["error"] is None]
    assert [o["id"] for o in refused] == ["beyond_context"] and "maximum context length" in refused[0]["refused"]
    assert v["splits"]["held_out"]["refused"] == {"n": 1} and v["splits"]["held_out"]["all"]["n"] == 1
