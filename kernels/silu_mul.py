"""SwiGLU's gate: silu(gate) * up from the fused gate_up projection, one launch.

    gate_up [..., 2I] (gate in the first half, up in the second) → [..., I]

Numerics of torch's `F.silu(gate) * up`: silu rounded to the input dtype, then the product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith_kernels.dispatch import use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(in_ptr, out_ptr, I, stride_in, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < I
        g = tl.load(in_ptr + row * stride_in + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(in_ptr + row * stride_in + I + cols, mask=inside, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up has an odd last dimension {two_i}")
    I = two_i // 2
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = min(1024, triton.next_power_of_2(I))
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(I, BLOCK))](x, out, I, x.stride(0), out.stride(0), BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], I)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The kernel on CUDA tensors, the reference elsewhere."""
    if use_kernel(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def swiglu_into(h: torch.Tensor, x: torch.Tensor, gate_up_weight: torch.Tensor, down: torch.nn.Linear) -> torch.Tensor:
    """h += down(silu(gate(x)) * up(x)), in place, for h [..., H] (a fresh residual sum, nobody
    else's tensor), x [..., H], gate_up_weight [2I, H]: the residual add done by the down
    projection's GEMM (beta = 1), a launch fewer per layer than a matmul and then an add. The
    sum is rounded once, where matmul-then-add rounds the product first."""
    act = silu_mul(F.linear(x, gate_up_weight))  # [..., I]
    if down.bias is not None or not h.is_contiguous() or h.dtype != act.dtype:
        return h.add_(down(act))
    h.view(-1, h.shape[-1]).addmm_(act.reshape(-1, act.shape[-1]), down.weight.t())
    return h
