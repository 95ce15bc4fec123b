"""Attention of a few query tokens per row over a static KV cache (decode and verify steps).

    q [B,nh,n,d] (rotated, from rope_cache), k_cache / v_cache [B,nkv,S,d], positions [B,n]
    → [B,n,nh*d], the o_proj input; a query at position p sees its row's keys at positions <= p
    (a draft tree's verify step, `tree_mask=`: every query sees the slots up to the row's root,
    the tree's nodes those of their mask rows; kernels/tree_attention.py calls it so); with
    `window` W (a sliding-window layer: Gemma-3's local layers, Mistral) only those at
    positions > p - W

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

from draftsmith_kernels.dispatch import INTERPRETED, use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# The runtime uses this path for steps of at most this many query tokens per row (decode,
# verify); longer chunks go through the flash SDPA, which reuses each key tile across queries.
DECODE_MAX_QUERIES = 16


def cache_mask(positions: torch.Tensor, max_len: int, window: int | None = None) -> torch.Tensor:
    """[B,1,q,S] bool: a query at position p sees the cache keys at positions <= p (and, with a
    sliding window W, > p - W, as transformers' sliding_window_overlay)."""
    key_pos = torch.arange(max_len, device=positions.device)
    visible = key_pos[None, None, :] <= positions[:, :, None]
    if window is not None:
        visible &= key_pos[None, None, :] > positions[:, :, None] - window
    return visible[:, None]


def grouped_attention_bias(positions: torch.Tensor, max_len: int, groups: int, dtype,
                           window: int | None = None) -> torch.Tensor:
    """[B,1,groups*q,S] additive mask (0 where key position <= query position, and > it - window
    with a window; -inf elsewhere), the rows repeated once per query head of a KV group (see
    `grouped_cache_attention`)."""
    visible = cache_mask(positions, max_len, window)  # [B,1,q,S]
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


def decode_attention_reference(q, k_cache, v_cache, positions, bias=None, window: int | None = None):
    """The torch form; `bias` (from grouped_attention_bias, with the same window) may be passed in
    to build it once per forward instead of once per layer."""
    if bias is None:
        bias = grouped_attention_bias(positions, k_cache.shape[2], q.shape[1] // k_cache.shape[1], q.dtype, window)
    return grouped_cache_attention(q, k_cache, v_cache, bias)


if triton is not None:

    # n (queries per row) and N (tree nodes) vary with every prompt and tree: not specialised on,
    # so no prompt length compiles anew
    @triton.jit(do_not_specialize=["n", "N"])
    def _partial_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, n, N, G, nh, scale, WINDOW,
                                  stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cs, stride_mb, stride_mq,
                                  D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                                  BLOCK_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, IEEE: tl.constexpr,
                                  TREE: tl.constexpr, LOW: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """One (row, KV head and tile of BLOCK_Q score rows, chunk of CHUNK cache positions):
        the row's n queries times the G query heads sharing that KV head are n*G score rows
        (query-major: r = t*G + j), cut in tiles of BLOCK_Q; a tile reads the chunk's keys and
        values once, scores them by two small matrix products, and each (query, head) gets the
        softmax statistics of its visible keys. Chunks beyond every query's last key do nothing.
        TREE (a tree's verify step): pos_ptr holds the row's base (the root's slot) and every
        query sees the slots up to it; the N nodes sit at slots base + 1 .. base + N and query
        t > 0 (node t-1) also sees those of its mask row (mask_ptr [B,n-1,N] bytes), read beside
        the keys (never before them: the slots all hold this step's K/V, so nothing unseen is
        ever non-finite). LOW: 16-bit products (q, k, v as stored, the probabilities rounded
        to the cache's dtype, float32 sums); else float32 operands (TF32 or, IEEE, exact).
        HAS_WINDOW (chains only): query t sees keys in (pos - WINDOW, pos]; keys before the
        tile's first visible one are not loaded, and a chunk with none of them still writes its
        statistics (m = -inf, l = 0, acc = 0: weight 0 in the merge, which reads every chunk up
        to the token's position)."""
        b = tl.program_id(0).to(tl.int64)
        tiles = tl.cdiv(n * G, BLOCK_Q)
        kv = tl.program_id(1) // tiles
        r = (tl.program_id(1) % tiles) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        split = tl.program_id(2)
        real = r < n * G
        t = r // G
        head = kv * G + r % G
        if TREE:
            base = tl.load(pos_ptr + b)
            pos = tl.zeros([BLOCK_Q], tl.int64) + base  # [BLOCK_Q] the cache part every query sees
            last = base + N
        else:
            pos = tl.load(pos_ptr + b * n + t, mask=real, other=-1)  # [BLOCK_Q]
            last = tl.max(pos, 0)
        if split * CHUNK <= last:
            dims = tl.arange(0, BLOCK_D)
            dim_ok = dims < D
            q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + dims[None, :],
                        mask=real[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]
            keys = split * CHUNK + tl.arange(0, CHUNK)
            offs = b * stride_cb + kv * stride_ch + keys[:, None] * stride_cs + dims[None, :]
            in_chunk = (keys <= last)[:, None] & dim_ok[None, :]
            if HAS_WINDOW:
                first = tl.min(tl.where(real, pos, last), 0) - WINDOW + 1  # the first key any query sees
                in_chunk = in_chunk & (keys >= first)[:, None]
            k = tl.load(k_ptr + offs, mask=in_chunk, other=0.0)  # [CHUNK, BLOCK_D]
            v = tl.load(v_ptr + offs, mask=in_chunk, other=0.0)
            visible = keys[None, :] <= pos[:, None]  # [BLOCK_Q, CHUNK]
            if HAS_WINDOW:
                visible = visible & (keys[None, :] > pos[:, None] - WINDOW)
            if TREE:
                node = keys - base - 1  # [CHUNK] the tree node at each slot (if 0 <= node < N)
                in_tree = ((node >= 0) & (node < N))[None, :] & (real & (t > 0))[:, None]
                seen = tl.load(mask_ptr + b * stride_mb + (t - 1)[:, None] * stride_mq + node[None, :],
                               mask=in_tree, other=0)
                visible = visible | (seen != 0)
            if not LOW:
                q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
            if IEEE:  # float32 caches: exact float32 products (no TF32), so tests compare exactly
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:  # 16-bit caches: TF32 products (10 mantissa bits, more than the inputs' 7 or 10), or 16-bit
                s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_Q, CHUNK]
            s = tl.where(visible, s, float("-inf"))
            m = tl.max(s, 1)  # -inf for a query that sees none of this chunk (weight 0 in the merge)
            p = tl.where(visible, tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
            if IEEE:
                acc = tl.dot(p, v, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v)  # [BLOCK_Q, BLOCK_D]
            slot = ((b * n + t) * nh + head) * BLOCK_SPLITS + split  # [BLOCK_Q]
            tl.store(m_ptr + slot, m, mask=real)
            tl.store(l_ptr + slot, tl.sum(p, 1), mask=real)
            tl.store(acc_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=real[:, None])

    @triton.jit
    def _merge_chunk(m_ptr, l_ptr, acc_ptr, slots, used, top, l, out, dims, BLOCK_D: tl.constexpr):
        """Split slots [BLOCK_H, C] (`used` where written) folded into a merge's running max `top`
        [BLOCK_H], sum `l` and output `out` [BLOCK_H, BLOCK_D] (an online softmax over chunks of
        splits: what the chunks before summed is rescaled to the new max). `top` starts finite,
        so an idle head's exp(top - new) is 1, never NaN; a split's m is -inf where its query
        sees none of its keys: weight 0."""
        m = tl.load(m_ptr + slots, mask=used, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(m, 1))
        alpha = tl.exp(top - new_top)
        w = tl.where(used, tl.exp(m - new_top[:, None]), 0.0)  # [BLOCK_H, C] rescaling of each split
        l = l * alpha + tl.sum(w * tl.load(l_ptr + slots, mask=used, other=0.0), 1)
        acc = tl.load(acc_ptr + slots[:, :, None] * BLOCK_D + dims[None, None, :], mask=used[:, :, None], other=0.0)
        out = out * alpha[:, None] + tl.sum(w[:, :, None] * acc, 1)
        return new_top, l, out

    @triton.jit(do_not_specialize=["n", "N"])
    def _combine_kernel(pos_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, n, N, NH, stride_ot,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                        BLOCK_H: tl.constexpr, SPLIT_CHUNK: tl.constexpr, TREE: tl.constexpr):
        """One (query token, query head), or with TREE or BLOCK_H > 1 one (query token, block of
        BLOCK_H query heads): merge the chunks' statistics into the attention output.
        A chain's token merges its chunks up to its position: one head in one [BLOCK_SPLITS,
        BLOCK_D] tile (the GPU's form), or BLOCK_H heads as a tree's token does (the interpreter's
        form: a program per head was about a third of the kernel-loop tests' time in CI).
        A tree's token merges the chunks up to base + N (all written; a chunk it sees nothing of
        has m = -inf, weight 0, and chunk 0 always holds a visible key), SPLIT_CHUNK at a time:
        all of a token's heads over 32 or 64 chunks in one tile would spill."""
        token = tl.program_id(0).to(tl.int64)
        if TREE or BLOCK_H > 1:
            heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
            head_ok = heads < NH
            if TREE:
                splits = tl.cdiv(tl.load(pos_ptr + token // n) + N + 1, CHUNK)
            else:  # (every split up to the token's position holds a visible key)
                splits = tl.cdiv(tl.load(pos_ptr + token) + 1, CHUNK)
            start = (token * NH + heads) * BLOCK_SPLITS  # [BLOCK_H]
            dims = tl.arange(0, BLOCK_D)
            top = tl.full([BLOCK_H], -1.0e30, tl.float32)
            l = tl.zeros([BLOCK_H], tl.float32)
            out = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for j0 in range(0, splits, SPLIT_CHUNK):
                j = j0 + tl.arange(0, SPLIT_CHUNK)
                used = (j < splits)[None, :] & head_ok[:, None]  # [BLOCK_H, SPLIT_CHUNK]
                top, l, out = _merge_chunk(m_ptr, l_ptr, acc_ptr, start[:, None] + j[None, :], used, top, l, out,
                                           dims, BLOCK_D)
            out = out / tl.where(head_ok, l, 1.0)[:, None]  # [BLOCK_H, BLOCK_D] (heads past NH: no 0 / 0)
            tl.store(out_ptr + token * stride_ot + heads[:, None] * D + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (dims < D)[None, :])
        else:
            head = tl.program_id(1)
            splits = tl.cdiv(tl.load(pos_ptr + token) + 1, CHUNK)  # the chunks that hold visible keys
            base = (token * NH + head) * BLOCK_SPLITS
            j = tl.arange(0, BLOCK_SPLITS)
            used = j < splits
            m = tl.load(m_ptr + base + j, mask=used, other=float("-inf"))
            w = tl.where(used, tl.exp(m - tl.max(m, 0)), 0.0)  # [BLOCK_SPLITS] rescaling of each chunk
            l = tl.sum(w * tl.load(l_ptr + base + j, mask=used, other=0.0), 0)
            dims = tl.arange(0, BLOCK_D)
            acc = tl.load(acc_ptr + (base + j)[:, None] * BLOCK_D + dims[None, :], mask=used[:, None], other=0.0)
            out = tl.sum(w[:, None] * acc, 0) / l
            tl.store(out_ptr + token * stride_ot + head * D + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)


# Query heads a chain's merge program takes: one on a GPU (the form every chain figure in
# BENCHMARKS.md ran; more a program were timed for trees only), all of them in Triton's
# CPU interpreter, whose cost is per program (CI runs whole loops through it), unless a caller asks
# for its own (the kernel's tests do)
CHAIN_COMBINE_HEADS = 16 if INTERPRETED else 1


def decode_attention_triton(q, k_cache, v_cache, positions, bias=None, *, tree_mask=None, max_block_q: int = 64,
                            low_products: bool = False, combine_heads: int | None = None, merge_chunk: int = 64,
                            max_chunks: int = 64, window: int | None = None):
    """Split over the cache length (flash-decoding): at batch 1 a decode step has only nh
    (token, head) pairs, too few programs to keep the GPU's memory system busy, so each pair's
    keys are cut into chunks handled in parallel, then merged by a second small launch.

    tree_mask [B,n-1,N] (a tree's verify step, kernels/tree_attention.py): positions is then
    base [B], the root's slot; query 0 is the root and query t > 0 node t-1, whose K/V RoPE
    wrote at slot base + t. max_block_q (score rows a program takes), low_products (16-bit
    products on 16-bit caches) and merge_chunk (chunks a merge program sums at once) are the tree
    path's tuning; combine_heads (query heads a merge program takes: the tree path's tuning, 1 for
    a tree by default, CHAIN_COMBINE_HEADS for a chain) and max_chunks (the most chunks the cache
    is cut into) both paths'; a chain's decode and verify steps keep the defaults. window: a
    sliding-window layer's W (chains only)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, nh, n, d = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    if nh % nkv or k_cache.shape[-1] != d or k_cache.shape[0] != B:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension, k and v one layout")
    tree = tree_mask is not None
    if tree and window is not None:
        raise ValueError("decode_attention: a sliding window is for chains only (a tree's nodes' positions are not passed)")
    if tree:
        N = tree_mask.shape[2]
        if tree_mask.shape != (B, n - 1, N):
            raise ValueError(f"mask {tuple(tree_mask.shape)} does not fit q {tuple(q.shape)}: need [B, n-1, N]")
        positions = positions.reshape(B).contiguous()
        # bool pointers load as int1; a byte view is plainer and costs no launch
        mask = tree_mask.contiguous()
        mask = mask.view(torch.int8) if mask.dtype == torch.bool else mask
    else:
        N = 0
        positions = positions.reshape(B * n).contiguous()
        mask = positions  # (not read)
    out = torch.empty(B, n, nh * d, dtype=q.dtype, device=q.device)
    if not B * n:
        return out
    chunk = max(32, triton.next_power_of_2(triton.cdiv(S, max_chunks)))  # at most 64 chunks per query
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
    block_q = min(max_block_q, max(16, triton.next_power_of_2(n * G)))
    ieee = q.dtype == torch.float32
    _partial_attention_kernel[(B, nkv * triton.cdiv(n * G, block_q), splits)](
        q, k_cache, v_cache, positions, mask, m, l, acc, n, N, G, nh, d ** -0.5, window or 0,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        mask.stride(0), mask.stride(1) if tree else 0,
        D=d, BLOCK_D=block_d, CHUNK=chunk, BLOCK_SPLITS=block_splits, BLOCK_Q=block_q, IEEE=ieee, TREE=tree,
        LOW=low_products and not ieee and not INTERPRETED, HAS_WINDOW=window is not None)
    if combine_heads is None:
        combine_heads = 1 if tree else CHAIN_COMBINE_HEADS
    block_h = min(combine_heads, triton.next_power_of_2(nh))
    _combine_kernel[(B * n, triton.cdiv(nh, block_h))](positions, m, l, acc, out, n, N, nh, out.stride(1),
                                                       D=d, BLOCK_D=block_d, CHUNK=chunk, BLOCK_SPLITS=block_splits,
                                                       BLOCK_H=block_h, SPLIT_CHUNK=min(block_splits, merge_chunk),
                                                       TREE=tree)
    return out


def decode_attention(q, k_cache, v_cache, positions, bias=None, window: int | None = None):
    """The kernel on CUDA tensors, the reference elsewhere; window: a sliding-window layer's W
    (bias, if given, built with it)."""
    if use_kernel(q):
        return decode_attention_triton(q, k_cache, v_cache, positions, window=window)
    return decode_attention_reference(q, k_cache, v_cache, positions, bias, window)
