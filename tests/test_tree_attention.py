"""The tree-attention kernel against its torch reference (on CPU through TRITON_INTERPRET=1,
set in conftest), over odd shapes, GQA and each dtype, with the tree block apart (a drafter's
candidates) and in the cache after the root (the target's verify step); small shapes keep the
interpreter fast."""
import os

import pytest
import torch

from inference.tree.ops import ancestor_mask
from draftsmith_kernels.settings import TreeAttentionTuning
from draftsmith_kernels.tree_attention import tree_attention_reference, tree_attention_triton, with_root_row

needs_triton_backend = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs CUDA or TRITON_INTERPRET=1")


def random_parents(B, N, g):
    """[B,N] a random tree per row, parents before children (-1: a child of the root)."""
    parents = torch.full((B, N), -1, dtype=torch.long)
    for i in range(1, N):
        parents[:, i] = torch.randint(-1, i, (B,), generator=g)
    return parents


def operands(B, N, S, nh, nkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(B, nh, N, d, generator=g).to(device, dtype)
    k_cache, v_cache = (torch.randn(B, nkv, S, d, generator=g).to(device, dtype) for _ in range(2))
    tree_k, tree_v = (torch.randn(B, nkv, N, d, generator=g).to(device, dtype) for _ in range(2))
    # ragged rows: the first sees one cache key, the last the whole cache
    base = torch.randint(0, S, (B,), generator=g)
    base[0], base[-1] = 0, S - 1
    mask = ancestor_mask(random_parents(B, N, g)).to(device)
    return q, k_cache, v_cache, base.to(device), tree_k, tree_v, mask


def verify_operands(B, N, S, nh, nkv, d, dtype, seed):
    """A verify step's operands: q for the root and its N nodes [B,nh,N+1,d], the nodes' K/V
    written into the cache at base + 1 + j, the nodes' mask [B,N,N] (the root, query 0, has no
    row). Rows range from base 0 to the block ending at the last slot. Also returns the block
    apart."""
    q, k_cache, v_cache, _, tree_k, tree_v, mask = operands(B, N, S, nh, nkv, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.cat([torch.randn(B, nh, 1, d, generator=g).to(q.device, dtype), q], 2)
    base = torch.randint(0, S - N, (B,), generator=g).to(q.device)
    base[0], base[-1] = 0, S - 1 - N
    for b in range(B):
        k_cache[b, :, base[b] + 1: base[b] + 1 + N] = tree_k[b]
        v_cache[b, :, base[b] + 1: base[b] + 1 + N] = tree_v[b]
    return q, k_cache, v_cache, base, tree_k, tree_v, mask


SHAPES = [(1, 1, 7, 4, 4, 64), (3, 5, 37, 9, 3, 48), (3, 13, 71, 4, 4, 48), (1, 13, 19, 9, 3, 64),
          (2, 22, 150, 6, 2, 64)]  # the last: 5 cache chunks, 69 score rows (two tiles)
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("B,N,S,nh,nkv,d", SHAPES)
def test_tree_attention_kernel_matches_reference(dtype, tol, B, N, S, nh, nkv, d):
    args = operands(B, N, S, nh, nkv, d, dtype, seed=B * 100 + N * 10 + d)
    ref = tree_attention_reference(*args)
    got = tree_attention_triton(*args)
    assert got.shape == ref.shape == (B, N, nh * d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("B,N,S,nh,nkv,d", SHAPES)
def test_tree_block_read_from_the_cache_matches_reference(dtype, tol, B, N, S, nh, nkv, d):
    """The verify step's form (block in the cache, root first) against its reference, and that
    reference against the form with the block apart (same keys, same masks)."""
    q, k_cache, v_cache, base, tree_k, tree_v, mask = verify_operands(B, N, S, nh, nkv, d, dtype, seed=N + d)
    ref = tree_attention_reference(q, k_cache, v_cache, base, None, None, mask)
    got = tree_attention_triton(q, k_cache, v_cache, base, None, None, mask)
    assert got.shape == ref.shape == (B, N + 1, nh * d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        apart = tree_attention_reference(q, k_cache, v_cache, base, tree_k, tree_v, with_root_row(mask))
        torch.testing.assert_close(ref, apart, rtol=1e-5, atol=1e-5)


@needs_triton_backend
@pytest.mark.parametrize("max_splits", [1, 2])
@pytest.mark.parametrize("B,N,S,nh,nkv,d", [(3, 5, 150, 9, 3, 48), (2, 22, 150, 6, 2, 64)])
def test_a_split_that_loops_over_several_key_tiles_matches_reference(max_splits, B, N, S, nh, nkv, d):
    """A drafter's form with few splits of a long cache: each program runs its online softmax
    over several tiles."""
    args = operands(B, N, S, nh, nkv, d, torch.float32, seed=N)
    got = tree_attention_triton(*args, max_splits=max_splits)
    torch.testing.assert_close(got, tree_attention_reference(*args), rtol=1e-5, atol=1e-5)


@needs_triton_backend
@pytest.mark.parametrize("block_q,heads,max_chunks,merge_chunk,dtype", [
    (16, 16, 64, 16, torch.float32), (32, 4, 64, 4, torch.bfloat16), (64, 1, 2, 4, torch.float32),
    (16, 2, 64, 4, torch.bfloat16)])
def test_the_verify_forms_chunks_and_merges_match_reference(block_q, heads, max_chunks, merge_chunk, dtype):
    """The verify step through decode_attention's chunks, at each of its knobs: score rows a
    program, query heads a merge program (9 heads: blocks of 4, 4 and 1, 2 ... and 1, or 16 with
    7 idle), the cache cut into 7 chunks of 32 (200 slots) or 2 of 128, merged 4 or 16 at a time
    (so the merge's online softmax runs over two rounds): a tree of 40 nodes spanning two or
    three chunks, rows from base 0 to the block ending at the last slot."""
    tuning = TreeAttentionTuning(chunked_block_q=block_q, chunked_heads=heads, chunked_max_chunks=max_chunks,
                                 merge_split_chunk=merge_chunk)
    q, k_cache, v_cache, base, _, _, mask = verify_operands(2, 40, 200, 9, 3, 64, dtype, seed=block_q + heads)
    ref = tree_attention_reference(q, k_cache, v_cache, base, None, None, mask)
    got = tree_attention_triton(q, k_cache, v_cache, base, None, None, mask, tuning=tuning)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("B,N,M,S,nh,nkv,d", [(2, 150, 8, 37, 9, 3, 64), (1, 264, 8, 19, 9, 3, 64), (3, 70, 5, 71, 4, 4, 48)])
def test_a_drafters_candidate_buffer_of_several_tiles_matches_reference(dtype, tol, B, N, M, S, nh, nkv, d):
    """A drafter's tree level: the frontier's M queries over a candidate buffer of N > 64 nodes
    (tiles of 64 in parallel splits), each seeing its ancestors: the last frontier node of the
    first row sees nodes of every tile, and nodes past those drafted so far stay zero."""
    q, k_cache, v_cache, base, tree_k, tree_v, _ = operands(B, N, S, nh, nkv, d, dtype, seed=N + M)
    g = torch.Generator().manual_seed(N)
    parents = random_parents(B, N, g)
    drafted = N - 3  # the last 3 candidates not drafted yet: never visible
    # the first row's last drafted node: a path through every tile (2 -> 65 [-> 130] -> it)
    path = [2, 65] + ([130] if N > 131 else []) + [drafted - 1]
    for parent, child in zip(path, path[1:]):
        parents[0, child] = parent
    tree_k[:, :, drafted:] = 0
    tree_v[:, :, drafted:] = 0
    frontier = torch.arange(drafted - M, drafted)
    mask = ancestor_mask(parents).to(q.device)[:, frontier]  # [B,M,N]
    assert bool(mask[0, -1, :64].any()) and bool(mask[0, -1, 64:128].any()) and not mask[:, :, drafted:].any()
    q = q[:, :, :M].contiguous()
    ref = tree_attention_reference(q, k_cache, v_cache, base, tree_k, tree_v, mask)
    got = tree_attention_triton(q, k_cache, v_cache, base, tree_k, tree_v, mask)
    assert got.shape == ref.shape == (B, M, nh * d)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_triton_backend
def test_a_verify_block_of_several_tiles_matches_reference():
    """The target's verify step over a tree of 70 nodes (two tiles read from the cache)."""
    q, k_cache, v_cache, base, _, _, mask = verify_operands(2, 70, 150, 9, 3, 64, torch.float32, seed=70)
    ref = tree_attention_reference(q, k_cache, v_cache, base, None, None, mask)
    got = tree_attention_triton(q, k_cache, v_cache, base, None, None, mask)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_triton_backend
def test_unseen_keys_are_never_read():
    """Cache keys past the row's base (past its tree block, when the block is in the cache):
    poisoning them with NaN changes nothing. Tree keys outside a query's mask row are read by the
    tile its query shares with others, but weigh exactly 0: any finite values change nothing."""
    q, k_cache, v_cache, base, tree_k, tree_v, mask = operands(3, 5, 37, 9, 3, 48, torch.float32, seed=7)
    got = tree_attention_triton(q, k_cache, v_cache, base, tree_k, tree_v, mask)
    beyond = torch.arange(37, device=base.device)[None, :] > base[:, None]  # [B,S]
    k2, v2 = k_cache.clone(), v_cache.clone()
    k2.transpose(1, 2)[beyond] = float("nan")
    v2.transpose(1, 2)[beyond] = float("nan")
    assert torch.equal(tree_attention_triton(q, k2, v2, base, tree_k, tree_v, mask), got)
    # with a mask where each node sees only itself, node 0 ignores every other tree key
    solo = torch.eye(5, dtype=torch.bool, device=mask.device).expand(3, 5, 5)
    ref = tree_attention_triton(q, k_cache, v_cache, base, tree_k, tree_v, solo)
    tk2, tv2 = tree_k.clone(), tree_v.clone()
    tk2[:, :, 1:], tv2[:, :, 1:] = 1e3 * torch.randn_like(tk2[:, :, 1:]), 1e3 * torch.randn_like(tv2[:, :, 1:])
    out = tree_attention_triton(q, k_cache, v_cache, base, tk2, tv2, solo)
    assert torch.equal(out[:, 0], ref[:, 0])

    # the block in the cache: NaN past it; the root sees none of it; node 0 (query 1) only itself
    q, k_cache, v_cache, base, _, _, mask = verify_operands(3, 5, 37, 9, 3, 48, torch.float32, seed=8)
    solo = torch.eye(5, dtype=torch.bool, device=mask.device).expand(3, 5, 5)
    got = tree_attention_triton(q, k_cache, v_cache, base, None, None, solo)
    slots = torch.arange(37, device=base.device)[None, :]
    k2, v2 = k_cache.clone(), v_cache.clone()
    k2.transpose(1, 2)[slots > base[:, None] + 5] = float("nan")
    v2.transpose(1, 2)[slots > base[:, None] + 5] = float("nan")
    others = (slots > base[:, None] + 1) & (slots <= base[:, None] + 5)  # nodes 1..4
    k2.transpose(1, 2)[others] = 1e3 * torch.randn_like(k2.transpose(1, 2)[others])
    v2.transpose(1, 2)[others] = 1e3 * torch.randn_like(v2.transpose(1, 2)[others])
    out = tree_attention_triton(q, k2, v2, base, None, None, solo)
    assert torch.equal(out[:, :2], got[:, :2])


def test_reference_equals_plain_attention_over_the_path():
    """The reference is real attention: a query on a chain sees exactly the prefix + its path,
    as a causal forward over those tokens would."""
    B, N, S, nh, d = 1, 3, 6, 2, 8
    q, k_cache, v_cache, _, tree_k, tree_v, _ = operands(B, N, S, nh, nh, d, torch.float32, seed=3)
    base = torch.tensor([3], device=q.device)  # (a GPU run puts the operands on the GPU)
    parents = torch.tensor([[-1, -1, 0]])  # node 2 under node 0; node 1 is a sibling of node 0
    out = tree_attention_reference(q, k_cache, v_cache, base, tree_k, tree_v, ancestor_mask(parents).to(q.device))
    keys = torch.cat([k_cache[:, :, :4], tree_k[:, :, [0, 2]]], 2)
    values = torch.cat([v_cache[:, :, :4], tree_v[:, :, [0, 2]]], 2)
    att = torch.softmax(q[:, :, 2:3] @ keys.transpose(-1, -2) / d ** 0.5, -1) @ values  # [B,nh,1,d]
    torch.testing.assert_close(out[:, 2], att[:, :, 0].reshape(B, nh * d))


@needs_triton_backend
@pytest.mark.parametrize("max_block_q,products_16bit,target_programs,max_block_s,num_warps,combine_heads",
                         [(16, False, 512, 64, 4, 1), (32, True, 16, 32, 2, 4), (16, True, 2048, 32, 4, 16),
                          (64, False, 512, 128, 8, 2)])
def test_the_tuning_variants_match_reference(max_block_q, products_16bit, target_programs, max_block_s, num_warps,
                                             combine_heads):
    """scripts/bench_attention.py's variants of the drafter's form (score rows per program,
    16-bit products, cache splits coarse and fine, key tiles, warps, query heads a merge program
    takes) compute the same attention: 40 queries over a ragged cache and 40 candidates (9 heads:
    merge programs of 4, 4 and 1, or one of 16 with 7 idle), and 22 over 22 (6 heads). (150 slots
    in tiles of 32 make 5 splits at most: 16 programs leave one split looping over every tile,
    2,048 one tile a split.)"""
    tuning = TreeAttentionTuning(max_block_q=max_block_q, products_16bit=products_16bit,
                                 target_programs=target_programs, max_block_s=max_block_s, num_warps=num_warps,
                                 combine_heads=combine_heads)
    for args in (operands(2, 40, 150, 9, 3, 64, torch.bfloat16, seed=3), operands(2, 22, 150, 6, 2, 64, torch.bfloat16,
                                                                               seed=4)):
        torch.testing.assert_close(tree_attention_triton(*args, tuning=tuning).float(),
                                   tree_attention_reference(*args).float(), rtol=2e-2, atol=2e-2)


def test_tuning_from_a_setting_line():
    """`--tree-attention`'s form: named settings over the defaults, and `spec` writes a line that
    parses back to the same tuning; an unknown name or a value out of range is an error naming it."""
    tuning = TreeAttentionTuning.parse("max_block_s=32, num_warps=2,products_16bit=1")
    assert tuning == TreeAttentionTuning(max_block_s=32, num_warps=2, products_16bit=True)
    assert TreeAttentionTuning.parse(tuning.spec()) == tuning and "max_block_s=32" in tuning.spec()
    assert TreeAttentionTuning.parse("") == TreeAttentionTuning()
    for bad, named in [("num_warps=3", "num_warps=3"), ("block_q=16", "'block_q'"),
                       ("max_block_q=64,target_programs=0", "target_programs"),
                       ("products_16bit=True", "products_16bit"), ("products_16bit=2", "products_16bit"),
                       ("max_block_s", "max_block_s")]:
        with pytest.raises(ValueError, match=named):
            TreeAttentionTuning.parse(bad)


def test_the_dispatcher_launches_with_the_tuning_in_effect(monkeypatch):
    """The kernel settings applied by the caller reach the launcher: the tree-attention dispatcher
    passes their tuning, and runs the reference when the mode is off."""
    import draftsmith_kernels.tree_attention as ta
    from draftsmith_kernels.settings import KernelSettings, applied

    seen = []
    monkeypatch.setattr(ta, "tree_attention_triton", lambda *a, tuning, **kw: seen.append(tuning) or "kernel")
    q, k_cache, v_cache, base, _, _, mask = verify_operands(1, 3, 20, 2, 1, 16, torch.float32, seed=0)
    chosen = KernelSettings(mode="force", tree_attention=TreeAttentionTuning(max_block_q=32))
    with applied(chosen):
        assert ta.tree_attention(q, k_cache, v_cache, base, None, None, mask) == "kernel"
    assert seen == [chosen.tree_attention]
    with applied(KernelSettings(mode="off")):
        out = ta.tree_attention(q, k_cache, v_cache, base, None, None, mask)
    torch.testing.assert_close(out, tree_attention_reference(q, k_cache, v_cache, base, None, None, mask))
    assert len(seen) == 1


@needs_triton_backend
@pytest.mark.parametrize("chunk", [16, 4])
def test_a_long_cache_split_finely_is_merged_chunk_by_chunk(chunk):
    """Far more cache splits than a merge program sums at once (44 splits of 16 keys and the
    tree's tile: 64 split slots, walked MERGE_SPLIT_CHUNK at a time, as a 4,096-slot cache's are
    on a GPU): the same attention as the reference in float32, to 1e-5, for a row whose base
    reaches the cache's end (its splits fill the first three chunks of 16, the tree's tile
    included) and one at base 0 (the first split and the tree's tile alone)."""
    tuning = TreeAttentionTuning(max_block_s=16, target_programs=1 << 16, merge_split_chunk=chunk)
    q, k_cache, v_cache, base, _, _, mask = verify_operands(2, 5, 700, 9, 3, 64, torch.float32, seed=11)
    ref = tree_attention_reference(q, k_cache, v_cache, base, None, None, mask)
    got = tree_attention_triton(q, k_cache, v_cache, base, None, None, mask, tuning=tuning)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
