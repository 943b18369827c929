"""Benchmark of otela_sim: estimate cost per call, the virtual-time load test's CPU, Table-1 replay time and
result, calibration error.

    .venv/bin/python tests/bench_sim.py [--quick] [--out bench-results]

Prints figures and writes <out>/sim.json. Never asserts: targets are in the issues (estimate
< 1 ms per call, Table-1 replay < 10 s, calibration median <= 10% / max <= 25%, H100/A100
ratio within 6%; issue 15: leave-one-group-out median <= 10% / max <= 25%, published vLLM
static rows not fitted on median <= 12% / max <= 30%, an engine left out with two probes
median <= 10%). Without --quick the leave-one-group-out refits take several minutes
(run it under nice -n 19).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import otela_sim as sim  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"

CASES = [("llama-2-7b", "A100", 1, 1, 128, 128), ("llama-2-13b", "GH200", 1, 64, 600, 80),
         ("codellama-34b", "A100", 2, 32, 1200, 500), ("llama-3.3-70b", "H100", 4, 128, 700, 64),
         ("qwen3-32b", "H200", 2, 16, 2048, 256), ("mixtral-8x7b", "MI300X", 1, 8, 512, 128)]


def bench_estimate(calls):
    for case in CASES:                      # first call of each builds the cost model
        sim.estimate(*case)
    t0 = time.perf_counter()
    for i in range(calls):
        sim.estimate(*CASES[i % len(CASES)])
    warm = (time.perf_counter() - t0) / calls
    cold_calls = max(60, calls // 50)
    t0 = time.perf_counter()
    for i in range(cold_calls):
        sim._cost.cache_clear()
        sim.estimate(*CASES[i % len(CASES)])
    cold = (time.perf_counter() - t0) / cold_calls
    return {"calls": calls, "us_per_call": warm * 1e6, "calls_per_s": 1 / warm, "cold_us_per_call": cold * 1e6}


def bench_replay(scenario):
    out = {}
    for name in ("opentela", "memory_proportional"):
        placement = sim.placement_from_paper(scenario["paper_placements"][name])
        t0 = time.perf_counter()
        r = sim.replay(scenario, placement, seed=0)
        wall = time.perf_counter() - t0
        paper = scenario["paper_result_req_s"][name]
        out[name] = {"wall_s": wall, "requests": r["requests"], "completed": r["completed"],
                     "total_req_s": r["total_req_s"], "paper_total_req_s": paper["total"],
                     "per_model_req_s": r["per_model_req_s"],
                     "paper_per_model_req_s": {k: v for k, v in paper.items() if k != "total"},
                     "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "mean_ms": r["mean_ms"],
                     "ttft_p50_ms": r["ttft_p50_ms"]}
    return out


def _errors(rows, cal):
    return {r["id"]: sim.predict_row(r, cal, quick=True) / float(r["value"]) - 1 for r in rows}


def _summ(errs):
    e = sorted(abs(x) for x in errs)
    return {"n": len(e), "median_abs_error": sim._percentile(e, 0.5), "max_abs_error": e[-1] if e else 0.0}


def bench_vllm_static_held_out(rows, never_seen=()):
    """Fit on every row but the static vLLM ones, predict those (never seen by this fit), and
    the rows held out of every fit (`never_seen`, column held_out), reported apart."""
    held = [r for r in rows if sim.row_engine(r).engine == "vllm" and r["metric"] != sim.SUSTAINED]
    train = [r for r in rows if r not in held]
    cal = sim.calibrate(train, iters=25)["calibration"]
    errs = _errors(held, cal)
    unseen = _errors(list(never_seen), cal)
    return {"rows": errs, **_summ(errs.values()), "never_seen": {"rows": unseen, **_summ(unseen.values())}}


def bench_left_out_engine(rows, engine):
    """An engine version left out of the fit entirely, then two of its static rows used as its
    two probes (smallest and largest batch; at one batch size, smallest and largest tp): fit
    only the overhead terms the two probes tell apart (sim.probe_terms: overhead_ms and the
    per-request term of their tp, or tp_per_seq_overhead_ms for a tp-1 and a tp > 1 probe at
    one batch size), predict its other rows (sustained rows replayed)."""
    mine = [r for r in rows if sim.row_engine(r).key == engine]
    train = [r for r in rows if r not in mine and r["metric"] != sim.SUSTAINED]
    base = sim.fit(train, iters=25)["calibration"]
    order = sorted((r for r in mine if r["metric"] != sim.SUSTAINED), key=lambda r: (int(r["batch"]), int(r["tp"])))
    probes = [order[0], order[-1]]
    rest = [r for r in mine if r not in probes]
    before = _errors(rest, base)
    terms = sim.probe_terms([(r["batch"], r["tp"]) for r in probes])
    params = {f"engines/{engine}/{n}": sim.engine_prior(engine, n)[:3] for n in terms}
    # a probe measures the engine itself: fitted tight, as probe_fit solves its two equations
    probed = sim.fit(probes, base, iters=25, params=params, row_sigma=0.01)
    after = _errors(rest, probed["calibration"])
    return {"engine": engine, "probes": [r["id"] for r in probes],
            "before": {"rows": before, **_summ(before.values())},
            "after": {"rows": after, **_summ(after.values())},
            "fitted": {n.split("/")[-1]: sim._get(probed["calibration"], n) for n in params},
            "failed": probed["failed"]}


def bench_load():
    """Issue 45's load test: 10 minutes of 20 req/s (Llama-3.1-8B on one H100, prompts
    Normal(1000, 200), outputs Normal(200, 50)) in virtual time; the target is < 10 s of CPU."""
    arrivals = sim.load_arrivals(20, 600, {"dist": "normal", "mean": 1000, "std": 200},
                                 {"dist": "normal", "mean": 200, "std": 50})
    t0 = time.process_time()
    r = sim.load_test("llama-3.1-8b", "H100", 1, arrivals, duration_s=600)
    return {"cpu_s": time.process_time() - t0, "virtual_s": 600, "rate_rps": 20, "report": r}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench-results")
    p.add_argument("--quick", action="store_true", help="fewer estimate calls; calibration replays shortened")
    a = p.parse_args()
    result = {"role": "sim"}

    est = bench_estimate(3000 if a.quick else 30000)
    result["estimate"] = est
    print(f"estimate: {est['us_per_call']:.1f} us/call ({est['calls_per_s']:.0f} calls/s); "
          f"cold (cost model rebuilt): {est['cold_us_per_call']:.1f} us/call")

    load = bench_load()
    result["load_test"] = load
    print(f"load test: {load['virtual_s']} s of {load['rate_rps']} req/s ({load['report']['requests']} requests) "
          f"in {load['cpu_s']:.2f} s of CPU (target < 10 s); TTFT p50 {load['report']['ttft_ms']['p50']:.0f} ms, "
          f"ITL mean {load['report']['itl_ms']['mean']:.1f} ms, saturated {load['report']['saturated']}")

    t0 = time.perf_counter()
    lv = sim.validate_load_tests(str(DATA / "load_tests.csv"))
    result["load_tests"] = lv
    print(f"published load tests (tests/data/load_tests.csv, {len({r['id'] for r in lv['rows']})} tests, "
          f"{time.perf_counter() - t0:.0f} s; fitted on the fit split: LOAD_REQUEST_OVERHEAD_S, and the bound on the "
          "front end's part per request (LOAD_FRONTEND_FIXED_S), the grouped expert GEMM's share (MOE_GEMM_EFF) and "
          "attention with sinks before Hopper (SINK_PREFILL_ATTN_SLOWDOWN); its rate and vLLM V1's admission defaults come from "
          "their sources; target median "
          "<= 10%, each metric <= 15%, worst <= 60%):")
    for split, by in lv["splits"].items():
        print(f"    {split:9s} " + "  ".join(f"{m} n={s['n']}" + ("" if m == "refused" else
                                                                     f" median {s['median_abs_error'] * 100:.1f}% max "
                                                                     f"{s['max_abs_error'] * 100:.1f}%")
                                             for m, s in by.items()))
    for r in lv["rows"]:
        if r["error"] is None:
            print(f"    {r['id']:26s} {r['metric']:12s} measured {r['measured']:9.2f} refused: {r['refused']}")
            continue
        print(f"    {r['id']:26s} {r['metric']:12s} measured {r['measured']:9.2f} predicted {r['predicted']:9.2f} "
              f"{r['error'] * 100:+6.1f}%{'  (saturated)' if r['saturated'] else ''}")

    scenario = json.loads((DATA / "table1_scenario.json").read_text())
    rep = bench_replay(scenario)
    result["replay_table1"] = rep
    for name, r in rep.items():
        print(f"replay table1 {name}: {r['wall_s']:.2f} s wall for {r['requests']} requests; "
              f"total {r['total_req_s']:.1f} req/s (paper {r['paper_total_req_s']})")
        for model, v in r["per_model_req_s"].items():
            print(f"    {model:36s} {v:7.1f} req/s (paper {r['paper_per_model_req_s'][model]})")

    t0 = time.perf_counter()
    v = sim.validate(sim.load_calibration(DATA / "measured_calibration.csv"), quick=a.quick)
    result["calibration"] = {"wall_s": time.perf_counter() - t0, "summary": v["summary"], "ratios": v["ratios"],
                             "rows": v["rows"], "shortened_replays": a.quick}
    print(f"calibration ({'shortened replays' if a.quick else 'full replays'}, "
          f"{result['calibration']['wall_s']:.1f} s):")
    for metric, s in v["summary"].items():
        print(f"    {metric:42s} n={s['n']:2d} median |err| {s['median_abs_error'] * 100:5.1f}%  "
              f"max |err| {s['max_abs_error'] * 100:5.1f}%")
    for r in v["ratios"]:
        print(f"    ratio {r['pair']:52s} measured {r['measured']:.3f} predicted {r['predicted']:.3f} "
              f"error {r['error'] * 100:+5.1f}%")

    for o in v["inconsistent"]:
        print(f"    marked inconsistent in the data (not fitted, not summarised): {o['id']} "
              f"{o['error'] * 100:+.1f}%")
    every = sim.load_calibration(DATA / "measured_calibration.csv")
    rows = sim.fitted_rows(every)
    # the held-out vLLM rows are issue 15's "others you have not seen" for its vLLM target; the
    # held-out rows of other engines (SGLang) are reported apart below
    never_seen = [r for r in every if sim.held_out(r) and not sim.inconsistent(r)
                  and sim.row_engine(r).engine == "vllm"]
    t0 = time.perf_counter()
    held = bench_vllm_static_held_out(rows, never_seen)
    result["vllm_static_held_out"] = held
    print(f"published static vLLM rows, not fitted on ({time.perf_counter() - t0:.0f} s): n={held['n']} "
          f"median |err| {held['median_abs_error'] * 100:.1f}%  max |err| {held['max_abs_error'] * 100:.1f}% "
          "(target 12% / 30%)")
    for rid, e in held["rows"].items():
        print(f"    {rid:32s} {e * 100:+6.1f}%")
    unseen = held["never_seen"]
    print(f"  rows held out of every fit (column held_out), same fit: n={unseen['n']} median |err| "
          f"{unseen['median_abs_error'] * 100:.1f}%  max |err| {unseen['max_abs_error'] * 100:.1f}% (target 12% / 30%)")
    for rid, e in unseen["rows"].items():
        print(f"    {rid:32s} {e * 100:+6.1f}%")
    print(f"  held out, predicted by the full calibration: n={v['held_out_summary']['n']} median |err| "
          f"{v['held_out_summary']['median_abs_error'] * 100:.1f}%  max |err| "
          f"{v['held_out_summary']['max_abs_error'] * 100:.1f}%")
    result["held_out_by_engine"] = v["held_out_by_engine"]
    for engine, s in v["held_out_by_engine"].items():
        print(f"    of them {engine}: n={s['n']} median |err| {s['median_abs_error'] * 100:.1f}%  "
              f"max |err| {s['max_abs_error'] * 100:.1f}%")
    result["left_out_engines"] = []
    for engine in ("trtllm-0.6", "gptfast", "vllm-0.6"):
        lo = bench_left_out_engine(rows, engine)
        result["left_out_engines"].append(lo)
        print(f"engine {engine} left out: median |err| {lo['before']['median_abs_error'] * 100:.1f}% "
              f"(max {lo['before']['max_abs_error'] * 100:.1f}%) -> with two probes ({', '.join(lo['probes'])}) "
              f"{lo['after']['median_abs_error'] * 100:.1f}% (max {lo['after']['max_abs_error'] * 100:.1f}%); "
              f"fitted {lo['fitted']}{' FAILED at a bound: ' + str(lo['failed']) if lo['failed'] else ''}")
    if not a.quick:
        t0 = time.perf_counter()
        logo = sim.leave_one_group_out(rows, quick=True, iters=12)
        result["leave_one_group_out"] = logo
        print(f"leave-one-group-out ({time.perf_counter() - t0:.0f} s): median |err| "
              f"{logo['all']['median_abs_error'] * 100:.1f}%  max |err| {logo['all']['max_abs_error'] * 100:.1f}% "
              "(target 10% / 25%)")
        for dim, groups in logo["groups"].items():
            for g, s in groups.items():
                print(f"    {dim:15s} {g:36s} n={s['n']:2d} median {s['median_abs_error'] * 100:5.1f}%  "
                      f"max {s['max_abs_error'] * 100:5.1f}%")

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "sim.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
