"""Adaptive verification's choice (inference/runtime/adaptive.py) against brute force, its device
form against its host form, and the step-cost table's JSON round trip and refusals."""
import itertools
import json

import pytest
import torch

from inference.runtime.adaptive import (AdaptiveVerification, StepCosts, choose_lengths, choose_width, expected_tokens,
                                        measure_step_costs, objective, step_ms_tensor, survival)


def _costs(B, k, draft, per_token, fixed):
    return StepCosts(target="t", device="cpu", dtype="float32", verify_ms={str(B): [fixed + per_token * B * n
                                                                                    for n in range(1, k + 2)]},
                     draft_ms={str(B): draft})


def test_the_choice_maximises_tokens_per_ms_over_every_per_row_length():
    """Every per-row length vector of small batches (padded step: cost at the widest row, at least
    one draft wide) is tried; the chosen lengths reach the largest expected tokens per millisecond."""
    g = torch.Generator().manual_seed(0)
    widths = set()
    for trial in range(60):
        B, k = 1 + trial % 3, 1 + trial % 4
        confidence = torch.rand(B, k, generator=g) ** (0.3 + 2 * torch.rand(1, generator=g).item())
        active = torch.rand(B, generator=g) < 0.8
        costs = _costs(B, k, draft=float(torch.rand(1, generator=g)) * 3, per_token=float(torch.rand(1, generator=g)),
                       fixed=0.5 + float(torch.rand(1, generator=g)) * 4)
        best = max(objective(list(ls), confidence, active, costs) for ls in itertools.product(range(k + 1), repeat=B) if max(ls) >= 1)
        chosen = choose_lengths(confidence, active, costs)
        assert objective(chosen, confidence, active, costs) == pytest.approx(best, rel=1e-6), (trial, chosen)
        widths.add(max(chosen))
    assert len(widths) >= 3, "the cases should call for different widths"


def test_confident_drafts_are_verified_and_hopeless_ones_are_not():
    B, k = 2, 4
    costs = _costs(B, k, draft=1.0, per_token=0.1, fixed=2.0)
    active = torch.ones(B, dtype=torch.bool)
    assert choose_lengths(torch.full((B, k), 0.99), active, costs) == [k, k]
    assert choose_lengths(torch.full((B, k), 0.01), active, costs) == [1, 1]  # the narrowest step
    # a confident start that falls off: verify up to the fall
    c = torch.tensor([[0.95, 0.95, 0.02, 0.9], [0.9, 0.95, 0.01, 0.9]])
    assert choose_lengths(c, active, costs) == [2, 2]
    assert choose_lengths(c, torch.tensor([True, False]), costs) == [2, 0]


def test_survival_and_expected_tokens():
    c = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]])
    assert survival(c).tolist() == [[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]
    # width 0: one token per running row; width w adds the survivals up to w
    assert expected_tokens(survival(c), torch.tensor([True, True])).tolist() == [2.0, 3.5, 3.75, 4.0]
    assert expected_tokens(survival(c), torch.tensor([True, False])).tolist() == [1.0, 1.5, 1.75, 2.0]


def test_device_form_matches_the_host_form_and_needs_no_sync():
    """choose_width is tensor ops only: the same width on any device, returned as a tensor there."""
    g = torch.Generator().manual_seed(1)
    B, k = 3, 5
    costs = _costs(B, k, draft=0.7, per_token=0.2, fixed=1.0)
    for _ in range(10):
        c, active = torch.rand(B, k, generator=g), torch.rand(B, generator=g) < 0.7
        w = choose_width(c, active, step_ms_tensor(costs, B, k, c.device))
        assert isinstance(w, torch.Tensor) and w.dim() == 0
        assert [int(w) if a else 0 for a in active] == choose_lengths(c, active, costs)


def test_step_costs_round_trip_and_refusals(tmp_path):
    costs = StepCosts(target="smollm2", device="cpu", dtype="float32", verify_ms={"1": [1.0, 1.5, 2.0], "8": [3.0, 5.0, 7.0]},
                      draft_ms={"1": 0.5}, context=64)
    path = tmp_path / "costs.json"
    costs.save(path)
    assert StepCosts.load(path) == costs
    assert AdaptiveVerification(costs).record()["step_costs"] == json.loads(path.read_text())
    assert costs.row(1, 2) == (0.5, [1.0, 1.5, 2.0])
    assert costs.row(4, 1) == (0.0, [3.0, 5.0])  # priced at the next measured batch, no draft time there
    assert costs.row(16, 1) == (0.0, [3.0, 5.0])  # beyond the table: its largest batch
    with pytest.raises(ValueError, match="k=3 needs 4"):
        costs.row(1, 3)
    (tmp_path / "bad.json").write_text('{"format": "draftsmith-step-costs/1", "target": "t"}')
    with pytest.raises(ValueError, match="bad.json: step-cost table: missing"):
        StepCosts.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a step-cost table"):
        StepCosts.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="positive"):
        StepCosts(target="t", device="cpu", dtype="float32", verify_ms={"1": [1.0, -2.0]})
    with pytest.raises(ValueError, match="no such"):
        StepCosts.load(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="cannot read the step-cost table"):  # a folder: an error, not an OSError
        StepCosts.load(tmp_path)
    for field, value, phrase in (("verify_ms", {"1": [True, True]}, "positive numbers"),
                                 ("verify_ms", {"1": [1.0, float("inf")]}, "positive numbers"),
                                 ("context", "abc", "is not a cache position")):
        with pytest.raises(ValueError, match=phrase):
            StepCosts.from_dict({**costs.to_dict(), field: value})


def test_measured_costs_cover_every_width_and_batch(tiny_target):
    from inference.runtime.model import RuntimeModel

    model = RuntimeModel.from_pretrained(tiny_target, dtype=torch.float32)
    costs = measure_step_costs(model, [1, 2], 3, context=8, repeats=2, target="tiny", draft_ms={1: 0.25})
    assert sorted(costs.verify_ms) == ["1", "2"] and all(len(v) == 3 and min(v) > 0 for v in costs.verify_ms.values())
    assert costs.draft_ms == {"1": 0.25} and costs.device == "cpu" and costs.dtype == "float32"
    assert StepCosts.from_dict(costs.to_dict()) == costs


def test_adaptive_verification_is_refused_where_no_confidences_come(tiny_target):
    """A proposer without a confidence head, or the host loop: a ValueError saying why, before any step."""
    from inference.proposers import GpuNgramProposer, NgramProposer
    from inference.runtime.engine import cache_size, generate
    from inference.runtime.model import RuntimeModel

    model = RuntimeModel.from_pretrained(tiny_target, dtype=torch.float32)
    prompts = [[5, 6, 7, 5, 6]]
    setting = AdaptiveVerification(_costs(1, 2, draft=0.1, per_token=0.1, fixed=1.0))
    n = cache_size(prompts, 4, 2)
    with pytest.raises(ValueError, match="confidence head"):
        generate(model, prompts, 4, proposer=GpuNgramProposer(2, 1, n), max_len=n, adaptive=setting)
    with pytest.raises(ValueError, match="runs in the device loop"):
        generate(model, prompts, 4, proposer=NgramProposer(2), max_len=n, adaptive=setting)
    with pytest.raises(ValueError, match="runs in the device loop"):
        generate(model, prompts, 4, max_len=n, adaptive=setting)


def test_the_causal_width_never_looks_at_the_draft_it_gates():
    """Sampled drafts: whether draft j is verified (w > j) may depend on confidences 0..j (the
    head computes c_j from the drafts before j) and never on those after, or the verified drafts
    would not be q's draws. The causal rule keeps that under any change of the later confidences;
    with costs linear in the width it picks the best width, while under costs that jump (a padded
    graph's step) the best-rate rule is seen to depend on later confidences."""
    g = torch.Generator().manual_seed(2)
    B, k = 3, 5
    best_rule_peeks = False
    for trial in range(200):
        if trial % 2:  # linear in the width
            costs = _costs(B, k, draft=float(torch.rand(1, generator=g)) * 2,
                           per_token=0.05 + float(torch.rand(1, generator=g)), fixed=1.0)
        else:  # a jump past width 1, flat after it
            costs = StepCosts(target="t", device="cpu", dtype="float32",
                              verify_ms={str(B): [1.0, 1.2, 2.0 + float(torch.rand(1, generator=g)), 2.6, 2.65, 2.7]})
        step_ms = step_ms_tensor(costs, B, k, "cpu")
        c, active = torch.rand(B, k, generator=g) ** 0.3, torch.rand(B, generator=g) < 0.8
        active[0] = True
        w, w_best = (int(choose_width(c, active, step_ms, causal)) for causal in (True, False))
        if trial % 2:
            assert objective(choose_lengths(c, active, costs, causal=True), c, active, costs) == pytest.approx(
                objective(choose_lengths(c, active, costs), c, active, costs), rel=1e-6)
        for j in range(k):
            later = c.clone()
            later[:, j + 1 :] = torch.rand(B, k - j - 1, generator=g) ** 0.3
            assert (int(choose_width(later, active, step_ms, True)) > j) == (w > j), (trial, j)
            best_rule_peeks |= (int(choose_width(later, active, step_ms, False)) > j) != (w_best > j)
    assert best_rule_peeks, "the best-rate rule should be seen to depend on later confidences"
