import numpy as np
import torch

from models.draft_vocab import build_draft_vocab, count_tokens, coverage


def test_counts_only_loss_masked_tokens():
    counts = count_tokens([[5, 6, 7, 5]], [[1, 0, 1, 1]], 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 2, 0, 1, 0, 0]


def test_d2t_t2d_invariants():
    rng = np.random.default_rng(0)
    V, Vd = 1000, 97
    counts = rng.integers(0, 50, V)
    d2t, t2d = build_draft_vocab(counts, Vd)
    assert d2t.dtype == torch.int64 and d2t.shape == (Vd,)
    assert t2d.dtype == torch.bool and t2d.shape == (V,) and int(t2d.sum()) == Vd
    target_ids = torch.arange(Vd) + d2t
    assert torch.all(target_ids[1:] > target_ids[:-1]), "sorted ascending by target id"
    assert torch.equal(torch.nonzero(t2d).flatten(), target_ids), "t2d marks exactly the d2t targets"
    # the chosen tokens are the most frequent ones
    kth = np.sort(counts)[::-1][Vd - 1]
    assert counts[target_ids.numpy()].min() >= kth
    assert counts[~t2d.numpy()].max() <= kth
    assert 0 < coverage(counts, t2d) <= 1


def test_full_vocab_is_identity():
    d2t, t2d = build_draft_vocab(np.ones(50), 50)
    assert torch.all(d2t == 0) and torch.all(t2d)
