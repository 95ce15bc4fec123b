"""Predicted acceptance at T > 0 (inference/walks/sampled.py) against sampled verification."""
import pytest
import torch

from inference.walks.sampled import (acceptance_with_error, block_histogram, block_residual_mass, block_weight,
                                          promise_at, standard_histogram, standard_step)
from inference.runtime.verify import block_verify, rejection_verify


def _chain_setup(V=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)  # target, per position
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)  # drafter, per position
    return p, q, g


def test_standard_histogram_is_the_law_of_rejection_sampling():
    """Distributions that do not depend on the prefix: the expected histogram from alpha_i is
    what rejection_verify accepts over 200,000 sampled chains."""
    p, q, g = _chain_setup()
    k, N = 3, 200_000
    alpha, _ = standard_step(p[:k], q, g)
    expected = standard_histogram(alpha[None].double())[0]
    assert expected.sum().item() == pytest.approx(1.0)
    drafts = torch.multinomial(q, N, replacement=True, generator=g).T
    accepted, _ = rejection_verify(drafts, q.expand(N, k, -1), p.expand(N, k + 1, -1), generator=g)
    measured = torch.bincount(accepted, minlength=k + 1).double() / N
    assert torch.allclose(measured, expected, atol=4e-3), (measured, expected)


def test_block_histogram_is_the_law_of_block_verification_given_the_chain():
    """One fixed chain of drafts: the exact law of L from the weights and residual masses is
    what block_verify accepts over 200,000 draws of its uniforms; swapping p and q is caught."""
    p, q, g = _chain_setup(seed=1)
    k, N = 3, 200_000
    drafts = torch.tensor([int(q[i].argmax()) for i in range(k)])

    def law(p, q):
        w, weights, residuals = torch.ones(1), [], []
        for i in range(k):
            if i:
                residuals.append(block_residual_mass(w, p[i : i + 1], q[i : i + 1]))
            w = block_weight(w, p[i, drafts[i]][None], q[i, drafts[i]][None])
            weights.append(w)
        return block_histogram(torch.stack(weights, 1).double(), torch.stack(residuals, 1).double())[0]

    expected = law(p, q)
    accepted, _ = block_verify(drafts.expand(N, k), q.expand(N, k, -1), p.expand(N, k + 1, -1), generator=g)
    measured = torch.bincount(accepted, minlength=k + 1).double() / N
    assert torch.allclose(measured, expected, atol=4e-3), (measured, expected)
    assert not torch.allclose(measured, law(q, p), atol=4e-3)  # the rule is not symmetric in p and q


def test_acceptance_with_error_and_fractional_histograms():
    stats = acceptance_with_error([0.5, 1.25, 2.25])
    assert stats["num_chains"] == 4 and stats["histogram"] == [0.5, 1.25, 2.25]
    mean = (1.25 + 2 * 2.25) / 4
    var = (0.5 * mean**2 + 1.25 * (1 - mean) ** 2 + 2.25 * (2 - mean) ** 2) / 4
    assert stats["tau"] == pytest.approx(1 + mean) and stats["tau_se"] == pytest.approx((var / 4) ** 0.5)


def test_promise_at_reads_old_and_new_promise_files():
    greedy = {"a": [0.5], "tau": 1.5, "temperature": 0.0}
    assert promise_at(greedy, 0.0, "standard") is greedy and promise_at(greedy, 0.0, "block") is greedy
    assert promise_at(greedy, 1.0, "standard") is None  # a file from before sampled promises
    block = {"temperature": 1.0, "verification": "block", "a": [0.4], "tau": 1.4}
    new = {**greedy, "sampled": [{"temperature": 1.0, "verification": "standard", "a": [0.3], "tau": 1.3}, block]}
    assert promise_at(new, 1.0, "block") is block and promise_at(new, 0.7, "block") is None
    assert promise_at({}, 0.0, "standard") is None


def _tiny_pair(tmp_path, k):
    """A tiny target (8-token vocabulary) and a random EAGLE-3 drafter over 6 of its tokens."""
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from tests.test_sampling import eight_token_target

    hf, _ = eight_token_target(tmp_path, num_layers=2, head_scale=8)
    drafter = Eagle3Drafter(Eagle3Config.from_target(hf.config, 6))
    for _, w in drafter.named_parameters():
        torch.nn.init.normal_(w, std=0.5)
    chosen = torch.tensor([0, 1, 2, 4, 5, 7])  # tokens 3 and 6 are outside the draft vocabulary: q = 0 there
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[chosen] = True
    drafter.init_from_target(hf, chosen - torch.arange(6), t2d)
    return drafter.eval()


@pytest.mark.parametrize("verification", ["standard", "block"])
def test_predicted_sampled_acceptance_equals_the_runtime_mean(tmp_path, verification):
    """CI check of issue 21: on a tiny drafter at T = 1, training's predictor on the served
    contexts (a chain continues the prompt and the first served token) equals the mean accepted
    length of 20,000 sampled runtime runs within their standard errors (3 sigma)."""
    from inference.runtime.engine import cache_size, generate
    from inference.runtime.model import RuntimeModel
    from inference.proposers import Eagle3Proposer
    from inference.walks.sampled import sampled_chain_histograms
    from models.target import Target

    k, N, T = 3, 20_000, 1.0
    drafter = _tiny_pair(tmp_path, k)
    rt = RuntimeModel.from_pretrained(tmp_path)
    prompt = [1, 2, 3, 4]
    proposer = Eagle3Proposer(drafter, k, N, cache_size([prompt], 2, k), target_config=rt.config)
    # two new tokens: the first from the prefill, then exactly one verified chain per row
    outs, stats = generate(rt, [prompt] * N, 2, proposer=proposer, temperature=T,
                           generator=torch.Generator().manual_seed(1), verification=verification)
    lengths = torch.repeat_interleave(torch.arange(k + 1), torch.tensor(stats.histogram)).double()
    assert lengths.numel() == N and 0.2 < lengths.mean() < k - 0.2  # neither always nor never accepted
    measured, measured_se = lengths.mean().item(), (lengths.var() / N).sqrt().item()

    # one drawn chain per served row, at that row's context; rows with the same first token share a text
    target = Target.load(str(tmp_path), drafter.aux_layer_ids)
    g = torch.Generator().manual_seed(2)
    first = torch.tensor([o[0] for o in outs])
    expected_length = []
    for token, count in enumerate(torch.bincount(first, minlength=8).tolist()):
        if not count:
            continue
        ids = torch.tensor(prompt + [token, 0])
        out = target(ids[None])
        rows = sampled_chain_histograms(target, drafter, ids, drafter.features(out)[0], out.last_hidden[0],
                                        torch.full((count,), len(prompt) - 1), k, T, verification, g)
        assert torch.allclose(rows.sum(1), torch.ones(count, dtype=torch.float64))
        expected_length.append((rows * torch.arange(k + 1)).sum(1))  # [count]: E[L | context, drawn chain]
    expected_length = torch.cat(expected_length)
    predicted, predicted_se = expected_length.mean().item(), (expected_length.var() / N).sqrt().item()
    assert abs(predicted - measured) < 3 * (predicted_se**2 + measured_se**2) ** 0.5, \
        (verification, predicted, predicted_se, measured, measured_se)


def test_sampled_window_takes_a_texts_anchors_at_once_within_its_bounds():
    """Few large windows (the drafter runs over the whole text k times per window), bounded by
    the [window, V] distributions, by what a capped walk can reach and, for a block drafter, by
    its attention over the text and every block."""
    from inference.walks.sampled import sampled_window
    from models.dflash import DFlashConfig, DFlashDrafter

    chain = object()  # a drafter of no method drafts chains
    assert sampled_window(chain, 7, 2048, 49152, None) == 2**26 // 49152 == 1365
    assert sampled_window(chain, 7, 2048, 10**7, None) == 128  # never fewer than 128 at once
    assert sampled_window(chain, 3, 2048, 49152, 8) == 32  # 8 chains of at most 4 tokens each
    block = DFlashDrafter.__new__(DFlashDrafter)
    block.config = DFlashConfig.__new__(DFlashConfig)
    block.config.block_size = 8
    w = sampled_window(block, 7, 2048, 49152, None)
    assert 128 <= w < 1365 and w * 8 * (2048 + w * 8) <= 2**26
