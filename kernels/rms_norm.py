"""RMSNorm with an optional fused residual add, one launch per call (the runtime's decode and
verify steps are launch-bound: the torch form costs ~8 kernels per norm).

    x [..., H], weight [H], residual [..., H] or None
    → (weight * normalize(h), h) with h = x + residual (or x): h is the next residual

Numerics of transformers' Llama: the sum rounded to x's dtype, statistics in float32, the
normalised value cast to x's dtype before the weight multiplies it.
"""
from __future__ import annotations

import torch

from draftsmith_kernels.dispatch import use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       *, out: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                       ids: torch.Tensor | None = None):
    if ids is not None:  # x is a table (an embedding): its rows `ids`, in out's dtype
        if residual is not None:
            raise ValueError("rms_norm: ids (a table lookup) and a residual exclude each other")
        x = x[ids].to(out.dtype if out is not None else torch.promote_types(weight.dtype, x.dtype))
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    y = weight * normed
    if out is not None:
        y = out.copy_(y)
    if sum_out is not None and residual is not None:
        h = sum_out.copy_(h)
    return y, (None if ids is not None else h)  # a lookup's rows are not a sum anyone reads


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, ids_ptr, H, eps,
                         stride_x, stride_r, stride_o, stride_s, HAS_RESIDUAL: tl.constexpr, HAS_IDS: tl.constexpr,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        if HAS_IDS:  # an embedding lookup fused in: row `row` normalises table row ids[row]
            x = tl.load(x_ptr + tl.load(ids_ptr + row) * stride_x + cols, mask=inside, other=0.0)
            x = x.to(out_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=inside, other=0.0)
            h = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_s + cols, h, mask=inside)
        else:
            h = x
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / H + eps)
        normed = (hf * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=inside)


def _rows(t: torch.Tensor, H: int, what: str) -> torch.Tensor:
    """t [..., H] as [R,H] with a unit column stride, without a copy (an output must be written
    in place: it may be a slice of a bigger buffer)."""
    try:
        t2 = t.view(-1, H)
    except RuntimeError:
        raise ValueError(f"{what} of shape {tuple(t.shape)} cannot be viewed as rows of {H}") from None
    if t2.stride(-1) != 1:
        raise ValueError(f"{what} needs a unit stride along its last dimension")
    return t2


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    *, out: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                    ids: torch.Tensor | None = None):
    """out / sum_out: write the normalised rows / the sum h there (views of a bigger buffer
    are fine: each row is addressed by its stride). ids [...]: x is a table [V,H] and the rows
    normalised are x[ids] (an embedding lookup and its norm in one launch)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for a hidden size of {H}")
    if ids is not None:
        if residual is not None:
            raise ValueError("rms_norm: ids (a table lookup) and a residual exclude each other")
        shape = (*ids.shape, H)
        ids2 = ids.reshape(-1).contiguous()
        x2 = x if x.stride(-1) == 1 else x.contiguous()
    else:
        shape = x.shape
        x2 = x.reshape(-1, H)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        ids2 = x2
    rows = ids2.numel() if ids is not None else x2.shape[0]
    dtype = out.dtype if out is not None else torch.promote_types(weight.dtype, x.dtype)
    out2 = _rows(out, H, "out") if out is not None else torch.empty(rows, H, dtype=dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual of shape {tuple(residual.shape)} for x of shape {tuple(x.shape)}")
        r2 = residual.reshape(-1, H).to(x.dtype)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        h2 = _rows(sum_out, H, "sum_out") if sum_out is not None else torch.empty_like(x2)
    else:
        r2 = h2 = x2
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, out2, h2, ids2, H, eps, x2.stride(0), r2.stride(0), out2.stride(0),
                                  h2.stride(0), HAS_RESIDUAL=residual is not None, HAS_IDS=ids is not None,
                                  BLOCK=triton.next_power_of_2(H))
    y = out if out is not None else out2.view(shape)
    if residual is None:
        return y, (x if ids is None else None)
    return y, (sum_out if sum_out is not None else h2.view(shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, **where):
    """The kernel on CUDA tensors, the reference elsewhere;
    `where`: out= / sum_out= / ids= (see rms_norm_triton)."""
    if use_kernel(x):
        return rms_norm_triton(x, weight, eps, residual, **where)
    return rms_norm_reference(x, weight, eps, residual, **where)


# ----------------------------------------------------------------------------- an EAGLE layer's two input norms
def gather_rows(x: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
    """x [B,F0,H], x_rows [B,F] → [B,F,H]: row x_rows[b, f] of x[b] at (b, f)."""
    return x.gather(1, x_rows[..., None].expand(-1, -1, x.shape[-1]))


def rms_norm_pair_reference(table: torch.Tensor, ids: torch.Tensor, table_weight: torch.Tensor, x: torch.Tensor,
                            x_weight: torch.Tensor, eps: float, x_rows: torch.Tensor | None = None,
                            x_out: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE-3's layer input: [rms_norm(table[ids]) * table_weight, rms_norm(x) * x_weight]
    side by side, ids [...], x [..., H] → [..., 2H] in x's dtype. With x_rows [B,F] (a draft
    tree's parents), x is [B,F0,H] and its rows are gathered first (`gather_rows`); x_out [B,F,H]
    then receives them, unnormalised (the layer's residual)."""
    if x_out is not None and x_rows is None:
        raise ValueError("rms_norm_pair: x_out receives gathered rows: it needs x_rows")
    if x_rows is not None:
        x = gather_rows(x, x_rows)
        if x_out is not None:
            x_out.copy_(x)
    H = x.shape[-1]
    both = x.new_empty(*x.shape[:-1], 2 * H)
    rms_norm_reference(table, table_weight, eps, ids=ids, out=both[..., :H])
    rms_norm_reference(x, x_weight, eps, out=both[..., H:])
    return both


if triton is not None:

    @triton.jit
    def _rms_norm_pair_kernel(table_ptr, ids_ptr, tw_ptr, x_ptr, xw_ptr, out_ptr, rows_ptr, xo_ptr, H, eps, stride_t,
                              stride_x, F, F0, BLOCK: tl.constexpr, GATHER: tl.constexpr, WRITE_X: tl.constexpr):
        """One (row, half): half 0 normalises table row ids[row], half 1 row `row` of x (GATHER:
        row rows[row] of x's batch row row // F, of F0 rows, also copied to xo when WRITE_X); each
        is written into its half of out's row [2H]."""
        row = tl.program_id(0).to(tl.int64)
        half = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        if half == 0:
            h = tl.load(table_ptr + tl.load(ids_ptr + row) * stride_t + cols, mask=inside, other=0.0)
            w = tl.load(tw_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            if GATHER:
                source = (row // F) * F0 + tl.load(rows_ptr + row)
            else:
                source = row
            h = tl.load(x_ptr + source * stride_x + cols, mask=inside, other=0.0)
            w = tl.load(xw_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            if WRITE_X:
                tl.store(xo_ptr + row * H + cols, h.to(xo_ptr.dtype.element_ty), mask=inside)
        tl.store(out_ptr + row * 2 * H + half * H + cols, pair_half(h, w, H, eps, out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def pair_half(h, w, H, eps, dtype: tl.constexpr):
        """One half of `rms_norm_pair`'s row: h [BLOCK] (zeros past H) normalised, times w
        (float32), rounded to dtype as the reference rounds it (also kernels/tree_select.py's)."""
        hf = h.to(dtype).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / H + eps)
        normed = (hf * rstd).to(dtype).to(tl.float32)
        return (normed * w).to(dtype)


def rms_norm_pair_triton(table, ids, table_weight, x, x_weight, eps, x_rows=None, x_out=None):
    if triton is None:
        raise RuntimeError("triton is not installed")
    H = x.shape[-1]
    rows_shape = x.shape[:-1] if x_rows is None else x_rows.shape
    if table.shape[-1] != H or table_weight.shape != (H,) or x_weight.shape != (H,) or ids.shape != rows_shape:
        raise ValueError(f"rms_norm_pair: table {tuple(table.shape)}, ids {tuple(ids.shape)}, x {tuple(x.shape)}, "
                         f"weights {tuple(table_weight.shape)} / {tuple(x_weight.shape)}")
    if x_rows is not None and (x.dim() != 3 or x_rows.dim() != 2 or x_rows.shape[0] != x.shape[0]):
        raise ValueError(f"rms_norm_pair: gathering rows {tuple(x_rows.shape)} of x {tuple(x.shape)}: need [B,F] of [B,F0,H]")
    if x_out is not None and (x_rows is None or x_out.shape != (*x_rows.shape, H) or not x_out.is_contiguous()):
        raise ValueError(f"rms_norm_pair: x_out {tuple(x_out.shape)} needs x_rows and a contiguous [B,F,H]")
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    ids2 = ids.reshape(-1).contiguous()
    table2 = table if table.stride(-1) == 1 else table.contiguous()
    n = ids2.shape[0]
    both = torch.empty(n, 2 * H, dtype=x.dtype, device=x.device)
    rows = ids2 if x_rows is None else x_rows.reshape(-1).contiguous()  # (unread without GATHER)
    F, F0 = (1, 1) if x_rows is None else (x_rows.shape[1], x.shape[1])
    if n:
        _rms_norm_pair_kernel[(n, 2)](table2, ids2, table_weight, x2, x_weight, both, rows,
                                      both if x_out is None else x_out, H, eps, table2.stride(0), x2.stride(0), F, F0,
                                      BLOCK=triton.next_power_of_2(H), GATHER=x_rows is not None,
                                      WRITE_X=x_out is not None)
    return both.view(*rows_shape, 2 * H)


def rms_norm_pair(table, ids, table_weight, x, x_weight, eps, x_rows=None, x_out=None) -> torch.Tensor:
    """The kernel on CUDA tensors, the reference elsewhere: one
    launch for the two norms an EAGLE-3 layer starts with (and a draft tree's gather of its
    parents' hidden states, x_rows / x_out)."""
    fn = rms_norm_pair_triton if use_kernel(x) else rms_norm_pair_reference
    return fn(table, ids, table_weight, x, x_weight, eps, x_rows, x_out)


# ----------------------------------------------------------------------------- per-head norms
def head_norm_reference(qkv: torch.Tensor, q_weight, k_weight, eps: float, nh: int, nkv: int) -> torch.Tensor:
    """In place: qkv [..., (nh + nkv + rest) * d] holds nh query heads, then nkv key heads (then
    values, untouched); each query head becomes rms_norm(head) * q_weight, each key head
    rms_norm(head) * k_weight (Qwen3's and DFlash's q_norm / k_norm). q_weight None when nh = 0."""
    d = k_weight.shape[0]
    heads = qkv.unflatten(-1, (-1, d))  # [..., heads, d] (a view)
    if nh:
        heads[..., :nh, :].copy_(rms_norm_reference(heads[..., :nh, :], q_weight, eps)[0])
    heads[..., nh: nh + nkv, :].copy_(rms_norm_reference(heads[..., nh: nh + nkv, :], k_weight, eps)[0])
    return qkv


if triton is not None:

    @triton.jit
    def _head_norm_kernel(x_ptr, qw_ptr, kw_ptr, D, NH, eps, stride_row, BLOCK: tl.constexpr):
        """One (token, head) of the first NH + NKV heads: normalised in place."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        inside = cols < D
        ptr = x_ptr + row * stride_row + head * D + cols
        x = tl.load(ptr, mask=inside, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)
        if head < NH:
            w = tl.load(qw_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            w = tl.load(kw_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(ptr, (normed * w).to(x_ptr.dtype.element_ty), mask=inside)


def head_norm_triton(qkv: torch.Tensor, q_weight, k_weight, eps: float, nh: int, nkv: int) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    d = k_weight.shape[0]
    if qkv.shape[-1] < (nh + nkv) * d or (nh and q_weight.shape != (d,)):
        raise ValueError(f"qkv [..., {qkv.shape[-1]}] holds fewer than {nh} + {nkv} heads of {d}, or the weights differ")
    rows = _rows(qkv, qkv.shape[-1], "qkv")  # in place: no copy allowed
    if rows.shape[0] and nh + nkv:
        _head_norm_kernel[(rows.shape[0], nh + nkv)](rows, q_weight if nh else k_weight, k_weight, d, nh, eps,
                                                     rows.stride(0), BLOCK=triton.next_power_of_2(d))
    return qkv


def head_norm(qkv: torch.Tensor, q_weight, k_weight, eps: float, nh: int, nkv: int) -> torch.Tensor:
    """The kernel on CUDA tensors, the reference elsewhere: one
    launch for every head of a step, where the torch form needs a split, copies and a cat."""
    fn = head_norm_triton if use_kernel(qkv) else head_norm_reference
    return fn(qkv, q_weight, k_weight, eps, nh, nkv)
