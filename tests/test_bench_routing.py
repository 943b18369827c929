"""The routing benchmark (tests/bench_routing.py) runs end to end: `--quick` starts a measured
fleet of emulated engines, otela's ingress and nodes and a peer router, and writes its figures
(agent loops, the alternating case's and the warm case's too).
What is checked is the JSON's shape and that every request was answered, never a speed."""
import json
import subprocess
import sys

import bench_routing
import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_the_quick_routing_bench_writes_each_policys_figures_and_the_ratios(tmp_path):
    _, missing = bench_routing.routers_dir(None)         # installs them into .cache/routers when it can
    if len(missing) == len(bench_routing.ROUTER_SPECS):
        pytest.skip("no peer router: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "bench_routing.py"), "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "routing.json").read_text())
    assert result["time_scale"] >= 1
    capacity = result["capacity"]["shared_prefix"]
    assert capacity["req_s_at_scale_1"] > 0
    assert capacity["req_s_at_scale_k"] == pytest.approx(capacity["req_s_at_scale_1"] / result["time_scale"])
    cases = result["cases"]["shared_prefix 80%"]
    assert len(cases) == 2 and any(k.startswith("otela ") for k in cases) and \
        any(not k.startswith("otela ") for k in cases)
    for label, f in cases.items():
        assert f["ok"] == f["requests"] > 0 and f["errors"] == 0, (label, f)
        assert 0 < f["ttft_p50_ms"] <= f["ttft_p99_ms"] <= f["e2e_p99_ms"], (label, f)
        assert f["output_tok_s"] > 0 and 0 <= f["hit_rate"] <= 1, (label, f)
        # every answer found in the engines' request log by its id: the TTFT split in two
        assert f["engine_matched"] == f["ok"], (label, f)
        assert 0 < f["engine_ttft_p50_ms"] <= f["engine_ttft_p99_ms"] and f["path_p50_ms"] > 0, (label, f)
        assert 0 < f["engine_floor_p99_ms"], (label, f)
    ratios = result["ratios"]["shared_prefix 80%"]
    assert set(ratios) >= {"policy", "ttft_p99_vs_best_peer", "hit_rate_vs_best_peer", "throughput_vs_best_peer"}
    assert "otela ttft" in cases if "ttft" in bench_routing.otela_ingress.POLICIES else "otela least_loaded" in cases
    # the agentic loops (issue 44): every turn answered through two ingresses and two routers,
    # their later turns apart; the alternating case's two ingresses against one
    loops = result["cases"]["agentic x2"]
    assert "otela ttft" in loops and any(not k.startswith("otela ") for k in loops)
    for label, f in loops.items():
        assert f["ok"] == f["requests"] > 4 and f["ingresses"] == 2, (label, f)
        assert 0 < f["turns_2plus"]["requests"] < f["requests"], (label, f)
    assert {"ttft_p99_vs_best_peer", "hit_rate_vs_best_peer"} <= set(result["ratios"]["agentic x2"])
    alternating = result["alternating"]["gap 0.3s"]
    assert alternating["otela ttft x1"]["ok"] == alternating["otela ttft x2"]["ok"] == 48
    assert alternating["x2_hit_rate_vs_x1"] > 0 and alternating["x2_ttft_p99_vs_x1"] > 0
    # the warm case (issue 44 item 3): the same loops and flood through one ingress, the rule on
    # and off, every turn and flood request answered, and the fair queue held the flood
    warm = result["warm"]
    assert [r["label"] for r in warm["runs"]] == [f"rule on, age {warm['runs'][0]['queue_age_s']:g} s",
                                                  f"rule off, age {warm['runs'][0]['queue_age_s']:g} s"]
    for f in warm["runs"]:
        assert f["turns_2plus"]["ok"] == f["turns_2plus"]["requests"] > 0, f
        assert f["flood"]["ok"] == f["flood"]["requests"] == warm["flood_sent"] > 0, f
        assert f["queue"]["waited"] > 0, f


def _line(i, arrived, e2e_ms, prompt, cached=0, engine="aa"):
    return {"id": f"chatcmpl-{engine}-{i}", "arrived": arrived, "e2e_ms": e2e_ms, "prompt_tokens": prompt,
            "cached_tokens": cached, "ttft_ms": 1.0}


def test_the_engine_floor_of_lone_requests_is_their_own_step_and_grows_with_the_streams_beside_them():
    cost = bench_routing.sim.serve_core(bench_routing.MODEL, bench_routing.GPU, engine=bench_routing.ENGINE).cost
    lone = [_line(i, i * 10.0, 100.0, 100) for i in range(100)]          # never two at once
    step = cost.step(100, 1, prefill_pairs=100 * 101 / 2, prefill_tokens=100)
    assert bench_routing.engine_floor_ms(lone, 1.0) == pytest.approx(step * 1e3, rel=1e-6)
    assert bench_routing.engine_floor_ms(lone, 5.0) == pytest.approx(step * 5e3, rel=1e-6)   # time-scaled
    crowded = [_line(i, i * 0.001, 10000.0, 100) for i in range(100)]   # each beside those before it
    assert bench_routing.engine_floor_ms(crowded, 1.0) > step * 1e3
    # the same requests spread over 100 engines are alone again; a cached prefix costs less
    spread = [_line(i, i * 0.001, 10000.0, 100, engine=f"e{i}") for i in range(100)]
    assert bench_routing.engine_floor_ms(spread, 1.0) == pytest.approx(step * 1e3, rel=1e-6)
    assert bench_routing.engine_floor_ms([_line(i, i * 10.0, 100.0, 100, cached=96) for i in range(100)], 1.0) < \
        step * 1e3
    assert bench_routing.engine_floor_ms([], 1.0) is None
