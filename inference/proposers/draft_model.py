"""A separate small LM as the proposer: same vocabulary on the device, another one on the host.
The interface is described in inference/proposers/model_free.py.
"""
from __future__ import annotations

import torch

from inference.proposers.base import DeviceProposer, HostProposer
from inference.proposers.device import advance_args
from inference.runtime.verify import NO_DRAFT


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


class DraftModelProposer(HostProposer, DeviceProposer):  # on_device: same vocabulary (set in __init__)
    """A separate small LM drafts k tokens greedily.

    Same vocabulary (a device proposer, see inference/proposers/model_free.py): the draft model keeps its
    own KV cache. Each step feeds the row's last two verified tokens (the one before the bonus
    may be an accepted draft the model has not seen yet; re-writing an entry it has seen is
    harmless) and then its own k-1 drafts, always the same shapes, so it runs inside the
    engine's CUDA graphs. Different vocabulary (greedy verification only, host loop): each
    step re-tokenizes the verified text with the draft tokenizer, drafts in the draft
    vocabulary and maps the drafts to target ids by token string (`vocab_intersection`); a
    draft without a target counterpart ends the chain. That path recomputes the draft's prefix
    every step: exact, not fast."""

    aux_layers = ()

    def __init__(self, draft_model, k: int, batch: int, max_len: int, target_config=None,
                 target_tokenizer=None, draft_tokenizer=None):
        self.model, self.k = draft_model, k
        self.cross_vocab = draft_tokenizer is not None
        self.on_device = not self.cross_vocab
        dev = draft_model.embed_tokens.weight.device
        if self.cross_vocab:
            if target_tokenizer is None:
                raise ValueError("a draft model with its own tokenizer needs the target's tokenizer too")
            self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
            self.to_target = vocab_intersection(target_tokenizer, draft_tokenizer).to(dev)
            return
        if target_config is not None and draft_model.config.vocab_size != target_config.vocab_size:
            raise ValueError(f"draft vocabulary {draft_model.config.vocab_size} differs from the target's "
                             f"{target_config.vocab_size}: pass both tokenizers to draft across vocabularies")
        self.cache = draft_model.new_cache(batch, max_len + k)
        self.pair = torch.zeros(batch, 2, dtype=torch.long, device=dev)  # [token before the last, last] per row
        self.length = torch.zeros(batch, dtype=torch.long, device=dev)  # verified tokens per row
        self.drafts = torch.zeros(batch, k, dtype=torch.long, device=dev)
        self._one = torch.ones(batch, dtype=torch.long, device=dev)  # logits of the pair's second token

    @torch.no_grad()
    def begin(self, prompts, aux, first):
        if self.cross_vocab:
            return
        dev = self.pair.device
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.as_tensor(p, device=dev)
        # every row from position 0 of an empty cache; padding lands beyond a row's end
        self.model(ids, torch.arange(T, device=dev).expand(len(prompts), T), self.cache,
                   logits_at=torch.zeros(len(prompts), dtype=torch.long, device=dev), causal_prefill=True)
        self.pair.copy_(torch.as_tensor([[p[-1], int(f)] for p, f in zip(prompts, first)], device=dev))
        self.length.copy_(torch.as_tensor([len(p) + 1 for p in prompts], device=dev))

    @torch.no_grad()
    def draft(self) -> torch.Tensor:
        positions = (self.length - 2)[:, None] + torch.arange(2, device=self.pair.device)
        logits, _ = self.model(self.pair, positions, self.cache, logits_at=self._one)
        d = logits[:, 0].argmax(-1)
        self.drafts[:, 0] = d
        for s in range(1, self.k):  # draft s+1 is read after draft s, fed at position length - 1 + s
            logits, _ = self.model(d[:, None], (self.length - 1 + s)[:, None], self.cache)
            d = logits[:, 0].argmax(-1)
            self.drafts[:, s] = d
        return self.drafts

    @torch.no_grad()
    def advance(self, fed, aux, accepted, bonus, active):
        rows = torch.arange(fed.shape[0], device=fed.device)
        pair = torch.stack([fed[rows, accepted], bonus], 1)  # the token before the bonus, the bonus
        self.pair.copy_(torch.where(active[:, None], pair, self.pair))
        self.length.add_(torch.where(active, accepted + 1, 0))

    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        if self.cross_vocab:
            return [self._propose_cross(t) for t in tokens]
        return self.draft().tolist()

    def accepted(self, fed, aux, counts, active):
        if not self.cross_vocab:
            self.advance(*advance_args(self.pair.device, fed, aux, counts, active))

    def _propose_cross(self, row: list[int]) -> list[int]:
        text = self.target_tokenizer.decode(row)
        ids = self.draft_tokenizer(text, add_special_tokens=False)["input_ids"] or [0]
        dev = self.model.embed_tokens.weight.device
        cache = self.model.new_cache(1, len(ids) + self.k)
        logits, _ = self.model(torch.as_tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None], cache,
                               logits_at=torch.tensor([len(ids) - 1], device=dev))
        out = []
        for s in range(self.k):
            d = logits[0, -1].argmax()
            t = int(self.to_target[d]) if int(d) < self.to_target.numel() else -1
            if t < 0:
                break
            out.append(t)
            if s + 1 < self.k:
                logits, _ = self.model(d.view(1, 1), torch.tensor([[len(ids) + s]], device=dev), cache)
        return out + [NO_DRAFT] * (self.k - len(out))
