"""Pipeline parallelism and the inter-node fabric: the layout API the placer codes against."""
import pytest

import otela_sim as sim


def test_pp_1_gives_the_same_numbers_as_before_pipelines_existed():
    for model, gpu, tp in [("llama-3.1-70b", "H100", 4), ("mixtral-8x7b", "A100", 2), ("qwen3-8b", "GH200", 1)]:
        old = sim.estimate(model, gpu, tp, 8, 512, 128)
        new = sim.estimate(model, gpu, tp, 8, 512, 128, pp=1, fabric=None)
        for key in ("ttft_ms", "decode_ms_per_token", "e2e_ms", "memory_gb_per_gpu", "max_batch"):
            assert new[key] == old[key]
        assert sim.max_batch(model, gpu, tp, 2048) == sim.max_batch(model, gpu, tp, 2048, pp=1)
        assert sim.memory_gb_per_gpu(model, gpu, tp) == sim.memory_gb_per_gpu(model, gpu, tp, pp=1)


@pytest.mark.parametrize("gpu, tp, pp, per_node, nodes", [
    ("H100", 8, 1, None, 1), ("H100", 8, 2, None, 2), ("H100", 4, 2, None, 1), ("H100", 4, 4, None, 2),
    ("H100", 16, 1, None, 2), ("H100", 16, 2, None, 4), ("GH200", 4, 4, None, 4), ("GH200", 2, 4, None, 2),
    ("H100", 2, 3, 4, 2),
])
def test_nodes_for_fills_a_node_with_stages_before_the_next(gpu, tp, pp, per_node, nodes):
    assert sim.nodes_for(gpu, tp, pp, per_node) == nodes


def test_a_pp_that_does_not_divide_the_layers_is_refused_naming_both():
    with pytest.raises(sim.SimError, match=r"pp=3 does not divide the 80 layers of .*Llama-3.1-70B"):
        sim.check_config("llama-3.1-70b", "H100", 8, pp=3)
    with pytest.raises(sim.SimError, match="pp=3 does not divide"):
        sim.estimate("llama-3.1-70b", "H100", 8, pp=3)
    sim.check_config("llama-3.1-70b", "H100", 8, pp=4)


def test_tp_wider_than_a_node_needs_a_layout_that_says_it_spans_whole_nodes():
    with pytest.raises(sim.SimError, match="GPUs of a"):
        sim.check_config("llama-2-70b", "H100", 16)                    # single-node engine
    sim.check_config("llama-2-70b", "H100", 16, nnodes=2)              # SGLang --tp 16 --nnodes 2
    with pytest.raises(sim.SimError, match="takes 4 nodes, not 2"):
        sim.check_config("llama-2-70b", "H100", 16, pp=2, nnodes=2)
    with pytest.raises(sim.SimError, match="whole number of nodes"):
        sim.check_config("llama-2-70b", "H100", 16, per_node=6, nnodes=3)


def test_each_stage_holds_its_share_of_the_layers_and_kv():
    one = sim.StepCost(sim.MODELS["llama-3.1-70b"], sim.GPUS["H100-SXM5-80GB"], 8)
    two = sim.StepCost(sim.MODELS["llama-3.1-70b"], sim.GPUS["H100-SXM5-80GB"], 8, pp=2)
    assert two.kv_bytes_per_token == one.kv_bytes_per_token / 2
    embed = 128256 * 8192 / 8 * 2                       # one of embedding / lm_head per stage, bf16
    assert two.weights_bytes == pytest.approx((one.weights_bytes - 2 * embed) / 2 + embed)
    assert sim.max_batch("llama-3.1-70b", "H100", 8, 4096, pp=2) > 2 * sim.max_batch("llama-3.1-70b", "H100", 8, 4096)


def test_a_lone_request_gains_nothing_from_a_pipeline_a_full_one_does():
    # batch 1: one microbatch walks the stages one after the other (the bubble): no faster
    # than one stage's GPUs; batch 64 fills 2 stages and nearly doubles the throughput of
    # what the same model does on tp=8 alone at the same batch (half the weights per GPU)
    alone = sim.estimate("llama-3.1-70b", "H100", 8, 1, 512, 128)
    pipe = sim.estimate("llama-3.1-70b", "H100", 8, 1, 512, 128, pp=2)
    assert pipe["decode_ms_per_token"] >= alone["decode_ms_per_token"]
    assert pipe["nodes"] == 2 and pipe["gpus"] == 16 and pipe["fabric"] == "ib-ndr-x8"
    one_b, two_b = sim.estimate("llama-3.1-70b", "H100", 8, 64, 512, 128), \
        sim.estimate("llama-3.1-70b", "H100", 8, 64, 512, 128, pp=2)
    assert two_b["decode_ms_per_token"] < one_b["decode_ms_per_token"]


def test_a_slower_fabric_is_never_faster_and_a_custom_one_is_read():
    fast = sim.estimate("llama-3.1-70b", "H100", 8, 16, 1024, 128, pp=2)
    slow = sim.estimate("llama-3.1-70b", "H100", 8, 16, 1024, 128, pp=2, fabric="ethernet-100")
    custom = sim.estimate("llama-3.1-70b", "H100", 8, 16, 1024, 128, pp=2, fabric="1:200:1")
    assert fast["ttft_ms"] < slow["ttft_ms"] < custom["ttft_ms"]
    assert sim.resolve_fabric("12.5:3:2").GBps_for(8) == 25.0
    with pytest.raises(sim.SimError, match="unknown fabric"):
        sim.resolve_fabric("carrier-pigeon")


def test_every_gpu_row_has_a_fabric_with_a_source():
    for gpu in sim.GPUS.values():
        fab = sim.resolve_fabric(None, gpu)
        assert fab.nic_GBps > 0 and fab.source


def _cli(*args):
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run([sys.executable, os.path.join(here, "..", "otela_sim.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_estimate_prints_the_layout_and_refuses_a_pp_that_does_not_divide():
    p = _cli("estimate", "--model", "qwen3-235b-a22b", "--gpu", "H100", "--tp", "8", "--pp", "2", "--batch", "16")
    assert p.returncode == 0, p.stderr
    layout = next(line for line in p.stdout.splitlines() if line.startswith("layout"))
    assert "2 node(s)" in layout and "16 GPUs" in layout and "ib-ndr-x8" in layout and "GB per GPU" in layout
    bad = _cli("estimate", "--model", "deepseek-v3", "--gpu", "H100", "--tp", "8", "--pp", "2")
    assert bad.returncode != 0 and "pp=2 does not divide the 61 layers" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    odd = _cli("estimate", "--model", "llama-3.1-70b", "--gpu", "GH200", "--tp", "8", "--pp", "1", "--fabric", "x")
    assert odd.returncode != 0 and "unknown fabric" in odd.stderr
    odd = _cli("estimate", "--model", "qwen2.5-72b", "--gpu", "GH200", "--tp", "16")
    assert odd.returncode == 0 and "4 node(s)" in odd.stdout, odd.stderr


def test_a_replay_placement_may_name_stages_a_fabric_and_the_nodes_of_tp_across_them():
    scenario = {"duration_s": 20, "gpus": [{"type": "H100", "count": 16, "per_node": 8}],
                "workload": [{"model": "llama-3.1-70b", "rate_rps": 2.0, "input": {"mean": 512, "std": 0},
                              "output": {"mean": 64, "std": 0}}]}
    pp = sim.replay(scenario, [{"model": "llama-3.1-70b", "gpu": "H100", "tp": 8, "pp": 2, "instances": 1}])
    wide = sim.replay(scenario, [{"model": "llama-3.1-70b", "gpu": "H100", "tp": 16, "nnodes": 2, "instances": 1,
                                  "fabric": "ib-hdr-x8"}])
    assert pp["completed"] == wide["completed"] == pp["requests"] and pp["unserved"] == 0
    # the pipeline's lone microbatches walk 80 layers on 8 GPUs; tp=16 reads half the weights
    # a GPU but all-reduces across nodes: both answer, neither is free
    assert pp["p50_ms"] > 0 and wide["p50_ms"] > 0 and pp["p50_ms"] != wide["p50_ms"]
    with pytest.raises(sim.SimError, match="GPUs of a"):
        sim.replay(scenario, [{"model": "llama-3.1-70b", "gpu": "H100", "tp": 16, "instances": 1}])
