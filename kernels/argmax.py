"""Argmax over a large vocabulary in two short launches, optionally mapped through an id table
and written into a strided output (a draft chain's column).

    x [R,V] (logits; any float dtype), ids [V'] int64 or None, out [R] int64 (any stride)
    → out[r] = ids[argmax x[r]] (or argmax x[r]); ties go to the lowest index, as torch.argmax

Why a kernel: one program scanning a row of 49,152 logits took 13-17 us on an H200, longer than
the lm_head matmul before it. Here chunks of CHUNK columns are scanned in parallel
(`_argmax_chunks_kernel`, one program per (row, chunk)), then merged per row; the merge also
maps draft-vocabulary rows to target ids and stores into the caller's buffer, which saves the
index and copy launches a drafter's chain would otherwise pay per step.
"""
from __future__ import annotations

import torch

from draftsmith_kernels.dispatch import INTERPRETED, use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CHUNK = 2048  # columns per program of the first launch
# columns per program as the runtime calls it: CHUNK on a GPU; 16,384 in Triton's CPU interpreter,
# whose cost is per program (a verify over a 49,152-token vocabulary: 24 programs a row), unless
# a caller asks for chunks of its own (the kernels' tests take the GPU's)
RUNTIME_CHUNK = 16384 if INTERPRETED else CHUNK


def argmax_rows_reference(x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    choice = x.argmax(-1)
    out.copy_(choice if ids is None else ids[choice])
    return out


if triton is not None:

    @triton.jit
    def _argmax_chunks_kernel(x_ptr, best_ptr, index_ptr, V, stride_x, NSPLIT, CHUNK: tl.constexpr):
        """One (row, chunk): the chunk's maximum and the first column holding it."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        cols = split * CHUNK + tl.arange(0, CHUNK)
        inside = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax (tl.max would skip it)
        m = tl.max(x, 0)
        slot = row * NSPLIT + split
        tl.store(best_ptr + slot, m)
        # first column holding the maximum; a chunk of -inf only names its first real column
        tl.store(index_ptr + slot, tl.min(tl.where((x == m) & inside, cols, V - 1), 0).to(tl.int64))

    @triton.jit
    def merge_chunks(best_ptr, index_ptr, row, NSPLIT, BLOCK_S: tl.constexpr):
        """The row's argmax from its chunks' (maximum, first column): the first chunk holding the
        maximum, so the lowest column wins a tie, as in one sequential scan."""
        j = tl.arange(0, BLOCK_S)
        used = j < NSPLIT
        best = tl.load(best_ptr + row * NSPLIT + j, mask=used, other=float("-inf"))
        index = tl.load(index_ptr + row * NSPLIT + j, mask=used, other=0)
        m = tl.max(best, 0)
        first = tl.min(tl.where(used & (best == m), j, BLOCK_S), 0)
        return tl.sum(tl.where(j == first, index, 0), 0)

    @triton.jit
    def _argmax_merge_kernel(best_ptr, index_ptr, ids_ptr, out_ptr, NSPLIT, stride_out,
                             HAS_IDS: tl.constexpr, BLOCK_S: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        choice = merge_chunks(best_ptr, index_ptr, row, NSPLIT, BLOCK_S)
        if HAS_IDS:
            choice = tl.load(ids_ptr + choice)
        tl.store(out_ptr + row * stride_out, choice)


def argmax_chunks(x: torch.Tensor, chunk: int = RUNTIME_CHUNK):
    """First launch: x [R,V] → (best [R,NSPLIT] float32, index [R,NSPLIT] int64, NSPLIT), chunks
    of `chunk` columns (a power of two)."""
    R, V = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    nsplit = triton.cdiv(V, chunk)
    best = torch.empty(R, nsplit, dtype=torch.float32, device=x.device)
    index = torch.empty(R, nsplit, dtype=torch.long, device=x.device)
    if R:
        _argmax_chunks_kernel[(R, nsplit)](x, best, index, V, x.stride(0), nsplit, CHUNK=chunk)
    return best, index, nsplit


def argmax_rows_triton(x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor | None = None,
                       chunk: int = RUNTIME_CHUNK) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2 or out.shape != x.shape[:1] or out.dtype != torch.long:
        raise ValueError(f"argmax of x {tuple(x.shape)} into out {tuple(out.shape)} {out.dtype}: need [R,V] and [R] int64")
    best, index, _ = argmax_chunks(x, chunk)
    return merge_chunks_into(best, index, out, ids)


def merge_chunks_into(best: torch.Tensor, index: torch.Tensor, out: torch.Tensor, ids: torch.Tensor | None = None):
    """Second launch: each row's chunks (best, index [R,NSPLIT]) → out[r] (mapped through ids);
    also the merge of kernels/lm_head_argmax.py, whose chunks are lm_head slices."""
    R, nsplit = best.shape
    if R:
        _argmax_merge_kernel[(R,)](best, index, ids if ids is not None else index, out, nsplit, out.stride(0),
                                   HAS_IDS=ids is not None, BLOCK_S=triton.next_power_of_2(nsplit))
    return out


def argmax_rows(x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on CUDA tensors, the reference elsewhere."""
    fn = argmax_rows_triton if use_kernel(x) else argmax_rows_reference
    return fn(x, out, ids)
