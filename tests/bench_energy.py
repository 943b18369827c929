"""otela_sim's energy model against the ML.ENERGY leaderboard's published GPU energy per
output token (GPU-only, as the leaderboard meters it with NVML; the node figures with host
power are printed beside, with nothing published to compare them to).

    .venv/bin/python tests/bench_energy.py --out bench-results

Prints a table and writes <out>/energy.json. Never asserts. Published figures:
  - Llama 3.1 8B, 1 x H100, batch 64: 0.20 J (leaderboard v2.0, vLLM 0.5.4) and 0.12 J (v3.0,
    vLLM 0.11.1): ML.ENERGY blog, "LLM Inference Energy: A Longitudinal Analysis"
    (https://ml.energy/blog/measurement/energy/llm-inference-energy-a-longitudinal-analysis).
    Lengths are not in the post: the model runs 512 in / 256 out and 256 in / 512 out.
  - Llama 2 7B chat and 13B chat, 1 x A100, one request at a time (leaderboard v1, Hugging
    Face transformers, chat task): energy per response, response length and latency in
    github.com/ml-energy/leaderboard-v2 data/A100_chat_benchmark.csv. That engine is not one
    the simulator models, so its GPU power model is also checked at the measured speed (u =
    the ideal roofline time of the response over the measured latency). The leaderboard names
    no A100 variant: SXM4 40 GB (400 W) and PCIe 80 GB (300 W) bracket it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import otela_sim as sim  # noqa: E402

LONGITUDINAL = "https://ml.energy/blog/measurement/energy/llm-inference-energy-a-longitudinal-analysis"
V1_CSV = "https://github.com/ml-energy/leaderboard-v2/blob/main/data/A100_chat_benchmark.csv"
# (label, model, gpu, engine release, batch, measured J per output token, source)
SERVED = [("Llama-3.1-8B, 1 x H100, batch 64, vLLM 0.5.4", "llama-3.1-8b", "H100-SXM5-80GB", "0.5.4", 64, 0.20,
           LONGITUDINAL),
          ("Llama-3.1-8B, 1 x H100, batch 64, vLLM 0.11.1", "llama-3.1-8b", "H100-SXM5-80GB", "0.11.1", 64, 0.12,
           LONGITUDINAL)]
# (label, model, response tokens, latency s, energy J per response) from the v1 CSV
ONE_AT_A_TIME = [("Llama-2-7B-chat, 1 x A100, batch 1, HF transformers", "llama-2-7b", 420.066, 9.4421, 1828.775),
                 ("Llama-2-13B-chat, 1 x A100, batch 1, HF transformers", "llama-2-13b", 379.494, 12.9842, 3050.126)]
PROMPT = 100  # the v1 chat prompts are short; the decode of ~400 tokens dominates either way


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="accepted for `make bench`; the run is seconds anyway")
    args = ap.parse_args()
    rows = []
    for label, model, gpu, release, batch, measured, source in SERVED:
        key = sim.resolve_engine("vllm", release).key
        for inp, out in ((512, 256), (256, 512)):
            e = sim.estimate(model, gpu, tp=1, batch=batch, input_len=inp, output_len=out, engine=key)
            rows.append({"config": f"{label} ({key}, {inp} in / {out} out)", "measured_j": measured, "source": source,
                         "model_gpu_j": round(e["j_per_output_token"], 3),
                         "error": round(e["j_per_output_token"] / measured - 1, 3),
                         "model_node_j": round(e["node_j_per_output_token"], 3), "gpu_w": round(e["power_w_per_gpu"])})
    for label, model, tokens, latency, joules in ONE_AT_A_TIME:
        measured = joules / tokens
        for gname in ("A100-40GB-SXM4", "A100-80GB-PCIe"):
            gpu, m = sim.resolve_gpu(gname), sim.resolve_model(model)
            ideal = sim._static_times(sim._cost_for(m, gpu, 1, None, "vllm-0.6", sim._IDEAL), 1, PROMPT, int(tokens))[2]
            at_speed = sim.energy(gpu, 1, latency, ideal, tokens)
            rows.append({"config": f"{label} on {gname}, power model at the measured speed", "measured_j": round(measured, 3),
                         "source": V1_CSV, "model_gpu_j": round(at_speed["j_per_output_token"], 3),
                         "error": round(at_speed["j_per_output_token"] / measured - 1, 3),
                         "model_node_j": round(at_speed["node_j_per_output_token"], 3),
                         "gpu_w": round(at_speed["power_w_per_gpu"]), "measured_w": round(joules / latency)})
    print(f"{'configuration':92s} {'measured':>9s} {'model GPU':>9s} {'error':>7s} {'model node':>10s}")
    for r in rows:
        print(f"{r['config']:92s} {r['measured_j']:9.3f} {r['model_gpu_j']:9.3f} {r['error'] * 100:+6.0f}% "
              f"{r['model_node_j']:10.3f}")
    print("J per output token; measured = ML.ENERGY leaderboard (GPU energy, NVML); model node = with host power")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "energy.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'energy.json')}")


if __name__ == "__main__":
    main()
