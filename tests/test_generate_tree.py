"""`python -m inference.generate --tree D,K,N` drafts EAGLE-2 trees with an EAGLE-3 export, as
bench and validate do, and its greedy answer is the target's own greedy answer (float32, CPU)."""
import json

import pytest
import torch

from tests.conftest import run_module


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_target):
    """The tiny target with larger random weights: its greedy answer varies token to token (the
    zoo's tiny target answers one token again and again, which any drafting would match)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("target") / "tiny"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def eagle3_export(tmp_path_factory, target):
    from transformers import AutoConfig

    from export.speculators import export_speculators
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    hf = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    d = Eagle3Drafter(Eagle3Config.from_target(hf, hf.vocab_size))
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("tree") / "eagle3"
    export_speculators(d.eval(), out, target_name=str(target), target_arch=["LlamaForCausalLM"], k=3,
                       dtype=torch.float32)
    return out


def _generate(target, *args):
    res = run_module("inference.generate", "--target", str(target), "--prompt", "Tell me about trees.",
                     "--max-new-tokens", "40", "--device", "cpu", "--stats", *args)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, json.loads(res.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("tree", ["3,2,4", "4,3,9,2"])
def test_generate_tree_equals_plain_greedy(target, eagle3_export, tree):
    plain, _ = _generate(target, "--proposer", "none")
    treed, stats = _generate(target, "--drafter", str(eagle3_export), "--tree", tree)
    assert len(set(plain.split())) > 5, plain  # an answer of many different tokens
    assert treed == plain
    assert stats["k"] == int(tree.split(",")[0]) and stats["draft_seconds"] > 0  # the tree drafted, its depth the k


@pytest.mark.parametrize("args,message", [
    (["--tree", "3,2,4"], "--tree: trees are drafted by a trained drafter"),
    (["--tree", "3,2"], "--tree 3,2: expected DEPTH,TOPK,NODES"),
    (["--tree", "3,2,4", "--proposer", "eagle3", "--drafter", "{export}", "-k", "5"], "-k 5 and --tree 3,2,4"),
    (["--tree", "3,2,4", "--drafter", "{export}", "--temperature", "0.5"], "--tree: trees are drafted for greedy"),
])
def test_generate_tree_bad_input_is_one_line(target, eagle3_export, args, message):
    args = [a.replace("{export}", str(eagle3_export)) for a in args]
    res = run_module("inference.generate", "--target", str(target), "--prompt", "x", *args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr
