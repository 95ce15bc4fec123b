"""Two exports of one drafter side by side: the same tensor names, shapes and dtypes, and each
tensor's largest difference (issue 22: a plain and an FSDP run after the same steps).

    python scripts/compare_exports.py EXPORT_A EXPORT_B [--atol 0.02]

Prints one line per tensor that differs and a summary; exits 1 when the names, shapes or dtypes
differ or a tensor differs by more than --atol (bfloat16 exports: their rounding is 2^-8 of a
value, and the runs' reductions need not run in the same order).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--atol", type=float, default=0.02)
    args = ap.parse_args(argv)
    from safetensors.torch import load_file

    files = [Path(x) / "model.safetensors" for x in (args.a, args.b)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        print(f"error: no export at {', '.join(missing)}", file=sys.stderr)
        return 2
    a, b = (load_file(f) for f in files)
    if list(a) != list(b):
        print(f"different tensors: only in A {sorted(set(a) - set(b))[:5]}, only in B {sorted(set(b) - set(a))[:5]}")
        return 1
    worst, over = 0.0, []
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            print(f"{name}: {tuple(x.shape)} {x.dtype} against {tuple(y.shape)} {y.dtype}")
            return 1
        if not x.is_floating_point():
            if not (x == y).all():
                over.append(name)
            continue
        d = (x.float() - y.float()).abs().max().item() if x.numel() else 0.0
        worst = max(worst, d)
        if d > 0:
            print(f"  {name}: largest difference {d:.3g} (largest value {x.float().abs().max().item():.3g})")
        if d > args.atol:
            over.append(name)
    print(f"{len(a)} tensors, largest difference {worst:.3g}; over {args.atol}: {over or 'none'}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
