"""The drafter's tree head (kernels/lm_head_topk.py: final norm, lm_head, log-softmax, top-k) at
the shapes a tree step calls it, for each lm_head slice size a program takes, on a GPU.

    PYTHONPATH=. python scripts/bench_heads.py [--out DIR]

A tree step calls the head once for the root (1 row, top_k children) and once per later depth
(F frontier rows, `children` each); the chunks launch's slice size (BLOCK_V lm_head rows a
program) trades programs against the candidates the merge ranks. Each variant is checked against
the torch reference (same indices) before it is timed: µs per call, both launches replayed from a
CUDA graph (triton.testing.do_bench_cudagraph), bf16, the recipe's shapes (H 576, Vd 16,384).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from draftsmith_kernels.lm_head_argmax import norm_lm_head_argmax_triton
from draftsmith_kernels.lm_head_topk import norm_lm_head_topk_reference, norm_lm_head_topk_triton

SHAPES = [(1, 8), (1, 10), (8, 8), (10, 10), (10, 4), (10, 2), (8, 4)]  # (rows, k)
SLICES = (64, 128, 256, 512)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    H, V = 576, 16384
    weight = torch.randn(V, H, device=dev, dtype=bf) * 0.05
    norm = torch.rand(H, device=dev, dtype=bf) + 0.5
    results = []
    for rows, k in SHAPES:
        x = torch.randn(rows, H, device=dev, dtype=bf)
        want = norm_lm_head_topk_reference(x, norm, 1e-5, weight, k)[1]
        line = {"rows": rows, "k": k}
        for block_v in SLICES:
            got = norm_lm_head_topk_triton(x, norm, 1e-5, weight, k, block_v=block_v)[1]
            if not torch.equal(got, want):  # a wrong variant is reported, never timed
                line[block_v] = "wrong"
                continue
            line[block_v] = round(1e3 * do_bench_cudagraph(
                lambda: norm_lm_head_topk_triton(x, norm, 1e-5, weight, k, block_v=block_v)), 2)
        out = torch.empty(rows, dtype=torch.long, device=dev)
        line["argmax"] = round(1e3 * do_bench_cudagraph(lambda: norm_lm_head_argmax_triton(x, norm, 1e-5, weight, out)), 2)
        results.append(line)
        print(f"rows {rows:2d}, k {k:2d}: " + ", ".join(f"{b} rows a slice {line[b]}" for b in SLICES)
              + f" µs; the chain's argmax head {line['argmax']} µs", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_heads.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
