"""Time one EAGLE-3 training step by phase on a GPU, with a random target shaped like the zoo
target (SmolLM2-135M: same shapes, so the same cost; no weights to carry).

    python scripts/profile_train_step.py [--out DIR]

Compares the TTT attention implementations side by side (flash + merged chain terms vs the
dense-mask reference) and prints the top CUDA kernels of the fast one.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import models.eagle3 as eagle3_mod
from models.eagle3 import Eagle3Config, Eagle3Drafter
from models.target import Target
from models.ttt_attention import ttt_attention, ttt_attention_reference
from train.config import EvalConfig, ObjectiveConfig, OptimConfig
from train.module import DrafterModule

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def build(vd=16384, steps=7):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16).cuda().eval()
    cfg = Eagle3Config.from_target(model.config, vd)
    target = Target(model, cfg.aux_layer_ids)
    drafter = Eagle3Drafter(cfg).cuda()
    ids = torch.sort(torch.randperm(SMOLLM2["vocab_size"])[:vd]).values
    drafter.init_from_target(model, ids - torch.arange(vd), torch.zeros(SMOLLM2["vocab_size"], dtype=torch.bool).index_fill_(0, ids, True))
    module = DrafterModule(target, drafter, ObjectiveConfig(ttt_steps=steps), OptimConfig(), EvalConfig(), 1000).cuda()
    return module


def step(module, opt, ids, mask, timings, autocast: bool = True):
    """One training step on ids' device, its phases' ms appended to `timings`. autocast: bf16
    autocast as the recipes train on a GPU (bf16-mixed); a CPU rehearsal passes False (32-true)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        out, teacher, greedy = module._target_pass(ids)
        sync()
        t1 = time.perf_counter()
        total, _, _ = module._objective(ids, mask, out, teacher, greedy)
    sync()
    t2 = time.perf_counter()
    total.backward()
    sync()
    t3 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    t4 = time.perf_counter()
    for k, v in zip(("target", "drafter_fwd", "backward", "optimizer", "total"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
        timings.setdefault(k, []).append(v * 1000)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    lines = []
    module = build()
    opt = torch.optim.AdamW([p for p in module.drafter.parameters() if p.requires_grad], lr=1e-4, fused=True)
    for B, T in ((4, 2048), (4, 1024), (8, 1024)):
        ids = torch.randint(0, SMOLLM2["vocab_size"], (B, T), device="cuda")
        mask = torch.ones(B, T, device="cuda", dtype=torch.long)
        for name, fn in (("flash+merge", ttt_attention), ("dense-mask", ttt_attention_reference)):
            eagle3_mod.ttt_attention = fn
            torch.cuda.reset_peak_memory_stats()
            timings: dict = {}
            for i in range(8):
                step(module, opt, ids, mask, timings)
            med = {k: statistics.median(v[3:]) for k, v in timings.items()}
            tok_s = B * T / (med["total"] / 1000)
            peak = torch.cuda.max_memory_allocated() / 2**30
            line = (f"B={B} T={T} attention={name:12s} " + " ".join(f"{k}={v:.1f}ms" for k, v in med.items())
                    + f" tokens/s={tok_s:,.0f} peak={peak:.1f}GiB")
            print(line, flush=True)
            lines.append(line)
    eagle3_mod.ttt_attention = ttt_attention
    ids = torch.randint(0, SMOLLM2["vocab_size"], (4, 2048), device="cuda")
    mask = torch.ones(4, 2048, device="cuda", dtype=torch.long)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step(module, opt, ids, mask, {})
    try:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
    except Exception as e:  # the sort key's name moved between torch versions
        table = f"(profiler table unavailable: {e})"

    print(table)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile.txt").write_text("\n".join(lines) + "\n\n" + table)


if __name__ == "__main__":
    main()
