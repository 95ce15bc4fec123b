"""Plain greedy decode speed, side by side in one process: transformers' generate (eager,
dynamic cache) vs this runtime eager vs this runtime with its CUDA-graph step.

Uses a random target shaped like SmolLM2-135M (same shapes, same cost; nothing to carry).
Speed only: output quality of random weights means nothing.

    python scripts/bench_decode.py [--out DIR] [--prompts 4] [--new 128]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference.runtime.engine import generate
from inference.runtime.model import RuntimeModel
from scripts.profile_train_step import SMOLLM2


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16)
    folder = Path(tempfile.mkdtemp())
    hf.save_pretrained(folder)
    hf = hf.cuda().eval()
    rt = RuntimeModel.from_pretrained(folder, dtype=torch.bfloat16, device="cuda")
    prompts = [torch.randint(0, SMOLLM2["vocab_size"], (128,)).tolist() for _ in range(args.prompts)]
    n = args.new
    results = {}

    def hf_plain():
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
        return outs

    def ours(graphs):
        return [generate(rt, [p], n, cuda_graphs=graphs)[0][0] for p in prompts]

    hf_plain()  # warm-up (kernels, allocator)
    ours(False)
    ours(True)
    for name, fn in (("transformers generate (eager)", hf_plain), ("runtime eager", lambda: ours(False)),
                     ("runtime CUDA graph", lambda: ours(True))):
        outs, sec = timed(fn)
        results[name] = {"tokens_per_s": round(len(prompts) * n / sec, 1), "seconds": round(sec, 3), "outputs": outs}
    base = results["transformers generate (eager)"]["tokens_per_s"]
    same = results["runtime eager"]["outputs"] == results["runtime CUDA graph"]["outputs"]
    lines = [f"{name:32s} {r['tokens_per_s']:>10,.1f} tok/s  {r['tokens_per_s'] / base:6.1f}x" for name, r in results.items()]
    lines.append(f"graph output == eager output: {same}")
    print("\n".join(lines))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()}
    summary["graph_equals_eager"] = same
    summary["gpu"] = torch.cuda.get_device_name()
    (Path(args.out) / "bench_decode.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
