"""Tree-aware predicted acceptance (inference/walks/tree.py): the held-out walk drafts the
trees the runtime drafts and judges them as the runtime does, so on the runtime's own greedy
answers the predicted tree histogram is the measured one, count for count; on text that leaves
the target's greedy path, the grafted forwards give the true accepted lengths."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith_kernels.settings import KernelSettings
from inference.runtime.engine import cache_size, generate
from inference.runtime.model import RuntimeModel
from inference.walks.tree import predicted_tree_histograms, tree_lengths, text_states
from inference.tree.loop import EagleTreeProposer
from models.target import Target

MAX_NEW = 20


def _small_vocab_eagle3(hf, vocab: list[int]):
    """A random EAGLE-3 drafter whose draft vocabulary is `vocab` (the tokens the tiny target
    answers with): its trees hold the target's next token often enough to be accepted at
    every depth, and at rank 1 as often as at rank 2, so every part of a tree counts."""
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    V, Vd = hf.config.vocab_size, len(vocab)
    torch.manual_seed(0)
    d = Eagle3Drafter(Eagle3Config.from_target(hf.config, Vd))
    for name, p in d.named_parameters():
        if "embed" not in name and p.dim() > 1:
            torch.nn.init.normal_(p, std=0.3)
    ids = torch.tensor(vocab)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d.init_from_target(hf, ids - torch.arange(Vd), t2d)
    return d.eval()


@pytest.fixture(scope="module")
def served(tiny_target):
    """Prompts, the runtime's plain greedy answers, the drafter, the runtime and the walk's target."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9, 4, 11, 8)]
    plain, _ = generate(rt, prompts, MAX_NEW)
    drafter = _small_vocab_eagle3(hf, sorted({t for o in plain for t in o}))
    return prompts, plain, drafter, rt, Target.load(tiny_target, drafter.aux_layer_ids)


def _measured(served, tree) -> list[int]:
    prompts, plain, drafter, rt, _ = served
    n = cache_size(prompts, MAX_NEW, tree[2])
    depth, top_k, total, *children = tree
    proposer = EagleTreeProposer(drafter, depth, top_k, total, batch=len(prompts), max_len=n, target_config=rt.config,
                                 children=children[0] if children else None)
    outs, stats = generate(rt, prompts, MAX_NEW, proposer=proposer, max_len=n)
    assert outs == plain  # lossless
    return stats.histogram


def test_the_loop_through_the_kernels_accepts_and_moves_as_the_torch_path_does(served, tiny_target):
    """Every runtime kernel on (the Triton interpreter on a CPU), two of the prompts, trees
    accepted at every depth: the tree loop emits plain greedy's answers with the histogram of the
    torch path, whose cache moves and next drafter inputs come from separate torch steps. Here the
    next draft's rerank launch makes the moves and the bookkeeping kernel the next inputs (a move
    left undone changed this histogram, though not these answers)."""
    import copy

    from tests.conftest import kernel_device

    prompts, _, _, rt, _ = served
    dev = kernel_device()
    prompts = prompts[:2]
    plain, _ = generate(rt, prompts, MAX_NEW)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = _small_vocab_eagle3(hf, sorted({t for o in plain for t in o}))  # these two answers' tokens
    tree = (3, 2, 8)
    n = cache_size(prompts, MAX_NEW, tree[2])
    runs = []
    for mode in ("off", "force"):
        on_dev = mode == "force" and dev != "cpu"
        model = RuntimeModel.from_pretrained(tiny_target, device=dev) if on_dev else rt
        proposer = EagleTreeProposer(copy.deepcopy(drafter).to(dev) if on_dev else drafter, *tree, batch=2, max_len=n,
                                     target_config=rt.config)
        outs, stats = generate(model, prompts, MAX_NEW, proposer=proposer, max_len=n, cuda_graphs=False,
                               kernels=KernelSettings(mode=mode))
        runs.append((outs, stats.histogram))
    assert runs[1] == runs[0]
    assert runs[0][0] == plain
    assert sum(runs[0][1][2:]) > 0, runs  # paths of two nodes and more: their entries moved


def _walked(served, tree, texts=None, window=None) -> list[int]:
    prompts, plain, drafter, _, target = served
    hist = torch.zeros(tree[0] + 1, dtype=torch.long)
    for p, o in texts or zip(prompts, plain):
        ids = torch.tensor([p + o])
        mask = torch.tensor([[0] * len(p) + [1] * len(o)])
        hist += predicted_tree_histograms(target, drafter, ids, mask, torch.tensor([ids.shape[1]]), [tree], None,
                                          window=window)[tree]
    return hist.tolist()


def test_the_walk_predicts_the_tree_histogram_the_runtime_measures(served):
    """Replaying the served answers, the walk's histogram equals the runtime's for the same
    tree, and differs for another tree: the promise is of this tree, not of trees in general."""
    from inference.walks.greedy import acceptance_from_histogram

    tree, other = (3, 2, 8), (3, 2, 10)
    measured = _measured(served, tree)
    assert sum(measured[2:]) > 0 and measured[3] > 0, measured  # trees accepted at every depth
    target = served[4]
    calls = []
    graft = target.greedy_after_chains
    target.greedy_after_chains = lambda seq, anchors, chains: calls.append((len(seq), anchors.tolist(), chains.shape[1])) \
        or graft(seq, anchors, chains)
    try:
        walked = _walked(served, tree)
    finally:
        del target.greedy_after_chains
    assert walked == measured
    assert _walked(served, tree, window=2) == measured  # windows batch the trees; they change none
    assert acceptance_from_histogram(walked)["tau"] == acceptance_from_histogram(measured)["tau"]
    # the target's own answers judge every tree but those running past their end
    assert all(a + 1 + c >= n for n, anchors, c in calls for a in anchors), calls
    assert _walked(served, other) != measured


def test_the_walk_predicts_a_narrow_trees_histogram_too(served):
    """A tree whose kept nodes below the root have fewer children than top_k (3 nodes a depth,
    2 children each): the walk drafts it as the runtime does, count for count, and it is not the
    square tree's histogram."""
    tree = (3, 3, 8, 2)
    measured = _measured(served, tree)
    assert sum(measured[2:]) > 0, measured
    assert _walked(served, tree) == measured
    assert _walked(served, (3, 3, 8)) != measured


def test_grafted_trees_on_text_off_the_greedy_path_get_the_true_lengths(served):
    """Answers with tokens changed every few places: the text no longer tells the target's
    choices below a changed token, so accepted paths are grafted on (one forward per round).
    Every anchor's length equals the longest prefix of the target's true greedy continuation
    that the tree holds as a root-to-node path."""
    prompts, plain, drafter, _, target = served
    from inference.proposers.drafters import Eagle3Proposer

    depth, top_k, total = 3, 2, 8
    grafted = 0
    for r, (p, o) in enumerate(list(zip(prompts, plain))[:3]):
        other = plain[r + 3][0]  # another answer's token: in the draft vocabulary, off this answer's path
        text = p + [t if i % 4 != 2 else other for i, t in enumerate(o)]
        ids = torch.tensor(text)
        n = len(text)
        with torch.no_grad():
            out = target(ids[None])
            _, greedy = target.head_outputs(out.last_hidden)
        proposer = Eagle3Proposer(drafter, 1, 1, n)
        hidden = text_states(proposer, ids, out.aux[0])
        anchors = torch.arange(len(p) - 1, n - 2)
        calls = []
        graft = target.greedy_after_chains
        target.greedy_after_chains = lambda seq, a, c: calls.append(a.numel()) or graft(seq, a, c)
        try:
            lengths = tree_lengths(target, proposer, ids, greedy[0], hidden, anchors, depth, top_k, total)
        finally:
            del target.greedy_after_chains
        grafted += sum(calls)
        # the truth: the tree the runtime's function drafts, against greedy decoding from the root
        from inference.walks.tree import draft_eagle_tree

        S = n - 1
        trees = draft_eagle_tree(proposer, hidden[anchors], anchors, proposer.k_cache[:, :, :S].expand(len(anchors), -1, -1, -1),
                                 proposer.v_cache[:, :, :S].expand(len(anchors), -1, -1, -1), depth, top_k, total)
        for j, a in enumerate(anchors.tolist()):
            seq, node, length = ids[: a + 2], -1, 0
            while length < depth:
                with torch.no_grad():
                    choice = int(target.model(seq[None]).logits[0, -1].argmax())
                child = [i for i in range(total) if trees.parents[j, i] == node and trees.tokens[j, i] == choice]
                if not child:
                    break
                node, length, seq = child[0], length + 1, torch.cat([seq, torch.tensor([choice])])
            assert int(lengths[j]) == length, (a, int(lengths[j]), length)
    assert grafted > 0  # the text left the greedy path where the trees were accepted


def test_the_walk_refuses_a_drafter_that_drafts_no_trees(tiny_target):
    from models.medusa import MedusaConfig, MedusaDrafter

    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    medusa = MedusaDrafter(MedusaConfig.from_target(hf.config, hf.config.vocab_size, num_heads=2))
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="draft trees are drafted by EAGLE-3 drafters for now .* not by this Medusa"):
        predicted_tree_histograms(None, medusa, ids, ids, torch.tensor([8]), [(2, 2, 4)], None)
