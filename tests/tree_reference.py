"""Tree references that only the tests use: the whole EAGLE-2 selection driven by a log-probability
callback (`select_tree`), Medusa-style static trees (`static_tree`, the oracle proposer of
tests/test_tree_decoding.py), sampled verification over fixed candidates (`sampled_tree_verify`:
the runtime's `sampled_tree_choice` matched greedily down the tree), SpecInfer-style recursive
rejection over a drawn tree (`tree_rejection_sample`) and `compact_cache`. They are built from the
runtime's pure tree functions (inference/tree/ops.py), so a test of one of them tests those too.
"""
from __future__ import annotations

from typing import Sequence

import torch

from draftsmith_kernels.rejection_sample import inverse_cdf
from inference.tree.ops import (Tree, TreeCandidates, ancestor_mask, compaction_moves, expand_depth, finalize,
                                greedy_tree_verify, move_entries_reference, sampled_tree_choice)


def _tree(tokens, parents, depths, base_positions) -> Tree:
    return Tree(tokens, parents, depths, ancestor_mask(parents), base_positions[:, None] + depths)


# ---------------------------------------------------------------------------- EAGLE-2 trees
def start_tree(batch: int, device=None) -> TreeCandidates:
    """No candidates yet; the frontier is the root with score 0."""
    empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
    return TreeCandidates(empty, empty, empty.float(), empty,
                          torch.full((batch, 1), -1, dtype=torch.long, device=device),
                          torch.zeros(batch, 1, device=device),
                          torch.zeros(batch, 0, 0, dtype=torch.bool, device=device))


def select_tree(root_logprobs, child_logprobs_fn, depth: int, top_k: int, total_tokens: int,
                base_positions) -> Tree:
    """The whole EAGLE-2 selection. root_logprobs [B,V] is the drafter's log-distribution after
    the root; child_logprobs_fn(state) → [B,F,V], its log-distribution after each frontier node
    of `state` (the caller runs its drafter there, under the frontier's ancestor mask)."""
    state = start_tree(root_logprobs.shape[0], root_logprobs.device)
    logprobs = root_logprobs[:, None]
    for d in range(depth):
        if d:
            logprobs = child_logprobs_fn(state)
        top = logprobs.topk(top_k, dim=-1)  # [B,F,top_k]
        state = expand_depth(state, top.indices, top.values, top_k)
    return finalize(state, total_tokens, base_positions)


# ---------------------------------------------------------------------------- static trees
def static_tree_structure(paths: Sequence[Sequence[int]]):
    """Medusa-style paths, each a tuple of choice ranks from the root ((0,), (1,), (0, 0), ...)
    → (parents [N], depths [N], choices [N]) on the host, nodes ordered by depth then path.
    Every prefix of a path must be a path too."""
    ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = []
    for p in ordered:
        if not p:
            raise ValueError("an empty path names the root, which is not a tree node")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"path {p} has no parent path {p[:-1]}")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return (torch.tensor(parents), torch.tensor([len(p) for p in ordered]),
            torch.tensor([p[-1] for p in ordered]))


def static_tree(paths, candidates: torch.Tensor, base_positions: torch.Tensor) -> Tree:
    """A fixed tree filled from per-depth candidates [B,D,K] (Medusa: head d's top-K tokens):
    the node at path (c_1, .., c_d) holds candidates[b, d-1, c_d]."""
    parents, depths, choices = (t.to(candidates.device) for t in static_tree_structure(paths))
    B = candidates.shape[0]
    tokens = candidates[:, depths - 1, choices]  # [B,N]
    return _tree(tokens, parents.expand(B, -1), depths.expand(B, -1), base_positions)


# ---------------------------------------------------------------------------- verification
def sampled_tree_verify(tree_tokens, parents, target_probs, u, max_depth: int | None = None, ancestors=None):
    """Exact sampling from the target over a tree of fixed candidates (chosen from the draft
    alone: an EAGLE-2 tree, top-k by score, reranked, pruned): one draw from the target after
    the root and after every node, then the longest path whose every node is its parent's draw.

    target_probs [B,N+1,V] (after the root, then after node i at i+1), u [B,N+1] uniforms.
    At the root the draw s ~ p_root is the next token whatever the tree holds; when s is one
    of the root's children the step moves there and its own draw comes next, otherwise s is
    the bonus: the target sampled token by token, the tree only saying how far one verify
    step reaches. Needs distinct sibling tokens (top-k ids are): with two equal siblings the
    deeper match would be preferred. Returns (path [B,max_depth], length [B], bonus [B]), as
    `greedy_tree_verify`, whose matching it is."""
    return greedy_tree_verify(tree_tokens, parents, sampled_tree_choice(target_probs, u), max_depth, ancestors)


def tree_rejection_sample(tree_tokens, parents, draft_probs, target_probs, u_accept, u_sample):
    """Multi-candidate speculative sampling over a tree from given uniforms (SpecInfer-style
    recursive rejection), exact for the target's distribution when each node's children were
    drawn, in index order and without replacement, from that node's draft distribution.

    draft_probs / target_probs [B,N+1,V]: q and p after the root (index 0) and after node i
    (index i+1). u_accept [B,D,K] (D: depths tried, K: children tried per node), u_sample [B].
    At the current node the children are tried in order: child x is accepted when
    u * q(x) < p(x) (probability min(1, p/q)); on rejection p <- normalize(max(p - q, 0)) and
    q <- q without x, renormalised (the distribution the next sibling was drawn from). With
    every child rejected, or at a leaf, the next token is drawn from p. Returns
    (path [B,D], length [B], next_token [B]), as `greedy_tree_verify`.

    Exactness needs the kept siblings to be a prefix of their draw order: a rerank that drops
    an earlier-drawn sibling but keeps a later one (finalize by score) biases the result, so a
    sampled tree must be pruned by whole draw-order suffixes."""
    B, N = tree_tokens.shape
    D, K = u_accept.shape[1], u_accept.shape[2]
    rows = torch.arange(B, device=tree_tokens.device)
    cur = torch.full((B,), -1, dtype=torch.long, device=tree_tokens.device)
    alive = torch.ones(B, dtype=torch.bool, device=tree_tokens.device)  # still descending
    path = torch.full((B, D), -1, dtype=torch.long, device=tree_tokens.device)
    source = target_probs[:, 0].float()  # [B,V] where the next token comes from
    for d in range(D):
        p, q = target_probs[rows, cur + 1].float(), draft_probs[rows, cur + 1].float()
        children = (parents == cur[:, None]) & alive[:, None]  # [B,N]
        rank = children.long().cumsum(1) - 1
        moved = torch.zeros_like(alive)
        nxt = cur
        for r in range(K):
            is_r = children & (rank == r)
            child = is_r.long().argmax(1)
            token = tree_tokens.gather(1, child[:, None])  # [B,1]
            tried = is_r.any(1) & ~moved & (token[:, 0] >= 0)  # empty slots are skipped
            x = token.clamp_min(0)
            ok = tried & (u_accept[:, d, r] * q.gather(1, x).squeeze(1) < p.gather(1, x).squeeze(1))
            nxt, moved = torch.where(ok, child, nxt), moved | ok
            rejected = (tried & ~ok)[:, None]
            p, q = torch.where(rejected, _residual(p, q), p), torch.where(rejected, _without(q, x), q)
        stop = alive & ~moved
        source = torch.where(stop[:, None], p, source)
        path[:, d] = torch.where(moved, nxt, -1)
        cur, alive = nxt, moved
    # rows that accepted D nodes take the bonus from the target after the last one
    source = torch.where(alive[:, None], target_probs[rows, cur + 1].float(), source)
    return path, (path >= 0).sum(1), inverse_cdf(source, u_sample)


def _residual(p, q):
    """normalize(max(p - q, 0)), or p itself where that vanishes (p == q: never rejected)."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def _without(q, x):
    """q with token x [B,1] removed, renormalised: the distribution of the next sibling drawn
    without replacement."""
    q = q.scatter(1, x, 0.0)
    return q / q.sum(-1, keepdim=True).clamp_min(1e-30)


def tree_rejection_verify(tree_tokens, parents, draft_probs, target_probs, generator=None,
                          max_depth: int | None = None, max_children: int | None = None):
    """`tree_rejection_sample` with uniforms drawn from `generator`. max_depth / max_children
    (default N) bound the loops: the tree's depth and the widest node's child count."""
    B, N = tree_tokens.shape
    D, K = max_depth or N, max_children or N
    u_accept = torch.rand(B, D, K, device=tree_tokens.device, generator=generator)
    u_sample = torch.rand(B, device=tree_tokens.device, generator=generator)
    return tree_rejection_sample(tree_tokens, parents, draft_probs, target_probs, u_accept, u_sample)


# ---------------------------------------------------------------------------- KV compaction
def compact_cache(k_cache, v_cache, src_positions, dst_positions, valid):
    """Move cache entries [..., B,nkv,S,d] by position, in place: entry src[b, j] → dst[b, j]
    where valid[b, j]; nothing else changes (`compaction_moves`, then `move_entries_reference`)."""
    moves = compaction_moves(src_positions, dst_positions, valid, k_cache.shape[-2])
    return move_entries_reference(k_cache, v_cache, *moves)
