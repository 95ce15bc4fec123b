"""Every launch line the project prints, run through the servers' own argument code (issue 52).

Lines come from README.md and docs/*.md (fenced blocks: `python -m sglang.launch_server ...`,
`vllm serve ...`, backslash continuations joined) and from what `python -m export` prints after
an export (export.formats.launch_lines). Each is resolved by the released server's code:

- SGLang 0.5.23: `prepare_server_args` and the speculative hook (tests/sglang_args.py says
  what of the wheel is imported and what is replaced). A chain drafter must resolve to top-k 1
  with k + 1 draft tokens (the trained k for an export's own lines), DFLASH to the export's block.
- vLLM 0.33: its argument parser and speculative config resolution (tests/vllm_args.py), where
  the wheel is in the draftsmith cache (`$DRAFTSMITH_CACHE/wheels/vllm-0.33.0-*.whl`; 336 MB,
  so it is not fetched here).

The SGLang wheel (and msgspec, which its argument records are made of) is installed alone
(`pip --no-deps`) into the draftsmith cache once; the tests skip, saying why, only when that
cannot be done (no registry)."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import package_alone

ROOT = Path(__file__).parent.parent
SGLANG = ("sglang==0.5.23", "msgspec==0.23.0")
SGLANG_PREFIX = ["python", "-m", "sglang.launch_server"]
CHAIN = ("EAGLE", "EAGLE3")
# the lines the README printed before issue 52 (each must fail here)
OLD_SGLANG_LINES = [
    "python -m sglang.launch_server --model-path HuggingFaceTB/SmolLM2-135M-Instruct --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path exports/eagle3-sglang --speculative-num-steps 7",
    "python -m sglang.launch_server --model-path HuggingFaceTB/SmolLM2-135M-Instruct --speculative-algorithm EAGLE "
    "--speculative-draft-model-path exports/eagle1",
]


def documented_lines(first_words: list[str]) -> list[tuple[str, str]]:
    """(file, line) of every command in a fenced block of README.md and docs/*.md that starts
    with `first_words`, continuation lines joined and a trailing # comment dropped."""
    found = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", md.read_text(), flags=re.S):
            for command in re.sub(r"\\\n\s*", " ", block).splitlines():
                try:
                    words = shlex.split(command, comments=True)
                except ValueError:
                    continue
                if words[: len(first_words)] == first_words:
                    found.append((md.name, shlex.join(words)))
    return found


def option(words: list[str], name: str):
    return words[words.index(name) + 1] if name in words else None


# ---------------------------------------------------------------- exports and a target where a line names them
def _hf_config(layers: int = 6):
    from transformers import AutoConfig

    from models.zoo import resolve_target

    config = AutoConfig.from_pretrained(resolve_target("tiny-random-llama"))
    config.num_hidden_layers = layers  # room for aux / target layer ids below the last layer
    return config


def write_drafter(kind: str, folder: Path, *, target: str, k: int = 5, draft_vocab: int | None = None,
                  block_size: int = 4, layout: str | None = None) -> Path:
    """A tiny export of `kind` (an SGLang algorithm or a vLLM method) at `folder`, trained-for k
    (layout: another than the kind's own)."""
    from export.formats import write_export
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.eagle1 import Eagle1Config, Eagle1Drafter
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    hf = _hf_config()
    V = hf.vocab_size
    vd = draft_vocab or V
    method, fmt, drafter = {
        "EAGLE3": lambda: ("eagle3", "sglang", Eagle3Drafter(Eagle3Config.from_target(hf, vd))),
        "EAGLE": lambda: ("eagle1", "eagle", Eagle1Drafter(Eagle1Config.from_target(hf, vd))),
        "DFLASH": lambda: ("dflash", "dflash", DFlashDrafter(DFlashConfig.from_target(
            hf, V, 3, num_layers=1, block_size=block_size, target_layer_ids=[0, 2]))),
        "eagle3": lambda: ("eagle3", "speculators", Eagle3Drafter(Eagle3Config.from_target(hf, vd))),
        "eagle": lambda: ("eagle1", "eagle-vllm", Eagle1Drafter(Eagle1Config.from_target(hf, V, fc_bias=False))),
        "dflash": lambda: ("dflash", "dflash", DFlashDrafter(DFlashConfig.from_target(
            hf, V, 3, num_layers=1, block_size=block_size, target_layer_ids=[0, 2]))),
    }[kind]()
    if vd < V:  # a draft vocabulary: rows at sorted random target ids
        ids = torch.sort(torch.randperm(V)[:vd]).values
        drafter.d2t.copy_(ids - torch.arange(vd))
        drafter.t2d.zero_().index_fill_(0, ids, True)
    write_export(drafter, layout or fmt, folder, method=method, target_name=target, hf_config=hf, target_model=None, joint=False,
                 k=k, provenance={"target": target, "training_config": {"eval": {"k": k}}}, dtype=torch.float32)
    return folder


def place_target(path: Path) -> None:
    """A target config at `path` (a line's hub id, as a folder relative to the line's cwd)."""
    path.mkdir(parents=True, exist_ok=True)
    _hf_config().save_pretrained(path)


# ---------------------------------------------------------------- SGLang
@pytest.fixture(scope="module")
def sglang_path():
    return os.pathsep.join(str(package_alone(req)) for req in SGLANG)


def run_sglang(lines: list[str], cwd: Path, path: str) -> list[dict]:
    (cwd / "lines.json").write_text(json.dumps(lines))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(ROOT)])}
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "sglang_args.py"), "lines.json"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def sglang_problems(result: dict, k: int | None = None, block: int | None = None) -> list[str]:
    """Why SGLang would not serve the line as draftsmith trained the drafter (empty: it would)."""
    if "error" in result:
        return [f"SGLang's argument code raises {result['error']}: {result['message']}"]
    algorithm, steps = result["speculative_algorithm"], result["speculative_num_steps"]
    topk, tokens = result["speculative_eagle_topk"], result["speculative_num_draft_tokens"]
    problems = []
    if algorithm in CHAIN:
        if topk != 1:
            problems.append(f"top-k resolves to {topk}: a tree, not the chain draftsmith trained")
        if tokens != steps + 1:
            problems.append(f"{tokens} draft tokens for {steps} steps (a chain verifies steps + 1)")
        if k is not None and steps != k:
            problems.append(f"{steps} steps, the drafter was trained for k = {k}")
    elif algorithm == "DFLASH":
        if block is not None and tokens != block:
            problems.append(f"{tokens} draft tokens, the drafter's block is {block}")
    else:
        problems.append(f"algorithm {algorithm}")
    return problems


def _sglang_workspace(lines: list[str], cwd: Path) -> None:
    """The target and the drafter each line names, at the (relative) paths it names them."""
    for line in lines:
        words = shlex.split(line)
        model, draft = option(words, "--model-path"), option(words, "--speculative-draft-model-path")
        assert model and draft and not Path(model).is_absolute() and not Path(draft).is_absolute(), line
        if not (cwd / model).exists():
            place_target(cwd / model)
        if not (cwd / draft).exists():
            vd = 512 if "--speculative-token-map" in words else None
            write_drafter(option(words, "--speculative-algorithm"), cwd / draft, target=model, draft_vocab=vd)


def test_documented_sglang_lines_resolve_to_what_draftsmith_trained(sglang_path, tmp_path):
    documented = documented_lines(SGLANG_PREFIX)
    algorithms = {option(shlex.split(line), "--speculative-algorithm") for _, line in documented}
    assert {"EAGLE3", "EAGLE", "DFLASH"} <= algorithms, documented  # every layout SGLang serves is shown
    lines = [line for _, line in documented]
    _sglang_workspace(lines, tmp_path)
    results = run_sglang(lines, tmp_path, sglang_path)
    problems = {f"{src}: {line}": sglang_problems(r) for (src, line), r in zip(documented, results)}
    assert not any(problems.values()), {line: p for line, p in problems.items() if p}


def test_the_old_sglang_lines_fail_here(sglang_path, tmp_path):
    _sglang_workspace(OLD_SGLANG_LINES, tmp_path)
    eagle3, eagle1 = run_sglang(OLD_SGLANG_LINES, tmp_path, sglang_path)
    # speculative_hook.py:1274 compares top-k (None when --speculative-num-steps is given alone) with 1
    assert eagle3.get("error") == "TypeError" and "NoneType" in eagle3["message"], eagle3
    assert any("top-k resolves to 4" in p for p in sglang_problems(eagle1)), eagle1  # SGLang's auto tree for Llama


@pytest.mark.parametrize("kind,vd", [("EAGLE3", 512), ("EAGLE", None), ("EAGLE", 512), ("DFLASH", None)])
def test_an_exports_printed_sglang_line_serves_it_as_trained(sglang_path, tmp_path, kind, vd):
    from export.formats import launch_lines

    place_target(tmp_path / "target")
    write_drafter(kind, tmp_path / "export", target=str(tmp_path / "target"), k=5, draft_vocab=vd, block_size=4)
    lines = [line for line in launch_lines(tmp_path / "export") if shlex.split(line)[:3] == SGLANG_PREFIX]
    assert len(lines) == 1, launch_lines(tmp_path / "export")
    (result,) = run_sglang(lines, tmp_path, sglang_path)
    assert sglang_problems(result, k=None if kind == "DFLASH" else 5, block=4 if kind == "DFLASH" else None) == []
    assert result["speculative_algorithm"] == kind and result["speculative_draft_model_path"] == str(tmp_path / "export")
    token_map = result["speculative_token_map"]
    if kind == "EAGLE" and vd:  # SGLang's EAGLE-1 drafts over all of V unless given the draft rows' target ids
        from safetensors.torch import load_file

        ids = torch.load(token_map, weights_only=True)  # as SGLang's load_token_map reads it
        d2t = load_file(str(tmp_path / "export" / "model.safetensors"))["d2t"]
        assert ids.dtype == torch.int64 and torch.equal(ids, torch.arange(vd) + d2t)  # row i drafts target i + d2t[i]
    else:
        assert token_map is None


# ---------------------------------------------------------------- vLLM (where its wheel is in the cache)
VLLM_PREFIX = ["vllm", "serve"]


@pytest.fixture(scope="module")
def vllm_path():
    """vLLM 0.33.0's Python sources, unpacked once from its wheel in the draftsmith cache (and
    cachetools, which its config module subclasses)."""
    import zipfile

    from models.zoo import cache_dir, file_lock

    wheels = sorted((cache_dir() / "wheels").glob("vllm-0.33.0-*.whl"))
    if not wheels:
        pytest.skip(f"vllm 0.33.0's wheel is not in {cache_dir() / 'wheels'} (pip download --no-deps vllm==0.33.0 -d there)")
    site = cache_dir() / "vllm-0.33.0-py"
    with file_lock("vllm-0.33.0-py"):
        if not site.is_dir():
            tmp = site.with_name(site.name + ".part")
            shutil.rmtree(tmp, ignore_errors=True)
            with zipfile.ZipFile(wheels[0]) as zf:
                zf.extractall(tmp, [n for n in zf.namelist() if n.endswith(".py") or ".dist-info/" in n])
            tmp.rename(site)
    return os.pathsep.join([str(site), str(package_alone("cachetools==8.0.3"))])


def run_vllm(lines: list[str], cwd: Path, path: str) -> list[dict]:
    (cwd / "lines.json").write_text(json.dumps(lines))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(ROOT)])}
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_args.py"), "lines.json"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


VLLM_ARCH = {"eagle3": "Eagle3LlamaForCausalLM", "eagle": "EagleLlamaForCausalLM", "dflash": "DFlashDraftModel"}


def vllm_problems(result: dict, k: int | None = None) -> list[str]:
    if "error" in result:
        return [f"vLLM's config resolution raises {result['error']}: {result['message']}"]
    problems = []
    if result["draft_architecture"] != VLLM_ARCH.get(result["method"]):
        problems.append(f"method {result['method']} builds {result['draft_architecture']}")
    if k is not None and result["num_speculative_tokens"] != k:
        problems.append(f"{result['num_speculative_tokens']} speculative tokens, the drafter drafts {k}")
    return problems


def _vllm_workspace(lines: list[str], cwd: Path) -> None:
    for line in lines:
        words = shlex.split(line)
        spec = json.loads(option(words, "--speculative-config") or "{}")
        if not spec:
            continue
        if not (cwd / words[2]).exists():
            place_target(cwd / words[2])
        if not (cwd / spec["model"]).exists():
            write_drafter(spec["method"], cwd / spec["model"], target=words[2])


def test_documented_vllm_lines_resolve_in_vllm(vllm_path, tmp_path):
    documented = documented_lines(VLLM_PREFIX)
    methods = {json.loads(option(shlex.split(line), "--speculative-config") or "{}").get("method") for _, line in documented}
    assert {"eagle3", "eagle", "dflash"} <= methods, documented
    lines = [line for _, line in documented]
    _vllm_workspace(lines, tmp_path)
    problems = {f"{src}: {line}": vllm_problems(r) for (src, line), r in zip(documented, run_vllm(lines, tmp_path, vllm_path))}
    assert not any(problems.values()), {line: p for line, p in problems.items() if p}


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "dflash", "DFLASH"])
def test_an_exports_printed_vllm_line_serves_it_with_a_local_target(vllm_path, tmp_path, kind):
    from export.formats import launch_lines

    place_target(tmp_path / "target")
    layout = "speculators" if kind == "DFLASH" else None  # DFlash in the speculators layout
    write_drafter(kind.lower(), tmp_path / "export", target=str(tmp_path / "target"), k=5, block_size=4, layout=layout)
    lines = [line for line in launch_lines(tmp_path / "export") if shlex.split(line)[:2] == VLLM_PREFIX]
    assert len(lines) == 1
    (result,) = run_vllm(lines, tmp_path, vllm_path)
    assert vllm_problems(result, k=3 if kind.lower() == "dflash" else 5) == [], result
    assert result["model"] == str(tmp_path / "target")


def test_the_old_vllm_line_fails_here_with_a_local_target(vllm_path, tmp_path):
    place_target(tmp_path / "target")
    write_drafter("eagle3", tmp_path / "exports" / "eagle3", target=str(tmp_path / "target"))
    (result,) = run_vllm(["vllm serve exports/eagle3"], tmp_path, vllm_path)
    assert result.get("error") == "ValueError" and "remote model repository" in result["message"], result


def printed_lines(stdout: str) -> list[str]:
    """The commands `python -m export` prints under "serve it with:"."""
    lines = stdout.splitlines()
    start = lines.index("serve it with:") + 1
    return [line.strip() for line in lines[start:] if line.startswith("  ")]


def test_what_python_m_export_prints_resolves_in_sglang(sglang_path, tmp_path):
    from tests.conftest import make_conversations, run_module, tiny_overrides
    from train.config import load_config
    from train.run import run

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))
    run(load_config(None, tiny_overrides(str(chat), tmp_path / "run", **{"trainer.max_steps": 2,
                                                                          "trainer.precision": "32-true"})))
    res = run_module("export.__main__", "--checkpoint", str(tmp_path / "run"), "--format", "sglang", "--out", str(tmp_path / "s"))
    assert res.returncode == 0, res.stderr[-2000:]
    lines = printed_lines(res.stdout)
    assert len(lines) == 1 and shlex.split(lines[0])[:3] == SGLANG_PREFIX, res.stdout
    (result,) = run_sglang(lines, tmp_path, sglang_path)
    assert sglang_problems(result, k=3) == []  # tiny_overrides trains for eval.k = 3
