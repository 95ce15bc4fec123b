"""kernels/tree_accept.py against its reference (inference/tree.py's verification and
compaction composed), on CPU through TRITON_INTERPRET=1: random trees of odd sizes with empty
slots, finished rows, roots at the cache's first and last slots, and choices that match often."""
import pytest
import torch

from inference.tree import ancestor_mask, tree_accept_reference
from kernels.tree_accept import tree_accept_triton
from tests.conftest import kernel_device
from tests.test_tree import random_parents


@pytest.mark.parametrize("B,N,D", [(1, 1, 1), (3, 5, 5), (2, 24, 4), (4, 37, 6), (2, 13, 13)])
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
        want = tree_accept_reference(*args, D, S)
        got = tree_accept_triton(*(t.to(dev) for t in args), D, S)
        for name, w, o in zip(want._fields, want, got):
            assert torch.equal(o.cpu(), w), (name, case, w, o)
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
