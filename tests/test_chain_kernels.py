"""The kernels of an EAGLE drafter's chain step against their torch references (on CPU through
TRITON_INTERPRET=1, set in conftest): the greedy head (norm, lm_head, argmax in two launches),
the two input norms in one, and the bookkeeping between verify and the next chain."""
import os

import pytest
import torch
import torch.nn.functional as F

needs_triton_backend = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,H,V", [(1, 576, 1000), (3, 70, 333), (17, 64, 129), (2, 576, 16384)])
@pytest.mark.parametrize("mapped", [False, True])
def test_norm_lm_head_argmax_matches_reference(dtype, R, H, V, mapped):
    """Rows on both sides of a 16-row block, a hidden size that is no multiple of the tile, a
    vocabulary that is no multiple of the slice; the output a strided column (a chain's)."""
    from kernels.lm_head_argmax import norm_lm_head_argmax_reference, norm_lm_head_argmax_triton
    from kernels.rms_norm import rms_norm_reference

    g = torch.Generator().manual_seed(R * H + V)
    hidden = (torch.randn(R, H, generator=g) * 3).to(DEVICE, dtype)
    norm_weight = (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(DEVICE, dtype)
    ids = torch.randperm(2 * V, generator=g)[:V].to(DEVICE) if mapped else None
    want = norm_lm_head_argmax_reference(hidden, norm_weight, 1e-5, weight, torch.empty(R, dtype=torch.long,
                                                                                     device=DEVICE), ids)
    buffer = torch.full((R, 3), -7, dtype=torch.long, device=DEVICE)
    got = norm_lm_head_argmax_triton(hidden, norm_weight, 1e-5, weight, buffer[:, 1], ids)
    assert (buffer[:, [0, 2]] == -7).all() and torch.equal(buffer[:, 1], got)
    if dtype == torch.float32:
        assert torch.equal(got, want)
        return
    # 16-bit logits tie often and only the summation order differs from a matmul: the chosen
    # column's logit is the largest, up to two rounding steps
    logits = F.linear(rms_norm_reference(hidden, norm_weight, 1e-5)[0], weight).float()
    column = got
    if ids is not None:  # back from target ids to lm_head rows
        inverse = torch.full((2 * V,), -1, dtype=torch.long, device=DEVICE)
        inverse[ids] = torch.arange(V, device=DEVICE)
        column = inverse[got]
    chosen = logits.gather(1, column[:, None])[:, 0]
    top = logits.max(1).values
    assert (chosen >= top - top.abs() * 2 ** -6).all(), (chosen, top)
    assert (got == want).float().mean() >= 0.5


@needs_triton_backend
def test_norm_lm_head_argmax_ties_go_to_the_lowest_column():
    from kernels.lm_head_argmax import norm_lm_head_argmax_triton

    H, V = 64, 700
    weight = torch.zeros(V, H, device=DEVICE)
    weight[[5, 300, 650], 0] = 1.0  # three columns tie (in different slices), the rest score 0
    hidden = torch.ones(2, H, device=DEVICE)
    got = norm_lm_head_argmax_triton(hidden, torch.ones(H, device=DEVICE), 1e-6, weight,
                                     torch.empty(2, dtype=torch.long, device=DEVICE))
    assert got.tolist() == [5, 5]


@needs_triton_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,H", [((1, 1), 576), ((3, 5), 70), ((2, 8), 64)])
def test_rms_norm_pair_matches_reference(dtype, shape, H):
    from kernels.rms_norm import rms_norm_pair_reference, rms_norm_pair_triton

    g = torch.Generator().manual_seed(H)
    table = torch.randn(50, H, generator=g).to(DEVICE, dtype)
    ids = torch.randint(0, 50, shape, generator=g).to(DEVICE)
    x = (torch.randn(*shape, H, generator=g) * 4).to(DEVICE, dtype)
    tw, xw = ((torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    want = rms_norm_pair_reference(table, ids, tw, x, xw, 1e-6)
    got = rms_norm_pair_triton(table, ids, tw, x, xw, 1e-6)
    assert got.shape == (*shape, 2 * H) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_triton_backend
@pytest.mark.parametrize("B,q,k,H", [(1, 1, 1, 8), (5, 5, 4, 70), (3, 8, 7, 576)])
def test_chain_bookkeeping_matches_reference(B, q, k, H):
    """Every accepted count from 0 to q - 1, finished rows (inactive) keeping their state."""
    from kernels.chain_state import (advance_inputs_reference, advance_inputs_triton, keep_entry_reference,
                                     keep_entry_triton)

    g = torch.Generator().manual_seed(B * q + H)
    for trial in range(3):
        fed = torch.randint(0, 100, (B, q), generator=g).to(DEVICE)
        bonus = torch.randint(100, 200, (B,), generator=g).to(DEVICE)
        accepted = torch.randint(0, q, (B,), generator=g).to(DEVICE)
        last = torch.randint(0, 50, (B,), generator=g).to(DEVICE)
        want, got = advance_inputs_reference(fed, bonus, accepted, last), advance_inputs_triton(fed, bonus, accepted, last)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert (want[0].gather(1, accepted[:, None])[:, 0] == bonus).all()
        out = torch.randn(B, q, H, generator=g).to(DEVICE)
        active = (torch.rand(B, generator=g) < 0.7).to(DEVICE)
        state = [torch.randn(B, H, generator=g).to(DEVICE), last.clone(), torch.full((B, k), -1, device=DEVICE)]
        ref, mine = [t.clone() for t in state], [t.clone() for t in state]
        keep_entry_reference(out, want[1], accepted, active, *ref)
        keep_entry_triton(out, want[1], accepted, active, *mine)
        for a, b in zip(mine, ref):
            assert torch.equal(a, b), trial
        assert torch.equal(ref[0][~active], state[0][~active])  # finished rows keep their state


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])  # 16 bits: a few roundings of ~1
@pytest.mark.parametrize("R,H,I", [(1, 576, 1536), (5, 70, 100), (17, 40, 64)])
def test_swiglu_down_matches_reference(dtype, tol, R, H, I):
    """The gate and the down projection added into h in place, over rows on both sides of a
    16-row block and sizes that are no multiple of the tiles."""
    from kernels.silu_mul import swiglu_down_reference, swiglu_down_triton

    g = torch.Generator().manual_seed(R * H + I)
    gate_up = (torch.randn(R, 2 * I, generator=g) * 2).to(DEVICE, dtype)
    weight = (torch.randn(H, I, generator=g) / I ** 0.5).to(DEVICE, dtype)
    h = torch.randn(R, H, generator=g).to(DEVICE, dtype)
    want, got = h.clone(), h.clone()
    swiglu_down_reference(gate_up, weight, want)
    assert swiglu_down_triton(gate_up, weight, got) is got
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
