"""CUDA-graph capture, written once for every captured step of the runtime.

A step function reads and writes only tensors that live across calls (static buffers, KV
caches, a proposer's state); capturing it records its kernels once, and each replay launches
them all with one call and no Python in between. Warm-up runs the function eagerly on a side
stream first (Triton compiles, cuBLAS picks its kernels, the allocator settles), so its
effects on the state are real: callers either make the warm-up a real step or pass `restore`,
the tensors to put back afterwards.
"""
from __future__ import annotations

import torch

from draftsmith_kernels.settings import KernelSettings, active

WORKSPACE_SLOTS = 64  # caches and captured graphs kept per model (prefill shapes too), least recently used dropped


def capture_graph(fn, warmup: int = 2, restore: tuple = (), pool=None, generator=None) -> torch.cuda.CUDAGraph:
    """Warm `fn` up `warmup` times, then capture one call of it; the tensors in `restore` get
    their pre-warm-up contents back. `pool` shares a memory pool with graphs captured earlier
    (replayed in the same order, as one step's phases are). `generator`, a CUDA generator
    `fn` draws from, is registered so that each replay draws fresh numbers from it."""
    saved = [t.clone() for t in restore]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        fn()
    for t, s in zip(restore, saved):
        t.copy_(s)
    return graph


def graph_generator_ok(generator) -> bool:
    """Whether draws from `generator` can live inside a captured graph (the default CUDA
    generator always; another CUDA generator where torch can register it)."""
    if generator is None:
        return True
    return generator.device.type == "cuda" and hasattr(torch.cuda.CUDAGraph, "register_generator_state")


def kernel_settings() -> KernelSettings:
    """The kernel settings a captured step holds: those `generate` applied for this call (the
    model's `kernels`, kernels/settings.py). Part of every workspace key, so that a step captured
    under one setting is never replayed under another."""
    return active()


def release_workspace(model) -> None:
    """Drop every cache and captured graph kept on the model and hand their memory back to the
    device: a job whose shapes keep changing (regeneration: each turn of each batch has its own
    rows and widths) would otherwise hold up to WORKSPACE_SLOTS of them (four regeneration
    shards on one H200 grew to 40-55 GiB each and ran out of memory)."""
    model.__dict__.pop("_workspace", None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reuse(model, key, build):
    """A KV cache or captured step kept on the model and reused by later calls of the same
    shape: capturing a CUDA graph costs more than decoding a short answer. Stale cache
    entries are harmless: a query sees only positions its own request has written."""
    slots = model.__dict__.setdefault("_workspace", {})
    if key in slots:
        slots[key] = slots.pop(key)  # most recently used last
    else:
        slots[key] = build()
        while len(slots) > WORKSPACE_SLOTS:
            slots.pop(next(iter(slots)))
    return slots[key]
