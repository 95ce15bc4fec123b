"""vLLM "speculators" layout for EAGLE-3 and DFlash (docs/formats.md): config.json +
model.safetensors + draftsmith.json (provenance and predicted acceptance). `vllm serve DIR`
reads it directly.

Layer ids are written as HF `hidden_states` indices (output-of-layer id + 1), the convention
this layout uses; draftsmith.json records the translation.

DFlash here (speculators 0.9's `DFlashDraftModel`): `speculators_model_type: "dflash"`, the
draft layers' Qwen3 config as `transformer_layer_config`, `block_size`, `mask_token_id`,
`aux_hidden_state_layer_ids`, `draft_vocab_size`; tensors `layers.{i}.*`, `norm`, `fc`,
`hidden_norm` as in the z-lab layout, plus the draft head rows `lm_head` and `d2t`/`t2d` when
Vd < V (a server cannot derive a reduced head from the target's); never the embedding.

MTP is not written here: speculators' MTP format holds one Qwen3-family decoder layer (with
q/k norms) reused for every step, while draftsmith's MTP modules are one Llama-style layer per
step, like the target's (`--format mtp`, the DeepSeek-V3 layout, carries them).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from export.io import atomic_folder, check_tensors, full_vocab_maps, write_export_files
from models.eagle3 import Eagle3Config, Eagle3Drafter

SPECULATORS_VERSION = "0.2.0"


def _header(algorithm: str, k: int, target_name: str, target_arch: list[str]) -> dict:
    from models.zoo import served_target_name

    # `vllm serve DIR` resolves verifier.name_or_path itself (a hub id or a local path): never
    # a draftsmith zoo alias
    return {
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": served_target_name(target_name), "architectures": target_arch},
        },
    }


def speculators_config(cfg: Eagle3Config, target_name: str, target_arch: list[str], k: int, dtype: str) -> dict:
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # vLLM 0.33 sizes fc as target_hidden_size x num_aux_hidden_states, read from this
        # layer config (llama_eagle3.py:210-216; absent: 3); the top-level ids do not count
        "num_aux_hidden_states": len(cfg.aux_layer_ids),
    }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        **_header("eagle3", k, target_name, target_arch),
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        # EAGLE-3.1, read at the top level (vLLM 0.33 speculators/algos.py:37-38, absent: false):
        # fc_norm builds one RMSNorm per aux state, loaded from `fc_norm.{i}.weight`
        # (llama_eagle3.py:231-240, 409-416); norm_output feeds the next step the final-normed
        # state (llama_eagle3.py:252, 285-286), false: the layer's output before the final norm
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
        "target_hidden_size": cfg.target_hidden_size,
        "dtype": dtype,
    }


def dflash_speculators_config(cfg, target_name: str, target_arch: list[str], dtype: str) -> dict:
    layer = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False, "tie_word_embeddings": False,
        # vLLM 0.33 reads is_causal first (qwen3_dflash.py): draftsmith's blocks attend
        # bidirectionally, so every layer is non-causal
        "is_causal": False,
    }
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        **_header("dflash", cfg.block_size - 1, target_name, target_arch),
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,  # vLLM: causal = not this (absent counts as true)
        "sample_from_anchor": False,  # the anchor is the verified bonus token: B-1 drafts
        "dtype": dtype,
    }


def export_speculators(drafter, out_dir: str | Path, *, target_name: str, target_arch: list[str],
                       k: int = 7, dtype: torch.dtype = torch.bfloat16, provenance: dict | None = None) -> Path:
    """Write an EAGLE-3 or DFlash drafter in the speculators layout, atomically."""
    from models.dflash import DFlashDrafter

    cfg = drafter.config
    dflash = isinstance(drafter, DFlashDrafter)
    tensors = {name: t.detach().to("cpu") for name, t in drafter.state_dict().items()}
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:  # the layout omits the maps for a full vocab
        tensors.pop("d2t"), tensors.pop("t2d")
        if dflash:
            tensors.pop("lm_head.weight")  # the target's head, whole
    if dflash:
        tensors.pop("embed_tokens.weight")  # always the target's
    dtype_name = str(dtype).replace("torch.", "")
    config = (dflash_speculators_config(cfg, target_name, target_arch, dtype_name) if dflash
              else speculators_config(cfg, target_name, target_arch, k, dtype_name))
    with atomic_folder(out_dir) as tmp:
        write_export_files(tmp, tensors, config, {
            "format": "speculators", "method": "dflash" if dflash else "eagle3",
            "layer_id_convention": {"draftsmith": "output_of_layer", "config.json": "hf_hidden_states_index (= output_of_layer + 1)"},
            "drafter_config": cfg.to_dict()}, provenance)
    return Path(out_dir)


def load_speculators(folder: str | Path, dtype: torch.dtype = torch.float32, target: str | None = None,
                     served: bool = False):
    """Read a speculators-layout EAGLE-3 or DFlash folder into draftsmith's module, strictly
    (served: from config.json alone, with vLLM's defaults for absent keys).

    draftsmith's own exports carry the drafter's config in draftsmith.json; a folder made
    elsewhere (by the speculators package, say) is read from its config.json alone, and an
    option draftsmith's modules cannot compute (several layers) is an error naming it. target: where a DFlash drafter's embedding and head come from (default:
    the verifier named in the config)."""
    import json

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    meta_path = folder / "draftsmith.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    method = meta.get("method") or config.get("speculators_model_type")
    target = target or meta.get("target")
    if served:  # as vLLM reads the folder: config.json alone
        meta = {}
    state = load_file(str(folder / "model.safetensors"))
    if method == "dflash":
        from export.dflash import dflash_from_state
        from models.dflash import DFlashConfig

        cfg = DFlashConfig.from_dict(meta["drafter_config"]) if meta else _dflash_config(config, folder)
        target = target or ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        drafter = dflash_from_state(cfg, state, target, folder)
        return drafter.to(dtype) if dtype is not None else drafter
    if method != "eagle3":
        raise ValueError(f"{folder}/config.json: speculators_model_type {method!r} has no reader here (eagle3, dflash)")
    cfg = Eagle3Config.from_dict(meta["drafter_config"]) if meta else _eagle3_config(config, folder)
    drafter = Eagle3Drafter(cfg)
    for name in [n for n in state if n.startswith("verifier_")]:
        state.pop(name)  # the verifier's own norm / head, saved by some trainers: not the drafter's
    if cfg.draft_vocab_size == cfg.vocab_size:
        state.update(full_vocab_maps(cfg.vocab_size))
    check_tensors(state, drafter, folder)
    drafter.load_state_dict(state, strict=True)
    return drafter.to(dtype) if dtype is not None else drafter


def _layer_fields(config: dict, folder) -> tuple[dict, object]:
    """The decoder shape from a speculators config's transformer_layer_config, read through
    transformers' config class of its model_type: a field left out (saved as a diff against
    that class, as the speculators package does) takes that class's default, as it does on the
    server."""
    from transformers import AutoConfig

    from models.layers import rope_config

    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict) or "model_type" not in layer:
        raise KeyError(f"{folder}/config.json: transformer_layer_config (with its model_type) is missing")
    hf = AutoConfig.for_model(layer["model_type"], **{k: v for k, v in layer.items() if k != "model_type"})
    theta, scaling = rope_config(hf)
    fields = dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                  num_attention_heads=hf.num_attention_heads,
                  num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                  head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                  rms_norm_eps=hf.rms_norm_eps, rope_theta=theta, rope_scaling=scaling,
                  max_position_embeddings=hf.max_position_embeddings)
    return fields, hf


def _eagle3_config(config: dict, folder) -> Eagle3Config:
    fields, layer = _layer_fields(config, folder)
    if layer.num_hidden_layers != 1:
        raise ValueError(f"{folder}/config.json: {layer.num_hidden_layers} draft layers; draftsmith's EAGLE-3 has one")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise KeyError(f"{folder}/config.json: eagle_aux_hidden_state_layer_ids is missing (name the layers)")
    aux = [i - 1 for i in sorted(set(ids))]  # vLLM captures sorted, distinct HF hidden_states indices
    return Eagle3Config(**fields, draft_vocab_size=config.get("draft_vocab_size") or fields["vocab_size"],
                        target_hidden_size=config.get("target_hidden_size") or fields["hidden_size"], aux_layer_ids=aux,
                        target_num_layers=max(aux) + 4,  # unknown here; only bounds the ids
                        norm_before_residual=config.get("norm_before_residual", True),  # vLLM's default when absent
                        norm_before_fc=bool(config.get("norm_before_fc", False)),
                        # vLLM 0.33 speculators/algos.py:37-38: both default false
                        fc_norm=bool(config.get("fc_norm", False)), norm_output=bool(config.get("norm_output", False)))


def _dflash_config(config: dict, folder):
    from models.dflash import DFlashConfig

    fields, layer = _layer_fields(config, folder)
    if config.get("sample_from_anchor"):
        raise ValueError(f"{folder}/config.json: sample_from_anchor=true (B drafts from the anchor) is a DFlash variant "
                         "draftsmith's module does not compute")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        if config.get(key) is None:
            raise KeyError(f"{folder}/config.json: {key} is missing")
    ids = [i - 1 for i in sorted(set(config["aux_hidden_state_layer_ids"]))]  # vLLM sorts and de-duplicates
    return DFlashConfig(**fields, draft_vocab_size=config.get("draft_vocab_size") or fields["vocab_size"],
                        target_num_layers=max(ids) + 4, mask_token_id=config["mask_token_id"], target_layer_ids=ids,
                        num_layers=layer.num_hidden_layers, block_size=config["block_size"])


# ---------------------------------------------------------------- the layout's entry points
# (export/formats.py: write_export dispatches here; export/load.py: load_export)
def write(drafter, out, ctx) -> Path:
    return export_speculators(drafter, out, target_arch=list(ctx.hf_config.architectures or []), k=ctx.k, **ctx.common())


def reads(config: dict) -> bool:
    return ((config.get("architectures") or [None])[0] == "Eagle3DraftModel"
            or config.get("speculators_model_type") in ("eagle3", "dflash"))


def read(folder, dtype=torch.float32, served: bool = False):
    return load_speculators(folder, dtype=dtype, served=served)


def served_config(config: dict, folder):
    """The drafter config vLLM builds from config.json alone (its defaults for absent keys)."""
    return (_dflash_config if config.get("speculators_model_type") == "dflash" else _eagle3_config)(config, folder)


# ---------------------------------------------------------------- what export.check holds it to
REQUIRED_KEYS = {  # what vLLM would otherwise default
    "eagle3": ("norm_before_residual", "norm_before_fc", "norm_output", "fc_norm", "eagle_aux_hidden_state_layer_ids",
               "draft_vocab_size"),
    "dflash": ("block_size", "aux_hidden_state_layer_ids", "mask_token_id", "draft_vocab_size", "sample_from_anchor"),
}


def served_facts(config: dict) -> dict:
    """What vLLM reads from config.json beside the drafter config (served_config), as it reads it."""
    layer = config.get("transformer_layer_config") or {}
    proposal = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
    facts = {"speculative_tokens": proposal.get("speculative_tokens"), "vocab_size": config.get("vocab_size", layer.get("vocab_size")),
             "rope_theta": layer.get("rope_theta")}
    if config.get("speculators_model_type") == "dflash":
        # vLLM 0.33 qwen3_dflash.py: is_causal first, then not sliding_window_non_causal
        causal = layer["is_causal"] if layer.get("is_causal") is not None else not config.get("sliding_window_non_causal", True)
        return {**facts, "is_causal": bool(causal), "hidden_size": config.get("hidden_size", layer.get("hidden_size")),
                "transformer_layer_config.num_hidden_layers": layer.get("num_hidden_layers"),
                **{key: config.get(key) for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size",
                                                    "draft_vocab_size", "sample_from_anchor")}}
    return {**facts, "hidden_size": config.get("target_hidden_size", layer.get("target_hidden_size")),
            # vLLM 0.33 llama_eagle3.py:210-216: fc takes this many aux states, 3 when absent
            "transformer_layer_config.num_aux_hidden_states": layer.get("num_aux_hidden_states", 3),
            **{key: config.get(key) for key in ("eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc",
                                                "norm_output", "fc_norm")}}


def expected_facts(method: str, trained: dict, k: int | None) -> dict:
    """What served_facts must say for the trained drafter: name -> (value, why)."""
    if method == "dflash":
        block = trained["block_size"]
        return {"is_causal": (False, "draftsmith's blocks attend bidirectionally"),
                "speculative_tokens": (block - 1, f"a block of {block} drafts {block - 1}; vLLM ignores block_size"),
                "aux_hidden_state_layer_ids": ([i + 1 for i in trained["target_layer_ids"]],
                                               "the trained output-of-layer ids + 1"),
                **{key: (trained[key], "trained") for key in ("mask_token_id", "block_size", "draft_vocab_size")},
                "transformer_layer_config.num_hidden_layers": (trained["num_layers"], "the trained draft layers"),
                "sample_from_anchor": (False, "the anchor is the verified token: B-1 drafts")}
    facts = {"eagle_aux_hidden_state_layer_ids": ([i + 1 for i in trained["aux_layer_ids"]],
                                                  "the trained output-of-layer ids + 1"),
             **{flag: (trained[flag], "trained") for flag in ("norm_before_residual", "norm_before_fc")},
             # EAGLE-3.1's flags (absent from configs saved before them: false, the only form then)
             **{flag: (bool(trained.get(flag, False)), "trained") for flag in ("fc_norm", "norm_output")},
             "transformer_layer_config.num_aux_hidden_states": (len(trained["aux_layer_ids"]),
                                                                "fc reads one state per trained aux layer")}
    if k is not None:
        facts["speculative_tokens"] = (k, "trained and predicted for that k")
    return facts


def taken_from_target(method: str, stored: set) -> set:
    if method == "dflash":
        from export.dflash import taken_from_target as dflash_taken

        return dflash_taken(method, stored)
    return set()


def launch_lines(folder: str, config: dict, meta: dict) -> list[str]:
    """vLLM 0.33 with --speculative-config: DFlash drafts B - 1 tokens a step (vLLM ignores block_size)."""
    from export.formats import draft_length, served_target, vllm_line

    target = served_target(config, meta)
    if config.get("speculators_model_type") == "dflash":
        return [vllm_line(target, "dflash", folder, int(config["block_size"]) - 1)]
    return [vllm_line(target, "eagle3", folder, draft_length(config, meta))]
