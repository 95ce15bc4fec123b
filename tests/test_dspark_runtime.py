"""The DSpark device proposer (inference/proposers/dspark.py) drafts what the drafter's walk
drafts (greedy and sampled, with its confidences), and the device loop stays lossless with it,
with and without adaptive verification (inference/runtime/adaptive.py): greedy output equals
plain greedy on 20 real prompts of the zoo target in float32 (ragged batches of 5), and at T = 1
the first two emitted tokens still follow the target (chi-square)."""
import collections

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith_kernels.rejection_sample import inverse_cdf
from inference.proposers.drafters import RecomputeProposer
from inference.proposers.dspark import DSparkCachedProposer
from inference.runtime.adaptive import AdaptiveVerification, StepCosts
from inference.runtime.engine import cache_size, generate
from inference.runtime.model import RuntimeModel
from models.dspark import DSparkConfig, DSparkDrafter
from tests.test_eagle3_runtime import Recording
from tests.test_sampling import assert_first_two_tokens_follow, chi_square_p, eight_token_target


def _dspark(hf, vocab_tokens, std=0.3, layers=2, block_size=4, rank=8, seed=0):
    """A DSpark drafter warm-started from target `hf` (a transformers model), its trained weights
    random (Markov and confidence heads included, so the bias and the confidences matter),
    drafting over `vocab_tokens`."""
    hf_config = hf.config
    V, vd = hf_config.vocab_size, len(vocab_tokens)
    torch.manual_seed(seed)
    d = DSparkDrafter(DSparkConfig.from_target(hf_config, vd, mask_token_id=0, num_layers=layers, block_size=block_size,
                                               markov_rank=rank))
    ids = torch.tensor(sorted(vocab_tokens))
    d.init_from_target(hf, ids - torch.arange(vd), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))
    for p in d.parameters():  # (what the warm start leaves trainable)
        if p.requires_grad and p.dim() > 1:
            torch.nn.init.normal_(p, std=std)
    return d.eval()


def _costs(batch, k, steep=True):
    """A step-cost table whose verify time grows fast with the width: the choice varies with the
    confidences."""
    return StepCosts(target="test", device="cpu", dtype="float32",
                     verify_ms={str(batch): [1.0 + (0.8 if steep else 0.05) * n for n in range(k + 1)]},
                     draft_ms={str(batch): 0.5})


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)
    hf = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("target12")
    hf.save_pretrained(folder)
    hf.saved_to = folder  # (the GPU case loads it on CUDA)
    rt = RuntimeModel.from_pretrained(folder)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 12, (n,)).tolist() for n in (3, 11, 6, 1, 8)]
    plain, _ = generate(rt, prompts, 24, eos_ids=(4, 6))
    return hf, rt, prompts, plain


def test_runtime_drafts_equal_the_walk_and_stay_lossless(small_target):
    """Every step of a ragged batch (rows ending apart): the cached proposer's drafts are those of
    RecomputeProposer, which drafts with the drafter's walk (`draft_at`, the Markov bias left to
    right) over each row's verified text; the output is plain greedy's, also with adaptive
    verification."""
    hf, rt, prompts, plain = small_target
    k = 3
    frequent = collections.Counter(t for o in plain for t in o).most_common(3)  # drafts in part accepted
    drafter = _dspark(hf, [t for t, _ in frequent])
    size = cache_size(prompts, 24, k)
    runs = {}
    for name, cls in (("walk", RecomputeProposer), ("runtime", DSparkCachedProposer)):
        rec = Recording(cls(drafter, k, len(prompts), size, rt.config))
        outs, stats = generate(rt, prompts, 24, proposer=rec, eos_ids=(4, 6), max_len=size)
        runs[name] = (outs, stats, [drafts for _, drafts in rec.calls])
    (outs, stats, drafts), (r_outs, r_stats, r_drafts) = runs["walk"], runs["runtime"]
    assert outs == plain and r_outs == plain
    for step, (d, r) in enumerate(zip(drafts, r_drafts)):
        for b in range(len(prompts)):
            if step < sum(stats.row_histograms[b]):  # (finished rows draft what nobody verifies)
                assert r[b] == d[b], (step, b, r[b], d[b])
    assert r_stats.row_histograms == stats.row_histograms
    assert sum(stats.histogram[1:]) > 0 and stats.histogram[0] > 0, stats.histogram  # accepted in part
    proposer = DSparkCachedProposer(drafter, k, len(prompts), size, rt.config)
    out, a_stats = generate(rt, prompts, 24, proposer=proposer, eos_ids=(4, 6), max_len=size,
                            adaptive=AdaptiveVerification(_costs(len(prompts), k)))
    assert out == plain
    width = a_stats.summary()["verified_drafts_per_row_step"]
    assert 1 < width < k, width  # the widths varied: some steps verified fewer than k drafts


def test_a_dspark_drafter_without_confidence_head_is_refused_adaptive_verification(small_target):
    """No confidence head: the proposer estimates nothing (no `confidence`), so adaptive
    verification refuses it rather than choose widths from constant confidences; fixed k serves."""
    from inference.proposers.base import capabilities

    hf, rt, prompts, plain = small_target
    torch.manual_seed(0)
    V = hf.config.vocab_size
    drafter = DSparkDrafter(DSparkConfig.from_target(hf.config, V, mask_token_id=0, num_layers=1, block_size=4,
                                                     markov_rank=4, confidence_head=False))
    drafter.init_from_target(hf, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    size = cache_size(prompts, 8, 3)
    proposer = DSparkCachedProposer(drafter.eval(), 3, len(prompts), size, rt.config)
    assert not capabilities(proposer).confidences
    with pytest.raises(ValueError, match="estimates its drafts' acceptance"):
        generate(rt, prompts, 8, proposer=proposer, eos_ids=(4, 6), max_len=size,
                 adaptive=AdaptiveVerification(_costs(len(prompts), 3)))
    out, _ = generate(rt, prompts, 8, proposer=proposer, eos_ids=(4, 6), max_len=size)
    assert out == [o[:8] for o in plain]


def test_draft_and_confidence_equal_the_walk_greedy_and_sampled(small_target):
    """After begin: draft() and the confidences equal `draft_block` at each row's anchor (target
    features from the runtime's prefill); draft_sampled(T, generator) equals the walk driven by the
    same draws (`drive_block` with an inverse-CDF step), q its softmax at T."""
    hf, rt, prompts, _ = small_target
    k, B, T = 3, len(prompts), 0.9
    drafter = _dspark(hf, [0, 2, 3, 5, 7, 8, 9, 11])
    size = cache_size(prompts, 8, k)
    proposer = DSparkCachedProposer(drafter, k, B, size, rt.config)
    L = max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        logits, aux = rt(ids, torch.arange(L).expand(B, L), rt.new_cache(B, size), proposer.aux_layers,
                         logits_at=lengths - 1, causal_prefill=True)
    first = logits[:, 0].argmax(-1)
    proposer.begin(prompts, aux, first.tolist())
    drafts, confidence = proposer.draft().clone(), proposer.confidence.clone()
    seed, g = 7, torch.Generator().manual_seed(7)
    sampled, q = (t.clone() for t in proposer.draft_sampled(T, g))
    g = torch.Generator().manual_seed(seed)
    draft_ids = drafter.draft_ids()
    for b, p in enumerate(prompts):
        row = torch.tensor(p + [int(first[b])])
        anchor = torch.tensor([len(p) - 1])
        with torch.no_grad():
            features = torch.cat([aux[b, : len(p)], aux.new_zeros(1, aux.shape[-1])])  # (the bonus' is unread)
            want, want_conf = drafter.draft_block(row, features, anchor, k)
        assert drafts[b].tolist() == want[0].tolist(), b
        assert torch.allclose(confidence[b], want_conf[0], atol=1e-5), b
    # the sampled walk of all rows at once draws the runtime's uniforms in the runtime's order
    walked, walk_q = [], []

    def step(logits):  # [B,Vd] → [B] target ids, by inverse CDF of softmax(logits / T)
        probs = torch.softmax(logits.float() / T, -1)
        walk_q.append(probs)
        walked.append(draft_ids[inverse_cdf(probs, torch.rand(B, generator=g))])
        return walked[-1]

    with torch.no_grad():
        hidden = proposer._block_hidden()  # the backbone at every row's anchor (checked above through draft())
        drafter.markov_walk(hidden, proposer.bonus, lambda logits, j: step(logits))
    assert sampled.tolist() == torch.stack(walked, 1).tolist()
    assert torch.allclose(q[:, :, draft_ids], torch.stack(walk_q, 1), atol=1e-6)
    assert not torch.equal(sampled, drafts), "sampling should draft something else than the argmax somewhere"


@pytest.mark.parametrize("adaptive,verification", [(False, "standard"), (True, "standard"), (True, "block")])
def test_sampled_dspark_keeps_the_target_distribution_at_t1(tmp_path, adaptive, verification):
    """T = 1 through the device loop, drafts sampled from the Markov walk: the first two emitted
    tokens follow the target (8-token vocabulary, N rows), with drafts accepted; adaptive
    verification truncates some steps and stays exact (standard and block verification)."""
    hf, rt = eight_token_target(tmp_path)
    prompt, N, k = [1, 2, 3, 4], 6000, 2
    drafter = _dspark(hf, list(range(8)), std=0.5, layers=1)
    proposer = DSparkCachedProposer(drafter, k, N, cache_size([prompt], 3, k), rt.config)
    costs = AdaptiveVerification(_costs(N, k)) if adaptive else None
    outs, stats = generate(rt, [prompt] * N, 3, proposer=proposer, temperature=1.0,
                           generator=torch.Generator().manual_seed(1), adaptive=costs, verification=verification)
    assert sum(n * c for n, c in enumerate(stats.histogram)) > 500  # drafts were accepted
    if adaptive:
        assert stats.verified_drafts is not None and stats.verified_drafts < k * sum(stats.histogram)
    assert_first_two_tokens_follow(hf, prompt, outs, 1.0)
    # the third token, after the most frequent first two: from the first step's second draft or
    # from the second step, as the width chose
    pair = collections.Counter(tuple(o[:2]) for o in outs if len(o) == 3).most_common(1)[0][0]
    third = torch.tensor([o[2] for o in outs if len(o) == 3 and tuple(o[:2]) == pair])
    with torch.no_grad():
        p3 = torch.softmax(hf(torch.tensor([prompt + list(pair)])).logits[0, -1], -1)
    assert third.numel() > 300 and chi_square_p(torch.bincount(third, minlength=8), p3) > 0.01


@pytest.mark.slow
def test_greedy_dspark_equals_plain_on_zoo_prompts(tokenizer):
    """float32, the zoo target, 20 real prompts (MT-bench and ShareGPT, each cut to its last 16-35
    tokens: the end of the question and the assistant's header; the CPU's time goes into the
    target's forwards) in ragged batches of 10: an untrained DSpark drafter's output equals plain
    greedy output, with and without adaptive verification (losslessness needs no trained drafter)."""
    from models.target import Target
    from models.zoo import resolve_target
    from tests.test_speculative import _real_prompts

    path = resolve_target("smollm2-135m-instruct")
    model = RuntimeModel.from_pretrained(path, dtype=torch.float32)
    hf = Target.load(path, []).model
    prompts = [p[-16 - i :] for i, p in enumerate(_real_prompts(tokenizer))]  # each question's end, its turn's header
    assert len({tuple(p) for p in prompts}) == len(prompts) >= 20
    new, k, eos = 4, 2, (tokenizer.eos_token_id,)
    plain = []
    for i in range(0, len(prompts), 10):
        plain.extend(generate(model, prompts[i : i + 10], new, eos_ids=eos)[0])
    drafter = _dspark(hf, list(range(hf.config.vocab_size)), std=0.02, layers=1, rank=16)
    widths = []
    for adaptive in (None, AdaptiveVerification(_costs(10, k, steep=False))):
        got = []
        for i in range(0, len(prompts), 10):
            batch = prompts[i : i + 10]
            n = cache_size(batch, new, k)
            proposer = DSparkCachedProposer(drafter, k, len(batch), n, model.config)
            out, stats = generate(model, batch, new, proposer=proposer, eos_ids=eos, max_len=n, adaptive=adaptive)
            got.extend(out)
            widths.append(stats.verified_drafts)
        assert got == plain, adaptive
    assert widths[:2] == [None] * 2 and all(w is not None for w in widths[2:])


def test_bench_and_generate_run_dspark_with_adaptive_verification(tmp_path, capsys):
    """bench --adaptive-verification measure: a DSpark export gets adaptive rows beside its fixed-k
    ones (batch 1 and 2), still equal to plain; bench.json records the table each used, which is
    also saved as a step_costs.json that generate's flag reads back (its --stats record it). A bad
    table, a proposer without confidences: one error line, exit 2."""
    import json

    from transformers import AutoModelForCausalLM

    from export.dspark import export_dspark
    from inference.bench import main
    from models.zoo import resolve_target

    hf = AutoModelForCausalLM.from_pretrained(resolve_target("tiny-random-llama"), dtype=torch.float32)
    drafter = _dspark(hf, list(range(hf.config.vocab_size)), std=0.02, layers=1, rank=4)
    export_dspark(drafter, tmp_path / "dspark", target_name="tiny-random-llama", dtype=torch.float32)
    out = tmp_path / "bench"
    args = ["--target", "tiny-random-llama", "--num-prompts", "2", "--max-new-tokens", "4", "--device", "cpu", "-k", "2",
            "--drafter", str(tmp_path / "dspark"), "--batch-size", "2", "--hf-prompts", "1"]
    assert main([*args, "--adaptive-verification", "measure", "--out", str(out)]) == 0
    summary = json.loads((out / "bench.json").read_text())
    rows = summary["rows"]
    adaptive = ["runtime DSpark (k=2), adaptive", "runtime DSpark (k=2), adaptive, batch 2"]
    assert {"runtime DSpark (k=2)", "runtime DSpark (k=2), batch 2", *adaptive} <= set(rows), sorted(rows)
    for name in adaptive:
        assert rows[name]["adaptive_verification"] and rows[name]["outputs_equal_runtime_plain"] == rows[name]["prompts"]
        assert 1 <= rows[name]["verified_drafts_per_row_step"] <= 2
        table = StepCosts.from_dict(summary["step_costs"][name])
        assert sorted(table.verify_ms) == ["1", "2"] and len(table.verify_ms["2"]) == 3 and table.draft_ms["1"] > 0
    assert StepCosts.load(out / "step_costs.json") == StepCosts.from_dict(summary["step_costs"][adaptive[0]])
    (tmp_path / "bad.json").write_text("{}")
    capsys.readouterr()
    assert main([*args, "--adaptive-verification", str(tmp_path / "bad.json"), "--out", str(tmp_path / "b2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --adaptive-verification:") and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "b2").exists()
    # generate reads the saved table: the stats record it; a proposer without confidences is refused
    from inference.generate import main as generate_main

    costs = str(out / "step_costs.json")
    assert generate_main(["--target", "tiny-random-llama", "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu",
                          "-k", "2", "--drafter", str(tmp_path / "dspark"), "--adaptive-verification", costs, "--stats"]) == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["adaptive_verification"] and StepCosts.from_dict(stats["step_costs"]) == StepCosts.load(costs)
    assert 1 <= stats["verified_drafts_per_row_step"] <= 2
    assert generate_main(["--target", "tiny-random-llama", "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu",
                          "--proposer", "ngram", "--adaptive-verification", costs]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --adaptive-verification: the ngram proposer estimates no acceptance"), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a GPU (the CPU cases run the same loop)")
def test_graphed_adaptive_loop_equals_the_eager_one_on_a_gpu(small_target):
    """float32 on CUDA: the DSpark proposer's steps and one verify graph per width, replayed, emit
    what the same loop emits eagerly (the same widths: both read the width chosen one step
    earlier, after the first draft's), equal to plain greedy; sampling runs inside the graphs."""
    hf, _, prompts, _ = small_target
    rt = RuntimeModel.from_pretrained(hf.saved_to, device="cuda")
    k, eos, new = 3, (4, 6), 24
    n = cache_size(prompts, new, k)
    plain, _ = generate(rt, prompts, new, eos_ids=eos, max_len=n)
    frequent = collections.Counter(t for o in plain for t in o).most_common(3)
    drafter = _dspark(hf, [t for t, _ in frequent]).cuda()
    adaptive = AdaptiveVerification(_costs(len(prompts), k))
    for setting in (None, adaptive):
        eager, eager_stats = generate(rt, prompts, new, proposer=DSparkCachedProposer(drafter, k, len(prompts), n, rt.config),
                                      eos_ids=eos, max_len=n, cuda_graphs=False, adaptive=setting)
        proposer = DSparkCachedProposer(drafter, k, len(prompts), n, rt.config)
        for call in range(2):  # the second call replays the graphs captured by the first
            graphed, stats = generate(rt, prompts, new, proposer=proposer, eos_ids=eos, max_len=n, adaptive=setting)
            assert stats.graphed and graphed == eager == plain, (setting, call)
        assert stats.row_histograms == eager_stats.row_histograms and stats.verified_drafts == eager_stats.verified_drafts
    outs, stats = generate(rt, prompts, new, proposer=proposer, temperature=1.0, max_len=n, adaptive=adaptive)
    assert stats.device_loop and stats.graphed and all(0 <= t < 12 for o in outs for t in o)
