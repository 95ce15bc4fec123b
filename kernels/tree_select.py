"""EAGLE-2 selection on fixed candidate buffers, inside launches a drafter's depth makes anyway,
and one for the rerank, instead of about twenty-five and fifteen: what inference/tree/ops.py's
`expand_depth` and `finalize` compute (its `expand_level_reference` and `finalize_reference`
compose them on these buffers; inference/tree/plan.py's `rerank` runs the rerank's kernel on
CUDA tensors), laid out for a drafter that drafts depth by depth in a CUDA graph.

    Candidates: tokens [B,C] (target ids), parents [B,C] (candidate index, -1: the root),
    scores [B,C] (cumulative draft log-probability), ancestors [B,C,C] bool; candidate c of a
    tree whose root has top_k children and whose later depths expand top_k nodes into k
    children each sits at depth 1 (c < top_k), else 2 + (c - top_k) // (top_k k). Each depth
    writes its block in full (ancestor rows included), so the buffers need no clearing between
    drafts.

    expanding a depth: the drafter's children of the F frontier nodes (the root alone first;
    k rows of the draft vocabulary each, with their log-probabilities) become candidates
    off .. off + F k; the best top_k of them (stable: ties to the lower index) are the next
    frontier, returned with what the drafter reads there (`Frontier`).
    finalize: the best `total_tokens` candidates by score (ties to the lower index), in
    candidate order: the Tree (inference/tree/ops.py) the target verifies.

A depth's expansion runs inside two launches the drafter makes anyway (inference/tree/loop.py
`_expand`): `expand_children_triton`, the head's merge, writes each node's children as
candidates (its epilogue), and `frontier_norm_pair_triton`, the next layer's input norms, has
each program rank the depth's children to find its frontier node (its prologue). The rerank
(`finalize_triton`) carries two epilogues of the step (inference/tree/plan.py): the verify
step's input (`Feed`) and the last verify's cache moves (`Moves`, in programs of their own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    from draftsmith_kernels.lm_head_topk import TOPK_BLOCK_V, merge_row, topk_chunks
    from draftsmith_kernels.rms_norm import pair_half
    from draftsmith_kernels.tree_accept import move_arguments, move_layer
except ImportError:
    triton = None

from draftsmith_kernels.emit import Feed  # noqa: E402  (the rerank's epilogues)
from draftsmith_kernels.tree_accept import Moves  # noqa: E402


class Candidates(NamedTuple):
    tokens: torch.Tensor  # [B,C]
    parents: torch.Tensor  # [B,C]
    scores: torch.Tensor  # [B,C] float32
    ancestors: torch.Tensor  # [B,C,C] bool

    @staticmethod
    def empty(batch: int, count: int, device) -> "Candidates":
        long = dict(dtype=torch.long, device=device)
        return Candidates(torch.empty(batch, count, **long), torch.empty(batch, count, **long),
                          torch.empty(batch, count, dtype=torch.float32, device=device),
                          torch.empty(batch, count, count, dtype=torch.bool, device=device))


class Frontier(NamedTuple):
    index: torch.Tensor  # [B,F] candidate indices (-1: the root)
    scores: torch.Tensor  # [B,F] their cumulative scores
    tokens: torch.Tensor  # [B,F] their tokens, the drafter's next input
    parent_row: torch.Tensor  # [B,F] each node's parent's row in the frontier it was drafted from
    # (0 at the first depth: the root): where the drafter's output holds its parent's hidden state
    visible: torch.Tensor  # [B,F,C] bool: each node's ancestors and itself
    positions: torch.Tensor  # [B,F] the position each node is fed at (last + depth)


def root_frontier(batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The frontier before any depth: the root alone, score 0 → (index [B,1], scores [B,1]).
    (`expand_children_triton` takes None for both instead: the kernel knows the root without them.)"""
    return torch.full((batch, 1), -1, dtype=torch.long, device=device), torch.zeros(batch, 1, device=device)


def candidate_depths(count: int, k: int, top_k: int, device) -> torch.Tensor:
    """[count] depth of each candidate index (the layout above)."""
    c = torch.arange(count, device=device)
    return torch.where(c < top_k, 1, 2 + (c - top_k).clamp_min(0) // (top_k * k))


# ----------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _rerank_kernel(scores_ptr, tokens_ptr, parents_ptr, anc_ptr, base_ptr, o_tokens_ptr, o_parents_ptr,
                       o_depths_ptr, o_mask_ptr, o_positions_ptr, C, N, FIRST, PER_DEPTH, BASE_OFFSET, s_c_b, s_a_b,
                       s_a_r, loop_tokens_ptr, loop_length_ptr, fed_ptr, fed_positions_ptr, s_lt_b, s_f_b, s_fp_b,
                       RANK_BLOCKS, k_ptr, v_ptr, src_ptr, dst_ptr, NKV, D, stride_l, stride_b, stride_h, stride_s,
                       BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, FEED: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (row, block of BLOCK_I candidates i): the kept candidates among them written as tree
        nodes. Every ranking program ranks all C candidates of its row (score descending, ties to the
        lower index; C^2 compares, BLOCK_J columns at a time), so each knows every candidate's node
        (the kept ones before it, counted in registers) with no scratch, barrier or second launch; the
        row's data is loaded first, no load waiting on another's value.
        FEED (an epilogue): also the verify step's input, as kernels/emit.py's `feed` writes it: the
        row's last token (loop_tokens at loop_length - 1) and that position, then the nodes' tokens
        and positions. Programs (row, RANK_BLOCKS + layer), where the grid has them, move the
        target's cache entries after the last verify instead (an epilogue: kernels/tree_accept.py
        `move_layer`): nothing reads that cache between the verify and this launch."""
        row = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1) - RANK_BLOCKS
        if layer >= 0:
            move_layer(k_ptr, v_ptr, src_ptr, dst_ptr, row, layer, NKV, D, stride_l, stride_b, stride_h, stride_s,
                       HEAD_DIM, BLOCK_H, BLOCK_M, BLOCK_D)
        else:
            _rank_block(scores_ptr, tokens_ptr, parents_ptr, anc_ptr, base_ptr, o_tokens_ptr, o_parents_ptr,
                        o_depths_ptr, o_mask_ptr, o_positions_ptr, C, N, FIRST, PER_DEPTH, BASE_OFFSET, s_c_b, s_a_b,
                        s_a_r, loop_tokens_ptr, loop_length_ptr, fed_ptr, fed_positions_ptr, s_lt_b, s_f_b, s_fp_b,
                        row, BLOCK_C, BLOCK_I, BLOCK_J, FEED)

    @triton.jit
    def _rank_block(scores_ptr, tokens_ptr, parents_ptr, anc_ptr, base_ptr, o_tokens_ptr, o_parents_ptr,
                    o_depths_ptr, o_mask_ptr, o_positions_ptr, C, N, FIRST, PER_DEPTH, BASE_OFFSET, s_c_b, s_a_b,
                    s_a_r, loop_tokens_ptr, loop_length_ptr, fed_ptr, fed_positions_ptr, s_lt_b, s_f_b, s_fp_b,
                    row, BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, FEED: tl.constexpr):
        """`_rerank_kernel`'s ranking program (row, block tl.program_id(1) of BLOCK_I candidates)."""
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] this program's candidates
        c = tl.arange(0, BLOCK_C)  # [BLOCK_C] every candidate of the row
        i_in, c_in = i < C, c < C
        score = tl.load(scores_ptr + row * s_c_b + c, mask=c_in, other=0.0)
        token = tl.load(tokens_ptr + row * s_c_b + i, mask=i_in, other=0)
        parent = tl.load(parents_ptr + row * s_c_b + i, mask=i_in, other=-1)
        sees = tl.load(anc_ptr + row * s_a_b + i[:, None] * s_a_r + c[None, :], mask=i_in[:, None] & c_in[None, :],
                       other=0)  # [BLOCK_I, BLOCK_C]: each i's ancestor row
        base = tl.load(base_ptr + row) + BASE_OFFSET
        # [BLOCK_C, BLOCK_J] counts summed once after the loop (a sum a block made each block's
        # [BLOCK_C] result change layout through shared memory, with barriers, every block)
        ahead_count = tl.zeros([BLOCK_C, BLOCK_J], tl.int32)
        for j0 in range(0, C, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            s_j = tl.load(scores_ptr + row * s_c_b + j, mask=j < C, other=0.0)
            ahead = (s_j[None, :] > score[:, None]) | ((s_j[None, :] == score[:, None]) & (j[None, :] < c[:, None]))
            ahead_count += (ahead & (j < C)[None, :]).to(tl.int32)
        rank = tl.sum(ahead_count, 1)
        kept = c_in & (rank < N)  # N of them when the ranks are a permutation (no NaN score)
        kept_count = kept.to(tl.int32)
        node = tl.cumsum(kept_count, 0) - kept_count  # [BLOCK_C]: a kept candidate's node, in candidate order
        # (a NaN score has nothing ahead of it and is ahead of nothing, so more than N would be kept:
        # nodes past N are dropped and no store leaves the row's outputs; no drafter gives one, its
        # merge maps NaN to -inf)
        kept = kept & (node < N)
        is_i = c[None, :] == i[:, None]  # [BLOCK_I, BLOCK_C]: picks candidate i's entries from the row's
        kept_i = tl.sum((is_i & kept[None, :]).to(tl.int32), 1) > 0
        node_i = tl.sum(tl.where(is_i, node[None, :], 0), 1)
        # a kept candidate's parent is kept (its score is at least the child's, its index lower)
        parent_node = tl.sum(tl.where(c[None, :] == parent[:, None], node[None, :], 0), 1)
        parent_node = tl.where((parent >= 0) & (parent < C), parent_node, -1)
        depth = tl.where(i < FIRST, 1, 2 + (i - FIRST) // PER_DEPTH)
        out = row * N + node_i
        tl.store(o_tokens_ptr + out, token, mask=kept_i)
        tl.store(o_parents_ptr + out, parent_node, mask=kept_i)
        tl.store(o_depths_ptr + out, depth, mask=kept_i)
        tl.store(o_positions_ptr + out, base + depth, mask=kept_i)
        # node_i's mask row: the kept columns of its ancestor row, at their nodes (every one of the N written)
        tl.store(o_mask_ptr + row * N * N + node_i[:, None] * N + node[None, :], sees,
                 mask=kept_i[:, None] & kept[None, :])
        if FEED:  # [B,N+1]: the root at column 0, node n at column 1 + n
            tl.store(fed_ptr + row * s_f_b + 1 + node_i, tl.maximum(token, 0), mask=kept_i)
            tl.store(fed_positions_ptr + row * s_fp_b + 1 + node_i, base + depth, mask=kept_i)
            if tl.program_id(1) == 0:
                root_at = tl.load(loop_length_ptr + row) - 1
                tl.store(fed_ptr + row * s_f_b, tl.load(loop_tokens_ptr + row * s_lt_b + root_at))
                tl.store(fed_positions_ptr + row * s_fp_b, root_at)


if triton is not None:

    @triton.jit
    def _merge_children_kernel(max_ptr, sum_ptr, val_ptr, idx_ptr, draft_ids_ptr, frontier_ptr, fscores_ptr,
                               tokens_ptr, parents_ptr, scores_ptr, anc_ptr, NSPLIT, V, F, OFF, C,
                               s_fr_b, s_fs_b, s_c_b, s_a_b, s_a_r, K: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK_CAND: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                               AT_ROOT: tl.constexpr):
        """One frontier node (program b * F + f): the head's merge of its slices (kernels/lm_head_topk.py
        `merge_row`: its K best children, as log-probabilities), then what inference/tree/ops.py's
        expand_level_reference writes for them: candidates OFF + f K + j, their tokens, parent,
        score and ancestor rows. Ranking them into the next frontier needs every node's children:
        `_frontier_norm_pair_kernel` does it. The node's own data (its index, score and ancestor
        row's first block) is loaded before the merge, which does not wait on it (loaded after it,
        two more round trips to memory would follow one another)."""
        r = tl.program_id(0).to(tl.int64)
        b, f = r // F, r % F
        j = tl.arange(0, BLOCK_K)
        live = j < K
        c = OFF + f * K + j
        cols = tl.arange(0, BLOCK_C)
        if AT_ROOT:
            parent = b * 0 - 1  # (a scalar tensor, as the load below gives)
        else:
            parent = tl.load(frontier_ptr + b * s_fr_b + f)
            parent_score = tl.load(fscores_ptr + b * s_fs_b + f)
        # (a block mask: the interpreter takes no scalar mask here)
        from_parent = tl.load(anc_ptr + b * s_a_b + parent * s_a_r + cols, mask=(cols * 0 + parent >= 0) & (cols < OFF),
                              other=0)
        lp, column = merge_row(max_ptr, sum_ptr, val_ptr, idx_ptr, r, NSPLIT, V, K, BLOCK_S, BLOCK_CAND, BLOCK_K)
        # a NaN log-probability (a broken drafter) ranks last: tl.minimum would make it 0, the best,
        # and a NaN score would rank beside the best and leave a frontier slot unwritten
        lp = tl.where(lp == lp, lp, float("-inf"))
        if AT_ROOT:
            score = tl.minimum(lp, 0.0)
        else:
            score = parent_score + tl.minimum(lp, 0.0)
        token = tl.load(draft_ids_ptr + column, mask=live, other=-1)
        tl.store(tokens_ptr + b * s_c_b + c, token, mask=live)
        tl.store(parents_ptr + b * s_c_b + c, tl.zeros([BLOCK_K], tl.int64) + parent, mask=live)
        tl.store(scores_ptr + b * s_c_b + c, score, mask=live)
        # each child's ancestor row: its parent's (columns before OFF, every child alike) and itself
        _children_ancestors(anc_ptr, b, s_a_b, s_a_r, c, live, cols, from_parent, C)
        for c0 in range(BLOCK_C, C, BLOCK_C):  # (rows of more than BLOCK_C candidates)
            from_parent = tl.load(anc_ptr + b * s_a_b + parent * s_a_r + c0 + cols,
                                  mask=(cols * 0 + parent >= 0) & (c0 + cols < OFF), other=0)
            _children_ancestors(anc_ptr, b, s_a_b, s_a_r, c, live, c0 + cols, from_parent, C)

    @triton.jit
    def _children_ancestors(anc_ptr, b, s_a_b, s_a_r, c, live, cols, from_parent, C):
        """Children c's ancestor rows at columns `cols`: their parent's there (from_parent), and each
        child itself."""
        sees = ((from_parent != 0)[None, :] | (cols[None, :] == c[:, None])).to(tl.uint8)
        tl.store(anc_ptr + b * s_a_b + c[:, None] * s_a_r + cols[None, :], sees,
                 mask=live[:, None] & (cols < C)[None, :])

    @triton.jit
    def _frontier_norm_pair_kernel(tokens_ptr, scores_ptr, anc_ptr, last_ptr, o_index_ptr, o_scores_ptr,
                                   o_tokens_ptr, o_parent_row_ptr, o_visible_ptr, o_positions_ptr,
                                   table_ptr, tw_ptr, x_ptr, xw_ptr, out_ptr, xo_ptr,
                                   K, TOPK, N_NEW, OFF, C, LEVEL, H, eps, s_c_b, s_a_b, s_a_r, stride_t, stride_xb,
                                   stride_xr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
        """One (new candidate of this depth, half): among the N_NEW = F0 K candidates OFF.. of this
        depth (F0 nodes drafted from, x [B,F0,H]) it ranks `rank` (score descending, ties to the
        lower index, as expand_level_reference orders them; every program ranks them all, N_NEW
        compares); ranked below TOPK, it is slot `rank` of the next frontier. Half 0 writes the slot
        (`Frontier`) and normalises the node's token embedding; half 1 its parent's hidden state
        (row child // K of x), also copied to xo: kernels/rms_norm.py's `rms_norm_pair` with x_rows,
        for rows the frontier names as it is chosen. Everything a program may write is loaded
        first, whatever its rank, so the rank is counted while the rows are on their way (learning
        the node from the rank before loading its rows would add two round trips to memory)."""
        pid = tl.program_id(0).to(tl.int64)
        half = tl.program_id(1)
        b, child = pid // N_NEW, pid % N_NEW
        node = OFF + child
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        vc = tl.arange(0, BLOCK_C)
        m = tl.arange(0, BLOCK_M)
        live = m < N_NEW
        score = tl.load(scores_ptr + b * s_c_b + OFF + m, mask=live, other=0.0)  # [BLOCK_M] the depth's scores
        own = tl.load(scores_ptr + b * s_c_b + node)
        token = tl.load(tokens_ptr + b * s_c_b + node)
        seen = tl.load(anc_ptr + b * s_a_b + node * s_a_r + vc, mask=vc < C, other=0)  # its ancestor row, first block
        if half == 0:
            h = tl.load(table_ptr + token * stride_t + cols, mask=inside, other=0.0)
            w = tl.load(tw_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            h = tl.load(x_ptr + b * stride_xb + (child // K) * stride_xr + cols, mask=inside, other=0.0)
            w = tl.load(xw_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        ahead = (score > own) | ((score == own) & (m < child))
        rank = tl.sum((ahead & live).to(tl.int32), 0)
        kept = rank < TOPK  # a permutation of ranks (no NaN score): one program a slot
        at = b * TOPK + rank  # its slot's row in the frontier's outputs [B,TOPK]
        if half == 0:
            tl.store(o_index_ptr + at, node, mask=kept)
            tl.store(o_scores_ptr + at, own, mask=kept)
            tl.store(o_tokens_ptr + at, token, mask=kept)
            tl.store(o_parent_row_ptr + at, child // K, mask=kept)
            tl.store(o_positions_ptr + at, tl.load(last_ptr + b) + LEVEL + 1, mask=kept)
            # what the node sees (block masks: the interpreter takes a scalar & a block as no mask dtype)
            tl.store(o_visible_ptr + at * C + vc, seen, mask=(vc < C) & (rank + vc * 0 < TOPK))
            for c0 in range(BLOCK_C, C, BLOCK_C):  # (rows of more than BLOCK_C candidates)
                row = tl.load(anc_ptr + b * s_a_b + node * s_a_r + c0 + vc, mask=c0 + vc < C, other=0)
                tl.store(o_visible_ptr + at * C + c0 + vc, row, mask=(c0 + vc < C) & (rank + vc * 0 < TOPK))
        else:
            tl.store(xo_ptr + at * H + cols, h.to(xo_ptr.dtype.element_ty), mask=inside & (rank + cols * 0 < TOPK))
        tl.store(out_ptr + at * 2 * H + half * H + cols, pair_half(h, w, H, eps, out_ptr.dtype.element_ty),
                 mask=inside & (rank + cols * 0 < TOPK))

@dataclass(frozen=True)
class TreeSelectTuning:
    """Launch settings of the selection's kernels, chosen by the caller (the runtime takes the
    defaults; scripts/bench_tree_select.py times other values at a tree step's shapes on a GPU).

    - *_warps: warps per program of each launch (Triton's default is 4); topk_warps: of the
      head's slices (kernels/lm_head_topk.py `topk_chunks`).
    - rerank_rows / rerank_columns: candidates a rerank program writes (each ranks all of its
      row's), and ranked against at a time, fewer past 256 candidates: every [BLOCK_I or BLOCK_J,
      BLOCK_C] tile holds at most rerank_tile. Chosen by the SASS ptxas makes for sm_90
      (scripts/kernel_registers.py): the C^2 compares are most of the kernel's instructions, so 8
      warps share them (214 registers a thread at 256 candidates; 16 columns and 4 warps 230; 32
      and 4 spill), and no width to 2,048 candidates spills.
    """
    merge_children_warps: int = 4
    frontier_warps: int = 4
    rerank_warps: int = 8
    topk_warps: int = 4
    rerank_rows: int = 16
    rerank_columns: int = 32
    rerank_tile: int = 8192


def _check_candidates(cand: Candidates):
    if any(t.stride(-1) != 1 for t in cand) or cand.tokens.stride(0) != cand.parents.stride(0) \
            or cand.tokens.stride(0) != cand.scores.stride(0):
        raise ValueError("tree candidates: tokens, parents and scores need the same row stride and unit steps")


def expand_children_triton(hidden, norm_weight, eps: float, lm_head_weight, k: int, draft_ids, frontier,
                           frontier_scores, off: int, cand: Candidates, block_v: int | None = None,
                           tuning: TreeSelectTuning = TreeSelectTuning()) -> None:
    """A depth's candidates in two launches: the drafter's head over hidden [B,F,H] (the frontier
    nodes' outputs; kernels/lm_head_topk.py's first launch) and `_merge_children_kernel`, which
    writes each node's k best children as candidates off .. off + F k of `cand` (what
    `norm_lm_head_topk_triton` then inference/tree/ops.py's `expand_level_reference` write there).
    frontier / frontier_scores [B,F]: the nodes' candidate indices and scores (None: the root
    alone). The next frontier is ranked from these by `frontier_norm_pair_triton`."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check_candidates(cand)
    B, Fr, _ = hidden.shape
    C, n_new = cand.tokens.shape[1], Fr * k
    if off + n_new > C or (Fr != 1 if frontier is None else (frontier.shape != (B, Fr) or frontier_scores is None
                                                             or frontier_scores.shape != (B, Fr))):
        raise ValueError(f"expand_children: {Fr} frontier rows x {k} children at candidates {off}.. of {C}, frontier "
                         f"{None if frontier is None else tuple(frontier.shape)}")
    maxima, sums, best, columns = topk_chunks(hidden, norm_weight, eps, lm_head_weight, k,
                                              TOPK_BLOCK_V if block_v is None else block_v, tuning.topk_warps)
    nsplit = maxima.shape[1]
    at_root = frontier is None
    if at_root:
        frontier = frontier_scores = maxima  # (not read)
    if B * Fr:
        _merge_children_kernel[(B * Fr,)](maxima, sums, best, columns, draft_ids.contiguous(), frontier,
                                          frontier_scores,
                                          cand.tokens, cand.parents, cand.scores, cand.ancestors.view(torch.uint8),
                                          nsplit, lm_head_weight.shape[0], Fr, off, C, frontier.stride(0),
                                          frontier_scores.stride(0), cand.tokens.stride(0), cand.ancestors.stride(0),
                                          cand.ancestors.stride(1), K=k, BLOCK_S=triton.next_power_of_2(nsplit),
                                          BLOCK_CAND=triton.next_power_of_2(nsplit * k),
                                          BLOCK_K=triton.next_power_of_2(k),
                                          BLOCK_C=min(256, triton.next_power_of_2(C)),
                                          AT_ROOT=at_root, num_warps=tuning.merge_children_warps)


def frontier_norm_pair_triton(cand: Candidates, off: int, k: int, top_k: int, level: int, last, table, table_weight,
                              x, x_weight, eps: float, x_out, tuning: TreeSelectTuning = TreeSelectTuning()):
    """The next frontier and the drafter's input there, in one launch: the best top_k of this
    depth's candidates off .. off + F0 k (by score, ties to the lower index: the frontier of
    `expand_level_reference`) and kernels/rms_norm.py's `rms_norm_pair(table, frontier.tokens,
    table_weight, x, x_weight, eps, x_rows=frontier.parent_row, x_out=x_out)`, x [B,F0,H] the
    rows drafted from.
    → (Frontier, the pair [B,top_k,2H])."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check_candidates(cand)
    B, F0, H = x.shape
    C, n_new = cand.tokens.shape[1], F0 * k
    if not 1 <= top_k <= n_new or off + n_new > C or n_new > 1024:
        raise ValueError(f"frontier_norm_pair: top_k={top_k} of {n_new} children (at most 1,024), candidates "
                         f"{off}..{off + n_new} of {C}")
    if table.shape[-1] != H or table_weight.shape != (H,) or x_weight.shape != (H,) or x.stride(-1) != 1 or \
            x_out.shape != (B, top_k, H) or not x_out.is_contiguous():
        raise ValueError(f"frontier_norm_pair: table {tuple(table.shape)}, x {tuple(x.shape)}, x_out "
                         f"{tuple(x_out.shape)}, weights {tuple(table_weight.shape)} / {tuple(x_weight.shape)}")
    dev, long = x.device, torch.long
    index, tokens, parent_row, positions = (torch.empty(B, top_k, dtype=long, device=dev) for _ in range(4))
    scores = torch.empty(B, top_k, dtype=torch.float32, device=dev)
    visible = torch.empty(B, top_k, C, dtype=torch.bool, device=dev)
    both = torch.empty(B, top_k, 2 * H, dtype=x.dtype, device=dev)
    table = table if table.stride(-1) == 1 else table.contiguous()
    if B:
        _frontier_norm_pair_kernel[(B * n_new, 2)](cand.tokens, cand.scores, cand.ancestors.view(torch.uint8),
                                                   last.contiguous(), index, scores, tokens, parent_row,
                                                   visible.view(torch.uint8), positions, table, table_weight, x,
                                                   x_weight, both, x_out, k, top_k, n_new, off, C, level, H, eps,
                                                   cand.tokens.stride(0), cand.ancestors.stride(0),
                                                   cand.ancestors.stride(1), table.stride(0), x.stride(0), x.stride(1),
                                                   BLOCK_M=triton.next_power_of_2(n_new),
                                                   BLOCK_C=min(256, triton.next_power_of_2(C)),
                                                   BLOCK=triton.next_power_of_2(H), num_warps=tuning.frontier_warps)
    return Frontier(index, scores, tokens, parent_row, visible, positions), both


def finalize_triton(cand: Candidates, k: int, top_k: int, total_tokens: int, base_positions, out=None,
                    base_offset: int = 0, feed: Feed | None = None, moves: Moves | None = None,
                    tuning: TreeSelectTuning = TreeSelectTuning()):
    """→ (tokens, parents, depths, mask, positions), the fields of inference/tree/ops.py's Tree, node
    positions base_positions + base_offset + depth; into `out` (those five tensors, [B,N] int64
    and the mask [B,N,N] bool) when given. Epilogues: feed (kernels/emit.py `Feed`: the loop's
    tokens [B,S] and length [B], the verify step's input fed / positions [B,N+1]), written as
    kernels/emit.py `feed(tokens, length, tree tokens, fed, positions, tree positions)` writes it;
    moves (kernels/tree_accept.py `Moves`), cache entries the launch also moves, in programs of
    their own, as `move_entries_triton` moves them (their B rows the candidates' rows)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check_candidates(cand)
    B, C = cand.tokens.shape
    N = total_tokens
    if not 0 < N <= C:
        raise ValueError(f"total_tokens={N} needs 1..{C} (the candidates drafted)")
    dev = cand.tokens.device
    if out is None:
        tokens, parents, depths, positions = (torch.empty(B, N, dtype=torch.long, device=dev) for _ in range(4))
        mask = torch.empty(B, N, N, dtype=torch.bool, device=dev)
    else:
        tokens, parents, depths, mask, positions = out
        for name, t in zip(("tokens", "parents", "depths", "positions"), (tokens, parents, depths, positions)):
            if t.shape != (B, N) or t.dtype != torch.long or not t.is_contiguous():
                raise ValueError(f"finalize: out {name} {tuple(t.shape)} {t.dtype}, need [{B},{N}] int64, contiguous")
        if mask.shape != (B, N, N) or mask.dtype != torch.bool or not mask.is_contiguous():
            raise ValueError(f"finalize: out mask {tuple(mask.shape)} {mask.dtype}, need [{B},{N},{N}] bool, contiguous")
    if feed is not None:
        loop_tokens, loop_length, fed, fed_positions = feed
        if fed.shape != (B, N + 1) or fed_positions.shape != (B, N + 1) or loop_tokens.shape[0] != B or \
                loop_length.shape != (B,) or any(t.dtype != torch.long for t in feed) or \
                not loop_length.is_contiguous() or any(t.stride(-1) != 1 for t in (loop_tokens, fed, fed_positions)):
            raise ValueError(f"finalize: feed tokens {tuple(loop_tokens.shape)}, length {tuple(loop_length.shape)}, "
                             f"fed {tuple(fed.shape)} / {tuple(fed_positions.shape)}: need int64 [{B},S], [{B}], "
                             f"[{B},{N + 1}] x 2 with unit steps")
    else:
        loop_tokens = loop_length = fed = fed_positions = tokens  # (not read)
    if moves is not None:  # a program a layer of each row, after the ranking ones
        layers, (k_cache, v_cache, src, dst, rows, *move_args), move_constexprs = move_arguments(*moves)
        if rows != B:
            raise ValueError(f"finalize: moves for {rows} rows, candidates for {B}")
    else:  # (no move program: the pointers are not read)
        layers, k_cache, v_cache, src, dst = 0, tokens, tokens, tokens, tokens
        move_args, move_constexprs = (1, 0, 0, 0, 0, 0), dict(HEAD_DIM=1, BLOCK_H=1, BLOCK_M=1, BLOCK_D=1)
    if B:
        block_c = triton.next_power_of_2(C)
        block_i = max(1, min(tuning.rerank_rows, tuning.rerank_tile // block_c))
        block_j = max(1, min(tuning.rerank_columns, tuning.rerank_tile // block_c))
        blocks = triton.cdiv(C, block_i)
        # programs (row, block of candidates) rank; programs (row, blocks + layer) move
        _rerank_kernel[(B, blocks + layers)](
            # the candidates, the roots' positions and the Tree written
            cand.scores, cand.tokens, cand.parents, cand.ancestors.view(torch.uint8), base_positions.contiguous(),
            tokens, parents, depths, mask.view(torch.uint8), positions, C, N, top_k, top_k * k, base_offset,
            cand.tokens.stride(0), cand.ancestors.stride(0), cand.ancestors.stride(1),
            # FEED: the verify step's input
            loop_tokens, loop_length, fed, fed_positions, loop_tokens.stride(0), fed.stride(0), fed_positions.stride(0),
            blocks,
            # the moves' programs (`move_layer`)
            k_cache, v_cache, src, dst, *move_args,
            BLOCK_C=block_c, BLOCK_I=block_i, BLOCK_J=block_j, FEED=feed is not None, **move_constexprs,
            num_warps=tuning.rerank_warps)
    return tokens, parents, depths, mask, positions
