"""Attention for training-time test (TTT) unrolls, exact and without masked-out work.

At unroll step s, query t attends to the step-0 keys at positions <= t (causal) and to the key
at position t of each later step 1..s (its own draft chain). A dense [T, (s+1)T] mask would
spend (s+1)x the causal work on zeros; instead:

    causal part:   o_c, lse_c = flash_attention(q, k_0, v_0, causal)        [B,h,T,d], [B,h,T]
    chain part:    z_j = scale * <q_t, k_j,t>                               [B,h,T] for j = 1..s
    merged:        lse = logsumexp(lse_c, z_1..z_s)
                   o   = exp(lse_c - lse) o_c + sum_j exp(z_j - lse) v_j

The backward reuses the flash backward kernel with the *merged* output and log-sum-exp, which
yields exactly the gradients of the causal keys under the joint softmax (the trick ring
attention uses), plus closed-form gradients for the diagonal terms.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ttt_mask(T: int, steps_so_far: int, device) -> torch.Tensor:
    """[T, steps_so_far*T] bool: query t sees step-0 keys <= t and key t of each later step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (steps_so_far - 1), dim=1)


def ttt_attention_reference(q, keys: list, values: list) -> torch.Tensor:
    """Dense-mask reference. q [B,h,T,d]; keys/values: s+1 tensors [B,h,T,d]."""
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
    mask = ttt_mask(q.shape[2], len(keys), q.device)
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)


def _flash_forward(q, k, v, scale):
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return out[0], out[1], out
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, None


def _flash_backward(dout, q, k, v, out, lse, scale, saved):
    if q.is_cuda:
        _, _, cum_q, cum_k, max_q, max_k, rng, unused, _ = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale)


class _TTTFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, kc, vc):
        # kc, vc [n, B, h, T, d]: the chain keys/values of steps 1..s stacked
        scale = q.shape[-1] ** -0.5
        o_c, lse_c, saved = _flash_forward(q, k0, v0, scale)
        z = (q.unsqueeze(0).float() * kc.float()).sum(-1) * scale  # [n,B,h,T]
        lse = torch.logsumexp(torch.cat([lse_c.unsqueeze(0).float(), z], 0), 0)  # [B,h,T]
        w_c = torch.exp(lse_c.float() - lse).unsqueeze(-1)
        w = torch.exp(z - lse).unsqueeze(-1)  # [n,B,h,T,1]
        o = (w_c * o_c.float() + (w * vc.float()).sum(0)).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kc, vc, o, lse, w)
        ctx.saved_flash = saved
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, kc, vc, o, lse, w = ctx.saved_tensors
        scale = ctx.scale
        dout = dout.contiguous()
        lse_for_kernel = lse.to(torch.float32).contiguous()
        dq, dk0, dv0 = _flash_backward(dout, q, k0, v0, o, lse_for_kernel, scale, ctx.saved_flash)
        D = (dout.float() * o.float()).sum(-1, keepdim=True)  # [B,h,T,1]
        dv = w * dout.float().unsqueeze(0)  # [n,B,h,T,d]
        dz = w * ((dout.float().unsqueeze(0) * vc.float()).sum(-1, keepdim=True) - D)  # [n,B,h,T,1]
        dq = dq.float() + (dz * kc.float()).sum(0) * scale
        dk = dz * q.float().unsqueeze(0) * scale
        return dq.to(q.dtype), dk0, dv0, dk.to(kc.dtype), dv.to(vc.dtype)


def flash_supported(q: torch.Tensor) -> bool:
    if q.is_cuda:
        return q.dtype in (torch.float16, torch.bfloat16)
    return True


def ttt_attention(q, keys: list, values: list) -> torch.Tensor:
    """Exact TTT attention. q [B,h,T,d]; keys/values: s+1 tensors [B,h,T,d] (step 0 first)."""
    # under CPU autocast the projections can come out in mixed dtypes (q float32 from the rotary
    # embedding, k / v bfloat16): the flash kernels take one dtype, the widest of them
    dtype = q.dtype
    for t in (*keys, *values):
        dtype = torch.promote_types(dtype, t.dtype)
    q, keys, values = q.to(dtype), [kk.to(dtype) for kk in keys], [vv.to(dtype) for vv in values]
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
    if not flash_supported(q):
        return ttt_attention_reference(q, keys, values)
    return _TTTFlash.apply(q.contiguous(), keys[0].contiguous(), values[0].contiguous(),
                           torch.stack(keys[1:]), torch.stack(values[1:]))
