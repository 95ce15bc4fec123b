"""Draft trees (inference/tree/ops.py, tests/tree_reference.py): EAGLE-2 selection keeps parents and breaks ties
deterministically, static trees, greedy tree verification against a brute force, KV
compaction, and tree rejection sampling reproducing the target's distribution (chi-square)."""
import random

import pytest
import torch

from inference.tree.ops import ancestor_mask, compaction_index, expand_depth, finalize, greedy_tree_verify
from tests.tree_reference import (compact_cache, select_tree, start_tree, static_tree, tree_rejection_sample,
                                  tree_rejection_verify)
from draftsmith_kernels.greedy_verify import greedy_verify_reference
from draftsmith_kernels.rejection_sample import rejection_sample_reference
from tests.test_sampling import chi_square_p


def random_parents(B, N, g):
    """[B,N] a random tree per row, parents before children (-1: a child of the root)."""
    parents = torch.full((B, N), -1, dtype=torch.long)
    for i in range(1, N):
        parents[:, i] = torch.randint(-1, i, (B,), generator=g)
    return parents


def ancestors(parents_row, i):
    """Node i and its ancestors, deepest first (plain Python)."""
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents_row[i]
    return chain


# ---------------------------------------------------------------------------- selection
def one_depth(state, tokens, logprobs, top_k=2):
    return expand_depth(state, torch.tensor(tokens)[None], torch.tensor(logprobs)[None], top_k)


def test_tie_parent_and_child_keeps_the_parent():
    """A child whose log-prob is 0 (or rounds above 0) ties its parent's cumulative score: the
    parent is kept first, then the child before an equal-scored later candidate."""
    state = one_depth(start_tree(1), [[10, 11]], [[-1.0, -1.5]])  # candidates 0: 10 (-1), 1: 11 (-1.5)
    # children of 10: 20 with log-prob 0 (a tie with its parent), 21; of 11: 22, 23
    state = one_depth(state, [[20, 21], [22, 23]], [[0.0, -3.0], [1e-7, -3.0]])
    assert state.scores.tolist()[0][:4] == [-1.0, -1.5, -1.0, -4.0]
    assert state.scores[0, 4] == -1.5  # 22's log-prob rounded above 0 is clamped: it ties 11
    base = torch.tensor([5])
    one = finalize(state, 1, base)
    assert one.tokens.tolist() == [[10]] and one.parents.tolist() == [[-1]]
    three = finalize(state, 3, base)
    # ranked 10, 20 (tie with its parent), then 11 before 22 (equal scores: lower depth first)
    assert three.tokens.tolist() == [[10, 11, 20]]
    assert three.parents.tolist() == [[-1, -1, 0]] and three.positions.tolist() == [[6, 6, 7]]
    assert finalize(state, 4, base).tokens.tolist() == [[10, 11, 20, 22]]
    # siblings with equal scores: the lower index first, every time
    state = one_depth(start_tree(1), [[7, 3, 5]], [[-0.5, -0.5, -0.5]], top_k=3)
    assert finalize(state, 2, base).tokens.tolist() == [[7, 3]]


def brute_select(scores, total):
    """Kept candidate indices by (score desc, index asc), in index order (plain Python)."""
    ranked = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
    return sorted(ranked[:total])


def test_select_tree_keeps_parents_before_children_on_random_scores():
    rng = random.Random(0)
    for case in range(200):
        B, depth, top_k = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 3)
        V = top_k + rng.randint(0, 3)
        g = torch.Generator().manual_seed(case)
        state = start_tree(B)
        for d in range(depth):
            # coarse logits make many exact ties between siblings, cousins, parent and child
            logits = torch.randint(0, 3, (B, state.frontier.shape[1], V), generator=g).float()
            top = torch.log_softmax(logits, -1).topk(top_k, dim=-1)
            new_scores = state.frontier_scores[:, :, None] + top.values.clamp_max(0)
            state = expand_depth(state, top.indices, top.values, top_k)
            # the ancestor matrix kept level by level is the closure of the parent relation
            assert torch.equal(state.ancestors, ancestor_mask(state.parents))
            # the frontier is the best top_k new candidates, lower index first on ties
            for b in range(B):
                flat = new_scores[b].flatten().tolist()
                best = sorted(range(len(flat)), key=lambda c: (-flat[c], c))[:top_k]
                C_before = state.tokens.shape[1] - len(flat)
                assert state.frontier[b].tolist() == [C_before + c for c in best]
        C = top_k + (depth - 1) * top_k * top_k
        assert state.tokens.shape == (B, C)
        total = rng.randint(1, C)
        base = torch.randint(0, 50, (B,), generator=g)
        tree = finalize(state, total, base)
        N = total
        assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == tree.positions.shape == (B, N)
        assert tree.mask.shape == (B, N, N)
        assert (tree.parents < torch.arange(N)).all() and (tree.parents >= -1).all()
        parent_depth = torch.where(tree.parents >= 0, tree.depths.gather(1, tree.parents.clamp_min(0)), 0)
        assert torch.equal(tree.depths, parent_depth + 1)
        assert torch.equal(tree.positions, base[:, None] + tree.depths)
        for b in range(B):
            kept = brute_select(state.scores[b].tolist(), total)
            assert tree.tokens[b].tolist() == [state.tokens[b, c].item() for c in kept]
            cand_parent = state.parents[b].tolist()
            assert tree.parents[b].tolist() == [kept.index(cand_parent[c]) if cand_parent[c] >= 0 else -1
                                                for c in kept]  # .index raises if a parent was dropped
            par = tree.parents[b].tolist()
            want = torch.zeros(N, N, dtype=torch.bool)
            for i in range(N):
                want[i, ancestors(par, i)] = True
            assert torch.equal(tree.mask[b], want)


def test_select_tree_drives_a_drafter_depth_by_depth():
    """select_tree asks for the drafter's log-probs once per depth after the first, for the
    F = top_k frontier nodes, and a chain (top_k = 1) is the drafter's greedy chain."""
    V, calls = 11, []
    table = torch.log_softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 3, -1)

    def child_logprobs(state):  # a bigram "drafter": log-probs after the frontier's token
        calls.append(tuple(state.frontier.shape))
        return table[state.tokens.gather(1, state.frontier)]

    root = table[torch.tensor([4, 9])]
    tree = select_tree(root, child_logprobs, depth=4, top_k=1, total_tokens=4, base_positions=torch.tensor([3, 8]))
    assert calls == [(2, 1)] * 3
    for b, t in enumerate((4, 9)):
        chain = []
        for _ in range(4):
            t = int(table[t].argmax())
            chain.append(t)
        assert tree.tokens[b].tolist() == chain
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2
    calls.clear()
    tree = select_tree(root, child_logprobs, depth=3, top_k=3, total_tokens=8, base_positions=torch.tensor([3, 8]))
    assert calls == [(2, 3)] * 2 and tree.tokens.shape == (2, 8)


def test_static_tree_from_medusa_paths():
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)]
    candidates = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # [B,D,K]: token = 12 b + 4 depth + rank
    tree = static_tree(paths, candidates, torch.tensor([10, 20]))
    # order: depth then path: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0)
    assert tree.parents.tolist() == [[-1, -1, -1, 0, 0, 1, 3]] * 2
    assert tree.depths.tolist() == [[1, 1, 1, 2, 2, 2, 3]] * 2
    assert tree.tokens[0].tolist() == [0, 1, 2, 4, 5, 4, 8]
    assert tree.tokens[1].tolist() == [12, 13, 14, 16, 17, 16, 20]
    assert tree.positions[1].tolist() == [21, 21, 21, 22, 22, 22, 23]
    assert tree.mask[0, 6].tolist() == [True, False, False, True, False, False, True]
    with pytest.raises(ValueError, match=r"\(1, 1\)"):
        static_tree([(0,), (1, 1, 0)], candidates, torch.tensor([0, 0]))


# ---------------------------------------------------------------------------- greedy verification
def brute_greedy(tokens, parents, choice):
    """The deepest (then lowest-index) node whose whole root path matches (plain Python)."""
    best, best_depth = -1, 0
    for i in range(len(tokens)):
        chain = ancestors(parents, i)
        if all(tokens[j] == choice[parents[j] + 1] for j in chain) and len(chain) > best_depth:
            best, best_depth = i, len(chain)
    path = ancestors(parents, best)[::-1] if best >= 0 else []
    return path, choice[best + 1]


def test_greedy_tree_verify_matches_brute_force_over_all_paths():
    g = torch.Generator().manual_seed(0)
    for case in range(200):
        B, N, V = 1 + case % 3, 1 + case % 13, 2 + case % 3  # a tiny vocabulary: many matches
        parents = random_parents(B, N, g)
        tokens = torch.randint(0, V, (B, N), generator=g)
        tokens[torch.rand(B, N, generator=g) < 0.1] = -1  # empty slots never match
        choice = torch.randint(0, V, (B, N + 1), generator=g)
        path, length, bonus = greedy_tree_verify(tokens, parents, choice)
        assert path.shape == (B, N)
        for b in range(B):
            want_path, want_bonus = brute_greedy(tokens[b].tolist(), parents[b].tolist(), choice[b].tolist())
            assert path[b].tolist() == want_path + [-1] * (N - len(want_path))
            assert length[b] == len(want_path) and bonus[b] == want_bonus


def test_greedy_tree_verify_on_a_chain_equals_chain_verification():
    g = torch.Generator().manual_seed(1)
    B, k, V = 6, 4, 3
    logits = torch.randn(B, k + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, k), generator=g)
    chain = torch.arange(-1, k - 1).expand(B, k)
    path, length, bonus = greedy_tree_verify(drafts, chain, logits.argmax(-1), max_depth=k)
    accepted, want_bonus = greedy_verify_reference(drafts, logits)
    assert torch.equal(length, accepted) and torch.equal(bonus, want_bonus)
    assert torch.equal(path, torch.where(torch.arange(k) < accepted[:, None], torch.arange(k), -1))


# ---------------------------------------------------------------------------- compaction
def test_compact_cache_moves_exactly_the_accepted_entries():
    g = torch.Generator().manual_seed(2)
    B, nkv, S, d, N = 4, 3, 23, 5, 6
    parents = random_parents(B, N, g)
    parents[0] = torch.arange(-1, N - 1)  # row 0: a chain, wholly accepted
    tokens = torch.randint(0, 2, (B, N), generator=g)
    choice = torch.randint(0, 2, (B, N + 1), generator=g)
    choice[0, :N] = tokens[0]
    tokens[1] = -1  # row 1: nothing accepted
    path, length, _ = greedy_tree_verify(tokens, parents, choice)
    assert length[0] == N and length[1] == 0
    base = torch.tensor([2, 9, 0, S - 1 - N])  # the last row's tree ends at the cache's last slot
    src, dst, valid = compaction_index(path, base)
    k_cache, v_cache = torch.randn(B, nkv, S, d, generator=g), torch.randn(B, nkv, S, d, generator=g)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b in range(B):
        for j in range(int(length[b])):
            s = int(base[b]) + 1 + int(path[b, j])
            want_k[b, :, int(base[b]) + 1 + j] = k_cache[b, :, s]
            want_v[b, :, int(base[b]) + 1 + j] = v_cache[b, :, s]
    out_k, out_v = compact_cache(k_cache, v_cache, src, dst, valid)
    assert out_k is k_cache and out_v is v_cache  # in place
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # a hand-made case: row 0 keeps nodes 2 and 4 (slots 3 and 5 → 1 and 2), row 1 nothing
    k = torch.arange(2 * 8, dtype=torch.float).reshape(2, 1, 8, 1)
    src, dst, valid = compaction_index(torch.tensor([[2, 4, -1], [-1, -1, -1]]), torch.tensor([0, 6]))
    compact_cache(k, k.clone(), src, dst, valid)
    assert k[:, 0, :, 0].tolist() == [[0, 3, 5, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    # a target's layers stacked [L,B,nkv,S,d], moved at once: each layer as if moved alone
    layers = torch.randn(3, 2, 2, 8, 4, generator=g)
    before, alone = layers.clone(), layers.clone()
    for layer in alone:
        compact_cache(layer, layer.clone(), src, dst, valid)
    compact_cache(layers, layers.clone(), src, dst, valid)
    assert torch.equal(layers, alone)
    assert torch.equal(layers[:, 0, :, 1], before[:, 0, :, 3]) and torch.equal(layers[:, 1], before[:, 1])


# ---------------------------------------------------------------------------- tree sampling
def sampled_tree(p_root, q_root, p_next, q_next, rows, g):
    """rows draws of a two-level tree: 3 root children drawn without replacement from q_root,
    2 children under each drawn without replacement from q_next[its token]. The target's
    distribution after a node depends only on its token (p_next), so the second emitted token
    given the first x follows p_next[x]. Layout: nodes 0-2 depth 1, then 3,4 | 5,6 | 7,8."""
    V = p_root.shape[0]
    first = torch.multinomial(q_root.expand(rows, V), 3, generator=g)  # [rows,3], without replacement
    second = torch.multinomial(q_next[first.flatten()], 2, generator=g).reshape(rows, 6)
    tokens = torch.cat([first, second], 1)
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 1, 2, 2]).expand(rows, 9)
    uniform = torch.full((rows, 6, V), 1.0 / V)  # after the leaves: never read for drafts
    draft_probs = torch.cat([q_root.expand(rows, 1, V), q_next[first], uniform], 1)  # [rows,10,V]
    target_probs = torch.cat([p_root.expand(rows, 1, V), p_next[first], p_next[second]], 1)
    return tokens, parents, draft_probs, target_probs


def emitted(tokens, path, length, nxt, n):
    """[rows,n] the first n emitted tokens (accepted nodes' tokens, then the next token)."""
    cols = torch.arange(n)
    accepted = tokens.gather(1, path[:, :n].clamp_min(0))
    return torch.where(cols < length[:, None], accepted, nxt[:, None])


def test_tree_sampling_reproduces_the_target_distribution():
    """Chi-square over 120,000 draws: the first emitted token follows p_root, the second (given
    the most frequent first) p_next[first]. The draft is skewed away from the target, so most
    draws reject one or more siblings; a missing sibling renormalisation fails this test."""
    V, rows = 6, 120_000
    g = torch.Generator().manual_seed(0)
    p_root = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.22, 0.28])
    q_root = torch.tensor([0.40, 0.30, 0.15, 0.08, 0.05, 0.02])
    p_next = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    q_next = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    tokens, parents, q, p = sampled_tree(p_root, q_root, p_next, q_next, rows, g)
    path, length, nxt = tree_rejection_verify(tokens, parents, q, p, generator=g, max_depth=3, max_children=3)
    assert path.shape == (rows, 3) and (length <= 2).all()
    assert (length == 0).float().mean() > 0.05 and (length == 2).float().mean() > 0.05  # all outcomes occur
    out = emitted(tokens, path, length, nxt, 2)
    assert chi_square_p(torch.bincount(out[:, 0], minlength=V), p_root) > 0.01
    mode = int(torch.bincount(out[:, 0]).argmax())
    second = out[(out[:, 0] == mode) & (length >= 1), 1]  # first token from an accepted node
    assert second.numel() > 5_000
    assert chi_square_p(torch.bincount(second, minlength=V), p_next[mode]) > 0.01


def test_tree_sampling_on_a_chain_equals_chain_rejection_sampling():
    """With one child per node and the same uniforms, tree and chain verification agree."""
    g = torch.Generator().manual_seed(3)
    B, k, V = 500, 3, 7
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, k)
    u_accept, u_sample = torch.rand(B, k, generator=g), torch.rand(B, generator=g)
    accepted, nxt = rejection_sample_reference(drafts, q, p, u_accept, u_sample)
    chain = torch.arange(-1, k - 1).expand(B, k)
    q_tree = torch.cat([q, torch.full((B, 1, V), 1.0 / V)], 1)  # [B,k+1,V]: q after the root and each node
    path, length, tree_next = tree_rejection_sample(drafts, chain, q_tree, p, u_accept[:, :, None], u_sample)
    assert torch.equal(length, accepted) and torch.equal(tree_next, nxt)



def test_sampled_tree_verify_over_fixed_candidates_reproduces_the_target_distribution():
    """EAGLE-2 trees hold fixed candidates (top-k by score, reranked), not draws: one draw from
    the target per node, matched down the tree, emits the target's distribution. Chi-square
    over 120,000 draws for the first token, the second given the most frequent accepted first,
    and the third given both (past the tree's depth: the bonus after a whole path). The
    candidates are the draft's likeliest tokens, so the target's likeliest are often missing."""
    from tests.tree_reference import sampled_tree_verify

    V, rows = 6, 120_000
    g = torch.Generator().manual_seed(1)
    p_root = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.22, 0.28])
    q_root = torch.tensor([0.40, 0.30, 0.15, 0.08, 0.05, 0.02])
    p_next = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # after a token: depends on it alone
    q_next = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    first = q_root.topk(3).indices.expand(rows, 3)  # the same three candidates in every row
    second = q_next[first].topk(2, dim=-1).indices.reshape(rows, 6)
    tokens = torch.cat([first, second], 1)
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 1, 2, 2]).expand(rows, 9)
    target = torch.cat([p_root.expand(rows, 1, V), p_next[first], p_next[second]], 1)
    u = torch.rand(rows, 10, generator=g)
    path, length, nxt = sampled_tree_verify(tokens, parents, target, u, max_depth=3)
    assert (length == 0).float().mean() > 0.05 and (length == 2).float().mean() > 0.05  # all outcomes occur
    out = emitted(tokens, path, length, nxt, 3)
    assert chi_square_p(torch.bincount(out[:, 0], minlength=V), p_root) > 0.01
    mode = int(torch.bincount(out[length >= 1, 0]).argmax())  # the most frequent accepted candidate
    given = (out[:, 0] == mode) & (length >= 1)
    assert given.sum() > 5_000 and chi_square_p(torch.bincount(out[given, 1], minlength=V), p_next[mode]) > 0.01
    deep = (length == 2) & given & (out[:, 1] == int(torch.bincount(out[(length == 2) & given, 1]).argmax()))
    assert deep.sum() > 2_000
    assert chi_square_p(torch.bincount(out[deep, 2], minlength=V), p_next[int(out[deep, 1][0])]) > 0.01
    # the same draws matched against the parent's distribution (rows shifted by one) are biased
    shifted = torch.cat([target[:, :1], target[:, :-1]], 1)
    wrong = emitted(tokens, *sampled_tree_verify(tokens, parents, shifted, u, max_depth=2), 2)
    wrong_given = (wrong[:, 0] == mode) & (sampled_tree_verify(tokens, parents, shifted, u, max_depth=2)[1] >= 1)
    assert chi_square_p(torch.bincount(wrong[wrong_given, 1], minlength=V), p_next[mode]) < 1e-6
