"""A draft tree's selection launches (kernels/tree_select.py and the head's slices,
kernels/lm_head_topk.py) at a tree step's shapes, for each warps-per-program setting, on a GPU.

    PYTHONPATH=. python scripts/bench_tree_select.py [--tree 6,10,60,4] [--tree 6,10,60,8] [--out DIR]

Each tree's selection runs as a drafter's step makes it, from random hidden states (bf16, the
recipe's shapes: H 576, a 16,384-row draft head, a 49,152-row embedding table): per depth the
head's slices and merge (`expand_children_triton`), then the next frontier with its input norms
(`frontier_norm_pair_triton`), and the rerank (`finalize_triton`). Each value of one launch setting
(kernels/tree_select.py TreeSelectTuning, passed to the launchers; the others at their defaults) is
checked against the defaults' candidates and tree before it is timed: µs per whole selection,
replayed from a CUDA graph (triton.testing.do_bench_cudagraph). A setting whose float sums come
out in another order gives other bits (log-probabilities a rounding apart, which may reorder ties):
it is reported as "differs" and not timed. Prints each setting's timings beside the defaults'.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from draftsmith_kernels.tree_select import Candidates, TreeSelectTuning, expand_children_triton, finalize_triton, \
    frontier_norm_pair_triton
from inference.tree.loop import tree_candidate_count

# each setting's values timed, the others at the defaults
KNOBS = {"merge_children_warps": (2, 4, 8), "frontier_warps": (2, 4, 8, 16), "rerank_warps": (4, 8, 16),
         "rerank_rows": (8, 16, 32), "rerank_columns": (8, 16, 32), "topk_warps": (2, 4, 8)}


def selection(depth, top_k, total, children, weights, hiddens, tuning: TreeSelectTuning):
    """One tree's selection with these launch settings → (candidates, tree tensors)."""
    W, nw, table, tw, xw, draft_ids, last = weights
    C = tree_candidate_count(depth, top_k, children)
    cand = Candidates.empty(1, C, W.device)
    index = scores = None
    off = 0
    for level in range(depth):
        x = hiddens[level]
        k = top_k if level == 0 else children
        expand_children_triton(x, nw, 1e-5, W, k, draft_ids, index, scores, off, cand, tuning=tuning)
        n_new = x.shape[1] * k
        if level + 1 < depth:
            parent = torch.empty(1, top_k, x.shape[-1], dtype=x.dtype, device=x.device)
            frontier, _ = frontier_norm_pair_triton(cand, off, k, top_k, level, last, table, tw, x, xw, 1e-5, parent,
                                                    tuning=tuning)
            index, scores = frontier.index, frontier.scores
        off += n_new
    return cand, finalize_triton(cand, children, top_k, total, last, base_offset=1, tuning=tuning)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="DEPTH,TOPK,NODES,CHILDREN")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    trees = []
    for spec in args.tree or ["6,10,60,4", "6,10,60,8"]:
        try:
            tree = tuple(int(v) for v in spec.split(","))
        except ValueError:
            tree = ()
        if len(tree) != 4 or min(tree) < 1 or tree[2] > tree_candidate_count(tree[0], tree[1], tree[3]):
            raise SystemExit(f"error: --tree {spec}: DEPTH,TOPK,NODES,CHILDREN, four positive integers, NODES at most "
                             "the candidates such a tree drafts")
        trees.append(tree)
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_tree_select times CUDA graphs: it needs a GPU")
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    H, V, Vt = 576, 16384, 49152
    weights = (torch.randn(V, H, device=dev, dtype=bf) * 0.05, torch.rand(H, device=dev, dtype=bf) + 0.5,
               torch.randn(Vt, H, device=dev, dtype=bf), torch.rand(H, device=dev, dtype=bf) + 0.5,
               torch.rand(H, device=dev, dtype=bf) + 0.5, torch.randperm(Vt, device=dev)[:V],
               torch.full((1,), 300, dtype=torch.long, device=dev))
    results = {}
    for depth, top_k, total, children in trees:
        name = f"{depth}-{top_k}-{total}-{children}"
        hiddens = [torch.randn(1, 1 if level == 0 else top_k, H, device=dev, dtype=bf) for level in range(depth)]
        def run(tuning=TreeSelectTuning()):
            return selection(depth, top_k, total, children, weights, hiddens, tuning)

        want = run()
        base = 1e3 * do_bench_cudagraph(run)
        line = {"standing": round(base, 2)}
        print(f"{name}: the defaults {base:.2f} µs", flush=True)
        for knob, values in KNOBS.items():
            timed = {}
            for value in values:
                tuning = TreeSelectTuning(**{knob: value})
                got = run(tuning)
                same = all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and \
                    all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
                timed[value] = round(1e3 * do_bench_cudagraph(lambda t=tuning: run(t)), 2) if same else "differs"
            line[knob] = timed
            print(f"  {knob:24s} " + "  ".join(f"{v}: {t}" for v, t in timed.items()), flush=True)
        results[name] = line
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_tree_select.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
