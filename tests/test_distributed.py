"""Rank-aware data sharding and a 2-process (gloo) training run on CPU."""
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from data.module import ResumableBatchSampler


def test_ranks_never_share_a_sample_within_an_epoch():
    lengths = np.random.default_rng(0).integers(10, 500, size=203)
    world, bs = 2, 4
    per_epoch = ResumableBatchSampler(lengths, bs, seed=3, total=1, rank=0, world=world).per_epoch
    seen = []
    for rank in range(world):
        batches = list(ResumableBatchSampler(lengths, bs, seed=3, total=per_epoch, rank=rank, world=world))
        assert len(batches) == per_epoch
        seen.extend(i for b in batches for i in b)
    assert len(seen) == len(set(seen)), "a sample was seen twice in one epoch"
    assert len(seen) >= len(lengths) - world * bs * 2, "almost every sample is seen once"


def test_resumed_sampler_continues_the_same_order():
    lengths = np.arange(100)
    full = list(ResumableBatchSampler(lengths, 4, seed=1, total=40, rank=1, world=2))
    tail = list(ResumableBatchSampler(lengths, 4, seed=1, total=40, start=17, rank=1, world=2))
    assert tail == full[17:]
    assert len(full) == 40, "the order runs on into later epochs, reshuffled"
    assert full[:12] != full[12:24]


@pytest.mark.slow
def test_two_process_gloo_run_and_single_process_reload(two_process_runs, tmp_path):
    overrides, runs = two_process_runs  # the 2-process DDP run (trainer.strategy=ddp trainer.devices=2; conftest)
    out = tmp_path / "ddp"
    shutil.copytree(runs["ddp"], out)  # a copy: the run is shared with tests/test_fsdp.py
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4
    # the 2-process checkpoint resumes on one process and trains on to step 6
    single = [sys.executable, "-m", "train", *overrides(out), "trainer.max_steps=6", "--resume"]
    res = subprocess.run(single, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
