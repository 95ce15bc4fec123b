"""The cached MTP / DFlash proposers draft exactly what RecomputeProposer drafts (the drafters'
own training-time predictors), keep finished rows still, and sample with a correct q.

The target is a 12-token random Llama rather than the zoo's tiny-random-llama: with 49k tokens
and random weights that one repeats a single token per row, so a random drafter either never
or always agrees. A small vocabulary and a draft vocabulary of the target's most frequent
output tokens give chains that are accepted in part, which is what a mask off by one breaks.
"""
import collections

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference.proposers.blocks import DFlashCachedProposer, MTPCachedProposer
from inference.proposers.drafters import RecomputeProposer
from inference.runtime.engine import cache_size, generate
from inference.runtime.model import RuntimeModel
from models.dflash import DFlashConfig, DFlashDrafter
from models.mtp import MTPConfig, MTPDrafter
from tests.test_sampling import assert_first_two_tokens_follow, eight_token_target
from tests.test_eagle3_runtime import Recording

PROMPT_LENGTHS = (3, 11, 6, 1, 8)
MAX_NEW = 24
EOS = (4, 6)  # ends two rows early (after 5 and 15 tokens), the others run to MAX_NEW


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)
    hf = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("target12")
    hf.save_pretrained(folder)
    rt = RuntimeModel.from_pretrained(folder)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 12, (n,)).tolist() for n in PROMPT_LENGTHS]
    plain, _ = generate(rt, prompts, MAX_NEW, eos_ids=EOS)
    assert len({len(o) for o in plain}) >= 3, "rows should finish at different times"
    return hf, rt, prompts, plain


def _drafter(kind, hf, vocab_tokens, std=0.3):
    """A drafter with random trainable weights, warm-started from the target, drafting over
    `vocab_tokens` only."""
    cfg, vd = hf.config, len(vocab_tokens)
    torch.manual_seed(0)
    if kind == "mtp":
        d = MTPDrafter(MTPConfig.from_target(cfg, vd, num_modules=3))
    else:
        d = DFlashDrafter(DFlashConfig.from_target(cfg, vd, mask_token_id=0, num_layers=2, block_size=4))
    ids = torch.tensor(sorted(vocab_tokens))
    d.init_from_target(hf, ids - torch.arange(vd), torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    # then every trained matrix random (MTP's warm start copies the target's small-init layer,
    # whose attention would hardly move the drafts, so its masks would hardly matter)
    for p in d.parameters():
        if p.requires_grad and p.dim() > 1:
            torch.nn.init.normal_(p, std=std)
    return d.eval()


def _frequent_tokens(outputs, n):
    return [t for t, _ in collections.Counter(t for o in outputs for t in o).most_common(n)]


CACHED = {"mtp": MTPCachedProposer, "dflash": DFlashCachedProposer}


@pytest.mark.parametrize("kind,k,vd", [("mtp", 1, 2), ("mtp", 2, 2), ("mtp", 3, 4), ("dflash", 1, 2), ("dflash", 3, 4)])
def test_cached_proposers_draft_what_recomputation_drafts(small_target, kind, k, vd):
    """Ragged batch, rows ending apart (EOS, budget), a cache exactly as long as needed: same
    drafts at every step as RecomputeProposer, hence the same acceptance, and plain greedy output."""
    hf, rt, prompts, plain = small_target
    drafter = _drafter(kind, hf, _frequent_tokens(plain, vd))
    size = cache_size(prompts, MAX_NEW, k)
    runs = {}
    for name, cls in (("recompute", RecomputeProposer), ("cached", CACHED[kind])):
        rec = Recording(cls(drafter, k, len(prompts), size, rt.config))
        outs, stats = generate(rt, prompts, MAX_NEW, proposer=rec, eos_ids=EOS, max_len=size)
        runs[name] = (outs, stats, [drafts for _, drafts in rec.calls])
    (outs, stats, drafts), (c_outs, c_stats, c_drafts) = runs["recompute"], runs["cached"]
    assert outs == plain and c_outs == plain
    # finished rows draft garbage that nobody verifies; compare the rows still generating
    for step, (d, c) in enumerate(zip(drafts, c_drafts)):
        for b in range(len(prompts)):
            if step < sum(stats.row_histograms[b]):
                assert c[b] == d[b], (step, b, c[b], d[b])
    assert c_stats.histogram == stats.histogram and c_stats.row_histograms == stats.row_histograms
    accepted_in_part = sum(stats.histogram[1:k]) if k > 1 else stats.histogram[1]
    assert accepted_in_part > 0 and stats.histogram[0] > 0, stats.histogram  # some drafts accepted, some not


def _state(proposer):
    """Each state tensor of a cached proposer with the batch dimension first, over its S
    positions (a slot beyond them is scratch: parked writes land there, no query reads it)."""
    batch_dim = {"anchor": 0, "bonus": 0, "tokens": 0, "hidden": 1, "k_cache": 1, "v_cache": 1}
    position_dim = {"tokens": 1, "hidden": 2, "k_cache": 3, "v_cache": 3}
    state = {}
    for name, dim in batch_dim.items():
        if hasattr(proposer, name):
            t = getattr(proposer, name)
            if name in position_dim:
                t = t.narrow(position_dim[name], 0, proposer.max_len)
            state[name] = t.transpose(0, dim).clone()
    return state


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_first_draft_and_a_finished_row_stay_put(small_target, kind):
    """draft() after begin is RecomputeProposer's first proposal; after an advance in which row
    1 is no longer active its draft and its state are unchanged, while the others draft what
    recomputation drafts for their grown text."""
    hf, rt, prompts, plain = small_target
    prompts = prompts[:3]
    k, B = 3, 3
    drafter = _drafter(kind, hf, _frequent_tokens(plain, 4))
    size = cache_size(prompts, 8, k)
    cached = CACHED[kind](drafter, k, B, size, rt.config)
    recompute = RecomputeProposer(drafter, k, B, size, rt.config)
    cache = rt.new_cache(B, size)
    T = max(len(p) for p in prompts)
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        logits, aux = rt(ids, torch.arange(T).expand(B, T), cache, cached.aux_layers, logits_at=lengths - 1,
                         causal_prefill=True)
    first = logits[:, 0].argmax(-1).tolist()
    tokens = [p + [f] for p, f in zip(prompts, first)]
    for proposer in (cached, recompute):
        proposer.begin(prompts, aux, first)
    buffers = {name: t.data_ptr() for name, t in vars(cached).items() if isinstance(t, torch.Tensor)}
    drafts = cached.draft()
    assert drafts is cached.draft()  # a static buffer
    assert drafts.tolist() == recompute.propose(tokens)

    # one verify step: whatever the loop accepts, the proposers follow (here 2, 1 and 0 drafts)
    fed = torch.cat([torch.tensor([t[-1] for t in tokens])[:, None], drafts.clone()], 1)  # [B,k+1]
    positions = (lengths[:, None]) + torch.arange(k + 1)
    with torch.no_grad():
        logits, aux = rt(fed, positions, cache, cached.aux_layers)
    accepted = torch.tensor([2, 1, 0])
    bonus = logits[torch.arange(B), accepted].argmax(-1)
    active = torch.tensor([True, False, True])
    before, stuck_draft = _state(cached), drafts[1].clone()
    cached.advance(fed, aux, accepted, bonus, active)
    recompute.accepted(fed, aux, list(zip(accepted.tolist(), bonus.tolist())), active.tolist())
    after = _state(cached)
    for name in before:
        assert torch.equal(before[name][1], after[name][1]), name
        assert not torch.equal(before[name][[0, 2]], after[name][[0, 2]]), name
    for b in (0, 2):
        tokens[b] += fed[b, 1 : 1 + accepted[b]].tolist() + [int(bonus[b])]
    again = cached.draft()
    assert torch.equal(again[1], stuck_draft)
    # draft and advance update state in place (what a captured graph needs)
    assert buffers == {name: t.data_ptr() for name, t in vars(cached).items() if isinstance(t, torch.Tensor)}
    expect = recompute.propose(tokens)
    assert [again[0].tolist(), again[2].tolist()] == [expect[0], expect[2]]


@pytest.mark.parametrize("kind,verification", [("mtp", "standard"), ("mtp", "block"), ("dflash", "standard"), ("dflash", "block")])
def test_sampled_drafts_keep_the_target_distribution(tmp_path, kind, verification):
    """Drafts sampled from the drafter's own softmax at T with their q: the first two emitted
    tokens still follow the target (8-token vocabulary, N rows in one batch), and drafts were
    accepted."""
    hf, rt = eight_token_target(tmp_path)
    prompt, T, N, k = [1, 2, 3, 4], 0.8, 10_000, 2
    drafter = _drafter(kind, hf, list(range(8)), std=0.5)
    proposer = CACHED[kind](drafter, k, N, cache_size([prompt], 2, k), rt.config)
    outs, stats = generate(rt, [prompt] * N, 2, proposer=proposer, temperature=T,
                           generator=torch.Generator().manual_seed(1), verification=verification)
    assert sum(n * c for n, c in enumerate(stats.histogram)) > 1000  # drafts were accepted
    assert torch.allclose(proposer.q.sum(-1), torch.ones(N, k))  # q: a distribution per draft
    assert_first_two_tokens_follow(hf, prompt, outs, T)
