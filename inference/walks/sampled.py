"""Predicted acceptance when drafts are sampled (T > 0): standard rejection and block verification.

The greedy promise (inference/walks/greedy.py) judges one deterministic chain per anchor. With
sampling, a chain's accepted length L is random; what is predicted is its law, as the expected
histogram of L, from the target's distribution p and the drafter's q (both at temperature T,
p restricted by top_k / top_p as the runtime restricts it, q as the runtime's proposers sample:
softmax(logits / T) over the draft vocabulary, 0 elsewhere). Per chain, at its anchor a:

Standard rejection (inference.runtime.verify.rejection_verify). Given drafts 1..i-1 accepted (the prefix
c_{i-1} = x_0..x_{a+1}, d_1..d_{i-1}), draft i ~ q_i(.|c_{i-1}) is accepted with probability
    alpha_i = sum_x min(p_i(x), q_i(x)),
and an accepted draft is distributed as min(p_i, q_i) / alpha_i. Hence
    P(L >= i) = sum_{d_1..d_i} prod_{j<=i} min(p_j(d_j), q_j(d_j)) = E[prod_{j<=i} alpha_j],
the expectation over ONE chain whose token j is drawn from min(p_j, q_j) / alpha_j (not from q:
the chain continues only through accepted drafts). The drafters feed their own draft back, so
q_{j+1} depends on d_j and the sum over all chains is intractable; one drawn chain per anchor
gives an unbiased estimate of every P(L >= i), hence of the histogram and of tau. Note the
law of L is symmetric in p and q under this rule: only block verification tells them apart.

Block verification (inference.runtime.verify.block_verify). The drafts are judged as a block: d_i ~ q_i,
w_0 = 1, w_i = min(w_{i-1} p_i(d_i) / q_i(d_i), 1), R_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0),
prefix i is kept with probability h_i = R_i / (R_i + 1 - w_i) (h_k = w_k), independently, and
L is the largest kept prefix. Given the drawn chain (from q, exactly as the runtime drafts),
    P(L = i | chain) = h_i prod_{j>i} (1 - h_j),   P(L = 0 | chain) = prod_j (1 - h_j)
exactly; the chain itself is the one drawn part.

Where the chain leaves the text, p_{i+1} needs the target after d_1..d_i: one forward over the
text with all of a window's chains grafted on (Target.chain_steps: the text's keys and values
computed once per row, each chain's tokens added as drafted), per draft position.
Each chain adds its expected histogram (a row summing to 1) to the promise; the walk to the
next anchor draws L from that row (serving starts the next chain L + 1 tokens on). The
standard error `tau_se` is what tau would have from as many independent chains drawn from the
histogram: an upper bound on the walk's own sampling error (a chain's conditional expectation
varies less than its draw).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.walks.greedy import walk_answer, window_for
from inference.runtime.verify import sampling_probs
from models.acceptance import Acceptance

VERIFICATIONS = ("standard", "block")


# ----------------------------------------------------------------------------- pure pieces
def standard_step(p: torch.Tensor, q: torch.Tensor, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """p, q [m,V] at one draft position → (alpha [m] = sum_x min(p, q), the chain's next token
    [m] drawn from min(p, q) / alpha: the draft as it is when accepted)."""
    overlap = torch.minimum(p, q)
    alpha = overlap.sum(-1)
    # where p and q do not overlap the chain ends here (alpha = 0): any token will do
    overlap = torch.where(alpha[:, None] > 0, overlap, q)
    return alpha, torch.multinomial(overlap, 1, generator=generator)[:, 0]


def standard_histogram(alpha: torch.Tensor) -> torch.Tensor:
    """alpha [m,k] along each chain → expected histogram [m,k+1]: P(L = i) = P(L >= i) - P(L >= i+1)
    with P(L >= i) = prod_{j<=i} alpha_j."""
    at_least = torch.cat([torch.ones_like(alpha[:, :1]), alpha.cumprod(1)], 1)  # [m,k+1], P(L >= 0) = 1
    return at_least - torch.cat([at_least[:, 1:], torch.zeros_like(alpha[:, :1])], 1)


def block_residual_mass(w: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """R = sum_x max(w p(x) - q(x), 0): w [m], p, q [m,V] (the next position's) → [m]."""
    return (w[:, None] * p - q).clamp_min(0).sum(-1)


def block_weight(w_prev: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """w_i = min(w_{i-1} p_i(d_i) / q_i(d_i), 1); all [m]."""
    return torch.minimum(w_prev * p_d / q_d.clamp_min(1e-30), torch.ones_like(w_prev))


def block_histogram(w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """w [m,k] (w_1..w_k), residual [m,k-1] (R_1..R_{k-1}) of one drawn chain → [m,k+1], the law of
    the accepted length given the chain: P(L = i) = h_i prod_{j>i} (1 - h_j), h_0 = 1."""
    denom = residual + 1 - w[:, :-1]
    h_mid = torch.where(denom > 0, residual / denom.clamp_min(1e-30), torch.ones_like(denom))
    h = torch.cat([torch.ones_like(w[:, :1]), h_mid, w[:, -1:]], 1)  # [m,k+1]: h_0..h_k
    none_after = torch.cat([(1 - h[:, 1:]).flip(1).cumprod(1).flip(1), torch.ones_like(w[:, :1])], 1)
    return h * none_after  # [m,k+1]: h_i * prod_{j>i} (1 - h_j)


def acceptance_with_error(hist) -> dict:
    """acceptance_from_histogram plus tau_se: sqrt(Var(L) / chains) under the histogram (the JSON
    view of models.acceptance.Acceptance.from_histogram(hist, with_error=True))."""
    return Acceptance.from_histogram(hist, with_error=True).to_dict()


# ----------------------------------------------------------------------------- chains at anchors
@torch.no_grad()
def sampled_chain_histograms(target, drafter, ids, features, last_hidden, anchors, k: int, temperature: float,
                             verification: str, generator=None, top_k: int = 0, top_p: float = 1.0,
                             steps=None, verify_width=None) -> torch.Tensor:
    """Expected accepted-length histograms [m,k+1] (float64, rows sum to 1) of one drawn chain per
    anchor. ids [T], features [T,...] (what the drafter reads), last_hidden [T,H] (the target's
    final hidden state on ids), anchors [m]: chain i continues x_0..x_{a_i+1}. steps: the
    sequence's `Target.chain_steps` when the caller walks several windows of it (its keys and
    values computed once); made here otherwise. verify_width(confidence [m,k]) → [m], when given:
    adaptive verification (a drafter whose drive_block returns its confidences: DSpark), each
    chain judged on its first width drafts only (inference.walks.greedy.chain_widths). The width
    depends on every draft of the chain, so the chain is then drawn from q as served under both
    rules (standard: P(L >= i | chain) = prod_{j<=i} min(1, p_j(d_j) / q_j(d_j)), unbiased like
    the accepted-chain estimate it replaces, which would read the width from the wrong chain)."""
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification {verification!r} is not one of {', '.join(VERIFICATIONS)}")
    head = target.head_weight
    draft_ids = drafter.draft_ids()
    m, V = anchors.numel(), head.shape[0]
    chain: list[torch.Tensor] = []  # drawn tokens d_1.. [m] each
    alphas, weights, residuals = [], [], []
    w = torch.ones(m, device=ids.device)

    def step(logits):  # logits [m,Vd] of draft i = len(chain) + 1 → d_i [m]
        nonlocal w
        q = torch.zeros(m, V, device=ids.device).index_copy_(1, draft_ids, torch.softmax(logits.float() / temperature, -1))
        hidden = last_hidden[anchors + 1] if not chain else steps.step(chain[-1])  # [m,H]: context + d_1..d_{i-1}
        p = sampling_probs(F.linear(hidden, head), temperature, top_k, top_p)  # [m,V]
        if verification == "standard" and verify_width is None:
            alpha, token = standard_step(p, q, generator)
            alphas.append(alpha)
        elif verification == "standard":  # the width is read from the chain as served: drawn from q,
            # whose draft i is accepted with probability min(1, p/q) (E over q: alpha_i)
            token = torch.multinomial(q, 1, generator=generator)[:, 0]
            alphas.append(block_weight(torch.ones_like(w), p.gather(1, token[:, None])[:, 0], q.gather(1, token[:, None])[:, 0]))
        else:
            if chain:  # the residual after i-1 drafts needs p_i, q_i
                residuals.append(block_residual_mass(w, p, q))
            token = torch.multinomial(q, 1, generator=generator)[:, 0]  # as the runtime drafts
            w = block_weight(w, p.gather(1, token[:, None])[:, 0], q.gather(1, token[:, None])[:, 0])
            weights.append(w)
        chain.append(token)
        return token

    if k > 1:
        steps = steps if steps is not None else target.chain_steps(ids)
        steps.start(anchors)
    confidence = drive_drafter(drafter, ids, features, anchors, k, step)
    width = None
    if verify_width is not None:
        if confidence is None:
            raise ValueError("adaptive verification needs a drafter with a confidence head (DSpark)")
        width = verify_width(confidence).to(ids.device)  # [m] in 1..k
    if verification == "standard":
        alpha = torch.stack(alphas, 1).double()
        if width is not None:  # drafts past the width are never verified: P(L >= i) = 0 for i > width
            alpha = alpha * (torch.arange(k, device=alpha.device) < width[:, None])
        return standard_histogram(alpha)
    residual = torch.stack(residuals, 1) if residuals else torch.zeros(m, 0, device=ids.device)
    w_all = torch.stack(weights, 1).double()
    if width is None:
        return block_histogram(w_all, residual.double())
    hist = torch.zeros(m, k + 1, dtype=torch.float64, device=ids.device)
    for n in width.unique().tolist():  # a block of n drafts: h_n = w_n, nothing after it
        rows = width == n
        hist[rows, : n + 1] = block_histogram(w_all[rows, :n], residual[rows, : n - 1].double())
    return hist


def drive_drafter(drafter, ids, features, anchors, k: int, step):
    """Run the drafter at `anchors` [m] for k drafts, calling step(logits [m,Vd]) → tokens [m] for
    each draft in order; the drafters that read their own drafts read step's tokens. Returns the
    drafts' confidences [m,k] where the drafter's drive_block gives them (DSpark), else None."""
    from models.methods import predictor_of

    predictor = predictor_of(drafter)
    if predictor == "block":  # DFlash: the whole block in one forward, from mask tokens
        drive = getattr(drafter, "drive_block", None)  # DSpark feeds each draft to the next one's bias
        if drive is not None:
            return drive(ids, features, anchors, k, step)
        logits = drafter.block_logits(ids, features, anchors)[:, 1 : k + 1]  # [m,k,Vd]
        for s in range(k):
            step(logits[:, s])
        return None
    elif predictor == "heads":  # Medusa: heads read no tokens
        for logits in drafter.unroll(ids[None], features[None], k):
            step(logits[0, anchors])
    else:  # EAGLE-3, EAGLE-1, MTP: step s reads draft s-1 (only the anchors' chains are ours)
        draft_ids = drafter.draft_ids()

        def pick(logits):  # [1,T,Vd] → [1,T] target ids
            tokens = draft_ids[logits.argmax(-1)]
            tokens[0, anchors] = step(logits[0, anchors])
            return tokens

        steps = drafter.unroll(ids[None], features[None], k, greedy=True, pick=pick)
        step(steps[-1][0, anchors])  # the last draft is fed nowhere


# ----------------------------------------------------------------------------- the held-out walk
def sampled_window(drafter, k: int, length: int, vocab: int, anchors_per_sequence: int | None) -> int:
    """Anchors drafted together by the sampled walk. Each window runs the drafter over the whole
    text k times, so few large windows (a text's every anchor, as a rule) instead of many small
    ones, bounded by the [window, V] distributions of a draft step (2^26 elements: 256 MB in
    float32), by the anchors a capped walk can reach (anchors_per_sequence chains of at most
    k + 1 tokens), and for a block drafter by its attention over the text and every block
    ([window x B, T + window x B], at most 2^26 entries)."""
    from models.methods import predictor_of

    window = window_for(anchors_per_sequence, k, max(128, 2**26 // vocab))
    if predictor_of(drafter) == "block":
        block = getattr(getattr(drafter, "config", None), "block_size", None) or k + 1
        while window > 128 and window * block * (length + window * block) > 2**26:
            window //= 2
    return window


@torch.no_grad()
def sampled_histogram(target, drafter, ids, loss_mask, lengths, k: int, anchors_per_sequence: int | None,
                      temperature: float, verification: str, generator=None, features=None, last_hidden=None,
                      window: int | None = None, per_turn: bool = False, top_k: int = 0, top_p: float = 1.0,
                      verify_width=None) -> torch.Tensor:
    """The sampled counterpart of acceptance.predicted_histogram: expected accepted-length
    histogram [k+1] (float64; [2,k+1] with per_turn: first answers, follow-up turns) of chains
    drafted at temperature T and judged by `verification`, walked as serving walks the answers
    (the next anchor L + 1 tokens on, L drawn from the chain's expected histogram).
    ids, loss_mask [B,T], lengths [B]; features / last_hidden from a target pass the caller made."""
    if temperature <= 0:
        raise ValueError("sampled_histogram is for temperature > 0 (the greedy walk is predicted_histogram)")
    if features is None or last_hidden is None:
        out = target(ids)
        features, last_hidden = drafter.features(out), out.last_hidden
    window = window or sampled_window(drafter, k, ids.shape[1], target.head_weight.shape[0], anchors_per_sequence)
    hist = torch.zeros(2, k + 1, dtype=torch.float64)
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        answer = loss_mask[b, :n].bool().tolist()
        expected_at = {}  # anchor → expected histogram row [k+1]; the walk moves on by a drawn length
        steps = target.chain_steps(ids[b, :n]) if k > 1 else None  # the row's keys and values, once

        def measure(window_anchors):
            anchors = torch.as_tensor(window_anchors, device=ids.device)
            rows = sampled_chain_histograms(target, drafter, ids[b, :n], features[b, :n], last_hidden[b, :n], anchors, k,
                                            temperature, verification, generator, top_k, top_p, steps, verify_width)
            expected_at.update(zip(window_anchors, rows.cpu()))
            return torch.multinomial(rows.float().clamp_min(0), 1, generator=generator)[:, 0].tolist()

        for a, later, _ in walk_answer(answer, anchors_per_sequence, window, measure):
            hist[int(later)] += expected_at[a]
    return hist if per_turn else hist.sum(0)


# ----------------------------------------------------------------------------- promises on file
def setting_key(temperature: float, verification: str) -> str:
    return f"T={float(temperature):g}/{verification}"


def promise_at(predicted: dict | None, temperature: float, verification: str) -> dict | None:
    """The promise for serving at this temperature and verification: the greedy one (the top
    level of predicted_acceptance) at T = 0, else the matching `sampled` entry; None where the
    promise file has none (files written before sampled promises hold the greedy one alone).
    This reads the JSON as a file holds it, unchecked; validate reads the typed
    models.acceptance.Prediction, whose promise_at makes the same choice."""
    if not predicted or "a" not in predicted:
        return None
    if temperature == 0:
        return predicted
    for entry in predicted.get("sampled") or []:
        if float(entry.get("temperature", -1)) == float(temperature) and entry.get("verification") == verification:
            return entry
    return None
