"""The kernels of an EAGLE drafter's chain step against their torch references (on CPU through
TRITON_INTERPRET=1, set in conftest): the greedy head (norm, lm_head, argmax in two launches),
the two input norms in one, and the bookkeeping between verify and the next chain."""
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import kernel_device


@pytest.fixture
def dev():
    return kernel_device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,H,V", [(1, 576, 1000), (3, 70, 333), (17, 64, 129), (2, 576, 2100)])
@pytest.mark.parametrize("mapped", [False, True])
def test_norm_lm_head_argmax_matches_reference(dev, dtype, R, H, V, mapped):
    """Rows on both sides of a 16-row block, a hidden size that is no multiple of the tile, a
    vocabulary that is no multiple of the slice (2,100: 17 of the GPU's slices to merge; the real
    16,384 took 8-16 s a case in the interpreter); the output a strided column (a chain's)."""
    from draftsmith_kernels.lm_head_argmax import BLOCK_V, norm_lm_head_argmax_reference, norm_lm_head_argmax_triton
    from draftsmith_kernels.rms_norm import rms_norm_reference

    g = torch.Generator().manual_seed(R * H + V)
    hidden = (torch.randn(R, H, generator=g) * 3).to(dev, dtype)
    norm_weight = (torch.rand(H, generator=g) + 0.5).to(dev, dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dev, dtype)
    ids = torch.randperm(2 * V, generator=g)[:V].to(dev) if mapped else None
    want = norm_lm_head_argmax_reference(hidden, norm_weight, 1e-5, weight, torch.empty(R, dtype=torch.long,
                                                                                     device=dev), ids)
    buffer = torch.full((R, 3), -7, dtype=torch.long, device=dev)
    got = norm_lm_head_argmax_triton(hidden, norm_weight, 1e-5, weight, buffer[:, 1], ids, block_v=BLOCK_V)  # the GPU's
    assert (buffer[:, [0, 2]] == -7).all() and torch.equal(buffer[:, 1], got)
    if dtype == torch.float32:
        assert torch.equal(got, want)
        return
    # 16-bit logits tie often and only the summation order differs from a matmul: the chosen
    # column's logit is the largest, up to two rounding steps
    logits = F.linear(rms_norm_reference(hidden, norm_weight, 1e-5)[0], weight).float()
    column = got
    if ids is not None:  # back from target ids to lm_head rows
        inverse = torch.full((2 * V,), -1, dtype=torch.long, device=dev)
        inverse[ids] = torch.arange(V, device=dev)
        column = inverse[got]
    chosen = logits.gather(1, column[:, None])[:, 0]
    top = logits.max(1).values
    assert (chosen >= top - top.abs() * 2 ** -6).all(), (chosen, top)
    assert (got == want).float().mean() >= 0.5


def test_norm_lm_head_argmax_ties_go_to_the_lowest_column(dev):
    from draftsmith_kernels.lm_head_argmax import norm_lm_head_argmax_triton

    H, V = 64, 700
    weight = torch.zeros(V, H, device=dev)
    weight[[5, 300, 650], 0] = 1.0  # three columns tie (in different slices), the rest score 0
    hidden = torch.ones(2, H, device=dev)
    got = norm_lm_head_argmax_triton(hidden, torch.ones(H, device=dev), 1e-6, weight,
                                     torch.empty(2, dtype=torch.long, device=dev))
    assert got.tolist() == [5, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,H", [((1, 1), 576), ((3, 5), 70), ((2, 8), 64)])
def test_rms_norm_pair_matches_reference(dev, dtype, shape, H):
    from draftsmith_kernels.rms_norm import rms_norm_pair_reference, rms_norm_pair_triton

    g = torch.Generator().manual_seed(H)
    table = torch.randn(50, H, generator=g).to(dev, dtype)
    ids = torch.randint(0, 50, shape, generator=g).to(dev)
    x = (torch.randn(*shape, H, generator=g) * 4).to(dev, dtype)
    tw, xw = ((torch.rand(H, generator=g) + 0.5).to(dev, dtype) for _ in range(2))
    want = rms_norm_pair_reference(table, ids, tw, x, xw, 1e-6)
    got = rms_norm_pair_triton(table, ids, tw, x, xw, 1e-6)
    assert got.shape == (*shape, 2 * H) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_pair_gathers_a_trees_parents(dev, dtype):
    """A draft tree's level: each node's parent row of the last output (x_rows) is normalised
    and copied out (x_out, the residual), in the same launch; rows repeat and skip."""
    from draftsmith_kernels.rms_norm import gather_rows, rms_norm_pair_reference, rms_norm_pair_triton

    g = torch.Generator().manual_seed(7)
    B, F0, F, H = 2, 3, 5, 70
    table = torch.randn(50, H, generator=g).to(dev, dtype)
    ids = torch.randint(0, 50, (B, F), generator=g).to(dev)
    x = (torch.randn(B, F0, H, generator=g) * 4).to(dev, dtype)
    rows = torch.tensor([[2, 2, 0, 1, 2], [0, 0, 0, 2, 1]]).to(dev)
    tw, xw = ((torch.rand(H, generator=g) + 0.5).to(dev, dtype) for _ in range(2))
    out = torch.full((B, F, H), float("nan"), dtype=dtype, device=dev)
    got = rms_norm_pair_triton(table, ids, tw, x, xw, 1e-6, x_rows=rows, x_out=out)
    gathered = gather_rows(x, rows)
    assert torch.equal(out, gathered) and gathered[1, 3].equal(x[1, 2])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), rms_norm_pair_reference(table, ids, tw, gathered, xw, 1e-6).float(),
                               rtol=tol, atol=tol)
    ref_out = torch.empty_like(out)
    torch.testing.assert_close(rms_norm_pair_reference(table, ids, tw, x, xw, 1e-6, x_rows=rows, x_out=ref_out).float(),
                               got.float(), rtol=tol, atol=tol)
    assert torch.equal(ref_out, gathered)
    # x a view whose batch and row dimensions cannot merge (reshaped by a copy), and one whose
    # rows are two apart (reshaped as a view with that stride)
    wide = (torch.randn(B, 2 * F0 + 1, H, generator=g) * 4).to(dev, dtype)
    for view in (wide[:, :F0], wide[:, 1::2]):
        out = torch.empty(B, F, H, dtype=dtype, device=dev)
        got = rms_norm_pair_triton(table, ids, tw, view, xw, 1e-6, x_rows=rows, x_out=out)
        assert torch.equal(out, gather_rows(view, rows))
        torch.testing.assert_close(got.float(), rms_norm_pair_reference(table, ids, tw, view, xw, 1e-6,
                                                                        x_rows=rows).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("B,q,k,H", [(1, 1, 1, 8), (5, 5, 4, 70), (3, 8, 7, 576), (18, 6, 4, 1100)])  # H > one 1,024 block
def test_chain_bookkeeping_matches_reference(dev, B, q, k, H):
    """Every accepted count from 0 to q - 1, finished rows (inactive) keeping their state."""
    from draftsmith_kernels.chain_state import (advance_inputs_reference, advance_inputs_triton, keep_entry_reference,
                                     keep_entry_triton)

    g = torch.Generator().manual_seed(B * q + H)
    for trial in range(3):
        fed = torch.randint(0, 100, (B, q), generator=g).to(dev)
        bonus = torch.randint(100, 200, (B,), generator=g).to(dev)
        accepted = torch.randint(0, q, (B,), generator=g).to(dev)
        last = torch.randint(0, 50, (B,), generator=g).to(dev)
        want, got = advance_inputs_reference(fed, bonus, accepted, last), advance_inputs_triton(fed, bonus, accepted, last)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert (got[0].gather(1, accepted[:, None])[:, 0] == bonus).all()  # the bonus replaces the first rejected draft
        out = torch.randn(B, q, H, generator=g).to(dev)
        active = (torch.rand(B, generator=g) < 0.7).to(dev)
        state = [torch.randn(B, H, generator=g).to(dev), last.clone(), torch.full((B, k), -1, device=dev)]
        ref, mine = [t.clone() for t in state], [t.clone() for t in state]
        keep_entry_reference(out, want[1], accepted, active, *ref)
        keep_entry_triton(out, want[1], accepted, active, *mine)
        for a, b in zip(mine, ref):
            assert torch.equal(a, b), trial
        assert torch.equal(ref[0][~active], state[0][~active])  # finished rows keep their state



@pytest.mark.parametrize("N,K,swiglu,with_residual,dtype", [
    (960, 1152, False, False, torch.bfloat16),  # the EAGLE-3 drafter's q/k/v projection (2H -> (nh + 2 nkv) d)
    (576, 1536, True, True, torch.bfloat16),  # its down projection, the residual added
    (3072, 576, False, False, torch.float32),  # its gate_up projection: 16 rows a program
    (37, 70, True, True, torch.float32),  # ragged: a partial row block and a partial K block
    (5, 300, False, True, torch.float32),
    (37, 70, False, False, torch.bfloat16),
])
def test_gemv_matches_reference(dev, dtype, N, K, swiglu, with_residual):
    from draftsmith_kernels.gemv import gemv_reference, gemv_triton, swiglu_gemv_reference, swiglu_gemv_triton

    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, 1, 2 * K if swiglu else K, generator=g).to(dev, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev, dtype)
    res = torch.randn(1, 1, N, generator=g).to(dev, dtype) if with_residual else None
    run, ref = (swiglu_gemv_triton, swiglu_gemv_reference) if swiglu else (gemv_triton, gemv_reference)
    got = run(x, w, res)
    want = ref(x.float(), w.float(), None if res is None else res.float())
    assert got.shape == (1, 1, N) and got.dtype == dtype
    # float32: summation order only; bfloat16: one rounding of the output (the interpreter truncates)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    if swiglu and dtype == torch.bfloat16:  # the reference rounds silu and the product as the kernel does
        want = ref(x, w, res).float()
    torch.testing.assert_close(got.float(), want, **tol)


def test_gemv_adds_into_its_own_residual(dev):
    """out = residual: h += x @ W.T in place, as the chain's down projection writes it."""
    from draftsmith_kernels.gemv import swiglu_gemv_reference, swiglu_gemv_triton

    g = torch.Generator().manual_seed(0)
    gate_up, w = torch.randn(1, 2 * 96, generator=g).to(dev), torch.randn(64, 96, generator=g).to(dev)
    h = torch.randn(1, 64, generator=g).to(dev)
    want = swiglu_gemv_reference(gate_up, w, h.clone())
    out = swiglu_gemv_triton(gate_up, w, h, out=h)
    assert out.data_ptr() == h.data_ptr()
    torch.testing.assert_close(h, want, atol=1e-4, rtol=1e-4)


def test_gemv_refuses_more_than_one_row(dev):
    from draftsmith_kernels.gemv import gemv_triton

    with pytest.raises(ValueError, match="one row of 8"):
        gemv_triton(torch.randn(2, 8, device=dev), torch.randn(4, 8, device=dev))


def test_gemv_refuses_an_out_that_is_not_one_contiguous_row(dev):
    from draftsmith_kernels.gemv import gemv_triton

    x, w = torch.randn(1, 8, device=dev), torch.randn(6, 8, device=dev)
    for out in (torch.empty(1, 5, device=dev), torch.empty(6, 2, device=dev)[:, 0]):
        with pytest.raises(ValueError, match="out must be one contiguous row of 6"):
            gemv_triton(x, w, out=out)
