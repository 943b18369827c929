"""Layouts of the large models on two multi-node pools: what otela_sim says each tp x pp costs.

    .venv/bin/python tests/bench_sim_layouts.py [--batch 32] [--input 1024] [--output 256] [--json]

For Llama-3.1-405B (bf16 and fp8), DeepSeek-V3 and Qwen3-235B-A22B on 2 nodes of 8 x H100 (IB
NDR, one NIC a GPU) and 4 nodes of 4 x GH200 (Slingshot-11, one NIC a GPU): every 16-GPU
layout (tp 4, 8, 16 with the pp that makes 16), the nodes it takes, memory per GPU, whether
it fits, batch-1 TTFT and inter-token time, and at --batch the TTFT, inter-token time and
output throughput; a layout the simulator refuses is printed with the reason. Prints
figures; never asserts.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import otela_sim as sim  # noqa: E402

MODELS = [("llama-3.1-405b", None), ("llama-3.1-405b", "fp8"), ("deepseek-v3", None), ("qwen3-235b-a22b", None)]
POOLS = [("H100", 16), ("GH200", 16)]


def rows(batch, inp, out):
    for gpu, total in POOLS:
        for model, dtype in MODELS:
            for tp in (4, 8, 16):
                pp = total // tp
                row = {"model": model, "dtype": dtype or "checkpoint", "gpu": gpu, "tp": tp, "pp": pp}
                try:
                    one = sim.estimate(model, gpu, tp, 1, inp, out, dtype=dtype, pp=pp)
                    full = sim.estimate(model, gpu, tp, batch, inp, out, dtype=dtype, pp=pp)
                except sim.SimError as e:
                    yield dict(row, refused=str(e))
                    continue
                yield dict(row, nodes=full["nodes"], fabric=full["fabric"], memory_gb_per_gpu=full["memory_gb_per_gpu"],
                           usable_gb_per_gpu=full["usable_gb_per_gpu"], fits=full["fits"],
                           max_batch=full["max_batch"], ttft_ms_b1=one["ttft_ms"], tpot_ms_b1=one["decode_ms_per_token"],
                           ttft_ms=full["ttft_ms"], tpot_ms=full["decode_ms_per_token"],
                           throughput_tok_s=full["throughput_tok_s"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="requests in the batch (default 32)")
    p.add_argument("--input", type=int, default=1024, help="prompt tokens a request (default 1024)")
    p.add_argument("--output", type=int, default=256, help="generated tokens a request (default 256)")
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    a = p.parse_args()
    for r in rows(a.batch, a.input, a.output):
        if a.json:
            print(json.dumps(r))
        elif "refused" in r:
            print(f"{r['model']:16s} {r['dtype']:10s} {r['gpu']:5s} tp{r['tp']:2d} x pp{r['pp']:<2d} refused: {r['refused']}")
        else:
            print(f"{r['model']:16s} {r['dtype']:10s} {r['gpu']:5s} tp{r['tp']:2d} x pp{r['pp']:<2d} {r['nodes']} nodes "
                  f"{r['memory_gb_per_gpu']:5.1f}/{r['usable_gb_per_gpu']:.0f} GB {'fits' if r['fits'] else 'NO FIT'} | "
                  f"batch 1: TTFT {r['ttft_ms_b1']:6.0f} ms, {r['tpot_ms_b1']:5.1f} ms/token | batch {a.batch}: "
                  f"TTFT {r['ttft_ms']:6.0f} ms, {r['tpot_ms']:5.1f} ms/token, {r['throughput_tok_s']:5.0f} tok/s")


if __name__ == "__main__":
    main()
