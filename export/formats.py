"""Which layouts carry which drafter, and one writer that dispatches on the layout: used by
the training run (its final export) and by `python -m export`."""
from __future__ import annotations

# method → the layouts that carry it, its own (the training run's default export) first
FORMATS = {"eagle3": ("speculators", "sglang"), "eagle1": ("eagle", "eagle-vllm"), "medusa": ("medusa",), "mtp": ("mtp",),
           "dflash": ("dflash", "speculators")}

# why a layout cannot carry a method, where there is more to say than "it has no slot for it"
WHY_NOT = {("mtp", "speculators"): "speculators' MTP format holds one Qwen3-family layer (with q/k norms) reused for "
                                   "every step; draftsmith's MTP has one Llama-style layer per step, like the target's"}


# said by every MTP export: the layout is DeepSeek-V3's, but neither server has an MTP path for
# the Llama-family targets draftsmith trains on (docs/serving.md)
MTP_SERVED_BY = ("served by the draftsmith runtime only (python -m inference.validate / generate): vLLM 0.33 and "
                 "SGLang 0.5.23 run MTP only for model types that ship MTP layers (DeepSeek-V3 and the like), and "
                 "model_type llama is not one")


def write_export(drafter, fmt: str, out, *, method: str, target_name: str, hf_config, target_model, joint: bool,
                 k: int, provenance: dict, dtype=None, runtime_only: bool = False):
    """Write `drafter` (of `method`) in layout `fmt`. target_model: the target (its embedding
    and head for MTP; in joint runs the trained target, which travels with the export).
    runtime_only: the training run's own export, for draftsmith's runtime, where a layout no
    server loads for this drafter (Medusa with Vd < V) is written instead of refused."""
    if fmt not in FORMATS[method]:
        why = f"; {WHY_NOT[method, fmt]}" if (method, fmt) in WHY_NOT else ""
        raise ValueError(f"--format {fmt} cannot carry a {method} drafter (formats for {method}: {', '.join(FORMATS[method])}){why}")
    import torch

    common = dict(target_name=target_name, dtype=dtype or torch.bfloat16, provenance=provenance)
    if fmt == "speculators":
        from export.speculators import export_speculators

        return export_speculators(drafter, out, target_arch=list(hf_config.architectures or []), k=k, **common)
    if fmt == "sglang":
        from export.sglang import export_sglang

        return export_sglang(drafter, out, **common)
    if fmt in ("eagle", "eagle-vllm"):
        from export.eagle1 import export_eagle1

        return export_eagle1(drafter, out, fmt=fmt, **common)
    if fmt == "medusa":
        from export.medusa import export_medusa

        return export_medusa(drafter, out, target_model=target_model if joint else None, runtime_only=runtime_only, **common)
    if fmt == "dflash":
        from export.dflash import export_dflash

        return export_dflash(drafter, out, **common)
    from export.mtp import export_mtp

    print(f"note: MTP on a {'/'.join(hf_config.architectures or ['Llama-family'])} target is {MTP_SERVED_BY}")
    return export_mtp(drafter, out, target_config=hf_config.to_dict(), embed=target_model.get_input_embeddings().weight,
                      head=target_model.get_output_embeddings().weight, target_model=target_model if joint else None, **common)
