"""Draft trees: EAGLE-2 dynamic selection, static (Medusa-style) trees, tree verification and
KV compaction, as small pure functions on fixed-shape tensors (no host syncs, so a step built
from them can be captured in a CUDA graph).

A tree hangs below the root, the row's last verified token (the bonus token) at cache position
`base`. Its N nodes are laid out parents before children (parents[b, i] < i), and described by

    tokens    [B,N] target ids (-1 = empty slot, never accepted)
    parents   [B,N] node index of the parent, -1 = a child of the root
    depths    [B,N] 1 for the root's children, 2 for theirs, ...
    mask      [B,N,N] bool, mask[b, i, j]: node i attends to node j (itself and its ancestors)
    positions [B,N] base + depth, the position each node's token is fed at

The verify forward feeds the N nodes, attending to the row's cache at positions <= base and
to the tree block under `mask` (kernels/tree_attention.py); node i's K/V are kept at cache slot
base + 1 + i until `compact_cache` moves the accepted path to base + 1 .. base + L.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from draftsmith_kernels.dispatch import use_kernel
from draftsmith_kernels.argmax import argmax_chunks
from draftsmith_kernels.chain_state import advance_inputs_reference
from draftsmith_kernels.emit import EmitState, emit_reference, feed_reference
from draftsmith_kernels.rejection_sample import inverse_cdf
from draftsmith_kernels.tree_accept import TreeAccept, move_entries_triton, tree_accept_triton
from draftsmith_kernels.tree_select import Candidates, Frontier, candidate_depths, finalize_triton, \
    root_frontier


class Tree(NamedTuple):
    tokens: torch.Tensor  # [B,N]
    parents: torch.Tensor  # [B,N]
    depths: torch.Tensor  # [B,N]
    mask: torch.Tensor  # [B,N,N]
    positions: torch.Tensor  # [B,N]


class TreeCandidates(NamedTuple):
    """EAGLE-2 expansion state: every candidate drafted so far (C of them, stored depth by
    depth, so a lower index never has a greater depth) and the frontier to expand next."""
    tokens: torch.Tensor  # [B,C]
    parents: torch.Tensor  # [B,C] candidate index of the parent, -1 = the root
    scores: torch.Tensor  # [B,C] cumulative draft log-probability from the root
    depths: torch.Tensor  # [B,C]
    frontier: torch.Tensor  # [B,F] candidate indices to expand (-1 = the root itself)
    frontier_scores: torch.Tensor  # [B,F]
    ancestors: torch.Tensor  # [B,C,C] bool: candidate i is j or descends from j (`ancestor_mask` of parents)
    level: int = 0  # the frontier's depth (0: the root): every frontier node is a child of the last expansion


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B,N] parent indices → [B,N,N] bool: node i sees itself and its ancestors. The
    reflexive-transitive closure of the parent relation by repeated squaring: ceil(log2 N)
    small batched matmuls instead of a loop over nodes or depths."""
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    has_parent = (parents >= 0)[..., None]
    step = torch.zeros(B, N, N, dtype=torch.bool, device=parents.device)
    step = step.scatter(2, parents.clamp_min(0)[..., None], has_parent) | eye
    for _ in range(math.ceil(math.log2(max(N - 1, 1)))):
        reach = step.float()
        step = torch.bmm(reach, reach) > 0
    return step


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


def expand_depth(state: TreeCandidates, child_tokens, child_logprobs, top_k: int) -> TreeCandidates:
    """One depth of EAGLE-2: the drafter has run on the F frontier nodes and proposes k children
    each (child_tokens / child_logprobs [B,F,k], the drafter's top-k and their log-probs). All
    F*k become candidates with score = parent score + log-prob; the best `top_k` of them (ties:
    lower index) are the next frontier. Shapes depend only on (F, k, top_k), so a drafter
    driven depth by depth has one static shape per depth.

    Log-probs are clamped to <= 0, so a child never outscores its parent (a float sum with a
    non-positive term never exceeds the other term): `finalize` relies on it."""
    B, F, k = child_tokens.shape
    C = state.tokens.shape[1]
    scores = (state.frontier_scores[:, :, None] + child_logprobs.float().clamp_max(0)).reshape(B, F * k)
    parents = state.frontier[:, :, None].expand(B, F, k).reshape(B, F * k)
    # the frontier is one depth (the last expansion's best children), so its children are the next
    depths = torch.full((B, F * k), state.level + 1, dtype=torch.long, device=child_tokens.device)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]  # [B,top_k]
    return TreeCandidates(torch.cat([state.tokens, child_tokens.reshape(B, F * k)], 1),
                          torch.cat([state.parents, parents], 1),
                          torch.cat([state.scores, scores], 1),
                          torch.cat([state.depths, depths], 1),
                          C + order, scores.gather(1, order),
                          extend_ancestors(state.ancestors, parents), state.level + 1)


def extend_ancestors(ancestors: torch.Tensor, new_parents: torch.Tensor) -> torch.Tensor:
    """[B,C,C] ancestor matrix of C candidates, [B,n] parents of n new ones (candidate indices
    < C; -1, the root, only while there are no candidates: EAGLE-2 expands the root, then
    candidates alone) → [B,C+n,C+n]: a new candidate's row is its parent's row plus itself.
    Kept level by level, so a tree's mask costs a few gathers instead of `ancestor_mask`'s
    log2(N) matmuls at every depth (launches are what a tree step on a GPU pays for)."""
    B, C, _ = ancestors.shape
    n = new_parents.shape[1]
    eye = torch.eye(n, dtype=torch.bool, device=ancestors.device).expand(B, n, n)
    if C == 0:  # the root's children: each is its only candidate ancestor
        return eye.contiguous()
    rows = ancestors.gather(1, new_parents[..., None].expand(B, n, C))
    return torch.cat([torch.nn.functional.pad(ancestors, (0, n)), torch.cat([rows, eye], 2)], 1)


def finalize(state: TreeCandidates, total_tokens: int, base_positions: torch.Tensor) -> Tree:
    """EAGLE-2's rerank: keep the `total_tokens` candidates of highest cumulative score, laid
    out in candidate order (depth-major, so parents come before children).

    Ranking is (score descending, then candidate index ascending), a stable sort. A child's
    score never exceeds its parent's and its index is larger, so the parent always ranks first,
    even on equal scores: every kept node's parent is kept. Equal scores fall to the lower
    depth, then the lower index (the candidate order is depth-major)."""
    B, C = state.tokens.shape
    if not 0 < total_tokens <= C:
        raise ValueError(f"total_tokens={total_tokens} needs 1..{C} (the candidates drafted)")
    best = torch.sort(state.scores, dim=1, descending=True, stable=True).indices[:, :total_tokens]
    kept = best.sort(dim=1).values  # [B,N] candidate indices in layout order
    node_of = torch.full((B, C), -1, dtype=torch.long, device=kept.device)
    node_of.scatter_(1, kept, torch.arange(total_tokens, device=kept.device).expand(B, -1))
    parent_cand = state.parents.gather(1, kept)
    parents = torch.where(parent_cand >= 0, node_of.gather(1, parent_cand.clamp_min(0)), -1)
    # every kept node's ancestors are kept: the mask is the candidates' one at the kept rows and columns
    mask = state.ancestors.gather(1, kept[..., None].expand(B, total_tokens, C))
    mask = mask.gather(2, kept[:, None, :].expand(B, total_tokens, total_tokens))
    depths = state.depths.gather(1, kept)
    return Tree(state.tokens.gather(1, kept), parents, depths, mask, base_positions[:, None] + depths)


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


# ---------------------------------------------------------------------------- the same on fixed buffers
# A drafter drafting in CUDA graphs keeps its candidates in fixed buffers (kernels/tree_select.py:
# Candidates, the layout, and the kernels); these references compose expand_depth and finalize
# on them, and the dispatchers run the kernels on CUDA tensors (unless DRAFTSMITH_KERNELS=0).
def expand_level_reference(child_ids, child_logprobs, draft_ids, frontier, frontier_scores, off: int, level: int,
                           last, cand: Candidates, top_k: int) -> Frontier:
    """One depth: child_ids [B,F,k] (rows of the draft vocabulary, mapped by draft_ids [Vd]) and
    child_logprobs [B,F,k] of the frontier (index, scores [B,F]; None: the root alone) become
    candidates off .. off + F k of `cand`; → the next frontier and what the drafter reads there,
    its nodes fed at position last + level + 1."""
    B, Fr, k = child_ids.shape
    if frontier is None:
        frontier, frontier_scores = root_frontier(B, child_ids.device)
    C, end = cand.tokens.shape[1], off + Fr * k
    depths = candidate_depths(off, k, top_k, child_ids.device).expand(B, off)
    state = TreeCandidates(cand.tokens[:, :off], cand.parents[:, :off], cand.scores[:, :off], depths, frontier,
                           frontier_scores, cand.ancestors[:, :off, :off], level)
    new = expand_depth(state, draft_ids[child_ids], child_logprobs, top_k)
    cand.tokens[:, off:end] = new.tokens[:, off:]
    cand.parents[:, off:end] = new.parents[:, off:]
    cand.scores[:, off:end] = new.scores[:, off:]
    cand.ancestors[:, off:end, :end] = new.ancestors[:, off:]
    cand.ancestors[:, off:end, end:] = False
    index = new.frontier
    visible = new.ancestors.gather(1, index[..., None].expand(-1, -1, end))
    # candidate off + f k + j is child j of frontier row f
    return Frontier(index, new.frontier_scores, new.tokens.gather(1, index), (index - off) // k,
                    F.pad(visible, (0, C - end)), (last + level + 1)[:, None].expand_as(index))


def finalize_reference(cand: Candidates, k: int, top_k: int, total_tokens: int, base_positions) -> Tree:
    """`finalize` of every candidate in `cand` (drafting k children per node, top_k per depth)."""
    B, C = cand.tokens.shape
    depths = candidate_depths(C, k, top_k, cand.tokens.device).expand(B, C)
    state = TreeCandidates(cand.tokens, cand.parents, cand.scores, depths, cand.parents[:, :0], cand.scores[:, :0],
                           cand.ancestors)
    return finalize(state, total_tokens, base_positions)


def finalize_candidates(cand: Candidates, k: int, top_k: int, total_tokens: int, base_positions,
                        out: Tree | None = None, base_offset: int = 0, feed=None, moves=None) -> Tree:
    """`finalize_reference` (node positions base_positions + base_offset + depth), through one
    kernel launch on CUDA tensors; into `out`'s tensors when given (a drafter drafting in CUDA
    graphs keeps one Tree that every graph writes). feed: (tokens [B,S], length [B], fed [B,N+1],
    fed_positions [B,N+1]), a loop's state and the verify step's input, written as
    kernels/emit.py's `feed` writes it; moves: (k_cache, v_cache, src, dst), the last verify's
    cache moves (`move_entries`); both inside the same launch on CUDA tensors."""
    if use_kernel(cand.tokens):  # (the offset added in the kernel: no launch of its own)
        return Tree(*finalize_triton(cand, k, top_k, total_tokens, base_positions, out, base_offset, feed, moves))
    if moves is not None:
        move_entries_reference(*moves)
    tree = finalize_reference(cand, k, top_k, total_tokens, base_positions + base_offset)
    if out is not None:
        for buffer, value in zip(out, tree):
            buffer.copy_(value)
        tree = out
    if feed is not None:
        loop_tokens, loop_length, fed, fed_positions = feed
        feed_reference(loop_tokens, loop_length, tree.tokens, fed, fed_positions, tree.positions)
    return tree


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
def _path_of(leaf, on_path, depths, max_depth: int):
    """[B] leaf, [B,N] nodes on its root path, [B,N] depths → [B,max_depth] node at each
    depth along the path (-1 beyond its end)."""
    N = on_path.shape[1]
    at = on_path[:, None, :] & (depths[:, None, :] == torch.arange(1, max_depth + 1, device=leaf.device)[None, :, None])
    node = at.long().argmax(-1)  # [B,max_depth]
    return torch.where(at.any(-1), node, -1) if N else node


def greedy_tree_verify(tree_tokens, parents, target_choice, max_depth: int | None = None, ancestors=None):
    """Greedy acceptance of the longest matching root-to-leaf path.

    target_choice [B,N+1]: the target's argmax after the root (column 0) and after node i
    (column i+1). Node i matches when its token is its parent's target choice; it is accepted
    when it and all its ancestors match. The deepest accepted node wins (the lowest index among
    equals). Returns path [B,max_depth] (node indices by depth, -1 padded; max_depth defaults to
    N), length [B] and bonus [B]: the target's choice after the last accepted node.
    ancestors: the tree's mask [B,N,N] when the caller has it (`ancestor_mask(parents)`)."""
    B, N = tree_tokens.shape
    max_depth = N if max_depth is None else max_depth
    match = tree_tokens == target_choice.gather(1, parents + 1)  # [B,N]
    anc = ancestor_mask(parents) if ancestors is None else ancestors
    accepted = ~(anc & ~match[:, None, :]).any(-1)  # [B,N]
    depths = anc.sum(-1)
    reach = torch.where(accepted, depths, 0)
    leaf = reach.argmax(1) if N else torch.zeros(B, dtype=torch.long, device=tree_tokens.device)
    length = reach.gather(1, leaf[:, None]).squeeze(1) if N else leaf
    on_path = anc[torch.arange(B, device=leaf.device), leaf] & (length > 0)[:, None]
    bonus = target_choice.gather(1, torch.where(length > 0, leaf + 1, 0)[:, None]).squeeze(1)
    return _path_of(leaf, on_path, depths, max_depth), length, bonus


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


def sampled_tree_choice(target_probs, u):
    """target_probs [B,N+1,V], u [B,N+1] → [B,N+1]: one draw from the target after the root and
    after each node (inverse CDF), the `choice` greedy matching reads."""
    B, N1, V = target_probs.shape
    return inverse_cdf(target_probs.reshape(B * N1, V).float(), u.reshape(B * N1)).view(B, N1)


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
def compaction_index(path, base_positions):
    """path [B,D] (accepted nodes by depth, -1 padded), base [B] → (src, dst, valid) [B,D]:
    node path[j]'s entries sit at tree slot base + 1 + path[j] and belong at base + 1 + j.
    src >= dst always (a node at depth j+1 has index >= j), so one gather-then-scatter is safe."""
    dst = base_positions[:, None] + 1 + torch.arange(path.shape[1], device=path.device)
    valid = path >= 0
    return torch.where(valid, base_positions[:, None] + 1 + path, dst), dst, valid


def compaction_moves(src_positions, dst_positions, valid, slots: int):
    """(src, dst, valid) [B,D] → (src, dst) [B,D] with every slot a move, so that the moves
    are graph-safe and deterministic: invalid slots are redirected to repeat a valid move of
    their row (or, in a row with none, to copy one slot onto itself), so every duplicate index
    of the scatter writes the same value; no host sync, no data-dependent shapes."""
    last = (valid.long().sum(1) - 1).clamp_min(0)[:, None]  # [B,1] the row's last valid move
    any_valid = valid.any(1, keepdim=True)
    still = dst_positions[:, :1].clamp(0, slots - 1)
    fill_src = torch.where(any_valid, src_positions.gather(1, last), still)
    fill_dst = torch.where(any_valid, dst_positions.gather(1, last), still)
    return torch.where(valid, src_positions, fill_src), torch.where(valid, dst_positions, fill_dst)


def move_entries(k_cache, v_cache, src, dst):
    """`move_entries_reference`, in one kernel launch on CUDA tensors (kernels/tree_accept.py)."""
    fn = move_entries_triton if use_kernel(k_cache) else move_entries_reference
    return fn(k_cache, v_cache, src, dst)


def move_entries_reference(k_cache, v_cache, src, dst):
    """Cache entries [..., B,nkv,S,d] moved by position, in place: entry src[b, j] → dst[b, j]
    in every leading index (a target's layers [L,B,nkv,S,d] at once: one gather and one
    scatter per cache, where a loop over 30 layers launched ~450 kernels and cost ~1.2 ms of a
    verify step on an H200). All sources are read before any write; src, dst [B,D] as
    `compaction_moves` leaves them."""
    L = src.shape[1]
    for cache in (k_cache, v_cache):
        shape = (*cache.shape[:-2], L, cache.shape[-1])  # [..., B, nkv, L, d]
        moved = cache.gather(-2, src[:, None, :, None].expand(shape))
        cache.scatter_(-2, dst[:, None, :, None].expand(shape), moved)
    return k_cache, v_cache


def compact_cache(k_cache, v_cache, src_positions, dst_positions, valid):
    """Move cache entries [..., B,nkv,S,d] by position, in place: entry src[b, j] → dst[b, j]
    where valid[b, j]; nothing else changes (`compaction_moves`, then `move_entries`)."""
    return move_entries(k_cache, v_cache, *compaction_moves(src_positions, dst_positions, valid, k_cache.shape[-2]))


# ---------------------------------------------------------------------------- a verified tree's bookkeeping
def tree_accept_reference(tree_tokens, parents, mask, choice, base, root, active, max_depth: int,
                          slots: int, last=None) -> TreeAccept:
    """Everything a verified tree step decides, from the target's choices (kernels/tree_accept.py
    says the shapes): the accepted path (`greedy_tree_verify`), its tokens, the cache moves for
    the active rows (`compaction_index`, `compaction_moves`), and the drafter's next input (fed
    and index; given the drafter's last position last [B], also its tokens and positions:
    kernels/chain_state.py's `advance_inputs`)."""
    path, length, bonus = greedy_tree_verify(tree_tokens, parents, choice, max_depth, mask)
    path_tokens = torch.where(path >= 0, tree_tokens.gather(1, path.clamp_min(0)), -1)
    src, dst, valid = compaction_index(path, base)
    src, dst = compaction_moves(src, dst, valid & active[:, None], slots)
    fed = torch.cat([root[:, None], path_tokens.clamp_min(0)], 1)
    index = torch.cat([torch.zeros_like(path[:, :1]), 1 + path.clamp_min(0)], 1)  # in each row's N + 1 outputs
    index = index + torch.arange(len(index), device=index.device)[:, None] * (tree_tokens.shape[1] + 1)  # flattened
    following = (None, None) if last is None else advance_inputs_reference(fed, bonus, length, last)
    return TreeAccept(path, length, bonus, path_tokens, fed, index, src, dst, *following)


def tree_accept(tree_tokens, parents, mask, choice, base, root, active, max_depth: int, slots: int, *,
                logits=None, emit_into: EmitState | None = None, last=None) -> TreeAccept:
    """`tree_accept_reference`, through one kernel launch on CUDA tensors. logits [B,N+1,V]
    instead of choice (None): the target's greedy choices, its argmax after the root and each node
    (on CUDA the argmax's chunk launch, its merge inside the kernel). emit_into: the step is also
    emitted into the loop's state (kernels/emit.py `emit`; inside the kernel on CUDA). last [B]:
    the drafter's last position, for its next input (next_tokens, next_positions)."""
    if use_kernel(tree_tokens):
        chunks = None
        if logits is not None:
            maxima, columns, _ = argmax_chunks(logits.flatten(0, 1))
            chunks = (maxima, columns)
        return tree_accept_triton(tree_tokens, parents, mask, choice, base, root, active, max_depth, slots,
                                  chunks=chunks, emit_into=emit_into, last=last)
    if logits is not None:
        choice = logits.argmax(-1)  # [B,N+1] (ties: the lowest id, as the kernels break them)
    accepted = tree_accept_reference(tree_tokens, parents, mask, choice, base, root, active, max_depth, slots, last)
    if emit_into is not None:
        emit_reference(accepted.path_tokens, accepted.length, accepted.bonus, *emit_into)
    return accepted
