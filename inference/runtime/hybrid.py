"""Hybrid targets in the runtime: Mamba2 selective-state-space layers beside attention (transformers'
`bamba`: BambaConfig, modeling_bamba.py), and the recurrent state they carry between steps.

A Bamba layer is Llama's (input norm, mixer, pre-FFN norm, SwiGLU MLP), its mixer either attention
(partial RoPE: the first rotary_dim dims of each head) or a Mamba2 mixer:
    in_proj: x [B,q,H] → gate z [B,q,I], xBC [B,q,C] (C = I + 2 G N), dt [B,q,nh]
    xBC → causal depthwise conv (kernel K, over the last K-1 inputs kept as the conv state) → silu
    x [B,q,nh,hd], B/C [B,q,G,N]; dt = clamp(softplus(dt + dt_bias)); A = -exp(A_log)
    per token: h = h * exp(dt A) + dt x Bᵀ (the SSM state h [B,nh,hd,N]); y = h C + D x
      (computed for up to SCAN_CHUNK positions at once in closed form: `chunk_states`)
    y → gated RMSNorm (y * silu(z), groups of I/G) → out_proj

Recurrent state and its rollback (kernels/state_rollback.py). Every recurrent layer's conv state
[C,K-1] and SSM state [nh,hd,N] of a row sit side by side in one flat vector of S numbers:
`HybridCache.state` [B,S]. A forward of q tokens at positions [B,q] keeps the state after EACH
of its positions, `history` [B,slots,S] (history[b, j]: after the token at positions[b, 0] + j;
`history_base` [B] = positions[:, 0]; a forward of more than `slots` tokens keeps its last ones). The next forward starts at positions[b, 0], having consumed
everything before it; so its first launch sets each row's state to the one after position
positions[b, 0] - 1, i.e. history[b, positions[b, 0] - 1 - history_base[b]], for all layers at
once: `state_rollback` with n_acc = that index. After a verify of k + 1 tokens with a accepted
drafts the next step starts at the bonus's position, base + a + 1, so n_acc = a: the state after
the last accepted token, picked on the device from the positions, with no host sync. Every loop
(host, device, adaptive widths, plain decoding) gets the rollback so, in the target's forward.
A prefill (right-padded rows) keeps only each row's state at its last prompt token (logits_at).

Not implemented: draft trees (refused with an error naming the target: states along each path).
CUDA graphs: the cache's buffers are static and restorable (`_Layers`), but hybrid steps are not
captured until a GPU run has checked them (`RuntimeModel.graphable` is off for hybrid targets;
tests/test_hybrid_runtime.py's gpu test turns it on for one model and compares with eager).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith_kernels.rms_norm import rms_norm
from draftsmith_kernels.state_rollback import state_rollback

HYBRID_KINDS = {"bamba"}


@dataclass(frozen=True)
class MambaShape:
    heads: int  # nh
    head_dim: int  # hd
    state: int  # N
    conv: int  # K
    groups: int  # G
    intermediate: int  # I = nh hd
    conv_bias: bool
    proj_bias: bool
    dt_min: float
    dt_max: float

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.groups * self.state

    @property
    def sizes(self) -> tuple[int, int]:
        """Numbers of the conv state [C,K-1] and of the SSM state [nh,hd,N] of one row."""
        return self.conv_dim * (self.conv - 1), self.heads * self.head_dim * self.state


def hybrid_fields(hf_config) -> dict:
    """RuntimeConfig fields of a bamba config, refusing what the runtime does not compute."""
    c = hf_config
    if c.hidden_act != "silu":
        raise ValueError(f"bamba with hidden_act {c.hidden_act!r} (the runtime has silu)")
    if getattr(c, "mlp_bias", False) or getattr(c, "attention_bias", False):
        raise ValueError("bamba with mlp_bias or attention_bias (the runtime's bamba layers have no biases there)")
    params = getattr(c, "rope_parameters", None) or {}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotary = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if rotary % 2 or rotary <= 0:
        raise ValueError(f"bamba with a rotary dimension of {rotary} (need a positive even number)")
    lo, hi = c.time_step_limit if c.time_step_limit is not None else (0.0, float("inf"))
    shape = MambaShape(heads=c.mamba_n_heads, head_dim=c.mamba_d_head, state=c.mamba_d_state, conv=c.mamba_d_conv,
                       groups=c.mamba_n_groups, intermediate=int(c.mamba_expand * c.hidden_size),
                       conv_bias=bool(c.mamba_conv_bias), proj_bias=bool(c.mamba_proj_bias), dt_min=float(lo),
                       dt_max=float(hi))
    kinds = tuple("attention" if t == "full_attention" else "mamba" for t in c.layers_block_type)
    return dict(layer_kinds=kinds, mamba=shape, rotary_dim=rotary if rotary != head_dim else None)


def partial_rope_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """perm [d]: new dim i of a query/key head reads old dim perm[i]. transformers' partial RoPE
    rotates pairs (i, i + r/2) of the first r dims and passes the rest; the runtime's RoPE rotates
    pairs (i, i + d/2) of all d with inv_freq [d/2]. Moving old dims r/2..r-1 to d/2.. (the pass
    dims into the gaps) and giving the pass pairs a frequency of 0 (cos 1, sin 0) computes the same
    rotation; q and k permuted alike keep every q·k, and v is untouched."""
    h, half = rotary_dim // 2, head_dim // 2
    rest = list(range(rotary_dim, head_dim))
    return torch.tensor(list(range(h)) + rest[: half - h] + list(range(h, rotary_dim)) + rest[half - h:])


def partial_inv_freq(inv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """inv [r/2] of the rotary dims → [d/2], zeros for the passed pairs (see the permutation)."""
    return torch.cat([inv, inv.new_zeros(head_dim // 2 - inv.shape[0])])


def hybrid_state(state: dict, cfg, source: str) -> dict:
    """bamba's tensor names (without `model.`) → Llama's for the attention layers and the MLPs
    (what hf_to_runtime_state maps), the mixers' under `layers.i.mamba.`; partial-RoPE q/k rows
    permuted (partial_rope_permutation). Returns (llama-named state, mixer tensors)."""
    renamed, mixers = {}, {}
    for name, t in state.items():
        name = name.replace(".feed_forward.", ".mlp.").replace(".pre_ff_layernorm.", ".post_attention_layernorm.")
        if name.startswith("final_layernorm."):
            name = "norm." + name.removeprefix("final_layernorm.")
        (mixers if ".mamba." in name else renamed)[name] = t
    if cfg.rotary_dim is not None:
        perm = partial_rope_permutation(cfg.head_dim, cfg.rotary_dim)
        for name in list(renamed):
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                w = renamed[name]
                renamed[name] = w.view(-1, cfg.head_dim, w.shape[-1])[:, perm].reshape(w.shape)
    m = cfg.mamba
    shapes = {}
    for i, kind in enumerate(cfg.layer_kinds):
        if kind != "mamba":
            continue
        p = f"layers.{i}.mamba."
        shapes.update({p + "in_proj.weight": (m.intermediate + m.conv_dim + m.heads, cfg.hidden_size),
                       p + "conv1d.weight": (m.conv_dim, 1, m.conv), p + "dt_bias": (m.heads,), p + "A_log": (m.heads,),
                       p + "D": (m.heads,), p + "norm.weight": (m.intermediate,),
                       p + "out_proj.weight": (cfg.hidden_size, m.intermediate)})
        if m.conv_bias:
            shapes[p + "conv1d.bias"] = (m.conv_dim,)
        if m.proj_bias:
            shapes.update({p + "in_proj.bias": (m.intermediate + m.conv_dim + m.heads,), p + "out_proj.bias": (cfg.hidden_size,)})
    missing, unexpected = sorted(set(shapes) - set(mixers)), sorted(set(mixers) - set(shapes))
    if missing or unexpected:
        raise KeyError(f"{source}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    wrong = [f"{k} {tuple(mixers[k].shape)} (expected {v})" for k, v in shapes.items() if tuple(mixers[k].shape) != v]
    if wrong:
        raise ValueError(f"{source}: wrong shapes: {', '.join(wrong[:5])}")
    return renamed, mixers


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) in groups of `group` channels (Mamba2's), in float32."""

    def __init__(self, size: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group, self.eps = group, eps

    def forward(self, y, z):
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        g = y.view(*y.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(y.shape).to(dtype)


# positions whose states a scan step materialises at once ([B,chunk,nh,hd,N]): a verify's k + 1
# in one, a prefill in slices (its memory bounded, the carried state exact)
SCAN_CHUNK = 16


def chunk_states(h0, dt, log_decay, x, Bm):
    """The SSM states after each of n positions, in closed form (no loop over positions):
    h_j = exp(c_j) h0 + sum_{i<=j} exp(c_j - c_i) dt_i x_i B_iᵀ, c the cumulative log decay.
    h0 [B,nh,hd,N]; dt, log_decay [B,n,nh]; x [B,n,nh,hd]; Bm [B,n,nh,N] → [B,n,nh,hd,N] float32."""
    n = dt.shape[1]
    c = torch.cumsum(log_decay, 1)  # [B,n,nh]
    lower = torch.ones(n, n, dtype=torch.bool, device=dt.device).tril()
    # exp(c_j - c_i) for i <= j, 0 above the diagonal (the difference is <= 0: no overflow)
    weights = torch.exp((c[:, :, None] - c[:, None, :]).masked_fill(~lower[None, :, :, None], float("-inf")))
    inputs = (dt[..., None] * x)  # [B,n,nh,hd]
    states = torch.einsum("bjih,bihp,bihn->bjhpn", weights, inputs, Bm)
    return states + torch.exp(c)[..., None, None] * h0[:, None]


class MambaMixer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        m = self.shape = cfg.mamba
        self.in_proj = nn.Linear(cfg.hidden_size, m.intermediate + m.conv_dim + m.heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv, groups=m.conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(m.heads))
        self.A_log = nn.Parameter(torch.zeros(m.heads))
        self.D = nn.Parameter(torch.ones(m.heads))
        self.norm = GatedRMSNorm(m.intermediate, m.intermediate // m.groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(m.intermediate, cfg.hidden_size, bias=m.proj_bias)

    def forward(self, x, slot: "RecurrentSlot"):
        """x [B,q,H] → [B,q,H], from the slot's state; the state after each position into the
        slot's history (or only after the kept position, slot.keep [B], in a prefill)."""
        m = self.shape
        B, q, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([m.intermediate, m.conv_dim, m.heads], -1)
        conv0, h = slot.conv_in(), slot.ssm_in().float()  # [B,C,K-1], [B,nh,hd,N]
        window = torch.cat([conv0, xbc.transpose(1, 2).to(conv0.dtype)], -1)  # [B,C,K-1+q]
        w = self.conv1d.weight[:, 0]  # [C,K]
        xbc = F.conv1d(window, w[:, None], self.conv1d.bias, groups=m.conv_dim).transpose(1, 2)  # [B,q,C]
        xs, Bm, Cm = F.silu(xbc).float().split([m.intermediate, m.groups * m.state, m.groups * m.state], -1)
        xs = xs.view(B, q, m.heads, m.head_dim)
        rep = m.heads // m.groups
        Bm = Bm.view(B, q, m.groups, m.state).repeat_interleave(rep, 2)  # [B,q,nh,N]
        Cm = Cm.view(B, q, m.groups, m.state).repeat_interleave(rep, 2)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(m.dt_min, m.dt_max)  # [B,q,nh]
        decay = torch.exp(dt * -torch.exp(self.A_log.float()))  # [B,q,nh]
        ys = []
        for t0 in range(0, q, SCAN_CHUNK):
            t1 = min(q, t0 + SCAN_CHUNK)
            states = chunk_states(h, dt[:, t0:t1], torch.log(decay[:, t0:t1]), xs[:, t0:t1], Bm[:, t0:t1])
            ys.append(torch.einsum("bthpn,bthn->bthp", states, Cm[:, t0:t1]))
            slot.keep_ssm(t0, states)
            h = states[:, -1]
        slot.keep_conv(window)
        y = torch.cat(ys, 1) + self.D.float()[:, None] * xs  # [B,q,nh,hd]
        y = self.norm(y.reshape(B, q, m.intermediate).to(x.dtype), z)
        return self.out_proj(y)


class MambaBlock(nn.Module):
    """A Bamba mamba layer with the attention Block's interface (inference/runtime/model.py):
    k_cache is this layer's RecurrentSlot, v_cache, bias, tree and inv_freq are unused."""

    local = False

    def __init__(self, cfg, mlp):
        super().__init__()
        from models.layers import RMSNorm

        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba = MambaMixer(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, residual, positions, inv_freq, k_cache, v_cache, bias, causal_prefill, tree=None,
                sum_out=None):
        normed, residual = rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual, sum_out=sum_out)
        x = self.mamba(normed, k_cache)
        normed, residual = rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps, residual)
        return self.mlp(normed), residual


class RecurrentSlot:
    """One mamba layer's views into HybridCache: its part [off, off + n) of the flat state."""

    def __init__(self, cache: "HybridCache", offset: int, shape: MambaShape):
        self.cache, self.offset, self.m = cache, offset, shape
        self.n_conv, self.n_ssm = shape.sizes

    def conv_in(self):
        s = self.cache.state
        return s[:, self.offset: self.offset + self.n_conv].view(s.shape[0], self.m.conv_dim, self.m.conv - 1)

    def ssm_in(self):
        s = self.cache.state
        o = self.offset + self.n_conv
        return s[:, o: o + self.n_ssm].view(s.shape[0], self.m.heads, self.m.head_dim, self.m.state)

    def keep_ssm(self, t0: int, states):
        """states [B,n,nh,hd,N]: the SSM states after positions t0.. t0+n-1 of this forward."""
        self.cache.keep(t0, self.offset + self.n_conv, states.reshape(*states.shape[:2], -1))

    def keep_conv(self, window):
        """window [B,C,K-1+q]: the conv state after position t is window[:, :, t+1 : t+K]."""
        K = self.m.conv
        states = window.unfold(2, K - 1, 1)[:, :, 1:]  # [B,C,q,K-1]
        self.cache.keep(0, self.offset, states.permute(0, 2, 1, 3).reshape(window.shape[0], states.shape[2], -1))


HISTORY_SLOTS = 8  # positions whose states a forward keeps: a verify of up to 8 tokens (k <= 7) keeps all


class _Layers(list):
    """HybridCache.k / .v: one entry per layer (a K or V tensor, a RecurrentSlot, or None), with
    the clone / copy_ that a graph capture's `restore` calls (inference/runtime/graphs.py): the
    K (or V) tensors and, for k, the recurrent state, its history and base, put back alike."""

    def __init__(self, entries, cache=None):
        super().__init__(entries)
        self.cache = cache

    def _tensors(self):
        own = [t for t in self if isinstance(t, torch.Tensor)]
        c = self.cache
        return own + ([c.state, c.history, c.history_base] if c is not None else [])

    def clone(self):
        return [t.clone() for t in self._tensors()]

    def copy_(self, saved):
        for t, s in zip(self._tensors(), saved):
            t.copy_(s)
        return self


class HybridCache(nn.Module):
    """A hybrid target's cache: K/V [B,nkv,S,d] for the attention layers (k[i], v[i] by layer, as
    KVCache's), a RecurrentSlot in k[i] for each mamba layer (v[i] None); the flat recurrent
    state [B,S_rec] and the history of the last forward (module docstring): the states after its
    last `slots` positions [B,slots,S_rec], history_base [B] the position of the first kept. Every
    buffer is allocated once and written in place, so a captured step reads the ones the next
    step writes."""

    def __init__(self, cfg, batch: int, max_len: int, dtype, device, slots: int = HISTORY_SLOTS):
        super().__init__()
        kv = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        k, v, offset = [], [], 0
        for kind in cfg.layer_kinds:
            if kind == "attention":
                k.append(torch.zeros(kv, dtype=dtype, device=device))
                v.append(torch.zeros(kv, dtype=dtype, device=device))
            else:
                k.append(RecurrentSlot(self, offset, cfg.mamba))
                v.append(None)
                offset += sum(cfg.mamba.sizes)
        self.size, self.max_len = offset, max_len
        self.state = torch.zeros(batch, offset, dtype=dtype, device=device)
        # before the first forward: the empty state "after position -1"
        self.history = torch.zeros(batch, slots, offset, dtype=dtype, device=device)
        self.history_base = torch.full((batch,), -1, dtype=torch.long, device=device)
        self.k, self.v = _Layers(k, self), _Layers(v)
        self.keep_at, self.kept_from = None, 0

    def begin(self, positions, keep_at=None, prefill: bool = False):
        """At the start of a forward at positions [B,q]: every row's state set to the one after
        positions[:, 0] - 1 (one rollback launch for all layers), or to the empty state for a
        prefill (every row from position 0; the engine reuses caches across generations); then
        the history is this forward's: its last `slots` positions, or one per row (after
        position keep_at [B], a prefill's last prompt token, in slot 0)."""
        if prefill:
            self.state.zero_()
        else:
            state_rollback(self.history, positions[:, 0] - 1 - self.history_base, self.state)
        q = positions.shape[1]
        self.keep_at = keep_at
        self.kept_from = 0 if keep_at is not None else max(0, q - self.history.shape[1])
        self.history_base.copy_(positions[:, 0] + (keep_at if keep_at is not None else self.kept_from))

    def keep(self, t0: int, offset: int, values):
        """values [B,n,m]: numbers [offset, offset + m) of the states after positions t0..t0+n-1 of
        this forward (a prefill: only each row's keep_at position, where it falls in them)."""
        n = values.shape[1]
        part = self.history[:, :, offset: offset + values.shape[2]]
        if self.keep_at is None:
            skip = max(0, self.kept_from - t0)  # positions before the kept ones
            if skip < n:
                part[:, t0 + skip - self.kept_from: t0 + n - self.kept_from].copy_(values[:, skip:])
            return
        inside = (self.keep_at >= t0) & (self.keep_at < t0 + n)  # [B]
        pick = (self.keep_at - t0).clamp(0, n - 1)
        chosen = values.gather(1, pick[:, None, None].expand(-1, 1, values.shape[2]))  # [B,1,m]
        part[:, :1].copy_(torch.where(inside[:, None, None], chosen.to(part.dtype), part[:, :1]))
