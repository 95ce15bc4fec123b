"""RMSNorm with an optional fused residual add, one launch per call (the runtime's decode and
verify steps are launch-bound: the torch form costs ~8 kernels per norm).

    x [..., H], weight [H], residual [..., H] or None
    → (weight * normalize(h), h) with h = x + residual (or x): h is the next residual

Numerics of transformers' Llama: the sum rounded to x's dtype, statistics in float32, the
normalised value cast to x's dtype before the weight multiplies it.
"""
from __future__ import annotations

import torch

from kernels import use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
                         stride_x, stride_r, stride_o, stride_s, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=inside, other=0.0)
            h = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_s + cols, h, mask=inside)
        else:
            h = x
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / H + eps)
        normed = (hf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if triton is None:
        raise RuntimeError("triton is not installed")
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for a hidden size of {H}")
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual of shape {tuple(residual.shape)} for x of shape {tuple(x.shape)}")
        r2 = residual.reshape(-1, H).to(x.dtype)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        h2 = torch.empty_like(x2)
    else:
        r2 = h2 = x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, h2, H, eps, x2.stride(0), r2.stride(0), out.stride(0),
                                         h2.stride(0), HAS_RESIDUAL=residual is not None,
                                         BLOCK=triton.next_power_of_2(H))
    return out.view(x.shape), (h2.view(x.shape) if residual is not None else x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The kernel on CUDA tensors (unless DRAFTSMITH_KERNELS=0), the reference elsewhere."""
    if use_kernel(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
