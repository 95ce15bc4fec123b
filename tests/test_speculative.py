import random

import pytest
import torch

from inference.runtime.engine import generate
from inference.runtime.model import RuntimeModel
from inference.proposers import NgramProposer, SuffixProposer, longest_suffix_match
from inference.runtime.verify import NO_DRAFT, greedy_verify


def _logits_choosing(tokens, V=11):
    """Stub target: logits whose argmax at each slot is the given token."""
    tokens = torch.as_tensor(tokens)
    out = torch.zeros(*tokens.shape, V)
    out.scatter_(-1, tokens[..., None], 1.0)
    return out


def test_greedy_verify_never_always_sometimes():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [NO_DRAFT, NO_DRAFT, NO_DRAFT]])
    target = _logits_choosing([[5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    accepted, bonus = greedy_verify(drafts, target)
    assert accepted.tolist() == [0, 3, 1, 0]
    assert bonus.tolist() == [5, 4, 2, 1]


def _naive_match(tokens, min_n, max_n):
    L = len(tokens)
    for m in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - m :]
        for start in range(L - m - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start : start + m] == suffix:
                return m, start + m
    return 0, -1


def test_longest_suffix_match_equals_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert longest_suffix_match(tokens, lo, hi) == _naive_match(tokens, lo, hi), tokens


def test_ngram_proposer_continues_the_earlier_occurrence():
    p = NgramProposer(k=3, min_n=2, max_n=3)
    assert p.propose_row([1, 2, 3, 9, 8, 7, 1, 2, 3]) == [9, 8, 7]
    assert p.propose([[4, 5, 6], [1, 2, 1, 2]]) == [[], [1, 2]]


def _real_prompts(tokenizer, n_mt=10, n_share=10):
    from data.chat import encode_prompt
    from data.sources import load_conversations, load_prompts

    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in load_prompts("mt-bench")[:n_mt]]
    for conv in load_conversations("sharegpt", limit=40)[:n_share]:
        first_user = next(m for m in conv if m["role"] == "user")
        prompts.append(encode_prompt(tokenizer, [{"role": "user", "content": first_user["content"][:600]}]))
    return prompts


@pytest.mark.slow
def test_lossless_greedy_on_real_prompts_with_ragged_batches(tokenizer, zoo_plain_greedy):
    """float32, zoo target: speculative output == plain greedy output, token for token, on 12
    ragged prompts (6 MT-bench, 6 ShareGPT; 20 took 2-4 minutes of CI's 2 cores) served 1, 4 and 7
    at a time. Plain greedy's outputs (16 new tokens) are the session's (conftest zoo_plain_greedy)."""
    from models.zoo import resolve_target

    model = RuntimeModel.from_pretrained(resolve_target("smollm2-135m-instruct"), dtype=torch.float32)
    every, every_plain = zoo_plain_greedy
    pick = [*range(6), *range(10, 16)]  # the first 10 prompts are MT-bench's, the next 10 ShareGPT's
    prompts, plain = [every[i] for i in pick], [every_plain[i] for i in pick]
    eos = (tokenizer.eos_token_id,)
    suffix = SuffixProposer(k=4)  # one instance: its global cache grows across batches
    for batch, k, make in ((1, 4, lambda k: NgramProposer(k=k, max_n=3)), (4, 4, lambda k: NgramProposer(k=k, max_n=3)),
                           (7, 1, lambda k: NgramProposer(k=k, max_n=3)), (4, 4, lambda k: suffix)):
        got, accepted = [], 0
        for i in range(0, len(prompts), batch):
            out, stats = generate(model, prompts[i : i + batch], 16, proposer=make(k), eos_ids=eos)
            got.extend(out)
            accepted += sum(n * c for n, c in enumerate(stats.histogram))
        assert got == plain, f"batch {batch}, k {k}"
        assert accepted > 0, "the n-gram proposer had drafts accepted, so verification was exercised"
    assert sum(len(o) for o in plain) > 12 * 5


def test_plain_runtime_greedy_equals_transformers_generate(tiny_target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (3, 11, 7)]
    ours, _ = generate(rt, prompts, 12)
    for p, o in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ref[0, len(p):].tolist() == o


def test_prompt_longer_than_cache_is_a_clear_error(tiny_target):
    rt = RuntimeModel.from_pretrained(tiny_target)
    with pytest.raises(ValueError, match="exceeds the cache"):
        generate(rt, [[1] * 50], 10, max_len=32)


def test_suffix_proposer_follows_the_most_frequent_continuation_and_adapts_length():
    p = SuffixProposer(k=6, factor=1.0)
    # in the prompt, "1 2" is followed by 3 twice and by 4 once
    p.begin([[1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 9, 7]], None, [1])
    assert p.propose([[1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 9, 7, 1, 2]]) == [[3, 9]]  # match "1 2": 2 tokens at most
    q = SuffixProposer(k=6, factor=1.0)
    q.begin([[5, 6, 7, 8, 10, 11, 5, 6, 7]], None, [8])
    assert q.propose([[5, 6, 7, 8, 10, 11, 5, 6, 7, 8]]) == [[10, 11, 5, 6]]  # match of 4: 4 tokens


def test_suffix_match_leaves_room_for_k_tokens_below_it():
    """The trie holds substrings up to `depth` tokens: the longest match (5 of depth 6) would
    leave one token of continuation, so the match is capped at depth - k and k tokens follow."""
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5]
    q = SuffixProposer(k=3, depth=6)
    q.begin([context[:-1]], None, [5])
    assert q.propose([context]) == [[6, 7, 8]]


def test_suffix_proposer_global_cache_serves_later_requests():
    p = SuffixProposer(k=4)
    p.begin([[100, 101]], None, [1])
    assert p.propose([[100, 101, 1, 2, 3]]) == [[]]
    p.end([[1, 2, 3, 4, 5, 6]])
    p.begin([[200]], None, [1])
    assert p.propose([[200, 1, 2, 3]]) == [[4, 5, 6]]


def test_prometheus_counters_follow_the_histogram():
    from inference.runtime.engine import GenerationStats

    stats = GenerationStats(k=3, histogram=[2, 1, 0, 4], new_tokens=25)
    text = stats.prometheus()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines["draftsmith_spec_decode_num_drafts_total"] == "7"
    assert lines["draftsmith_spec_decode_num_draft_tokens_total"] == "21"
    assert lines["draftsmith_spec_decode_num_accepted_tokens_total"] == str(1 * 1 + 3 * 4)
    assert lines['draftsmith_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == "5"
    assert lines['draftsmith_spec_decode_num_accepted_tokens_per_pos_total{position="3"}'] == "4"
    assert "# TYPE draftsmith_spec_decode_num_drafts_total counter" in text


def test_draft_length_table():
    from inference.runtime.engine import draft_length

    table = [[1, 4, 5], [5, 16, 2], [17, 1024, 0]]
    assert [draft_length(table, b, 5) for b in (1, 4, 5, 16, 17, 2000)] == [5, 5, 2, 2, 0, 5]
    with pytest.raises(ValueError, match="beyond the proposer's 3"):
        draft_length(table, 1, 3)
    with pytest.raises(ValueError, match="must be \\[min_bs, max_bs, k\\]"):
        draft_length([[4, 1, 2]], 2, 5)


def test_k_table_changes_the_draft_length_and_stays_lossless(tiny_target):
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(2)
    base = torch.randint(0, 40000, (6,)).tolist()
    prompts = [base * 3, base * 2 + [7]]  # repetitive: n-gram drafts something
    plain, _ = generate(rt, prompts, 12)
    out, stats = generate(rt, prompts, 12, proposer=NgramProposer(k=4), k_table=[[1, 1, 4], [2, 8, 2]])
    assert out == plain and stats.k == 2 and len(stats.histogram) == 3
    out, stats = generate(rt, prompts, 12, proposer=NgramProposer(k=4), k_table=[[2, 8, 0]])
    assert out == plain and stats.k == 0


def test_device_side_plain_loop_equals_the_per_token_loop(tiny_target):
    """The sync-free plain greedy loop emits what the general loop emits, EOS cuts included."""
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(4)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (3, 11, 6)]
    free_run, _ = generate(rt, prompts, 40, fast_plain=False)
    eos = (free_run[1][5], free_run[2][20])  # tokens that do occur: rows end at different steps
    slow, _ = generate(rt, prompts, 40, eos_ids=eos, fast_plain=False)
    fast, stats = generate(rt, prompts, 40, eos_ids=eos)
    assert fast == slow
    assert len(fast[1]) <= 6 and fast[1][-1] in eos and stats.new_tokens == sum(map(len, fast))
    assert generate(rt, prompts, 40)[0] == free_run


def test_draft_model_proposer_same_vocabulary(tiny_target, tmp_path):
    """The target drafting for itself accepts everything; another model with the same
    vocabulary stays lossless; both keep their KV cache in step with acceptance."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.proposers import DraftModelProposer

    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(5)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (4, 11, 7)]
    plain, _ = generate(rt, prompts, 20)
    own = DraftModelProposer(rt, 3, 3, 64, rt.config)
    spec, stats = generate(rt, prompts, 20, proposer=own)
    assert spec == plain and stats.summary()["acceptance"]["a"][0] == 1.0
    cfg = LlamaConfig(vocab_size=rt.config.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    other = RuntimeModel.from_pretrained(tmp_path)
    spec, _ = generate(rt, prompts, 20, proposer=DraftModelProposer(other, 4, 3, 64, rt.config))
    assert spec == plain


def test_draft_model_across_vocabularies(tiny_target, tokenizer, tmp_path):
    """A draft model with its own word-level vocabulary: drafts mapped by token string,
    unmapped drafts end the chain, output stays lossless."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from inference.proposers import DraftModelProposer, vocab_intersection

    words = ["[UNK]", "the", "a", "cat", "zzzqqq", "Hello", "world"]
    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = Whitespace()
    draft_tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    mapping = vocab_intersection(tokenizer, draft_tok)
    target_vocab = tokenizer.get_vocab()
    for w, i in draft_tok.get_vocab().items():
        assert int(mapping[i]) == target_vocab.get(w, -1)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    draft = RuntimeModel.from_pretrained(tmp_path)
    rt = RuntimeModel.from_pretrained(tiny_target)
    prompts = [tokenizer("Hello world the cat")["input_ids"], tokenizer("a cat")["input_ids"]]
    proposer = DraftModelProposer(draft, 3, 2, 64, rt.config, target_tokenizer=tokenizer, draft_tokenizer=draft_tok)
    drafted = proposer.propose(prompts)
    mapped = set(mapping[mapping >= 0].tolist())
    for row in drafted:
        assert len(row) == 3 and all(t in mapped or t == NO_DRAFT for t in row)
        assert row == row[: sum(t != NO_DRAFT for t in row)] + [NO_DRAFT] * (3 - sum(t != NO_DRAFT for t in row))
    assert generate(rt, prompts, 12, proposer=proposer)[0] == generate(rt, prompts, 12)[0]


def test_vectorised_ngram_drafts_equal_the_kmp_proposer():
    from inference.proposers.model_free import GpuNgramProposer, ngram_drafts

    rng = random.Random(1)
    rows = [[rng.randrange(6) for _ in range(rng.randint(1, 40))] for _ in range(300)]
    cpu = NgramProposer(5, min_n=2, max_n=4)
    S = 48
    buffer = torch.full((len(rows), S), 99)
    for b, r in enumerate(rows):
        buffer[b, : len(r)] = torch.tensor(r)
    got = ngram_drafts(buffer, torch.tensor([len(r) for r in rows]), 5, 2, 4).tolist()
    for r, g in zip(rows, got):
        want = cpu.propose_row(r)
        assert g == want + [-1] * (5 - len(want)), (r, g, want)
    # through the engine: lossless, same drafts as the CPU proposer
    gpu = GpuNgramProposer(3, 2, 64)
    assert gpu.propose([[1, 2, 3, 1, 2], [4, 4, 4]]) == [[3, 1, 2], [4, -1, -1]]


@pytest.mark.slow
def test_every_proposer_is_lossless_on_real_prompts_with_the_zoo_target(tokenizer, zoo_plain_greedy):
    """float32, zoo target, 10 real prompts (MT-bench and ShareGPT) in ragged batches of 5: each
    proposer's output equals plain greedy output. Drafters are freshly initialised from the target (random
    where they train), so this checks verification and bookkeeping, not acceptance."""
    from transformers import AutoConfig

    from inference.proposers import DraftModelProposer, GpuNgramProposer, drafter_proposer
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.eagle1 import Eagle1Config, Eagle1Drafter
    from models.medusa import MedusaConfig, MedusaDrafter
    from models.mtp import MTPConfig, MTPDrafter
    from models.target import Target
    from models.zoo import resolve_target

    path = resolve_target("smollm2-135m-instruct")
    model = RuntimeModel.from_pretrained(path, dtype=torch.float32)
    hf_cfg = AutoConfig.from_pretrained(path)
    target = Target.load(path, [])
    V = hf_cfg.vocab_size
    keep_all = (torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    torch.manual_seed(0)
    drafters = {
        "eagle1": Eagle1Drafter(Eagle1Config.from_target(hf_cfg, V)),
        "medusa": MedusaDrafter(MedusaConfig.from_target(hf_cfg, V, 3)),
        "mtp": MTPDrafter(MTPConfig.from_target(hf_cfg, V, 3)),
        "dflash": DFlashDrafter(DFlashConfig.from_target(hf_cfg, V, 0, num_layers=1, block_size=4)),
    }
    for d in drafters.values():
        for name, p in d.named_parameters():
            if p.requires_grad and p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
        d.init_from_target(target.model, *keep_all)
        d.eval()
    # 10 prompts (20 took 3-6 minutes of CI's 2 cores): the session's first batch of MT-bench prompts and
    # first of ShareGPT's, whose plain greedy outputs (16 new tokens) cut at 12 are plain greedy's for 12
    every, every_plain = zoo_plain_greedy
    prompts = every[:5] + every[10:15]
    plain = [o[:12] for o in every_plain[:5] + every_plain[10:15]]
    eos = (tokenizer.eos_token_id,)
    makers = {name: (lambda b, n, d=d: drafter_proposer(d, 3, b, n, model.config)) for name, d in drafters.items()}
    makers["ngram-gpu"] = lambda b, n: GpuNgramProposer(3, b, n, max_n=3)
    makers["draft-model (the target itself)"] = lambda b, n: DraftModelProposer(model, 3, b, n, model.config)
    for name, make in makers.items():
        got = []
        for i in range(0, len(prompts), 5):
            batch = prompts[i : i + 5]
            n = max(len(p) for p in batch) + 12 + 4
            got.extend(generate(model, batch, 12, proposer=make(len(batch), n), eos_ids=eos, max_len=n)[0])
        assert got == plain, name
