"""Where one plain decode step's time goes on a GPU: the graphed step's wall time against the sum
of its kernels' durations, and the kernels by total time (random target shaped like SmolLM2-135M,
bf16, batch 1, one query token; same shapes, same cost, nothing to carry).

    python scripts/profile_decode.py [--out DIR] [--cache 768]

If the kernels' sum is close to the step's wall time, the step needs fewer or faster kernels;
if it is well below, the gaps between kernels (launch latency inside the graph) dominate.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith_kernels.settings import KernelSettings, applied
from inference.runtime.engine import GreedyDecodeStep
from inference.runtime.model import RuntimeModel
from scripts.profile_train_step import SMOLLM2


def step_ms(step, n: int = 300, warmup: int = 20, device: str = "cuda") -> float:
    """Mean ms of `step` over n calls after `warmup`: CUDA events on a GPU, the host clock
    elsewhere (scripts/scale_profile.py times a CPU rehearsal with it)."""
    for _ in range(warmup):
        step()
    if not str(device).startswith("cuda"):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        return 1e3 * (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def kernel_table(step, steps: int = 10) -> tuple[float, list]:
    """Eager steps under the profiler → (kernel ms per step, [(name, calls/step, us/step)])."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, calls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            calls[e.name] += 1
    rows = sorted(((n[:90], calls[n] / steps, total[n] / steps) for n in total), key=lambda r: -r[2])
    return sum(total.values()) / steps / 1e3, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cache", type=int, default=768)
    args = ap.parse_args()
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp())
    LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16).save_pretrained(folder)
    rt = RuntimeModel.from_pretrained(folder, dtype=torch.bfloat16, device="cuda")
    report = {"gpu": torch.cuda.get_device_name(), "cache": args.cache}
    for mode in ("auto", "off"):  # Triton kernels on, then the torch ops
        with applied(KernelSettings(mode=mode)):  # (the steps are built and timed here, outside `generate`)
            cache = rt.new_cache(1, args.cache)
            graphed = GreedyDecodeStep(rt, cache, 1, graphed=True)
            eager = GreedyDecodeStep(rt, cache, 1, graphed=False)
            for s in (graphed, eager):
                s.positions.fill_(300)
            ms_graph = step_ms(graphed)
            ms_eager = step_ms(eager, 50)
            kernel_ms, rows = kernel_table(eager)
        name = "triton" if mode == "auto" else "torch"
        report[name] = {"graph_step_ms": round(ms_graph, 4), "eager_step_ms": round(ms_eager, 4),
                        "kernel_sum_ms": round(kernel_ms, 4), "kernels_per_step": sum(r[1] for r in rows),
                        "top": [{"kernel": n, "per_step": c, "us": round(u, 1)} for n, c, u in rows[:25]]}
        print(f"[{name}] graph step {ms_graph:.3f} ms ({1e3 / ms_graph:,.0f} tok/s), eager {ms_eager:.3f} ms, "
              f"kernels {kernel_ms:.3f} ms in {sum(r[1] for r in rows):.0f} launches")
        for n, c, u in rows[:25]:
            print(f"  {u:8.1f} us  {c:5.0f}x  {n}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile_decode.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
