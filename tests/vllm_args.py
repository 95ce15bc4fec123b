"""Run `vllm serve` lines through vLLM 0.33's own config resolution (tests/test_launch_lines.py
runs this in a subprocess, with the unpacked vllm wheel first on PYTHONPATH).

    python tests/vllm_args.py LINES.json   (run in the folder the lines' relative paths are relative to)

For each line `vllm serve MODEL [--speculative-config JSON]`:
- `vllm.transformers_utils.config.maybe_override_with_speculators`, which EngineArgs runs on
  the served model before anything else: a speculators folder served as the model names its
  verifier, which must be a hub id (a local one is refused);
- the draft's config as vLLM loads it (`vllm.transformers_utils.config.get_config`: a
  speculators config becomes the served config, SpeculatorsConfig), wrapped as
  SpeculativeConfig wraps an `eagle` / `eagle3` / `dflash` draft that is not one
  (transformers_utils/configs/eagle.py, EAGLEConfig), and its architecture looked up in vLLM's
  model registry;
- the method checked against vLLM's SpeculativeMethod.
Printed: one JSON list, per line the resolved method, draft tokens, draft architecture and the
verifier, or the exception's type and message. vLLM's full argument parser and ModelConfig
import its OpenAI server and CUDA packages, which are not installed here: those parts do not run.
Third-party modules vLLM imports at module level that are absent are empty modules
(tests/sglang_args.py `_Empty`); none of them is called on this path.
"""
import json
import shlex
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from tests.sglang_args import _EmptyFinder  # noqa: E402

ABSENT_OK = ("cbor2", "zmq", "pybase64", "uvloop", "prometheus_client", "xgrammar", "fastapi", "openai_harmony",
             "openai", "cachetools")


def _literal_values(tp) -> set:
    out = set()
    for arg in typing.get_args(tp):
        out |= _literal_values(arg) if typing.get_args(arg) else {arg}
    return out


def resolve(line: str) -> dict:
    from vllm.config.speculative import SpeculativeMethod
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config, maybe_override_with_speculators
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    words = shlex.split(line)
    if words[:2] != ["vllm", "serve"] or len(words) < 3:
        return {"line": line, "error": "ValueError", "message": "not a `vllm serve MODEL` line"}
    try:
        rest = words[3:]
        spec = json.loads(rest[rest.index("--speculative-config") + 1]) if "--speculative-config" in rest else None
        model, _, spec = maybe_override_with_speculators(model=words[2], tokenizer=None, trust_remote_code=False,
                                                         vllm_speculative_config=spec)
        if spec is None:
            return {"line": line, "error": "ValueError", "message": "no speculative decoding configured"}
        method = spec.get("method")
        if method not in _literal_values(SpeculativeMethod):
            raise ValueError(f"method {method!r} is not one of vLLM's")
        draft = get_config(spec["model"], trust_remote_code=False)
        if method in ("eagle", "eagle3", "dflash") and not isinstance(draft, (EAGLEConfig, SpeculatorsConfig)):
            draft = EAGLEConfig(draft, method=method, model_type="eagle")
        archs = list(draft.architectures or [])
        supported = [a for a in archs if a in ModelRegistry.get_supported_archs()]
        if not supported:
            raise ValueError(f"draft architectures {archs} are not in vLLM's model registry")
        out = {"line": line, "model": model, "method": method, "num_speculative_tokens": spec.get("num_speculative_tokens"),
               "draft_model": spec["model"], "draft_architecture": supported[0]}
        if "num_speculative_tokens_per_batch_size" in spec:
            out["k_by_batch"] = _k_by_batch(spec)
        return out
    except Exception as e:
        return {"line": line, "error": type(e).__name__, "message": str(e)}


def _k_by_batch(spec: dict) -> list[int]:
    """A per-batch-size draft-length table as vLLM reads it: the field's declared type
    (SpeculativeConfig.num_speculative_tokens_per_batch_size, validated by pydantic), then the
    scheduler's dense lookup (v1/spec_decode/dynamic/utils.py) for batch sizes 1..64 under the
    line's num_speculative_tokens: [k at batch 1, ..., k at batch 64]."""
    import dataclasses

    from pydantic import TypeAdapter
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    field = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}["num_speculative_tokens_per_batch_size"]
    table = TypeAdapter(field.type).validate_python(spec["num_speculative_tokens_per_batch_size"])
    return build_dynamic_sd_schedule_lookup(table, 64, spec["num_speculative_tokens"])[1:]


def main() -> int:
    lines = json.loads(Path(sys.argv[1]).read_text())
    sys.meta_path.insert(0, _EmptyFinder([n for n in ABSENT_OK if __import__("importlib.util").util.find_spec(n) is None]))
    print(json.dumps([resolve(line) for line in lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
