"""Losses: small pure functions on flattened or batched tensors.

Masks select positions; every mean is over selected positions only, so padding and
non-assistant tokens never contribute.
"""
from __future__ import annotations

from draftsmith_kernels.soft_kl import soft_kl  # noqa: F401  (Triton on GPU, torch reference elsewhere)


def ttt_step_weights(steps: int, decay: float) -> list[float]:
    """Weight of unroll step s: decay**s."""
    return [decay**s for s in range(steps)]


def ttt_slices(T: int, step: int) -> tuple[slice, slice, slice]:
    """Index ranges aligning TTT step `step` with its labels.

    Step s at index t drafts token t+2+s, whose teacher distribution is the target's at
    position t+1+s. Returns (draft index range, teacher index range, label index range) of
    equal length T-2-s.
    """
    n = max(T - 2 - step, 0)
    return slice(0, n), slice(1 + step, 1 + step + n), slice(2 + step, 2 + step + n)


def feature_smooth_l1(predicted, target, mask):
    """Smooth-L1 between predicted and target features, averaged over the hidden size and
    over selected positions (EAGLE-1's regression). predicted, target [..., H]; mask [...] bool.

    The mean over H (as EAGLE's reference trainer takes it) keeps the term on the scale of a
    token loss, so the default weights 1.0 / 0.1 balance the two; a sum over H made it ~H times
    larger and the token loss no longer steered training."""
    import torch.nn.functional as F

    per_position = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)


def hard_ce(logits, labels, mask):
    """Cross-entropy to hard labels (indices into the logits' vocabulary, -1 = not in it),
    averaged over selected positions whose label exists. logits [..., Vd]; labels, mask [...]."""
    import torch.nn.functional as F

    keep = mask.bool() & (labels >= 0)
    per_position = F.cross_entropy(logits.float().flatten(0, -2), labels.clamp_min(0).flatten(), reduction="none")
    keep = keep.flatten().to(per_position.dtype)
    return (per_position * keep).sum() / keep.sum().clamp_min(1)


def acceptance_targets(student_logits, teacher_probs, choice, draft_ids, kind: str):
    """What a confidence head learns of each drafted position (DSpark): the probability that
    its draft is accepted given the drafts before it were, under teacher forcing (the text
    before it). student_logits [N,Vd] (the draft's logits, bias applied), teacher_probs [N,Vd]
    (the target's distribution over the draft vocabulary: training's teacher, renormalised there,
    so with Vd < V the overlap is read a little high; exact with the full vocabulary), choice [N]
    (the target's full-vocab argmax), draft_ids [Vd] → [N] float32 in [0, 1], no gradient.

    kind "overlap": sum_x min(p(x), q(x)), acceptance under standard verification at T = 1 (the
    sampled walk's alpha; the reference trainer's target); "greedy": 1 where the draft's argmax
    is the target's (acceptance at T = 0, the greedy walk's)."""
    import torch

    with torch.no_grad():
        if kind == "greedy":
            return (draft_ids[student_logits.argmax(-1)] == choice).float()
        if kind != "overlap":
            raise ValueError(f"confidence target {kind!r} is not one of overlap, greedy")
        q = torch.softmax(student_logits.float(), -1)
        return torch.minimum(q, teacher_probs.float()).sum(-1).clamp(0, 1)


def confidence_bce(confidence_logits, target, mask):
    """Binary cross-entropy of confidence logits [N] against acceptance probabilities [N] (soft
    labels), averaged over selected positions mask [N]."""
    import torch.nn.functional as F

    per_position = F.binary_cross_entropy_with_logits(confidence_logits.float(), target.float(), reduction="none")
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)
