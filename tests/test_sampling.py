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


class _FixedDrafts:
    """A proposer that always drafts the same tokens (no probabilities)."""

    aux_layers = ()

    def __init__(self, drafts):
        self.k, self.drafts = len(drafts), drafts

    def begin(self, *a):
        pass

    def propose(self, tokens):
        return [list(self.drafts) for _ in tokens]

    def accepted(self, *a):
        pass


@pytest.mark.parametrize("drafts", [[], [3, 5], [3, NO_DRAFT]])
def test_engine_sampling_follows_the_target_distribution(tmp_path, drafts):
    """End to end through the engine on an 8-token vocabulary: the first two sampled tokens
    follow softmax(logits / T), with or without drafts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.engine import generate
    from inference.model import RuntimeModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)  # spread the distribution so that acceptance matters
    hf.save_pretrained(tmp_path)
    rt = RuntimeModel.from_pretrained(tmp_path)
    prompt, T, N = [1, 2, 3, 4], 0.8, 20_000
    proposer = _FixedDrafts(drafts) if drafts else None
    outs, _ = generate(rt, [prompt] * N, 2, proposer=proposer, temperature=T, generator=torch.Generator().manual_seed(1))
    first = torch.tensor([o[0] for o in outs])
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / T, -1)
    assert chi_square_p(torch.bincount(first, minlength=8), p1) > 0.01
    mode = int(torch.bincount(first).argmax())
    second = torch.tensor([o[1] for o in outs if o[0] == mode])
    with torch.no_grad():
        p2 = torch.softmax(hf(torch.tensor([prompt + [mode]])).logits[0, -1] / T, -1)
    assert chi_square_p(torch.bincount(second, minlength=8), p2) > 0.01
