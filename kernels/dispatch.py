"""The one dispatch rule for the Triton kernels in this folder, each of which sits beside its
plain-torch reference of the same signature.

The folder is imported as `draftsmith_kernels` (pyproject.toml maps it): the name `kernels` belongs
to Hugging Face's package, which transformers >= 5.25 imports, and this folder has no __init__.py
so that `import kernels` finds that package even when the repository root is on the path.
"""
from __future__ import annotations

import os

from draftsmith_kernels.settings import active

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

# Triton's CPU interpreter (TRITON_INTERPRET=1): its cost is per program, and its 16-bit dots are
# wrong (3.9), so kernels take wider slices and float32 products there
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def use_kernel(t) -> bool:
    """Whether a dispatcher runs its Triton kernel on tensor t: by the mode of the kernel settings
    in effect (kernels/settings.py: "auto" on CUDA tensors, "off" never, "force" on any device)."""
    mode = active().mode
    if not HAVE_TRITON or mode == "off":
        return False
    return mode == "force" or t.is_cuda
