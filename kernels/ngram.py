"""Prompt lookup over a batch on the device: for each row, the k tokens after the most recent
earlier occurrence of its longest suffix (max_n down to min_n tokens), as the host n-gram
proposer's `longest_suffix_match` finds it; -1 where there is none or the row runs out.

    buffer [B,S] token ids (beyond each row's length: anything), lengths [B] → drafts [B,k]

The torch form builds every window of every size (about 120 launches per draft); the kernel is
one program per row scanning its tokens, one launch.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def ngram_drafts_reference(buffer: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """Vectorised prompt lookup over a batch on the device: for each row, the k tokens after
    the most recent earlier occurrence of its longest suffix (min_n..max_n tokens), as
    `longest_suffix_match` finds it; -1 where there is none or the row runs out.

    buffer [B,S] token ids (beyond each row's length: anything), lengths [B] → [B,k]."""
    B, S = buffer.shape
    dev = buffer.device
    found = torch.zeros(B, dtype=torch.bool, device=dev)
    cont = torch.zeros(B, dtype=torch.long, device=dev)  # where the continuation starts
    for n in range(max_n, min_n - 1, -1):
        if n >= S:
            continue
        windows = buffer.unfold(1, n, 1)  # [B, S-n+1, n]: windows[b, s] = buffer[b, s:s+n]
        suffix_idx = (lengths - n).clamp_min(0)[:, None] + torch.arange(n, device=dev)
        suffix = buffer.gather(1, suffix_idx)  # [B, n]
        starts = torch.arange(windows.shape[1], device=dev)
        match = (windows == suffix[:, None, :]).all(-1) & (starts[None] <= (lengths - n - 1)[:, None])
        latest = torch.where(match, starts[None], -1).max(1).values  # most recent occurrence
        new = (latest >= 0) & ~found & (lengths > n)
        cont = torch.where(new, latest + n, cont)
        found |= new
    idx = cont[:, None] + torch.arange(k, device=dev)
    drafts = buffer.gather(1, idx.clamp_max(S - 1))
    ok = found[:, None] & (idx < lengths[:, None])
    return torch.where(ok, drafts, torch.full_like(drafts, -1))


if triton is not None:

    @triton.jit
    def _ngram_kernel(buf_ptr, len_ptr, out_ptr, S, K, stride_b, stride_o,
                      MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr, KBLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        L = tl.load(len_ptr + row)
        base = buf_ptr + row * stride_b
        found = tl.zeros([], tl.int32)
        cont = tl.zeros([], tl.int64)
        for n in tl.static_range(MAX_N, MIN_N - 1, -1):  # the longest suffix first
            if n < S:
                best = tl.full([], -1, tl.int64)
                suffix_start = tl.maximum(L - n, 0)
                for start in range(0, S, BLOCK):
                    s = start + tl.arange(0, BLOCK).to(tl.int64)
                    ok = s <= L - n - 1  # an earlier occurrence, with at least one token after it
                    for i in tl.static_range(n):
                        a = tl.load(base + s + i, mask=ok & (s + i < S), other=-2)
                        ok = ok & (a == tl.load(base + suffix_start + i))
                    best = tl.maximum(best, tl.max(tl.where(ok, s, -1), 0))
                new = (best >= 0) & (found == 0) & (L > n)
                cont = tl.where(new, best + n, cont)
                found = tl.where(new, 1, found)
        j = tl.arange(0, KBLOCK)
        idx = cont + j
        d = tl.load(base + tl.minimum(idx, S - 1), mask=j < K, other=-1)
        tl.store(out_ptr + row * stride_o + j, tl.where((found == 1) & (idx < L), d, -1), mask=j < K)


def ngram_drafts_triton(buffer: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, S = buffer.shape
    if buffer.stride(-1) != 1:
        buffer = buffer.contiguous()
    out = torch.empty(B, k, dtype=torch.long, device=buffer.device)
    if B and k:
        _ngram_kernel[(B,)](buffer, lengths.contiguous(), out, S, k, buffer.stride(0), out.stride(0),
                            MIN_N=min_n, MAX_N=max_n, BLOCK=min(1024, triton.next_power_of_2(S)),
                            KBLOCK=triton.next_power_of_2(k))
    return out


def ngram_drafts(buffer: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """The kernel on CUDA tensors, the reference elsewhere."""
    from draftsmith_kernels.dispatch import use_kernel

    fn = ngram_drafts_triton if use_kernel(buffer) else ngram_drafts_reference
    return fn(buffer, lengths, k, min_n, max_n)
