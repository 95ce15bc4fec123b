"""Attention of a draft tree's queries over the row's KV cache plus the tree block.

    q [B,nh,M,d] (rotated), k_cache / v_cache [B,nkv,S,d], base_positions [B], and the tree
    block's K/V either
      tree_k / tree_v [B,nkv,N,d] apart (a drafter's candidate buffers), with tree_mask
            [B,M,N] bool, a row per query, or
      None: in the cache itself at slots base + 1 .. base + N (the target's verify step,
            whose RoPE kernel has just written them there), with tree_mask [B,M-1,N]: query 0
            is the root, which sees no tree key, and query t > 0 is node t-1 (its mask row)
    → [B,M,nh*d], the o_proj input

Every query of row b sees the cache keys at slots <= base_positions[b] (the verified prefix,
ending with the root token) and the tree keys j of its mask row (itself and its ancestors,
inference/tree/ops.py). A verify step feeds the root and its N nodes (M = N + 1): the root is a
plain cache query, and the tree's own [B,N,N] mask is the nodes' rows as it stands (no copy
with an empty row in front: two launches a verify step). The tree slots of the cache are not
ordered by position, so a position-causal mask cannot describe them: the block is masked apart.
GQA: query head h reads KV head h // (nh / nkv), as transformers' repeat_kv orders them.
base_positions must lie in 0..S-1, and base + N in 0..S-1 when the block is in the cache (not
checked: that would be a host sync). Cache slots past the base (past the block) are never read;
tree keys outside a query's mask row are read with its tile and weigh exactly 0, so they must be
finite (in the cache they are: written this step; a candidate buffer's unseen slots are not
even read).

Why kernels: the torch form is one SDPA call over the whole cache under a dense additive mask
[B,1,g*M,S] (plus the mask's own ~10 launches), as a chain verify step was before
decode_attention. The verify step's form goes through decode_attention's own kernels
(kernels/decode_attention.py): the cache and the block after the root are cut alike into chunks
scored in parallel, the chunks holding tree slots reading each query's mask row beside their
keys, and merged by a second launch. The drafter's form is the kernel below: as in
decode_attention, the g*M score rows of a KV head are one tile (tl.dot), so each cache key up to
the base is read once per tile, not once per (query, head); the cache is cut into splits that
run in parallel (flash-decoding; as many as the rows, heads and tiles leave the GPU room for),
each an online softmax over tiles of keys; the candidate buffer is cut into tiles of at most 64
nodes, one more split each, under its own mask; a second launch merges the splits into o_proj's
layout, in float32. (One split of one tile for the whole buffer would be slow: 264 candidates,
depth 5 with top-k 8, made it a 64 x 512 tile that took ~30 us a level on an H200, against ~6 us
for 200.) The verify step goes through decode_attention's chunks rather than tiles of this
kernel: on an H200 at the bench's geometry (512 slots, 40 nodes) 5.2-5.6 us a call against
5.6-5.8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith_kernels.dispatch import INTERPRETED, use_kernel
from draftsmith_kernels.settings import TreeAttentionTuning, active
from draftsmith_kernels.decode_attention import decode_attention_triton, grouped_cache_attention

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def tree_attention_bias(base_positions, tree_mask, max_len: int, groups: int, dtype) -> torch.Tensor:
    """[B,1,groups*M,S+N] additive mask over (cache keys, tree keys apart), rows repeated once
    per query head of a KV group (the folding of `grouped_cache_attention`)."""
    M = tree_mask.shape[1]
    cache_visible = torch.arange(max_len, device=base_positions.device)[None, :] <= base_positions[:, None]  # [B,S]
    visible = torch.cat([cache_visible[:, None, :].expand(-1, M, -1), tree_mask], 2)  # [B,M,S+N]
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return bias[:, None].repeat(1, 1, groups, 1)


def tree_cache_bias(base_positions, tree_mask, max_len: int, groups: int, dtype) -> torch.Tensor:
    """[B,1,groups*M,S] additive mask over the cache slots when the tree block sits in the cache:
    slots <= base, and slot base + 1 + j where tree_mask[b, t, j]. Built once per forward on the
    torch path (the kernel reads base and the mask instead)."""
    B, M, N = tree_mask.shape
    base = base_positions[:, None, None]
    visible = (torch.arange(max_len, device=base.device)[None, None, :] <= base).expand(B, M, max_len).clone()
    visible.scatter_(2, (base + 1 + torch.arange(N, device=base.device)).expand(B, M, N), tree_mask)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return bias[:, None].repeat(1, 1, groups, 1)


def with_root_row(node_mask: torch.Tensor) -> torch.Tensor:
    """[B,N,N] the nodes' mask rows → [B,N+1,N], the root's empty row first (a verify step's
    queries: the root, then the nodes)."""
    return torch.cat([node_mask.new_zeros(node_mask.shape[0], 1, node_mask.shape[2]), node_mask], 1)


def tree_attention_reference(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask, bias=None):
    """The torch form: one SDPA call over the cache (and the tree block beside it, when apart).
    `bias` (from tree_cache_bias, block in the cache only) may be passed in to build it once per
    forward instead of once per layer."""
    B, nh, M, d = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    g = nh // nkv
    if tree_k is None:
        if bias is None:
            bias = tree_cache_bias(base_positions, with_root_row(tree_mask), S, g, q.dtype)
        return grouped_cache_attention(q, k_cache, v_cache, bias)
    keys = torch.cat([k_cache, tree_k], 2)  # [B,nkv,S+N,d]
    values = torch.cat([v_cache, tree_v], 2)
    bias = tree_attention_bias(base_positions, tree_mask, S, g, q.dtype)
    out = F.scaled_dot_product_attention(q.reshape(B, nkv, g * M, d), keys, values, attn_mask=bias)
    return out.unflatten(2, (g, M)).permute(0, 3, 1, 2, 4).reshape(B, M, nh * d)


MAX_SPLITS = 63  # cache splits at most; + a candidate buffer's tile: 64 split slots, a power of two for the merge
MAX_TREE_TILE = 64  # tree nodes a split scores at once (BLOCK_Q x this scores in registers)
# the launch settings (score rows a program, key tiles, warps, products, merges) are the caller's:
# kernels/settings.py TreeAttentionTuning


if triton is not None:
    from draftsmith_kernels.decode_attention import _merge_chunk  # the merges' online softmax over chunks of splits

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:  # float32 caches: exact float32 products (no TF32), so tests compare exactly
            return tl.dot(a, b, input_precision="ieee")
        else:  # 16-bit caches: TF32 products (10 mantissa bits, more than the inputs' 7 or 10), or 16-bit ones
            return tl.dot(a, b)

    @triton.jit
    def _operand(x, LOW: tl.constexpr):
        """A loaded tile as the products take it: as stored (16-bit products), or in float32."""
        if LOW:
            return x
        else:
            return x.to(tl.float32)

    @triton.jit
    def _dot_pv(p, v, IEEE: tl.constexpr, ROUND_P: tl.constexpr, P_DTYPE: tl.constexpr):
        """Probabilities [rows, keys] float32 times values [keys, D] (`_operand`), float32 sums;
        ROUND_P: the probabilities rounded to the cache's dtype first (16-bit products, or their
        emulation in float32 under the interpreter, whose 16-bit dots are not exact)."""
        if ROUND_P:
            p = p.to(P_DTYPE)
        return _dot(p.to(v.dtype), v, IEEE)

    @triton.jit
    def _tile_setup(b, M, G, stride_qb, stride_qh, stride_qt, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_Q: tl.constexpr):
        """A program's tile of score rows: the row's M queries times the G query heads sharing the
        KV head are M*G score rows (query-major: r = t*G + j); program_id(1) is the KV head times
        the tiles of BLOCK_Q rows. → kv, the rows' query t and head [BLOCK_Q], which are real,
        the head dimension's columns and which are real, and the offsets of q's tile [BLOCK_Q,
        BLOCK_D] (loaded only by the programs that use it: splits past the base do nothing)."""
        tiles = tl.cdiv(M * G, BLOCK_Q)
        kv = tl.program_id(1) // tiles
        r = (tl.program_id(1) % tiles) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        real = r < M * G
        t = r // G
        head = kv * G + r % G
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < D
        q_offs = b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + dims[None, :]
        return kv, t, head, real, dims, dim_ok, q_offs

    @triton.jit
    def _attend_cache(q, kc_ptr, vc_ptr, row, lo, hi, m, l, acc, scale, stride_cs, dims, dim_ok,
                      BLOCK_S: tl.constexpr, IEEE: tl.constexpr, LOW: tl.constexpr, ROUND_P: tl.constexpr):
        """The online softmax (m, l, acc) [BLOCK_Q], [BLOCK_Q], [BLOCK_Q, BLOCK_D] carried over the
        cache slots lo .. hi-1 (all visible) of one row and KV head (`row`: its offset), in tiles
        of BLOCK_S keys. m must start finite (exp(m - m_new) stays defined)."""
        for start in range(lo, hi, BLOCK_S):
            keys = start + tl.arange(0, BLOCK_S)
            inside = keys < hi  # the same for every query of the row
            offs = row + keys[:, None] * stride_cs + dims[None, :]
            both = inside[:, None] & dim_ok[None, :]
            k = _operand(tl.load(kc_ptr + offs, mask=both, other=0.0), LOW)  # [BLOCK_S, BLOCK_D]
            v = _operand(tl.load(vc_ptr + offs, mask=both, other=0.0), LOW)
            s = tl.where(inside[None, :], _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])  # [BLOCK_Q, BLOCK_S], 0 outside
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot_pv(p, v, IEEE, ROUND_P, vc_ptr.dtype.element_ty)
            m = m_new
        return m, l, acc

    @triton.jit
    def _tree_tile(q, k_ptr, v_ptr, row, stride_n, mask_rows, nodes, N, real, dims, dim_ok, scale,
                   IEEE: tl.constexpr, LOW: tl.constexpr):
        """Scores of a tile of tree nodes `nodes` [BLOCK_N] (node j's K/V at slot j of `row`, a
        candidate buffer), -inf outside each query's mask row (mask_rows [BLOCK_Q]: pointers to
        them, read where `real`).
        → s [BLOCK_Q, BLOCK_N], seen, v [BLOCK_N, BLOCK_D]. Only the nodes some row of the tile
        sees are read (the others load as 0): whatever a slot no query sees holds, even inf or
        NaN left by an earlier draft, never reaches the products (no buffer to clear first).
        (Loading every node's keys and values beside the mask rows and zeroing the unseen ones,
        so that no load waits for the mask, was 0.2-0.3 µs a call slower on an H200.)"""
        node_ok = nodes < N
        seen = tl.load(mask_rows[:, None] + nodes[None, :], mask=real[:, None] & node_ok[None, :], other=0) != 0
        wanted = tl.max(seen.to(tl.int32), 0) > 0  # [BLOCK_N] nodes some row of the tile sees
        offs = row + nodes[:, None] * stride_n + dims[None, :]
        both = (node_ok & wanted)[:, None] & dim_ok[None, :]
        k = _operand(tl.load(k_ptr + offs, mask=both, other=0.0), LOW)  # [BLOCK_N, BLOCK_D]
        v = _operand(tl.load(v_ptr + offs, mask=both, other=0.0), LOW)
        s = tl.where(seen, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
        return s, seen, v

    # M, N (queries, tree nodes) vary with the tree's size: not specialised on
    @triton.jit(do_not_specialize=["M", "N", "span"])
    def _tree_partial_kernel(q_ptr, kc_ptr, vc_ptr, base_ptr, kt_ptr, vt_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr,
                             M, N, G, nh, span, tree_split, scale,
                             stride_qb, stride_qh, stride_qt, stride_cb, stride_ch, stride_cs,
                             stride_tb, stride_th, stride_tt, stride_mb, stride_mq,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr,
                             IEEE: tl.constexpr, LOW: tl.constexpr, ROUND_P: tl.constexpr):
        """One (row, KV head and tile of BLOCK_Q score rows, split). Splits 0 .. tree_split-1
        cover `span` cache slots each (a multiple of BLOCK_S), all visible up to the base, in
        tiles of BLOCK_S keys with an online softmax (splits past the base do nothing); split
        tree_split + i is tile i of the candidate buffer (nodes i*BLOCK_N .., under each query's
        mask row). Each writes per (query, head) softmax statistics for the merge."""
        b = tl.program_id(0).to(tl.int64)
        split = tl.program_id(2)
        kv, t, head, real, dims, dim_ok, q_offs = _tile_setup(b, M, G, stride_qb, stride_qh, stride_qt, D, BLOCK_D, BLOCK_Q)
        q_ok = real[:, None] & dim_ok[None, :]
        base = tl.load(base_ptr + b)
        cache_row = b * stride_cb + kv * stride_ch
        slot = ((b * M + t) * nh + head) * BLOCK_SPLITS + split  # [BLOCK_Q] where this split's stats go
        if split >= tree_split:
            q = _operand(tl.load(q_ptr + q_offs, mask=q_ok, other=0.0), LOW)  # [BLOCK_Q, BLOCK_D]
            nodes = (split - tree_split) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_rows = mask_ptr + b * stride_mb + t * stride_mq
            s, seen, v = _tree_tile(q, kt_ptr, vt_ptr, b * stride_tb + kv * stride_th, stride_tt, mask_rows, nodes, N,
                                    real, dims, dim_ok, scale, IEEE, LOW)
            m = tl.max(s, 1)  # -inf for a query that sees no node of the tile: weight 0 in the merge
            p = tl.where(seen, tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
            tl.store(m_ptr + slot, m, mask=real)
            tl.store(l_ptr + slot, tl.sum(p, 1), mask=real)
            acc = _dot_pv(p, v, IEEE, ROUND_P, vc_ptr.dtype.element_ty)  # [BLOCK_Q, BLOCK_D]
            tl.store(acc_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=real[:, None])
        elif split * span <= base:
            q = _operand(tl.load(q_ptr + q_offs, mask=q_ok, other=0.0), LOW)
            m = tl.full([BLOCK_Q], -1.0e30, tl.float32)  # finite start; the first tile holds a visible key
            l = tl.zeros([BLOCK_Q], tl.float32)
            acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
            m, l, acc = _attend_cache(q, kc_ptr, vc_ptr, cache_row, split * span, tl.minimum(split * span + span, base + 1),
                                      m, l, acc, scale, stride_cs, dims, dim_ok, BLOCK_S, IEEE, LOW, ROUND_P)
            tl.store(m_ptr + slot, m, mask=real)
            tl.store(l_ptr + slot, l, mask=real)
            tl.store(acc_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=real[:, None])

    @triton.jit(do_not_specialize=["M", "span", "tree_split", "tree_end"])
    def _tree_combine_kernel(base_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, M, NH, span, tree_split, tree_end, stride_ot,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                             SPLIT_CHUNK: tl.constexpr):
        """One (query token, block of BLOCK_H query heads): merge the statistics of the cache splits
        up to the base and of the tree block's tiles (splits tree_split .. tree_end-1). The split
        slots are walked SPLIT_CHUNK at a time, a [BLOCK_H, SPLIT_CHUNK, BLOCK_D] tile whatever
        the cache's length (TreeAttentionTuning.merge_split_chunk says why), and a chunk that holds
        no split this row wrote (past the base, before the tree's tiles) is skipped: a row early in
        a long cache merges its few splits, not the cache's every slot."""
        token = tl.program_id(0).to(tl.int64)  # b * M + t
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        head_ok = heads < NH
        splits = tl.cdiv(tl.load(base_ptr + token // M) + 1, span)
        start = (token * NH + heads) * BLOCK_SPLITS  # [BLOCK_H]
        dims = tl.arange(0, BLOCK_D)
        top = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        out = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for j0 in range(0, tree_end, SPLIT_CHUNK):
            if (j0 < splits) | (j0 + SPLIT_CHUNK > tree_split):
                jc = j0 + tl.arange(0, SPLIT_CHUNK)
                used = ((jc < splits) | ((jc >= tree_split) & (jc < tree_end)))[None, :] & head_ok[:, None]
                top, l, out = _merge_chunk(m_ptr, l_ptr, acc_ptr, start[:, None] + jc[None, :], used, top, l, out, dims,
                                           BLOCK_D)
        out = out / tl.where(head_ok, l, 1.0)[:, None]  # [BLOCK_H, BLOCK_D] (heads past NH: no 0 / 0)
        tl.store(out_ptr + token * stride_ot + heads[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & (dims < D)[None, :])


def tree_attention_triton(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask, bias=None,
                          max_splits: int = MAX_SPLITS, tuning: TreeAttentionTuning = TreeAttentionTuning()):
    """Two launches whatever the tree. The verify step's form (tree_k None): decode_attention's
    partial and merge kernels under the tree's mask. A drafter's: the partial kernel over (B, nkv
    * score-row tiles, cache splits + candidate tiles) and the merge over (B*M, blocks of query
    heads). `bias` is the torch path's and is ignored; max_splits caps a drafter's cache splits
    (tests lower it so that one split loops over several tiles); `tuning`: the launch settings."""
    t = tuning
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, nh, M, d = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    N = tree_mask.shape[2]
    if nh % nkv or k_cache.shape[-1] != d or k_cache.shape[0] != B:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    rows = M - 1 if tree_k is None else M  # the block in the cache: the root has no mask row
    if tree_mask.shape != (B, rows, N) or (tree_k is None) != (tree_v is None):
        raise ValueError(f"mask {tuple(tree_mask.shape)} does not fit q {tuple(q.shape)} (or only one of tree k/v)")
    if tree_k is not None and (tree_k.shape != (B, nkv, N, d) or tree_v.shape != tree_k.shape):
        raise ValueError(f"tree k/v {tuple(tree_k.shape)} do not fit the mask's {N} nodes")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension, k and v one layout")
    if tree_k is None:  # the verify step's form: decode_attention's chunks, the mask read beside the keys
        return decode_attention_triton(q, k_cache, v_cache, base_positions, tree_mask=tree_mask,
                                       max_block_q=t.chunked_block_q, low_products=t.products_16bit,
                                       combine_heads=t.chunked_heads, merge_chunk=t.merge_split_chunk,
                                       max_chunks=t.chunked_max_chunks)
    tree_k, tree_v = tree_k.contiguous(), tree_v.contiguous()
    # bool pointers load as int1; a byte view is plainer and costs no launch
    mask = tree_mask.contiguous()
    mask = mask.view(torch.int8) if mask.dtype == torch.bool else mask
    base = base_positions.reshape(B).contiguous()
    out = torch.empty(B, M, nh * d, dtype=q.dtype, device=q.device)
    if not B * M:
        return out
    G = nh // nkv
    # score rows per program: up to 64 (a tree of 15 nodes times G = 4 heads is one tile), so few
    # variants compile; tl.dot needs inner sizes of at least 16: small heads and trees are padded
    block_q = min(t.max_block_q, max(16, triton.next_power_of_2(M * G)))
    low = t.products_16bit and q.dtype != torch.float32
    tiles = triton.cdiv(M * G, block_q)
    block_s, block_d = min(t.max_block_s, max(16, triton.next_power_of_2(S))), max(16, triton.next_power_of_2(d))
    block_n = min(MAX_TREE_TILE, max(16, triton.next_power_of_2(N)))
    tree_tiles = triton.cdiv(N, block_n) if N else 0
    # the cache split: as many splits as keep the GPU busy, each a whole number of key tiles
    # (and few enough that with the tree's tiles they fit 64 split slots: a power of two past 64
    # would double the merge's tile)
    splits = max(1, min(max_splits, MAX_SPLITS, 64 - tree_tiles, triton.cdiv(S, block_s),
                        triton.cdiv(t.target_programs, B * nkv * tiles)))
    span = block_s * triton.cdiv(triton.cdiv(S, splits), block_s)
    tree_split = triton.cdiv(S, span)  # the tree block's first split index, after the cache's
    block_splits = triton.next_power_of_2(tree_split + tree_tiles)
    # per (token, head, split) statistics, block_splits slots each (one power-of-two tile for the
    # merge); slots of splits past a row's base are never written nor read
    m = torch.empty(B * M * nh * block_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B * M * nh * block_splits, block_d, dtype=torch.float32, device=q.device)
    _tree_partial_kernel[(B, nkv * tiles, tree_split + tree_tiles)](
        q, k_cache, v_cache, base, tree_k, tree_v, mask, m, l, acc, M, N, G, nh, span, tree_split, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tree_k.stride(0), tree_k.stride(1), tree_k.stride(2), mask.stride(0), mask.stride(1),
        D=d, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_SPLITS=block_splits, BLOCK_Q=block_q,
        IEEE=q.dtype == torch.float32, LOW=low and not INTERPRETED, ROUND_P=low, num_warps=t.num_warps)
    block_h = min(t.combine_heads, triton.next_power_of_2(nh))
    _tree_combine_kernel[(B * M, triton.cdiv(nh, block_h))](base, m, l, acc, out, M, nh, span, tree_split,
                                                            tree_split + tree_tiles, out.stride(1), D=d, BLOCK_D=block_d,
                                                            BLOCK_SPLITS=block_splits, BLOCK_H=block_h,
                                                            SPLIT_CHUNK=min(block_splits, t.merge_split_chunk))
    return out


def tree_attention(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask, bias=None):
    """The kernel on CUDA tensors, the reference elsewhere; the kernel launched with the tuning of
    the kernel settings in effect (kernels/settings.py)."""
    if use_kernel(q):
        return tree_attention_triton(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask,
                                     tuning=active().tree_attention)
    return tree_attention_reference(q, k_cache, v_cache, base_positions, tree_k, tree_v, tree_mask, bias)
