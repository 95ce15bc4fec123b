"""The tree-attention kernel's tuning variants timed on a GPU, beside the chain's decode attention,
at SmolLM2-135M's shapes (9 query / 3 KV heads of 64) in bf16: the target's verify step over a
tree of N nodes, and a drafter's level (8 frontier queries over its cache and a candidate buffer).

    python scripts/bench_attention.py [--out DIR] [--cache 1024] [--base 400] [--defaults-only]
        [--nodes 24,40,60] [--candidates 40,200,264]
    (a long context: --cache 4096 --base 3000; the bench's MT-bench geometry, 20 first turns at
    256 new tokens with a 4-8-40-4 tree: --cache 512 --base 100,200,300,380 --nodes 40 --candidates 104)

Variants: kernels/settings.py TreeAttentionTuning around its defaults. The drafter's form:
target_programs (how finely the cache is split), max_block_s (cache keys per tile, down to 32),
num_warps, and 32 score rows a program (max_block_q); the first variant is the defaults with the
other products (products_16bit, both forms: 16-bit against the default TF32), a control timed but
never named best (16-bit products are faster a call but drafted less tau). The verify step's form
(decode_attention's chunks under the tree's mask): chunked_block_q score rows, chunked_heads query
heads a merge program, chunked_max_chunks.
The last line names the best variant as `--tree-attention NAME=VALUE,...`, the flag of
`python -m inference.bench` and `inference.validate` that runs the tree with it (recorded in
bench.json / report.json). Each variant is checked against the torch
reference, then timed by triton.testing.do_bench_cudagraph (launches replayed from a CUDA graph,
as the runtime runs them; medians in microseconds). A verify step calls the kernel once per
layer (30), a drafter level once: multiply before comparing with a step's milliseconds.
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

import draftsmith_kernels.tree_attention as ta
from draftsmith_kernels.settings import TreeAttentionTuning
from inference.tree.ops import ancestor_mask
from draftsmith_kernels.decode_attention import decode_attention_triton


def random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """[n,n] an EAGLE-2-like tree: each node's parent among the nodes before it (-1: the root)."""
    parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)])
    return ancestor_mask(parents[None])[0]


def cases(S: int, base: int, nodes=(24, 40, 60), candidates=(40, 200, 264)):
    """(name, q, k_cache, v_cache, base, tree_k, tree_v, mask) on the GPU: the verify step over
    trees of each of `nodes`, a drafter's level over each of `candidates`."""
    dev, bf, g = "cuda", torch.bfloat16, torch.Generator().manual_seed(0)
    nh, nkv, d = 9, 3, 64
    k_cache = torch.randn(1, nkv, S, d, generator=g).to(dev, bf)
    v_cache = torch.randn(1, nkv, S, d, generator=g).to(dev, bf)
    base_t = torch.tensor([base], device=dev)
    for n in nodes:  # the verify step: the root and n nodes, the block in the cache after the root
        mask = random_tree_mask(n, g)[None].to(dev)  # the nodes' rows (the root, query 0, has none)
        q = torch.randn(1, nh, n + 1, d, generator=g).to(dev, bf)
        yield f"verify, {n} nodes", q, k_cache, v_cache, base_t, None, None, mask
    for c in candidates:  # a drafter's level: 8 frontier nodes over c candidates (4-4-24, 4-8-40, 5-8-40)
        mask = random_tree_mask(c, g)[-8:][None].to(dev)
        q = torch.randn(1, nh, 8, d, generator=g).to(dev, bf)
        tree_k, tree_v = (torch.randn(1, nkv, c, d, generator=g).to(dev, bf) for _ in range(2))
        yield f"drafter level, 8 of {c} candidates", q, k_cache, v_cache, base_t, tree_k, tree_v, mask


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_attention.json here")
    parser.add_argument("--cache", type=int, default=1024, help="cache slots S")
    parser.add_argument("--base", default="400", help="the root's slot (keys visible before the tree); several, "
                        "comma-separated: every case at each, weighted alike")
    parser.add_argument("--nodes", default="24,40,60", help="verify cases: trees of these many nodes")
    parser.add_argument("--candidates", default="40,200,264", help="drafter-level cases: 8 queries over these many "
                        "candidates (a depth-4 tree of top-k 8 and 4 children drafts 104)")
    parser.add_argument("--defaults-only", action="store_true", help="time the defaults alone (no sweep)")
    args = parser.parse_args()
    try:
        bases, nodes, candidates = ([int(x) for x in text.split(",") if x.strip()]
                                    for text in (args.base, args.nodes, args.candidates))
    except ValueError as error:
        raise SystemExit(f"error: --base, --nodes and --candidates take comma-separated integers ({error})") from None
    if not bases or max(bases) + max(nodes, default=0) >= args.cache or min(bases) < 0:
        raise SystemExit(f"error: --base {args.base} with trees of {max(nodes, default=0)} nodes does not fit "
                         f"--cache {args.cache}")
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_attention.py times kernels on a GPU; none is visible")
    rows = []
    defaults = TreeAttentionTuning()
    # the variants around the defaults that could still win on another GPU or geometry: the split's size, its key
    # tiles and the warps; shorter key tiles with finer splits; 32 score rows; the verify's chunked form's settings.
    # The control is the defaults with the other products (16-bit: faster a call, less tau; never named best)
    control = replace(defaults, products_16bit=not defaults.products_16bit)
    variants = [control] + [
        replace(defaults, target_programs=programs, max_block_s=block_s, num_warps=warps)
        for programs, block_s, warps in itertools.product((2048, 8192), (32, 64, 128), (2, 4))] + [
        replace(defaults, max_block_q=32, max_block_s=block_s) for block_s in (64, 128)] + [
        replace(defaults, target_programs=8192, max_block_s=block_s, num_warps=warps, merge_split_chunk=8)
        for block_s, warps in itertools.product((32, 64), (2, 4))] + [
        replace(defaults, chunked_block_q=block_q, chunked_heads=heads, chunked_max_chunks=chunks)
        for block_q, heads, chunks in itertools.product((16, 32), (4, 16), (16, 64))]
    if args.defaults_only:
        variants = [defaults]

    def label(v: TreeAttentionTuning) -> str:
        return (f"q{v.max_block_q}{'' if v.products_16bit else ' tf32'} p{v.target_programs} s{v.max_block_s} "
                f"w{v.num_warps} h{v.combine_heads} c{v.merge_split_chunk} "
                f"verify q{v.chunked_block_q} h{v.chunked_heads} n{v.chunked_max_chunks}")

    all_cases = [(f"{name} (base {base})" if len(bases) > 1 else name, *operands)
                 for base in bases for name, *operands in cases(args.cache, base, nodes, candidates)]
    for name, *operands in all_cases:
        reference = ta.tree_attention_reference(*operands).float()
        row = {"case": name}
        for variant in variants:
            got = ta.tree_attention_triton(*operands, tuning=variant).float()
            try:
                torch.testing.assert_close(got, reference, rtol=2e-2, atol=2e-2)
            except AssertionError as error:  # a wrong variant is reported and never chosen
                print(f"{name}: {label(variant)} is WRONG, not timed: {str(error).splitlines()[0]}", flush=True)
                row[label(variant)] = float("inf")
                continue
            row[label(variant)] = do_bench_cudagraph(lambda v=variant: ta.tree_attention_triton(*operands, tuning=v),
                                                     rep=50) * 1000
        rows.append(row)
        best = min((k for k in row if k != "case"), key=row.get)
        shown = "" if args.defaults_only else (f", {'16-bit' if control.products_16bit else 'TF32'} "
                                               f"products {row[label(control)]:.2f} µs")
        print(f"{name}: defaults {row.get(label(defaults), float('nan')):.2f} µs{shown}; best {best}: "
              f"{row[best]:.2f} µs", flush=True)
    # one number per variant, as a step weighs them: 30 calls of each verify case (one per layer),
    # 5 of each drafter case (one per level)
    totals = {k: sum(r[k] * (30 if r["case"].startswith("verify") else 5) for r in rows) for k in rows[0] if k != "case"}
    for k in sorted(totals, key=totals.get)[:5]:
        print(f"  weighted (30 x each verify case + 5 x each drafter case): {k}: {totals[k]:.1f} µs "
              f"(defaults: {totals.get(label(defaults), float('nan')):.1f})")
    # the best named for later runs keeps the default products (the control's are never chosen)
    eligible = {k: v for k, v in totals.items() if args.defaults_only or k != label(control)}
    best = next(v for v in variants if label(v) == min(eligible, key=eligible.get))
    print(f"best on this GPU: --tree-attention {best.spec()}")
    # the chain's verify for comparison: 5 queries at positions base .. base + 4
    for base in bases:
        _, q, k_cache, v_cache, *_ = next(cases(args.cache, base, nodes or (8,), ()))
        q5 = q[:, :, :5].contiguous()
        positions = torch.arange(base, base + 5, device="cuda")[None]
        chain = do_bench_cudagraph(lambda: decode_attention_triton(q5, k_cache, v_cache, positions), rep=50) * 1000
        rows.append({"case": f"chain verify (decode attention), 5 queries (base {base})", "decode_attention": chain})
        print(f"chain verify (decode attention), 5 queries, base {base}: {chain:.2f} µs")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_attention.json").write_text(json.dumps(rows, indent=1))  # (a wrong variant: Infinity)


if __name__ == "__main__":
    main()
