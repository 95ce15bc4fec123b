"""Shared fixtures: a tiny random Llama with the real tokenizer, and small chat files."""
from __future__ import annotations

import json
import os
import random
import warnings

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on the CPU through the interpreter where there is no GPU (CI); this must
# be set before triton is first imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # pytest-xdist workers (`-n N`) share the cores: each takes its share of torch's threads
    # rather than all of them (N workers x all cores oversubscribes a 2-core CI machine)
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
except ImportError:
    pass
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


def pytest_addoption(parser):
    parser.addoption("--rehearse-recipes", action="store_true",
                     help="also run the `rehearse` tests: every recipe end to end (minutes per recipe on 2 cores)")


def pytest_collection_modifyitems(config, items):
    """`rehearse` tests are skipped unless --rehearse-recipes asks for them (a command-line
    choice, not a variable of the environment)."""
    if config.getoption("--rehearse-recipes"):
        return
    skip = pytest.mark.skip(reason="minutes per recipe on 2 cores: run with --rehearse-recipes")
    for item in items:
        if "rehearse" in item.keywords:
            item.add_marker(skip)


def kernel_device() -> str:
    """Where the Triton kernels run: "cuda", or "cpu" under TRITON_INTERPRET=1; skips otherwise."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    return "cpu"


@pytest.fixture(scope="session")
def tiny_target() -> str:
    from models.zoo import resolve_target

    return resolve_target("tiny-random-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


WORDS = ("the model drafts tokens and the target verifies them in one pass so decoding gets faster "
         "when the drafts agree with what the target would have said anyway").split()


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = []
        for turn in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": f"question {i}.{turn}: " + " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))})
            msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))})
        rows.append({"messages": msgs})
    return rows


@pytest.fixture()
def chat_file(tmp_path) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(120)))
    return str(path)


@pytest.fixture(autouse=True)
def _isolated_dataset_cache(tmp_path_factory, monkeypatch):
    """Datasets tokenized by tests go to a per-session folder; the zoo cache is shared."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


def tiny_overrides(chat_file: str, out_dir, **extra) -> list[str]:
    base = {
        "target": "tiny-random-llama", "data.dataset": chat_file, "data.max_length": 96,
        "data.batch_size": 4, "data.num_workers": 0, "data.heldout_fraction": 0.1,
        "drafter.draft_vocab_size": 256, "objective.ttt_steps": 3, "eval.k": 3,
        "eval.num_sequences": 4, "eval.anchors_per_sequence": 8, "eval.every_n_steps": 4,
        "checkpoint_every_n_steps": 3, "trainer.max_steps": 6, "trainer.accelerator": "cpu",
        "trainer.enable_progress_bar": False, "trainer.logger": False, "out_dir": str(out_dir),
    }
    base.update(extra)
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in base.items()]


def train_at_once(*runs, one_thread: bool = False, env: dict | None = None):
    """Independent training runs (each a list of arguments) started together, each of which must
    exit 0: a run is mostly one busy core (imports, a tiny model) with waits between its ranks, so
    two at once on CI's 2 cores take about as long as one. one_thread: each process computes on
    one thread, as Lightning already gives each rank of a 2-process run on 2 cores (two
    one-process runs of two threads each on 2 cores spent the time saved spinning on each
    other's cores). env: variables set for the runs."""
    import subprocess
    import sys
    import tempfile

    started = []
    for args in runs:
        err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: no run waits on a full pipe
        variables = {**os.environ, **(env or {}), **({"OMP_NUM_THREADS": "1"} if one_thread else {})}
        started.append((subprocess.Popen([sys.executable, "-m", "train", *args], stdout=subprocess.DEVNULL, stderr=err,
                                         text=True, env=variables), err))
    for proc, err in started:
        proc.wait(timeout=600)
    for proc, err in started:
        err.seek(0)
        assert proc.returncode == 0, err.read()[-3000:]
        err.close()


@pytest.fixture(scope="session")
def two_process_runs(tmp_path_factory):
    """The tiny recipe trained 4 steps (checkpoints every 2) on two gloo processes, with
    trainer.strategy=ddp and with trainer.strategy=fsdp, both at once, once a session for the tests
    that compare or resume them (tests/test_distributed.py, tests/test_fsdp.py): (overrides, runs)
    with runs {"ddp": folder, "fsdp": folder} and overrides(out_dir) the arguments they were
    trained with for another out_dir. Tests resume copies and leave these folders as they are."""
    root = tmp_path_factory.mktemp("two_process_runs")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(120)))

    def overrides(out_dir):
        return tiny_overrides(str(chat), out_dir, **{"trainer.max_steps": 4, "checkpoint_every_n_steps": 2})

    runs = {name: root / name for name in ("ddp", "fsdp")}
    # (the autouse dataset-cache fixture below is a test's, not yet set for a session fixture)
    train_at_once(*([*overrides(out), f"trainer.strategy={name}", "trainer.devices=2"] for name, out in runs.items()),
                  env={"HF_DATASETS_CACHE": str(tmp_path_factory.getbasetemp() / "hf_datasets")})
    return overrides, runs


@pytest.fixture(scope="session")
def zoo_plain_greedy(tokenizer):
    """The zoo target's (smollm2-135m-instruct, float32) plain greedy decoding of the 20 real
    prompts (tests/test_speculative.py `_real_prompts`), 16 new tokens in ragged batches of 5,
    ending at the tokenizer's EOS: (prompts, outputs), computed once for the lossless tests on real
    prompts that compare against this same reference (the tree's, EAGLE-3's, the ragged batches' and
    every proposer's: tests/test_speculative.py, on some of the prompts)."""
    import torch

    from inference.runtime.engine import generate
    from inference.runtime.model import RuntimeModel
    from models.zoo import resolve_target
    from tests.test_speculative import _real_prompts

    rt = RuntimeModel.from_pretrained(resolve_target("smollm2-135m-instruct"), dtype=torch.float32)
    prompts = _real_prompts(tokenizer)
    plain = []
    for i in range(0, len(prompts), 5):
        plain.extend(generate(rt, prompts[i : i + 5], 16, eos_ids=(tokenizer.eos_token_id,))[0])
    return prompts, plain


def package_alone(requirement: str):
    """A package with pins draftsmith does not share, installed alone (`pip --no-deps`) into the
    draftsmith cache once, for a test to import in a subprocess: its folder, or a skip saying
    why it could not be installed (no registry)."""
    import subprocess
    import sys

    from models.zoo import cache_dir

    site = cache_dir() / requirement.replace("==", "-")
    if not site.is_dir():
        tmp = site.with_name(site.name + f".tmp{os.getpid()}")
        res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp),
                              requirement], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            pytest.skip(f"{requirement} could not be installed here: {res.stderr.strip().splitlines()[-1:]}")
        tmp.rename(site)
    return site


def overfit_one_batch(module, drafter, steps: int, rows: int = 2, length: int = 20, vocab: int = 40000,
                      reseed: int | None = None) -> tuple[dict, list[float]]:
    """A DrafterModule's training step repeated on one random batch (AdamW, lr 3e-3, the
    drafter's trainable parameters): (the batch, the loss at each step). reseed: the seed set
    before every step (methods that draw anchors see the same ones each time)."""
    import torch

    module.log = lambda *a, **k: None
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (rows, length)), "loss_mask": torch.ones(rows, length, dtype=torch.long),
             "lengths": torch.tensor([length] * rows)}
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        if reseed is not None:
            torch.manual_seed(reseed)
        opt.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return batch, losses


def interrupt_training_at(monkeypatch, step: int):
    """The next `train.run` stops at `step` as Ctrl-C would (a KeyboardInterrupt in the batch
    loop). Returns a function that puts the real trainer back."""
    import lightning as L

    import train.run as run_mod

    class StopAt(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == step:
                raise KeyboardInterrupt

    real_build = run_mod.build_trainer

    def interrupted(cfg, out_dir):
        trainer = real_build(cfg, out_dir)
        trainer.callbacks.insert(0, StopAt())
        return trainer

    monkeypatch.setattr(run_mod, "build_trainer", interrupted)
    return lambda: monkeypatch.setattr(run_mod, "build_trainer", real_build)


def device_reads(fn):
    """Runs fn() and counts the ops that read a tensor's value back to the host (on a GPU, a
    sync: the host waits for the device there)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "is_nonzero", "masked_select"):
                reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Reads():
        out = fn()
    return out, reads


def run_module(module: str, *args: str):
    """`python -m MODULE ARGS` in this process: MODULE's main(argv), with the exit code and what it
    printed as subprocess.run(..., capture_output=True, text=True) gives them (returncode, stdout,
    stderr). A process of its own spends seconds importing torch; every CLI still runs as a real
    command in some test (train, export, export.check, generate, validate, regenerate,
    scripts/device/drafter_parts.py)."""
    import contextlib
    import importlib
    import io
    import logging
    from types import SimpleNamespace

    main = importlib.import_module(module).main
    root, handlers = logging.getLogger(), list(logging.getLogger().handlers)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
        finally:  # a main that set up logging onto the captured stream leaves no handler behind
            for handler in root.handlers[:]:
                if handler not in handlers:
                    root.removeHandler(handler)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
