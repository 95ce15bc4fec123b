"""kernels/lm_head_topk.py (a tree's head: norm, lm_head, log-softmax, top-k in two launches)
against its torch reference, on CPU through TRITON_INTERPRET=1: rows on both sides of a
16-row block, hidden sizes and vocabularies that are no multiple of their tiles, a last slice
with fewer columns than k, ties across slices, NaN logits."""
import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith_kernels.lm_head_topk import log_softmax_topk_reference, norm_lm_head_topk_reference, norm_lm_head_topk_triton
from draftsmith_kernels.rms_norm import rms_norm_reference
from tests.conftest import kernel_device


@pytest.fixture
def dev():
    return kernel_device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,H,V,k", [((1,), 576, 1000, 4), ((3,), 70, 333, 7), ((17,), 64, 129, 7),
                                        ((2, 3), 64, 200, 1), ((2,), 576, 4100, 8)])
def test_norm_lm_head_topk_matches_reference(dev, dtype, lead, H, V, k):
    g = torch.Generator().manual_seed(H * V + k)
    hidden = (torch.randn(*lead, H, generator=g) * 3).to(dev, dtype)
    norm_weight = (torch.rand(H, generator=g) + 0.5).to(dev, dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dev, dtype)
    want_values, want_indices = norm_lm_head_topk_reference(hidden, norm_weight, 1e-5, weight, k)
    values, indices = norm_lm_head_topk_triton(hidden, norm_weight, 1e-5, weight, k, block_v=128)  # the GPU's slices
    assert values.shape == indices.shape == (*lead, k) and values.dtype == torch.float32
    assert indices.dtype == torch.long and int(indices.min()) >= 0 and int(indices.max()) < V
    assert (indices.unsqueeze(-1) == indices.unsqueeze(-2)).sum(-1).eq(1).all()  # k different rows
    assert (values[..., 1:] <= values[..., :-1]).all()  # best first
    if dtype == torch.float32:
        assert torch.equal(indices, want_indices)
        torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
        return
    # 16-bit logits tie often and only the summation order differs from a matmul: each rank's
    # logit is the reference's at that rank up to two rounding steps, its log-probability too
    logits = F.linear(rms_norm_reference(hidden, norm_weight, 1e-5)[0], weight).float()
    chosen = logits.gather(-1, indices)
    top = logits.topk(k, dim=-1).values
    assert (chosen - top).abs().le(top.abs() * 2 ** -6 + 1e-3).all(), (chosen, top)
    torch.testing.assert_close(values, torch.log_softmax(logits, -1).gather(-1, indices), rtol=0, atol=5e-2)
    assert (indices == want_indices).all(-1).float().mean() >= 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_lowest_row_across_slices(dev, dtype):
    """Three rows tie for the best logit in three different 128-row slices; the rest tie at 0."""
    H, V = 64, 700
    weight = torch.zeros(V, H, device=dev, dtype=dtype)
    weight[[650, 300, 5], 0] = 8.0
    hidden = torch.ones(2, H, device=dev, dtype=dtype)
    values, indices = norm_lm_head_topk_triton(hidden, torch.ones(H, device=dev, dtype=dtype), 1e-6, weight, 5,
                                               block_v=128)
    assert indices.tolist() == [[5, 300, 650, 0, 1]] * 2
    best = float(F.linear(rms_norm_reference(hidden, torch.ones_like(hidden[0]), 1e-6)[0], weight)[0, 5])
    lse = math.log(3 * math.exp(best) + (V - 3))  # (8, unless the norm's bf16 rounding moves it a step)
    torch.testing.assert_close(values[0], torch.tensor([best - lse] * 3 + [-lse] * 2, device=dev),
                               **({} if dtype == torch.float32 else dict(rtol=0, atol=0.05)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_logit_is_never_chosen_before_a_number(dev, dtype):
    H, V = 16, 300
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(V, H, generator=g).to(dev, dtype)
    weight[[2, 140]] = float("nan")  # rows 2 and 140 give NaN logits
    hidden = torch.randn(3, H, generator=g).to(dev, dtype)
    ones = torch.ones(H, device=dev, dtype=dtype)
    values, indices = norm_lm_head_topk_triton(hidden, ones, 1e-6, weight, 6, block_v=128)
    want_values, want_indices = norm_lm_head_topk_reference(hidden, ones, 1e-6, weight, 6)
    assert not torch.isin(indices, torch.tensor([2, 140], device=dev)).any() and torch.isfinite(values).all()
    if dtype == torch.float32:
        assert torch.equal(indices, want_indices)
        torch.testing.assert_close(values, want_values)


def test_the_reference_breaks_ties_by_the_lowest_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, float("nan")]])
    values, indices = log_softmax_topk_reference(logits, 4)
    assert indices.tolist() == [[1, 3, 4, 2]]
    torch.testing.assert_close(values, torch.log_softmax(logits.nan_to_num(nan=-math.inf), -1)[:, [1, 3, 4, 2]])


def test_k_out_of_range_is_refused(dev):
    weight = torch.randn(10, 8, device=dev)
    for k in (0, 11):
        with pytest.raises(ValueError, match=f"k={k}"):
            norm_lm_head_topk_triton(torch.randn(1, 8, device=dev), torch.ones(8, device=dev), 1e-6, weight, k)
