"""Rotary embedding of q and k fused with the KV-cache write, one launch per attention layer.

    qkv [B,n,(nh+2*nkv)*d] (the fused q/k/v projection), positions [B,n], inv_freq [d/2]
    → q [B,nh,n,d] rotated; k rotated and v written into k_cache / v_cache [B,nkv,S,d] at
      each row's positions (or at `slots` [B,n], when the cache slot is not the RoPE position:
      draft trees, an MTP module's drafted key, writes parked in a scratch slot; or, with
      `tree_block`, at consecutive slots from the row's first position: a tree verify step's
      root at its own position, node i at root + 1 + i)

Rotate-half RoPE as transformers' Llama. The torch form costs ~14 kernels per layer (slices,
cat, products, two scatters); here one program per (token, head) does all of it in float32.
(One program per token with all its heads, 41 programs instead of 615 for a tree verify step,
was slower on an H200 at every width: +8 µs a plain step, +11 a tree verify step over 30
layers; one or two warps a program instead of four changed nothing.)
"""
from __future__ import annotations

import torch

from draftsmith_kernels.dispatch import use_kernel
from models.layers import apply_rope, rope_cos_sin

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def rope_cache_reference(qkv, positions, inv_freq, k_cache, v_cache, num_heads: int, num_kv_heads: int, slots=None,
                         tree_block: bool = False):
    """slots [B,n] (draft trees): the cache slots to write K/V at, when they differ from the
    RoPE positions (tree nodes of one depth share a position, each has its own slot)."""
    B, n, _ = qkv.shape
    if tree_block:
        slots = positions[:, :1] + torch.arange(n, device=positions.device)
    d = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], -1)
    q = q.reshape(B, n, num_heads, d).transpose(1, 2)
    k = k.reshape(B, n, num_kv_heads, d).transpose(1, 2)
    v = v.reshape(B, n, num_kv_heads, d).transpose(1, 2)
    cos, sin = rope_cos_sin(inv_freq, positions, qkv.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    index = (positions if slots is None else slots)[:, None, :, None].expand(B, num_kv_heads, n, d)
    k_cache.scatter_(2, index, k.to(k_cache.dtype))
    v_cache.scatter_(2, index, v.to(v_cache.dtype))
    return q.contiguous()


if triton is not None:

    # n (queries per row) varies with every prompt: not specialised on, so no prompt length compiles anew
    @triton.jit(do_not_specialize=["n"])
    def _rope_cache_kernel(qkv_ptr, pos_ptr, slot_ptr, inv_ptr, q_ptr, kc_ptr, vc_ptr, n, NH, NKV,
                           stride_row, stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cs,
                           HALF: tl.constexpr, BLOCK: tl.constexpr, TREE_BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)  # b * n + t
        head = tl.program_id(1)  # 0..NH-1: query heads; NH..NH+NKV-1: key/value heads
        b = token // n
        t = token % n
        pos = tl.load(pos_ptr + token)
        if TREE_BLOCK:  # consecutive slots from the row's first position (slot_ptr unread)
            slot = tl.load(pos_ptr + b * n) + t
        else:
            slot = tl.load(slot_ptr + token)
        i = tl.arange(0, BLOCK)
        inside = i < HALF
        freq = pos.to(tl.float32) * tl.load(inv_ptr + i, mask=inside, other=0.0)
        cos = tl.cos(freq)
        sin = tl.sin(freq)
        row = qkv_ptr + token * stride_row
        if head < NH:
            src = row + head * (2 * HALF)
            dst = q_ptr + b * stride_qb + head * stride_qh + t * stride_qt
        else:
            g = head - NH
            src = row + (NH + g) * (2 * HALF)
            dst = kc_ptr + b * stride_cb + g * stride_ch + slot * stride_cs
            v = tl.load(row + (NH + NKV + g) * (2 * HALF) + tl.arange(0, 2 * BLOCK), mask=tl.arange(0, 2 * BLOCK) < 2 * HALF)
            tl.store(vc_ptr + b * stride_cb + g * stride_ch + slot * stride_cs + tl.arange(0, 2 * BLOCK),
                     v.to(vc_ptr.dtype.element_ty), mask=tl.arange(0, 2 * BLOCK) < 2 * HALF)
        x1 = tl.load(src + i, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=inside, other=0.0).to(tl.float32)
        tl.store(dst + i, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=inside)
        tl.store(dst + HALF + i, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=inside)


def rope_cache_triton(qkv, positions, inv_freq, k_cache, v_cache, num_heads: int, num_kv_heads: int, slots=None,
                      tree_block: bool = False):
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, n, width = qkv.shape
    d = k_cache.shape[-1]
    if width != (num_heads + 2 * num_kv_heads) * d or d % 2:
        raise ValueError(f"qkv width {width} is not ({num_heads} + 2*{num_kv_heads}) heads x {d}")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from the activations' {qkv.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout with a contiguous last dimension")
    qkv = qkv.reshape(B * n, width)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    positions = positions.reshape(B * n).contiguous()
    slots = positions if slots is None else slots.reshape(B * n).contiguous()
    q = torch.empty(B, num_heads, n, d, dtype=qkv.dtype, device=qkv.device)
    half = d // 2
    if B * n:
        _rope_cache_kernel[(B * n, num_heads + num_kv_heads)](
            qkv, positions, slots, inv_freq.float().contiguous(), q, k_cache, v_cache, n, num_heads, num_kv_heads,
            qkv.stride(0), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            HALF=half, BLOCK=triton.next_power_of_2(half), TREE_BLOCK=tree_block)
    return q


def rope_cache(qkv, positions, inv_freq, k_cache, v_cache, num_heads: int, num_kv_heads: int, slots=None,
               tree_block: bool = False):
    """The kernel on CUDA tensors, the reference elsewhere."""
    fn = rope_cache_triton if use_kernel(qkv) else rope_cache_reference
    return fn(qkv, positions, inv_freq, k_cache, v_cache, num_heads, num_kv_heads, slots=slots, tree_block=tree_block)
