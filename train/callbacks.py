"""Training callbacks (throughput and peak memory, measured over training batches only; a progress
bar that reads the device only when it refreshes) and a CSV logger that continues its file on
--resume."""
from __future__ import annotations

import csv
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar


def progress_refresh_rate() -> int:
    """Steps between progress-bar refreshes: each reads the shown loss back from the device (a
    host sync on a GPU), so on a GPU every 10th step; on a CPU, where a read costs nothing, every
    step."""
    return 10 if torch.cuda.is_available() else 1


class ProgressBar(TQDMProgressBar):
    """Lightning's bar, showing the last step's loss and first-position accuracy (the module's
    `shown`, read only when the bar refreshes) and the tokens/s of the Throughput meter (a host
    number). Metrics logged with prog_bar=True would instead be read after every batch: Lightning
    converts them to numbers whether or not a bar is shown."""

    def get_metrics(self, trainer, module):
        metrics = super().get_metrics(trainer, module)
        for name, value in getattr(module, "shown", {}).items():
            metrics[name] = f"{float(value):.4g}"
        meter = next((c for c in trainer.callbacks if isinstance(c, Throughput)), None)
        if meter is not None and meter.seconds > 0:
            metrics["tokens/s"] = f"{meter.tokens / meter.seconds:,.0f}"
        return metrics


class NonFiniteTraining(Exception):
    """The loss (or the weights) became NaN or Inf: training stops, and that state is never saved."""


class FiniteLoss(L.Callback):
    """Stops training at a NaN or Inf loss, naming the first step that had one, and refuses to
    write a checkpoint of non-finite weights. The first bad step is kept on the device ([]-shaped
    int64, -1 while none) and read on the host only every `every` steps and before each
    checkpoint: a read at every step would be a device sync at every step."""

    def __init__(self, every: int = 50):
        self.every = every
        self.first_bad = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        loss = loss.detach()
        if self.first_bad is None:
            self.first_bad = torch.full((), -1, dtype=torch.long, device=loss.device)
        step = torch.full((), trainer.global_step, dtype=torch.long, device=loss.device)
        self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(loss), step, self.first_bad)
        if trainer.global_step % self.every == 0 or not torch.cuda.is_available():
            self._stop_if_bad()

    def _stop_if_bad(self):
        if self.first_bad is not None and int(self.first_bad) >= 0:
            raise NonFiniteTraining(f"the training loss became NaN or Inf at step {int(self.first_bad)}; training stopped "
                                    "and no checkpoint of it was written (lower optim.lr, or check the data)")

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self._stop_if_bad()
        drafter = getattr(module, "drafter", module)
        bad = next((name for name, p in drafter.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:
            raise NonFiniteTraining(f"the drafter's weights ({bad}) became NaN or Inf by step {trainer.global_step}; "
                                    "training stopped and no checkpoint of them was written (lower optim.lr)")


class Throughput(L.Callback):
    """Real (unpadded) tokens per second over training steps, the time between them included
    (batches loaded, logs and checkpoints written: the wall clock a time box runs on), excluding
    validation and the first `warmup` steps (allocator and kernel warm-up); peak accelerator
    memory. Timing each batch alone, with a sync at each end, would read higher than the wall
    clock.

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
        self._pending = False  # a window closed whose rate is not logged yet (logging waits for a training batch)

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
        self._window_tokens += batch["num_tokens"]
        self._window_steps += 1
        if self._window_steps >= self.every:
            self._pending = self._close()
        if self._pending:  # a window closed here or by the validation before this step: log the rate
            module.log("train/tokens_per_s", self.tokens / max(self.seconds, 1e-9))
            self._pending = False

    def on_validation_start(self, trainer, module):
        self._pending = self._close() or self._pending

    def on_train_end(self, trainer, module):
        self._close()
        # the peak of fit alone: the final validation after it may move a target that training
        # from a feature store (data.features) never put on the device
        self.fit_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None

    def summary(self) -> dict:
        out = {"tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None,
               "timed_tokens": self.tokens, "timed_seconds": round(self.seconds, 2)}
        if torch.cuda.is_available():
            out["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if getattr(self, "fit_peak", None) is not None:
                out["peak_gpu_memory_gib_fit"] = round(self.fit_peak / 2**30, 2)
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
