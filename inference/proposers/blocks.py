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
position masks, never from copies. A write the text does not allow yet goes to a scratch slot
past the positions, which no query sees (one scatter, no read-back).

Shapes: B batch, S = max_len cache positions, k drafts, H hidden, nh/nkv heads, hd head dim,
Vd draft vocab, V target vocab, W target feature width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.proposers.device import HostLoopInterface, check_drafter_fits
from draftsmith_kernels.argmax import argmax_rows
from draftsmith_kernels.decode_attention import DECODE_MAX_QUERIES, decode_attention, decode_attention_reference
from draftsmith_kernels.rejection_sample import inverse_cdf
from draftsmith_kernels.rms_norm import head_norm, rms_norm
from draftsmith_kernels.rope_cache import rope_cache
from draftsmith_kernels.silu_mul import swiglu_into


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
        if not temperature:  # argmax, mapped to target ids, written into the column: one kernel pair
            argmax_rows(logits, self.drafts[:, j], self.draft_ids)
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
        self.module_ids = torch.arange(1, k + 1, device=self.device)[:, None, None]  # [k,1,1]: d = 1..k
        self.columns = torch.arange(k + 1, device=self.device)[None]  # [1,k+1]

    def _slots(self, positions, valid):
        """Where writes at positions [B,q] go: the position where valid, else the scratch slot S."""
        return torch.where(valid, positions, self.max_len)

    def _layer(self, d: int, token, hidden, positions, slots, bound):
        """MTPModule d on token [B,q], h^{d-1} [B,q,H]: RoPE at positions [B,q], K/V written at
        slots [B,q], each query attending to cache slots <= bound [B,q]. Returns h^d [B,q,H]
        (the function of `MTPModule.forward`)."""
        module, cfg = self.drafter.mtp[d - 1], self.drafter.config
        eps = cfg.rms_norm_eps
        H = hidden.shape[-1]
        both = hidden.new_empty(*hidden.shape[:-1], 2 * H)  # [B,q,2H]: embedding first (a lookup fused into its norm)
        rms_norm(self.drafter.embed_tokens.weight, module.enorm.weight, eps, ids=token, out=both[..., :H])
        rms_norm(hidden, module.hnorm.weight, eps, out=both[..., H:])
        x = module.eh_proj(both)
        qkv = F.linear(rms_norm(x, module.input_layernorm.weight, eps)[0], self.qkv_weight[d - 1])
        k_cache, v_cache = self.k_cache[d - 1], self.v_cache[d - 1]
        q = rope_cache(qkv, positions, self.drafter.inv_freq, k_cache, v_cache, cfg.num_attention_heads,
                       cfg.num_key_value_heads, slots=slots)
        # the prompt's whole stream at once (begin) goes through the torch form
        attend = decode_attention if token.shape[1] <= DECODE_MAX_QUERIES else decode_attention_reference
        attn = module.self_attn.o_proj(attend(q, k_cache, v_cache, bound))
        post, h = rms_norm(attn, module.post_attention_layernorm.weight, eps, x)  # h = x + attention
        return swiglu_into(h, post, self.gate_up_weight[d - 1], module.mlp.down_proj)  # h + MLP(post)

    def _windows(self, positions, valid):
        """Index tensors of every module's extension at once (a few launches, not a few per
        module): positions, valid [D,B,q] → (at, token_at, slots), each [D,B,q]: positions
        clamped into the cache, where module d reads x_{t'+d}, and where its writes go."""
        S = self.max_len
        d = self.module_ids[: positions.shape[0]]  # [D,1,1]: 1..D
        return positions.clamp(0, S - 1), (positions + d).clamp(0, S - 1), self._slots(positions, valid)

    def _extend(self, d: int, at, token_at, slots):
        """Teacher-forced entries of module d at consecutive positions (clamped: at [B,q];
        written at slots [B,q]; see _windows): causal over the stream, the query at t' sees
        entries at positions <= t'."""
        H = self.hidden.shape[-1]
        token = self.tokens.gather(1, token_at)  # x_{t'+d}
        prev = self.hidden[d - 1].gather(1, at[..., None].expand(-1, -1, H))  # h^{d-1}_{t'}
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
        positions = torch.arange(T, device=self.device).expand(self.k, B, T)
        windows = self._windows(positions, torch.ones_like(positions, dtype=torch.bool))
        for d in range(1, self.k + 1):  # entries past a row's valid end are stale, overwritten later
            self._extend(d, *(w[d - 1] for w in windows))

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
        j = self.columns  # [1,k+1]
        n, act = accepted[:, None], active[:, None]
        fed_at = self.anchor[:, None] + 1 + j  # positions of fed tokens, N-1 .. N-1+k
        anchor = torch.where(active, self.anchor + accepted + 1, self.anchor)
        # verified text grows by d_1..d_n, bonus at N..N+n; the features of fed tokens 0..n are verified
        grown = torch.where(j == n, bonus[:, None], torch.cat([fed[:, 1:], bonus[:, None]], 1))
        self.tokens.scatter_(1, self._slots(fed_at + 1, act & (j <= n) & (fed_at + 1 < S)), grown)
        feature_slots = self._slots(fed_at, act & (j <= n) & (fed_at < S))
        self.hidden[0].scatter_(1, feature_slots[..., None].expand(-1, -1, H), aux.to(self.dtype))
        # module d's window starts after its old valid end a+1-d and keeps what the text now allows
        d = self.module_ids  # [k,1,1]
        window = (self.anchor[:, None] + 2 + j) - d  # [k,B,k+1]
        valid = act & (window >= 0) & (window <= (anchor[:, None] + 1) - d) & (window < S)
        windows = self._windows(window, valid)
        for m in range(1, k + 1):  # module m-1's stream is extended first: module m reads it
            self._extend(m, *(w[m - 1] for w in windows))
        self.anchor.copy_(anchor)


class DFlashCachedProposer(_DeviceProposer):
    """DFlash drafting from a per-layer cache of the context keys and values.

    The context of a block is hidden_norm(fc(features)) at the verified positions; every layer
    projects it to keys k_norm(k_proj(c)) (RoPE at the context position) and values v_proj(c)
    independently of the block, so these are cached per layer [B,nkv,S+Bs+1,hd] and written as
    features are verified (k+1 positions per advance, masked to the accepted ones). Each draft
    runs the block [bonus, MASK x (Bs-1)] at positions a+1..a+Bs through every layer: its keys
    and values are written into the cache at those positions (stale context slots, rewritten
    once verified), and each block query sees cache slots <= a+Bs: the context up to a and the
    whole block, as `DFlashDrafter.block_logits` attends. The block's drafts do not condition on
    each other (positions 2.. read MASK), so sampled drafts are independent draws from each
    position's softmax and q is that softmax.

    The caches hold Bs slots past S (a block may reach past the last position) and a scratch
    slot after them, where writes the text does not allow yet are parked; no query sees it.
    Each layer runs through the runtime's kernels (fused norms, RoPE written into the cache,
    decode attention)."""

    def __init__(self, drafter, k: int, batch: int, max_len: int, target_config):
        super().__init__(drafter, k, batch, max_len, target_config)
        cfg = drafter.config
        self.scratch = max_len + cfg.block_size  # slot index of the parked writes
        kv = (cfg.num_layers, batch, cfg.num_key_value_heads, self.scratch + 1, cfg.head_dim)
        self.k_cache = torch.zeros(kv, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(kv, dtype=self.dtype, device=self.device)
        self.bonus = torch.zeros(batch, dtype=torch.long, device=self.device)  # x_{a+1}, the block's first token
        self.block_offsets = torch.arange(cfg.block_size, device=self.device)
        self.masks = torch.full((batch, cfg.block_size - 1), cfg.mask_token_id, dtype=torch.long, device=self.device)
        # fused projections, as the runtime model stores them: q|k|v and gate|up for a block, k|v for the context
        attn = [layer.self_attn for layer in drafter.layers]
        self.qkv_weight = [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach() for a in attn]
        self.kv_weight = [torch.cat([a.k_proj.weight, a.v_proj.weight]).detach() for a in attn]
        self.gate_up_weight = [torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach()
                               for layer in drafter.layers]

    def _write_context(self, features, positions, valid):
        """features [B,q,W] at consecutive positions [B,q] → every layer's context K/V, at
        their positions where valid (else parked in the scratch slot)."""
        d, cfg = self.drafter, self.drafter.config
        nkv = cfg.num_key_value_heads
        context = rms_norm(d.fc(features.to(self.dtype)), d.hidden_norm.weight, d.hidden_norm.eps)[0]  # [B,q,H]
        slots = torch.where(valid, positions, self.scratch)
        for i, layer in enumerate(d.layers):
            kv = F.linear(context, self.kv_weight[i])  # [B,q,2*nkv*hd]: keys normed in place, one launch
            head_norm(kv, None, layer.self_attn.k_norm.weight, layer.self_attn.k_norm.eps, 0, nkv)
            rope_cache(kv, positions, d.inv_freq, self.k_cache[i], self.v_cache[i], 0, nkv, slots=slots)  # no queries

    def _block_logits(self):
        """Logits [B,k,Vd] of block positions 1..k."""
        return self.drafter.lm_head(self._block_hidden())

    def _block_hidden(self):
        """Final-normed hidden states [B,k,H] of block positions 1..k (what lm_head reads)."""
        d, cfg = self.drafter, self.drafter.config
        nh, nkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
        positions = self.anchor[:, None] + 1 + self.block_offsets  # [B,Bs]
        sees = (self.anchor + cfg.block_size)[:, None].expand_as(positions)  # context <= a, the whole block
        h = d.embed_tokens(torch.cat([self.bonus[:, None], self.masks], 1)).to(self.dtype)  # [B,Bs,H]
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            x = rms_norm(h, layer.input_layernorm.weight, eps)[0]
            qkv = F.linear(x, self.qkv_weight[i])  # q and k heads normed in place, one launch
            head_norm(qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, nh, nkv)
            q = rope_cache(qkv, positions, d.inv_freq, self.k_cache[i], self.v_cache[i], nh, nkv)
            out = attn.o_proj(decode_attention(q, self.k_cache[i], self.v_cache[i], sees))
            post, h = rms_norm(out, layer.post_attention_layernorm.weight, eps, h)  # h = h + attention
            h = swiglu_into(h, post, self.gate_up_weight[i], layer.mlp.down_proj)  # h + MLP(post)
        return rms_norm(h[:, 1 : self.k + 1], d.norm.weight, d.norm.eps)[0]

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        B, T, _ = aux.shape
        self.anchor.copy_(torch.as_tensor([len(p) - 1 for p in prompts]))
        self.bonus.copy_(torch.as_tensor([int(f) for f in first]))
        # positions past a row's prompt are padding: stale, overwritten once verified
        self._write_context(aux, torch.arange(T, device=self.device).expand(B, T),
                            torch.ones(B, T, dtype=torch.bool, device=self.device))

    @torch.no_grad()
    def _draft(self, temperature, generator):
        logits = self._block_logits()  # [B,k,Vd]
        if not temperature:  # every position's argmax at once
            argmax_rows(logits.reshape(-1, logits.shape[-1]), self.drafts.view(-1), self.draft_ids)
            return
        for j in range(self.k):
            self._pick(j, logits[:, j], temperature, generator)

    @torch.no_grad()
    def advance(self, fed, aux, accepted, bonus, active):
        j = torch.arange(self.k + 1, device=self.device)[None]
        fed_at = self.anchor[:, None] + 1 + j  # N-1 .. N-1+k: features of t_{N-1}, d_1..d_n are verified
        self._write_context(aux, fed_at, active[:, None] & (j <= accepted[:, None]) & (fed_at < self.max_len))
        self.anchor.copy_(torch.where(active, self.anchor + accepted + 1, self.anchor))
        self.bonus.copy_(torch.where(active, bonus, self.bonus))
