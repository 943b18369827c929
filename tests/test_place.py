"""The placer's solver, baselines and replay, as specifications (no Slurm, no network)."""
from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import otela_place as place  # noqa: E402
import otela_sim  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE1 = os.path.join(ROOT, "tests", "data", "table1_scenario.json")


def table1():
    with open(TABLE1) as f:
        return json.load(f)


def exhaustive(demand, pool, cands, headroom=place.HEADROOM):
    """Best (ratio, useful capacity, -GPUs) over every instance vector."""
    ranges = [range(pool[c.gpu][0] // c.tp + 1) for c in cands]
    capacity_of = {c.key(): c.capacity_rps for c in cands}
    best = None
    for counts in itertools.product(*ranges):
        used = {g: 0 for g in pool}
        for c, k in zip(cands, counts):
            used[c.gpu] += c.tp * k
        if any(used[g] > pool[g][0] for g in pool):
            continue
        rows = [{"model": c.model, "gpu": c.gpu, "tp": c.tp, "instances": k} for c, k in zip(cands, counts) if k]
        ratio, served, gpus = place.score(rows, demand, capacity_of, headroom)
        if ratio <= 0:
            continue
        key = (round(ratio, 6), round(served, 6), -gpus)
        best = key if best is None or key > best else best
    return best


def random_instance(seed):
    rng = random.Random(seed)
    pool = {g: (rng.choice([2, 4, 6, 8]), 4) for g in ("A", "B")[: rng.choice([1, 2])]}
    models = [f"m{i}" for i in range(rng.choice([1, 2, 3]))]
    demand = {m: rng.choice([0.5, 2.0, 5.0, 12.0]) for m in models}
    cands = []
    for m in models:
        for g in pool:
            for tp in rng.sample([1, 2, 4], rng.choice([1, 2])):
                cands.append(place.Candidate(m, g, tp, round(rng.uniform(0.3, 6.0) * tp ** 0.8, 3)))
    return demand, pool, cands


@pytest.mark.parametrize("seed", range(30))
def test_solver_equals_exhaustive_search_on_small_instances(seed):
    demand, pool, cands = random_instance(seed)
    best = exhaustive(demand, pool, cands)
    if best is None:
        with pytest.raises(place.PlacementError):
            place.solve(demand, pool, cands)
        return
    got = place.solve(demand, pool, cands, slack=0)
    assert got.ratio == pytest.approx(best[0], rel=1e-5, abs=1e-6)
    assert got.served_rps == pytest.approx(best[1], rel=1e-5, abs=1e-6)
    assert -got.gpus_used == best[2]


def test_solver_respects_gpu_counts_per_type():
    pool = {"A": (4, 4), "B": (2, 2)}
    cands = [place.Candidate("m", "A", 2, 3.0), place.Candidate("m", "B", 1, 1.0)]
    got = place.solve({"m": 100.0}, pool, cands)
    used = {g: sum(r["tp"] * r["instances"] for r in got.rows if r["gpu"] == g) for g in pool}
    assert used == {"A": 4, "B": 2}
    assert got.served_rps == pytest.approx(8.0)


def test_routing_weights_follow_capacity_and_sum_to_one():
    pool = {"A": (2, 2), "B": (2, 2)}
    cands = [place.Candidate("m", "A", 1, 1.0), place.Candidate("m", "B", 1, 3.0)]
    got = place.solve({"m": 100.0}, pool, cands)
    weights = {r["gpu"]: r["weight"] for r in got.rows}
    assert weights == {"A": 0.25, "B": 0.75}


def test_solver_uses_fewest_gpus_once_demand_is_met_with_headroom():
    pool = {"A": (8, 4)}
    cands = [place.Candidate("m", "A", 1, 10.0)]
    got = place.solve({"m": 20.0}, pool, cands)  # 20 x 1.25 = 25 req/s -> 3 instances
    assert got.rows == [{"model": "m", "gpu": "A", "tp": 1, "instances": 3, "weight": 1.0}]
    assert got.ratio == pytest.approx(place.HEADROOM)


def test_too_few_gpus_for_every_model_is_a_one_line_reason():
    pool = {"A": (4, 4)}
    cands = [place.Candidate(m, "A", 4, 1.0) for m in ("x", "y")]
    with pytest.raises(place.PlacementError) as err:
        place.solve({"x": 1.0, "y": 1.0}, pool, cands)
    assert "\n" not in str(err.value) and "one instance" in str(err.value)


def test_model_without_any_candidate_is_a_one_line_reason():
    with pytest.raises(place.PlacementError) as err:
        place.solve({"x": 1.0}, {"A": (4, 4)}, [])
    assert str(err.value) == "model x has no GPU type it can run on"


def test_tp_must_divide_heads_and_fit_in_one_node():
    cfg = {"num_attention_heads": 40, "num_key_value_heads": 40}
    assert place.tp_allowed(cfg, 4, 4) is None
    assert "does not divide" in place.tp_allowed({"num_attention_heads": 40, "num_key_value_heads": 10}, 4, 4)
    assert "exceeds" in place.tp_allowed(cfg, 8, 4)


def test_latency_objective_routes_more_traffic_to_the_faster_gpu():
    pool = {"A": (4, 4), "B": (4, 4)}
    cands = [place.Candidate("m", "A", 1, 5.0, latency_ms=2000.0),
             place.Candidate("m", "B", 1, 5.0, latency_ms=500.0)]
    got = place.solve({"m": 8.0}, pool, cands, objective="latency")
    weights = {r["gpu"]: r["weight"] for r in got.rows}
    assert weights.get("B", 0) > weights.get("A", 0)
    assert got.ratio == pytest.approx(place.HEADROOM)


# ---------------------------------------------------------------- Table 1


def test_measured_capacities_with_strict_objective_reproduce_the_papers_placement():
    s = table1()
    result = place.plan_all(s, capacity="measured", replay_method="fluid", slack=0)
    assert sorted(map(json.dumps, result["ours"]["placement"])) == sorted(map(json.dumps, result["paper"]["placement"]))


def test_memp_baseline_matches_the_papers_memp_placement():
    s = table1()
    want = place.paper_placement(s, "memory_proportional")
    got = place.memp_placement(s)
    key = lambda r: (r["model"], r["gpu"])  # noqa: E731
    assert [(r["model"], r["gpu"], r["tp"], r["instances"]) for r in sorted(got, key=key)] == \
        [(r["model"], r["gpu"], r["tp"], r["instances"]) for r in sorted(want, key=key)]
    assert {key(r): r["weight"] for r in got}[("meta-llama/Llama-3.3-70B-Instruct", "A100-80GB-SXM4")] == \
        pytest.approx(0.111, abs=1e-3)


def test_fluid_replay_of_measured_capacities_gives_the_papers_totals():
    s = table1()
    result = place.plan_all(s, capacity="measured", replay_method="fluid")
    assert result["paper"]["replay"]["total_req_s"] == pytest.approx(128.7, rel=0.02)
    assert result["memp"]["replay"]["total_req_s"] == pytest.approx(72.1, rel=0.02)
    assert result["ours"]["replay"]["total_req_s"] / result["memp"]["replay"]["total_req_s"] >= 1.78


def test_fluid_queue_within_capacity_has_no_wait_and_finishes_at_the_horizon():
    samples, finish = place.fluid_queue([2.0] * 10, [4.0] * 10, 1.0, service_s=0.5)
    assert place.quantile(samples, 0.99) == pytest.approx(0.5)
    assert finish == pytest.approx(10.5)


def test_fluid_queue_overloaded_finishes_when_capacity_has_served_everything():
    samples, finish = place.fluid_queue([4.0] * 10, [2.0] * 10, 1.0)
    assert finish == pytest.approx(20.0)
    # the last arrival (t = 9.5 s) waits for 19 - 9.5 s of backlog ahead of it
    assert max(v for v, _ in samples) == pytest.approx(19.0 - 9.5, abs=0.1)


def test_plan_json_names_ours_memp_and_paper():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario", TABLE1,
                          "--capacity", "measured", "--replay", "fluid", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {"ours", "memp", "paper"} <= set(doc)
    for name in ("ours", "memp", "paper"):
        assert set(doc[name]["replay"]) >= {"total_req_s", "per_model_req_s", "p50_ms", "p99_ms"}
        assert all(set(r) >= {"model", "gpu", "tp", "instances", "weight"} for r in doc[name]["placement"])


def test_plan_with_a_missing_scenario_exits_2_with_one_line():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario", "/nonexistent.json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "cannot read" in out.stderr


@pytest.mark.slow
def test_table1_in_the_simulator_ours_beats_the_papers_placement_and_memp_by_178_percent():
    s = table1()
    result = place.plan_all(s, capacity="measured", replay_method="sim")
    ours, paper, memp = (result[k]["replay"]["total_req_s"] for k in ("ours", "paper", "memp"))
    assert ours >= paper
    assert ours / memp >= 1.78


def run_place(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("content", ["[]", "[{\"model\": \"x\"}]", "3"])
def test_plan_with_a_scenario_that_is_a_json_list_exits_2_with_one_line(tmp_path, content):
    path = tmp_path / "s.json"
    path.write_text(content)
    out = run_place("plan", "--scenario", str(path))
    assert out.returncode == 2 and "scenario must be a JSON object" in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr


def test_plan_report_states_energy_per_output_token_beside_the_papers_figure():
    s = table1()
    result = place.plan_all(s, capacity="measured", replay_method="fluid", baseline=False)
    energy = result["ours"]["energy"]
    assert 0.05 < energy["kwh_per_million_tokens"] < 1.0
    assert energy["kwh_per_million_tokens"] == pytest.approx(energy["j_per_output_token"] / 3.6)
    assert "0.16-0.25 kWh/M tokens" in place.format_plan(s, result)


def test_plan_uses_probed_engine_overheads_for_its_capacities(tmp_path):
    s = table1()
    key = ("meta-llama/Llama-2-13b-hf", "A100-80GB-SXM4", 1)
    config = s["models"][key[0]]
    before = place.sim_candidate(key[0], config, key[1], key[2], place.workload_of(s, key[0]))[0].capacity_rps
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps({"probes": [{"engine_version": "vllm-0.6", "overhead_ms": 30.0,
                                              "per_seq_overhead_ms": 0.1}]}))
    saved = dict(otela_sim._ACTIVE)
    try:
        place.use_probes(str(probes))
        after = place.sim_candidate(key[0], config, key[1], key[2], place.workload_of(s, key[0]))[0].capacity_rps
    finally:
        otela_sim._ACTIVE.clear()
        otela_sim._ACTIVE.update(saved)
    assert after < before * 0.8       # a slow engine step serves fewer requests per second


def test_plan_with_a_bad_probes_file_exits_2_with_one_line(tmp_path):
    probes = tmp_path / "probes.json"
    probes.write_text("[]")
    out = run_place("plan", "--scenario", os.path.join(ROOT, "tests", "data", "table1_scenario.json"),
                    "--probes", str(probes))
    assert out.returncode == 2 and "probes" in out.stderr and out.stderr.strip().count("\n") == 0


def test_plan_into_a_closed_pipe_is_one_line_and_exit_2():
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario",
                              os.path.join(ROOT, "tests", "data", "table1_scenario.json"), "--capacity", "measured",
                              "--replay", "fluid"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert out.returncode == 2 and "broken pipe" in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr


def test_plan_engine_flag_sets_the_engine_the_simulator_assumes_and_rejects_unknown_ones():
    s = table1()
    key = ("meta-llama/Llama-2-13b-hf", "A100-80GB-SXM4", 1)
    config = s["models"][key[0]]
    saved = place.SIM_ENGINE
    try:
        place.use_engine("vllm")
        assert place.SIM_ENGINE == "vllm-0.6"
        v0 = place.sim_latency_ms(config, key[1], key[2], place.workload_of(s, key[0]))
        place.use_engine("trtllm-0.10")
        trt = place.sim_latency_ms(config, key[1], key[2], place.workload_of(s, key[0]))
        assert trt != v0
        with pytest.raises(place.PlacementError, match="unknown engine"):
            place.use_engine("tgi")
    finally:
        place.SIM_ENGINE = saved
