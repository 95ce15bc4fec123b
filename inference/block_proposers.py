"""Cached, fixed-shape proposers for MTP and DFlash drafters, for a speculative loop that lives
on the device (one CUDA graph per step). They draft exactly what `RecomputeProposer` drafts
(the drafter's own training-time predictor, greedy), without re-running the verified prefix.

Interface (besides the host loop's propose / propose_sampled / accepted):
    begin(prompts, aux, first)   eager, after prefill
    draft() -> [B,k]             greedy drafts; a static buffer written in place
    draft_sampled(T, generator)  -> drafts [B,k], q [B,k,V] (static buffers)
    advance(fed, aux, accepted, bonus, active)   after verification
draft / draft_sampled / advance never sync with the host, keep their shapes fixed for a given
(batch, max_len, k) and only update preallocated state in place.

Positions: a row holding x_0..x_{n-1} (x_{n-1} the bonus, not yet fed to the target) has target
features at positions <= n-2 and drafts from the anchor a = n-2 (see models/mtp.py and
models/dflash.py). Cache entries are written by position; entries past what the verified text
allows are stale and are overwritten before any query can see them: correctness comes from the
position masks, never from copies.

Shapes: B batch, S = max_len cache positions, k drafts, H hidden, nh/nkv heads, hd head dim,
Vd draft vocab, V target vocab, W target feature width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.device_proposer import HostLoopInterface, check_drafter_fits
from inference.model import cache_mask
from kernels.decode_attention import DECODE_MAX_QUERIES, decode_attention, decode_attention_reference
from kernels.rejection_sample import inverse_cdf
from kernels.rms_norm import rms_norm
from kernels.rope_cache import rope_cache
from kernels.silu_mul import silu_mul
from models.layers import apply_rope, rope_cos_sin


def write_by_position(buf, dim, positions, values, valid):
    """buf [B, .., S at `dim`, ..] <- values (buf's shape with q at `dim`) at positions [B,q]
    where valid [B,q]; every other entry keeps its value and no index leaves [0, S).

    positions must be consecutive per row (p0, p0+1, ..., any integers) and valid must imply
    0 <= position < S. An invalid entry rewrites the old value of a parking slot outside the
    row's window (p0-1, or q when p0 <= 0; needs S > q), so no valid write shares its index and
    the duplicate parked writes all carry the same value: deterministic, graph-safe."""
    B, q = positions.shape
    S = buf.shape[dim]
    start = positions[:, :1]
    park = torch.where(start > 0, (start - 1).clamp_max(S - 1), torch.full_like(start, q))
    shape = [B] + [1] * (buf.dim() - 1)
    shape[dim] = q
    index = torch.where(valid, positions, park).view(shape).expand(values.shape)
    keep = valid.view(shape)
    buf.scatter_(dim, index, torch.where(keep, values.to(buf.dtype), buf.gather(dim, index)))


class _DeviceProposer(HostLoopInterface):
    """What the MTP and DFlash proposers share: the checks RecomputeProposer makes, the static
    output buffers, the pick of a draft (greedy or sampled); the host-loop wrappers come from
    HostLoopInterface."""

    def __init__(self, drafter, k: int, batch: int, max_len: int, target_config):
        cfg = drafter.config
        check_drafter_fits(drafter, k, target_config)
        if max_len <= k + 1:
            raise ValueError(f"max_len {max_len} leaves no room for a verify window of k+1={k + 1} positions")
        self.drafter, self.k = drafter.eval(), k
        self.aux_layers = tuple(drafter.aux_layer_ids) or (target_config.num_layers,)
        self.batch, self.max_len = batch, max_len
        p = drafter.lm_head.weight
        self.dtype, self.device = p.dtype, p.device
        self.draft_ids = drafter.draft_ids()  # [Vd] target id of each draft id
        self.anchor = torch.zeros(batch, dtype=torch.long, device=p.device)  # a = n-2 per row
        self.drafts = torch.zeros(batch, k, dtype=torch.long, device=p.device)
        # target-vocabulary columns outside the draft vocabulary are never written: q = 0 there
        self.q = torch.zeros(batch, k, cfg.vocab_size, dtype=torch.float32, device=p.device)

    def _pick(self, j: int, logits, temperature, generator):
        """logits [B,Vd] of draft j → self.drafts[:, j] (and self.q[:, j] when sampling)."""
        if not temperature:
            self.drafts[:, j].copy_(self.draft_ids[logits.argmax(-1)])
            return
        probs = torch.softmax(logits.float() / temperature, -1)  # [B,Vd]
        u = torch.rand(probs.shape[0], device=probs.device, generator=generator)
        self.drafts[:, j].copy_(self.draft_ids[inverse_cdf(probs, u)])
        self.q[:, j].index_copy_(1, self.draft_ids, probs)

    def draft(self) -> torch.Tensor:
        self._draft(0.0, None)
        return self.drafts

    def draft_sampled(self, temperature: float, generator=None):
        self._draft(temperature, generator)
        return self.drafts, self.q


def _heads(linear, x, heads: int, head_dim: int):
    """x [B,q,H] → linear(x) as [B,heads,q,hd]."""
    B, q, _ = x.shape
    return linear(x).view(B, q, heads, head_dim).transpose(1, 2)


class MTPCachedProposer(_DeviceProposer):
    """MTP drafting from per-module caches of the teacher-forced streams.

    Module d's teacher-forced (tf) entry at position t' reads x_{t'+d} and module d-1's tf
    hidden state at t' (module 0: the target's feature), so it exists once x_{t'+d} is verified:
    for t' <= a+1-d. Per module the proposer keeps the K/V of those entries [B,nkv,S+1,hd] and
    (for the next module and the chain) their outputs [B,S+1,H]; each advance extends every
    module's stream by a window of k+1 positions starting after its valid end, masked to what
    the text now allows. The chain from the anchor a follows `MTPDrafter.unroll(greedy=True)`:
    module 1's drafted state is its tf output at a; module d > 1 reads the previous draft and
    attends to its tf entries at positions <= a+1-d and to its own drafted entry.

    Every buffer has one slot past the S positions, a scratch slot: a write the text does not
    allow yet is parked there (one scatter, no read-back of the old value) and no query ever
    sees it (queries see slots <= their position < S). Each module's layer runs through the
    runtime's kernels (fused norms, RoPE written into the cache, decode attention), about 14
    launches instead of about 45."""

    def __init__(self, drafter, k: int, batch: int, max_len: int, target_config):
        super().__init__(drafter, k, batch, max_len, target_config)
        cfg = drafter.config
        B, S, H = batch, max_len, cfg.hidden_size
        self.tokens = torch.zeros(B, S + 1, dtype=torch.long, device=self.device)  # verified x_t by position
        # hidden[0]: target features h^0; hidden[d]: module d's tf output (module 1's feeds the chain)
        self.hidden = torch.zeros(max(k, 2), B, S + 1, H, dtype=self.dtype, device=self.device)
        kv = (k, B, cfg.num_key_value_heads, S + 1, cfg.head_dim)
        self.k_cache = torch.zeros(kv, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(kv, dtype=self.dtype, device=self.device)
        # q, k, v and gate, up in one matmul each, as the runtime model stores them
        modules = drafter.mtp[:k]
        self.qkv_weight = [torch.cat([m.self_attn.q_proj.weight, m.self_attn.k_proj.weight, m.self_attn.v_proj.weight]).detach()
                           for m in modules]
        self.gate_up_weight = [torch.cat([m.mlp.gate_proj.weight, m.mlp.up_proj.weight]).detach() for m in modules]

    def _slots(self, positions, valid):
        """Where writes at positions [B,q] go: the position where valid, else the scratch slot S."""
        return torch.where(valid, positions, self.max_len)

    def _layer(self, d: int, token, hidden, positions, slots, bound):
        """MTPModule d on token [B,q], h^{d-1} [B,q,H]: RoPE at positions [B,q], K/V written at
        slots [B,q], each query attending to cache slots <= bound [B,q]. Returns h^d [B,q,H]
        (the function of `MTPModule.forward`)."""
        module, cfg = self.drafter.mtp[d - 1], self.drafter.config
        eps = cfg.rms_norm_eps
        embeds, _ = rms_norm(self.drafter.embed_tokens(token).to(self.dtype), module.enorm.weight, eps)
        normed, _ = rms_norm(hidden, module.hnorm.weight, eps)
        x = module.eh_proj(torch.cat([embeds, normed], -1))  # embedding first
        qkv = F.linear(rms_norm(x, module.input_layernorm.weight, eps)[0], self.qkv_weight[d - 1])
        k_cache, v_cache = self.k_cache[d - 1], self.v_cache[d - 1]
        q = rope_cache(qkv, positions, self.drafter.inv_freq, k_cache, v_cache, cfg.num_attention_heads,
                       cfg.num_key_value_heads, slots=slots)
        # the prompt's whole stream at once (begin) goes through the torch form
        attend = decode_attention if token.shape[1] <= DECODE_MAX_QUERIES else decode_attention_reference
        attn = module.self_attn.o_proj(attend(q, k_cache, v_cache, bound))
        post, h = rms_norm(attn, module.post_attention_layernorm.weight, eps, x)  # h = x + attention
        return module.mlp.down_proj(silu_mul(F.linear(post, self.gate_up_weight[d - 1]))) + h

    def _extend(self, d: int, positions, valid):
        """Teacher-forced entries of module d at consecutive positions [B,q] (written where
        valid): causal over the stream, the query at t' sees entries at positions <= t'."""
        S, H = self.max_len, self.hidden.shape[-1]
        at = positions.clamp(0, S - 1)
        token = self.tokens.gather(1, (positions + d).clamp(0, S - 1))  # x_{t'+d}
        prev = self.hidden[d - 1].gather(1, at[..., None].expand(-1, -1, H))  # h^{d-1}_{t'}
        slots = self._slots(positions, valid)
        h = self._layer(d, token, prev, at, slots, at)
        if d < self.hidden.shape[0]:
            self.hidden[d].scatter_(1, slots[..., None].expand(-1, -1, H), h)

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        B, T, _ = aux.shape
        rows = torch.zeros(B, self.max_len + 1, dtype=torch.long)  # built on the host: one copy
        for b, (p, f) in enumerate(zip(prompts, first)):
            rows[b, : len(p)] = torch.as_tensor(p)
            rows[b, len(p)] = int(f)
        self.tokens.copy_(rows)
        self.anchor.copy_(torch.as_tensor([len(p) - 1 for p in prompts]))
        self.hidden[0, :, :T] = aux.to(self.dtype)  # beyond a row's prompt: stale, overwritten when verified
        positions = torch.arange(T, device=self.device).expand(B, T)
        for d in range(1, self.k + 1):  # entries past a row's valid end are stale, overwritten later
            self._extend(d, positions, torch.ones(B, T, dtype=torch.bool, device=self.device))

    @torch.no_grad()
    def _draft(self, temperature, generator):
        S, H, eps = self.max_len, self.hidden.shape[-1], self.drafter.config.rms_norm_eps
        a = self.anchor[:, None]  # [B,1]
        h = self.hidden[1].gather(1, a[..., None].expand(-1, 1, H))  # module 1's tf output at a: [B,1,H]
        for d in range(1, self.k + 1):
            module = self.drafter.mtp[d - 1]
            if d > 1:
                # module d's own drafted key goes to the first stale slot of its stream (a+2-d),
                # RoPE at a: seeing slots <= a+2-d shows exactly its tf entries <= a+1-d and itself
                slot = (a + 2 - d).clamp(0, S - 1)
                h = self._layer(d, self.drafts[:, d - 2 : d - 1], h, a, slot, slot)
            logits = F.linear(rms_norm(h, module.shared_head_norm.weight, eps)[0], self.drafter.lm_head.weight)
            self._pick(d - 1, logits[:, 0], temperature, generator)

    @torch.no_grad()
    def advance(self, fed, aux, accepted, bonus, active):
        S, k, H = self.max_len, self.k, self.hidden.shape[-1]
        j = torch.arange(k + 1, device=self.device)[None]  # [1,k+1]
        n, act = accepted[:, None], active[:, None]
        fed_at = self.anchor[:, None] + 1 + j  # positions of fed tokens, N-1 .. N-1+k
        anchor = torch.where(active, self.anchor + accepted + 1, self.anchor)
        # verified text grows by d_1..d_n, bonus at N..N+n; the features of fed tokens 0..n are verified
        grown = torch.where(j == n, bonus[:, None], torch.cat([fed[:, 1:], bonus[:, None]], 1))
        self.tokens.scatter_(1, self._slots(fed_at + 1, act & (j <= n) & (fed_at + 1 < S)), grown)
        feature_slots = self._slots(fed_at, act & (j <= n) & (fed_at < S))
        self.hidden[0].scatter_(1, feature_slots[..., None].expand(-1, -1, H), aux.to(self.dtype))
        for d in range(1, k + 1):  # module d-1's stream is extended first: module d reads it
            window = self.anchor[:, None] + 2 - d + j  # after the old valid end a+1-d
            valid = act & (window >= 0) & (window <= anchor[:, None] + 1 - d) & (window < S)
            self._extend(d, window, valid)
        self.anchor.copy_(anchor)


class DFlashCachedProposer(_DeviceProposer):
    """DFlash drafting from a per-layer cache of the context keys and values.

    The context of a block is hidden_norm(fc(features)) at the verified positions; every layer
    projects it to keys k_norm(k_proj(c)) (RoPE at the context position) and values v_proj(c)
    independently of the block, so these are cached [L,B,nkv,S,hd] and written as features are
    verified (k+1 positions per advance, masked to the accepted ones). Each draft runs the
    block [bonus, MASK x (B-1)] at positions a+1..a+B through every layer, its own keys and
    values computed fresh, attending to cache positions <= a and to the whole block, as
    `DFlashDrafter.block_logits` does. The block's drafts do not condition on each other
    (positions 2.. read MASK), so sampled drafts are independent draws from each position's
    softmax and q is that softmax."""

    def __init__(self, drafter, k: int, batch: int, max_len: int, target_config):
        super().__init__(drafter, k, batch, max_len, target_config)
        cfg = drafter.config
        kv = (cfg.num_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = torch.zeros(kv, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(kv, dtype=self.dtype, device=self.device)
        self.bonus = torch.zeros(batch, dtype=torch.long, device=self.device)  # x_{a+1}, the block's first token
        self.block_offsets = torch.arange(cfg.block_size, device=self.device)

    def _write_context(self, features, positions, valid):
        """features [B,q,W] at consecutive positions [B,q] → every layer's context K/V."""
        context = self.drafter.hidden_norm(self.drafter.fc(features.to(self.dtype)))  # [B,q,H]
        cos, sin = rope_cos_sin(self.drafter.inv_freq, positions.clamp(0, self.max_len - 1), self.dtype)
        for i, layer in enumerate(self.drafter.layers):
            attn = layer.self_attn
            k = apply_rope(attn.k_norm(_heads(attn.k_proj, context, attn.nkv, attn.d)), cos, sin)
            write_by_position(self.k_cache[i], 2, positions, k, valid)
            write_by_position(self.v_cache[i], 2, positions, _heads(attn.v_proj, context, attn.nkv, attn.d), valid)

    def _block_logits(self):
        """Logits [B,k,Vd] of block positions 1..k."""
        cfg = self.drafter.config
        B, Bs, S = self.batch, cfg.block_size, self.max_len
        block = torch.cat([self.bonus[:, None], torch.full_like(self.drafts[:, :1], cfg.mask_token_id).expand(B, Bs - 1)], 1)
        positions = self.anchor[:, None] + 1 + self.block_offsets  # [B,Bs]
        cos, sin = rope_cos_sin(self.drafter.inv_freq, positions, self.dtype)
        sees = torch.cat([cache_mask(self.anchor[:, None], S).expand(B, 1, Bs, S),
                          torch.ones(B, 1, Bs, Bs, dtype=torch.bool, device=self.device)], -1)  # [B,1,Bs,S+Bs]
        h = self.drafter.embed_tokens(block).to(self.dtype)  # [B,Bs,H]
        for i, layer in enumerate(self.drafter.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rope(attn.q_norm(_heads(attn.q_proj, x, attn.nh, attn.d)), cos, sin)
            k = apply_rope(attn.k_norm(_heads(attn.k_proj, x, attn.nkv, attn.d)), cos, sin)
            v = _heads(attn.v_proj, x, attn.nkv, attn.d)
            out = F.scaled_dot_product_attention(q, torch.cat([self.k_cache[i], k], 2), torch.cat([self.v_cache[i], v], 2),
                                                 attn_mask=sees, enable_gqa=attn.nh != attn.nkv)  # [B,nh,Bs,hd]
            h = h + attn.o_proj(out.transpose(1, 2).reshape(B, Bs, attn.nh * attn.d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.drafter.lm_head(self.drafter.norm(h[:, 1 : self.k + 1]))

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        B, T, _ = aux.shape
        self.anchor.copy_(torch.as_tensor([len(p) - 1 for p in prompts], device=self.device))
        self.bonus.copy_(torch.as_tensor(first, device=self.device))
        # positions past a row's prompt are padding: stale, overwritten once verified
        self._write_context(aux, torch.arange(T, device=self.device).expand(B, T),
                            torch.ones(B, T, dtype=torch.bool, device=self.device))

    @torch.no_grad()
    def _draft(self, temperature, generator):
        logits = self._block_logits()
        for j in range(self.k):
            self._pick(j, logits[:, j], temperature, generator)

    @torch.no_grad()
    def advance(self, fed, aux, accepted, bonus, active):
        j = torch.arange(self.k + 1, device=self.device)[None]
        fed_at = self.anchor[:, None] + 1 + j  # N-1 .. N-1+k: features of t_{N-1}, d_1..d_n are verified
        self._write_context(aux, fed_at, active[:, None] & (j <= accepted[:, None]) & (fed_at < self.max_len))
        self.anchor.copy_(torch.where(active, self.anchor + accepted + 1, self.anchor))
        self.bonus.copy_(torch.where(active, bonus, self.bonus))
