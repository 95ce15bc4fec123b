"""Draft proposers behind one small interface: `propose(context) -> list[int]` of at most k
target token ids for one row, given that row's tokens so far (prompt + output)."""
from __future__ import annotations


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


class NgramProposer:
    """Prompt-lookup drafting: continue the longest earlier match of the context's suffix."""

    def __init__(self, k: int, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: list[int]) -> list[int]:
        m, start = longest_suffix_match(tokens, self.min_n, self.max_n)
        if m == 0:
            return []
        return tokens[start : start + self.k]
