"""Model-free proposers: n-gram (host KMP and a vectorized device version) and suffix decoding."""
from __future__ import annotations

import torch

from inference.proposers.base import DeviceProposer, HostProposer

from draftsmith_kernels.ngram import ngram_drafts  # buffer [B,S], lengths [B] → drafts [B,k] (one Triton launch on a GPU)


def longest_suffix_match(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """(length m, start of the continuation) of the longest suffix of `tokens` (min_n <= m <=
    max_n) that also occurs earlier, preferring the most recent occurrence; (0, -1) if none.

    KMP prefix function over the reversed sequence: prefix lengths of the reversal that
    reappear later in it are suffixes of `tokens` that reappear earlier. O(len) per call.
    """
    r = tokens[::-1]
    n = len(r)
    pi = [0] * n
    best_len, best_j = 0, -1
    for j in range(1, n):
        m = pi[j - 1]
        while m and (m == max_n or r[j] != r[m]):
            m = pi[m - 1]
        if r[j] == r[m]:
            m += 1
        pi[j] = m
        if m > best_len:  # strictly longer: the first (most recent) of each length wins
            best_len, best_j = m, j
    if best_len < min_n:
        return 0, -1
    # r[best_j - m + 1 .. best_j] == r[0 .. m-1]; in token order that occurrence ends at
    # index n-1-(best_j-m+1), so the continuation starts right after it
    return best_len, n - best_j + best_len - 1


class NgramProposer(HostProposer):
    """Prompt-lookup drafting: continue the longest earlier match of the context's suffix."""

    aux_layers: tuple = ()

    def __init__(self, k: int, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose_row(self, tokens: list[int]) -> list[int]:
        m, start = longest_suffix_match(tokens, self.min_n, self.max_n)
        return tokens[start : start + self.k] if m else []

    def begin(self, prompts, aux, first):
        pass

    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        return [self.propose_row(t) for t in tokens]

    def accepted(self, fed, aux, counts, active):
        pass


class GpuNgramProposer(HostProposer, DeviceProposer):
    """`NgramProposer` on the device: each row's verified tokens live in a device buffer that
    `advance` extends, and one vectorised search (`ngram_drafts`) serves the batch. A device
    proposer: the engine captures it in its CUDA graphs with the rest of the step."""

    aux_layers: tuple = ()
    on_device = True

    def __init__(self, k: int, batch: int, max_len: int, min_n: int = 1, max_n: int = 4, device="cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.buffer = torch.zeros(batch, max_len + k + 1, dtype=torch.long, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.drafts = torch.zeros(batch, k, dtype=torch.long, device=device)

    def begin(self, prompts, aux, first):
        dev = self.buffer.device
        self.buffer.zero_()
        for b, (p, f) in enumerate(zip(prompts, first)):
            self.buffer[b, : len(p) + 1] = torch.as_tensor(list(p) + [int(f)], device=dev)
        self.length.copy_(torch.as_tensor([len(p) + 1 for p in prompts], device=dev))

    def draft(self) -> torch.Tensor:
        self.drafts.copy_(ngram_drafts(self.buffer, self.length, self.k, self.min_n, self.max_n))
        return self.drafts

    def advance(self, fed, aux, accepted, bonus, active):
        # the verified tokens d_1..d_n, bonus go after each active row's end
        B, q = fed.shape
        new = torch.cat([fed[:, 1:], bonus[:, None]], 1).scatter(1, accepted[:, None], bonus[:, None])
        columns = torch.arange(q, device=fed.device)
        index = self.length[:, None] + columns
        keep = self.buffer.gather(1, index)
        self.buffer.scatter_(1, index, torch.where(active[:, None] & (columns <= accepted[:, None]), new, keep))
        self.length.add_(torch.where(active, accepted + 1, 0))

    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        """The host loop's interface: the rows' tokens are given, the buffer takes what is new."""
        dev = self.buffer.device
        for b, row in enumerate(tokens):
            seen = int(self.length[b])
            if len(row) < seen or (seen and int(self.buffer[b, seen - 1]) != row[seen - 1]):
                seen = 0  # another request in this row
            self.buffer[b, seen : len(row)] = torch.as_tensor(row[seen:], device=dev)
        self.length.copy_(torch.as_tensor([len(t) for t in tokens], device=dev))
        return self.draft().tolist()

    def accepted(self, fed, aux, counts, active):
        pass  # the host loop hands the verified tokens to `propose`


class _SuffixTrie:
    """Bounded-depth suffix trie over token sequences with occurrence counts.

    Every substring of length <= depth of the inserted sequences is a path from the root;
    `count` at a node is how often that substring occurred. Appending a token extends the
    suffixes that end at the previous token (at most depth of them): O(depth) per token.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]  # node -> {token: child node}
        self.count: list[int] = [0]

    def _child(self, node: int, token: int) -> int:
        nxt = self.children[node].get(token)
        if nxt is None:
            nxt = len(self.count)
            self.children[node][token] = nxt
            self.children.append({})
            self.count.append(0)
        self.count[nxt] += 1
        return nxt

    def extend(self, active: list[int], token: int) -> list[int]:
        """Append `token` after the suffixes at `active` nodes; returns the new active nodes."""
        new = [self._child(node, token) for node in [0] + active[: self.depth - 1]]
        return new

    def insert(self, tokens: list[int]) -> None:
        active: list[int] = []
        for t in tokens:
            active = self.extend(active, t)

    def match(self, context: list[int], max_len: int | None = None) -> tuple[int, int]:
        """(node, length) of the longest suffix of `context` (< depth, <= max_len) that occurred
        with a continuation (the context's own latest occurrence has none)."""
        for m in range(min(self.depth - 1, len(context), max_len or self.depth), 0, -1):
            node = 0
            for t in context[len(context) - m :]:
                node = self.children[node].get(t, -1)
                if node < 0:
                    break
            if node >= 0 and self.children[node]:
                return node, m
        return 0, 0

    def continuation(self, node: int, limit: int) -> list[int]:
        """Follow the most frequent child (ties: lowest token id) for up to `limit` tokens."""
        out = []
        while len(out) < limit and self.children[node]:
            token, node = max(self.children[node].items(), key=lambda kv: (self.count[kv[1]], -kv[0]))
            out.append(token)
        return out


class SuffixProposer(HostProposer):
    """Suffix decoding: continue the context from a suffix trie over this request's prompt and
    output and over a global cache of earlier responses, following the most frequent path.

    The draft length adapts to the match: `min(k, ceil(factor * match length))`. With a small
    factor a long, confident match drafts far and a one-token match drafts little, which saves
    verify work in large batches; the default (100: up to k always) suits small batches, where a
    graphed verify of k + 1 tokens costs what one of fewer costs (20 MT-bench answers on the zoo
    target, k = 7, float32: tau 1.620 with factor 1 and matches up to the trie's depth, 2.058
    with factor 100 and matches that leave room for k tokens; the n-gram proposer: 1.962).
    """

    aux_layers: tuple = ()

    def __init__(self, k: int, depth: int = 24, factor: float = 100.0, min_match: int = 1):
        if k >= depth - 1:  # a match must leave k tokens below it in the trie
            raise ValueError(f"suffix decoding drafting k={k} needs a trie deeper than k + 1, got depth={depth}")
        self.k, self.depth, self.factor, self.min_match = k, depth, factor, min_match
        self.global_trie = _SuffixTrie(depth)
        self._rows: list[tuple[_SuffixTrie, list[int], int]] = []  # (trie, active nodes, tokens seen)

    def begin(self, prompts, aux, first):
        self._rows = []
        for p, f in zip(prompts, first):
            trie = _SuffixTrie(self.depth)
            active: list[int] = []
            for t in list(p) + [f]:
                active = trie.extend(active, t)
            self._rows.append((trie, active, len(p) + 1))

    def propose(self, tokens: list[list[int]]) -> list[list[int]]:
        drafts = []
        for b, seq in enumerate(tokens):
            trie, active, seen = self._rows[b]
            for t in seq[seen:]:  # tokens accepted since the last call
                active = trie.extend(active, t)
            self._rows[b] = (trie, active, len(seq))
            best: list[int] = []
            for source in (trie, self.global_trie):
                # a match of m tokens leaves depth - m levels below it: at most depth - k, so
                # that a k-token continuation fits (the longest match is not the best anchor
                # when its continuation is cut short by the trie's depth)
                node, m = source.match(seq, max_len=max(1, self.depth - self.k))
                if m < self.min_match:
                    continue
                limit = min(self.k, max(1, int(-(-self.factor * m // 1))))
                cand = source.continuation(node, limit)
                if len(cand) > len(best):
                    best = cand
            drafts.append(best)
        return drafts

    def accepted(self, fed, aux, counts, active):
        pass

    def end(self, outputs: list[list[int]]) -> None:
        """Finished responses join the global cache for later requests."""
        for o in outputs:
            self.global_trie.insert(o)
