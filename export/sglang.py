"""SGLang / EAGLE layout for EAGLE-3 (docs/formats.md): a flat one-layer LlamaConfig with
`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size` always written,
`eagle_config: {eagle_aux_hidden_state_layer_ids (output-of-layer ids), use_aux_hidden_state,
norm_before_fc}`, every value a reader would default written out, and tensors named
`midlayer.*` instead of `layers.0.*`, with the embedding shipped (a missing one is
random-initialised by the EAGLE reference loader without an error).

SGLang 0.5.23 reads `norm_before_fc` (eagle_config first, then the top level) and then loads
`input_norm.weight`, so that option is carried (the EAGLE reference loader does not know it:
such an export is for SGLang). Its residual is always the pre-norm hidden state: a drafter
trained with `norm_before_residual` is refused, naming the layout that carries it (speculators).

EAGLE-3.1's flags are carried too: SGLang 0.5.23 reads `fc_norm` (or its older name
`use_aux_norm`) and `norm_output` from the top level only (llama_eagle3.py:185-196, 207), loads
`fc_norm.{i}.weight` (prefixed `model.`, :372) and feeds the next draft step the final-normed
state when norm_output is set (:267-268). The EAGLE reference loader knows neither.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from export.io import atomic_folder, check_tensors, full_vocab_maps, write_export_files
from models.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layer_ids


class UnsupportedOption(ValueError):
    pass


def sglang_config(cfg: Eagle3Config, target_name: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True,
                         "norm_before_fc": cfg.norm_before_fc},
        "norm_before_fc": cfg.norm_before_fc, "norm_before_residual": False,
        "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,  # top level: SGLang reads them nowhere else
        "base_model_name_or_path": target_name,
        **({"target_hidden_size": cfg.target_hidden_size} if cfg.target_hidden_size != cfg.hidden_size else {}),
    }


def check_expressible(cfg: Eagle3Config) -> list[str]:
    """Reasons this drafter cannot be written faithfully in the SGLang layout (empty: it can)."""
    problems = []
    if cfg.norm_before_residual:
        problems.append("drafter.eagle3.norm_before_residual=true: SGLang 0.5.23's EAGLE-3 layer always takes the pre-norm "
                        "hidden state as the residual and has no such option (the speculators layout carries it; "
                        "norm_before_fc alone is served by both)")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if cfg.head_dim != head_dim:
        problems.append(f"head_dim {cfg.head_dim}: EAGLE readers take hidden_size // num_attention_heads = {head_dim}")
    if cfg.rope_scaling and set(cfg.rope_scaling) - {"type", "factor", "rope_type"}:
        problems.append("rope_scaling beyond {type, factor}: the EAGLE reader cannot parse it (the speculators layout carries it)")
    return problems


def export_sglang(drafter: Eagle3Drafter, out_dir: str | Path, *, target_name: str, dtype: torch.dtype = torch.bfloat16,
                  provenance: dict | None = None) -> Path:
    cfg = drafter.config
    problems = check_expressible(cfg)
    if problems:
        raise UnsupportedOption("cannot export to sglang: " + "; ".join(problems))
    tensors = {}
    for name, t in drafter.state_dict().items():
        tensors[name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name] = t
    tensors = {n: (t.detach().cpu().to(dtype) if t.is_floating_point() else t.detach().cpu()).contiguous()
               for n, t in tensors.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors.pop("d2t"), tensors.pop("t2d")
    notes = []
    if cfg.norm_before_fc:
        notes.append("norm_before_fc: SGLang 0.5.23 reads it and loads input_norm; the EAGLE reference loader does not")
    for flag in ("fc_norm", "norm_output"):
        if getattr(cfg, flag):
            notes.append(f"{flag} (EAGLE-3.1): SGLang 0.5.23 reads it; the EAGLE reference loader does not")
    if list(cfg.aux_layer_ids) != default_aux_layer_ids(cfg.target_num_layers):
        notes.append(f"aux layers {cfg.aux_layer_ids} are not the default {default_aux_layer_ids(cfg.target_num_layers)}: "
                     "SGLang reads eagle_config, but the EAGLE reference loader ignores it and would feed other layers")
    with atomic_folder(out_dir) as tmp:
        write_export_files(tmp, tensors, sglang_config(cfg, target_name), {
            "format": "sglang", "method": "eagle3", "drafter_config": cfg.to_dict(), "notes": notes,
            "layer_id_convention": {"draftsmith": "output_of_layer", "config.json eagle_config": "output_of_layer"}},
            provenance)
    for note in notes:
        print(f"note: {note}")
    return Path(out_dir)


def served_config(config: dict, folder) -> Eagle3Config:
    """The drafter config a server builds from config.json alone (its defaults for absent keys)."""
    if "draft_vocab_size" not in config:
        raise KeyError(f"{folder}/config.json: draft_vocab_size is missing")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        raise KeyError(f"{folder}/config.json: eagle_config.eagle_aux_hidden_state_layer_ids is missing (name the layers)")
    return Eagle3Config(vocab_size=config["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
                       hidden_size=config["hidden_size"], target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
                       intermediate_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
                       num_key_value_heads=config["num_key_value_heads"],
                       head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                       aux_layer_ids=sorted(set(ids)),  # SGLang captures distinct layers in layer order
                       target_num_layers=max(ids) + 4, rms_norm_eps=config["rms_norm_eps"],
                       rope_theta=config["rope_theta"], rope_scaling=config.get("rope_scaling"),
                       max_position_embeddings=config["max_position_embeddings"],
                       norm_before_fc=bool((config.get("eagle_config") or {}).get("norm_before_fc", config.get("norm_before_fc", False))),
                       fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm", False)),  # llama_eagle3.py:185-187
                       norm_output=bool(config.get("norm_output", False)))


def load_sglang(folder: str | Path, dtype: torch.dtype = torch.float32, served: bool = False) -> Eagle3Drafter:
    """Read the layout back strictly into draftsmith's EAGLE-3 module (served: from config.json
    alone, with SGLang's defaults for absent keys)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    meta_path = folder / "draftsmith.json"
    if meta_path.is_file() and not served:
        cfg = Eagle3Config.from_dict(json.loads(meta_path.read_text())["drafter_config"])
    else:  # an export made elsewhere, or read as a server reads it
        cfg = served_config(config, folder)
    drafter = Eagle3Drafter(cfg)
    state = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v
             for k, v in load_file(str(folder / "model.safetensors")).items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        state.update(full_vocab_maps(cfg.vocab_size))
    check_tensors(state, drafter, folder)
    drafter.load_state_dict(state, strict=True)
    return drafter.to(dtype)


# ---------------------------------------------------------------- the layout's entry points
def write(drafter, out, ctx) -> Path:
    return export_sglang(drafter, out, **ctx.common())


def reads(config: dict) -> bool:
    return (config.get("architectures") or [None])[0] == "LlamaForCausalLMEagle3"


def read(folder, dtype=torch.float32, served: bool = False):
    return load_sglang(folder, dtype=dtype, served=served)


# ---------------------------------------------------------------- what export.check holds it to
REQUIRED_KEYS = ("draft_vocab_size", "eagle_config", "rms_norm_eps", "max_position_embeddings", "hidden_act",
                 "num_key_value_heads")  # rope_theta too: export.check requires every stated RoPE base


def served_facts(config: dict) -> dict:
    """What SGLang reads from config.json beside the drafter config (served_config)."""
    return {"eagle_config.eagle_aux_hidden_state_layer_ids": (config.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids"),
            "norm_before_residual": bool(config.get("norm_before_residual")),
            "fc_norm": bool(config.get("fc_norm") or config.get("use_aux_norm", False)),
            "norm_output": bool(config.get("norm_output", False)),
            **{key: config.get(key) for key in ("vocab_size", "hidden_size", "rope_theta")}}


def expected_facts(method: str, trained: dict, k: int | None) -> dict:
    """What served_facts must say for the trained drafter: name -> (value, why). A trained
    norm_before_residual is named by the served config already (SGLang serves it false)."""
    return {"eagle_config.eagle_aux_hidden_state_layer_ids": (trained["aux_layer_ids"], "the trained output-of-layer ids"),
            "norm_before_residual": (False, "SGLang 0.5.23 has no such option (the residual is pre-norm)"),
            **{flag: (bool(trained.get(flag, False)), "trained") for flag in ("fc_norm", "norm_output")}}


def launch_lines(folder: str, config: dict, meta: dict) -> list[str]:
    """SGLang 0.5.23's EAGLE3 as a chain of the trained length (d2t is read as its hot token map)."""
    from export.formats import draft_length, served_target, sglang_chain_flags, sglang_line

    return [sglang_line(served_target(config, meta), "EAGLE3", folder, *sglang_chain_flags(draft_length(config, meta)))]
