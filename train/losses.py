"""Losses: small pure functions on flattened or batched tensors.

Masks select positions; every mean is over selected positions only, so padding and
non-assistant tokens never contribute.
"""
from __future__ import annotations

from kernels.soft_kl import soft_kl  # noqa: F401  (Triton on GPU, torch reference elsewhere)


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
