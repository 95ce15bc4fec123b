"""Triton kernels, each beside its plain-torch reference of the same signature.

`use_kernel(t)` is the one dispatch rule: the kernel runs on CUDA tensors unless
DRAFTSMITH_KERNELS=0; DRAFTSMITH_KERNELS=force runs it on any device (with TRITON_INTERPRET=1
on a CPU, which is how CI tests whole models through the kernels).
"""
from __future__ import annotations

import os

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

# Triton's CPU interpreter (TRITON_INTERPRET=1): its cost is per program, and its 16-bit dots are
# wrong (3.9), so kernels take wider slices and float32 products there
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def use_kernel(t) -> bool:
    mode = os.environ.get("DRAFTSMITH_KERNELS", "1")
    if not HAVE_TRITON or mode == "0":
        return False
    return mode == "force" or t.is_cuda
