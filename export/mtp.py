"""DeepSeek-V3 MTP layout (docs/formats.md): MTP module d is stored as an extra decoder layer of the
target, index L + d: `model.layers.{L+d}.{embed_tokens, enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head, self_attn.*, mlp.*, input_layernorm,
post_attention_layernorm}`; config.json is the target's with `num_nextn_predict_layers`.

The embedding and head written are the target's full ones (each module carries a copy, as
the layout wants). A drafter trained with a smaller draft vocabulary also writes `d2t`/`t2d`,
read by draftsmith's runtime only: train with Vd = V to serve the layout elsewhere unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from export.io import atomic_folder, check_tensors, full_vocab_maps, write_export_files
from models.mtp import MTPConfig, MTPDrafter

MODULE_PARTS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                "shared_head.norm.weight": "shared_head_norm.weight"}
LAYER_PARTS = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def export_mtp(drafter: MTPDrafter, out_dir: str | Path, *, target_name: str, target_config: dict,
               embed: torch.Tensor, head: torch.Tensor, dtype: torch.dtype = torch.bfloat16, provenance: dict | None = None,
               target_model=None) -> Path:
    """embed, head [V,H]: the target's full embedding and head (the layout stores them).
    target_model (joint MTP): the trained target's own tensors are stitched in too, making one
    HF checkpoint of the target with its MTP layers."""
    cfg = drafter.config
    L = cfg.target_num_layers
    tensors = {}
    for d, module in enumerate(drafter.mtp):
        p = f"model.layers.{L + d}."
        state = module.state_dict()
        for out_name, ours in MODULE_PARTS.items():
            tensors[p + out_name] = state[ours]
        for name in LAYER_PARTS:
            tensors[p + name] = state[name]
        tensors[p + "embed_tokens.weight"] = embed.detach().clone()  # a copy per module (safetensors shares nothing)
        tensors[p + "shared_head.head.weight"] = head.detach().clone()
    if target_model is not None:
        own = {n: t for n, t in target_model.state_dict().items()}
        if "lm_head.weight" in own and own["lm_head.weight"].data_ptr() == own["model.embed_tokens.weight"].data_ptr():
            own.pop("lm_head.weight")  # tied: the config says so
        tensors.update({n: t.detach().clone() for n, t in own.items()})
    tensors = {n: t.detach().cpu().to(dtype).contiguous() for n, t in tensors.items()}
    if cfg.draft_vocab_size < cfg.vocab_size:
        tensors["d2t"], tensors["t2d"] = drafter.d2t.cpu().contiguous(), drafter.t2d.cpu().contiguous()
    config = {**target_config, "num_nextn_predict_layers": cfg.num_modules}
    with atomic_folder(out_dir) as tmp:
        write_export_files(tmp, tensors, config, {
            "format": "mtp", "method": "mtp", "drafter_config": cfg.to_dict(), "served_by": ["draftsmith"],
            "layer_id_convention": {"mtp_module_d": f"model.layers.{{{L} + d}}"}}, provenance)
    return Path(out_dir)


def served_config(config: dict, folder) -> MTPConfig:
    """The drafter config a server builds from config.json alone (its defaults for absent keys)."""
    return MTPConfig.from_target(_Namespace(config), config["vocab_size"], config["num_nextn_predict_layers"])


def load_mtp(folder: str | Path, dtype: torch.dtype = torch.float32, served: bool = False) -> MTPDrafter:
    """Read the layout back strictly into draftsmith's module (served: from config.json alone)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    meta_path = folder / "draftsmith.json"
    if meta_path.is_file() and not served:
        cfg = MTPConfig.from_dict(json.loads(meta_path.read_text())["drafter_config"])
    else:  # an export made elsewhere, or read as a server reads it
        cfg = served_config(config, folder)
    L = cfg.target_num_layers
    state = load_file(str(folder / "model.safetensors"))
    drafter = MTPDrafter(cfg)
    expected = {f"model.layers.{L + d}.{n}" for d in range(cfg.num_modules)
                for n in [*MODULE_PARTS, *LAYER_PARTS, "embed_tokens.weight", "shared_head.head.weight"]}
    if cfg.draft_vocab_size < cfg.vocab_size:
        expected |= {"d2t", "t2d"}
    target_tensors = {n for n in state if n not in expected and _is_target_tensor(n, L)}  # a stitched joint export
    missing, unexpected = expected - set(state), set(state) - expected - target_tensors
    if missing or unexpected:
        raise KeyError(f"{folder}: missing tensors {sorted(missing)[:5]}, unexpected tensors {sorted(unexpected)[:5]}")
    ours = {}
    for d in range(cfg.num_modules):
        p = f"model.layers.{L + d}."
        for out_name, name in MODULE_PARTS.items():
            ours[f"mtp.{d}.{name}"] = state[p + out_name]
        for name in LAYER_PARTS:
            ours[f"mtp.{d}.{name}"] = state[p + name]
    if cfg.draft_vocab_size < cfg.vocab_size:
        ours["d2t"], ours["t2d"] = state["d2t"], state["t2d"]
    else:
        ours.update(full_vocab_maps(cfg.vocab_size))
    embed, head = state[f"model.layers.{L}.embed_tokens.weight"], state[f"model.layers.{L}.shared_head.head.weight"]
    ours["embed_tokens.weight"] = embed
    ours["lm_head.weight"] = torch.zeros(cfg.draft_vocab_size, cfg.hidden_size, dtype=head.dtype)
    check_tensors(ours, drafter, folder)
    drafter.load_state_dict(ours, strict=True)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(head[drafter.draft_ids()])
    return drafter.to(dtype)


def _is_target_tensor(name: str, L: int) -> bool:
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return True
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < L


class _Namespace:
    """An HF-config-like view of a config.json dict."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def rope_theta(config: dict):
    """RoPE base of a config.json, in transformers 4 (rope_theta) or 5 (rope_parameters) form."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return config.get("rope_theta")


# ---------------------------------------------------------------- the layout's entry points
COPIES_TARGET = True  # the target's embedding and head sit beside every module

# said by every MTP export: the layout is DeepSeek-V3's, but neither server has an MTP path for
# the Llama-family targets draftsmith trains on (docs/serving.md)
MTP_SERVED_BY = ("served by the draftsmith runtime only (python -m inference.validate / generate): vLLM 0.33 and "
                 "SGLang 0.5.23 run MTP only for model types that ship MTP layers (DeepSeek-V3 and the like), and "
                 "model_type llama is not one")


def write(drafter, out, ctx) -> Path:
    print(f"note: MTP on a {'/'.join(ctx.hf_config.architectures or ['Llama-family'])} target is {MTP_SERVED_BY}")
    model = ctx.target_model
    return export_mtp(drafter, out, target_config=ctx.hf_config.to_dict(), embed=model.get_input_embeddings().weight,
                      head=model.get_output_embeddings().weight, target_model=model if ctx.joint else None, **ctx.common())


def reads(config: dict) -> bool:
    return bool(config.get("num_nextn_predict_layers"))


def read(folder, dtype=torch.float32, served: bool = False):
    return load_mtp(folder, dtype=dtype, served=served)


# ---------------------------------------------------------------- what export.check holds it to
REQUIRED_KEYS = ("num_nextn_predict_layers",)


def served_facts(config: dict) -> dict:
    """What a server reads from config.json (the target's own, with its MTP layers) beside the
    drafter config: the modules are layers L + d of a target of config.json's depth L."""
    return {"num_nextn_predict_layers": config.get("num_nextn_predict_layers"), "target_num_layers": config.get("num_hidden_layers"),
            "vocab_size": config.get("vocab_size"), "hidden_size": config.get("hidden_size"), "rope_theta": rope_theta(config)}


def expected_facts(method: str, trained: dict, k: int | None) -> dict:
    return {"num_nextn_predict_layers": (trained["num_modules"], "the trained modules"),
            "target_num_layers": (trained["target_num_layers"], "the depth the modules were trained after")}
