"""Attention of a draft tree's N query tokens per row over the row's KV cache plus the tree block.

    q [B,nh,N,d] (rotated), k_cache / v_cache [B,nkv,S,d], base_positions [B],
    tree_k / tree_v [B,nkv,N,d], tree_mask [B,N,N] bool → [B,N,nh*d], the o_proj input

Every tree query of row b sees the cache keys at positions <= base_positions[b] (the verified
prefix, ending with the root token) and the tree keys j with tree_mask[b, i, j] (itself and its
ancestors, inference/tree.py). The tree's own K/V come in separately because the tree slots of
the cache (base + 1 + i) are not ordered by position: a position-causal mask cannot describe them.
GQA: query head h reads KV head h // (nh / nkv), as transformers' repeat_kv orders them.
base_positions must lie in 0..S-1 (not checked: that would be a host sync).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def tree_attention_bias(base_positions, tree_mask, max_len: int, groups: int, dtype) -> torch.Tensor:
    """[B,1,groups*N,S+N] additive mask over (cache keys, tree keys), rows repeated once per
    query head of a KV group (the folding of `grouped_cache_attention`)."""
    N = tree_mask.shape[1]
    cache_visible = torch.arange(max_len, device=base_positions.device)[None, :] <= base_positions[:, None]  # [B,S]
    visible = torch.cat([cache_visible[:, None, :].expand(-1, N, -1), tree_mask], 2)  # [B,N,S+N]
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return bias[:, None].repeat(1, 1, groups, 1)


def tree_attention_reference(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask):
    """The torch form: one SDPA call over the cache and the tree block side by side."""
    B, nh, N, d = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    g = nh // nkv
    keys = torch.cat([k_cache, tree_k], 2)  # [B,nkv,S+N,d]
    values = torch.cat([v_cache, tree_v], 2)
    bias = tree_attention_bias(base_positions, tree_mask, S, g, q.dtype)
    out = F.scaled_dot_product_attention(q.reshape(B, nkv, g * N, d), keys, values, attn_mask=bias)
    return out.unflatten(2, (g, N)).permute(0, 3, 1, 2, 4).reshape(B, N, nh * d)


if triton is not None:

    @triton.jit
    def _tree_attention_kernel(q_ptr, kc_ptr, vc_ptr, base_ptr, kt_ptr, vt_ptr, mask_ptr, out_ptr, N, G, scale,
                               stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cs,
                               stride_tb, stride_th, stride_tt, stride_mb, stride_mq, stride_ot,
                               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK_N: tl.constexpr):
        """One (row, tree query, query head): an online softmax over the visible cache chunks,
        then over the tree block under the query's mask row, in float32.

        Performance ideas (not done): the g query heads of a KV head and the N queries of a row
        read the same keys, so a program per (row, KV head) holding all g*N queries as one tile
        would read each cache chunk once instead of g*N times (tl.dot on [g*N, d] x [d, BLOCK_S]);
        long caches want a split over the cache length, as decode_attention does."""
        token = tl.program_id(0).to(tl.int64)  # b * N + i
        head = tl.program_id(1)
        b = token // N
        i = token % N
        kv = head // G
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < D
        q = tl.load(q_ptr + b * stride_qb + head * stride_qh + i * stride_qt + dims, mask=dim_ok, other=0.0)
        q = q.to(tl.float32) * scale
        base = tl.load(base_ptr + b)
        m = tl.full([], -1.0e30, tl.float32)  # finite start: exp(m - m_new) stays defined
        l = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, base + 1, BLOCK_S):
            keys = start + tl.arange(0, BLOCK_S)
            visible = keys <= base
            offs = b * stride_cb + kv * stride_ch + keys[:, None] * stride_cs + dims[None, :]
            both = visible[:, None] & dim_ok[None, :]
            k = tl.load(kc_ptr + offs, mask=both, other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
            v = tl.load(vc_ptr + offs, mask=both, other=0.0).to(tl.float32)
            s = tl.where(visible, tl.sum(k * q[None, :], 1), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m = m_new
        nodes = tl.arange(0, BLOCK_N)
        seen = tl.load(mask_ptr + b * stride_mb + i * stride_mq + nodes, mask=nodes < N, other=0) != 0
        offs = b * stride_tb + kv * stride_th + nodes[:, None] * stride_tt + dims[None, :]
        both = seen[:, None] & dim_ok[None, :]
        k = tl.load(kt_ptr + offs, mask=both, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(vt_ptr + offs, mask=both, other=0.0).to(tl.float32)
        s = tl.where(seen, tl.sum(k * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        out = acc / l
        tl.store(out_ptr + token * stride_ot + head * D + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def tree_attention_triton(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask):
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, nh, N, d = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    if nh % nkv or k_cache.shape[-1] != d or k_cache.shape[0] != B:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if tree_k.shape != (B, nkv, N, d) or tree_v.shape != tree_k.shape or tree_mask.shape != (B, N, N):
        raise ValueError(f"tree k/v {tuple(tree_k.shape)} and mask {tuple(tree_mask.shape)} do not fit q {tuple(q.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension, k and v one layout")
    tree_k, tree_v = tree_k.contiguous(), tree_v.contiguous()
    mask = tree_mask.to(torch.int8).contiguous()  # bool pointers load as int1; bytes are plainer
    base = base_positions.reshape(B).contiguous()
    out = torch.empty(B, N, nh * d, dtype=q.dtype, device=q.device)
    if not B * N:
        return out
    _tree_attention_kernel[(B * N, nh)](
        q, k_cache, v_cache, base, tree_k, tree_v, mask, out, N, nh // nkv, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tree_k.stride(0), tree_k.stride(1), tree_k.stride(2), mask.stride(0), mask.stride(1), out.stride(1),
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=min(64, triton.next_power_of_2(S)),
        BLOCK_N=triton.next_power_of_2(N))
    return out


def tree_attention(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask):
    """The kernel on CUDA tensors (unless DRAFTSMITH_KERNELS=0), the reference elsewhere."""
    fn = tree_attention_triton if use_kernel(q) else tree_attention_reference
    return fn(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask)
