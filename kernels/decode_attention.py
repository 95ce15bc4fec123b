"""Attention of a few query tokens per row over a static KV cache (decode and verify steps).

    q [B,nh,n,d] (rotated, from rope_cache), k_cache / v_cache [B,nkv,S,d], positions [B,n]
    → [B,n,nh*d], the o_proj input; a query at position p sees its row's keys at positions <= p

Why a kernel: the torch form is one SDPA call over the whole cache with an additive mask. On an
H200 that launches a flash kernel tiled for long queries, plus a mask, a memset and a copy back
into o_proj's layout; at batch 1 it was ~14 us of a ~44 us decode layer (scripts/profile_decode.py,
BENCHMARKS.md). Here chunks of the cache are scored in parallel (only chunks a query may see do
any work), each chunk once for all the queries and query heads that read its KV head (a verify
step's k+1 queries cost about what one does), and merged by a second launch that writes
straight into o_proj's layout, in float32.
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

# The runtime uses this path for steps of at most this many query tokens per row (decode,
# verify); longer chunks go through the flash SDPA, which reuses each key tile across queries.
DECODE_MAX_QUERIES = 16


def cache_mask(positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B,1,q,S] bool: a query at position p sees the cache keys at positions <= p."""
    key_pos = torch.arange(max_len, device=positions.device)
    return (key_pos[None, None, :] <= positions[:, :, None])[:, None]


def grouped_attention_bias(positions: torch.Tensor, max_len: int, groups: int, dtype) -> torch.Tensor:
    """[B,1,groups*q,S] additive mask (0 where key position <= query position, -inf after),
    the rows repeated once per query head of a KV group (see `grouped_cache_attention`)."""
    visible = cache_mask(positions, max_len)  # [B,1,q,S]
    bias = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
    return bias.repeat(1, 1, groups, 1)


def grouped_cache_attention(q, k_cache, v_cache, bias):
    """q [B,nh,q,d] over the whole cache [B,nkv,S,d] with `grouped_attention_bias`.

    The g = nh/nkv query heads that share a KV head are folded into its query length
    ([B,nkv,g*q,d]), so one plain attention call serves grouped-query attention without
    repeating the cache or falling back to the slow math path. Returns [B,q,nh*d], the
    o_proj input (head h = kv*g + j, as transformers' repeat_kv orders them)."""
    B, nh, n, d = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    out = F.scaled_dot_product_attention(q.reshape(B, nkv, g * n, d), k_cache, v_cache, attn_mask=bias)
    return out.unflatten(2, (g, n)).permute(0, 3, 1, 2, 4).reshape(B, n, nh * d)


def decode_attention_reference(q, k_cache, v_cache, positions, bias=None):
    """The torch form; `bias` (from grouped_attention_bias) may be passed in to build it once per
    forward instead of once per layer."""
    if bias is None:
        bias = grouped_attention_bias(positions, k_cache.shape[2], q.shape[1] // k_cache.shape[1], q.dtype)
    return grouped_cache_attention(q, k_cache, v_cache, bias)


if triton is not None:

    # n (queries per row) varies with every prompt: not specialised on, so no prompt length compiles anew
    @triton.jit(do_not_specialize=["n"])
    def _partial_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, n, G, nh, scale,
                                  stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cs,
                                  D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                                  BLOCK_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, IEEE: tl.constexpr):
        """One (row, KV head and tile of BLOCK_Q score rows, chunk of CHUNK cache positions):
        the row's n queries times the G query heads sharing that KV head are n*G score rows
        (query-major: r = t*G + j), cut in tiles of BLOCK_Q; a tile reads the chunk's keys and
        values once, scores them by two small matrix products, and each (query, head) gets the
        softmax statistics of its visible keys. Chunks beyond every query's position do nothing."""
        b = tl.program_id(0).to(tl.int64)
        tiles = tl.cdiv(n * G, BLOCK_Q)
        kv = tl.program_id(1) // tiles
        r = (tl.program_id(1) % tiles) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        split = tl.program_id(2)
        real = r < n * G
        t = r // G
        head = kv * G + r % G
        pos = tl.load(pos_ptr + b * n + t, mask=real, other=-1)  # [BLOCK_Q]
        if split * CHUNK <= tl.max(pos, 0):
            dims = tl.arange(0, BLOCK_D)
            dim_ok = dims < D
            q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + dims[None, :],
                        mask=real[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]
            keys = split * CHUNK + tl.arange(0, CHUNK)
            offs = b * stride_cb + kv * stride_ch + keys[:, None] * stride_cs + dims[None, :]
            in_chunk = (keys <= tl.max(pos, 0))[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offs, mask=in_chunk, other=0.0)  # [CHUNK, BLOCK_D]
            v = tl.load(v_ptr + offs, mask=in_chunk, other=0.0)
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
            if IEEE:  # float32 caches: exact float32 products (no TF32), so tests compare exactly
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:  # 16-bit caches: TF32 products (10 mantissa bits, more than the inputs' 7 or 10)
                s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_Q, CHUNK]
            visible = keys[None, :] <= pos[:, None]
            s = tl.where(visible, s, float("-inf"))
            m = tl.max(s, 1)  # -inf for a query that sees none of this chunk (never read back)
            p = tl.where(visible, tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
            if IEEE:
                acc = tl.dot(p, v, input_precision="ieee")
            else:
                acc = tl.dot(p, v)  # [BLOCK_Q, BLOCK_D]
            slot = ((b * n + t) * nh + head) * BLOCK_SPLITS + split  # [BLOCK_Q]
            tl.store(m_ptr + slot, m, mask=real)
            tl.store(l_ptr + slot, tl.sum(p, 1), mask=real)
            tl.store(acc_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=real[:, None])

    @triton.jit
    def _combine_kernel(pos_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, stride_ot,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
        """One (query token, query head): merge the chunks' statistics into the attention output."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.cdiv(tl.load(pos_ptr + token) + 1, CHUNK)  # the chunks that hold visible keys
        base = (token * tl.num_programs(1) + head) * BLOCK_SPLITS
        j = tl.arange(0, BLOCK_SPLITS)
        used = j < splits
        m = tl.load(m_ptr + base + j, mask=used, other=float("-inf"))
        w = tl.where(used, tl.exp(m - tl.max(m, 0)), 0.0)  # [BLOCK_SPLITS] rescaling of each chunk
        l = tl.sum(w * tl.load(l_ptr + base + j, mask=used, other=0.0), 0)
        dims = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + (base + j)[:, None] * BLOCK_D + dims[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, 0) / l
        tl.store(out_ptr + token * stride_ot + head * D + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)


def decode_attention_triton(q, k_cache, v_cache, positions, bias=None):
    """Split over the cache length (flash-decoding): at batch 1 a decode step has only nh
    (token, head) pairs, too few programs to keep the GPU's memory system busy, so each pair's
    keys are cut into chunks handled in parallel, then merged by a second small launch."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, nh, n, d = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    if nh % nkv or k_cache.shape[-1] != d or k_cache.shape[0] != B:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension, k and v one layout")
    positions = positions.reshape(B * n).contiguous()
    out = torch.empty(B, n, nh * d, dtype=q.dtype, device=q.device)
    if not B * n:
        return out
    chunk = max(32, triton.next_power_of_2(triton.cdiv(S, 64)))  # at most 64 chunks per query
    splits = triton.cdiv(S, chunk)
    # tl.dot needs an inner size of at least 16 (8 for float32 on NVIDIA): pad small heads, masked
    block_splits, block_d = triton.next_power_of_2(splits), max(16, triton.next_power_of_2(d))
    # per (token, head, chunk) statistics, laid out with block_splits slots so that the merge
    # reads one power-of-two tile; slots past a query's last visible chunk are never read
    m = torch.empty(B * n * nh * block_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B * n * nh * block_splits, block_d, dtype=torch.float32, device=q.device)
    G = nh // nkv
    # score rows per program: up to 64 (a verify step's k+1 queries times G heads fit one tile;
    # a long chunk, a drafter's prompt, takes several), so only three variants ever compile
    block_q = min(64, max(16, triton.next_power_of_2(n * G)))
    _partial_attention_kernel[(B, nkv * triton.cdiv(n * G, block_q), splits)](
        q, k_cache, v_cache, positions, m, l, acc, n, G, nh, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D=d, BLOCK_D=block_d, CHUNK=chunk, BLOCK_SPLITS=block_splits, BLOCK_Q=block_q, IEEE=q.dtype == torch.float32)
    _combine_kernel[(B * n, nh)](positions, m, l, acc, out, out.stride(1),
                                 D=d, BLOCK_D=block_d, CHUNK=chunk, BLOCK_SPLITS=block_splits)
    return out


def decode_attention(q, k_cache, v_cache, positions, bias=None):
    """The kernel on CUDA tensors (unless DRAFTSMITH_KERNELS=0), the reference elsewhere."""
    fn = decode_attention_triton if use_kernel(q) else decode_attention_reference
    return fn(q, k_cache, v_cache, positions, bias)
