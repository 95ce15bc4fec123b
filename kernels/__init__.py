"""Triton kernels, each beside its plain-torch reference of the same signature.

`use_kernel(t)` is the one dispatch rule: the kernel runs on CUDA tensors unless
DRAFTSMITH_KERNELS=0; DRAFTSMITH_KERNELS=force runs it on any device (with TRITON_INTERPRET=1
on a CPU, which is how CI tests whole models through the kernels).
"""
from __future__ import annotations

import importlib.metadata
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


def __getattr__(name: str):
    """A name this package lacks. Hugging Face's `kernels` distribution (a dependency of
    transformers >= 5.25) has this folder's import name, so transformers' `from kernels import
    CUDAProperties, ...` lands here where both are installed: say so in one line instead of
    "cannot import name" (pyproject.toml pins transformers below 5.25 for this reason)."""
    if not name.startswith("__"):
        try:
            version = importlib.metadata.version("kernels")
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version is not None:
            raise ImportError(
                f"Hugging Face's `kernels` package ({version}) is installed here and shares its import name with "
                f"draftsmith's kernels/ (asked for {name!r}, which this package lacks): `pip uninstall -y kernels` and "
                f"`pip install 'transformers<5.25'` (as pyproject.toml pins), or use a separate environment")
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
