"""The routing benchmark (tests/bench_routing.py) runs end to end: `--quick` starts a measured
fleet of emulated engines, otela's ingress and nodes and a peer router, and writes its figures.
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
    ratios = result["ratios"]["shared_prefix 80%"]
    assert set(ratios) >= {"policy", "ttft_p99_vs_best_peer", "hit_rate_vs_best_peer", "throughput_vs_best_peer"}
    assert "otela ttft" in cases if "ttft" in bench_routing.otela_ingress.POLICIES else "otela least_loaded" in cases
