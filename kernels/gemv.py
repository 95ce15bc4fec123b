"""One-row matrix-vector products for the drafter's chain steps, spread over the whole GPU.

    gemv(x [1,K], weight [N,K], residual [1,N] | None, out=None) -> [1,N]     x @ weight.T (+ residual)
    swiglu_gemv(gate_up [1,2I], weight [N,I], residual, out=None) -> [1,N]   silu(gate) * up first

Why: a chain step of the EAGLE-3 drafter (batch 1) multiplies one row by each projection. cuBLAS
tiles such a product over N alone, 64 columns a block, and walks K inside each block: the
drafter's q/k/v projection (N = 960, K = 1,152) runs on 15 blocks and its down projection
(N = 576, K = 1,536) on 9, 5.2 and 4.7 µs on an H200 for 2.2 and 1.8 MB of weights (traced: a
third of a chain step). Here each program takes BLOCK_N rows of the weight (sized so that
100-250 programs share the work) and walks K; `swiglu_gemv` forms silu(gate) * up as it reads
the down projection's input (no launch of its own), and the residual sum is rounded once, as
`addmm` with beta = 1 rounds it.

Several rows (a tree level's 8 frontier nodes, the advance's path) stay with cuBLAS: the same
kernel widened to M <= 16 rows (an [M, BLOCK_N, BLOCK_K] product in registers, summed over K)
made a 4-8-40-4 tree's drafting 62 µs slower a step on an H200 with only the down projection
through it (silu_mul's launch saved), 223 µs with every projection.

Numerics: products summed in float32 (in another order than cuBLAS: last-bit differences in
16-bit outputs); silu(gate) and the product rounded to the input dtype as `silu_mul` does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith_kernels.dispatch import use_kernel
from draftsmith_kernels.silu_mul import silu_mul_reference

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x, weight)
    return y if residual is None else residual + y


def swiglu_gemv_reference(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    return gemv_reference(silu_mul_reference(gate_up), weight, residual)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, res_ptr, out_ptr, N, K, stride_w, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns of this program
        row_ok = rows < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)  # [BK]
            col_ok = cols < K
            if SWIGLU:  # x = silu(gate) * up, gate in x_ptr[0:K], up in x_ptr[K:2K]
                g = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
                s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
                x = (s * u).to(x_ptr.dtype.element_ty).to(tl.float32)
            else:
                x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [BN,BK]
            acc += tl.sum(w * x[None, :], axis=1)
        if HAS_RES:  # read before the store: out may be the residual itself (h += ...)
            acc += tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def _launch(x, weight, residual, out, swiglu: bool):
    if triton is None:
        raise RuntimeError("triton is not installed")
    N, K = weight.shape
    width = 2 * K if swiglu else K
    if x.numel() != width:
        raise ValueError(f"gemv takes one row of {width} values, got shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs a weight with a contiguous last dimension")
    if residual is not None and (residual.numel() != N or not residual.is_contiguous()):
        raise ValueError(f"residual must be one contiguous row of {N}, got shape {tuple(residual.shape)}")
    x = x.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    elif out.numel() != N or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be one contiguous row of {N} on {x.device}, got shape {tuple(out.shape)}")
    # rows per program: the largest power of 2 not above N / 128, 1 to 16, so about 128-256
    # programs share a large N (N = 576 or 960: 4 rows, 144 or 240 programs; 3,072: 16 rows, 192)
    BLOCK_N = max(1, min(16, triton.next_power_of_2(N // 128 + 1) // 2))
    grid = (triton.cdiv(N, BLOCK_N),)
    _gemv_kernel[grid](x, weight, residual if residual is not None else out, out, N, K, weight.stride(0),
                       HAS_RES=residual is not None, SWIGLU=swiglu, BLOCK_N=BLOCK_N, BLOCK_K=256)
    return out


def gemv_triton(x, weight, residual=None, out=None):
    return _launch(x, weight, residual, out, swiglu=False)


def swiglu_gemv_triton(gate_up, weight, residual=None, out=None):
    return _launch(gate_up, weight, residual, out, swiglu=True)


def one_row(x: torch.Tensor) -> bool:
    """Whether x [..., K] is a single row on a device where the kernels run."""
    return x.numel() == x.shape[-1] and use_kernel(x)


def gemv(x, weight, residual=None, out=None):
    """x @ weight.T (+ residual) for one row: the kernel on CUDA, the reference elsewhere. `out`
    may be `residual` (an in-place residual sum)."""
    if one_row(x):
        return gemv_triton(x, weight, residual, out)
    y = gemv_reference(x, weight, residual)
    return y if out is None else out.copy_(y)


def swiglu_gemv(gate_up, weight, residual=None, out=None):
    """(silu(gate) * up) @ weight.T (+ residual) for one row, as `gemv`."""
    if one_row(gate_up):
        return swiglu_gemv_triton(gate_up, weight, residual, out)
    y = swiglu_gemv_reference(gate_up, weight, residual)
    return y if out is None else out.copy_(y)
