"""Carry a drafter export between machines in small files, without the target's tensors.

    python scripts/device/drafter_parts.py pack EXPORT PARTS --target smollm2-135m-instruct [--part-mib 15]
    python scripts/device/drafter_parts.py unpack PARTS [PARTS...] EXPORT --target smollm2-135m-instruct
    python scripts/device/drafter_parts.py stage PARTS [PARTS...] --into . [--max-mib 60] [--first 3]

Why: a GPU lease returns at most 8 files of 16 MiB, and an EAGLE-3 export of the zoo target is
86 MB, two thirds of it a bf16 copy of the target's embedding. `pack` writes every tensor that
is not a copy of one of the target's tensors into parts of at most --part-mib (a large tensor is
cut by rows), records which tensors are the target's (compared exactly, in the export's dtype),
and keeps the export's small files inside its manifest (parts.json): the
parts and the manifest are all there is to carry. `unpack` rebuilds model.safetensors from the parts and the
target and checks every tensor against the manifest's sha256 of its bytes; nothing is written
unless all match, and the folder appears whole (written beside, then renamed).

A device call carries at most 64 MiB: `stage` spreads parts folders over ignored folders
.devN/NAME-parts (N from --first), each at most --max-mib, a large export over two or more;
`unpack` takes every folder holding parts of one export.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

MANIFEST = "parts.json"


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _target_tensors(target: str) -> dict[str, torch.Tensor]:
    from models.zoo import resolve_target

    folder = Path(resolve_target(target))
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise FileNotFoundError(f"{folder}: no .safetensors files (the target's tensors)")
    return tensors


def pack(export: Path, parts: Path, target: str, part_mib: float = 15.0) -> dict:
    """Written into a folder beside `parts` and renamed at the end: a failed pack leaves nothing."""
    if parts.exists():
        raise FileExistsError(f"{parts}: exists (nothing replaced)")
    parts.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{parts.name}.", dir=parts.parent))
    try:
        manifest = _pack(export, staging, target, part_mib)
        os.replace(staging, parts)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _pack(export: Path, parts: Path, target: str, part_mib: float) -> dict:
    tensors = load_file(export / "model.safetensors")
    with safe_open(export / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    by_shape: dict = {}
    for name, t in _target_tensors(target).items():
        by_shape.setdefault(tuple(t.shape), []).append((name, t))
    limit = int(part_mib * 2**20)
    manifest = {"tensors": {}, "parts": [], "metadata": metadata, "files": []}
    current, size = {}, 0

    def flush():
        nonlocal current, size
        if current:
            name = f"part-{len(manifest['parts']):02d}.safetensors"
            save_file(current, parts / name)
            manifest["parts"].append(name)
        current, size = {}, 0

    for name, t in tensors.items():
        entry = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sha256": _digest(t)}
        # the target's copy only when byte for byte the same (torch.equal takes -0.0 for 0.0)
        same = next((n for n, u in by_shape.get(tuple(t.shape), []) if t.numel() and _digest(u.to(t.dtype)) == entry["sha256"]),
                    None)
        if same is not None:
            entry["from_target"] = same
        else:
            row_bytes = max(1, (t[0].numel() if t.dim() and t.shape[0] else 1) * t.element_size())
            rows_per_chunk = max(1, limit // row_bytes)
            entry["chunks"] = []
            for i, start in enumerate(range(0, max(1, t.shape[0] if t.dim() else 1), rows_per_chunk)):
                chunk = t[start: start + rows_per_chunk].contiguous() if t.dim() else t
                if size + chunk.numel() * chunk.element_size() > limit:
                    flush()
                key = f"{name}#{i}"
                current[key] = chunk
                size += chunk.numel() * chunk.element_size()
                entry["chunks"].append(key)
        manifest["tensors"][name] = entry
    flush()
    # the export's small files ride inside the manifest: a lease returns at most 8 files
    for f in sorted(export.iterdir()):
        if f.is_file() and f.name != "model.safetensors":
            manifest["files"].append({"name": f.name, "base64": base64.b64encode(f.read_bytes()).decode()})
    (parts / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(parts: Path | list[Path], export: Path, target: str) -> None:
    """parts: the folder of `pack`, or several folders holding its files between them."""
    folders = [parts] if isinstance(parts, Path) else list(parts)
    manifests = [f / MANIFEST for f in folders if (f / MANIFEST).is_file()]
    if not manifests:
        raise FileNotFoundError(f"no {MANIFEST} in {', '.join(map(str, folders))}")
    manifest = json.loads(manifests[0].read_text())
    if any(json.loads(m.read_text()) != manifest for m in manifests[1:]):
        raise ValueError(f"the folders hold parts of different exports ({', '.join(map(str, manifests))} differ)")
    if export.exists() and any(export.iterdir()):
        raise FileExistsError(f"{export}: exists and is not empty (nothing replaced)")
    chunks: dict[str, torch.Tensor] = {}
    for name in manifest["parts"]:
        where = next((f / name for f in folders if (f / name).is_file()), None)
        if where is None:
            raise FileNotFoundError(f"part {name} is in none of {', '.join(map(str, folders))}")
        chunks.update(load_file(where))
    from_target = _target_tensors(target) if any("from_target" in e for e in manifest["tensors"].values()) else {}
    tensors = {}
    for name, entry in manifest["tensors"].items():
        dtype = getattr(torch, entry["dtype"])
        if "from_target" in entry:
            t = from_target[entry["from_target"]].to(dtype)
        else:
            pieces = [chunks[key] for key in entry["chunks"]]
            t = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if list(t.shape) != entry["shape"] or _digest(t) != entry["sha256"]:
            raise ValueError(f"{name}: rebuilt tensor differs from the packed one (shape or sha256): "
                             f"another target than the one packed against, or a damaged part")
        tensors[name] = t
    export.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{export.name}.", dir=export.parent))
    try:
        save_file(tensors, staging / "model.safetensors", metadata=manifest.get("metadata"))
        for f in manifest["files"]:
            (staging / f["name"]).write_bytes(base64.b64decode(f["base64"]))
        if export.exists():
            export.rmdir()  # empty (checked above)
        os.replace(staging, export)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def stage(parts: list[Path], into: Path, max_mib: float = 60.0, first: int = 3) -> list[Path]:
    """Copy the files of each parts folder into into/.devN/NAME-parts, N = first, first + 1, ...,
    a folder taking files until the next would pass max_mib (an export may span folders).
    Returns the folders written. Everything is checked before anything is copied (manifests,
    sizes, one folder per export name, no existing .devN), and a failed copy removes what it wrote."""
    limit = max_mib * 2**20
    names = [f.name for f in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"two parts folders share a name ({', '.join(sorted(n for n in set(names) if names.count(n) > 1))}): "
                         "unpack could not tell their files apart")
    plan: list[tuple[Path, Path]] = []  # (file, destination)
    n, used = first, 0.0
    for folder in parts:
        if not (folder / MANIFEST).is_file():
            raise FileNotFoundError(f"{folder}: no {MANIFEST} (not a folder written by pack)")
        for f in sorted(folder.iterdir()):
            size = f.stat().st_size
            if size > limit:
                raise ValueError(f"{f}: {size / 2**20:.1f} MiB, more than --max-mib {max_mib}")
            if used and used + size > limit:
                n, used = n + 1, 0.0
            plan.append((f, into / f".dev{n}" / folder.name / f.name))
            used += size
    written = list(dict.fromkeys(dest.parent.parent for _, dest in plan))
    for folder in written:
        if folder.exists():
            raise FileExistsError(f"{folder} exists: stage into a fresh --first")
    try:
        for f, dest in plan:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
    except BaseException:
        for folder in written:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack")
    p.add_argument("export", type=Path)
    p.add_argument("parts", type=Path)
    p.add_argument("--target", required=True)
    p.add_argument("--part-mib", type=float, default=15.0)
    u = sub.add_parser("unpack")
    u.add_argument("parts", type=Path, nargs="+")
    u.add_argument("export", type=Path)
    u.add_argument("--target", required=True)
    st = sub.add_parser("stage")
    st.add_argument("parts", type=Path, nargs="+")
    st.add_argument("--into", type=Path, default=Path("."))
    st.add_argument("--max-mib", type=float, default=60.0)
    st.add_argument("--first", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        if args.verb == "pack":
            m = pack(args.export, args.parts, args.target, args.part_mib)
            kept = sum(1 for e in m["tensors"].values() if "from_target" in e)
            print(f"wrote {args.parts}: {len(m['parts'])} parts, {kept} tensors taken from {args.target}")
        elif args.verb == "stage":
            for folder in stage(args.parts, args.into, args.max_mib, args.first):
                print(f"staged {folder} ({sum(f.stat().st_size for f in folder.rglob('*') if f.is_file()) / 2**20:.1f} MiB)")
        else:
            unpack(args.parts, args.export, args.target)
            print(f"wrote {args.export}")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
