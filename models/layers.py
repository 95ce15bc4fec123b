"""Llama building blocks shared by the drafters: RMSNorm, rotary embedding, gated MLP.

Kept numerically identical to transformers' Llama (float32 norm statistics, rotate-half RoPE)
so that a drafter layer initialised from a target layer reproduces it.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from models.draft_vocab import check_draft_vocab


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderAttention(nn.Module):
    """A Llama attention over an input of `width` features (H; EAGLE-3's [embedding; feature]
    is 2H) with transformers' projection names, so a target layer's weights load as they are.
    What each query sees is the caller's `attend(q, k, v)` ([B,nh,T,d] each → [B,nh,T,d]):
    a TTT unroll, an MTP stream, a runtime KV cache."""

    def __init__(self, cfg, width: int | None = None):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = width or cfg.hidden_size
        self.q_proj = nn.Linear(width, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(width, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(width, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend):
        """x [B,T,width] → [B,T,H]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.nkv != self.nh:  # expand KV heads here: the fused attention kernels want equal heads
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        return self.o_proj(attend(q, k, v).transpose(1, 2).reshape(B, T, self.nh * self.d))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2]; supports no scaling, `linear` and `llama3` scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        import math

        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
    return inv.float()


def keep_rope_float32(module: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """`nn.Module._apply` for a module with an `inv_freq` buffer: moves move it, dtype casts
    leave it float32 (set as a drafter's `_apply`). Rounded to bfloat16 the frequencies are off
    by up to 0.4 %, so the angle between positions 300 apart turns by up to about 0.3 rad:
    a drafter cast to bfloat16 for serving would rotate its keys unlike in training, where the
    module stays float32 under autocast."""
    inv_freq = module.inv_freq
    nn.Module._apply(module, fn, recurse)
    module.inv_freq = inv_freq.to(module.inv_freq.device)
    return module


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [*positions.shape, head_dim] for rotate-half RoPE."""
    freqs = positions.unsqueeze(-1).float() * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, T, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_config(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling) from an HF config, across the transformers 4 and 5 spellings. A config
    with parameters per layer type (Gemma-3: "full_attention" and "sliding_attention") gives its
    global layers' (a drafter's layer attends over the whole context)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        kind = params.get("rope_type", "default")
        return float(params["rope_theta"]), (None if kind == "default" else dict(params))
    theta = getattr(hf_config, "rope_theta", 10000.0)
    return float(theta), getattr(hf_config, "rope_scaling", None)


class DictConfig:
    """to_dict / from_dict for the drafters' config dataclasses (what checkpoints and exports
    store); an unknown key is an error naming it, never dropped."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
        return cls(**d)


def decoder_shape(hf_config) -> dict:
    """The fields a drafter built from the target's decoder layer copies from its config:
    sizes, head layout, norm epsilon, RoPE (the target's base, never a default), depth."""
    theta, scaling = rope_config(hf_config)
    return dict(vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                intermediate_size=hf_config.intermediate_size, num_attention_heads=hf_config.num_attention_heads,
                num_key_value_heads=getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads),
                head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
                target_num_layers=hf_config.num_hidden_layers, rms_norm_eps=hf_config.rms_norm_eps,
                rope_theta=theta, rope_scaling=scaling, max_position_embeddings=hf_config.max_position_embeddings)


@dataclasses.dataclass(kw_only=True)
class DecoderShape(DictConfig):
    """The fields every drafter built from the target's decoder layer shares (what
    `decoder_shape` copies, plus the draft vocabulary); a method's config extends it with its
    own fields. Keyword-only, so a method's required fields may follow these defaults."""

    vocab_size: int  # V: the target's vocabulary
    draft_vocab_size: int  # Vd: rows of the draft head
    hidden_size: int  # H (the target's)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_num_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    layer_id_convention: str = "output_of_layer"

    def __post_init__(self):
        check_draft_vocab(self.draft_vocab_size, self.vocab_size)

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, **fields):
        """The target's decoder shape with this method's own `fields`."""
        return cls(**decoder_shape(hf_config), draft_vocab_size=draft_vocab_size, **fields)


def check_layer_ids(ids: list[int], num_layers: int, what: str = "aux layer id") -> None:
    """Layer ids must be in range and strictly increasing: vLLM sorts and de-duplicates them
    and SGLang captures in layer order, so any other list trains on one feature order and is
    served another."""
    for i in ids:
        if not 0 <= i < num_layers:
            raise ValueError(f"{what} {i} is out of range for a {num_layers}-layer target (0..{num_layers - 1})")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        field = "target_layer_ids" if what == "target layer id" else "aux_layer_ids"
        raise ValueError(f"{field} {list(ids)} must be strictly increasing (servers capture the layers sorted and "
                         f"de-duplicated: use {sorted(set(ids))})")
