"""Proposers that run a model: EAGLE-3 / EAGLE-1 (own KV cache), Medusa heads, MTP and DFlash
(recomputed over the verified prefix), a separate draft model, and `drafter_proposer`, which
picks the right one for a trained drafter. The interface is described in inference/proposers/model_free.py.
"""
from __future__ import annotations

import torch

import torch.nn.functional as F

from inference.proposers.base import HostProposer
from inference.proposers.device import HostLoopInterface, check_drafter_fits
from inference.runtime.graphs import capture_graph, kernel_settings
from inference.runtime.steps import PREFILL_BUCKET, PREFILL_GRAPH_MAX_TOKENS
from draftsmith_kernels.argmax import argmax_rows
from draftsmith_kernels.chain_state import advance_inputs, keep_entry
from draftsmith_kernels.decode_attention import decode_attention
from draftsmith_kernels.gemv import gemv, one_row, swiglu_gemv
from draftsmith_kernels.lm_head_argmax import norm_lm_head_argmax
from draftsmith_kernels.rejection_sample import inverse_cdf
from draftsmith_kernels.rms_norm import rms_norm, rms_norm_pair
from draftsmith_kernels.rope_cache import rope_cache
from draftsmith_kernels.silu_mul import swiglu_into
from models.eagle3 import Eagle3Drafter
from models.methods import method_of, predictor_of, resolve


class Eagle3Proposer(HostLoopInterface):
    """EAGLE-3 (and EAGLE-1) drafting with its own KV cache, exactly as the TTT unroll trains it.

    The drafter's cache holds, at position t, the entry computed from (token t_{t+1}, target
    feature g_t) (the "step 0" of training). A chain from the last such position t0 feeds
    its own hidden state and drafted token at positions t0+1, t0+2, ...; those entries are
    overwritten by step-0 entries once the target has verified the tokens.

    A device proposer: `draft` and `advance` run on tensors alone (no host sync, fixed shapes,
    state updated in place), so the engine captures them in CUDA graphs. EAGLE-3 runs its
    layer through the runtime's kernels (`_eagle3_layer`: fused norms, RoPE written straight
    into the cache, the decode-attention kernel); EAGLE-1 runs its own modules with the cache
    read by the same attention kernel.
    """

    def __init__(self, drafter: Eagle3Drafter, k: int, batch: int, max_len: int, target_config=None):
        cfg = drafter.config
        if target_config is not None:
            problems = []
            if cfg.vocab_size != target_config.vocab_size:
                problems.append(f"vocab {cfg.vocab_size} vs the target's {target_config.vocab_size}")
            if getattr(cfg, "target_hidden_size", cfg.hidden_size) != target_config.hidden_size:
                problems.append(f"target hidden size {getattr(cfg, 'target_hidden_size', cfg.hidden_size)} vs {target_config.hidden_size}")
            if drafter.aux_layer_ids and max(drafter.aux_layer_ids) >= target_config.num_layers:
                problems.append(f"aux layer {max(drafter.aux_layer_ids)} of a {target_config.num_layers}-layer target")
            if problems:
                raise ValueError("this EAGLE drafter was trained for another target: " + "; ".join(problems))
        self.drafter, self.k = drafter.eval(), k
        # EAGLE-3 reads its aux layers; EAGLE-1 the final hidden state (the runtime's id L)
        self.aux_layers = tuple(drafter.aux_layer_ids) or (target_config.num_layers if target_config is not None
                                                             else drafter.config.target_num_layers,)
        p = drafter.fc.weight
        self.fused = isinstance(drafter, Eagle3Drafter)
        if self.fused:
            layer = drafter.layers[0]
            if layer.input_layernorm.eps != layer.hidden_norm.eps:  # rms_norm_pair normalises both at once
                raise ValueError("EAGLE-3 drafter: the embedding's and the hidden state's norms need the same eps")
            # q, k, v in one matmul, as the runtime model stores them ([2H] → [(nh + 2 nkv) d])
            attn = drafter.layers[0].self_attn
            self.qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
            mlp = drafter.layers[0].mlp
            self.gate_up_weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            # the one-row GEMV kernels of a chain step add no biases (Llama-style drafters have none)
            self.one_row_kernels = all(m.bias is None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                                   mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        heads = cfg.num_key_value_heads if self.fused else cfg.num_attention_heads  # EAGLE-1's attend sees expanded heads
        shape = (batch, heads, max_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.draft_ids = drafter.draft_ids()  # [Vd] target id of each draft row
        self.last = torch.zeros(batch, dtype=torch.long, device=p.device)  # t0 per row
        self.hidden = torch.zeros(batch, cfg.hidden_size, dtype=p.dtype, device=p.device)  # drafter output at t0
        self.drafts = torch.zeros(batch, k, dtype=torch.long, device=p.device)
        self.q = torch.zeros(batch, k, cfg.vocab_size, dtype=torch.float32, device=p.device)  # sampled drafts' q
        self.chain_positions = torch.zeros(batch, k, dtype=torch.long, device=p.device)  # the next chain's positions
        self._begin_steps = {}  # (rows, width, aux width, dtype, kernels) → the captured begin and its input buffers
        self._begin_pool = None  # one memory pool for all of them (see begin_graphed)

    def _run(self, tokens, hidden, positions):
        """tokens [B,q], hidden [B,q,H], positions [B,q] → output hidden [B,q,H], caching K/V."""
        if self.fused:
            return _eagle3_layer(self, tokens, hidden, positions)

        def attend(q, k, v):  # [B,nh,q,d] each → [B,nh,q,d]; a query at p sees cache keys <= p
            B, nh, n, d = q.shape
            index = positions[:, None, :, None].expand(B, nh, n, d)
            self.k_cache.scatter_(2, index, k.to(self.k_cache.dtype))
            self.v_cache.scatter_(2, index, v.to(self.v_cache.dtype))
            return decode_attention(q, self.k_cache, self.v_cache, positions).view(B, n, nh, d).transpose(1, 2)

        return self.drafter.step(tokens, hidden, positions, attend)

    def _step0(self, tokens, aux, positions, aux_rows=None):
        """Step-0 entries of `tokens` [B,q] with target features `aux` [B,q,n*Ht] at `positions`
        → the drafter's output hidden [B,q,H] (K/V cached). aux_rows [B,q]: the features are
        those rows of aux flattened ([R,n*Ht]: a verified tree's path among its nodes), gathered
        by the input norm's launch where there is one."""
        aux = aux.to(self.drafter.fc.weight.dtype)
        cfg = self.drafter.config
        # the fused norm kernel: one launch, not seven (fc_norm's per-feature norms: `fuse`)
        if self.fused and cfg.norm_before_fc and not cfg.fc_norm:
            norm = self.drafter.input_norm
            if aux_rows is None:
                fused = self.drafter.fc(rms_norm(aux, norm.weight, norm.eps)[0])
            else:
                fused = self.drafter.fc(rms_norm(aux.flatten(0, -2), norm.weight, norm.eps, ids=aux_rows)[0])
        else:
            fused = self.drafter.fuse(aux if aux_rows is None else aux.flatten(0, -2)[aux_rows])
        return self._run(tokens, fused, positions)

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        """Step-0 entries of every prompt position (aux [B,T,n*Ht] from the prefill; first [B]
        the tokens it chose, a list or a device tensor), eagerly."""
        shifted, last_index = _shifted_prompts(prompts, aux.shape[1])
        dev = self.last.device
        self._begin(shifted.to(dev), aux, last_index.to(dev), torch.as_tensor(first, device=dev),
                    torch.arange(aux.shape[1], device=dev).expand(aux.shape[0], -1))

    @torch.no_grad()
    def begin_graphed(self, prompts, aux, first):
        """`begin` as one CUDA-graph replay per (rows, width rounded up to PREFILL_BUCKET): an
        eager begin launches about 20 kernels from Python after the prefill, and the GPU waits
        for each (traced: 2.3 ms of host time per answer for 0.05 ms of kernels).
        The inputs reach the graph's buffers by copies queued behind the prefill (no host sync).
        Positions past a row's prompt get entries from stale features; every one of them is
        overwritten before a query reads it (a chain writes its own positions first)."""
        B, T, W = aux.shape
        width = -(-T // PREFILL_BUCKET) * PREFILL_BUCKET
        if width > self.k_cache.shape[2] or B * width > PREFILL_GRAPH_MAX_TOKENS:
            return self.begin(prompts, aux, first)
        key = (B, width, W, aux.dtype, kernel_settings())
        step = self._begin_steps.get(key)
        shifted, last_index = _shifted_prompts(prompts, width)
        if step is None:
            dev = self.last.device
            step = {"ids": torch.zeros(B, width, dtype=torch.long, device=dev),
                    "aux": torch.zeros(B, width, W, dtype=aux.dtype, device=dev),
                    "last": torch.zeros(B, dtype=torch.long, device=dev),
                    "first": torch.zeros(B, dtype=torch.long, device=dev),
                    "positions": torch.arange(width, device=dev).expand(B, width)}
            _fill_begin(step, shifted, aux, last_index, first)
            run = lambda: self._begin(step["ids"], step["aux"], step["last"], step["first"], step["positions"])  # noqa: E731
            # every begin graph shares one pool: a graph's pool keeps its peak (the attention's
            # scratch over the whole width), and one pool per width grew by gigabytes over a
            # bench of long prompts on an 8B-shaped drafter. Sharing is safe:
            # a begin leaves nothing in the pool (its results go to the proposer's state, its
            # inputs live outside it) and begins never run concurrently
            if self._begin_pool is None:
                self._begin_pool = torch.cuda.graph_pool_handle()
            step["graph"] = capture_graph(run, warmup=1, pool=self._begin_pool)  # the warm-up is the real begin
            self._begin_steps[key] = step
            while len(self._begin_steps) > BEGIN_GRAPHS:  # least recently captured out: its input buffers freed
                self._begin_steps.pop(next(iter(self._begin_steps)))
            return
        _fill_begin(step, shifted, aux, last_index, first)
        step["graph"].replay()

    def _begin(self, shifted, aux, last_index, first, positions):
        """shifted [B,T] prompt tokens t_1.. (entry t pairs token t_{t+1} with feature g_t), the
        first token to go at each row's last index [B]; aux [B,T,n*Ht]; positions [B,T]."""
        tokens = shifted.scatter(1, last_index[:, None], first[:, None].to(shifted.dtype))
        out = self._step0(tokens, aux, positions)
        everyone = torch.ones_like(last_index, dtype=torch.bool)
        keep_entry(out, positions.contiguous(), last_index, everyone, self.hidden, self.last, self.chain_positions)

    @torch.no_grad()
    def draft(self) -> torch.Tensor:
        """Greedy chains [B,k] from each row's t0 (a static buffer)."""
        self._chain(None, None)
        return self.drafts

    @torch.no_grad()
    def draft_sampled(self, temperature: float, generator=None):
        """Drafts sampled from the drafter's own softmax(logits / T), each step fed the last
        sample, with their distributions q [B,k,V] over the target vocabulary."""
        self._chain(temperature, generator)
        return self.drafts, self.q

    def _chain(self, temperature, generator):
        hidden = self.hidden[:, None]
        B = hidden.shape[0]
        positions = self.chain_positions  # [B,k]: last + 1 .. last + k, written by begin / advance
        fused_head = self.fused and not temperature and self.drafter.lm_head.bias is None
        norm_output = getattr(self.drafter.config, "norm_output", False)  # EAGLE-1 has no such flag
        for s in range(self.k):
            if fused_head:  # norm, lm_head and argmax (mapped to target ids) into the chain's column: two launches
                norm_lm_head_argmax(hidden[:, -1], self.drafter.norm.weight, self.drafter.norm.eps,
                                    self.drafter.lm_head.weight, self.drafts[:, s], self.draft_ids)
            else:
                if self.fused:  # drafter.logits with the fused norm kernel
                    normed, _ = rms_norm(hidden, self.drafter.norm.weight, self.drafter.norm.eps)
                    logits = self.drafter.lm_head(normed)[:, -1]  # [B,Vd]
                else:
                    logits = self.drafter.logits(hidden)[:, -1]
                if temperature:
                    probs = torch.softmax(logits.float() / temperature, -1)
                    u = torch.rand(B, device=probs.device, generator=generator)
                    self.q[:, s].index_copy_(1, self.draft_ids, probs)  # other columns stay 0
                    self.drafts[:, s] = self.draft_ids[inverse_cdf(probs, u)]
                else:  # argmax, mapped to target ids, written into the chain's column: one kernel pair
                    argmax_rows(logits, self.drafts[:, s], self.draft_ids)
            if s + 1 < self.k:
                if norm_output:  # EAGLE-3.1: the next step reads the final-normed state (drafter.fed_back)
                    hidden, _ = rms_norm(hidden, self.drafter.norm.weight, self.drafter.norm.eps)
                hidden = self._run(self.drafts[:, s : s + 1], hidden, positions[:, s : s + 1])

    @torch.no_grad()
    def advance(self, fed, aux, accepted, bonus, active, aux_rows=None, inputs=None):
        """fed [B,q] = [t_{N-1}, d_1..d_{q-1}] with target features aux [B,q,n*Ht] (or rows
        aux_rows [B,q] of aux flattened: `_step0`); after n = accepted drafts the next tokens are
        d_1..d_n, bonus, so entries t = N-1 .. N-1+n pair (next token, feature of the fed token
        at t). Rows not `active` keep their place, so their (ignored) entries never run past the
        cache. inputs: those next tokens and their positions [B,q], made already from fed, bonus,
        accepted and this proposer's `last` (a verified tree's bookkeeping launch writes them:
        kernels/tree_accept.py), else made here."""
        nxt, positions = advance_inputs(fed, bonus, accepted, self.last) if inputs is None else inputs  # [B,q] each
        out = self._step0(nxt, aux, positions, aux_rows)  # [B,q,H]
        keep_entry(out, positions, accepted, active, self.hidden, self.last, self.chain_positions)


BEGIN_GRAPHS = 16  # captured begins kept per proposer (one per rows × prompt-width bucket)


def _shifted_prompts(prompts, width: int):
    """Each prompt without its first token, right-padded to `width` ([B,width] on the host,
    pinned where a GPU is), and each row's last index [B]: where its first generated token goes."""
    pin = torch.cuda.is_available()
    shifted = torch.zeros(len(prompts), width, dtype=torch.long, pin_memory=pin)
    for b, p in enumerate(prompts):
        shifted[b, : len(p) - 1] = torch.as_tensor(p[1:], dtype=torch.long)
    last_index = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)
    return shifted, (last_index.pin_memory() if pin else last_index)


def _fill_begin(step: dict, shifted, aux, last_index, first):
    """A captured begin's inputs into its buffers, queued on the stream (no host sync)."""
    step["ids"].copy_(shifted, non_blocking=True)
    step["last"].copy_(last_index, non_blocking=True)
    step["first"].copy_(torch.as_tensor(first), non_blocking=True)
    step["aux"][:, : aux.shape[1]] = aux  # positions past it keep stale features (see begin_graphed)


def _eagle3_layer(p: Eagle3Proposer, tokens, hidden, positions):
    """EAGLE-3's decoder layer (models/eagle3.py: Eagle3Layer) through the runtime's kernels:
    tokens [B,q], hidden [B,q,H], positions [B,q] → [B,q,H], writing K/V into p's cache.
    The same function as `drafter.step`: about 15 launches instead of about 60."""
    d = p.drafter
    layer, cfg = d.layers[0], d.config
    H = hidden.shape[-1]
    # [B,q,2H]: the normed embedding first, then the normed hidden (one launch)
    both = rms_norm_pair(d.embed_tokens.weight, tokens, layer.input_layernorm.weight, hidden, layer.hidden_norm.weight,
                         layer.hidden_norm.eps)
    normed = both[..., H:]
    chain_step = p.one_row_kernels and one_row(both)  # batch 1, one token: the GEMV kernels (kernels/gemv.py)
    qkv = gemv(both, p.qkv_weight) if chain_step else F.linear(both, p.qkv_weight)
    q = rope_cache(qkv, positions, d.inv_freq, p.k_cache, p.v_cache, cfg.num_attention_heads, cfg.num_key_value_heads)
    attn = decode_attention(q, p.k_cache, p.v_cache, positions)  # [B,q,H]
    o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
    attn = gemv(attn, o_proj.weight) if chain_step else o_proj(attn)
    residual = normed if layer.norm_before_residual else hidden
    post, h = rms_norm(attn, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, residual)
    if chain_step:  # h += down(silu(gate) * up), the product formed as the down projection reads it
        return swiglu_gemv(gemv(post, p.gate_up_weight), down.weight, h, out=h)
    return swiglu_into(h, post, p.gate_up_weight, down)  # h + MLP(post)


class MedusaProposer(HostLoopInterface):
    """Medusa drafting: one draft per head from the target's final hidden state at the last
    verified position (the state whose head output is the bonus token), exactly the chain
    training's predictor drafts. Needs no cache of its own; a device proposer (see
    Eagle3Proposer)."""

    def __init__(self, drafter, k: int, target_config, batch: int = 1):
        cfg = drafter.config
        problems = []
        if cfg.vocab_size != target_config.vocab_size:
            problems.append(f"vocab {cfg.vocab_size} vs the target's {target_config.vocab_size}")
        if cfg.hidden_size != target_config.hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} vs {target_config.hidden_size}")
        if problems:
            raise ValueError("this Medusa drafter was trained for another target: " + "; ".join(problems))
        if not 1 <= k <= cfg.num_heads:
            raise ValueError(f"k={k}: this Medusa drafter has {cfg.num_heads} heads, one draft each")
        self.drafter, self.k = drafter.eval(), k
        self.aux_layers = (target_config.num_layers,)  # the runtime's id for the final normed hidden state
        p = drafter.lm_head.weight if hasattr(drafter, "lm_head") else next(drafter.parameters())
        self.draft_ids = drafter.draft_ids()
        self.hidden = torch.zeros(batch, cfg.hidden_size, dtype=p.dtype, device=p.device)  # [B,H]
        self.drafts = torch.zeros(batch, k, dtype=torch.long, device=p.device)
        self.q = torch.zeros(batch, k, cfg.vocab_size, dtype=torch.float32, device=p.device)

    def _resize(self, batch):
        """The host loop may serve another batch size than the one built for (cache-free)."""
        if self.hidden.shape[0] != batch:
            self.hidden = self.hidden.new_zeros(batch, self.hidden.shape[1])
            self.drafts = self.drafts.new_zeros(batch, self.k)
            self.q = self.q.new_zeros(batch, self.k, self.q.shape[2])

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        self._resize(aux.shape[0])
        last = torch.as_tensor([len(p) - 1 for p in prompts], device=aux.device)
        self.hidden.copy_(aux[torch.arange(aux.shape[0], device=aux.device), last])

    @torch.no_grad()
    def draft(self) -> torch.Tensor:
        for s, x in enumerate(self.drafter.unroll(None, self.hidden[:, None], self.k)):
            argmax_rows(x[:, 0], self.drafts[:, s], self.draft_ids)
        return self.drafts

    @torch.no_grad()
    def draft_sampled(self, temperature: float, generator=None):
        """One sample per head from softmax(head / T), with those distributions q [B,k,V]
        (a head's draft does not depend on the previous ones: still a valid q for rejection
        sampling)."""
        B = self.hidden.shape[0]
        for s, x in enumerate(self.drafter.unroll(None, self.hidden[:, None], self.k)):
            probs = torch.softmax(x[:, 0].float() / temperature, -1)
            self.drafts[:, s] = self.draft_ids[inverse_cdf(probs, torch.rand(B, device=probs.device, generator=generator))]
            self.q[:, s].index_copy_(1, self.draft_ids, probs)
        return self.drafts, self.q

    @torch.no_grad()
    def advance(self, fed, aux, accepted, bonus, active):
        verified = aux[torch.arange(aux.shape[0], device=aux.device), accepted]  # the bonus token's input state
        self.hidden.copy_(torch.where(active[:, None], verified.to(self.hidden.dtype), self.hidden))



class RecomputeProposer(HostProposer):
    """Drafting by recomputation, the exact reference of the cached MTP and DFlash proposers
    (inference/proposers/blocks.py): each step runs the drafter over a row's verified prefix and takes the chain at
    its end, with the very function training's predictor uses (`unroll(greedy=True)`, or one
    DFlash block), so it drafts exactly what training predicts. Cost grows with the context:
    a correctness path, not a fast one.

    Keeps per row the target's features at verified positions ([S, width] buffers)."""

    def __init__(self, drafter, k: int, batch: int, max_len: int, target_config):
        check_drafter_fits(drafter, k, target_config)
        self.drafter, self.k = drafter.eval(), k
        self.aux_layers = tuple(drafter.aux_layer_ids) or (target_config.num_layers,)
        self.blockwise = predictor_of(drafter) == "block"  # DFlash: one block per anchor
        self.max_len = max_len
        self.features = None  # [B, S, width]

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        B, T, width = aux.shape
        self.features = torch.zeros(B, self.max_len, width, dtype=aux.dtype, device=aux.device)
        self.features[:, :T] = aux  # beyond a row's prompt: padding, overwritten as it is verified
        self._start = [len(p) for p in prompts]  # first position whose feature is not verified yet

    @torch.no_grad()
    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        out = []
        dev = self.features.device
        for b, row in enumerate(tokens):
            n = len(row)  # the chain continues x_0..x_{n-1}: anchor a = n - 2
            ids = torch.as_tensor(row, device=dev)
            feats = self.features[b, :n].to(self.drafter.lm_head.weight.dtype)
            if self.blockwise:
                chain = self.drafter.draft_at(ids, feats, torch.tensor([n - 2], device=dev), self.k)[0]
            else:
                steps = self.drafter.unroll(ids[None], feats[None], self.k, greedy=True)
                chain = torch.stack([self.drafter.draft_ids()[s[0, n - 2].argmax()] for s in steps])
            out.append(chain.tolist())
        return out

    @torch.no_grad()
    def accepted(self, fed, aux, counts, active):
        # fed [B, k+1] sat at positions len-1 .. len-1+k; the last token and the accepted drafts
        # now have verified features
        for b, (n, _) in enumerate(counts):
            if active[b]:
                start = self._start[b]
                self.features[b, start : start + n + 1] = aux[b, : n + 1]
                self._start[b] = start + n + 1


def medusa_proposer(drafter, k: int, batch: int, max_len: int, target_config) -> MedusaProposer:
    """MedusaProposer with the table's proposer signature (it keeps no cache: max_len unused)."""
    return MedusaProposer(drafter, k, target_config, batch)


def drafter_proposer(drafter, k: int, batch: int, max_len: int, target_config):
    """The runtime proposer for a trained drafter module, the one its method's row of
    models/methods.py names; the shipped ones are all device proposers: EAGLE-3 / EAGLE-1 (own
    KV cache), Medusa (cache-free), MTP and DFlash (cached streams, inference/proposers/blocks.py;
    `RecomputeProposer` is their exact reference)."""
    return resolve(method_of(drafter).proposer)(drafter, k, batch, max_len, target_config)
