"""Random-weight models of the sizes people serve, built on the device with nothing to carry,
and the bytes each phase of a speculative step reads (scripts/scale_profile.py times them
against these). Shapes: [B] batch, H hidden, V / Vd target / draft vocabulary."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# the released models' config.json fields that set a shape (weights' sizes, RoPE, norms)
SHAPES = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
                         max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
                         max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False, attention_bias=False),
}

# configs/eagle3.yaml's drafter options
EAGLE3_RECIPE = dict(norm_before_fc=True, norm_before_residual=False)


def hf_config_of(fields: dict):
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def load_hf_config(path: str):
    """An HF config.json (or a folder holding one) → its config; ValueError saying what is wrong."""
    from inference.runtime.model import SUPPORTED

    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        fields = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--hf-config {path}: not a readable JSON file ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(fields, dict) or fields.get("model_type") not in SUPPORTED:
        kind = fields.get("model_type") if isinstance(fields, dict) else None
        raise ValueError(f"--hf-config {path}: model_type {kind!r} has no runtime implementation "
                         f"({', '.join(sorted(SUPPORTED))})")
    try:
        return hf_config_of(fields)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"--hf-config {path}: {e}") from None


@contextmanager
def building(device, dtype):
    """Modules made inside are made on `device` in `dtype`: random weights initialised in place
    (no host copy, no float32 detour: an 8B target is 16 GB)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


def random_runtime(hf_cfg, device, dtype):
    """RuntimeModel of this shape with random weights (the layout `from_pretrained` builds)."""
    from inference.runtime.model import RuntimeConfig, RuntimeModel
    from models.layers import rope_inv_freq

    cfg = RuntimeConfig.from_hf(hf_cfg)
    with building(device, dtype), torch.no_grad():
        model = RuntimeModel(cfg)
        for name, p in model.named_parameters():  # unit norms and zero biases keep the activations sane
            if p.dim() == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)  # float32, as loaded
    model.inv_freq_local = rope_inv_freq(cfg.head_dim, *cfg.local_rope()).to(device)
    return model.eval()


def random_eagle3(hf_cfg, vd: int, device, dtype):
    """A random EAGLE-3 drafter of the real size for this target (1 layer, the target's hidden
    size, vd head rows: the first vd target ids)."""
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    with building(device, dtype), torch.no_grad():
        drafter = Eagle3Drafter(Eagle3Config.from_target(hf_cfg, vd, **EAGLE3_RECIPE))
        drafter.d2t.zero_()
        drafter.t2d.zero_()[:vd] = True
    return drafter.eval()


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


def target_read_bytes(rt) -> tuple[int, int]:
    """(bytes one decode step reads: every weight but the embedding table, the head once;
    bytes of all weights)."""
    every = nbytes(rt.parameters())
    table = rt.embed_tokens.weight
    return (every if rt.config.tie_word_embeddings else every - table.numel() * table.element_size()), every


def eagle3_draft_read_bytes(drafter, k: int) -> dict:
    """What a chain step's draft phase reads (inference/proposers/drafters.py): the advance runs
    fc and the layer once over the verified tokens, then k heads (norm + lm_head) and k - 1
    chain layers; embedding rows are gathered, not read whole."""
    fc = nbytes([drafter.fc.weight] + ([drafter.input_norm.weight] if hasattr(drafter, "input_norm") else []))
    layer = nbytes(drafter.layers[0].parameters())
    head = nbytes([drafter.norm.weight, drafter.lm_head.weight])
    return {"fc_bytes": fc, "layer_bytes": layer, "head_bytes": head, "layer_passes": k, "head_passes": k,
            "bytes": fc + k * layer + k * head}


def copy_bandwidth(device, mib: int, repeats: int = 50) -> float:
    """Bytes/s of a device-to-device copy of `mib` MiB (read + written)."""
    from scripts.profile_decode import step_ms

    src = torch.randint(0, 256, (mib * 2**20,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = step_ms(lambda: dst.copy_(src), n=repeats, warmup=3, device=str(device))
    del src, dst
    return 2 * mib * 2**20 / (ms / 1e3)


def random_hf(hf_cfg, device, dtype):
    from transformers import AutoModelForCausalLM

    with building(device, dtype):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return model.to(device).eval()  # (a no-op where transformers built it on the device)
