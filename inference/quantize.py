"""Weight-only rounding of a target, the numerics of quantised serving, for measuring what it
does to a drafter's acceptance (`python -m inference.deploy`, its precision section).

Each scheme rounds a weight [out, in] to what a quantised server stores and dequantises back to
the weight's own dtype, so the model then computes in bf16 / float32 on the rounded values
(weight-only quantisation: activations stay as they are):

- fp8-e4m3: one float32 scale per output channel (row), amax / 448, and every element rounded
  to the nearest float8 e4m3fn value of w / scale (3 mantissa bits: a relative error of at most
  2^-4 for scaled values at or above e4m3's smallest normal, 2^-6; at most half its subnormal
  step, 2^-10, below it).
- int4-g128: groups of 128 consecutive inputs of a row (a shorter last group when `in` is not a
  multiple of 128), each with a float32 scale (max - min) / 15 and an integer zero point
  (asymmetric 4-bit, as AWQ and GPTQ store it); an element is off by at most scale / 2.

`round_target_` applies a scheme to the decoder layers' matrices (attention and MLP
projections); the embedding, the output head and the norms stay as loaded, as weight-only
quantised checkpoints leave them.
"""
from __future__ import annotations

import torch

SCHEMES = ("fp8-e4m3", "int4-g128")
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
INT4_GROUP = 128


def fp8_e4m3_round(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] → w rounded through float8 e4m3fn with per-output-channel scales, in w's dtype."""
    x = w.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX  # [out, 1]
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).to(w.dtype)


def int4_group_round(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """w [out, in] → w rounded to asymmetric 4-bit integers in groups of `group` inputs per row, in w's dtype."""
    out_dim, in_dim = w.shape
    x = w.float()
    pad = -in_dim % group
    if pad:  # the last group is shorter: padded with copies of its own first value, which change neither min nor max
        x = torch.cat([x, x[:, in_dim - (group - pad) : in_dim - (group - pad) + 1].expand(out_dim, pad)], 1)
    g = x.view(out_dim, -1, group)  # [out, groups, group]
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    zero = torch.round(-lo / scale)
    q = (torch.round(g / scale) + zero).clamp(0, 15)
    return ((q - zero) * scale).view(out_dim, -1)[:, :in_dim].to(w.dtype)


ROUNDERS = {"fp8-e4m3": fp8_e4m3_round, "int4-g128": int4_group_round}


def layer_matrices(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The decoder layers' 2-D weights of a runtime model (inference/runtime/model.py, or the
    transformers fallback): every matrix under `layers.` (attention and MLP projections)."""
    return [(name, p) for name, p in model.named_parameters()
            if p.dim() == 2 and ".layers." in f".{name}" and "embed" not in name and "lm_head" not in name]


@torch.no_grad()
def round_target_(model, scheme: str) -> dict[str, torch.Tensor]:
    """Round `model`'s layer matrices in place (the same storage: captured CUDA graphs stay
    valid) by `scheme`; returns the originals on the CPU, for `restore_`."""
    if scheme not in ROUNDERS:
        raise ValueError(f"quantisation scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    saved = {}
    for name, p in layer_matrices(model):
        saved[name] = p.detach().to("cpu", copy=True)
        p.copy_(ROUNDERS[scheme](p))
    if not saved:
        raise ValueError("the target has no decoder-layer matrices to round")
    return saved


@torch.no_grad()
def restore_(model, saved: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, original in saved.items():
        params[name].copy_(original)
