"""DSpark layouts (docs/serving.md, "DSpark"): the DFlash backbone's tensors and Qwen3 config as
the DFlash writers make them (export/dflash.py, export/speculators.py), plus the Markov and
confidence heads under vLLM's names, which SGLang reads too:

    markov_head.markov_w1.weight  [V, r]      embedding of the previous token (a target id)
    markov_head.markov_w2.weight  [Vd, r]     its draft-vocab bias
    confidence_head.proj.weight   [1, H + r]  ([1, H] without confidence_with_markov)
    confidence_head.proj.bias     [1]

Two layouts:

- `dspark`: the published dense DSpark config (`architectures: ["Qwen3DSparkModel"]`, a Qwen3
  config), loaded by vLLM 0.33 (`--speculative-config '{"method": "dspark", ...}'`) and by
  SGLang 0.5.23 (`--speculative-algorithm DSPARK`). `block_size` here is the number of drafts
  (SGLang's gamma, vLLM's default token count): B - 1 for draftsmith's block of B, whose anchor
  is the bonus token (`sample_from_anchor: false`; both servers default to true).
- `speculators`: speculators 0.9.0's `speculators_model_type: "dspark"`, read by vLLM 0.33 alone
  (`SpeculatorsConfig`, `algos.py` `update_dspark`); `block_size` is the block B, and the layer
  ids are hidden-states indices (output-of-layer id + 1).

No embedding is stored (both servers use the target's). The head and `d2t`/`t2d` are stored
only for a draft vocabulary smaller than the target's (vLLM requires both then; SGLang's DSpark
has no draft vocabulary, so such an export is served by vLLM alone).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from export.dflash import dflash_config, dflash_from_state
from export.io import atomic_folder, read_json, write_export_files

NATIVE, SPECULATORS = "dspark", "speculators"
ARCHITECTURE = "Qwen3DSparkModel"  # vllm registry.py:681 (qwen3_dspark), sglang models/dspark.py:995
MARKOV_HEAD_TYPE = "vanilla"  # markov_w2(markov_w1[prev]); SGLang requires the key (dspark_config.py:265-268)


def _heads(cfg) -> dict:
    """The DSpark keys both layouts write at the top level (both servers read them there)."""
    return {"markov_rank": cfg.markov_rank, "markov_head_type": MARKOV_HEAD_TYPE,
            # vLLM reads absent flags as false (qwen3_dspark.py:220-221), SGLang as true (dspark.py:490-497)
            "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": bool(cfg.confidence_head and cfg.confidence_with_markov),
            "sample_from_anchor": False}  # the anchor is the bonus token: block positions 1..B-1 draft


def native_config(cfg, target_name: str) -> dict:
    """config.json of the `dspark` layout: DFlash's z-lab Qwen3 config with DSpark's keys."""
    config = dflash_config(cfg, target_name)
    config.update({"architectures": [ARCHITECTURE], "block_size": cfg.block_size - 1,  # drafts per block (gamma)
                   "is_causal": False,  # draftsmith's blocks attend bidirectionally (both servers read it first)
                   **_heads(cfg)})
    return config


def speculators_config(cfg, target_name: str, target_arch: list[str], dtype: str) -> dict:
    """config.json of the `speculators` layout: DFlash's speculators config, retyped."""
    from export.speculators import dflash_speculators_config

    config = dflash_speculators_config(cfg, target_name, target_arch, dtype)
    config["speculators_config"]["algorithm"] = "dspark"
    config.update({"architectures": [ARCHITECTURE], "speculators_model_type": "dspark", **_heads(cfg)})
    config.pop("sliding_window_non_causal", None)  # a DFlash key (update_dspark reads no such key)
    return config


def export_dspark(drafter, out_dir: str | Path, fmt: str = NATIVE, *, target_name: str, target_arch: list[str] | None = None,
                  dtype: torch.dtype = torch.bfloat16, provenance: dict | None = None) -> Path:
    """Write a DSpark drafter in layout `fmt` (dspark or speculators), atomically."""
    cfg = drafter.config
    tensors = {n: t.detach().cpu() for n, t in drafter.state_dict().items() if n != "embed_tokens.weight"}
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:  # the target's head, whole; no maps
        for name in ("lm_head.weight", "d2t", "t2d"):
            tensors.pop(name)
    dtype_name = str(dtype).replace("torch.", "")
    if fmt == NATIVE:
        config = native_config(cfg, target_name)
    elif fmt == SPECULATORS:
        config = speculators_config(cfg, target_name, list(target_arch or []), dtype_name)
    else:
        raise ValueError(f"--format {fmt}: a DSpark drafter is written as {NATIVE} or {SPECULATORS}")
    meta = {"format": fmt, "method": "dspark", "drafter_config": cfg.to_dict()}
    if fmt == SPECULATORS:
        meta["layer_id_convention"] = {"draftsmith": "output_of_layer",
                                       "config.json": "hf_hidden_states_index (= output_of_layer + 1)"}
    with atomic_folder(out_dir) as tmp:
        write_export_files(tmp, tensors, config, meta, provenance)
    return Path(out_dir)


# ---------------------------------------------------------------- reading back
def _flag(config: dict, key: str, vllm_default: bool, sglang_default: bool, folder) -> bool:
    """A flag the two servers default differently: refused when absent (it would be served two ways)."""
    if key in config:
        return bool(config[key])
    if vllm_default == sglang_default:
        return vllm_default
    raise KeyError(f"{folder}/config.json: {key} is missing (vLLM reads it as {str(vllm_default).lower()}, "
                   f"SGLang as {str(sglang_default).lower()})")


def _check_alignment(config: dict, folder, default: bool) -> None:
    if config.get("sample_from_anchor", default):
        raise ValueError(f"{folder}/config.json: sample_from_anchor is true{'' if 'sample_from_anchor' in config else ' (absent)'}: "
                         "B drafts from the anchor, an alignment draftsmith's DSpark does not compute")
    if config.get("markov_head_type", MARKOV_HEAD_TYPE) != MARKOV_HEAD_TYPE:
        raise ValueError(f"{folder}/config.json: markov_head_type {config['markov_head_type']!r}; draftsmith's DSpark "
                         f"computes the {MARKOV_HEAD_TYPE} head")


def _native_served(config: dict, folder):
    """The drafter vLLM and SGLang build from a `dspark` config.json (their defaults for absent keys)."""
    from models.dspark import DSparkConfig
    from models.layers import rope_config

    _check_alignment(config, folder, default=True)  # both default to sampling from the anchor
    d = config.get("dflash_config") or {}
    ids = d.get("target_layer_ids", config.get("target_layer_ids"))  # vllm eagle3_utils.py:121-140, sglang dflash_utils.py:657-660
    mask = d.get("mask_token_id", config.get("mask_token_id"))
    for key, value in (("block_size", config.get("block_size")), ("target_layer_ids", ids), ("mask_token_id", mask),
                       ("markov_rank", config.get("markov_rank")),
                       ("markov_head_type (SGLang refuses a rank without it)", config.get("markov_head_type"))):
        if value is None:
            raise KeyError(f"{folder}/config.json: {key} is missing")
    from transformers import AutoConfig

    hf = AutoConfig.for_model("qwen3", **{k: v for k, v in config.items() if k != "model_type"})
    theta, scaling = rope_config(hf)
    head = _flag(config, "enable_confidence_head", False, True, folder)
    return DSparkConfig(vocab_size=hf.vocab_size, draft_vocab_size=config.get("draft_vocab_size") or hf.vocab_size,
                        hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
                        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                        target_num_layers=config.get("num_target_layers") or max(ids) + 1, mask_token_id=mask,
                        target_layer_ids=list(ids), num_layers=hf.num_hidden_layers, block_size=int(config["block_size"]) + 1,
                        rms_norm_eps=hf.rms_norm_eps, rope_theta=theta, rope_scaling=scaling,
                        max_position_embeddings=hf.max_position_embeddings, markov_rank=int(config["markov_rank"]),
                        confidence_head=head,
                        confidence_with_markov=head and _flag(config, "confidence_head_with_markov", False,
                                                              int(config["markov_rank"]) > 0, folder))


def _speculators_served(config: dict, folder):
    """The drafter vLLM builds from a speculators `dspark` config.json (algos.py update_dspark)."""
    from export.speculators import _layer_fields
    from models.dspark import DSparkConfig

    fields, layer = _layer_fields(config, folder)
    _check_alignment(config, folder, default=False)  # algos.py:188: absent is false here
    proposal = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
    for key, value in (("aux_hidden_state_layer_ids", config.get("aux_hidden_state_layer_ids")),
                       ("mask_token_id", config.get("mask_token_id")), ("markov_rank", config.get("markov_rank")),
                       ("speculators_config.proposal_methods[0].speculative_tokens", proposal.get("speculative_tokens"))):
        if value is None:
            raise KeyError(f"{folder}/config.json: {key} is missing")
    ids = [i - 1 for i in sorted(set(config["aux_hidden_state_layer_ids"]))]  # vLLM sorts and de-duplicates
    head = bool(config.get("enable_confidence_head", False))  # qwen3_dspark.py:220-221: absent is false
    return DSparkConfig(**fields, draft_vocab_size=config.get("draft_vocab_size") or fields["vocab_size"],
                        target_num_layers=max(ids) + 4, mask_token_id=config["mask_token_id"], target_layer_ids=ids,
                        num_layers=layer.num_hidden_layers, block_size=int(proposal["speculative_tokens"]) + 1,
                        markov_rank=int(config["markov_rank"]), confidence_head=head,
                        confidence_with_markov=head and bool(config.get("confidence_head_with_markov", False)))


def served_config(config: dict, folder):
    """The drafter config a server builds from config.json alone (its defaults for absent keys)."""
    return (_speculators_served if config.get("speculators_model_type") else _native_served)(config, folder)


def load_dspark(folder: str | Path, dtype: torch.dtype = torch.float32, target: str | None = None, served: bool = False):
    """Read either layout back strictly; the embedding (and the head unless stored) come from the
    target. served: from config.json alone, as the servers read it."""
    from models.dspark import DSparkConfig, DSparkDrafter

    folder = Path(folder)
    config = read_json(folder / "config.json")
    meta = read_json(folder / "draftsmith.json") if (folder / "draftsmith.json").is_file() else {}
    cfg = DSparkConfig.from_dict(meta["drafter_config"]) if "drafter_config" in meta and not served else served_config(config, folder)
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    target = target or meta.get("target") or verifier or config.get("base_model_name_or_path")
    drafter = dflash_from_state(cfg, load_file(str(folder / "model.safetensors")), target, folder, drafter_cls=DSparkDrafter)
    return drafter.to(dtype)


# ---------------------------------------------------------------- the layout's entry points
def write(drafter, out, ctx) -> Path:
    arch = list(getattr(ctx.hf_config, "architectures", None) or [])
    return export_dspark(drafter, out, ctx.fmt, target_arch=arch, **ctx.common())


def reads(config: dict) -> bool:
    if config.get("speculators_model_type"):
        return config["speculators_model_type"] == "dspark"
    return (config.get("architectures") or [None])[0] == ARCHITECTURE


def read(folder, dtype=torch.float32, served: bool = False):
    return load_dspark(folder, dtype=dtype, served=served)


# ---------------------------------------------------------------- what export.check holds it to
# keys a server defaults when absent (the mask token, the rank and the layer ids have no default: a
# config without them does not build, level b)
REQUIRED_KEYS = ("block_size", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                 "sample_from_anchor", "draft_vocab_size")


def served_facts(config: dict) -> dict:
    """What vLLM 0.33 and SGLang 0.5.23 read from config.json beside the drafter config, each as it
    reads it (`vllm.` / `sglang.` where the two default differently; the heads' keys sit at the top
    level in both layouts). drafts: the tokens drafted per step (the native layout's block_size,
    the speculators layout's speculative_tokens); target_layer_ids: output-of-layer ids as the
    target captures them."""
    rank = config.get("markov_rank")
    facts = {key: config.get(key) for key in ("markov_rank", "markov_head_type", "draft_vocab_size")}
    facts.update({"architecture": (config.get("architectures") or [None])[0],
                  "vllm.enable_confidence_head": config.get("enable_confidence_head", False),  # qwen3_dspark.py:220
                  "vllm.confidence_head_with_markov": config.get("confidence_head_with_markov", False),  # :221
                  "sglang.enable_confidence_head": config.get("enable_confidence_head", True),  # dspark.py:490-495
                  "sglang.confidence_head_with_markov": config.get("confidence_head_with_markov", isinstance(rank, int) and rank > 0),  # :497
                  "sglang.sample_from_anchor": config.get("sample_from_anchor", True)})  # dspark_config.py:29-31
    if config.get("speculators_model_type"):
        layer = config.get("transformer_layer_config") or {}
        proposal = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
        aux = config.get("aux_hidden_state_layer_ids")
        return {**facts, "vllm.sample_from_anchor": config.get("sample_from_anchor", False),  # algos.py:188
                "is_causal": layer.get("is_causal"), "drafts": proposal.get("speculative_tokens"),
                "mask_token_id": config.get("mask_token_id"),
                "target_layer_ids": None if aux is None else [i - 1 for i in aux],  # algos.py:195
                "vocab_size": layer.get("vocab_size"), "hidden_size": config.get("target_hidden_size", layer.get("hidden_size")),
                "rope_theta": layer.get("rope_theta")}
    d = config.get("dflash_config") or {}
    return {**facts, "vllm.sample_from_anchor": config.get("sample_from_anchor", True),  # dspark/speculator.py:49-51
            "is_causal": config.get("is_causal"), "drafts": config.get("block_size"),
            "mask_token_id": d.get("mask_token_id", config.get("mask_token_id")),
            "target_layer_ids": d.get("target_layer_ids", config.get("target_layer_ids")),
            **{key: config.get(key) for key in ("vocab_size", "hidden_size", "rope_theta")},
            "target_num_layers": config.get("num_target_layers")}


def expected_facts(method: str, trained: dict, k: int | None) -> dict:
    """What served_facts must say for the trained drafter: name -> (value, why)."""
    block, head = trained["block_size"], bool(trained["confidence_head"])
    with_markov = head and bool(trained["confidence_with_markov"])
    return {"architecture": (ARCHITECTURE, "the DSpark model both servers register"),
            "markov_rank": (trained["markov_rank"], "trained"),
            "markov_head_type": (MARKOV_HEAD_TYPE, "draftsmith's Markov head is markov_w2(markov_w1[prev])"),
            "mask_token_id": (trained["mask_token_id"], "trained"), "draft_vocab_size": (trained["draft_vocab_size"], "trained"),
            "target_layer_ids": (list(trained["target_layer_ids"]), "the trained output-of-layer ids"),
            "drafts": (block - 1, f"a block of {block} drafts {block - 1} (its anchor is the bonus token)"),
            "is_causal": (False, "draftsmith's blocks attend bidirectionally"),
            **{f"{server}.enable_confidence_head": (head, "trained") for server in ("vllm", "sglang")},
            **{f"{server}.confidence_head_with_markov": (with_markov, "trained") for server in ("vllm", "sglang")},
            **{f"{server}.sample_from_anchor": (False, "the anchor is the verified bonus token: B-1 drafts")
               for server in ("vllm", "sglang")}}


def taken_from_target(method: str, stored: set) -> set:
    # the embedding is never stored; the head is, as draft rows, only when Vd < V
    return {"embed_tokens.weight"} | ({"lm_head.weight"} - stored)


def launch_lines(folder: str, config: dict, meta: dict) -> list[str]:
    """vLLM 0.33 (`method: dspark`, B - 1 drafts a step) loads both layouts; SGLang 0.5.23
    (`DSPARK`, a verify window of B = gamma + 1, speculative_hook.py:816-836) the `dspark` one
    with the full vocabulary (its Markov head and head are the target's V wide)."""
    from export.formats import served_target, sglang_line, vllm_line

    target = served_target(config, meta)
    if config.get("speculators_model_type"):
        drafts = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
        return [vllm_line(target, "dspark", folder, drafts)]
    drafts = int(config["block_size"])
    lines = [vllm_line(target, "dspark", folder, drafts)]
    if config.get("draft_vocab_size", config["vocab_size"]) == config["vocab_size"]:
        lines.append(sglang_line(target, "DSPARK", folder, "--speculative-num-draft-tokens", str(drafts + 1)))
    return lines
