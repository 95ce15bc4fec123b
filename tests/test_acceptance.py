import torch

from inference.walks.greedy import acceptance_from_histogram, accepted_lengths, length_histogram


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


def _greedy_continuation(model, prefix: torch.Tensor, k: int) -> list[int]:
    seq = prefix.clone()
    for _ in range(k):
        with torch.no_grad():
            nxt = model(seq[None]).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq[len(prefix):].tolist()


class _ScriptedDrafter:
    """Drafts given per position [T, k] (in the test: the target's true greedy continuation,
    wrong at chosen places): chains of every accepted length, without training anything."""

    def __init__(self, drafts: torch.Tensor, vocab: int):
        self.drafts, self.vocab = drafts, vocab  # [T, k]

    def draft_ids(self):
        return torch.arange(self.vocab)

    def unroll(self, ids, features, k, greedy=True):
        return [torch.nn.functional.one_hot(self.drafts[:, s], self.vocab).float()[None] for s in range(k)]


def _served_walk(paths, drafts, start, end, k):
    """Serving by hand: chains from the first answer token, each next one after the bonus."""
    hist, a = [0] * (k + 1), start - 1
    while a + 2 < end:
        accepted = 0
        while accepted < k and drafts[a][accepted] == paths[a][accepted]:
            accepted += 1
        hist[accepted] += 1
        a += accepted + 1
    return hist


def test_predicted_acceptance_walks_the_answer_as_serving_does(tiny_target):
    """Chains start where serving starts them (after each bonus token), on human text (the
    target's choices need grafted chains) and on the target's own greedy text (the text alone
    judges every chain before its end: no extra forward)."""
    from inference.walks.greedy import predicted_histogram
    from models.target import Target

    target = Target.load(tiny_target, [0])
    model, k, prompt = target.model, 3, 6
    V = target.config.vocab_size
    torch.manual_seed(0)
    human = torch.randint(0, 3000, (40,))
    own = torch.cat([human[:prompt], torch.tensor(_greedy_continuation(model, human[:prompt], 34))])
    for ids in (human, own):
        T = len(ids)
        paths = [_greedy_continuation(model, ids[: a + 2], k) for a in range(T - 1)]  # true choices per anchor
        drafts = torch.tensor([[p[s] if (a * 7 + s * 3) % 5 else (p[s] + 1) % V for s in range(k)]
                               for a, p in enumerate(paths)] + [[0] * k])
        mask = torch.zeros(1, T, dtype=torch.long)
        mask[0, prompt:] = 1
        calls = []
        graft = target.greedy_after_chains
        target.greedy_after_chains = lambda seq, anchors, chains: calls.extend(anchors.tolist()) or graft(seq, anchors, chains)
        with torch.no_grad():
            _, greedy = target.head_outputs(target(ids[None]).last_hidden)
        hist = predicted_histogram(target, _ScriptedDrafter(drafts, V), ids[None], mask, torch.tensor([T]), k,
                                   anchors_per_sequence=1000, features=torch.zeros(1, T, 1), greedy=greedy, window=8)
        del target.greedy_after_chains
        expected = _served_walk(paths, drafts.tolist(), prompt, T, k)
        assert hist.tolist() == expected
        assert sum(expected[1:]) > 0 and expected[k] > 0  # chains of every kind were judged
        # the target's own text judges every chain but those running past its end
        assert all(a + k + 1 >= T for a in calls) == (ids is own), calls


def test_predicted_acceptance_splits_first_answers_from_follow_up_turns(tiny_target):
    """per_turn counts the chains of a row's first answer span and of its later spans apart; each
    part equals the walk over that span alone (the walk restarts at every span), and the parts
    add up to the whole."""
    from inference.walks.greedy import predicted_histogram
    from models.target import Target

    target = Target.load(tiny_target, [0])
    k, T = 3, 48
    V = target.config.vocab_size
    torch.manual_seed(2)
    ids = torch.randint(0, 3000, (T,))
    with torch.no_grad():
        _, greedy = target.head_outputs(target(ids[None]).last_hidden)
    # drafts: the target's greedy choice after the text, right at two positions in three
    drafts = torch.stack([torch.where(torch.arange(T) % 3 > 0, greedy[0], (greedy[0] + 1) % V)] * k, dim=1)

    def walk(spans, per_turn):
        mask = torch.zeros(1, T, dtype=torch.long)
        for s, e in spans:
            mask[0, s:e] = 1
        return predicted_histogram(target, _ScriptedDrafter(drafts, V), ids[None], mask, torch.tensor([T]), k,
                                   anchors_per_sequence=1000, features=torch.zeros(1, T, 1), greedy=greedy,
                                   per_turn=per_turn)

    first, follow_ups = (6, 20), [(26, 34), (38, 48)]
    split = walk([first, *follow_ups], per_turn=True)
    assert split.shape == (2, k + 1)
    assert split[0].tolist() == walk([first], per_turn=False).tolist()
    alone = [walk([span], per_turn=False) for span in follow_ups]
    assert split[1].tolist() == (alone[0] + alone[1]).tolist()
    assert split.sum(0).tolist() == walk([first, *follow_ups], per_turn=False).tolist()
    assert split[0].sum() > 0 and split[1].sum() > 0


def test_cap_answer_spans_keeps_the_served_part_of_each_answer():
    from inference.walks.greedy import cap_answer_spans

    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1], [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    assert cap_answer_spans(mask, 2).tolist() == [[0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1], [1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert cap_answer_spans(mask, 3).sum(1).tolist() == [7, 6]
    assert cap_answer_spans(mask, 100).tolist() == mask.tolist() and cap_answer_spans(mask, None) is mask
