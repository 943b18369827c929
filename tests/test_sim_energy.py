"""The stated energy model: GPU power by roofline utilisation (what a GPU meter reads), a
host share per GPU, and idle power for the time a placed instance waits."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_place  # noqa: E402
import otela_sim  # noqa: E402

TINY = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 2048}


def test_node_energy_adds_the_host_share_of_every_gpu_to_the_gpu_energy():
    e = otela_sim.estimate("llama-3.1-8b", "H100", tp=2, batch=32, input_len=512, output_len=256)
    tdp = otela_sim.resolve_gpu("H100").tdp_w
    assert e["node_power_w_per_gpu"] == pytest.approx(e["power_w_per_gpu"] + otela_sim.HOST_POWER_SHARE * tdp)
    tokens = 32 * 256
    assert e["node_j_per_output_token"] == pytest.approx(e["node_power_w_per_gpu"] * 2 * e["e2e_ms"] / 1e3 / tokens)
    assert e["node_kwh_per_million_tokens"] == pytest.approx(e["node_j_per_output_token"] / 3.6)


def test_an_idle_instance_draws_its_gpus_idle_share_and_the_host_share():
    assert otela_sim.idle_power_w("H100", 2) == pytest.approx(700 * 2 * (0.15 + 0.4))
    assert otela_sim.idle_power_w("A100-40GB", 1) == pytest.approx(400 * 0.55)


@pytest.mark.parametrize("rate, load", [(1.0, 0.5), (2.0, 1.0), (3.0, 1.0)])
def test_placement_energy_charges_idle_time_to_the_tokens_an_underloaded_instance_serves(rate, load):
    scenario = {"gpus": [{"type": "H100", "count": 8, "per_node": 8}], "models": {"m": TINY},
                "workload": [{"model": "m", "rate_rps": rate, "input": {"mean": 100}, "output": {"mean": 50}}]}
    rows = [{"model": "m", "gpu": "H100", "tp": 1, "instances": 1, "weight": 1.0}]
    got = otela_place.placement_energy(scenario, rows, {("m", "H100", 1): 2.0})
    row = got["rows"][0]
    assert row["load"] == load
    idle = (1 - load) * otela_sim.idle_power_w("H100", 1) / (load * 2.0 * 50)
    assert row["node_j_with_idle"] == pytest.approx(row["node_j_per_output_token"] + idle)
    assert got["node_j_per_output_token"] == pytest.approx(row["node_j_with_idle"])
    assert got["j_per_output_token"] == pytest.approx(row["j_per_output_token"])  # the GPU figure has no idle
