"""EAGLE-1 layouts (docs/formats.md), both a one-layer Llama config.json + model.safetensors with
`embed_tokens`, `fc`, `layers.0.*` (no input norm) and no head or final norm: the server uses
the target's head.

- `eagle` (SGLang 0.5.23 `LlamaForCausalLMEagle`, the EAGLE reference): fc with a bias. No
  `bias` key: SGLang's Llama attention reads `bias` as "attention biases", which the file has
  not, and its fc has a bias whatever the config says. A draft vocabulary smaller than the
  target's adds `d2t`/`t2d` (draftsmith's runtime) and `hot_token_ids.pt`, the [Vd] int64
  target id of each draft row: SGLang's EAGLE-1 ignores d2t and drafts over all of V unless
  launched with `--speculative-token-map DIR/hot_token_ids.pt` (eagle_worker_v2.py: the
  target's head rows at those ids, draft row i = target token hot[i]), which launch_lines adds.
- `eagle-vllm` (vLLM 0.33 method `eagle`, `EagleLlamaForCausalLM`): vLLM's fc has no bias and
  its head is the target's whole one, so only a drafter trained with `drafter.eagle1.fc_bias=false`
  and Vd = V is written; anything else is refused, naming why (docs/serving.md), except the
  training run's own export (`runtime_only`) of an fc without bias and Vd < V, which no server
  computes and draftsmith's runtime reads (with d2t/t2d).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch
from safetensors.torch import load_file

from export.io import atomic_folder, check_tensors, full_vocab_maps, target_embedding_and_head, write_export_files
from models.eagle1 import Eagle1Config, Eagle1Drafter


ARCHITECTURES = {"eagle": "LlamaForCausalLMEagle", "eagle-vllm": "EagleLlamaForCausalLM"}
TOKEN_MAP = "hot_token_ids.pt"  # SGLang's --speculative-token-map for a draft vocabulary (torch.load, weights_only)


def eagle1_config(cfg: Eagle1Config, target_name: str, fmt: str = "eagle") -> dict:
    return {
        "architectures": [ARCHITECTURES[fmt]], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "draft_vocab_size": cfg.draft_vocab_size,
        "base_model_name_or_path": target_name,
    }


def vllm_problems(cfg: Eagle1Config) -> list[str]:
    """Why vLLM 0.33's `eagle` method would not compute this drafter (empty: it would)."""
    problems = []
    if cfg.fc_bias:
        problems.append("vLLM 0.33's EAGLE-1 fc has no bias and this drafter's has one (train with drafter.eagle1.fc_bias=false)")
    if cfg.draft_vocab_size != cfg.vocab_size:
        problems.append(f"vLLM 0.33's EAGLE-1 drafts over the target's whole vocabulary and this drafter's "
                        f"draft_vocab_size is {cfg.draft_vocab_size} < {cfg.vocab_size} (train with Vd = V)")
    return problems


def export_eagle1(drafter: Eagle1Drafter, out_dir: str | Path, *, target_name: str, dtype: torch.dtype = torch.bfloat16,
                  provenance: dict | None = None, fmt: str = "eagle", runtime_only: bool = False) -> Path:
    """runtime_only: the training run's own export, where an fc without a bias and Vd < V (no
    server computes it) is written in the eagle-vllm layout with its maps, for draftsmith's runtime."""
    cfg = drafter.config
    problems = vllm_problems(cfg)
    runtime_alone = runtime_only and fmt == "eagle-vllm" and not cfg.fc_bias and cfg.draft_vocab_size < cfg.vocab_size
    if fmt == "eagle-vllm" and problems and not runtime_alone:
        raise ValueError("cannot export to eagle-vllm: " + "; ".join(problems) + " (--format eagle serves it in SGLang)")
    if runtime_alone:
        print(f"note: {out_dir} is served by draftsmith's runtime only: " + "; ".join(problems))
    if fmt == "eagle" and not cfg.fc_bias:
        raise ValueError("cannot export to eagle: SGLang 0.5.23's EAGLE-1 fc always has a bias and this drafter has "
                         "none (--format eagle-vllm serves it in vLLM)")
    tensors = {n: t.detach().cpu() for n, t in drafter.state_dict().items() if n != "lm_head.weight"}
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors.pop("d2t"), tensors.pop("t2d")
    with atomic_folder(out_dir) as tmp:
        write_export_files(tmp, tensors, eagle1_config(cfg, target_name, fmt),
                           {"format": fmt, "method": "eagle1", "drafter_config": cfg.to_dict(),
                            "served_by": ["draftsmith"] if runtime_alone else
                            ["sglang==0.5.23" if fmt == "eagle" else "vllm==0.33", "draftsmith"]}, provenance)
        if fmt == "eagle" and cfg.draft_vocab_size < cfg.vocab_size:
            torch.save(drafter.draft_ids().detach().cpu().to(torch.int64), tmp / TOKEN_MAP)
    return Path(out_dir)


def served_config(config: dict, folder) -> Eagle1Config:
    """The drafter config a server builds from config.json alone (its defaults for absent keys)."""
    return Eagle1Config(vocab_size=config["vocab_size"], draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]),
                       hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
                       num_attention_heads=config["num_attention_heads"],
                       num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
                       head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                       target_num_layers=0, rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
                       rope_scaling=config.get("rope_scaling"), max_position_embeddings=config["max_position_embeddings"],
                       fc_bias=(config.get("architectures") or [""])[0] != ARCHITECTURES["eagle-vllm"])


def load_eagle1(folder: str | Path, dtype: torch.dtype = torch.float32, target: str | None = None,
                served: bool = False) -> Eagle1Drafter:
    """Read the layout back strictly; the head comes from the target (named in draftsmith.json
    unless given), restricted to the draft vocabulary. served: build the drafter from
    config.json alone, as a server does (draftsmith.json's drafter config ignored)."""
    folder = Path(folder)
    meta = json.loads((folder / "draftsmith.json").read_text()) if (folder / "draftsmith.json").is_file() else {}
    config = json.loads((folder / "config.json").read_text())
    if "drafter_config" in meta and not served:
        cfg = Eagle1Config.from_dict(meta["drafter_config"])
    else:  # an export made elsewhere, or read as a server reads it
        cfg = served_config(config, folder)
    target = target or meta.get("target") or config.get("base_model_name_or_path")
    if not target:
        raise ValueError(f"{folder}: an EAGLE-1 export uses its target's head; name the target")
    drafter = Eagle1Drafter(cfg)
    state = load_file(str(folder / "model.safetensors"))
    if cfg.draft_vocab_size == cfg.vocab_size:
        state.update(full_vocab_maps(cfg.vocab_size))
    check_tensors(state, drafter, folder, ("lm_head.weight",))
    shapes = drafter.state_dict()
    _, head = target_embedding_and_head(target)
    if head.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"target {target}: head of shape {tuple(head.shape)}, the drafter needs ({cfg.vocab_size}, {cfg.hidden_size})")
    drafter.load_state_dict({**state, "lm_head.weight": torch.zeros_like(shapes["lm_head.weight"])}, strict=True)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(head[drafter.draft_ids()])
    return drafter.to(dtype)


# ---------------------------------------------------------------- the layout's entry points
# one module, two layouts: eagle (SGLang) and eagle-vllm, told apart by ctx.fmt / the architecture
def write(drafter, out, ctx) -> Path:
    return export_eagle1(drafter, out, fmt=ctx.fmt, runtime_only=ctx.runtime_only, **ctx.common())


def launch_lines(folder: str, config: dict, meta: dict) -> list[str]:
    """SGLang's EAGLE chain (with the token map of a draft vocabulary), or vLLM's `eagle` method."""
    from export.formats import draft_length, served_target, sglang_chain_flags, sglang_line, vllm_line

    target, k = served_target(config, meta), draft_length(config, meta)
    trained = meta.get("drafter_config") or {}
    if meta.get("format") == "eagle-vllm":
        return [] if "vllm==0.33" not in meta.get("served_by", ["vllm==0.33"]) else [vllm_line(target, "eagle", folder, k)]
    flags = sglang_chain_flags(k)
    if trained.get("draft_vocab_size", config["vocab_size"]) < config["vocab_size"]:
        flags += ("--speculative-token-map", shlex.quote(str(Path(folder) / TOKEN_MAP)))
    return [sglang_line(target, "EAGLE", folder, *flags)]


def reads(config: dict) -> bool:
    return (config.get("architectures") or [None])[0] in ARCHITECTURES.values()


def read(folder, dtype=torch.float32, served: bool = False):
    return load_eagle1(folder, dtype=dtype, served=served)


# ---------------------------------------------------------------- what export.check holds it to
REQUIRED_KEYS = ()  # rope_theta, the one a reader would default, export.check requires as a stated RoPE base


def served_facts(config: dict) -> dict:
    """What servers read from config.json beside the drafter config (served_config)."""
    return {"bias": bool(config.get("bias")), "attention_bias": bool(config.get("attention_bias")),
            **{key: config.get(key) for key in ("vocab_size", "hidden_size", "rope_theta")}}


def expected_facts(method: str, trained: dict, k: int | None) -> dict:
    why = "servers would create attention biases the file does not hold"
    return {"bias": (False, why), "attention_bias": (False, why)}


def taken_from_target(method: str, stored: set) -> set:
    return {"lm_head.weight"}  # never stored: the server uses the target's head
