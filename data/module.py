"""LightningDataModule: tokenized conversations → padded batches, resumable and rank-sharded.

The training order is a pure function of (seed, batch index): epoch e shuffles with seed+e,
then batches are formed from length-sorted windows (less padding) and shuffled again. A resumed
run starts at the batch after the last optimizer step, and rank r of W takes every W-th batch,
so no sample is seen twice in an epoch and interruption loses nothing.
"""
from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler


def epoch_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int, window: int = 64) -> list[list[int]]:
    """All batches of one epoch (global, before sharding); the last partial batch is dropped."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    batches = []
    span = batch_size * window
    for start in range(0, len(order) - batch_size + 1, span):
        chunk = order[start : start + span]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        for b in range(0, len(chunk) - batch_size + 1, batch_size):
            batches.append(chunk[b : b + batch_size].tolist())
    perm = rng.permutation(len(batches))
    return [batches[i] for i in perm]


class ResumableBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches number `start` .. `total`-1 of an endless epoch sequence.

    `len()` is `total` (what Lightning counts in the epoch), iteration starts at `start`
    (batches already consumed by this rank before a resume).
    """

    def __init__(self, lengths, batch_size: int, seed: int, total: int, start: int = 0, rank: int = 0, world: int = 1):
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.total, self.start = batch_size, seed, total, start
        self.rank, self.world = rank, world
        per_epoch = len(epoch_batches(self.lengths, batch_size, seed, 0)) // world
        if per_epoch == 0:
            raise ValueError(f"{len(self.lengths)} training conversations make no batch of {batch_size} on each of {world} ranks")
        self.per_epoch = per_epoch

    def __len__(self):
        return self.total

    def __iter__(self):
        i = self.start
        while i < self.total:
            epoch, within = divmod(i, self.per_epoch)
            batches = epoch_batches(self.lengths, self.batch_size, self.seed, epoch)
            mine = batches[self.rank :: self.world][: self.per_epoch]
            for b in mine[within:]:
                if i >= self.total:
                    return
                yield b
                i += 1


def collate(rows: list[dict], pad_id: int, multiple: int = 128) -> dict:
    """Right-pad to the longest row, rounded up to `multiple` (few distinct shapes, so the GPU
    attention and matmul plans are built once each): input_ids, loss_mask [B,T],
    lengths [B]; num_tokens, their sum as a host int (a count no device read waits for)."""
    T = max(len(r["input_ids"]) for r in rows)
    T = -(-T // multiple) * multiple
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        mask[i, :n] = torch.as_tensor(r["loss_mask"])
    lengths = [len(r["input_ids"]) for r in rows]
    return {"input_ids": ids, "loss_mask": mask, "lengths": torch.tensor(lengths), "num_tokens": sum(lengths)}


class ChatDataModule(L.LightningDataModule):
    def __init__(self, train, heldout, pad_id: int, batch_size: int, seed: int, num_workers: int = 2,
                 max_steps: int = 1, accumulate: int = 1, eval_sequences: int = 32, eval_max_length: int = 1024):
        super().__init__()
        self.train_set, self.heldout_set = train, heldout
        self.pad_id, self.batch_size, self.seed, self.num_workers = pad_id, batch_size, seed, num_workers
        self.max_steps, self.accumulate = max_steps, accumulate
        self.eval_sequences, self.eval_max_length = eval_sequences, eval_max_length

    def check_batches(self, world: int) -> None:
        """At least one batch of data.batch_size per rank (before anything is written, so the
        refusal leaves the run folder as it was)."""
        from data.sources import DataError

        if len(epoch_batches(np.asarray(self.train_set["num_tokens"]), self.batch_size, self.seed, 0)) // world == 0:
            raise DataError(f"data.batch_size {self.batch_size}: the {len(self.train_set)} training conversations make no "
                            f"batch of {self.batch_size} on each of {world} rank(s); lower data.batch_size or use more data")

    def _collate(self, rows):
        return collate(rows, self.pad_id)

    def train_dataloader(self):
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        done = trainer.global_step * self.accumulate if trainer is not None else 0
        sampler = ResumableBatchSampler(self.train_set["num_tokens"], self.batch_size, self.seed,
                                        total=self.max_steps * self.accumulate, start=done, rank=rank, world=world)
        if hasattr(self.train_set, "collate"):  # a feature store (data/features.py): rows carry the target's outputs
            dataset, collate_fn = self.train_set, self.train_set.collate
        else:
            dataset, collate_fn = self.train_set.with_format(columns=["input_ids", "loss_mask"]), self._collate
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=self.num_workers,
                          # pinned batches copy to the GPU without waiting for it (asynchronously)
                          pin_memory=torch.cuda.is_available(), persistent_workers=False)

    def val_dataloader(self):
        """One loader per held-out set (a list when there are several)."""
        sets = self.heldout_set if isinstance(self.heldout_set, list) else [self.heldout_set]
        loaders = [self._heldout_loader(s) for s in sets]
        return loaders[0] if len(loaders) == 1 else loaders

    def _heldout_loader(self, heldout_set):
        n = min(self.eval_sequences, len(heldout_set))
        if n == 0:
            raise ValueError("no held-out conversations: raise data.heldout_fraction or data.limit")
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        # each rank validates its own share; the acceptance histograms are summed across ranks
        heldout = heldout_set.select(range(rank, n, world)).with_format(columns=["input_ids", "loss_mask"])
        cut = self.eval_max_length

        def truncate(rows):
            return collate([{"input_ids": r["input_ids"][:cut], "loss_mask": r["loss_mask"][:cut]} for r in rows], self.pad_id)

        return DataLoader(heldout, batch_size=self.batch_size, collate_fn=truncate, num_workers=0)
