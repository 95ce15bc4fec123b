"""A drafter's tree head in two launches: final RMSNorm, lm_head, log-softmax and top-k.

    hidden [..., H], norm_weight [H], weight [V,H] (lm_head, no bias), k <= V
    → values [..., k] float32, the k largest log-probabilities of each row, best first;
      indices [..., k] int64, their lm_head rows (ties: the lowest row first)

Why a kernel: an EAGLE-2 tree drafts one level per drafter step and needs each frontier node's
best k children with their log-probabilities. In torch that is a norm, a matmul, a float copy, a
log-softmax and torch.topk, whose radix select over a 16,384-wide row takes 60-72 µs on an H200
(one block per row), once per depth: more than half the tree's drafting time. Here the first
launch (as kernels/lm_head_argmax.py's) normalises the rows, multiplies them by a BLOCK_V-row
slice of the lm_head and keeps, per slice, its maximum, its sum of exp(logit - maximum) and its
k best logits; the second merges a row's slices: the log-sum-exp and the k best of all slices'
candidates. The logits never reach memory. The runtime's tree keeps a merge program a row
(one program merging a whole frontier is slower on an H200) and expands the tree inside it:
kernels/tree_select.py, whose merge is `merge_row`; `norm_lm_head_topk_triton` is the head
alone, for its tests and scripts/bench_heads.py.

Numerics of the torch form (the reference): the norm as kernels/rms_norm.py, each logit rounded
to the lm_head's dtype as a matmul's output is, then log-softmax in float32. Ranking is by the
logits (a log-softmax subtracts one number from the whole row), ties to the lowest row, and a
NaN logit counts as -inf (never chosen before a number, no probability). Only the summation
orders differ from the torch form: the matmul's and the log-sum-exp's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith_kernels.dispatch import INTERPRETED
from draftsmith_kernels.lm_head_argmax import BLOCK_H, BLOCK_R, BLOCK_V
from draftsmith_kernels.rms_norm import rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_K = 64  # children per node: the merge keeps every slice's k best in one block of lanes
# lm_head rows per program: 128 on a GPU (as kernels/lm_head_argmax.py: 128 programs for a 16,384-row
# draft vocabulary); 8,192 in Triton's CPU interpreter, whose cost is per program (CI runs whole
# tree loops through it: a 49,152-row head in 48 programs of 1,024 rows took 1.24 s a call, in 6 of
# 8,192 0.25 s, still more than one slice to merge), unless a caller asks for slices of its own
# (the kernel's tests do)
TOPK_BLOCK_V = 8192 if INTERPRETED else BLOCK_V
TOPK_WARPS = 4  # warps per slices program (the default of kernels/tree_select.py TreeSelectTuning.topk_warps)


def log_softmax_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] → (values [..., k] float32 log-probabilities, indices [..., k] int64): the
    k best by logit, ties to the lowest index. torch.topk leaves the order of ties open, so it
    ranks one int64 key per logit that has no ties: the float's bits, mapped to an order-keeping
    integer, above the index counted down (a stable sort of the row ranks the same, 30-100 times
    slower on a CPU)."""
    x = logits.float()
    x = x.masked_fill(x.isnan(), float("-inf")) + 0.0  # NaN ranks last; -0.0 becomes 0.0 (they tie)
    bits = x.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # signed order = the floats' order
    countdown = 0xFFFFFFFF - torch.arange(x.shape[-1], device=x.device)  # a lower index ranks higher
    key = ordered * 2 ** 32 + countdown
    indices = 0xFFFFFFFF - key.topk(k, dim=-1).values % 2 ** 32
    return torch.log_softmax(x, -1).gather(-1, indices), indices


def norm_lm_head_topk_reference(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    normed, _ = rms_norm_reference(hidden, norm_weight, eps)
    return log_softmax_topk_reference(F.linear(normed, weight), k)


if triton is not None:

    @triton.jit
    def _rank_key(value, column):
        """int64 keys that order (value descending, column ascending) as plain integers: the
        float's bits mapped to an order-keeping int32 above the column counted down (value finite
        or -inf, never NaN nor -0.0; 0 <= column < 2^31). One max then finds a best and its lowest
        column at once (two reductions otherwise; the merge needed three)."""
        bits = value.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (ordered.to(tl.int64) << 32) + (2147483647 - column).to(tl.int64)

    @triton.jit
    def _unrank_key(key):
        """`_rank_key` undone: (value float32, column int64)."""
        ordered = (key >> 32).to(tl.int32)
        bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
        return bits.to(tl.float32, bitcast=True), 2147483647 - (key - ((key >> 32) << 32))

    @triton.jit
    def _norm_gemv_topk_chunks_kernel(x_ptr, nw_ptr, w_ptr, max_ptr, sum_ptr, val_ptr, idx_ptr, R, V, H, eps,
                                      stride_x, stride_w, NSPLIT, K: tl.constexpr, IEEE: tl.constexpr,
                                      BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
        """One (slice of BLOCK_V lm_head rows, block of BLOCK_R hidden rows): for each hidden row,
        the slice's largest logit, its sum of exp(logit - largest), and its K best logits with
        their columns (an exhausted slice pads with -inf at column V, which loses every tie)."""
        split = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = split * BLOCK_V + tl.arange(0, BLOCK_V)
        row_in, col_in = rows < R, cols < V
        hs = tl.arange(0, BLOCK_H)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        square_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):  # the rows' statistics first (H values each: cheap to read twice)
            x = tl.load(x_rows + h0 + hs[None, :], mask=row_in[:, None] & (h0 + hs < H)[None, :], other=0.0)
            square_sum += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
        rstd = 1.0 / tl.sqrt(square_sum / H + eps)
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        for h0 in range(0, H, BLOCK_H):
            h_in = h0 + hs < H
            x = tl.load(x_rows + h0 + hs[None, :], mask=row_in[:, None] & h_in[None, :], other=0.0)
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            nw = tl.load(nw_ptr + h0 + hs, mask=h_in, other=0.0).to(tl.float32)
            xn = (normed * nw[None, :]).to(w_ptr.dtype.element_ty)  # [BLOCK_R, BLOCK_H], as the norm stores it
            w = tl.load(w_rows + h0 + hs[None, :], mask=col_in[:, None] & h_in[None, :], other=0.0)
            if IEEE:  # float32 products, exact (no TF32): float32 weights, or the interpreter
                acc = tl.dot(xn.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xn, tl.trans(w), acc)
        logits = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # each logit rounded as a matmul's output
        logits = tl.where((logits != logits) | ~col_in[None, :], float("-inf"), logits)  # NaN: no probability
        logits = tl.where(logits == 0.0, 0.0, logits)  # -0.0 ties with 0.0 (its bits would rank it below)
        m = tl.max(logits, 1)  # [BLOCK_R]
        shift = tl.where(m == float("-inf"), 0.0, m)  # a slice of -inf sums to 0, not NaN
        total = tl.sum(tl.exp(logits - shift[:, None]), 1)
        slot = rows.to(tl.int64) * NSPLIT + split
        tl.store(max_ptr + slot, m, mask=row_in)
        tl.store(sum_ptr + slot, total, mask=row_in)
        # [BLOCK_R, BLOCK_V] rank keys; taken and missing columns hold `gone`, below every real key
        gone = tl.full([BLOCK_R, BLOCK_V], -2147483648, tl.int32).to(tl.int64) << 32
        key = tl.where(col_in[None, :] & row_in[:, None], _rank_key(logits, cols[None, :]), gone)
        for j in tl.static_range(K):
            best = tl.max(key, 1)  # [BLOCK_R]
            value, column = _unrank_key(best)
            none_left = (best >> 32).to(tl.int32) == -2147483648  # an exhausted slice: -inf at column V
            tl.store(val_ptr + slot * K + j, tl.where(none_left, float("-inf"), value), mask=row_in)
            tl.store(idx_ptr + slot * K + j, tl.where(none_left, V, column), mask=row_in)
            key = tl.where(key == best[:, None], gone, key)

    @triton.jit
    def merge_row(max_ptr, sum_ptr, val_ptr, idx_ptr, row, NSPLIT, V, K: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row's merge: the log-sum-exp of its slices, then its K best of the slices' NSPLIT * K
        candidates (ties: the lowest column) → (log-probabilities, columns) [BLOCK_K], best first
        (lanes past K: -inf, column V). A column is one slice's, so real keys are unique; exhausted
        slices' pads (-inf at column V) rank below every real one, and k <= V picks k real ones."""
        s = tl.arange(0, BLOCK_S)
        m = tl.load(max_ptr + row * NSPLIT + s, mask=s < NSPLIT, other=float("-inf"))
        total = tl.load(sum_ptr + row * NSPLIT + s, mask=s < NSPLIT, other=0.0)
        top = tl.max(m, 0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        lse = shift + tl.log(tl.sum(total * tl.exp(m - shift), 0))
        c = tl.arange(0, BLOCK_C)
        n = NSPLIT * K
        v = tl.load(val_ptr + row * n + c, mask=c < n, other=float("-inf"))
        ix = tl.load(idx_ptr + row * n + c, mask=c < n, other=V)
        gone = tl.full([BLOCK_C], -2147483648, tl.int32).to(tl.int64) << 32
        key = tl.where(c < n, _rank_key(v, ix), gone)
        lanes = tl.arange(0, BLOCK_K)
        values = tl.full([BLOCK_K], float("-inf"), tl.float32)
        columns = tl.full([BLOCK_K], V, tl.int64)
        for j in tl.static_range(K):
            best = tl.max(key, 0)
            value, column = _unrank_key(best)
            values = tl.where(lanes == j, value - lse, values)
            columns = tl.where(lanes == j, column, columns)
            key = tl.where(key == best, gone, key)
        return values, columns

    @triton.jit
    def _topk_merge_kernel(max_ptr, sum_ptr, val_ptr, idx_ptr, out_val_ptr, out_idx_ptr, NSPLIT, V,
                           K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row: `merge_row`, stored."""
        row = tl.program_id(0).to(tl.int64)
        values, columns = merge_row(max_ptr, sum_ptr, val_ptr, idx_ptr, row, NSPLIT, V, K, BLOCK_S, BLOCK_C, BLOCK_K)
        lanes = tl.arange(0, BLOCK_K)
        tl.store(out_val_ptr + row * K + lanes, values, mask=lanes < K)
        tl.store(out_idx_ptr + row * K + lanes, columns, mask=lanes < K)


def topk_chunks(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, k: int,
                block_v: int = TOPK_BLOCK_V, num_warps: int = TOPK_WARPS):
    """The first launch alone: hidden [..., H] → the rows [R,H] it read and each row's slices'
    (maxima [R,S], sums [R,S], k best logits [R,S,k], their columns [R,S,k]), S = ceil(V / block_v),
    for a merge (`_topk_merge_kernel`, or kernels/tree_select.py's, which also expands a tree)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H or norm_weight.shape != (H,):
        raise ValueError(f"norm_lm_head_topk: hidden {tuple(hidden.shape)}, norm weight {tuple(norm_weight.shape)}, "
                         f"lm_head {tuple(weight.shape)}: need [..., H], [H] and [V,H]")
    V = weight.shape[0]
    if not 1 <= k <= min(V, MAX_K):
        raise ValueError(f"norm_lm_head_topk: k={k} must be in 1..{min(V, MAX_K)} (an lm_head of {V} rows)")
    x = hidden.reshape(-1, H)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    R = x.shape[0]
    nsplit = triton.cdiv(V, block_v)
    dev = hidden.device
    maxima = torch.empty(R, nsplit, dtype=torch.float32, device=dev)
    sums = torch.empty_like(maxima)
    best = torch.empty(R, nsplit, k, dtype=torch.float32, device=dev)
    columns = torch.empty(R, nsplit, k, dtype=torch.long, device=dev)
    if R:
        _norm_gemv_topk_chunks_kernel[(nsplit, triton.cdiv(R, BLOCK_R))](
            x, norm_weight, weight, maxima, sums, best, columns, R, V, H, eps, x.stride(0), weight.stride(0), nsplit,
            K=k, IEEE=weight.dtype == torch.float32 or INTERPRETED, BLOCK_R=BLOCK_R, BLOCK_V=block_v, BLOCK_H=BLOCK_H,
            num_warps=num_warps)
    return maxima, sums, best, columns


def norm_lm_head_topk_triton(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                             k: int, block_v: int = TOPK_BLOCK_V) -> tuple[torch.Tensor, torch.Tensor]:
    maxima, sums, best, columns = topk_chunks(hidden, norm_weight, eps, weight, k, block_v)
    R, nsplit = maxima.shape
    V = weight.shape[0]
    values = torch.empty(R, k, dtype=torch.float32, device=hidden.device)
    indices = torch.empty(R, k, dtype=torch.long, device=hidden.device)
    if R:
        _topk_merge_kernel[(R,)](maxima, sums, best, columns, values, indices, nsplit, V, K=k,
                                 BLOCK_S=triton.next_power_of_2(nsplit), BLOCK_C=triton.next_power_of_2(nsplit * k),
                                 BLOCK_K=triton.next_power_of_2(k))
    lead = hidden.shape[:-1]
    return values.reshape(*lead, k), indices.reshape(*lead, k)

