"""SwiGLU's gate: silu(gate) * up from the fused gate_up projection, one launch.

    gate_up [..., 2I] (gate in the first half, up in the second) → [..., I]

Numerics of torch's `F.silu(gate) * up`: silu rounded to the input dtype, then the product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import use_kernel

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
    """The kernel on CUDA tensors (unless DRAFTSMITH_KERNELS=0), the reference elsewhere."""
    if use_kernel(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def swiglu_down_reference(gate_up: torch.Tensor, down_weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h += silu(gate) * up @ down_weight.T in place: gate_up [R,2I], down_weight [H,I], h [R,H]
    (the product summed in float32 and added to h before one rounding, as addmm_ does)."""
    return h.addmm_(silu_mul_reference(gate_up), down_weight.t())


if triton is not None:

    @triton.jit
    def _swiglu_down_kernel(gu_ptr, w_ptr, h_ptr, R, H, I, stride_gu, stride_w, stride_h, IEEE: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
        """One (block of BLOCK_N output columns, block of BLOCK_R rows): the gate computed from
        gate_up tile by tile (every program recomputes it: R x I values, cheaper than a launch),
        multiplied into the down projection's rows, added to h."""
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_in, col_in = rows < R, cols < H
        i = tl.arange(0, BLOCK_I)
        gu_rows = gu_ptr + rows.to(tl.int64)[:, None] * stride_gu
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            i_in = i0 + i < I
            mask = row_in[:, None] & i_in[None, :]
            g = tl.load(gu_rows + i0 + i[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(gu_rows + I + i0 + i[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(h_ptr.dtype.element_ty).to(tl.float32)  # silu rounded, as silu_mul
            act = (s * u).to(h_ptr.dtype.element_ty)  # [BLOCK_R, BLOCK_I]
            w = tl.load(w_rows + i0 + i[None, :], mask=col_in[:, None] & i_in[None, :], other=0.0)
            if IEEE:  # float32 products, exact: float32 weights, or the interpreter (kernels/lm_head_argmax.py)
                acc = tl.dot(act.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(act, tl.trans(w), acc)
        out = h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :]
        both = row_in[:, None] & col_in[None, :]
        old = tl.load(out, mask=both, other=0.0).to(tl.float32)
        tl.store(out, (old + acc).to(h_ptr.dtype.element_ty), mask=both)


def swiglu_down_triton(gate_up: torch.Tensor, down_weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    from kernels.lm_head_argmax import INTERPRETED

    R, two_i = gate_up.shape
    H, I = down_weight.shape
    if two_i != 2 * I or h.shape != (R, H) or h.dtype != gate_up.dtype:
        raise ValueError(f"swiglu_down: gate_up {tuple(gate_up.shape)}, down {tuple(down_weight.shape)}, h "
                         f"{tuple(h.shape)} {h.dtype}: need [R,2I], [H,I] and [R,H] of gate_up's dtype")
    if gate_up.stride(-1) != 1 or down_weight.stride(-1) != 1 or h.stride(-1) != 1:
        raise ValueError("swiglu_down: every operand needs a unit stride along its last dimension")
    if R:
        BLOCK_R, BLOCK_N = 16, 32  # 18 programs for a 576-wide output
        _swiglu_down_kernel[(triton.cdiv(H, BLOCK_N), triton.cdiv(R, BLOCK_R))](
            gate_up, down_weight, h, R, H, I, gate_up.stride(0), down_weight.stride(0), h.stride(0),
            IEEE=down_weight.dtype == torch.float32 or INTERPRETED, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_I=64)
    return h


def swiglu_into(h: torch.Tensor, x: torch.Tensor, gate_up_weight: torch.Tensor, down: torch.nn.Linear) -> torch.Tensor:
    """h += down(silu(gate(x)) * up(x)), in place, for h [..., H] (a fresh residual sum, nobody
    else's tensor), x [..., H], gate_up_weight [2I, H]: the gate and the residual add done by
    the down projection (one kernel on a GPU: `swiglu_down`; addmm_ with beta = 1 otherwise), two
    launches fewer per layer than a matmul, the gate and an add. The sum is rounded once, where
    matmul-then-add rounds the product first."""
    gate_up = F.linear(x, gate_up_weight)  # [..., 2I]
    if down.bias is not None or not h.is_contiguous() or h.dtype != gate_up.dtype:
        return h.add_(down(silu_mul(gate_up)))
    rows = h.view(-1, h.shape[-1])
    fn = swiglu_down_triton if use_kernel(h) else swiglu_down_reference
    fn(gate_up.reshape(-1, gate_up.shape[-1]), down.weight, rows)
    return h
