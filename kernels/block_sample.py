"""Block verification (Sun et al. 2024) from given uniforms, fused: the weight recurrence, the
residual mass after every prefix, the keep decisions and an inverse-CDF draw of the next
token, one program per row.

    drafts [B,k] (-1 = empty slot), draft_probs [B,k,V] or None (q = 1 at the drafted token),
    target_probs [B,k+1,V], eta [B,k], u_sample [B] uniforms → accepted [B], next_token [B]

w_0 = 1, w_i = min(w_{i-1} p_i(d_i) / q_i(d_i), 1); after i drafts the residual is
max(w_i p_{i+1} - q_{i+1}, 0) with mass R_i; prefix i is kept when eta_i <= h_i with
h_i = R_i / (R_i + 1 - w_i) (h = w at a row's last draft); the accepted length is the
largest kept i, and the next token is drawn from the residual after it (from p after the
whole block, or from p where the residual vanishes). Kernel and reference agree token for
token given the same uniforms.
"""
from __future__ import annotations

import torch

from draftsmith_kernels.dispatch import use_kernel
from draftsmith_kernels.rejection_sample import inverse_cdf, verification_operands

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def block_sample_reference(drafts, draft_probs, target_probs, eta, u_sample):
    B, k = drafts.shape
    p = target_probs.float()
    dev = drafts.device
    rows = torch.arange(B, device=dev)
    if k == 0:
        return torch.zeros(B, dtype=torch.long, device=dev), inverse_cdf(p[:, 0], u_sample)
    valid = drafts >= 0
    length = valid.long().cumprod(1).sum(1)
    d = drafts.clamp_min(0)
    q = torch.zeros_like(p[:, :k]).scatter_(2, d[..., None], 1.0) if draft_probs is None else draft_probs.float()
    p_d = p[:, :k].gather(2, d[..., None]).squeeze(-1)
    q_d = q.gather(2, d[..., None]).squeeze(-1).clamp_min(1e-30)
    weights = [torch.ones(B, device=dev)]
    for i in range(k):
        weights.append(torch.minimum(weights[-1] * p_d[:, i] / q_d[:, i], torch.ones_like(weights[-1])))
    w = torch.stack(weights, 1)  # [B,k+1]
    residual = (w[:, :k, None] * p[:, :k] - q).clamp_min(0)  # [B,k,V]: after i drafts, i = 0..k-1
    mass = residual.sum(-1)
    idx = torch.arange(1, k + 1, device=dev)
    denom = mass[:, 1:] + 1 - w[:, 1:k]
    h_mid = torch.where(denom > 0, mass[:, 1:] / denom.clamp_min(1e-30), torch.ones_like(denom))
    h = torch.cat([h_mid, torch.zeros(B, 1, device=dev)], 1)
    h = torch.where(idx[None] == length[:, None], w[:, 1:], h)
    h = torch.where(idx[None] > length[:, None], torch.zeros_like(h), h)
    kept = (eta <= h) & valid
    tau = torch.where(kept.any(1), k - kept.flip(1).long().argmax(1), torch.zeros(B, dtype=torch.long, device=dev))
    res = residual[rows, tau.clamp_max(k - 1)]
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p[rows, tau])
    source = torch.where((tau == length)[:, None], p[rows, tau], res)
    return tau, inverse_cdf(source, u_sample)


if triton is not None:

    @triton.jit
    def _row_residual(p_row, q_row, d, w, V, cols_base, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
        """Mass of max(w p - q, 0) over the vocabulary (q one-hot at d without draft probs)."""
        total = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + cols_base
            inside = cols < V
            pv = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
            if HAS_Q:
                qv = tl.load(q_row + cols, mask=inside, other=0.0).to(tl.float32)
            else:
                qv = tl.where(cols == d, 1.0, 0.0)
            total += tl.sum(tl.where(inside, tl.maximum(w * pv - qv, 0.0), 0.0), 0)
        return total

    @triton.jit
    def _block_kernel(p_ptr, q_ptr, d_ptr, eta_ptr, us_ptr, acc_ptr, out_ptr, V, K,
                      stride_pb, stride_pq, stride_qb, stride_qq, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols_base = tl.arange(0, BLOCK)
        # the row's block ends at its first empty slot
        length = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int64)
        for i in range(0, K):
            alive = tl.where(tl.load(d_ptr + row * K + i) >= 0, alive, 0)
            length += alive
        w = tl.full([], 1.0, tl.float32)
        tau = tl.zeros([], tl.int64)
        w_tau = tl.full([], 1.0, tl.float32)
        for i in range(1, K + 1):  # prefix of i drafts
            d = tl.maximum(tl.load(d_ptr + row * K + i - 1), 0)
            pd = tl.load(p_ptr + row * stride_pb + (i - 1) * stride_pq + d).to(tl.float32)
            if HAS_Q:
                qd = tl.maximum(tl.load(q_ptr + row * stride_qb + (i - 1) * stride_qq + d).to(tl.float32), 1e-30)
            else:
                qd = 1.0
            w = tl.minimum(w * pd / qd, 1.0)
            if i < K:
                d_next = tl.maximum(tl.load(d_ptr + row * K + i), 0)
                mass = _row_residual(p_ptr + row * stride_pb + i * stride_pq, q_ptr + row * stride_qb + i * stride_qq,
                                     d_next, w, V, cols_base, HAS_Q, BLOCK)
            else:
                mass = tl.zeros([], tl.float32)
            denom = mass + 1.0 - w
            h = tl.where(denom > 0, mass / tl.maximum(denom, 1e-30), 1.0)
            h = tl.where(i == length, w, tl.where(i > length, 0.0, h))
            keep = (tl.load(eta_ptr + row * K + i - 1) <= h) & (i <= length)
            tau = tl.where(keep, i, tau)
            w_tau = tl.where(keep, w, w_tau)
        # next token: from p after the whole block, else from the residual after tau drafts
        whole = tau == length
        p_row = p_ptr + row * stride_pb + tau * stride_pq
        jq = tl.minimum(tau, tl.maximum(K - 1, 0))
        q_row = q_ptr + row * stride_qb + jq * stride_qq
        d_q = tl.maximum(tl.load(d_ptr + row * K + jq, mask=jq < K, other=0), 0)
        mass = _row_residual(p_row, q_row, d_q, w_tau, V, cols_base, HAS_Q, BLOCK)
        use_p = whole | (mass <= 0.0)
        total = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + cols_base
            total += tl.sum(tl.load(p_row + cols, mask=cols < V, other=0.0).to(tl.float32), 0)
        total = tl.where(use_p, total, mass)
        goal = tl.load(us_ptr + row) * total
        running = tl.zeros([], tl.float32)
        found = tl.full([], V, tl.int64)
        last_nonzero = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + cols_base
            inside = cols < V
            pv = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
            if HAS_Q:
                qv = tl.load(q_row + cols, mask=inside, other=0.0).to(tl.float32)
            else:
                qv = tl.where(cols == d_q, 1.0, 0.0)
            r = tl.where(inside, tl.where(use_p, pv, tl.maximum(w_tau * pv - qv, 0.0)), 0.0)
            c = tl.cumsum(r, 0) + running
            found = tl.minimum(found, tl.min(tl.where((c > goal) & inside, cols.to(tl.int64), V), 0))
            last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(r > 0, cols.to(tl.int64), 0), 0))
            running += tl.sum(r, 0)
        tl.store(acc_ptr + row, tau)
        tl.store(out_ptr + row, tl.where(found < V, found, last_nonzero))


def block_sample_triton(drafts, draft_probs, target_probs, eta, u_sample):
    p, qp, accepted, out = verification_operands(drafts, draft_probs, target_probs)
    (B, _, V), k = p.shape, drafts.shape[1]
    if B:
        _block_kernel[(B,)](p, qp, drafts.contiguous(), eta.float().contiguous(), u_sample.float().contiguous(), accepted, out,
                            V, k, p.stride(0), p.stride(1), qp.stride(0), qp.stride(1), HAS_Q=draft_probs is not None,
                            BLOCK=min(4096, triton.next_power_of_2(V)))
    return accepted, out


def block_sample(drafts, draft_probs, target_probs, eta, u_sample):
    """The kernel on CUDA tensors, the reference elsewhere."""
    fn = block_sample_triton if use_kernel(target_probs) else block_sample_reference
    return fn(drafts, draft_probs, target_probs, eta, u_sample)
