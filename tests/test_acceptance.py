import torch

from inference.acceptance import acceptance_from_histogram, accepted_lengths, length_histogram


def test_accepted_lengths_count_leading_matches():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3], [1, 2, 9]])
    target = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert accepted_lengths(drafts, target).tolist() == [3, 1, 0, 2]


def test_tau_and_conditional_acceptance():
    lengths = torch.tensor([3, 1, 0, 2])
    stats = acceptance_from_histogram(length_histogram(lengths, 3))
    assert stats["histogram"] == [1, 1, 1, 1]
    # tau = 1 + mean accepted = 1 + 6/4
    assert abs(stats["tau"] - 2.5) < 1e-12
    # a_1 = 3/4, a_2 = 2/3, a_3 = 1/2; tau = 1 + a1 + a1 a2 + a1 a2 a3
    a = stats["a"]
    assert [round(x, 6) for x in a] == [0.75, round(2 / 3, 6), 0.5]
    assert abs(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2] - stats["tau"]) < 1e-12


def test_plain_decoding_has_tau_one():
    stats = acceptance_from_histogram(length_histogram(torch.zeros(10, dtype=torch.long), 4))
    assert stats["tau"] == 1.0 and stats["a"] == [0.0] * 4
