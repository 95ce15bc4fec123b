"""kernels/tree_accept.py against its reference (inference/tree/ops.py's verification and
compaction composed), on CPU through TRITON_INTERPRET=1: random trees of odd sizes with empty
slots, finished rows, roots at the cache's first and last slots, and choices that match often."""
import pytest
import torch

from inference.tree.ops import ancestor_mask, move_entries_reference, tree_accept_reference
from draftsmith_kernels.tree_accept import move_entries_triton, tree_accept_triton
from tests.conftest import kernel_device
from tests.test_tree import random_parents


# (2, 63, 6) and (1, 64, 6): the verify's outputs (N + 1) fill 64 lanes, and need 128
@pytest.mark.parametrize("B,N,D", [(1, 1, 1), (3, 5, 5), (2, 24, 4), (4, 37, 6), (2, 13, 13), (2, 63, 6), (1, 64, 6)])
def test_tree_accept_matches_reference(B, N, D):
    dev = kernel_device()
    g = torch.Generator().manual_seed(B * 100 + N)
    S = N + 9
    longest = 0
    for case in range(6):
        V = 2 + case % 3  # a tiny vocabulary: long accepted paths
        parents = random_parents(B, N, g)
        depth = ancestor_mask(parents).sum(-1)
        parents = torch.where(depth > D, -1, parents)  # a tree no deeper than D (the loop's k)
        mask = ancestor_mask(parents)
        tokens = torch.randint(0, V, (B, N), generator=g)
        tokens[torch.rand(B, N, generator=g) < 0.1] = -1  # empty slots never match
        choice = torch.randint(0, V, (B, N + 1), generator=g)
        base = torch.randint(0, S - N, (B,), generator=g)
        base[0] = S - 1 - N if case % 2 else 0  # the tree's last slot is the cache's last one, or the root at 0
        root = torch.randint(0, 50, (B,), generator=g)
        active = torch.rand(B, generator=g) > 0.25
        args = (tokens, parents, mask, choice, base, root, active)
        last = base - 1 if case < 3 else torch.randint(0, S, (B,), generator=g)  # the drafter's last position
        want = tree_accept_reference(*args, D, S, last if case else None)
        got = tree_accept_triton(*(t.to(dev) for t in args), D, S, last=last.to(dev) if case else None)
        for name, w, o in zip(want._fields, want, got):
            assert (o is None and w is None and case == 0) or torch.equal(o.cpu(), w), (name, case, w, o)
        longest = max(longest, int(want.length.max()))
    assert longest >= min(2, D)  # the cases do accept paths, deeper than one node where the tree allows


def test_tree_accept_on_a_chain_accepts_the_matching_prefix():
    dev = kernel_device()
    k = 4
    parents = torch.arange(-1, k - 1)[None]
    tokens = torch.tensor([[7, 8, 9, 3]])
    choice = torch.tensor([[7, 8, 5, 1, 2]])  # drafts 1 and 2 match, 3 does not: bonus 5
    args = (tokens, parents, ancestor_mask(parents), choice, torch.tensor([10]), torch.tensor([42]),
            torch.tensor([True]))
    got = tree_accept_triton(*(t.to(dev) for t in args), k, 32)
    assert got.path.tolist() == [[0, 1, -1, -1]] and got.length.tolist() == [2] and got.bonus.tolist() == [5]
    assert got.fed.tolist() == [[42, 7, 8, 0, 0]] and got.index.tolist() == [[0, 1, 2, 1, 1]]
    assert got.src.tolist() == [[11, 12, 12, 12]] and got.dst.tolist() == [[11, 12, 12, 12]]
    assert got.next_tokens is None and got.next_positions is None  # not asked for
    # the drafter's next input, asked for: fed shifted by one, the bonus after the accepted drafts and last
    got = tree_accept_triton(*(t.to(dev) for t in args), k, 32, last=torch.tensor([9], device=dev))
    assert got.next_tokens.tolist() == [[7, 8, 5, 0, 5]] and got.next_positions.tolist() == [[10, 11, 12, 13, 14]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (an 8B target's KV heads and head dim last: 8 x 128 a layer's tile)
@pytest.mark.parametrize("lead,B,nkv,N,D,d", [((), 1, 1, 3, 3, 16), ((3,), 2, 3, 24, 4, 64), ((2,), 4, 2, 37, 6, 48),
                                              ((2,), 2, 8, 20, 6, 128)])
def test_move_entries_kernel_matches_reference(dtype, lead, B, nkv, N, D, d):
    """The moves a verified tree makes (kernels/tree_accept.py's src / dst: paths whose slots and
    destinations overlap, rows with nothing accepted, duplicate moves) on caches of one layer
    [B,nkv,S,d] and of stacked layers [L,B,nkv,S,d]: the kernel moves what the reference does."""
    dev = kernel_device()
    g = torch.Generator().manual_seed(B * 10 + N)
    S = N + 11
    parents = random_parents(B, N, g)
    parents = torch.where(ancestor_mask(parents).sum(-1) > D, -1, parents)
    mask = ancestor_mask(parents)
    tokens = torch.randint(0, 2, (B, N), generator=g)
    choice = torch.randint(0, 2, (B, N + 1), generator=g)
    base = torch.randint(0, S - N, (B,), generator=g)
    active = torch.ones(B, dtype=torch.bool)
    active[-1] = B == 1  # a finished row: only no-op moves
    moves = tree_accept_reference(tokens, parents, mask, choice, base, torch.zeros(B, dtype=torch.long), active, D, S)
    assert moves.length.max() > 1  # some path moves several entries
    k = torch.randn(*lead, B, nkv, S, d, generator=g).to(dtype)
    v = torch.randn(*lead, B, nkv, S, d, generator=g).to(dtype)
    want_k, want_v = move_entries_reference(k.clone(), v.clone(), moves.src, moves.dst)
    got_k, got_v = k.clone().to(dev), v.clone().to(dev)
    out = move_entries_triton(got_k, got_v, moves.src.to(dev), moves.dst.to(dev))
    assert out[0] is got_k and out[1] is got_v  # in place
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    assert not torch.equal(want_k, k)  # the case moved something


@pytest.mark.parametrize("B,N,D", [(1, 5, 4), (3, 24, 4), (2, 40, 5), (2, 64, 6)])
def test_tree_accept_from_argmax_chunks_and_emitting_matches_the_steps_apart(B, N, D):
    """The verify step's greedy tail in one launch: the target's choices given as its logits'
    argmax chunks (kernels/argmax.py, merged inside the kernel) and the step emitted by the same
    launch. The same TreeAccept and the same loop state as argmax, the reference and
    kernels/emit.py's reference one after another, over 5,000 logits (three chunks, a tie across
    two of them: the lowest id wins), with a finished row, a row whose path meets the
    end-of-sequence token and a row one token short of its budget."""
    from draftsmith_kernels.argmax import CHUNK, argmax_chunks
    from draftsmith_kernels.emit import EmitState, emit_reference

    dev = kernel_device()
    g = torch.Generator().manual_seed(7 * N + B)
    V, S, eos, budget = 5000, max(64, N + 16), 4, 40
    accepted_somewhere = 0
    for case in range(4):
        parents = random_parents(B, N, g)
        parents = torch.where(ancestor_mask(parents).sum(-1) > D, -1, parents)
        mask = ancestor_mask(parents)
        tokens = torch.randint(2, 6, (B, N), generator=g)  # a tiny set of tokens, the eos among them: long paths
        tokens[torch.rand(B, N, generator=g) < 0.1] = -1
        favourite = torch.randint(2, 6, (B, N + 1), generator=g)
        logits = torch.randn(B, N + 1, V, generator=g)
        logits.scatter_(2, favourite[..., None], 9.0)
        logits[0, 0, [favourite[0, 0] + 2048, favourite[0, 0] + 4096]] = 9.0  # the same maximum in three chunks
        base = torch.randint(0, S - N - 1, (B,), generator=g)
        root = torch.randint(0, 50, (B,), generator=g)
        active = torch.ones(B, dtype=torch.bool)
        state = EmitState(torch.tensor([eos]), torch.tensor([budget]), torch.randint(0, 9, (B, S + D + 1), generator=g),
                          torch.randint(1, S // 2, (B,), generator=g), torch.randint(0, budget - 8, (B,), generator=g),
                          torch.zeros(B, dtype=torch.bool), torch.zeros(B, D + 1, dtype=torch.long),
                          torch.randint(0, 5, (B,), generator=g), torch.ones(B, dtype=torch.bool))
        state.n_out[0] = budget - 1  # one token left
        if B > 1:
            state.done[-1], state.active_out[-1], active[-1] = True, False, False  # a finished row
        want_state = EmitState(*(t.clone() for t in state))
        last = base - 1  # the drafter's last position (one behind the root)
        want = tree_accept_reference(tokens, parents, mask, logits.argmax(-1), base, root, active, D, S, last)
        emit_reference(want.path_tokens, want.length, want.bonus, *want_state)
        got_state = EmitState(*(t.clone().to(dev) for t in state))
        maxima, columns, _ = argmax_chunks(logits.flatten(0, 1).to(dev), chunk=CHUNK)  # the GPU's chunks
        got = tree_accept_triton(*(t.to(dev) for t in (tokens, parents, mask)), None,
                                 *(t.to(dev) for t in (base, root, active)), D, S, chunks=(maxima, columns),
                                 emit_into=got_state, last=last.to(dev))
        for name, w, o in zip(want._fields, want, got):
            assert torch.equal(o.cpu(), w), (name, case, w, o)
        for name, w, o in zip(state._fields, want_state, got_state):
            assert torch.equal(o.cpu(), w), (name, case, w, o)
        assert not torch.equal(want_state.tokens, state.tokens) and not torch.equal(want_state.n_out, state.n_out)
        accepted_somewhere += int(want.length[:1 if B == 1 else -1].sum())
    assert accepted_somewhere > 0
