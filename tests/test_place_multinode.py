"""Models bigger than a node: the placer plans (model, GPU, tp, pp, nodes) for a model no node
holds, counts whole nodes, refuses bad layouts in one line, and renders a job over several
nodes; single-node keys, comments and scripts stay what they were."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place as place  # noqa: E402
import otela_sim as sim  # noqa: E402

LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192}
LLAMA_405B = {"hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
              "intermediate_size": 53248, "vocab_size": 128256, "max_position_embeddings": 8192}
WORK = {"input": {"mean": 512}, "output": {"mean": 128}}


def mixed_site(rate_70b=2.0, rate_405b=1.0):
    """8 nodes of 1 A100-80GB and 8 nodes of 4 H100 (one GPU type per node size)."""
    return {"gpus": [{"type": "A100-80GB-SXM4", "count": 8, "per_node": 1},
                     {"type": "H100-SXM5-80GB", "count": 32, "per_node": 4}],
            "models": {"llama-70b": LLAMA_70B, "llama-405b": LLAMA_405B},
            "workload": [dict(WORK, model="llama-70b", rate_rps=rate_70b),
                         dict(WORK, model="llama-405b", rate_rps=rate_405b)]}


def test_a_model_no_node_holds_gets_candidates_over_whole_nodes_with_pp_dividing_its_layers():
    cands, why_not = place.candidates(mixed_site())
    assert why_not == {}
    big = [c for c in cands if c.model == "llama-405b"]
    # no 1-GPU A100 node set holds it within 8 nodes; on 4-GPU H100 nodes: tp = 4, the fewest stages
    assert big and all(c.gpu == "H100-SXM5-80GB" and c.tp == 4 and c.pp > 1 for c in big)
    assert all(126 % c.pp == 0 and c.nodes == c.pp and c.gpus == 4 * c.pp for c in big)
    small = {(c.gpu, c.tp, c.pp) for c in cands if c.model == "llama-70b"}
    # a 4-GPU node holds the 70B (single-node candidates only there); 1-GPU nodes need stages
    assert all(pp == 1 for g, _, pp in small if g == "H100-SXM5-80GB")
    assert any(pp > 1 and tp == 1 for g, tp, pp in small if g == "A100-80GB-SXM4")


def test_a_site_of_1_and_4_gpu_nodes_places_a_70b_and_a_405b_within_its_nodes():
    scenario = mixed_site()
    cands, _ = place.candidates(scenario)
    plan = place.solve(place.demand_of(scenario), place.gpu_pool(scenario), cands)
    rows = {place.row_key(r): r for r in plan.rows}
    big = [r for r in plan.rows if r["model"] == "llama-405b"]
    assert big and all(r["pp"] > 1 and r["nodes"] == r["pp"] and r["gpu"] == "H100-SXM5-80GB" for r in big)
    assert any(r["model"] == "llama-70b" for r in plan.rows)
    for gpu, (count, per_node) in place.gpu_pool(scenario).items():
        mine = [r for r in plan.rows if r["gpu"] == gpu]
        assert sum(place.row_gpus(r) * r["instances"] for r in mine) <= count
        assert sum(r.get("nodes", 0) * r["instances"] for r in mine) <= count // per_node
    assert plan.gpus_used == sum(place.row_gpus(r) * r["instances"] for r in rows.values())
    assert plan.ratio > 0


def test_multi_node_instances_take_whole_nodes_not_fragments():
    # 6 GPUs of nodes of 4: one whole node; a layout of 2 nodes cannot be placed, however many GPUs are free
    scenario = {"gpus": [{"type": "H100-SXM5-80GB", "count": 6, "per_node": 4}], "models": {"big": LLAMA_405B},
                "workload": [dict(WORK, model="big", rate_rps=1.0)]}
    cands = [place.Candidate("big", "H100-SXM5-80GB", 4, 1.0, pp=2, nodes=2),
             place.Candidate("big", "H100-SXM5-80GB", 1, 0.01)]
    plan = place.solve(place.demand_of(scenario), place.gpu_pool(scenario), cands)
    assert [(r["tp"], r.get("pp", 1)) for r in plan.rows] == [(1, 1)]


@pytest.mark.parametrize("measured, message", [
    ({"tp": 4, "pp": 3, "H100-SXM5-80GB": 1.0}, "pp=3 does not divide its 80 layers"),
    ({"tp": 4, "pp": 10, "H100-SXM5-80GB": 1.0}, "tp=4 x pp=10 takes 10 nodes of 4 H100-SXM5-80GB; the pool has 8"),
])
def test_a_bad_layout_is_a_one_line_error(measured, message):
    scenario = dict(mixed_site(), measured_instance_capacity_rps={"llama-70b": measured})
    with pytest.raises(place.PlacementError) as e:
        place.candidates(scenario, "measured")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_model_bigger_than_every_node_set_says_why_in_one_line():
    scenario = {"gpus": [{"type": "A100-80GB-SXM4", "count": 4, "per_node": 1}], "models": {"big": LLAMA_405B},
                "workload": [dict(WORK, model="big", rate_rps=1.0)]}
    cands, why_not = place.candidates(scenario)
    assert cands == [] and "does not fit the 4 whole nodes of 1" in why_not["big"]


def test_keys_comments_and_labels_carry_pp_only_over_several_nodes():
    assert place.job_comment(("m", "H100", 4)) == "otela|m|H100|4"
    assert place.job_comment(("m", "H100", 4, 6)) == "otela|m|H100|4|6"
    jobs = place.parse_squeue("1 RUNNING otela|m|H100|4\n2 RUNNING otela|m|H100|4|6\n"
                              "3 RUNNING otela-drain|1700000000|m|H100|4|6\n")
    assert [(j["key"], j["draining_since"]) for j in jobs] == [
        (("m", "H100", 4), None), (("m", "H100", 4, 6), None), (("m", "H100", 4, 6), 1700000000)]
    session = {"labels": {"otela.model": "m", "otela.gpu": "H100", "otela.tp": "4", "otela.pp": "6"}}
    assert place.session_key(session) == ("m", "H100", 4, 6)
    rows = [{"model": "m", "gpu": "H100", "tp": 4, "pp": 6, "nodes": 6, "instances": 1, "weight": 1.0}]
    assert place.reconcile_actions(rows, jobs[1:2])["submit"] == {}


SITE = {"gpus": [{"type": "H100", "count": 4, "per_node": 1, "gres": "gpu", "partition": "mlab"}]}
VARS = {"KEY_FILE": "/k", "BOOTSTRAP": "login1:7946"}
ROW = {"model": "Qwen/Qwen3-32B", "gpu": "H100", "tp": 1, "pp": 2, "nodes": 2, "instances": 1, "weight": 1.0}


@pytest.mark.parametrize("template", ["vllm", "sglang"])
def test_a_job_over_several_nodes_asks_slurm_for_them_and_starts_every_rank(template):
    site = place.check_site(SITE, "site.json")
    (key, name, text), = place.job_scripts([ROW], site, template, VARS)
    assert key == ("Qwen/Qwen3-32B", "H100", 1, 2) and name.endswith("-tp1-pp2-0.sbatch")
    directives = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert "--nodes=2" in directives and "--ntasks-per-node=1" in directives and "--gres=gpu:1" in directives
    assert "--comment=otela|Qwen/Qwen3-32B|H100|1|2" in directives
    assert re.search(r"^NODES=2$", text, re.M) and re.search(r"^PP=2$", text, re.M)
    assert 'source "$OTELA_DIR/sbatch/ranks.sh"' in text
    with open(os.path.join(ROOT, "sbatch", "ranks.sh")) as f:
        assert "--kill-on-bad-exit=1" in f.read()


def test_a_single_node_job_renders_as_it_always_did():
    site = place.check_site(SITE, "site.json")
    row = dict(ROW, pp=1, nodes=1)
    del row["pp"], row["nodes"]
    (key, name, text), = place.job_scripts([row], site, "vllm", VARS)
    assert key == ("Qwen/Qwen3-32B", "H100", 1) and name.endswith("-tp1-0.sbatch")
    assert "#SBATCH --nodes=1\n" in text and "--comment=otela|Qwen/Qwen3-32B|H100|1\n" in text


def test_a_template_of_one_node_refuses_a_model_bigger_than_a_node():
    site = place.check_site(SITE, "site.json")
    with pytest.raises(place.PlacementError, match="runs one node; Qwen/Qwen3-32B needs 2"):
        place.job_scripts([ROW], site, "llamacpp", dict(VARS, MODEL_FILE="-"))


def test_a_session_of_several_nodes_publishes_its_nodes_gpus_and_layout():
    import otela_node
    hw = {"gpu": "H100", "count": 1, "memory_gb": 80.0}
    env = {"OTELA_INSTANCE_NODES": "otm1,otm2", "OTELA_INSTANCE_TP": "1", "OTELA_INSTANCE_PP": "2"}
    assert otela_node.instance_layout(hw, env) == dict(hw, nodes=["otm1", "otm2"], tp=1, pp=2, count=2)
    assert otela_node.instance_layout(hw, {}) == hw            # one node: as detected
    assert otela_node.instance_layout(hw, dict(env, OTELA_INSTANCE_PP="x")) == hw


def test_a_built_in_model_keeps_its_experts_and_quantization_through_the_placer():
    # resolved once at the border: Qwen3-235B-A22B is 470 GB of weights, not a dense 22B
    config = place.model_config("Qwen/Qwen3-235B-A22B")
    scenario = {"gpus": [{"type": "H100-SXM5-80GB", "count": 16, "per_node": 4}], "models": {"qwen": config},
                "workload": [dict(WORK, model="qwen", rate_rps=1.0)]}
    cands, why_not = place.candidates(scenario)
    assert [(c.tp, c.pp, c.nodes) for c in cands] == [(4, 2, 2)] and why_not == {}
    # DeepSeek-V3's 61 layers admit no pipeline split: one line says so
    scenario["models"] = {"qwen": place.model_config("deepseek-ai/DeepSeek-V3")}
    assert "no pp from 2 to 4 divides its 61 layers" in place.candidates(scenario)[1]["qwen"]


# --- tp across nodes: an engine that runs it (SGLang --tp 16 --nnodes 2) -----------------------

def deepseek_site(gpu, count, per_node, across):
    scenario = {"gpus": [{"type": gpu, "count": count, "per_node": per_node}],
                "models": {"dsv3": place.model_config("deepseek-ai/DeepSeek-V3")},
                "workload": [dict(WORK, model="dsv3", rate_rps=1.0)]}
    if across is not None:
        scenario["tp_across_nodes"] = across
    return place.check_scenario(scenario)


@pytest.mark.parametrize("gpu, per_node, tp, nodes", [("H100-SXM5-80GB", 8, 16, 2), ("GH200-96GB", 4, 16, 4)])
def test_deepseek_v3_whose_61_layers_take_no_pp_is_planned_with_tp_across_whole_nodes(gpu, per_node, tp, nodes):
    cands, why_not = place.candidates(deepseek_site(gpu, 4 * per_node, per_node, True))
    assert why_not == {}
    assert [(c.tp, c.pp, c.nodes, c.gpus) for c in cands] == [(tp, 1, nodes, tp)]
    assert cands[0].key() == ("dsv3", gpu, tp) and cands[0].capacity_rps > 0
    plan = place.solve(place.demand_of(deepseek_site(gpu, 4 * per_node, per_node, True)),
                       {gpu: (4 * per_node, per_node)}, cands)
    assert [(r["tp"], r.get("pp", 1), r["nodes"]) for r in plan.rows] == [(tp, 1, nodes)]


@pytest.mark.parametrize("across", [None, False, ["another-model"]])
def test_an_engine_without_tp_across_nodes_leaves_deepseek_v3_unplanned_and_says_why(across):
    cands, why_not = place.candidates(deepseek_site("H100-SXM5-80GB", 32, 8, across))
    assert cands == [] and "no pp from 2 to 4 divides its 61 layers" in why_not["dsv3"]


def test_a_model_both_families_hold_gets_the_fewest_nodes_of_each():
    # Llama-3.1-405B in BF16 (8k context) on 8-GPU H100 nodes: tp 8 x pp 2 and tp 16, 2 nodes each
    scenario = {"gpus": [{"type": "H100-SXM5-80GB", "count": 48, "per_node": 8}], "models": {"big": LLAMA_405B},
                "workload": [dict(WORK, model="big", rate_rps=1.0)], "tp_across_nodes": True}
    cands, _ = place.candidates(scenario)
    assert sorted((c.tp, c.pp, c.nodes) for c in cands) == [(8, 2, 2), (16, 1, 2)]


def test_a_site_of_1_and_4_gpu_nodes_with_tp_across_nodes_places_a_70b_and_a_405b():
    scenario = dict(mixed_site(), tp_across_nodes=True)
    cands, why_not = place.candidates(scenario)
    assert why_not == {}
    plan = place.solve(place.demand_of(scenario), place.gpu_pool(scenario), cands)
    assert {r["model"] for r in plan.rows} == {"llama-70b", "llama-405b"}
    for gpu, (count, per_node) in place.gpu_pool(scenario).items():
        mine = [r for r in plan.rows if r["gpu"] == gpu]
        assert sum(r.get("nodes", 1) * r["instances"] for r in mine if r.get("nodes", 1) > 1) <= count // per_node


def test_a_measured_tp_across_nodes_needs_an_engine_that_runs_it():
    figures = {"dsv3": {"tp": 16, "H100-SXM5-80GB": 2.0}}
    scenario = dict(deepseek_site("H100-SXM5-80GB", 32, 8, True), measured_instance_capacity_rps=figures)
    cands, _ = place.candidates(scenario, "measured")
    assert [(c.tp, c.pp, c.nodes, c.capacity_rps) for c in cands] == [(16, 1, 2, 2.0)]
    scenario["tp_across_nodes"] = False
    cands, why_not = place.candidates(scenario, "measured")
    assert cands == [] and "tp=16 exceeds the 8 GPUs of one node" in why_not["dsv3"]


def test_a_scenario_with_a_bad_tp_across_nodes_is_a_one_line_error():
    with pytest.raises(place.PlacementError, match="'tp_across_nodes' must be true, false or a list of model names"):
        deepseek_site("H100-SXM5-80GB", 16, 8, "yes")


def test_a_job_of_tp_across_nodes_asks_each_node_for_its_share_of_the_gpus():
    site = place.check_site({"gpus": [{"type": "H100", "count": 16, "per_node": 8, "gres": "gpu"}]}, "site.json")
    row = {"model": "deepseek-ai/DeepSeek-V3", "gpu": "H100", "tp": 16, "nodes": 2, "instances": 1, "weight": 1.0}
    (key, name, text), = place.job_scripts([row], site, "sglang", VARS)
    assert key == ("deepseek-ai/DeepSeek-V3", "H100", 16) and name.endswith("-tp16-0.sbatch")
    directives = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert "--nodes=2" in directives and "--gres=gpu:8" in directives
    assert re.search(r"^TP=16$", text, re.M) and re.search(r"^PP=1$", text, re.M)


SOURCED = os.path.join(ROOT, "tests", "data", "large_model_sourced.csv")


def test_the_simulator_behind_large_model_candidates_is_within_a_stated_error_of_sourced_figures():
    rows = sim.load_calibration(SOURCED)
    assert all(r["source"] and "https://" in r["source_locator"] for r in rows)
    held = [r for r in rows if sim.held_out(r)]
    assert 0 < len(held) < len(rows)
    v = sim.validate(rows)
    # nothing is fitted on this file. As of this commit (TensorRT-LLM's 405B FP8 tp 8 on H200, batch
    # capped at 256 here where the engine goes past it): in-sample 31 % median (38 % worst), held
    # out 16 % (25 % worst), every prediction below the figure
    assert v["summary"]["all"]["median_abs_error"] < 0.35 and v["summary"]["all"]["max_abs_error"] < 0.42
    assert v["held_out_summary"]["median_abs_error"] < 0.20 and v["held_out_summary"]["max_abs_error"] < 0.30
    assert all(r["error"] < 0 for r in v["rows"])


@pytest.mark.parametrize("template, expect", [
    ("sglang", "DeepSeek-V3 1xH100-SXM5-80GB tp16 (2 nodes)"),
    ("vllm", "no pp from 2 to 2 divides its 61 layers (tp across nodes needs an engine that runs it: the sglang template)"),
])
def test_plan_with_the_sglang_template_places_deepseek_v3_over_two_8_gpu_nodes(tmp_path, template, expect):
    scenario = {"gpus": [{"type": "H100-SXM5-80GB", "count": 16, "per_node": 8}],
                "models": {"deepseek-ai/DeepSeek-V3": sim.BUILTIN_CONFIGS["deepseek-v3"]},
                "workload": [dict(WORK, model="deepseek-ai/DeepSeek-V3", rate_rps=1.0)]}
    (tmp_path / "s.json").write_text(json.dumps(scenario))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "otela_place.py"), "plan", "--scenario",
                          str(tmp_path / "s.json"), "--template", template, "--baseline", "none", "--replay", "fluid"],
                         capture_output=True, text=True, timeout=300)
    assert expect in out.stdout + out.stderr


def test_the_gpus_our_running_multi_node_jobs_hold_are_all_their_ranks(monkeypatch):
    monkeypatch.setattr(place, "slurm_inventory", lambda aliases: {"gpus": [{"type": "H100", "count": 0, "per_node": 8}]})
    monkeypatch.setattr(place, "slurm_jobs", lambda: [
        {"id": "1", "state": "RUNNING", "draining_since": None, "key": ("big", "H100", 8, 2)},
        {"id": "2", "state": "RUNNING", "draining_since": None, "key": ("dsv3", "H100", 16)},
        {"id": "3", "state": "RUNNING", "draining_since": None, "key": ("small", "H100", 2)}])
    assert place.slurm_gpus({}, kept=set())["gpus"] == [{"type": "H100", "count": 34, "per_node": 8}]
