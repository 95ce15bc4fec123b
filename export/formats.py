"""Which layouts carry which drafter, and one writer that dispatches on the layout: used by
the training run (its final export) and by `python -m export`.

Each method's row of models/methods.py names its layouts and the module of each. A layout
module provides what it writes and reads:

    write(drafter, out, ctx: ExportContext) -> Path   the folder, written atomically
    reads(config: dict) -> bool                        whether a config.json is of this layout
    read(folder, dtype, served) -> drafter             strict reader (export/load.py)
    served_config(config, folder) -> drafter config    what a server builds from config.json
    COPIES_TARGET (optional, default False)            the layout stores the target's tensors

and what export.check holds an export of it to (its contract, so the checker needs no branch
per method or layout):

    served_facts(config) -> dict                       what a server reads from config.json
                                                       beyond the drafter config: draft count,
                                                       causal and bias flags, layer ids as
                                                       written, and the target's shape as stated
                                                       (vocab_size, hidden_size, target_num_layers,
                                                       rope_theta; None where config.json leaves
                                                       it out). Default: vocab_size, hidden_size
    expected_facts(method, trained, k) -> dict         name -> (what served_facts must say, why),
                                                       for the trained drafter config (a dict)
                                                       and the draft length k it was trained for
    REQUIRED_KEYS                                      config.json keys a reader would otherwise
                                                       default (a dict by method where one
                                                       layout carries several)
    taken_from_target(method, stored) -> set           drafter tensors not stored (of the names
                                                       `stored` in model.safetensors) that the
                                                       reader takes from the target at full
                                                       precision (optional, default none)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models import methods


class _LayoutsByMethod(Mapping):
    """method → the layouts that carry it, its own (the training run's default export) first;
    read from the method table at each use, so a method registered later is seen."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return tuple(methods.METHODS[name].layouts)

    def __iter__(self):
        return iter(methods.METHODS)

    def __len__(self) -> int:
        return len(methods.METHODS)


FORMATS = _LayoutsByMethod()

# why a layout cannot carry a method, where there is more to say than "it has no slot for it"
WHY_NOT = {("mtp", "speculators"): "speculators' MTP format holds one Qwen3-family layer (with q/k norms) reused for "
                                   "every step; draftsmith's MTP has one Llama-style layer per step, like the target's"}


@dataclass(frozen=True)
class ExportContext:
    """What a layout's `write` may need beside the drafter."""

    fmt: str  # the layout's name (one module may write several, e.g. eagle / eagle-vllm)
    target_name: str
    hf_config: Any  # the target's transformers config
    target_model: Any  # the target (its embedding and head; in joint runs the trained target), or None
    joint: bool  # the target trained too: it travels with the export where the layout can carry it
    k: int  # the draft length the drafter was trained and predicted for
    provenance: dict
    dtype: Any  # torch dtype of the stored weights
    runtime_only: bool = False  # the training run's own export, for draftsmith's runtime (export/medusa.py)

    def common(self) -> dict:
        return dict(target_name=self.target_name, dtype=self.dtype, provenance=self.provenance)


def layout_module(method: str, fmt: str):
    """The module of layout `fmt` for `method`; one ValueError line when the layout cannot carry it."""
    layouts = methods.method(method).layouts
    if fmt not in layouts:
        why = f"; {WHY_NOT[method, fmt]}" if (method, fmt) in WHY_NOT else ""
        raise ValueError(f"--format {fmt} cannot carry a {method} drafter (formats for {method}: {', '.join(layouts)}){why}")
    return methods.resolve(layouts[fmt])


def layout_modules() -> list:
    """Every layout module of the table, each once, in table order (export/load.py asks each
    whether it reads a folder)."""
    paths = dict.fromkeys(path for row in methods.METHODS.values() for path in row.layouts.values())
    return [methods.resolve(path) for path in paths]


def write_export(drafter, fmt: str, out, *, method: str, target_name: str, hf_config, target_model, joint: bool,
                 k: int, provenance: dict, dtype=None, runtime_only: bool = False):
    """Write `drafter` (of `method`) in layout `fmt`. target_model: the target (its embedding
    and head for MTP; in joint runs the trained target, which travels with the export).
    runtime_only: the training run's own export, for draftsmith's runtime, where a layout no
    server loads for this drafter (Medusa with Vd < V) is written instead of refused."""
    layout = layout_module(method, fmt)
    import torch

    ctx = ExportContext(fmt=fmt, target_name=target_name, hf_config=hf_config, target_model=target_model, joint=joint,
                        k=k, provenance=provenance, dtype=dtype or torch.bfloat16, runtime_only=runtime_only)
    return layout.write(drafter, out, ctx)
