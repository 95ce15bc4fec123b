"""A draft tree's selection launches (kernels/tree_select.py and the head's slices,
kernels/lm_head_topk.py) at a tree step's shapes, for each warps-per-program setting, on a GPU.

    PYTHONPATH=. python scripts/bench_tree_select.py [--tree 6,10,60,4] [--tree 6,10,60,8] [--out DIR]

Each tree's selection runs as a drafter's step makes it, from random hidden states (bf16, the
recipe's shapes: H 576, a 16,384-row draft head, a 49,152-row embedding table): per depth the
head's slices and merge (`expand_children_triton`), then the next frontier with its input norms
(`frontier_norm_pair_triton`), and the rerank (`finalize_triton`). Every setting of one knob (the
others as they stand) is checked against the standing settings' candidates and tree before it is
timed: µs per whole selection, replayed from a CUDA graph (triton.testing.do_bench_cudagraph). A
setting whose float sums come out in another order gives other bits (log-probabilities a rounding
apart, which may reorder ties): it is reported as "differs" and not timed. Prints each knob's
timings beside the standing settings'.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

import draftsmith_kernels.lm_head_topk as head
import draftsmith_kernels.tree_select as select
from inference.tree.loop import tree_candidate_count
from draftsmith_kernels.tree_select import Candidates, expand_children_triton, finalize_triton, frontier_norm_pair_triton

KNOBS = {("warps", "merge_children"): (2, 4, 8), ("warps", "frontier"): (2, 4, 8, 16), ("warps", "rerank"): (4, 8, 16),
         ("rerank_rows", None): (8, 16, 32), ("rerank_columns", None): (8, 16, 32), ("topk_warps", None): (2, 4, 8)}


def set_knob(knob, value):
    kind, name = knob
    if kind == "warps":
        select.WARPS[name] = value
    elif kind == "rerank_rows":
        select.RERANK_ROWS = value
    elif kind == "rerank_columns":
        select.RERANK_COLUMNS = value
    else:
        head.TOPK_WARPS = value


def get_knob(knob):
    kind, name = knob
    if kind == "warps":
        return select.WARPS[name]
    if kind in ("rerank_rows", "rerank_columns"):
        return select.RERANK_ROWS if kind == "rerank_rows" else select.RERANK_COLUMNS
    return head.TOPK_WARPS


def selection(depth, top_k, total, children, weights, hiddens):
    """One tree's selection → (candidates, tree tensors)."""
    W, nw, table, tw, xw, draft_ids, last = weights
    C = tree_candidate_count(depth, top_k, children)
    cand = Candidates.empty(1, C, W.device)
    index = scores = None
    off = 0
    for level in range(depth):
        x = hiddens[level]
        k = top_k if level == 0 else children
        expand_children_triton(x, nw, 1e-5, W, k, draft_ids, index, scores, off, cand)
        n_new = x.shape[1] * k
        if level + 1 < depth:
            parent = torch.empty(1, top_k, x.shape[-1], dtype=x.dtype, device=x.device)
            frontier, _ = frontier_norm_pair_triton(cand, off, k, top_k, level, last, table, tw, x, xw, 1e-5, parent)
            index, scores = frontier.index, frontier.scores
        off += n_new
    return cand, finalize_triton(cand, children, top_k, total, last, base_offset=1)


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
        run = lambda: selection(depth, top_k, total, children, weights, hiddens)  # noqa: E731
        want = run()
        standing = {knob: get_knob(knob) for knob in KNOBS}
        base = 1e3 * do_bench_cudagraph(run)
        line = {"standing": round(base, 2)}
        print(f"{name}: standing settings {base:.2f} µs", flush=True)
        for knob, values in KNOBS.items():
            timed = {}
            for value in values:
                set_knob(knob, value)
                got = run()
                same = all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and \
                    all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
                timed[value] = round(1e3 * do_bench_cudagraph(run), 2) if same else "differs"
            set_knob(knob, standing[knob])
            label = f"{knob[0]}{'/' + knob[1] if knob[1] else ''}"
            line[label] = timed
            print(f"  {label:24s} " + "  ".join(f"{v}: {t}" for v, t in timed.items()), flush=True)
        results[name] = line
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_tree_select.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
