"""Models from any Hugging Face config.json: what is modelled, what is refused, and the
built-in large and sparse models' sizes against their publishers' figures."""
import copy
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import otela_sim as sim

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("key, total, active, with_embedding", [
    ("llama-3.1-405b", 405e9, None, False),            # Meta: 405B
    ("deepseek-v3", 671e9, 37e9, False),               # DeepSeek-V3 report: 671B total, 37B activated (MTP apart)
    ("deepseek-r1", 671e9, 37e9, False),
    ("qwen3-235b-a22b", 235e9, 22e9, True),            # Qwen3 model card: 235B total, 22B activated
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, True),            # Qwen3 model card: 30.5B, 3.3B activated
    ("gpt-oss-120b", 117e9, 5.1e9, False),             # OpenAI gpt-oss card: 116.8B total, 5.1B active
    ("gpt-oss-20b", 21e9, 3.6e9, False),               # 20.9B total, 3.6B active
    ("mixtral-8x22b", 141e9, 39e9, True),              # Mistral: 141B, 39B active
    ("llama-4-scout-17b-16e", 109e9, 17e9, True),      # Meta: 109B total (vision tower included), 17B active
    ("apertus-8b", 8.05e9, None, False), ("apertus-70b", 70.6e9, None, False),   # swiss-ai model cards
])
def test_built_in_large_models_have_their_published_parameter_counts(key, total, active, with_embedding):
    m = sim.MODELS[key]
    assert m.params == pytest.approx(total, rel=0.03)
    if active:
        # active_params counts the lm_head, not the input embedding's look-up (OpenAI's and
        # DeepSeek's convention); Qwen, Mistral and Meta count the embedding too
        counted = m.active_params + (m.vocab_size * m.hidden_size if with_embedding else 0)
        assert counted == pytest.approx(active, rel=0.03)


def test_checkpoint_sizes_follow_their_quantisation():
    assert sim.MODELS["gpt-oss-120b"].weights_gb() == pytest.approx(65, rel=0.05)     # the mxfp4 release: ~65 GB
    assert sim.MODELS["deepseek-v3"].weights_gb() == pytest.approx(672, rel=0.03)     # FP8, embeddings bf16
    assert sim.MODELS["llama-4-scout-17b-16e"].weights_gb() == pytest.approx(216, rel=0.03)


def test_deepseek_v3_memory_holds_every_expert_and_a_latent_kv_cache():
    c = sim.StepCost(sim.MODELS["deepseek-v3"], sim.GPUS["H200-SXM-141GB"], 8)
    assert c.weights_bytes * 8 / 1e9 == pytest.approx(672, rel=0.03)
    # the latent (512) and its rope key (64), bf16, per layer; replicated on every tp rank
    assert c.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert sim.estimate("deepseek-v3", "H200", 8, 1, 1024, 128)["fits"]
    assert not sim.estimate("deepseek-v3", "H100", 8, 1, 1024, 128)["fits"]       # 672 GB > 8 x 72


def test_decode_reads_only_the_experts_a_batch_touches():
    m = sim.MODELS["qwen3-235b-a22b"]
    c = sim.StepCost(m, sim.GPUS["H100-SXM5-80GB"], 8)
    # batch 1 reads 8 of 128 experts a layer: about the active share of the weights; 256
    # tokens touch nearly all of them (1 - (1 - 8/128)^256 > 0.99)
    one, big = c.layers * c._linear(1) * c.bw_weights, c.layers * c._linear(256) * c.bw_weights
    assert one < 0.15 * c.weights_bytes
    assert big > 0.95 * c.weights_bytes


def test_deepseek_v3_config_is_no_longer_read_as_a_dense_77_gb_model():
    cfg = copy.deepcopy(sim.BUILTIN_CONFIGS["deepseek-v3"])
    m = sim.resolve_model(cfg, name="dsv3")
    assert m.params > 600e9 and m.mla and m.experts == 256 and m.n_moe_layers == 58
    assert sim.memory_gb_per_gpu(m, "H200", 8) > 80


def test_llama_4_scout_is_about_its_size_per_gpu_not_729_gb():
    mem = sim.memory_gb_per_gpu("llama-4-scout-17b-16e", "H100", 4)
    assert 216 / 4 < mem < 216 / 4 + 20
    # FP8 (compressed-tensors, as RedHatAI publishes it): half the weights
    cfg = copy.deepcopy(sim.BUILTIN_CONFIGS["llama-4-scout-17b-16e"])
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}}}
    fp8 = sim.resolve_model(cfg, name="scout-fp8")
    assert fp8.weights_gb() == pytest.approx(110, rel=0.05)


def test_mixtral_8x22b_is_estimated_without_a_file():
    e = sim.estimate("mistralai/Mixtral-8x22B-v0.1", "H100", 8, 8, 512, 128)
    assert e["fits"] and e["weights_gb_per_gpu"] == pytest.approx(281 / 8, rel=0.03)


def test_gpt_oss_windowed_layers_read_a_window_per_request_and_hold_no_per_token_kv():
    c = sim.StepCost(sim.MODELS["gpt-oss-120b"], sim.GPUS["H100-SXM5-80GB"], 1)
    assert (c.window, c.window_layers) == (128, 18)
    assert c.kv_bytes_per_token == 18 * 2 * 8 * 64 * 2            # the 18 full layers only
    short, long = c.step(1, 1, decode_ctx=100), c.step(1, 1, decode_ctx=8000)
    full = c.beta_layer * 36 * 7900
    assert long - short == pytest.approx(full / 2, rel=0.01)        # only the full half grows


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"kv_lora_rank": 512, "qk_nope_head_dim": None}, "missing qk_nope_head_dim"),
    ({"num_local_experts": 8}, "missing num_experts_per_tok"),
    ({"quantization_config": {"quant_method": "hqq"}}, "quantization method 'hqq' is not modelled"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}, "8-bit"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "3-bit"),
    ({"cross_attention_layers": [3, 8]}, "cross_attention_layers"),
    ({"index_topk": 2048}, "index_topk"),
    ({"my_new_routing_depth": 3}, "does not know: my_new_routing_depth"),
    ({"layer_types": ["linear_attention"] * 4}, "linear_attention"),
    ({"model_type": "gemma2"}, "model_type 'gemma2'"),
    ({"is_encoder_decoder": True}, "is_encoder_decoder"),
])
def test_a_config_the_roofline_cannot_model_is_refused_naming_the_field(change, message):
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}
    for k, v in change.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with pytest.raises(sim.SimError, match=message):
        sim.resolve_model(cfg, name="tiny")


def test_ignorable_fields_are_ignored_and_the_lists_do_not_overlap():
    assert not set(sim.CONFIG_IGNORED) & sim.CONFIG_READ
    assert not set(sim.CONFIG_REFUSED) & (sim.CONFIG_READ | set(sim.CONFIG_IGNORED))
    base = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}
    noisy = dict(base, rope_scaling={"rope_type": "yarn", "factor": 4}, n_group=8, topk_group=4,
                 architectures=["LlamaForCausalLM"], transformers_version="4.56.0", is_encoder_decoder=False)
    assert sim.resolve_model(noisy, name="t") == sim.resolve_model(base, name="t")


def test_four_bit_checkpoints_stream_a_quarter_of_the_bytes():
    base = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    awq = dict(base, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    full, q4 = sim.resolve_model(base, name="b"), sim.resolve_model(awq, name="q")
    assert q4.weights_gb() < 0.4 * full.weights_gb()       # the embeddings stay 16-bit
    slow = sim.estimate(full, "A100", 1, 1, 128, 128)["decode_ms_per_token"]
    fast = sim.estimate(q4, "A100", 1, 1, 128, 128)["decode_ms_per_token"]
    assert fast < 0.5 * slow
    with pytest.raises(sim.SimError, match="dtype"):
        sim.estimate(q4, "A100", 1, dtype="fp8")


def test_cli_refuses_an_unmodelled_config_with_one_line(tmp_path):
    cfg = dict(sim.BUILTIN_CONFIGS["deepseek-v3"], index_topk=2048)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, os.path.join(HERE, "..", "otela_sim.py"), "estimate", "--config", str(path),
                        "--gpu", "H200", "--tp", "8"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "index_topk" in p.stderr and len(p.stderr.strip().splitlines()) == 1


LARGE = os.path.join(HERE, "data", "large_model_validation.csv")


def test_large_model_figures_are_sourced_partly_held_out_and_within_a_stated_error():
    rows = sim.load_calibration(LARGE)
    assert all(r["source"] and r["source_locator"] for r in rows)
    held = [r for r in rows if sim.held_out(r)]
    assert 0 < len(held) < len(rows)
    v = sim.validate(rows)
    # nothing in this file is fitted (the calibration is tests/data/measured_calibration.csv's);
    # the errors as of this commit: in-sample 19 % median (26 % worst), held out 23 % (29 % worst)
    assert v["summary"]["all"]["median_abs_error"] < 0.25 and v["summary"]["all"]["max_abs_error"] < 0.30
    assert v["held_out_summary"]["median_abs_error"] < 0.30 and v["held_out_summary"]["max_abs_error"] < 0.35


# A config this file has no row for (Qwen/Qwen2-57B-A14B's config.json, as published): a
# Qwen2-MoE with a wide shared expert beside 64 routed ones.
QWEN2_57B = {
    "_name_or_path": "Qwen/Qwen2-57B-A14B", "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
    "hidden_size": 3584, "intermediate_size": 18944, "moe_intermediate_size": 2560,
    "shared_expert_intermediate_size": 20480, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": False, "vocab_size": 151936, "max_position_embeddings": 131072,
    "max_window_layers": 28, "sliding_window": 131072, "use_sliding_window": False, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "bos_token_id": 151643,
    "eos_token_id": 151643, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "transformers_version": "4.40.1"}


def test_a_config_never_seen_is_read_with_its_shared_expert():
    m = sim.resolve_model(QWEN2_57B, name="Qwen/Qwen2-57B-A14B")
    assert m.params == pytest.approx(57.4e9, rel=0.02)                        # "57B"
    assert m.active_params + m.vocab_size * m.hidden_size == pytest.approx(14e9, rel=0.03)   # "A14B"
    assert m.shared_intermediate_size == 20480 and m.sliding_layers == 0
    e = sim.estimate(m, "H100", 2, 32, 1024, 256)
    assert e["fits"] and e["weights_gb_per_gpu"] == pytest.approx(57.4, rel=0.03)


_IGNORABLE = sorted(k for k in sim.CONFIG_IGNORED if k not in ("vision_config",))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(_IGNORABLE), unique=True, max_size=12), st.integers(0, 10 ** 6))
def test_ignorable_fields_never_change_the_model_whatever_their_values(keys, value):
    base = dict(sim.BUILTIN_CONFIGS["qwen3-30b-a3b"])
    noisy = dict(base, **{k: value for k in keys})
    assert sim.resolve_model(noisy, name="q") == sim.resolve_model(base, name="q")


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["llama-3.1-70b", "qwen3-235b-a22b", "mixtral-8x22b", "gpt-oss-120b", "apertus-70b"]),
       st.sampled_from([1, 2, 4]), st.integers(1, 64), st.integers(16, 4096))
def test_more_stages_never_need_more_memory_per_gpu_and_never_speed_up_a_lone_request(key, tp, batch, ctx):
    m = sim.MODELS[key]
    pps = [p for p in (1, 2, 4, 8) if m.num_hidden_layers % p == 0]
    mems = [sim.memory_gb_per_gpu(m, "H200", tp, pp=p) for p in pps]
    assert all(b <= a + 1e-9 for a, b in zip(mems, mems[1:]))
    lone = [sim.estimate(m, "H200", tp, 1, ctx, 16, pp=p)["decode_ms_per_token"] for p in pps]
    assert all(b >= a * 0.999 for a, b in zip(lone, lone[1:]))


def test_routed_experts_compute_their_rows_padded_to_the_grouped_gemms_tile():
    # a prefill step of 2048 tokens over gpt-oss-120b's 128 experts (4 a token): 64 rows an expert
    # on average, spread over two 64-row tiles for about half of them; 8192 tokens on 8 of 128
    # (Qwen3-235B) spread over many tiles: about half a tile an expert over the rows
    assert 1.3 < sim._moe_padded_rows(2048, 4, 128) / (2048 * 4) < 1.6
    assert 1.0 < sim._moe_padded_rows(8192, 8, 128) / (8192 * 8) < 1.1
    # decode: one token on 2 of 8 experts computes (about) two 16-row tiles
    assert 16 <= sim._moe_padded_rows(1, 2, 8) <= 2 * 16
    assert sim._moe_padded_rows(0, 4, 128) == 0.0


def test_the_grouped_expert_gemm_slows_moe_prefill_and_leaves_dense_models_and_decode_alone():
    dense = sim.StepCost(sim.MODELS["qwen3-32b"], sim.GPUS["A100-80GB-SXM4"], 1, engine="vllm-v1")
    moe = sim.StepCost(sim.MODELS["gpt-oss-20b"], sim.GPUS["A100-80GB-SXM4"], 1, engine="vllm-v1")
    old_eff = sim.MOE_GEMM_EFF
    try:
        sim.MOE_GEMM_EFF = 1.0
        dense_fast, prefill_fast, decode_fast = dense._linear(2048), moe._linear(2048), moe._linear(8)
        sim.MOE_GEMM_EFF = old_eff
        assert dense._linear(2048) == dense_fast                       # no experts: untouched
        assert moe._linear(2048) > 1.3 * prefill_fast                  # prefill: the experts' math bounds it
        assert moe._linear(8) == pytest.approx(decode_fast, rel=1e-9)  # decode: the weight stream hides it
    finally:
        sim.MOE_GEMM_EFF = old_eff


def test_marlin_pads_mxfp4_experts_on_gpus_before_hopper():
    # gpt-oss-120b's experts (hidden 2880, width 2880) run in Marlin's MoE kernel on an A100: padded to
    # 3072 x 2944, 9 % more than the checkpoint (~5 GiB more held); Hopper's Triton path keeps them
    m = sim.MODELS["gpt-oss-120b"]
    a100 = sim.StepCost(m, sim.GPUS["A100-80GB-SXM4"], 1, engine="vllm-v1")
    h100 = sim.StepCost(m, sim.GPUS["H100-SXM5-80GB"], 1, engine="vllm-v1")
    assert a100.expert_w == 3 * 3072 * 2944 and h100.expert_w == 3 * 2880 * 2880
    assert 4.5 < (a100.weights_bytes - h100.weights_bytes) / 2 ** 30 < 5.5
    # a 16-bit MoE is not padded on either
    q = sim.MODELS["qwen3-235b-a22b"]
    assert sim.StepCost(q, sim.GPUS["A100-80GB-SXM4"], 8).expert_w == sim.StepCost(q, sim.GPUS["H100-SXM5-80GB"], 8).expert_w


def test_attention_with_sinks_prefills_in_triton_before_hopper():
    # gpt-oss's sinks have no FlashAttention-2 kernel: its prefill attention costs
    # SINK_PREFILL_ATTN_SLOWDOWN times more on an A100, not on an H100 (FlashAttention 3), and no other
    # model's does; decode attention (memory-bound) is untouched
    assert sim.MODELS["gpt-oss-20b"].attention_sinks and not sim.MODELS["qwen3-32b"].attention_sinks
    cfg = dict(sim.BUILTIN_CONFIGS["gpt-oss-20b"])
    assert sim.resolve_model(cfg).attention_sinks                      # read from a config.json too
    m = sim.MODELS["gpt-oss-20b"]
    a100 = sim.StepCost(m, sim.GPUS["A100-80GB-SXM4"], 1, engine="vllm-v1")
    h100 = sim.StepCost(m, sim.GPUS["H100-SXM5-80GB"], 1, engine="vllm-v1")
    assert a100.attn_flops == pytest.approx(sim.SINK_PREFILL_ATTN_SLOWDOWN * h100.attn_flops)
    assert a100.attn_flops_decode == h100.attn_flops_decode
    q = sim.MODELS["qwen3-32b"]
    assert sim.StepCost(q, sim.GPUS["A100-80GB-SXM4"], 1).attn_flops == sim.StepCost(q, sim.GPUS["H100-SXM5-80GB"], 1).attn_flops
