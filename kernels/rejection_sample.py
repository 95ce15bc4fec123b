"""Standard speculative-sampling verification from given uniforms, fused: the acceptance scan
over the k drafts, the residual distribution at the first rejection (or the target's after
the last draft) and an inverse-CDF draw from it, one program per row.

    drafts [B,k] (target ids, -1 = empty slot), draft_probs [B,k,V] or None (q = 1 at the
    drafted token), target_probs [B,k+1,V], u_accept [B,k], u_sample [B] uniforms in [0,1)
    → accepted [B] in 0..k, next_token [B]

Draft j is accepted when u_accept[j] * q_j(d_j) < p_j(d_j) (probability min(1, p/q)); the next
token is the first index whose running mass exceeds u_sample * total mass of
normalize(max(p_j - q_j, 0)) at the first rejection j (p itself if that vanishes), or of p_k
when all k were accepted. Given the same uniforms, kernel and reference agree token for token.
"""
from __future__ import annotations

import torch

from draftsmith_kernels.dispatch import use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _source(drafts, draft_probs, target_probs, accepted):
    """[B,V] the distribution the next token comes from (unnormalised)."""
    B, k = drafts.shape
    p = target_probs.float()
    rows = torch.arange(B, device=drafts.device)
    j = accepted.clamp_max(max(k - 1, 0))
    p_j = p[rows, accepted]
    if k == 0:
        return p_j
    d_j = drafts[rows, j]
    valid = (d_j >= 0) & (accepted < k)
    if draft_probs is None:
        q_j = torch.zeros_like(p_j).scatter_(1, d_j.clamp_min(0)[:, None], 1.0)
    else:
        q_j = draft_probs.float()[rows, j]
    q_j = q_j * valid[:, None]
    residual = torch.where((accepted < k)[:, None], (p_j - q_j).clamp_min(0), p_j)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_j)


def rejection_sample_reference(drafts, draft_probs, target_probs, u_accept, u_sample):
    B, k = drafts.shape
    p = target_probs.float()
    if k:
        d = drafts.clamp_min(0)
        p_d = p[:, :k].gather(2, d[..., None]).squeeze(-1)
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.float().gather(2, d[..., None]).squeeze(-1)
        ok = (u_accept * q_d < p_d) & (drafts >= 0)
        accepted = ok.long().cumprod(1).sum(1)
    else:
        accepted = torch.zeros(B, dtype=torch.long, device=drafts.device)
    return accepted, inverse_cdf(_source(drafts, draft_probs, target_probs, accepted), u_sample)


def inverse_cdf(source, u):
    """[B,V] unnormalised masses, u [B] → the first index whose running mass exceeds u * total
    (the last nonzero one when rounding puts u * total at the very end)."""
    cdf = source.cumsum(-1)
    goal = u[:, None] * cdf[:, -1:]
    idx = (cdf > goal).long().argmax(-1)
    last_nonzero = (source > 0).long().cumsum(-1).argmax(-1)
    return torch.where((cdf > goal).any(-1), idx, last_nonzero)


if triton is not None:

    @triton.jit
    def _rejection_kernel(p_ptr, q_ptr, d_ptr, ua_ptr, us_ptr, acc_ptr, out_ptr, V, K,
                          stride_pb, stride_pq, stride_qb, stride_qq, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int64)
        for j in range(0, K):
            d = tl.load(d_ptr + row * K + j)
            dc = tl.maximum(d, 0)
            pd = tl.load(p_ptr + row * stride_pb + j * stride_pq + dc).to(tl.float32)
            if HAS_Q:
                qd = tl.load(q_ptr + row * stride_qb + j * stride_qq + dc).to(tl.float32)
            else:
                qd = 1.0
            u = tl.load(ua_ptr + row * K + j)
            ok = (u * qd < pd) & (d >= 0)
            alive = tl.where(ok, alive, 0)
            acc += alive
        use_res = acc < K
        jq = tl.minimum(acc, tl.maximum(K - 1, 0))
        d_j = tl.load(d_ptr + row * K + jq, mask=jq < K, other=-1)
        valid_j = use_res & (d_j >= 0)
        p_row = p_ptr + row * stride_pb + acc * stride_pq
        q_row = q_ptr + row * stride_qb + jq * stride_qq
        # total residual mass
        total = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            pv = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
            if HAS_Q:
                qv = tl.load(q_row + cols, mask=inside, other=0.0).to(tl.float32) * tl.where(valid_j, 1.0, 0.0)
            else:
                qv = tl.where((cols == d_j) & valid_j, 1.0, 0.0)
            r = tl.where(use_res, tl.maximum(pv - qv, 0.0), pv)
            total += tl.sum(r, 0)
        fallback = total <= 0.0  # the residual vanished: p itself
        if fallback:
            total = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                total += tl.sum(tl.load(p_row + cols, mask=cols < V, other=0.0).to(tl.float32), 0)
        goal = tl.load(us_ptr + row) * total
        running = tl.zeros([], tl.float32)
        found = tl.full([], V, tl.int64)
        last_nonzero = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            pv = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
            if HAS_Q:
                qv = tl.load(q_row + cols, mask=inside, other=0.0).to(tl.float32) * tl.where(valid_j, 1.0, 0.0)
            else:
                qv = tl.where((cols == d_j) & valid_j, 1.0, 0.0)
            r = tl.where(use_res & (~fallback), tl.maximum(pv - qv, 0.0), pv)
            c = tl.cumsum(r, 0) + running
            hit = tl.min(tl.where((c > goal) & inside, cols.to(tl.int64), V), 0)
            found = tl.minimum(found, hit)
            last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where((r > 0) & inside, cols.to(tl.int64), 0), 0))
            running += tl.sum(r, 0)
        tl.store(acc_ptr + row, acc)
        tl.store(out_ptr + row, tl.where(found < V, found, last_nonzero))


def verification_operands(drafts, draft_probs, target_probs):
    """Shared by the rejection and block kernels' wrappers: p [B,k+1,V] and q (p itself as a
    placeholder without draft probabilities) with contiguous rows, and the two [B] outputs."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, q, V = target_probs.shape
    k = drafts.shape[1]
    if q != k + 1:
        raise ValueError(f"target_probs have {q} positions for {k} drafts (need k+1)")
    p = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    qp = p if draft_probs is None else (draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous())
    accepted = torch.empty(B, dtype=torch.long, device=p.device)
    out = torch.empty(B, dtype=torch.long, device=p.device)
    return p, qp, accepted, out


def rejection_sample_triton(drafts, draft_probs, target_probs, u_accept, u_sample):
    p, qp, accepted, out = verification_operands(drafts, draft_probs, target_probs)
    (B, _, V), k = p.shape, drafts.shape[1]
    drafts, u_accept, u_sample = drafts.contiguous(), u_accept.float().contiguous(), u_sample.float().contiguous()
    if B:
        _rejection_kernel[(B,)](p, qp, drafts, u_accept, u_sample, accepted, out, V, k, p.stride(0), p.stride(1),
                                qp.stride(0), qp.stride(1), HAS_Q=draft_probs is not None,
                                BLOCK=min(4096, triton.next_power_of_2(V)))
    return accepted, out


def rejection_sample(drafts, draft_probs, target_probs, u_accept, u_sample):
    """The kernel on CUDA tensors, the reference elsewhere."""
    fn = rejection_sample_triton if use_kernel(target_probs) else rejection_sample_reference
    return fn(drafts, draft_probs, target_probs, u_accept, u_sample)
