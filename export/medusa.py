"""vLLM's Medusa layout (`MedusaModel`, docs/formats.md): config.json + model.safetensors +
draftsmith.json. Tensors `blocks.{i}.layers.{j}.weight/.bias`, `lm_heads.{i}.weight` and, for a
draft vocabulary smaller than the target's, `token_map` [Vd] (the target id of each row).

vLLM drops unknown keys silently and loads block biases only with `medusa_fc_bias: true`: the
config always says so, since draftsmith's residual blocks have biases.

Which vLLM serves it: 0.33 has no Medusa; 0.15-0.32 size every head to the target's whole
vocabulary and assert when a `token_map` comes with fewer rows. So a drafter with Vd = V is
written with full-vocabulary heads (what those versions load and compute as trained), and one
with Vd < V is refused, unless written for draftsmith's own runtime (`runtime_only`: the
training run's export, which `python -m inference.validate` reads).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from export.io import atomic_folder, check_tensors, full_vocab_maps, write_export_files
from models.medusa import MedusaConfig, MedusaDrafter


def medusa_config(cfg: MedusaConfig, target_name: str) -> dict:
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "truncated_vocab_size": cfg.draft_vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        "base_model_name_or_path": target_name,
    }


VLLM_REFUSAL = ("vLLM 0.33 has no Medusa, and vLLM 0.15-0.32 size each Medusa head to the target's whole vocabulary "
                "(they assert on a token_map head)")


def export_medusa(drafter: MedusaDrafter, out_dir: str | Path, *, target_name: str, dtype: torch.dtype = torch.bfloat16,
                  provenance: dict | None = None, target_model=None, runtime_only: bool = False) -> Path:
    """target_model (Medusa-2): the jointly trained target, saved beside the heads in target/
    (an HF folder to serve in place of the original). runtime_only: a draft vocabulary smaller
    than the target's is written for draftsmith's runtime instead of refused."""
    cfg = drafter.config
    served_by = ["vllm>=0.15,<=0.32", "draftsmith"]
    if cfg.draft_vocab_size < cfg.vocab_size:
        if not runtime_only:
            raise ValueError(f"cannot export to medusa for vLLM: {VLLM_REFUSAL}, and this drafter's draft_vocab_size is "
                             f"{cfg.draft_vocab_size} < {cfg.vocab_size} (train with drafter.draft_vocab_size={cfg.vocab_size}; "
                             "the training run's own export serves it in draftsmith's runtime)")
        served_by = ["draftsmith"]
        print(f"note: {out_dir} is served by draftsmith's runtime only: {VLLM_REFUSAL}")
    state = drafter.state_dict()
    tensors = {n: t.detach().cpu().to(dtype).contiguous() for n, t in state.items() if n not in ("d2t", "t2d")}
    if cfg.draft_vocab_size < cfg.vocab_size:
        tensors["token_map"] = drafter.draft_ids().detach().cpu().contiguous()
    with atomic_folder(out_dir) as tmp:
        write_export_files(tmp, tensors, medusa_config(cfg, target_name),
                           {"format": "medusa", "method": "medusa", "drafter_config": cfg.to_dict(), "served_by": served_by},
                           provenance)
        if target_model is not None:
            target_model.save_pretrained(tmp / "target")
    return Path(out_dir)


def served_config(config: dict, folder) -> MedusaConfig:
    """The drafter config a server builds from config.json alone (its defaults for absent keys)."""
    return MedusaConfig(vocab_size=config["vocab_size"], draft_vocab_size=config.get("truncated_vocab_size") or config["vocab_size"],
                       hidden_size=config["hidden_size"], target_num_layers=0, num_heads=config["num_heads"],
                       num_layers=config["num_hidden_layers"])


def load_medusa(folder: str | Path, dtype: torch.dtype = torch.float32, served: bool = False) -> MedusaDrafter:
    """Read the layout back strictly: every tensor present with its shape, nothing else.
    served: from config.json alone, as a server reads it."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    meta_path = folder / "draftsmith.json"
    if meta_path.is_file() and not served:
        cfg = MedusaConfig.from_dict(json.loads(meta_path.read_text())["drafter_config"])
    else:  # an export made elsewhere, or read as a server reads it
        cfg = served_config(config, folder)
    if not config.get("medusa_fc_bias", False) and cfg.num_layers:
        raise ValueError(f"{folder}/config.json: medusa_fc_bias is not true, so a server would drop the block biases")
    drafter = MedusaDrafter(cfg)
    state = load_file(str(folder / "model.safetensors"))
    token_map = state.pop("token_map", None)
    if cfg.draft_vocab_size < cfg.vocab_size:
        if token_map is None:
            raise KeyError(f"{folder}: token_map is missing for a draft vocabulary of {cfg.draft_vocab_size} < {cfg.vocab_size}")
        if token_map.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"{folder}: token_map has shape {tuple(token_map.shape)}, expected ({cfg.draft_vocab_size},)")
        state["d2t"] = token_map.long() - torch.arange(cfg.draft_vocab_size)
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, token_map.long(), True)
    else:
        state.update(full_vocab_maps(cfg.vocab_size))
    check_tensors(state, drafter, folder)
    drafter.load_state_dict(state, strict=True)
    return drafter.to(dtype)


# ---------------------------------------------------------------- the layout's entry points
def write(drafter, out, ctx) -> Path:
    return export_medusa(drafter, out, target_model=ctx.target_model if ctx.joint else None,
                         runtime_only=ctx.runtime_only, **ctx.common())


def reads(config: dict) -> bool:
    return (config.get("architectures") or [None])[0] == "MedusaModel"


def read(folder, dtype=torch.float32, served: bool = False):
    return load_medusa(folder, dtype=dtype, served=served)


# ---------------------------------------------------------------- what export.check holds it to
REQUIRED_KEYS = ("medusa_fc_bias", "truncated_vocab_size")


def served_facts(config: dict) -> dict:
    """What vLLM reads from config.json beside the drafter config (served_config)."""
    return {key: config.get(key) for key in ("num_heads", "num_hidden_layers", "truncated_vocab_size", "vocab_size",
                                             "hidden_size")}


def expected_facts(method: str, trained: dict, k: int | None) -> dict:
    return {"num_heads": (trained["num_heads"], "trained"), "num_hidden_layers": (trained["num_layers"], "the trained block layers"),
            "truncated_vocab_size": (trained["draft_vocab_size"], "the trained draft vocabulary")}
