"""z-lab DFlash layout (docs/formats.md): a Qwen3-style decoder config with
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`,
`dflash_config: {mask_token_id, target_layer_ids}` (output-of-layer ids, as draftsmith counts),
and tensors `layers.{i}.*` (with q_norm / k_norm), `norm`, `fc` [H, n*Ht], `hidden_norm`; no
embedding and no head: the server uses the target's. A draft vocabulary smaller than the
target's adds `d2t`/`t2d`, read by draftsmith only: train with Vd = V to serve elsewhere.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from export.io import atomic_folder, check_tensors, full_vocab_maps, target_embedding_and_head, write_export_files
from models.dflash import DFlashConfig, DFlashDrafter

NOT_STORED = ("embed_tokens.weight", "lm_head.weight")


def dflash_config(cfg: DFlashConfig, target_name: str) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers, "draft_vocab_size": cfg.draft_vocab_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "base_model_name_or_path": target_name,
    }


def export_dflash(drafter: DFlashDrafter, out_dir: str | Path, *, target_name: str, dtype: torch.dtype = torch.bfloat16,
                  provenance: dict | None = None) -> Path:
    cfg = drafter.config
    tensors = {n: t.detach().cpu() for n, t in drafter.state_dict().items() if n not in NOT_STORED}
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors.pop("d2t"), tensors.pop("t2d")
    with atomic_folder(out_dir) as tmp:
        write_export_files(tmp, tensors, dflash_config(cfg, target_name),
                           {"format": "dflash", "method": "dflash", "drafter_config": cfg.to_dict()}, provenance)
    return Path(out_dir)


def served_config(config: dict, folder) -> DFlashConfig:
    """The drafter config a server builds from config.json alone (its defaults for absent keys)."""
    d = config["dflash_config"]
    return DFlashConfig(vocab_size=config["vocab_size"], draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]),
                       hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
                       num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
                       head_dim=config["head_dim"], target_num_layers=config["num_target_layers"],
                       mask_token_id=d["mask_token_id"], target_layer_ids=d["target_layer_ids"],
                       num_layers=config["num_hidden_layers"], block_size=config["block_size"],
                       rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
                       rope_scaling=config.get("rope_scaling"), max_position_embeddings=config["max_position_embeddings"])


def load_dflash(folder: str | Path, dtype: torch.dtype = torch.float32, target: str | None = None,
                served: bool = False) -> DFlashDrafter:
    """Read the layout back strictly; embedding and head come from the target. served: from
    config.json alone, as z-lab's DFlashDraftModel reads it."""
    folder = Path(folder)
    meta = json.loads((folder / "draftsmith.json").read_text()) if (folder / "draftsmith.json").is_file() else {}
    config = json.loads((folder / "config.json").read_text())
    if "drafter_config" in meta and not served:
        cfg = DFlashConfig.from_dict(meta["drafter_config"])
    else:  # an export made elsewhere, or read as a server reads it
        cfg = served_config(config, folder)
    target = target or meta.get("target") or config.get("base_model_name_or_path")
    return dflash_from_state(cfg, load_file(str(folder / "model.safetensors")), target, folder).to(dtype)


def dflash_from_state(cfg: DFlashConfig, state: dict, target: str | None, folder, drafter_cls=DFlashDrafter) -> DFlashDrafter:
    """The drafter from an export's tensors, strictly; the embedding, and the head unless the
    file stores its draft rows (speculators' layout does when Vd < V), come from the target.
    drafter_cls: a drafter on DFlash's backbone (DSpark's, export/dspark.py)."""
    if not target:
        raise ValueError(f"{folder}: a DFlash export uses its target's embedding and head; name the target")
    drafter = drafter_cls(cfg)
    if cfg.draft_vocab_size == cfg.vocab_size:
        state.update(full_vocab_maps(cfg.vocab_size))
    head_stored = "lm_head.weight" in state
    check_tensors(state, drafter, folder, ("embed_tokens.weight",) if head_stored else NOT_STORED)
    shapes = drafter.state_dict()
    embed, head = target_embedding_and_head(target)
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"target {target}: embedding of shape {tuple(embed.shape)}, the drafter needs ({cfg.vocab_size}, {cfg.hidden_size})")
    drafter.load_state_dict({"lm_head.weight": shapes["lm_head.weight"], **state, "embed_tokens.weight": embed}, strict=True)
    if not head_stored:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head[drafter.draft_ids()])
    return drafter


# ---------------------------------------------------------------- the layout's entry points
def write(drafter, out, ctx) -> Path:
    return export_dflash(drafter, out, **ctx.common())


def reads(config: dict) -> bool:
    # z-lab's layout; a DFlashDraftModel with speculators_model_type is the speculators layout's
    return (config.get("architectures") or [None])[0] == "DFlashDraftModel" and not config.get("speculators_model_type")


def read(folder, dtype=torch.float32, served: bool = False):
    return load_dflash(folder, dtype=dtype, served=served)


# ---------------------------------------------------------------- what export.check holds it to
REQUIRED_KEYS = ("block_size", "num_target_layers", "dflash_config")


def served_facts(config: dict) -> dict:
    """What z-lab's DFlashDraftModel reads from config.json beside the drafter config (served_config)."""
    d = config.get("dflash_config") or {}
    return {"target_num_layers": config.get("num_target_layers"), "dflash_config.target_layer_ids": d.get("target_layer_ids"),
            "dflash_config.mask_token_id": d.get("mask_token_id"),
            **{key: config.get(key) for key in ("block_size", "vocab_size", "hidden_size", "rope_theta")}}


def expected_facts(method: str, trained: dict, k: int | None) -> dict:
    return {"dflash_config.target_layer_ids": (trained["target_layer_ids"], "the trained output-of-layer ids"),
            "dflash_config.mask_token_id": (trained["mask_token_id"], "trained"), "block_size": (trained["block_size"], "trained")}


def taken_from_target(method: str, stored: set) -> set:
    # the embedding is never stored; the head is, as draft rows, only by speculators' layout when Vd < V
    return {"embed_tokens.weight"} | ({"lm_head.weight"} - stored)


def launch_lines(folder: str, config: dict, meta: dict) -> list[str]:
    """vLLM 0.33 (`method: dflash`, B - 1 drafts a step) and SGLang 0.5.23 (`DFLASH`, a verify
    window of B) both load this layout as trained, non-causal; neither reads d2t, so a draft
    vocabulary smaller than the target's is served by draftsmith's runtime only."""
    from export.formats import served_target, sglang_line, vllm_line

    if config.get("draft_vocab_size", config["vocab_size"]) < config["vocab_size"]:
        return []
    target, block = served_target(config, meta), int(config["block_size"])
    return [vllm_line(target, "dflash", folder, block - 1),
            sglang_line(target, "DFLASH", folder, "--speculative-num-draft-tokens", str(block))]
