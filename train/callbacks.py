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
    first `warmup` steps (allocator and kernel warm-up); peak accelerator memory."""

    def __init__(self, warmup: int = 5):
        self.warmup = warmup
        self.tokens = 0
        self.seconds = 0.0
        self._t0 = None
        self._seen = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._seen += 1
        if self._seen > self.warmup:
            self.seconds += time.perf_counter() - self._t0
            self.tokens += int(batch["lengths"].sum())
            module.log("train/tokens_per_s", self.tokens / max(self.seconds, 1e-9), prog_bar=True)

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
