"""Training callbacks (throughput and peak memory, measured over training batches only) and a
CSV logger that continues its file on --resume."""
from __future__ import annotations

import csv
import os
import time

import lightning as L
import torch


class Throughput(L.Callback):
    """Real (unpadded) tokens per second over training steps, excluding validation and the
    first `warmup` steps (allocator and kernel warm-up); peak accelerator memory.

    The device is synchronised only where a window of `every` steps opens and closes, and around
    validation: a sync at every step kept the host from queueing step n+1 while the device still
    ran step n (host-bound phases such as the target's forward then left the GPU idle)."""

    def __init__(self, warmup: int = 5, every: int = 50):
        self.warmup, self.every = warmup, every
        self.tokens = 0
        self.seconds = 0.0
        self._seen = 0  # training batches begun
        self._t0 = None  # the open window's start
        self._window_tokens = self._window_steps = 0

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _close(self) -> bool:
        """Ends the open window (if any) and adds it to the totals."""
        if self._t0 is None:
            return False
        self._sync()
        self.seconds += time.perf_counter() - self._t0
        self.tokens += self._window_tokens
        self._t0, self._window_tokens, self._window_steps = None, 0, 0
        return True

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._seen += 1
        if self._seen > self.warmup and self._t0 is None:
            self._sync()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self._t0 is None:
            return
        # a count made on the host by the collate function (data/module.py): reading it from the
        # device's `lengths` would be a sync of its own
        self._window_tokens += int(batch["num_tokens"]) if "num_tokens" in batch else int(batch["lengths"].sum())
        self._window_steps += 1
        if self._window_steps >= self.every and self._close():
            module.log("train/tokens_per_s", self.tokens / max(self.seconds, 1e-9), prog_bar=True)

    def on_validation_start(self, trainer, module):
        self._close()

    def on_train_end(self, trainer, module):
        self._close()

    def summary(self) -> dict:
        out = {"tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None,
               "timed_tokens": self.tokens, "timed_seconds": round(self.seconds, 2)}
        if torch.cuda.is_available():
            out["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            out["gpu"] = torch.cuda.get_device_name()
        return out


def resumable_csv_logger(out_dir):
    """Lightning's CSVLogger, except that an existing logs/metrics.csv is continued, not
    deleted: a resumed run appends its rows after the earlier ones (a new run starts in an
    empty folder, so it never finds one)."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    class _AppendingWriter(ExperimentWriter):
        def _check_log_dir_exists(self):
            if os.path.isfile(self.metrics_file_path):
                with open(self.metrics_file_path, newline="") as f:
                    header = next(csv.reader(f), [])
                self.metrics_keys = sorted(header)  # same columns; a new one rewrites the header

    class _Logger(CSVLogger):
        @property
        @rank_zero_experiment
        def experiment(self):
            if self._experiment is None:
                self._fs.makedirs(self.root_dir, exist_ok=True)
                self._experiment = _AppendingWriter(log_dir=self.log_dir)
            return self._experiment

    return _Logger(out_dir, name="logs", version="")
