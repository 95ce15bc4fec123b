"""The tree-attention kernel against its torch reference (on CPU through TRITON_INTERPRET=1,
set in conftest), over odd shapes, GQA and each dtype; small shapes keep the interpreter fast."""
import os

import pytest
import torch

from inference.tree import ancestor_mask
from kernels.tree_attention import tree_attention_reference, tree_attention_triton

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


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B,N,S,nh,nkv,d", [(1, 1, 7, 4, 4, 64), (3, 5, 37, 9, 3, 48), (3, 13, 71, 4, 4, 48),
                                            (1, 13, 19, 9, 3, 64)])
def test_tree_attention_kernel_matches_reference(dtype, tol, B, N, S, nh, nkv, d):
    args = operands(B, N, S, nh, nkv, d, dtype, seed=B * 100 + N * 10 + d)
    ref = tree_attention_reference(*args)
    got = tree_attention_triton(*args)
    assert got.shape == ref.shape == (B, N, nh * d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_triton_backend
def test_unseen_keys_are_never_read():
    """Cache keys past the row's base and tree keys outside the mask row: poisoning them with
    NaN changes nothing."""
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
    tk2[:, :, 1:], tv2[:, :, 1:] = float("nan"), float("nan")
    out = tree_attention_triton(q, k_cache, v_cache, base, tk2, tv2, solo)
    assert torch.equal(out[:, 0], ref[:, 0])


def test_reference_equals_plain_attention_over_the_path():
    """The reference is real attention: a query on a chain sees exactly the prefix + its path,
    as a causal forward over those tokens would."""
    B, N, S, nh, d = 1, 3, 6, 2, 8
    q, k_cache, v_cache, _, tree_k, tree_v, _ = operands(B, N, S, nh, nh, d, torch.float32, seed=3)
    base = torch.tensor([3])
    parents = torch.tensor([[-1, -1, 0]])  # node 2 under node 0; node 1 is a sibling of node 0
    out = tree_attention_reference(q, k_cache, v_cache, base, tree_k, tree_v, ancestor_mask(parents))
    keys = torch.cat([k_cache[:, :, :4], tree_k[:, :, [0, 2]]], 2)
    values = torch.cat([v_cache[:, :, :4], tree_v[:, :, [0, 2]]], 2)
    att = torch.softmax(q[:, :, 2:3] @ keys.transpose(-1, -2) / d ** 0.5, -1) @ values  # [B,nh,1,d]
    torch.testing.assert_close(out[:, 2], att[:, :, 0].reshape(B, nh * d))
