"""The runtime EAGLE-3 proposer drafts exactly what training's greedy unroll drafts."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.runtime.engine import cache_size, generate
from inference.runtime.model import RuntimeModel
from inference.proposers import Eagle3Proposer
from models.eagle3 import Eagle3Config, Eagle3Drafter
from models.target import Target


def _drafter_for(hf_model, seed=0, vd=512, **flags):
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(hf_model.config, vd, **flags)
    d = Eagle3Drafter(cfg)
    for name, p in d.named_parameters():
        if "embed" not in name:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.sort(torch.randperm(cfg.vocab_size)[:vd]).values
    d.init_from_target(hf_model, ids - torch.arange(vd), torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    return d.eval()


class Recording:
    """Wraps a proposer and records (context, drafts) of every step."""

    def __init__(self, inner):
        self.inner, self.k, self.aux_layers, self.calls = inner, inner.k, inner.aux_layers, []

    def begin(self, *a):
        self.inner.begin(*a)

    def propose(self, tokens):
        drafts = self.inner.propose(tokens)
        self.calls.append(([list(t) for t in tokens], drafts))
        return drafts

    def accepted(self, *a):
        self.inner.accepted(*a)


@pytest.mark.parametrize("flags", [{}, {"norm_before_fc": True, "norm_before_residual": True}])
def test_runtime_drafts_equal_training_unroll_drafts(tiny_target, flags):
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = _drafter_for(hf, **flags)
    target = Target(hf, drafter.config.aux_layer_ids)
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9)]
    k = 4
    rec = Recording(Eagle3Proposer(drafter, k, batch=3, max_len=cache_size(prompts, 16, k)))
    generate(rt, prompts, 16, proposer=rec)
    checked = 0
    for contexts, drafts in rec.calls:
        for ctx, d in zip(contexts, drafts):
            ids = torch.tensor([ctx])
            with torch.no_grad():
                aux = target(ids).aux
                steps = drafter.unroll(ids, aux, k, greedy=True)
            a = len(ctx) - 2  # the chain continues x_0..x_{a+1}
            expect = [int(drafter.draft_ids()[s[0, a].argmax()]) for s in steps]
            assert d == expect, (len(ctx), d, expect)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA case needs a GPU (the CPU case is the same check)"))])
def test_rows_finishing_apart_stay_inside_the_drafters_cache(tiny_target, device):
    """Batched serving (validate's 16 questions at once): a row that reaches its token budget
    in a step that accepted more than it had left must not advance the drafter's cache past
    its end while the other rows go on (on a GPU: a device-side assert in the cache write)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = _drafter_for(hf).to(device)
    rt = RuntimeModel.from_pretrained(tiny_target, device=device)
    torch.manual_seed(5)
    prompts = [torch.randint(0, 40000, (9,)).tolist() for _ in range(8)]  # equal: each is the longest
    k, max_new = 4, 24
    size = cache_size(prompts, max_new, k)
    inner = Eagle3Proposer(drafter, k, batch=8, max_len=size)
    seen = []  # (rows still generating, furthest cache position the next step writes)

    class Watch(Recording):
        def accepted(self, fed, aux, counts, active):
            self.inner.accepted(fed, aux, counts, active)
            seen.append((sum(active), int(self.inner.last.max()) + k + 1))

    # synthetic verification accepts each draft with probability 0.8: rows run at different
    # speeds and often overshoot their budget in their last step
    outs, _ = generate(rt, prompts, max_new, proposer=Watch(inner), verification="synthetic:0.8",
                       generator=torch.Generator(device).manual_seed(0))
    assert all(len(o) == max_new for o in outs)
    assert any(0 < n < len(prompts) for n, _ in seen), "no row finished before the others"
    assert max(reach for _, reach in seen) < size


def test_drafter_for_another_target_is_refused(tiny_target):
    from types import SimpleNamespace

    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    drafter = _drafter_for(hf)
    other = SimpleNamespace(vocab_size=1000, hidden_size=64, num_layers=2)
    with pytest.raises(ValueError, match="trained for another target: vocab"):
        Eagle3Proposer(drafter, 3, 1, 64, target_config=other)


@pytest.mark.slow
def test_lossless_with_eagle3_proposer_on_real_prompts(tokenizer, zoo_plain_greedy):
    from models.zoo import resolve_target

    path = resolve_target("smollm2-135m-instruct")
    rt = RuntimeModel.from_pretrained(path)
    drafter = _drafter_for(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), vd=4096)
    # the 20 real prompts and plain greedy's outputs, 16 new tokens in these batches of 5 (conftest)
    prompts, plain = zoo_plain_greedy
    eos = (tokenizer.eos_token_id,)
    spec = []
    for i in range(0, len(prompts), 5):
        batch = prompts[i : i + 5]
        proposer = Eagle3Proposer(drafter, 3, len(batch), cache_size(batch, 16, 3), target_config=rt.config)
        spec.extend(generate(rt, batch, 16, proposer=proposer, eos_ids=eos)[0])
    assert spec == plain


def test_begin_over_a_wider_buffer_with_stale_features_changes_nothing(tiny_target):
    """What the captured begin runs (`begin_graphed` on a GPU): the prompts padded to a bucket
    wider than the longest, the features past each prompt stale. Entries at those positions are
    overwritten before any query reads them, so every step drafts the same chains."""
    from inference.proposers.drafters import _shifted_prompts

    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = _drafter_for(hf, norm_before_fc=True)
    rt = RuntimeModel.from_pretrained(tiny_target)

    class Drafts(Eagle3Proposer):
        def draft(self):
            self.seen = getattr(self, "seen", []) + [super().draft().clone()]
            return self.drafts

    class WideBegin(Drafts):
        def begin(self, prompts, aux, first):
            B, T, W = aux.shape
            shifted, last_index = _shifted_prompts(prompts, T + 37)
            stale = 5 * torch.randn(B, T + 37, W)
            stale[:, :T] = aux
            self._begin(shifted, stale, last_index, torch.as_tensor(first), torch.arange(T + 37).expand(B, -1))

    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9)]
    runs = []
    for make in (Drafts, WideBegin):
        proposer = make(drafter, 4, batch=3, max_len=128, target_config=rt.config)
        outputs, _ = generate(rt, prompts, 24, proposer=proposer, max_len=128)
        runs.append((outputs, torch.stack(proposer.seen)))
    assert runs[0][0] == runs[1][0]
    assert len(runs[0][1]) >= 6 and torch.equal(runs[0][1], runs[1][1])
