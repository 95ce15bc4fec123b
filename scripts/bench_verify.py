"""The target's verify forward alone, by the tokens it feeds, under each GEMM backend a user can
pick: a random target shaped like SmolLM2-135M (bf16), a cache holding a prompt's worth of
context, the forward captured in a CUDA graph as the loops replay it. A chain verifies k + 1
tokens, a draft tree its root and N nodes under the tree mask.

    PYTHONPATH=. python scripts/bench_verify.py [--tokens 1,5,7,41,61] [--context 300]
                                                [--blas default,cublaslt,tunable] [--out DIR]

Up to 8 tokens are fed as a chain (consecutive positions), more as a tree (the root and a random
tree of the rest under its mask). Prints µs per forward for every (backend, tokens), and each
count's cost over the first count's.
Backends: "default" (cuBLAS as PyTorch picks it), "cublaslt" (torch.backends.cuda.
preferred_blas_library), "tunable" (torch.cuda.tunable: every GEMM shape timed over cuBLASLt's
candidate kernels before the capture, the fastest kept).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def tree_mask(n: int, generator: torch.Generator) -> torch.Tensor:
    """[1,n,n] bool: a random tree's ancestor rows (node i's parent is a random earlier node or the root)."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask[None]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,5,7,41,61")
    ap.add_argument("--context", type=int, default=300, help="tokens already in the cache before the verified ones")
    ap.add_argument("--blas", default="default,cublaslt,tunable")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise SystemExit(f"error: --tokens {args.tokens!r}: comma-separated token counts, e.g. 1,5,7,41,61") from None
    if min(counts) < 1 or max(counts) > 64 or not 1 <= args.context <= 900:
        raise SystemExit("error: --tokens takes 1..64 each and --context 1..900 (a 1,024-slot cache)")
    backends = args.blas.split(",")
    unknown = [b for b in backends if b not in ("default", "cublaslt", "tunable")]
    if unknown:
        raise SystemExit(f"error: --blas {unknown[0]!r} is not one of default, cublaslt, tunable")
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_verify times CUDA graphs: it needs a GPU")
    from inference.runtime.model import RuntimeModel
    from scripts.bench_gemm import graph_time  # µs per call, captured in a CUDA graph
    from scripts.profile_spec import smollm2_shaped

    folder = Path(tempfile.mkdtemp())
    smollm2_shaped(folder)
    rt = RuntimeModel.from_pretrained(folder, dtype=torch.bfloat16, device="cuda")
    cache = rt.new_cache(1, 1024)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (1, args.context), device="cuda")
    rt(prompt, torch.arange(args.context, device="cuda")[None], cache)  # the context's K/V in the cache
    results = {}
    for blas in backends:
        if blas == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        elif blas == "tunable":
            torch.backends.cuda.preferred_blas_library("cublas")
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            torch.cuda.tunable.set_filename(str(Path(tempfile.mkdtemp()) / "tunableop.csv"))
        row = {}
        for n in counts:
            ids = torch.randint(100, 40000, (1, n), device="cuda")
            base = args.context - 1  # a verify feeds the last verified token (the root) first
            if n <= 8:  # a chain: k + 1 consecutive positions
                positions = base + torch.arange(n, device="cuda")[None]
                mask = None
            else:  # a tree: the root, then n - 1 nodes at their depths
                mask = tree_mask(n - 1, gen).cuda()
                depth = mask.sum(-1)  # [1,n-1]
                positions = torch.cat([torch.full((1, 1), base, device="cuda"), base + depth], 1)

            def forward(ids=ids, positions=positions, mask=mask):
                rt(ids, positions, cache, (), tree_mask=mask)

            if blas == "tunable":
                forward()  # every GEMM shape tuned here, outside the capture
                torch.cuda.synchronize()
            row[n] = graph_time(forward, calls=1, reps=100)
        if blas == "tunable":
            torch.cuda.tunable.tuning_enable(False)
            torch.cuda.tunable.enable(False)
        torch.backends.cuda.preferred_blas_library("cublas")
        results[blas] = row
        first = row[counts[0]]
        cells = (f"{n} tokens {t:8.1f} µs (+{t - first:5.1f})" for n, t in row.items())
        print(f"{blas:10s} " + "  ".join(cells), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_verify.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                     "context": args.context, "us": results}, indent=1))


if __name__ == "__main__":
    main()
