"""Draft trees as pure torch functions on fixed-shape tensors (no host syncs, so a step built from
them can be captured in a CUDA graph): EAGLE-2 dynamic selection, greedy tree verification (at
T > 0 on one draw from the target per node) and KV compaction. These are the references the
tree step's kernels are tested against (tests/test_tree_select.py, tests/test_tree_accept.py)
and what the step runs where the kernels do not (a CPU); inference/tree/plan.py launches one or
the other. References only the tests use sit in tests/tree_reference.py.

A tree hangs below the root, the row's last verified token (the bonus token) at cache position
`base`. Its N nodes are laid out parents before children (parents[b, i] < i), and described by

    tokens    [B,N] target ids (-1 = empty slot, never accepted)
    parents   [B,N] node index of the parent, -1 = a child of the root
    depths    [B,N] 1 for the root's children, 2 for theirs, ...
    mask      [B,N,N] bool, mask[b, i, j]: node i attends to node j (itself and its ancestors)
    positions [B,N] base + depth, the position each node's token is fed at

The verify forward feeds the root and the N nodes, attending to the row's cache at positions
<= base and to the tree block under `mask` (kernels/tree_attention.py); node i's K/V are kept at
cache slot base + 1 + i until the accepted path's moves (`compaction_moves`,
`move_entries_reference`) put it at base + 1 .. base + L.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftsmith_kernels.chain_state import advance_inputs_reference
from draftsmith_kernels.rejection_sample import inverse_cdf
from draftsmith_kernels.tree_accept import TreeAccept
from draftsmith_kernels.tree_select import Candidates, Frontier, candidate_depths, root_frontier


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


# ---------------------------------------------------------------------------- EAGLE-2 trees


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


# ---------------------------------------------------------------------------- the same on fixed buffers
# A drafter drafting in CUDA graphs keeps its candidates in fixed buffers (kernels/tree_select.py:
# Candidates, the layout, and the kernels); these references compose expand_depth and finalize
# on them, bit for bit what the kernels write.
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


def sampled_tree_choice(target_probs, u):
    """target_probs [B,N+1,V], u [B,N+1] → [B,N+1]: one draw from the target after the root and
    after each node (inverse CDF), the `choice` greedy matching reads."""
    B, N1, V = target_probs.shape
    return inverse_cdf(target_probs.reshape(B * N1, V).float(), u.reshape(B * N1)).view(B, N1)


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


def move_entries_reference(k_cache, v_cache, src, dst):
    """Cache entries [..., B,nkv,S,d] moved by position, in place: entry src[b, j] → dst[b, j]
    in every leading index (a target's layers [L,B,nkv,S,d] at once: one gather and one
    scatter per cache, not a loop over layers). All sources are read before any write; src, dst
    [B,D] as `compaction_moves` leaves them."""
    L = src.shape[1]
    for cache in (k_cache, v_cache):
        shape = (*cache.shape[:-2], L, cache.shape[-1])  # [..., B, nkv, L, d]
        moved = cache.gather(-2, src[:, None, :, None].expand(shape))
        cache.scatter_(-2, dst[:, None, :, None].expand(shape), moved)
    return k_cache, v_cache


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


