"""Rejection sampling reproduces the target's distribution (chi-square, 100,000+ draws)."""
import pytest
import torch

from inference.verify import NO_DRAFT, rejection_verify


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs.double() * n
    keep = expected > 0
    stat = ((counts.double()[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _setup(V=6, k=3, seed=0, deterministic_drafts=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)  # target, per position
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)  # draft model, per position
    return p, q, g


@pytest.mark.parametrize("with_q", [True, False])
def test_first_token_follows_the_target(with_q):
    V, k, N = 6, 3, 200_000
    p, q, g = _setup(V, k)
    if with_q:
        drafts = torch.multinomial(q, N, replacement=True, generator=g).T  # [N,k], d_i ~ q_i
        draft_probs = q.expand(N, k, V)
    else:
        # a proposer without probabilities (say n-gram) always drafts the same tokens
        drafts = p[:k].argmax(-1).expand(N, k)
        draft_probs = None
    accepted, nxt = rejection_verify(drafts, draft_probs, p.expand(N, k + 1, V), generator=g)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    assert chi_square_p(torch.bincount(first, minlength=V), p[0]) > 0.01
    # the second emitted token, given the first draft was accepted, follows p_1
    second = torch.where(accepted > 1, drafts[:, 1], nxt)[accepted > 0]
    assert second.numel() > 10_000
    assert chi_square_p(torch.bincount(second, minlength=V), p[1]) > 0.01


def test_a_wrong_distribution_is_detected():
    """The test has power: sampling from q instead of p fails it."""
    p, q, g = _setup()
    draws = torch.multinomial(q[0], 100_000, replacement=True, generator=g)
    assert chi_square_p(torch.bincount(draws, minlength=6), p[0]) < 1e-6


def test_acceptance_rate_matches_theory_and_empty_slots_reject():
    V, k, N = 6, 1, 100_000
    p, q, g = _setup(V, k, seed=2)
    drafts = torch.multinomial(q[:1], N, replacement=True, generator=g).T
    accepted, _ = rejection_verify(drafts, q.expand(N, k, V), p.expand(N, k + 1, V), generator=g)
    expect = torch.minimum(p[0], q[0]).sum()  # P(accept) = sum_x min(p, q)
    assert abs(accepted.float().mean() - expect) < 0.01
    acc, _ = rejection_verify(torch.full((4, 2), NO_DRAFT), None, torch.softmax(torch.randn(4, 3, 5), -1))
    assert acc.tolist() == [0, 0, 0, 0]
