"""Proposers that run a model: EAGLE-3 / EAGLE-1 (own KV cache), Medusa heads, MTP and DFlash
(recomputed over the verified prefix), a separate draft model, and `drafter_proposer`, which
picks the right one for a trained drafter. The interface is described in inference/proposers.py.
"""
from __future__ import annotations

import torch

from inference.model import cache_mask, cached_attention
from models.eagle3 import Eagle3Drafter
from models.layers import rope_cos_sin


def _to_target_vocab(probs: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B,Vd] probabilities over the draft vocabulary → [B,V] over the target's (zero elsewhere)."""
    out = torch.zeros(probs.shape[0], vocab_size, dtype=probs.dtype, device=probs.device)
    return out.index_copy_(1, draft_ids, probs)


class Eagle3Proposer:
    """EAGLE-3 (and EAGLE-1) drafting with its own KV cache, exactly as the TTT unroll trains it.

    The drafter's cache holds, at position t, the entry computed from (token t_{t+1}, target
    feature g_t) (the "step 0" of training). A chain from the last such position t0 feeds
    its own hidden state and drafted token at positions t0+1, t0+2, ...; those entries are
    overwritten by step-0 entries once the target has verified the tokens.
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
        shape = (batch, cfg.num_attention_heads, max_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.last = torch.zeros(batch, dtype=torch.long, device=p.device)  # t0 per row
        self.hidden = None  # [B,H]: drafter output at t0

    def _run(self, tokens, hidden, positions):
        """tokens [B,q], hidden [B,q,H], positions [B,q] → output hidden [B,q,H], caching K/V."""
        mask = cache_mask(positions, self.k_cache.shape[2])

        def attend(q, k, v):
            return cached_attention(q, k, v, self.k_cache, self.v_cache, positions, mask)

        return self.drafter.step(tokens, hidden, positions, attend)

    def _step0(self, tokens, aux, positions, last_index):
        fused = self.drafter.fuse(aux.to(self.drafter.fc.weight.dtype))
        out = self._run(tokens, fused, positions)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.hidden = out[rows, last_index]
        self.last = positions[rows, last_index]

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        B, T = aux.shape[:2]
        dev = self.last.device
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):  # entry t pairs token t_{t+1} with feature g_t
            tokens[b, : len(p)] = torch.as_tensor(list(p[1:]) + [first[b]], device=dev)
        last_index = torch.as_tensor([len(p) - 1 for p in prompts], device=dev)
        self._step0(tokens, aux, torch.arange(T, device=dev).expand(B, T), last_index)

    @torch.no_grad()
    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        return self._chain(None, None)[0].tolist()

    @torch.no_grad()
    def propose_sampled(self, tokens, temperature: float, generator=None):
        """Drafts sampled from the drafter's own softmax(logits / T), each step fed the last
        sample, with their distributions q [B,k,V] for rejection sampling."""
        drafts, q = self._chain(temperature, generator)
        return drafts.tolist(), q

    def _chain(self, temperature, generator):
        draft_ids = self.drafter.draft_ids()
        hidden = self.hidden[:, None]
        drafts, qs = [], []
        for s in range(self.k):
            logits = self.drafter.logits(hidden)[:, -1]  # [B,Vd]
            if temperature:
                probs = torch.softmax(logits.float() / temperature, -1)
                d = draft_ids[torch.multinomial(probs, 1, generator=generator)[:, 0]]
                qs.append(_to_target_vocab(probs, draft_ids, self.drafter.config.vocab_size))
            else:
                d = draft_ids[logits.argmax(-1)]  # [B]
            drafts.append(d)
            if s + 1 < self.k:
                hidden = self._run(d[:, None], hidden, (self.last + 1 + s)[:, None])
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    @torch.no_grad()
    def accepted(self, fed, aux, counts, active):
        # fed [B,k+1] = [t_{N-1}, d_1..d_k]; after n accepted the next tokens are d_1..d_n, bonus.
        # Entries t = N-1 .. N-1+n pair (next token, feature of the fed token at t).
        fed = torch.as_tensor(fed, device=self.last.device)
        B, q = fed.shape
        counts_t = torch.as_tensor([c for c, _ in counts], device=fed.device)
        nxt = fed[:, 1:].clone()
        nxt = torch.cat([nxt, torch.zeros(B, 1, dtype=torch.long, device=fed.device)], 1)  # [B,k+1]
        nxt[torch.arange(B, device=fed.device), counts_t] = torch.as_tensor([b for _, b in counts], device=fed.device)
        positions = (self.last + 1)[:, None] + torch.arange(q, device=fed.device)
        last, hidden = self.last, self.hidden
        self._step0(nxt, aux, positions, counts_t)
        # finished rows keep their place, so their (ignored) entries never run past the cache
        keep = ~torch.as_tensor(active, device=fed.device)
        self.last = torch.where(keep, last, self.last)
        self.hidden = torch.where(keep[:, None], hidden, self.hidden)


class MedusaProposer:
    """Medusa drafting: one draft per head from the target's final hidden state at the last
    verified position (the state whose head output is the bonus token), exactly the chain
    training's predictor drafts. Needs no cache of its own."""

    def __init__(self, drafter, k: int, target_config):
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
        self.hidden = None  # [B,H]

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        last = torch.as_tensor([len(p) - 1 for p in prompts], device=aux.device)
        self.hidden = aux[torch.arange(aux.shape[0], device=aux.device), last]

    @torch.no_grad()
    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        draft_ids = self.drafter.draft_ids()
        logits = self.drafter.unroll(None, self.hidden[:, None], self.k)
        drafts = torch.stack([draft_ids[x[:, 0].argmax(-1)] for x in logits], 1)  # [B,k]
        return drafts.tolist()

    @torch.no_grad()
    def propose_sampled(self, tokens, temperature: float, generator=None):
        """One sample per head from softmax(head / T), with those distributions q [B,k,V]
        (a head's draft does not depend on the previous ones: still a valid q for rejection
        sampling)."""
        draft_ids = self.drafter.draft_ids()
        probs = [torch.softmax(x[:, 0].float() / temperature, -1) for x in self.drafter.unroll(None, self.hidden[:, None], self.k)]
        drafts = torch.stack([draft_ids[torch.multinomial(p, 1, generator=generator)[:, 0]] for p in probs], 1)
        q = torch.stack([_to_target_vocab(p, draft_ids, self.drafter.config.vocab_size) for p in probs], 1)
        return drafts.tolist(), q

    @torch.no_grad()
    def accepted(self, fed, aux, counts, active):
        n = torch.as_tensor([c for c, _ in counts], device=aux.device)
        self.hidden = aux[torch.arange(aux.shape[0], device=aux.device), n]


class RecomputeProposer:
    """Drafting by recomputation, for drafters without a cached runtime path yet (MTP,
    DFlash): each step runs the drafter over a row's verified prefix and takes the chain at
    its end, with the very function training's predictor uses (`unroll(greedy=True)`, or one
    DFlash block), so it drafts exactly what training predicts. Cost grows with the context:
    a correctness path, not a fast one.

    Keeps per row the target's features at verified positions ([S, width] buffers)."""

    def __init__(self, drafter, k: int, batch: int, max_len: int, target_config):
        cfg = drafter.config
        if cfg.vocab_size != target_config.vocab_size or cfg.hidden_size != target_config.hidden_size:
            raise ValueError(f"this drafter was trained for another target: vocab {cfg.vocab_size} / hidden {cfg.hidden_size} "
                             f"vs {target_config.vocab_size} / {target_config.hidden_size}")
        capability = drafter.train_steps(k)
        if k > capability:
            raise ValueError(f"k={k}: this {type(drafter).__name__} drafts at most {capability} tokens per step")
        self.drafter, self.k = drafter.eval(), k
        self.aux_layers = tuple(drafter.aux_layer_ids) or (target_config.num_layers,)
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
            if hasattr(self.drafter, "draft_at"):
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


def drafter_proposer(drafter, k: int, batch: int, max_len: int, target_config):
    """The runtime proposer for a trained drafter module: EAGLE-3 / EAGLE-1 (cached),
    Medusa (cache-free), MTP and DFlash (recomputed)."""
    from models.dflash import DFlashDrafter
    from models.medusa import MedusaDrafter
    from models.mtp import MTPDrafter

    if isinstance(drafter, MedusaDrafter):
        return MedusaProposer(drafter, k, target_config)
    if isinstance(drafter, (MTPDrafter, DFlashDrafter)):
        return RecomputeProposer(drafter, k, batch, max_len, target_config)
    return Eagle3Proposer(drafter, k, batch, max_len, target_config=target_config)


def vocab_intersection(target_tokenizer, draft_tokenizer) -> torch.Tensor:
    """[draft vocab] target id of each draft token with the same token string, -1 where the
    target has none (such a draft ends a chain). Greedy drafting across vocabularies."""
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    mapping = torch.full((max(draft_vocab.values()) + 1,), -1, dtype=torch.long)
    for token, i in draft_vocab.items():
        j = target_vocab.get(token)
        if j is not None:
            mapping[i] = j
    return mapping


class DraftModelProposer:
    """A separate small LM drafts k tokens greedily.

    Same vocabulary: the draft model keeps its own KV cache; each step feeds the tokens it has
    not seen (the bonus, and the last accepted draft when all k were taken) and drafts k.
    Different vocabulary (greedy verification only): each step re-tokenizes the verified text
    with the draft tokenizer, drafts in the draft vocabulary and maps the drafts to target ids
    by token string (`vocab_intersection`); a draft without a target counterpart ends the
    chain. The second path recomputes the draft's prefix every step: exact, not fast."""

    aux_layers = ()

    def __init__(self, draft_model, k: int, batch: int, max_len: int, target_config=None,
                 target_tokenizer=None, draft_tokenizer=None):
        self.draft, self.k = draft_model, k
        self.cross_vocab = draft_tokenizer is not None
        if self.cross_vocab:
            if target_tokenizer is None:
                raise ValueError("a draft model with its own tokenizer needs the target's tokenizer too")
            self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
            self.to_target = vocab_intersection(target_tokenizer, draft_tokenizer).to(draft_model.embed_tokens.weight.device)
        elif target_config is not None and draft_model.config.vocab_size != target_config.vocab_size:
            raise ValueError(f"draft vocabulary {draft_model.config.vocab_size} differs from the target's "
                             f"{target_config.vocab_size}: pass both tokenizers to draft across vocabularies")
        self.cache = None if self.cross_vocab else draft_model.new_cache(batch, max_len + k)
        self.fed = [0] * batch  # tokens of each row whose KV entries in the draft cache are valid
        self._len = [0] * batch

    def begin(self, prompts, aux, first):
        self.fed = [0] * len(prompts)

    @torch.no_grad()
    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        if self.cross_vocab:
            return [self._propose_cross(t) for t in tokens]
        dev = self.draft.embed_tokens.weight.device
        B = len(tokens)
        new = [t[f:] for t, f in zip(tokens, self.fed)]
        width = max(len(n) for n in new)
        ids = torch.zeros(B, width, dtype=torch.long, device=dev)
        for b, n in enumerate(new):
            ids[b, : len(n)] = torch.as_tensor(n, device=dev)
        positions = torch.as_tensor(self.fed, device=dev)[:, None] + torch.arange(width, device=dev)
        last = torch.as_tensor([len(n) - 1 for n in new], device=dev)
        logits, _ = self.draft(ids, positions, self.cache, logits_at=last)
        drafts = [logits[:, 0].argmax(-1)]
        self._len = [len(t) for t in tokens]
        pos = torch.as_tensor(self._len, device=dev)
        for s in range(1, self.k):
            logits, _ = self.draft(drafts[-1][:, None], (pos + s - 1)[:, None], self.cache)
            drafts.append(logits[:, 0].argmax(-1))
        return torch.stack(drafts, 1).tolist()

    def _propose_cross(self, row: list[int]) -> list[int]:
        from inference.verify import NO_DRAFT

        text = self.target_tokenizer.decode(row)
        ids = self.draft_tokenizer(text, add_special_tokens=False)["input_ids"] or [0]
        dev = self.draft.embed_tokens.weight.device
        cache = self.draft.new_cache(1, len(ids) + self.k)
        logits, _ = self.draft(torch.as_tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None], cache,
                               logits_at=torch.tensor([len(ids) - 1], device=dev))
        out = []
        for s in range(self.k):
            d = logits[0, -1].argmax()
            t = int(self.to_target[d]) if int(d) < self.to_target.numel() else -1
            if t < 0:
                break
            out.append(t)
            if s + 1 < self.k:
                logits, _ = self.draft(d.view(1, 1), torch.tensor([[len(ids) + s]], device=dev), cache)
        return out + [NO_DRAFT] * (self.k - len(out))

    def accepted(self, fed, aux, counts, active):
        if not self.cross_vocab:
            # valid entries: the tokens fed so far plus drafts 1..k-1 where they were accepted
            self.fed = [length + min(n, self.k - 1) for length, (n, _) in zip(self._len, counts)]
