"""A verified tree's bookkeeping in one launch instead of about forty: the accepted path, what
the loop emits, where the cache entries move, and what the proposer takes in next.

    tree_tokens [B,N] (-1: an empty slot), parents [B,N] (-1: a child of the root),
    mask [B,N,N] bool (node i sees itself and its ancestors), choice [B,N+1] (the target's token
    after the root, then after node i: argmax, or one draw at T > 0), base [B] (the root's slot),
    root [B] (the root's token), active [B] bool (rows still generating), max_depth D, slots S
    (the cache's length)

    → TreeAccept: path [B,D] (accepted nodes by depth, -1 padded), length [B], bonus [B],
      path_tokens [B,D] (-1 padded), fed [B,D+1] (root, then the path's tokens, 0 padded: the
      proposer's next input), index [B,D+1] (its rows of the verify's outputs flattened to
      [B*(N+1)]: the root's, row b*(N+1), then b*(N+1) + 1 + each path node's), src / dst [B,D]
      (cache slots to move, every slot a move: `compaction_moves`); given the drafter's last
      position last [B], also next_tokens / next_positions [B,D+1]: the drafter's next input, as
      kernels/chain_state.py's `advance_inputs` makes it from fed (else None)

The rules are inference/tree/ops.py's (greedy_tree_verify, compaction_index, compaction_moves): its
`tree_accept_reference` composes those functions, and inference/tree/plan.py's `tree_accept` runs
this kernel on CUDA tensors. The kernel computes the same in one program per row (it also never matches an empty
slot against a choice of -1, which argmax and a draw never give).

Epilogues of the same launch (each saves a launch of its own): EMIT, the step emitted into the
loop's state (kernels/emit.py `emit_row`); NEXT, the drafter's next input (kernels/chain_state.py
`advance_inputs`); FROM_CHUNKS, the merge of the verify logits' argmax chunks (kernels/argmax.py).

The moves themselves (`Moves`; `move_entries_triton`, inference/tree/plan.py's `move_entries` on
CUDA tensors): one launch for the keys and values of every layer, a program a (layer, row), where
a gather and a scatter per cache take four. An EAGLE-3 tree loop has the next draft's rerank make
them in programs of its own instead (`move_layer`, kernels/tree_select.py): no launch of theirs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    from draftsmith_kernels.emit import emit_row
except ImportError:
    triton = None

from draftsmith_kernels.emit import EmitState  # noqa: E402


class TreeAccept(NamedTuple):
    path: torch.Tensor  # [B,D]
    length: torch.Tensor  # [B]
    bonus: torch.Tensor  # [B]
    path_tokens: torch.Tensor  # [B,D]
    fed: torch.Tensor  # [B,D+1]
    index: torch.Tensor  # [B,D+1]
    src: torch.Tensor  # [B,D]
    dst: torch.Tensor  # [B,D]
    next_tokens: torch.Tensor | None = None  # [B,D+1], given the proposer's last position (else None)
    next_positions: torch.Tensor | None = None  # [B,D+1]

    @staticmethod
    def empty(batch: int, max_depth: int, device, next_input: bool) -> "TreeAccept":
        """Buffers for `tree_accept_triton(out=...)` (next_tokens / next_positions when next_input)."""
        long = dict(dtype=torch.long, device=device)
        B, D = batch, max_depth
        pair = (torch.empty(B, D + 1, **long), torch.empty(B, D + 1, **long)) if next_input else (None, None)
        return TreeAccept(torch.empty(B, D, **long), torch.empty(B, **long), torch.empty(B, **long),
                          torch.empty(B, D, **long), torch.empty(B, D + 1, **long), torch.empty(B, D + 1, **long),
                          torch.empty(B, D, **long), torch.empty(B, D, **long), *pair)


class Moves(NamedTuple):
    """Cache entries to move, in place: caches [..., B,nkv,S,d] (a target's layers [L,B,nkv,S,d]
    at once; one layout for both), entry src[b, j] to dst[b, j] in every leading index, src / dst
    [B,D] with every slot a move (duplicates write the same value: inference/tree/ops.py
    `compaction_moves`). All sources are read before any write."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


if triton is not None:

    @triton.jit
    def _tree_accept_kernel(tokens_ptr, parents_ptr, mask_ptr, choice_ptr, base_ptr, root_ptr, active_ptr,
                            path_ptr, length_ptr, bonus_ptr, path_tokens_ptr, fed_ptr, index_ptr, src_ptr, dst_ptr,
                            N, D, S, stride_t, stride_p, stride_mb, stride_mi, stride_c, stride_o, stride_base,
                            stride_root, cidx_ptr, NSPLIT, eos_ptr, budget_ptr, out_tokens_ptr, state_length_ptr,
                            n_out_ptr, done_ptr, histogram_ptr, row_steps_ptr, active_out_ptr, E, stride_ot, stride_h,
                            last_ptr, next_ptr, next_pos_ptr,
                            BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr,
                            FROM_CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr, EMIT: tl.constexpr,
                            HAS_ACTIVE_OUT: tl.constexpr, NEXT: tl.constexpr):
        """One program per row. Lanes i / j: tree nodes (BLOCK_N >= N); lanes o: the verify's N + 1
        outputs (the root's, then node i's at 1 + i; BLOCK_O >= N + 1); lanes d: depths (BLOCK_D >=
        D + 1). FROM_CHUNKS: the target's choices are the argmax of its logits, given as their
        chunks' (maximum, first column) [B*(N+1), NSPLIT] (choice_ptr: the maxima, cidx_ptr: the
        columns), merged here; else choice_ptr holds them [B,N+1]. EMIT: the step is then emitted
        into the loop's state (kernels/emit.py `emit_row`), after `active` is read for the moves.
        NEXT: the drafter's next input too, from its last position (last_ptr [B]).
        The row's data is loaded first, no load waiting on another's value: all N + 1 choices are
        merged from their chunks, and a node's choice after its parent, the path's tokens and the
        bonus are picked from registers (loaded as each became known, they would take four round
        trips to memory one after another)."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_N)
        in_tree = i < N
        o = tl.arange(0, BLOCK_O)
        in_out = o < N + 1
        token = tl.load(tokens_ptr + row * stride_t + i, mask=in_tree, other=-1)
        parent = tl.load(parents_ptr + row * stride_p + i, mask=in_tree, other=-1)
        both = in_tree[:, None] & in_tree[None, :]
        sees = tl.load(mask_ptr + row * stride_mb + i[:, None] * stride_mi + i[None, :], mask=both, other=0) != 0
        base = tl.load(base_ptr + row * stride_base)
        root = tl.load(root_ptr + row * stride_root)
        active = tl.load(active_ptr + row) != 0
        if FROM_CHUNKS:  # [BLOCK_O, BLOCK_S]: each output's chunks; the first holding the maximum wins a tie
            s = tl.arange(0, BLOCK_S)
            s_ok = s < NSPLIT
            at = (row * (N + 1) + o)[:, None] * NSPLIT + s[None, :]
            best = tl.load(choice_ptr + at, mask=in_out[:, None] & s_ok[None, :], other=float("-inf"))
            column = tl.load(cidx_ptr + at, mask=in_out[:, None] & s_ok[None, :], other=0)
            m = tl.max(best, 1)
            first = tl.min(tl.where(s_ok[None, :] & (best == m[:, None]), s[None, :], BLOCK_S), 1)
            choice = tl.sum(tl.where(s[None, :] == first[:, None], column.to(tl.int32), 0), 1)  # [BLOCK_O]
        else:
            choice = tl.load(choice_ptr + row * stride_c + o, mask=in_out, other=-1).to(tl.int32)
        # (token ids in 32 bits: the [BLOCK_N, BLOCK_O] picks below in int64 spilled registers on
        # sm_90 at 64 nodes, where BLOCK_O is twice BLOCK_N)
        # node i matches when its token is the target's choice after its parent (output parent + 1)
        after_parent = tl.sum(tl.where(o[None, :] == parent[:, None] + 1, choice[None, :], 0), 1)  # [BLOCK_N]
        match = (token == after_parent) & (token >= 0) & in_tree
        # accepted: the node and every ancestor match; its depth: how many it sees
        broken = tl.max((sees & (match[None, :] == 0)).to(tl.int32), 1)  # [BLOCK_N] over i
        depth = tl.sum(sees.to(tl.int32), 1)
        reach = tl.where((broken == 0) & in_tree, depth, 0)
        length = tl.max(reach, 0)
        leaf = tl.argmax(reach, 0, tie_break_left=True)  # the deepest, lowest index among equals
        on_path = tl.sum(tl.where(i[:, None] == leaf, sees.to(tl.int32), 0), 0) > 0  # [BLOCK_N] over j
        on_path = on_path & (length > 0)
        d = tl.arange(0, BLOCK_D)
        # [BLOCK_D, BLOCK_N]: the path's node at depth d + 1
        at_depth = on_path[None, :] & (depth[None, :] == d[:, None] + 1)
        has = tl.sum(at_depth.to(tl.int32), 1) > 0
        node = tl.where(has, tl.sum(tl.where(at_depth, i[None, :], 0), 1), -1)  # [BLOCK_D]
        in_path = d < D
        path_token = tl.sum(tl.where(at_depth, token[None, :], 0), 1)
        path_token = tl.where(has, path_token, -1)
        after_leaf = tl.where(length > 0, leaf + 1, 0)
        bonus = tl.sum(tl.where(o == after_leaf, choice, 0), 0)
        out = row * stride_o
        tl.store(path_ptr + out + d, node, mask=in_path)
        tl.store(path_tokens_ptr + out + d, path_token, mask=in_path)
        tl.store(length_ptr + row, length)
        tl.store(bonus_ptr + row, bonus)
        # the proposer's next input: the root, then the path's tokens (lane d: the node at depth d)
        out_fed = row * (stride_o + 1)
        on_fed = (d >= 1) & (d <= length)
        at_fed = on_path[None, :] & (depth[None, :] == d[:, None])  # [BLOCK_D, BLOCK_N]
        fed_node = tl.sum(tl.where(at_fed, i[None, :], 0), 1)
        fed_token = tl.where(on_fed, tl.sum(tl.where(at_fed, token[None, :], 0), 1), 0)
        tl.store(fed_ptr + out_fed + d, tl.where(d == 0, root, tl.maximum(fed_token, 0)), mask=d <= D)
        local = tl.where(on_fed, 1 + fed_node, tl.where(d == 0, 0, 1))  # in the row's N + 1 outputs
        tl.store(index_ptr + out_fed + d, row * (N + 1) + local, mask=d <= D)
        if NEXT:  # what kernels/chain_state.py's advance_inputs makes of fed (its launch saved): fed
            # shifted left by one lane (lane d: the path's token at depth d + 1, 0 past the path), the
            # bonus after the last accepted token and in the last lane; positions last + 1 + d
            next_token = tl.where((d == D) | (d == length), bonus, tl.maximum(path_token, 0))
            tl.store(next_ptr + out_fed + d, next_token, mask=d <= D)
            tl.store(next_pos_ptr + out_fed + d, tl.load(last_ptr + row) + 1 + d, mask=d <= D)
        # cache moves: node path[d] from slot base + 1 + path[d] to base + 1 + d; the slots past the
        # accepted ones (and a finished row's) repeat the last real move, or copy base + 1 onto itself
        n_valid = tl.where(active, length, 0)
        valid = (d < n_valid) & has
        still = tl.minimum(tl.maximum(base + 1, 0), S - 1)
        fill_src = tl.where(n_valid > 0, base + 1 + leaf, still)
        fill_dst = tl.where(n_valid > 0, base + n_valid, still)
        tl.store(src_ptr + out + d, tl.where(valid, base + 1 + node, fill_src), mask=in_path)
        tl.store(dst_ptr + out + d, tl.where(valid, base + 1 + d, fill_dst), mask=in_path)
        if EMIT:  # the path's tokens by depth lane (-1 past it), then the bonus
            emit_row(row, d, path_token, length, bonus, D, E, eos_ptr, budget_ptr, out_tokens_ptr, state_length_ptr,
                     n_out_ptr, done_ptr, histogram_ptr, row_steps_ptr, active_out_ptr, stride_ot, stride_h,
                     HAS_ACTIVE_OUT)


if triton is not None:

    @triton.jit
    def move_layer(k_ptr, v_ptr, src_ptr, dst_ptr, b, layer, NKV, D, stride_l, stride_b, stride_h, stride_s,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (layer, row b) of the caches, every KV head at once ([BLOCK_H, BLOCK_M, BLOCK_D]
        tiles): the D entries at slots src[b] read, then written at slots dst[b]. The barrier keeps
        every read of the program before its first write (a path's slots and their destinations
        overlap); (layer, row) blocks are disjoint, so a program each needs no other order
        (kernels/tree_select.py's rerank also calls this, in programs of its own)."""
        j = tl.arange(0, BLOCK_M)
        j_in = j < D
        src = tl.load(src_ptr + b * D + j, mask=j_in, other=0)
        dst = tl.load(dst_ptr + b * D + j, mask=j_in, other=0)
        h = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        inside = (h < NKV)[:, None, None] & j_in[None, :, None] & (dims < HEAD_DIM)[None, None, :]
        heads = layer.to(tl.int64) * stride_l + b.to(tl.int64) * stride_b + h.to(tl.int64)[:, None, None] * stride_h \
            + dims[None, None, :]
        k = tl.load(k_ptr + heads + src[None, :, None] * stride_s, mask=inside)
        v = tl.load(v_ptr + heads + src[None, :, None] * stride_s, mask=inside)
        tl.debug_barrier()
        tl.store(k_ptr + heads + dst[None, :, None] * stride_s, k, mask=inside)
        tl.store(v_ptr + heads + dst[None, :, None] * stride_s, v, mask=inside)

    @triton.jit
    def _move_entries_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, B, NKV, D, stride_l, stride_b, stride_h, stride_s,
                             HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_D: tl.constexpr):
        """One (layer, row) a program: `move_layer`."""
        pid = tl.program_id(0)
        move_layer(k_ptr, v_ptr, src_ptr, dst_ptr, pid % B, pid // B, NKV, D, stride_l, stride_b, stride_h, stride_s,
                   HEAD_DIM, BLOCK_H, BLOCK_M, BLOCK_D)


def move_arguments(k_cache, v_cache, src, dst):
    """A move's checks, then what `move_layer` takes: (programs a row: one a layer, 0 with nothing
    to move; the arguments (k, v, src, dst, B, nkv, D, four strides); its constexprs). Caches
    [..., B,nkv,S,d] (one layout for both), src / dst [B,D] slots (every slot a move, duplicates
    writing the same value: `compaction_moves`)."""
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"move_entries: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} need one layout "
                         "with a contiguous last dimension")
    B, nkv, S, d = k_cache.shape[-4:]
    if src.shape != dst.shape or src.dim() != 2 or src.shape[0] != B:
        raise ValueError(f"move_entries: src {tuple(src.shape)} / dst {tuple(dst.shape)} do not fit {B} rows")
    k, v = k_cache.view(-1, B, nkv, S, d), v_cache.view(-1, B, nkv, S, d)  # the layers as one leading dim
    D = src.shape[1]
    return (k.shape[0] if D and nkv else 0,
            (k, v, src.contiguous(), dst.contiguous(), B, nkv, D, k.stride(0), k.stride(1), k.stride(2), k.stride(3)),
            dict(HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(max(nkv, 1)), BLOCK_M=triton.next_power_of_2(max(D, 1)),
                 BLOCK_D=triton.next_power_of_2(d)))


def move_entries_triton(k_cache, v_cache, src, dst):
    """inference/tree/ops.py's `move_entries_reference` in one launch, a program a (layer, row):
    caches and src / dst as `move_arguments` says, moved in place."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    layers, args, constexprs = move_arguments(k_cache, v_cache, src, dst)
    if layers * src.shape[0]:
        _move_entries_kernel[(layers * src.shape[0],)](*args, **constexprs)
    return k_cache, v_cache


def tree_accept_triton(tree_tokens, parents, mask, choice, base, root, active, max_depth: int, slots: int, *,
                       chunks=None, emit_into: EmitState | None = None, last=None,
                       out: TreeAccept | None = None) -> TreeAccept:
    """choice [B,N+1]; or, with choice None, chunks = (maxima, columns) [B*(N+1), NSPLIT], the
    verify logits' `argmax_chunks` (kernels/argmax.py), whose merge is done here (a launch fewer).
    Epilogues: emit_into, the loop's state, into which the step is also emitted (kernels/emit.py's
    `emit` on the path's tokens, length and bonus); last [B], the drafter's last position, from
    which the drafter's next input is also made (next_tokens, next_positions: kernels/chain_state.py's
    `advance_inputs` of fed, bonus, length and last). out: the TreeAccept to write (contiguous,
    `TreeAccept.empty`; next_tokens / next_positions needed with last), else new tensors."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, N = tree_tokens.shape
    D = max_depth
    if N > 1024:  # one block holds the row's [N, N] mask
        raise ValueError(f"tree_accept: {N} tree nodes; the kernel takes at most 1,024")
    if (choice is None) == (chunks is None):
        raise ValueError("tree_accept: give the target's choices or their argmax chunks, one of the two")
    if chunks is not None:
        choice, columns = chunks
        nsplit = choice.shape[1]
        if choice.shape != (B * (N + 1), nsplit) or columns.shape != choice.shape or not choice.is_contiguous() \
                or not columns.is_contiguous():
            raise ValueError(f"tree_accept: argmax chunks {tuple(choice.shape)} / {tuple(columns.shape)} need one "
                             f"contiguous [{B * (N + 1)}, NSPLIT] layout")
    else:
        columns, nsplit = choice, 1
    for name, t in (("tree_tokens", tree_tokens), ("parents", parents), ("mask", mask), ("choice", choice)):
        if t.stride(-1) != 1:
            raise ValueError(f"tree_accept: {name} needs a contiguous last dimension")
    # bool tensors go in as their bytes (one byte each, 0 or 1)
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    active = active.view(torch.uint8) if active.dtype == torch.bool else active
    active = active.contiguous()  # (base and root may be strided: a column of the verify step's input)
    if last is not None and (last.shape != (B,) or last.dtype != torch.long):
        raise ValueError(f"tree_accept: last {tuple(last.shape)} {last.dtype}, need [{B}] int64")
    if out is None:
        out = TreeAccept.empty(B, D, tree_tokens.device, next_input=last is not None)
    else:
        _check_out(out, B, D, last is not None)
    if last is None:
        out = out._replace(next_tokens=None, next_positions=None)
    path, length, bonus, path_tokens, fed, index, src, dst, next_tokens, next_positions = out
    if emit_into is not None:
        emit_into.check()
        e = emit_into
        emit_args = (e.eos, e.budget, e.tokens, e.length, e.n_out, e.done, e.histogram, e.row_steps,
                     e.done if e.active_out is None else e.active_out, e.eos.numel(), e.tokens.stride(0),
                     e.histogram.stride(0))
    else:  # (unread: any tensors stand in)
        emit_args = (length,) * 9 + (0, 0, 0)
    next_args = (length,) * 3 if last is None else (last.contiguous(), next_tokens, next_positions)
    if B:
        _tree_accept_kernel[(B,)](
            # the tree, the target's choices, the rows' roots and activity
            tree_tokens, parents, mask, choice, base, root, active,
            # what the step decides (out's rows: D and D + 1 wide)
            path, length, bonus, path_tokens, fed, index, src, dst,
            N, D, slots, tree_tokens.stride(0), parents.stride(0), mask.stride(0), mask.stride(1), choice.stride(0),
            D, base.stride(0), root.stride(0),
            columns, nsplit,  # FROM_CHUNKS: the argmax chunks' columns
            *emit_args,  # EMIT: the loop's state
            *next_args,  # NEXT: the drafter's last position, its next tokens and positions
            BLOCK_N=triton.next_power_of_2(max(N, 1)), BLOCK_O=triton.next_power_of_2(N + 1),
            BLOCK_D=triton.next_power_of_2(D + 1),
            FROM_CHUNKS=chunks is not None, BLOCK_S=triton.next_power_of_2(nsplit),
            EMIT=emit_into is not None, HAS_ACTIVE_OUT=emit_into is not None and emit_into.active_out is not None,
            NEXT=last is not None)
    return out


def _check_out(out: TreeAccept, B: int, D: int, next_input: bool):
    wide = {"fed", "index", "next_tokens", "next_positions"}
    for name, t in zip(TreeAccept._fields, out):
        if t is None and name.startswith("next_") and not next_input:
            continue
        shape = (B,) if name in ("length", "bonus") else (B, D + 1) if name in wide else (B, D)
        if t is None or t.shape != shape or t.dtype != torch.long or not t.is_contiguous():
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"tree_accept: out {name} {got}, need {list(shape)} int64, contiguous")
