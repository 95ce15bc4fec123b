"""kernels/tree_select.py against its references (inference/tree/ops.py's expand_level_reference and
finalize_reference), on CPU through TRITON_INTERPRET=1: the rerank on whole trees drafted depth
by depth from random log-probabilities with many ties, odd sizes, a frontier wider and narrower
than the children per node, and trees kept whole or cut to one node; a depth's expansion inside
the head's merge and the next layer's input norms, from hidden states through an lm_head of few
distinct rows (ties again)."""
import pytest
import torch

from inference.tree.ops import Tree, expand_level_reference, finalize_reference
from draftsmith_kernels.tree_select import Candidates, finalize_triton
from tests.conftest import kernel_device


def _draft(expand, B, depth, top_k, Vd, g, dev, children=None):
    """A whole tree's candidates through `expand`, from coarse random log-probabilities (ties):
    the root's top_k children, then `children` (top_k unless given) below each frontier node."""
    children = top_k if children is None else children
    C = top_k + (depth - 1) * top_k * children
    cand = Candidates.empty(B, C, dev)
    index = scores = None  # the root alone
    last = torch.randint(3, 40, (B,), generator=g).to(dev)
    draft_ids = torch.randperm(3 * Vd, generator=g)[:Vd].to(dev)
    drafted, frontiers = 0, []
    for level in range(depth):
        F_ = 1 if index is None else index.shape[1]
        logprobs = -torch.randint(0, 4, (B, F_, Vd), generator=g).float() / 2  # many equal scores
        # (taken on the CPU for both sides: torch.topk orders ties differently on a GPU)
        top = logprobs.topk(top_k if index is None else children, dim=-1)
        frontier = expand(top.indices.to(dev), top.values.to(dev), draft_ids, index, scores, drafted, level, last, cand,
                          top_k)
        frontiers.append(frontier)
        drafted += F_ * top.indices.shape[-1]
        index, scores = frontier.index, frontier.scores
    assert drafted == C
    return cand, frontiers, last


# (2, 3, 6, 30): 78 candidates, more than one 64-column block of ancestor rows and of ranks; the
# last two expand their frontier nodes into fewer (2) and more (5) children than the nodes kept
@pytest.mark.parametrize("B,depth,top_k,Vd,children", [(1, 1, 1, 5, None), (2, 4, 4, 40, None), (3, 3, 3, 7, None),
                                                       (2, 2, 5, 9, None), (2, 3, 6, 30, None), (2, 4, 5, 30, 2),
                                                       (2, 3, 3, 20, 5)])
def test_finalize_matches_its_reference(B, depth, top_k, Vd, children):
    dev = kernel_device()
    k = top_k if children is None else children
    for seed in range(3):
        cand, frontiers, last = _draft(expand_level_reference, B, depth, top_k, Vd, torch.Generator().manual_seed(seed),
                                       "cpu", children)
        for level, front in enumerate(frontiers):
            # parent_row names each node's parent in the frontier before (the root at depth 1)
            parents = cand.parents.gather(1, front.index)
            if level == 0:
                assert (parents == -1).all() and (front.parent_row == 0).all()
            else:
                assert torch.equal(parents, frontiers[level - 1].index.gather(1, front.parent_row))
        C = cand.tokens.shape[1]
        on_dev = Candidates(*(t.to(dev) for t in cand))
        for total in sorted({1, (C + 1) // 2, C}):
            want = finalize_reference(cand, k, top_k, total, last + 1)
            got = Tree(*finalize_triton(on_dev, k, top_k, total, (last + 1).to(dev)))
            for name, w, o in zip(want._fields, want, got):
                assert torch.equal(o.cpu(), w), (name, total, seed)
            # the positions' offset added in the kernel (a drafter passes its last entry, + 1)
            offset = Tree(*finalize_triton(on_dev, k, top_k, total, last.to(dev), base_offset=1))
            assert torch.equal(offset.positions.cpu(), want.positions)
            # depths follow the layout: the root's top_k children, then top_k x k a depth
            assert torch.equal(want.depths, want.positions - (last + 1)[:, None])
            assert (want.depths == 1 + (want.parents >= 0).long() * want.depths.gather(1, want.parents.clamp_min(0))).all()


@pytest.mark.parametrize("tile", [None, 1024])
def test_finalize_over_many_candidates_crosses_its_blocks(tile):
    """More candidates than one program writes and ranks against at a time (16 and 32; 8 and 8
    where a tile holds 1,024, as for a row of 1,024 candidates by default): ranks, node numbers
    and the mask are counted across programs and blocks."""
    from draftsmith_kernels.tree_select import TreeSelectTuning

    tuning = TreeSelectTuning() if tile is None else TreeSelectTuning(rerank_tile=tile)
    dev = kernel_device()
    g = torch.Generator().manual_seed(5)
    cand, _, last = _draft(expand_level_reference, 2, 3, 6, 30, g, "cpu")  # 6 + 2 x 36 = 78 candidates
    assert cand.tokens.shape[1] == 78
    for total in (40, 71, 78):
        want = finalize_reference(cand, 6, 6, total, last + 1)
        got = Tree(*finalize_triton(Candidates(*(t.to(dev) for t in cand)), 6, 6, total, (last + 1).to(dev),
                                    tuning=tuning))
        for name, w, o in zip(want._fields, want, got):
            assert torch.equal(o.cpu(), w), (name, total)


@pytest.mark.parametrize("B,depth,top_k,children,total", [(2, 4, 4, 2, 19), (3, 3, 6, None, 78)])
def test_finalize_writes_the_verify_input_as_feed_does(B, depth, top_k, children, total):
    """The rerank's launch also writes the verify step's input (a loop's root token and position,
    then the nodes'): what kernels/emit.py's `feed` writes from the reference tree, every column
    (the buffers start as junk)."""
    from draftsmith_kernels.emit import feed_reference

    dev = kernel_device()
    g = torch.Generator().manual_seed(3)
    k = top_k if children is None else children
    cand, _, last = _draft(expand_level_reference, B, depth, top_k, 30, g, "cpu", children)
    tree = finalize_reference(cand, k, top_k, total, last + 1)
    loop_tokens = torch.randint(0, 100, (B, 64), generator=g)
    length = last + 2  # the root (the row's last token) sits at position last + 1
    want_fed, want_positions = torch.full((B, total + 1), -7), torch.full((B, total + 1), -7)
    feed_reference(loop_tokens, length, tree.tokens, want_fed, want_positions, tree.positions)
    fed, positions = torch.full((B, total + 1), -7, device=dev), torch.full((B, total + 1), -7, device=dev)
    got = Tree(*finalize_triton(Candidates(*(t.to(dev) for t in cand)), k, top_k, total, last.to(dev), base_offset=1,
                                feed=(loop_tokens.to(dev), length.to(dev), fed, positions)))
    assert torch.equal(got.tokens.cpu(), tree.tokens)
    assert torch.equal(fed.cpu(), want_fed) and torch.equal(positions.cpu(), want_positions)
    assert torch.equal(want_fed[:, 0], loop_tokens.gather(1, (length - 1)[:, None])[:, 0])
    with pytest.raises(ValueError, match="feed"):
        finalize_triton(Candidates(*(t.to(dev) for t in cand)), k, top_k, total, last.to(dev),
                        feed=(loop_tokens.to(dev), length.to(dev), fed[:, 1:], positions))


@pytest.mark.parametrize("lead,nkv,D,d", [((3,), 2, 4, 16), ((), 1, 3, 8)])
def test_finalize_makes_the_cache_moves_it_is_given(lead, nkv, D, d):
    """The rerank's launch also makes a verified tree's cache moves, in programs past its ranking
    ones: the caches (stacked layers [L,B,nkv,S,d], or one layer) end as kernels/tree_accept.py's
    moves leave them (paths whose slots and destinations overlap, a row with nothing to move),
    the tree as without them; a move for another batch is refused."""
    from inference.tree.ops import ancestor_mask, move_entries_reference, tree_accept_reference
    from tests.test_tree import random_parents

    dev = kernel_device()
    g = torch.Generator().manual_seed(11)
    B, N, S = 3, 12, 40
    cand, _, last = _draft(expand_level_reference, B, 3, 3, 20, g, "cpu")
    want_tree = finalize_reference(cand, 3, 3, 9, last + 1)
    parents = random_parents(B, N, g)
    parents = torch.where(ancestor_mask(parents).sum(-1) > D, -1, parents)
    tokens, choice = torch.randint(0, 2, (B, N), generator=g), torch.randint(0, 2, (B, N + 1), generator=g)
    base = torch.randint(0, S - N, (B,), generator=g)
    root, active = torch.zeros(B, dtype=torch.long), torch.tensor([True, True, False])
    accepted = tree_accept_reference(tokens, parents, ancestor_mask(parents), choice, base, root, active, D, S)
    assert accepted.length[:2].max() > 1  # a path moves several entries
    k_cache, v_cache = (torch.randn(*lead, B, nkv, S, d, generator=g) for _ in range(2))
    want_k, want_v = move_entries_reference(k_cache.clone(), v_cache.clone(), accepted.src, accepted.dst)
    assert not torch.equal(want_k, k_cache)
    got_k, got_v = k_cache.to(dev), v_cache.to(dev)
    got = Tree(*finalize_triton(Candidates(*(t.to(dev) for t in cand)), 3, 3, 9, last.to(dev), base_offset=1,
                                moves=(got_k, got_v, accepted.src.to(dev), accepted.dst.to(dev))))
    for name, w, o in zip(want_tree._fields, want_tree, got):
        assert torch.equal(o.cpu(), w), name
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    with pytest.raises(ValueError, match="moves for 2 rows"):
        finalize_triton(Candidates(*(t.to(dev) for t in cand)), 3, 3, 9, last.to(dev),
                        moves=(got_k[..., :2, :, :, :], got_v[..., :2, :, :, :], accepted.src[:2].to(dev),
                               accepted.dst[:2].to(dev)))


def test_a_nan_score_writes_nothing_outside_the_rows_outputs():
    """A NaN score has nothing ahead of it and is ahead of nothing, so more than N candidates
    would count as kept (no drafter gives one: its merge maps NaN to -inf). The rerank still writes only inside each row's N
    nodes and N + 1 fed columns: guards around every output stay as they were."""
    dev = kernel_device()
    g = torch.Generator().manual_seed(11)
    cand, _, last = _draft(expand_level_reference, 2, 3, 3, 20, g, "cpu")
    cand.scores[1, 3] = float("nan")
    B, C = cand.tokens.shape
    N = 4
    guard = -7
    longs = [torch.full((B + 1, N), guard, device=dev) for _ in range(4)]  # a row of guard past the last
    mask = torch.zeros(B + 1, N, N, dtype=torch.bool, device=dev)
    mask[B] = True
    fed, fed_positions = (torch.full((B + 1, N + 1), guard, device=dev) for _ in range(2))
    loop_tokens = torch.randint(0, 9, (B, 32), generator=g).to(dev)
    out = (longs[0][:B], longs[1][:B], longs[2][:B], mask[:B], longs[3][:B])
    finalize_triton(Candidates(*(t.to(dev) for t in cand)), 3, 3, N, last.to(dev), out=out,
                    feed=(loop_tokens, (last + 2).to(dev), fed[:B], fed_positions[:B]))
    for t in (*longs, fed, fed_positions):
        assert (t[B] == guard).all()
    assert mask[B].all()


def test_finalize_refuses_more_nodes_than_candidates():
    cand = Candidates.empty(1, 4, "cpu")
    with pytest.raises(ValueError, match="total_tokens=5"):
        finalize_triton(cand, 2, 2, 5, torch.zeros(1, dtype=torch.long))


# (1, 3, 8, 16, 64, 300): 264 candidates, ancestor rows longer than one 256-column block
@pytest.mark.parametrize("B,depth,top_k,children,H,Vd", [(2, 3, 3, 2, 64, 300), (1, 4, 4, None, 70, 129),
                                                         (3, 2, 5, 3, 64, 40), (1, 3, 8, 16, 64, 300)])
def test_the_fused_depth_launches_match_head_expand_and_norms(B, depth, top_k, children, H, Vd):
    """A depth through `expand_children_triton` and `frontier_norm_pair_triton` (the head's merge
    writing the candidates, then the frontier ranked beside the layer's input norms) writes the
    very bits of the head alone (`norm_lm_head_topk_triton`: the same slices and merge), its
    children expanded by `expand_level_reference`, and `rms_norm_pair_triton` with the parents
    gathered. An lm_head of few distinct rows makes many children tie (by score, and by
    cumulative score across parents)."""
    from draftsmith_kernels.lm_head_topk import norm_lm_head_topk_triton
    from draftsmith_kernels.rms_norm import rms_norm_pair_triton
    from draftsmith_kernels.tree_select import expand_children_triton, frontier_norm_pair_triton

    dev = kernel_device()
    g = torch.Generator().manual_seed(B * 100 + depth)
    k = top_k if children is None else children
    C = top_k + (depth - 1) * top_k * k
    head = (torch.randn(6, H, generator=g) / H ** 0.5)[torch.randint(0, 6, (Vd,), generator=g)].to(dev)
    norm_w = (torch.rand(H, generator=g) + 0.5).to(dev)
    table = torch.randn(3 * Vd, H, generator=g).to(dev)
    tw, xw = (torch.rand(H, generator=g) + 0.5).to(dev), (torch.rand(H, generator=g) + 0.5).to(dev)
    draft_ids = torch.randperm(3 * Vd, generator=g)[:Vd].to(dev)
    last = torch.randint(3, 40, (B,), generator=g).to(dev)
    sides = [Candidates.empty(B, C, "cpu"), Candidates.empty(B, C, dev)]
    frontiers = [(None, None), (None, None)]
    x, off = torch.randn(B, 1, H, generator=g).to(dev), 0
    for level in range(depth):
        kk = top_k if level == 0 else k
        # the separate launches
        index, scores = frontiers[0]
        values, ids = norm_lm_head_topk_triton(x, norm_w, 1e-5, head, kk, block_v=128)
        want = expand_level_reference(ids.cpu(), values.cpu(), draft_ids.cpu(), index, scores, off, level, last.cpu(),
                                      sides[0], top_k)
        want_hidden = x.new_empty(B, top_k, H)
        want_pair = rms_norm_pair_triton(table, want.tokens.to(dev), tw, x, xw, 1e-5, x_rows=want.parent_row.to(dev),
                                         x_out=want_hidden)
        # the fused ones
        index, scores = frontiers[1]
        expand_children_triton(x, norm_w, 1e-5, head, kk, draft_ids, index, scores, off, sides[1], block_v=128)
        got_hidden = x.new_empty(B, top_k, H)
        got, got_pair = frontier_norm_pair_triton(sides[1], off, kk, top_k, level, last, table, tw, x, xw, 1e-5,
                                                  got_hidden)
        end = off + x.shape[1] * kk
        for name, w, o in zip(Candidates._fields, sides[0], sides[1]):
            assert torch.equal(o[:, off:end].cpu(), w[:, off:end]), (name, level)
        for name, w, o in zip(want._fields, want, got):
            assert torch.equal(o.cpu(), w), (name, level)
        assert torch.equal(got_pair, want_pair) and torch.equal(got_hidden, want_hidden), level
        frontiers = [(want.index, want.scores), (got.index, got.scores)]
        x, off = torch.randn(B, top_k, H, generator=g).to(dev), end
    assert off == C  # every candidate written


def test_a_nan_child_ranks_last_in_the_fused_launches():
    """As `_expand_kernel`: a NaN log-probability (an lm_head row of NaN) ranks below every child."""
    from draftsmith_kernels.tree_select import expand_children_triton, frontier_norm_pair_triton

    dev = kernel_device()
    H = 16
    head = torch.eye(3, H, device=dev)
    head[0] = float("nan")
    x = torch.zeros(1, 1, H, device=dev)
    x[..., 0], x[..., 1], x[..., 2] = 1.0, 3.0, 2.0  # row 1 then row 2; row 0 NaN
    cand = Candidates.empty(1, 3, dev)
    expand_children_triton(x, torch.ones(H, device=dev), 1e-6, head, 3, torch.arange(3, device=dev), None, None, 0,
                           cand, block_v=128)
    front, _ = frontier_norm_pair_triton(cand, 0, 3, 2, 0, torch.zeros(1, dtype=torch.long, device=dev),
                                         torch.randn(3, H, device=dev), torch.ones(H, device=dev), x,
                                         torch.ones(H, device=dev), 1e-6, x.new_empty(1, 2, H))
    assert cand.tokens[0].tolist() == [1, 2, 0] and cand.scores[0, 2] == float("-inf")
    assert front.tokens.tolist() == [[1, 2]]
