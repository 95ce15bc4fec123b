"""The DSpark drafter as vLLM 0.33 and SGLang 0.5.23 build it from an export folder, restated from
their loaders (docs/serving.md, "DSpark", cites file and line for each rule) with no draftsmith
module: what each server reads from config.json (`vllm_view`, `sglang_view`), which of its
parameters each tensor of model.safetensors fills (`vllm_load`, `sglang_load`), and the forward
they compute (`reference_block`): the DFlash backbone over one block, the base logits, the
Markov bias left to right and the confidence. tests/test_dspark_export.py holds draftsmith's
exports to it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}  # vllm qwen3_dflash.py:403-409, sglang models/dflash.py:887-893


# ---------------------------------------------------------------- config.json as each server reads it
def vllm_view(config: dict, num_speculative_tokens: int | None = None) -> dict:
    """What vLLM 0.33's Qwen3DSparkForCausalLM and DSparkSpeculator read, with their defaults.
    A speculators config is first turned into the served config (speculators/base.py:59, algos.py:153-209)."""
    if config.get("speculators_config") is not None:  # transformers_utils/config.py:363-366
        if config.get("speculators_model_type") != "dspark":
            raise ValueError(f"speculators_model_type {config.get('speculators_model_type')!r} is not dspark")
        hf = dict(config["transformer_layer_config"])
        archs = [a for a in config.get("architectures") or [] if a in ("Qwen3DSparkModel", "Qwen3OmniDSparkModel")]
        hf["architectures"] = archs or ["Qwen3DSparkModel"]
        hf["sample_from_anchor"] = config.get("sample_from_anchor", False)
        aux = config["aux_hidden_state_layer_ids"]  # required (KeyError otherwise)
        hf["eagle_aux_hidden_state_layer_ids"] = aux
        hf["target_layer_ids"] = [i - 1 for i in aux]
        for key in ("draft_vocab_size", "target_hidden_size", "mask_token_id", "markov_rank", "markov_head_type",
                    "block_size", "enable_confidence_head", "confidence_head_with_markov", "use_aux_hidden_state"):
            if config.get(key) is not None:
                hf[key] = config[key]
        tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]  # base.py:120-131
    else:
        hf = dict(config)
        tokens = num_speculative_tokens if num_speculative_tokens is not None else hf.get("block_size")  # speculative.py:1592-1599
    d = hf.get("dflash_config") or {}
    # eagle3_utils.py:113-140: eagle ids, else dflash_config / dspark / top-level target ids + 1
    aux = (hf.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in d.get("target_layer_ids") or []]
           or [i + 1 for i in hf.get("dspark_target_layer_ids") or []] or [i + 1 for i in hf.get("target_layer_ids") or []])
    if "mask_token_id" in d:  # spec_decode/utils.py:92-114
        mask = d["mask_token_id"]
    else:
        mask = hf.get("mask_token_id", hf.get("dspark_noise_token_id"))

    def causal(i):  # qwen3_dflash.py:62-73
        if hf.get("is_causal") is not None:
            return bool(hf["is_causal"])
        if d.get("causal") is not None:
            return bool(d["causal"])
        types = hf.get("layer_types")
        return bool(types) and types[i] == "sliding_attention"

    head = bool(hf.get("enable_confidence_head", False))  # qwen3_dspark.py:220
    return {"architecture": hf["architectures"][0], "vocab_size": hf["vocab_size"],
            "draft_vocab_size": hf.get("draft_vocab_size") or hf["vocab_size"],  # qwen3_dspark.py:206-208, 240-241
            "hidden_size": hf["hidden_size"], "target_hidden_size": hf.get("target_hidden_size") or hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"], "markov_rank": hf["markov_rank"],
            "markov_head_type": hf.get("markov_head_type", "vanilla"),  # qwen3_dspark builds the vanilla head only
            "confidence_head": head, "confidence_with_markov": head and bool(hf.get("confidence_head_with_markov", False)),
            "sample_from_anchor": bool(hf.get("sample_from_anchor", True)),  # dspark/speculator.py:49-51
            "aux_hidden_states": tuple(sorted(set(aux))), "mask_token_id": mask,
            "causal": [causal(i) for i in range(hf["num_hidden_layers"])], "drafts": tokens,
            "use_aux_hidden_state": {**(hf.get("eagle_config") or {}), **d}.get("use_aux_hidden_state",
                                                                               hf.get("use_aux_hidden_state", True)),
            "logit_scale": hf.get("logit_scale", 1.0)}  # qwen3_dspark.py:249


def sglang_view(config: dict, num_draft_tokens: int | None = None) -> dict:
    """What SGLang 0.5.23's Qwen3DSparkModel and DSpark worker read (speculative/dspark_components/
    dspark_config.py:29-31, 84-134, 214-322; speculative/dflash_utils.py:588-700; models/dspark.py:385-500)."""
    if config.get("speculators_config") is not None:
        raise ValueError("SGLang reads no speculators config")
    d = {**(config.get("dflash_config") or {}), **(config.get("dspark_config") or {})}
    rank = int(d.get("markov_rank", config.get("markov_rank", 0)) or 0)
    kind = d.get("markov_head_type", config.get("markov_head_type"))
    if rank <= 0:
        raise ValueError("DSpark requires markov_rank > 0")
    if kind is None:
        raise ValueError("DSpark requires markov_head_type when markov_rank > 0")
    block = d.get("block_size", config.get("block_size"))
    gamma = num_draft_tokens - 1 if num_draft_tokens is not None else block
    if num_draft_tokens is not None and block is not None and num_draft_tokens != block + 1:
        raise ValueError("speculative_num_draft_tokens must equal gamma + 1")  # speculative_hook.py:826-834
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]  # Qwen3Config's default
    causal = [bool(config["is_causal"]) if config.get("is_causal") is not None else t != "full_attention" for t in types]
    return {"architecture": config["architectures"][0], "vocab_size": config["vocab_size"],
            "hidden_size": config["hidden_size"], "num_layers": config["num_hidden_layers"], "markov_rank": rank,
            "markov_head_type": str(kind).lower(), "mask_token_id": d.get("mask_token_id", config.get("mask_token_id")),
            "gamma": gamma, "target_layer_ids": d.get("target_layer_ids", config.get("target_layer_ids")),
            "sample_from_anchor": bool(config.get("sample_from_anchor", True)),
            "confidence_head": bool(config.get("enable_confidence_head", True)),
            "confidence_with_markov": bool(config.get("confidence_head_with_markov", rank > 0)), "causal": causal}


# ---------------------------------------------------------------- which parameters the tensors fill
def _backbone(view: dict, config: dict, prefix: str, fc_in: int) -> dict:
    """name -> shape of the DFlash backbone's parameters (fused q/k/v and gate/up, as both servers hold them)."""
    H = view["hidden_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = config.get("head_dim") or H // nh, config["intermediate_size"]
    shapes = {f"{prefix}fc.weight": (H, fc_in), f"{prefix}hidden_norm.weight": (H,), f"{prefix}norm.weight": (H,)}
    for i in range(view["num_layers"]):
        p = f"{prefix}layers.{i}."
        shapes.update({p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_up_proj.weight": (2 * inter, H), p + "mlp.down_proj.weight": (H, inter),
                       p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
    return shapes


def _fused(name: str, shape, filled: dict) -> None:
    """Add a file tensor to the parameter it fills (q/k/v and gate/up stack on dim 0 into one)."""
    for part, whole in STACKED.items():
        if part in name:
            fused, prev = name.replace(part, whole), filled.get(name.replace(part, whole))
            rows = (prev[0] if prev else 0) + shape[0]
            filled[fused] = (rows, *shape[1:]) if prev is None or tuple(prev[1:]) == tuple(shape[1:]) else ("mismatched",)
            return
    filled[name] = tuple(shape)


def _compare(expected: dict, filled: dict, unexpected: list, where: str) -> list[str]:
    left = "random" if where == "SGLang" else "unloaded"
    problems = [f"{where}: {name} is not in the file (left {left})" for name in expected if name not in filled]
    problems += [f"{where}: {name} has shape {shape}, the server's parameter {tuple(expected[name])}"
                 for name, shape in filled.items() if name in expected and tuple(shape) != tuple(expected[name])]
    return problems + [f"{where}: {name}" for name in unexpected]


def vllm_load(config: dict, shapes: dict, target_vocab: int) -> list[str]:
    """qwen3_dspark.py:312-372 on the file's tensor names and shapes: [] when every parameter the
    model keeps is filled with its shape and nothing is unexpected (AutoWeightsLoader raises then)."""
    view = vllm_view(config)
    V, Vd, r, H = view["vocab_size"], view["draft_vocab_size"], view["markov_rank"], view["hidden_size"]
    expected = _backbone(view, config.get("transformer_layer_config") or config, "model.",
                         view["target_hidden_size"] * len(view["aux_hidden_states"]))  # qwen3_dflash.py:84-93
    expected.update({"model.markov_head.markov_w1.weight": (V, r), "model.markov_head.markov_w2.weight": (Vd, r)})
    names = set(shapes)
    has = {key: any(key in n for n in names) for key in ("embed_tokens", "lm_head", "d2t", "confidence_head")}
    if V > target_vocab and not has["embed_tokens"] or Vd < target_vocab and not (has["lm_head"] and has["d2t"]):
        return ["vLLM refuses the folder: a reduced draft vocabulary needs lm_head and d2t (qwen3_dspark.py:341-357)"]
    if has["lm_head"]:
        expected["lm_head.weight"] = (Vd, H)
    if Vd < target_vocab:
        expected["draft_id_to_target_id"] = (Vd,)  # qwen3_dspark.py:262-268
    if view["confidence_head"] and has["confidence_head"]:  # qwen3_dspark.py:220-230, 366-368
        width = H + (r if view["confidence_with_markov"] else 0)
        expected.update({"model.confidence_head.proj.weight": (1, width), "model.confidence_head.proj.bias": (1,)})
    filled, unexpected = {}, []
    for name, shape in shapes.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        if "mask_embedding" in name or ("confidence_head" in name and not view["confidence_head"]) or "embed_tokens" in name:
            continue
        _fused(name, shape, filled)
    unexpected = [f"{n} is not a parameter of the model (AutoWeightsLoader raises)" for n in filled if n not in expected]
    return _compare(expected, filled, unexpected, "vLLM")


def sglang_load(config: dict, shapes: dict) -> list[str]:
    """models/dspark.py:627-696 (and the DFlash backbone's load_weights, models/dflash.py:886-1000,
    which skips a name it does not know): [] when every parameter is filled with its shape."""
    view = sglang_view(config)
    V, r, H = view["vocab_size"], view["markov_rank"], view["hidden_size"]
    expected = _backbone(view, config, "", H * len(view["target_layer_ids"]))  # models/dflash.py:745-775
    expected.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})  # dspark.py:198-199
    if view["confidence_head"]:  # dspark.py:487-507
        width = H + (r if view["confidence_with_markov"] else 0)
        expected.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    filled, unexpected = {}, []
    for name, shape in shapes.items():
        plain = name.removeprefix("model.")
        if plain.startswith(("lm_head.", "rotary_emb.", "embed_tokens.")):  # dspark.py:510, 636-641
            continue
        if name.startswith(("markov_head.", "confidence_head.")) and name not in expected:
            unexpected.append(f"{name} is not a parameter of the model (SGLang raises, dspark.py:650-681)")
            continue
        if plain not in expected and not any(part in plain for part in STACKED):
            continue  # the backbone's loader skips an unknown name silently: the missing parameter says it
        _fused(plain, shape, filled)
    return _compare(expected, filled, unexpected, "SGLang")


# ---------------------------------------------------------------- the forward both compute
def _rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w.float()


def _rope(x, pos, theta):
    """Neox-style RoPE (both servers' default: is_neox_style true) on x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None], torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def reference_block(folder: str | Path, embed: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, features: torch.Tensor,
                    anchor: int, forced: torch.Tensor | None = None) -> dict:
    """One block as vLLM's DSparkSpeculator drafts it greedily (sample_from_anchor false: the query
    rows are [x_{a+1}, mask x N] at positions a+1..a+1+N, dspark/speculator.py:156-209) from the
    folder alone (float32): ids [T] target ids, features [T, n*H] the target's captured states in
    layer order, anchor a (the context is positions 0..a). forced [N]: each step's previous token
    (x_{a+1}, then the text) instead of the anchor and the drafts (training's teacher forcing). embed / head: the target's
    [V, H] (the head's draft rows are read from the file when it stores them).
    Returns {"logits" [N, Vd] (base + Markov bias), "base" [N, Vd], "tokens" [N] target ids,
    "confidence" [N] or None}."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    view = vllm_view(config)
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    layer = config.get("transformer_layer_config") or config
    eps, theta = layer["rms_norm_eps"], float(layer.get("rope_theta") or (layer.get("rope_parameters") or {})["rope_theta"])
    nh, nkv = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or layer["hidden_size"] // nh
    N = view["drafts"]
    ctx = _rms(features[: anchor + 1].float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [a+1, H]
    block_ids = torch.full((N + 1,), view["mask_token_id"], dtype=torch.long)
    block_ids[0] = ids[anchor + 1]
    h = embed.float()[block_ids]  # [N+1, H]
    q_pos = torch.arange(anchor + 1, anchor + 2 + N)
    k_pos = torch.cat([torch.arange(anchor + 1), q_pos])
    for i in range(view["num_layers"]):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd)
        kv_in = torch.cat([ctx, x])  # context K/V from the normed fc output, no input norm (qwen3_dflash.py:586-614)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), q_pos, theta)
        k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), k_pos, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5  # non-causal: every block row sees the whole block
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(len(q_pos), nh * hd)
        h = h + out @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    hidden = _rms(h, w["norm.weight"], eps)[1:]  # the anchor row drafts nothing (sglang dspark_draft.py:88-94)
    d2t = w.get("d2t")
    rows = w["lm_head.weight"] if "lm_head.weight" in w else head.float()
    base = hidden @ rows.T * view["logit_scale"]
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    prev, logits, tokens, embeds = ids[anchor + 1], [], [], []
    for j in range(N):  # the Markov stage, left to right (dspark/speculator.py:185-200)
        if forced is not None:
            prev = forced[j]
        e = w1[prev]
        logits.append(base[j] + (e @ w2.T) * view["logit_scale"])
        row = int(logits[-1].argmax())
        tokens.append(row + (int(d2t[row]) if d2t is not None else 0))  # qwen3_dspark.py:278-282
        embeds.append(e)
        prev = tokens[-1]
    confidence = None
    if view["confidence_head"]:  # qwen3_dspark.py:185-189, 305-310
        x = torch.cat([hidden, torch.stack(embeds)], -1) if view["confidence_with_markov"] else hidden
        confidence = torch.sigmoid(x @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"]).squeeze(-1)
    return {"logits": torch.stack(logits), "base": base, "tokens": torch.tensor(tokens), "confidence": confidence}
