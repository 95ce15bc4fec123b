"""Verification: small pure functions from target outputs and drafts to accepted tokens."""
from __future__ import annotations

import torch

from inference.acceptance import accepted_lengths

NO_DRAFT = -1  # fills draft slots a proposer left empty; never equals a target token


def greedy_verify(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of k drafts per row.

    drafts [B,k] (target ids, NO_DRAFT where empty); target_logits [B,k+1,V]: the target's
    logits after the last verified token and after each draft. Returns (accepted [B] in 0..k,
    bonus [B]: the target's own token after the accepted prefix). Lossless by construction:
    every emitted token is the target's argmax given the tokens before it.
    """
    choice = target_logits.argmax(-1)  # [B,k+1]
    k = drafts.shape[1]
    accepted = accepted_lengths(drafts, choice[:, :k]) if k else torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    bonus = choice.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus
