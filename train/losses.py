"""Losses: small pure functions on flattened or batched tensors.

Masks select positions; every mean is over selected positions only, so padding and
non-assistant tokens never contribute.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def soft_kl(student_logits: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, averaged over the mask.

    student_logits, teacher_probs [..., Vd]; mask [...]. Computed in float32; the teacher
    entropy term makes the value a true KL (0 when the two agree), it adds no gradient.
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)
    p = teacher_probs.float()
    plogp = torch.where(p > 0, p * torch.log(p.clamp_min(1e-30)), torch.zeros_like(p))
    kl = (plogp - p * logq).sum(-1)
    return masked_mean(kl, mask)


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
