"""vLLM "speculators" layout for EAGLE-3 (FORMATS.md): config.json + model.safetensors +
draftsmith.json (provenance and predicted acceptance). `vllm serve DIR` reads it directly.

Layer ids are written as HF `hidden_states` indices (output-of-layer id + 1), the convention
this layout uses; draftsmith.json records the translation.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from export.io import atomic_folder, check_tensors, full_vocab_maps, write_json
from models.eagle3 import Eagle3Config, Eagle3Drafter

SPECULATORS_VERSION = "0.2.0"


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
    }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": target_arch},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": False,
        "norm_output": True,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
        "target_hidden_size": cfg.target_hidden_size,
        "dtype": dtype,
    }


def export_speculators(drafter: Eagle3Drafter, out_dir: str | Path, *, target_name: str, target_arch: list[str],
                       k: int = 7, dtype: torch.dtype = torch.bfloat16, provenance: dict | None = None) -> Path:
    """Write the drafter in the speculators layout, atomically."""
    cfg = drafter.config
    tensors = {name: t.detach().to("cpu") for name, t in drafter.state_dict().items()}
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:  # the layout omits the maps for a full vocab
        tensors.pop("d2t"), tensors.pop("t2d")
    dtype_name = str(dtype).replace("torch.", "")
    with atomic_folder(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", speculators_config(cfg, target_name, target_arch, k, dtype_name))
        digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        write_json(tmp / "draftsmith.json", {
            "format": "speculators",
            "method": "eagle3",
            "layer_id_convention": {"draftsmith": "output_of_layer", "config.json": "hf_hidden_states_index (= output_of_layer + 1)"},
            "drafter_config": cfg.to_dict(),
            "weights_sha256": digest,
            **(provenance or {}),
        })
    return Path(out_dir)


def load_speculators(folder: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """Read a speculators-layout EAGLE-3 export back into draftsmith's module (strict)."""
    import json

    folder = Path(folder)
    meta_path = folder / "draftsmith.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} is missing (exports made elsewhere are read by the full reader, issue 5)")
    cfg = Eagle3Config.from_dict(json.loads(meta_path.read_text())["drafter_config"])
    drafter = Eagle3Drafter(cfg)
    state = load_file(str(folder / "model.safetensors"))
    if cfg.draft_vocab_size == cfg.vocab_size:
        state.update(full_vocab_maps(cfg.vocab_size))
    check_tensors(state, drafter, folder)
    drafter.load_state_dict(state, strict=True)
    return drafter.to(dtype) if dtype is not None else drafter
