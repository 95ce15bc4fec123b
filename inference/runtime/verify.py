"""Verification: small pure functions from target outputs and drafts to accepted tokens.

Each has a Triton kernel and a plain-torch reference of the same signature in kernels/; the
kernel runs on GPU tensors. Greedy verification is lossless by construction: every emitted
token is the target's argmax given the tokens before it.
"""
from __future__ import annotations

import torch

from draftsmith_kernels.greedy_verify import greedy_verify  # noqa: F401  (drafts [B,k], logits [B,k+1,V] → accepted, bonus)
from draftsmith_kernels.block_sample import block_sample  # block verification from uniforms (Triton on GPU)
from draftsmith_kernels.rejection_sample import rejection_sample  # the fused scan + residual draw (Triton on GPU)

NO_DRAFT = -1  # fills draft slots a proposer left empty; never equals a target token


def rejection_verify(drafts, draft_probs, target_probs, generator=None):
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), vectorised.

    drafts [B,k] target ids; draft_probs [B,k,V] the proposer's distribution at each draft,
    or None for proposers without probabilities (then q = 1 at the drafted token);
    target_probs [B,k+1,V] the target's distribution at each draft position and after the
    last one. Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection the token is resampled from normalize(max(p_i - q_i, 0)); when all k are
    accepted the bonus comes from p_k. The emitted tokens follow the target's distribution.
    Returns (accepted [B] in 0..k, next_token [B]: the resampled or bonus token). The draws
    come from `generator`; the work is `kernels.rejection_sample` (one Triton launch on GPU).
    """
    B, k = drafts.shape
    u_accept = torch.rand(B, k, device=drafts.device, generator=generator)
    u_sample = torch.rand(B, device=drafts.device, generator=generator)
    return rejection_sample(drafts, draft_probs, target_probs, u_accept, u_sample)


def block_verify(drafts, draft_probs, target_probs, generator=None):
    """Block verification (Sun et al. 2024, arXiv 2403.10444): the drafted block is judged as
    a whole, which accepts at least as many tokens as `rejection_verify` on average and
    reproduces the same (target) distribution. Same signature and shapes.

    With weights w_0 = 1, w_i = min(w_{i-1} p_i(d_i) / q_i(d_i), 1) and the residual mass
    R_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0) after i drafts, prefix i is kept with
    probability h_i = R_i / (R_i + 1 - w_i) (h = w at the last draft), independently per i,
    and the accepted length is the largest kept i. The next token comes from the normalised
    residual max(w_tau p_{tau+1} - q_{tau+1}, 0) (from p_{tau+1} itself after the whole block).
    Empty slots end a row's block early. The work is `kernels.block_sample` (one Triton
    launch on GPU).
    """
    B, k = drafts.shape
    eta = torch.rand(B, k, device=drafts.device, generator=generator)
    u_sample = torch.rand(B, device=drafts.device, generator=generator)
    return block_sample(drafts, draft_probs, target_probs, eta, u_sample)


def synthetic_verify(drafts, rate: float, target_logits, generator=None):
    """Benchmark-only verification: each draft is accepted with probability `rate` (leading
    run), the next token is the target's argmax there. Emits text the target would not: it
    measures speed at a chosen acceptance, never quality."""
    B, k = drafts.shape
    ok = torch.rand(B, k, device=drafts.device, generator=generator) < rate
    accepted = (ok & (drafts >= 0)).long().cumprod(1).sum(1)
    bonus = target_logits.argmax(-1).gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


def sampling_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """softmax(logits / T) restricted to the top_k tokens and to the smallest set whose mass
    reaches top_p (renormalised): the distribution sampling reproduces. logits [..., V]."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the better tokens
        drop = before >= top_p  # the top token always stays
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
