"""Verification: small pure functions from target outputs and drafts to accepted tokens.

Each has a Triton kernel and a plain-torch reference of the same signature in kernels/; the
kernel runs on GPU tensors. Greedy verification is lossless by construction: every emitted
token is the target's argmax given the tokens before it.
"""
from __future__ import annotations

import torch

from kernels.greedy_verify import greedy_verify  # noqa: F401  (drafts [B,k], logits [B,k+1,V] → accepted, bonus)

NO_DRAFT = -1  # fills draft slots a proposer left empty; never equals a target token


def rejection_verify(drafts, draft_probs, target_probs, generator=None):
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), vectorised.

    drafts [B,k] target ids; draft_probs [B,k,V] the proposer's distribution at each draft,
    or None for proposers without probabilities (then q = 1 at the drafted token);
    target_probs [B,k+1,V] the target's distribution at each draft position and after the
    last one. Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection the token is resampled from normalize(max(p_i - q_i, 0)); when all k are
    accepted the bonus comes from p_k. The emitted tokens follow the target's distribution.
    Returns (accepted [B] in 0..k, next_token [B]: the resampled or bonus token).
    """
    B, k = drafts.shape
    p = target_probs.float()
    rows = torch.arange(B, device=drafts.device)
    if k == 0:
        return torch.zeros(B, dtype=torch.long, device=drafts.device), torch.multinomial(p[:, 0], 1, generator=generator).squeeze(1)
    valid = drafts >= 0
    d = drafts.clamp_min(0)
    p_d = p[:, :k].gather(2, d[..., None]).squeeze(-1)  # [B,k]
    if draft_probs is None:
        q = torch.zeros_like(p[:, :k]).scatter_(2, d[..., None], 1.0)
    else:
        q = draft_probs.float()
    q = q * valid[..., None]  # an empty slot drafted nothing: its residual is p itself
    q_d = q.gather(2, d[..., None]).squeeze(-1)
    u = torch.rand(B, k, device=drafts.device, generator=generator)
    ok = (u * q_d < p_d) & valid  # u < p/q without dividing by a zero q
    accepted = ok.long().cumprod(1).sum(1)  # [B]
    # the distribution the next token comes from: residual at the first rejection, else p_k
    j = accepted.clamp_max(k - 1)
    residual = (p[rows, j] - q[rows, j]).clamp_min(0)
    residual_sum = residual.sum(-1, keepdim=True)
    # a residual can vanish only where p == q there; then p itself is the right distribution
    residual = torch.where(residual_sum > 0, residual / residual_sum.clamp_min(1e-30), p[rows, j])
    source = torch.where((accepted == k)[:, None], p[:, k], residual)
    next_token = torch.multinomial(source, 1, generator=generator).squeeze(1)
    return accepted, next_token
