"""Rejection sampling reproduces the target's distribution (chi-square, 100,000+ draws)."""
import pytest
import torch

from inference.runtime.verify import NO_DRAFT, rejection_verify


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs.double() * n
    keep = expected > 0
    stat = ((counts.double()[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def eight_token_target(folder, num_layers: int = 1, head_scale: float = 20):
    """A 1-layer Llama over an 8-token vocabulary whose head is scaled up, so the distribution
    is spread enough that acceptance matters: (transformers model, runtime model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.runtime.model import RuntimeModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=num_layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(head_scale)
    hf.save_pretrained(folder)
    return hf, RuntimeModel.from_pretrained(folder)


def assert_first_two_tokens_follow(hf, prompt, outs, T, vocab=8):
    """The first token of `outs` follows softmax(logits / T) after `prompt`, and so does the
    second after the most frequent first one (chi-square, p > 0.01)."""
    first = torch.tensor([o[0] for o in outs])
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / T, -1)
    assert chi_square_p(torch.bincount(first, minlength=vocab), p1) > 0.01
    mode = int(torch.bincount(first).argmax())
    second = torch.tensor([o[1] for o in outs if o[0] == mode])
    with torch.no_grad():
        p2 = torch.softmax(hf(torch.tensor([prompt + [mode]])).logits[0, -1] / T, -1)
    assert chi_square_p(torch.bincount(second, minlength=vocab), p2) > 0.01


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


@pytest.mark.parametrize("drafts,verification", [([], "standard"), ([3, 5], "standard"), ([3, NO_DRAFT], "standard"),
                                                  ([3, 5], "block"), ([3, NO_DRAFT], "block")])
def test_engine_sampling_follows_the_target_distribution(tmp_path, drafts, verification):
    """End to end through the engine on an 8-token vocabulary: the first two sampled tokens
    follow softmax(logits / T), with or without drafts."""
    from inference.runtime.engine import generate

    hf, rt = eight_token_target(tmp_path)
    prompt, T, N = [1, 2, 3, 4], 0.8, 20_000
    proposer = _FixedDrafts(drafts) if drafts else None
    outs, _ = generate(rt, [prompt] * N, 2, proposer=proposer, temperature=T, generator=torch.Generator().manual_seed(1),
                       verification=verification)
    assert_first_two_tokens_follow(hf, prompt, outs, T)


def _two_token_sampler(verify, P, Q, k, N, g, with_q=True):
    """Speculative sampling of the first two tokens of N sequences from a Markov 'target' P
    [V+1, V] (row V = the start) with a Markov drafter Q, one or two verify steps."""
    V = P.shape[1]
    last = torch.full((N,), V)
    first = torch.full((N,), -1)
    second = torch.full((N,), -1)
    accepted_first_step = None
    for step in range(2):
        todo = second < 0
        n = int(todo.sum())
        if n == 0:
            break
        ctx = last[todo]
        drafts, qs, ps = [], [], [P[ctx]]
        prev = ctx
        for _ in range(k):
            d = torch.multinomial(Q[prev], 1, generator=g).squeeze(1) if with_q else Q[prev].argmax(-1)
            qs.append(Q[prev])
            drafts.append(d)
            ps.append(P[d])
            prev = d
        drafts = torch.stack(drafts, 1)
        acc, nxt = verify(drafts, torch.stack(qs, 1) if with_q else None, torch.stack(ps, 1), generator=g)
        if step == 0:
            accepted_first_step = acc
        emitted = torch.cat([drafts, nxt[:, None]], 1)
        cols = torch.arange(k + 1)[None]
        emitted = torch.where(cols < acc[:, None], emitted, torch.where(cols == acc[:, None], nxt[:, None], -1))
        f, s = first[todo], second[todo]
        for j in range(k + 1):
            tok = emitted[:, j]
            put_first = (f < 0) & (tok >= 0)
            put_second = (f >= 0) & (s < 0) & (tok >= 0) & ~put_first
            s = torch.where(put_second, tok, s)
            f = torch.where(put_first, tok, f)
        first[todo], second[todo] = f, s
        last[todo] = torch.where(s >= 0, s, f)
    return first, second, accepted_first_step


@pytest.mark.parametrize("with_q", [True, False])
def test_block_and_standard_verification_reproduce_the_target_over_two_tokens(with_q):
    from inference.runtime.verify import block_verify

    V, k, N = 4, 3, 150_000
    g = torch.Generator().manual_seed(7)
    P = torch.softmax(torch.randn(V + 1, V, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(V + 1, V, generator=g) * 1.5, -1)
    joint = (P[V][:, None] * P[:V]).flatten()  # p(x1) p(x2 | x1)
    means = {}
    for name, verify in (("standard", rejection_verify), ("block", block_verify)):
        first, second, acc = _two_token_sampler(verify, P, Q, k, N, g, with_q)
        assert (second >= 0).all()
        counts = torch.bincount(first * V + second, minlength=V * V)
        assert chi_square_p(counts, joint) > 0.01, name
        means[name] = acc.float().mean().item()
    assert means["block"] >= means["standard"] - 0.005, means  # never fewer accepted on average


def test_block_verification_with_one_draft_is_standard_verification():
    from inference.runtime.verify import block_verify

    V, N = 5, 200_000
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, V, generator=g), -1)
    q = torch.softmax(torch.randn(1, V, generator=g), -1)
    drafts = torch.multinomial(q, N, replacement=True, generator=g).T
    acc, _ = block_verify(drafts, q.expand(N, 1, V), p.expand(N, 2, V), generator=g)
    assert abs(acc.float().mean() - torch.minimum(p[0], q[0]).sum()) < 0.01


def test_top_k_and_top_p_restrict_the_distribution():
    from inference.runtime.verify import sampling_probs

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    full = torch.softmax(logits, -1)
    k2 = sampling_probs(logits, 1.0, top_k=2)
    assert (k2[0, 2:] == 0).all() and torch.allclose(k2[0, :2], full[0, :2] / full[0, :2].sum())
    p = sampling_probs(logits, 1.0, top_p=0.8)
    kept = int((p > 0).sum())
    assert full[0, : kept - 1].sum() < 0.8 <= full[0, :kept].sum() and torch.allclose(p.sum(), torch.tensor(1.0))
    assert int((sampling_probs(logits, 1.0, top_p=0.01) > 0).sum()) == 1  # the best token always stays


def test_engine_top_k_sampling_never_leaves_the_top_k(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.runtime.engine import generate
    from inference.runtime.model import RuntimeModel

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    hf.save_pretrained(tmp_path)
    rt = RuntimeModel.from_pretrained(tmp_path)
    outs, _ = generate(rt, [[1, 2, 3]] * 2000, 1, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top2 = set(hf(torch.tensor([[1, 2, 3]])).logits[0, -1].topk(2).indices.tolist())
    assert {o[0] for o in outs} == top2


def test_synthetic_acceptance_hits_its_rate(tiny_target):
    from inference.runtime.engine import generate
    from inference.runtime.model import RuntimeModel

    rt = RuntimeModel.from_pretrained(tiny_target)
    _, stats = generate(rt, [[5, 6, 7]] * 8, 40, proposer=_FixedDrafts([1, 2, 3]), verification="synthetic:0.5",
                        generator=torch.Generator().manual_seed(0))
    a = stats.summary()["acceptance"]["a"]
    assert abs(a[0] - 0.5) < 0.1 and abs(a[1] - 0.5) < 0.15
    with pytest.raises(ValueError, match="verification"):
        generate(rt, [[5, 6]], 2, verification="blockwise")


@pytest.mark.parametrize("kind,verification", [("eagle3", "standard"), ("eagle3", "block"), ("medusa", "standard")])
def test_drafters_sampling_with_their_own_distribution_keep_the_target_distribution(tmp_path, kind, verification):
    """EAGLE-3 and Medusa sample their drafts from their own softmax at T and hand q to
    verification: the first two emitted tokens still follow the target (8-token vocabulary)."""
    from inference.runtime.engine import cache_size, generate
    from inference.proposers import Eagle3Proposer, MedusaProposer
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.medusa import MedusaConfig, MedusaDrafter

    hf, rt = eight_token_target(tmp_path)
    cfg = hf.config
    keep = (torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool))
    prompt, T, N, k = [1, 2, 3, 4], 0.8, 20_000, 2
    if kind == "eagle3":
        d = Eagle3Drafter(Eagle3Config.from_target(cfg, 8))
        for name, p in d.named_parameters():
            torch.nn.init.normal_(p, std=0.5)
        d.init_from_target(hf, *keep)
        proposer = Eagle3Proposer(d.eval(), k, N, cache_size([prompt], 2, k), target_config=rt.config)
    else:
        d = MedusaDrafter(MedusaConfig.from_target(cfg, 8, num_heads=k))
        d.init_from_target(hf, *keep)
        proposer = MedusaProposer(d.eval(), k, rt.config)
    outs, stats = generate(rt, [prompt] * N, 2, proposer=proposer, temperature=T,
                           generator=torch.Generator().manual_seed(1), verification=verification)
    assert sum(n * c for n, c in enumerate(stats.histogram)) > 1000  # drafts were accepted
    assert_first_two_tokens_follow(hf, prompt, outs, T)
