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

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
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


def auto_layout(method: str, drafter) -> str:
    """The layout a run's `export_format: auto` (and `python -m export` without --format) writes
    for `drafter` (a drafter, or its config as a dict): the method's own, unless that cannot
    carry this drafter and another of the method's can. EAGLE-1 without an fc bias: SGLang's
    EAGLE-1 fc always has one (`eagle` refuses it), vLLM's `eagle` never has (`eagle-vllm`)."""
    config = drafter if isinstance(drafter, dict) else drafter.config.to_dict()
    if method == "eagle1" and not config.get("fc_bias", True):
        return "eagle-vllm"
    return methods.default_layout(method)


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


# ---------------------------------------------------------------- how a server launches an export
# A layout module may provide `launch_lines(folder: str, config: dict, meta: dict) -> list[str]`:
# the commands that serve the export as written (docs/serving.md). `python -m export` prints
# them; tests/test_launch_lines.py runs each through the server's own argument code.

def served_target(config: dict, meta: dict) -> str:
    """The target as a server names it (a hub id, or a local target's absolute path): the
    speculators verifier when the layout names one, else the run's target through
    models.zoo.served_target_name."""
    from models.zoo import served_target_name

    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if verifier:
        return verifier
    name = meta.get("target") or config.get("base_model_name_or_path")
    if not name:
        raise ValueError("the export names no target")
    return served_target_name(name)


def draft_length(config: dict, meta: dict) -> int:
    """The chain length k the drafter was trained and predicted for (the run's eval.k), else the
    speculators layout's speculative_tokens."""
    k = ((meta.get("training_config") or {}).get("eval") or {}).get("k")
    if k is None:
        k = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0].get("speculative_tokens")
    if k is None:
        raise ValueError("the export records no draft length (eval.k)")
    return int(k)


def vllm_line(target: str, method: str, folder: str, tokens: int) -> str:
    """vLLM 0.33: the target served with the drafter named in --speculative-config. (`vllm serve
    DIR` of a speculators export works only when its verifier is a hub id: vLLM refuses a local
    path there, so draftsmith always prints this form.)"""
    spec = json.dumps({"method": method, "model": folder, "num_speculative_tokens": tokens})
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"


def sglang_line(target: str, algorithm: str, folder: str, *flags: str) -> str:
    return (f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {shlex.quote(folder)} " + " ".join(flags)).rstrip()


def sglang_chain_flags(k: int) -> tuple[str, ...]:
    """A chain of k drafts in SGLang 0.5.23: with --speculative-num-steps given, top-k is not
    chosen for you (speculative_hook.py:1274 compares None > 1), and a chain verifies k + 1 tokens."""
    return ("--speculative-num-steps", str(k), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1))


def launch_lines(folder) -> list[str]:
    """The commands that serve the export at `folder` (as the user named it) in the servers that
    compute it as trained; [] when none does (draftsmith's runtime: inference.validate/generate)."""
    from export.io import read_json

    path = Path(folder)
    config, meta = read_json(path / "config.json"), read_json(path / "draftsmith.json")
    layout = layout_module(meta.get("method"), meta.get("format"))
    if not hasattr(layout, "launch_lines"):
        return []
    lines = layout.launch_lines(str(folder), config, meta)
    from export.io import read_k_table

    rows = read_k_table(path) if meta.get("k_table") else None
    return [with_k_table(line, meta["k_table"]["rows"], str(folder)) for line in lines] if rows else lines


SGLANG_ADAPTIVE = "sglang_adaptive.json"  # the k table as SGLang's --speculative-adaptive-config (inference.deploy)


def with_k_table(line: str, rows: list[list[int]], folder: str) -> str:
    """A launch line that drafts k by batch size from the export's table [[first, last, k], ...]
    (docs/deploy.md): vLLM 0.33's `num_speculative_tokens_per_batch_size` in --speculative-config,
    with num_speculative_tokens the table's largest k (vLLM caps each row's k at it); SGLang
    0.5.23's EAGLE / EAGLE3 chains through --speculative-adaptive with the export's
    SGLANG_ADAPTIVE file (one candidate per batch-size slot, so nothing adapts). Other lines
    (SGLang's DFLASH, which has no such setting) and tables that draft nothing are left as they are."""
    top = max(k for _, _, k in rows)
    words = shlex.split(line)
    if top == 0:
        return line
    if words[:2] == ["vllm", "serve"] and "--speculative-config" in words:
        at = words.index("--speculative-config") + 1
        spec = json.loads(words[at])
        words[at] = json.dumps({**spec, "num_speculative_tokens": top, "num_speculative_tokens_per_batch_size": rows})
        return shlex.join(words)
    algorithm = words[words.index("--speculative-algorithm") + 1] if "--speculative-algorithm" in words else None
    chain = "--speculative-eagle-topk" in words and words[words.index("--speculative-eagle-topk") + 1] == "1"
    adaptive = Path(folder) / SGLANG_ADAPTIVE
    if algorithm in ("EAGLE", "EAGLE3") and chain and adaptive.is_file():
        for flag, value in (("--speculative-num-steps", top), ("--speculative-num-draft-tokens", top + 1)):
            if flag in words:
                words[words.index(flag) + 1] = str(value)
        return shlex.join(words + ["--speculative-adaptive", "--speculative-adaptive-config", str(adaptive)])
    return line


def sglang_adaptive_config(rows: list[list[int]]) -> dict:
    """SGLang 0.5.23's adaptive config (speculative/adaptive_spec_params.py) holding the table: a
    slot per row keyed by its first batch size (a batch takes the slot of the largest key at or
    below it, after padding to a captured CUDA-graph batch size), each with the row's k as its
    only candidate step count."""
    return {str(lo): {"candidate_steps": [k]} for lo, _, k in rows}
