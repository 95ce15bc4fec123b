"""Run SGLang launch lines through SGLang's own argument code (tests/test_launch_lines.py runs
this in a subprocess, with the unpacked sglang wheel first on PYTHONPATH).

    python tests/sglang_args.py LINES.json   (a JSON list of command lines; run in the folder
                                              the lines' relative paths are relative to)

For each line: `sglang.srt.server_args.prepare_server_args` parses the arguments after
`python -m sglang.launch_server`, then `sglang.srt.arg_groups.speculative_hook.
handle_speculative_decoding` resolves the speculative ones (algorithm alias, the EAGLE family's
steps / top-k / draft tokens, DFLASH's block). Printed: one JSON list, per line either the
resolved fields or the exception's type and message.

SGLang pins torch, transformers and CUDA packages draftsmith does not share, so the wheel is
not installed with its dependencies; what it imports that is absent here is replaced, and
nothing of its argument code is:
- third-party modules not installed (`pybase64`, `starlette`, `zmq`): empty modules; the
  argument code calls none of them.
- `sglang.srt.configs` (its __init__ registers every multimodal config class with transformers)
  is entered without its __init__, so only the submodules imported load, from the wheel.
- `sglang.srt.configs.model_config` (imports the quantisation kernels): a ModelConfig class that
  is never built, because the target's config is handed to the record the way SGLang's
  `model_config_of` takes a supplied one (`_model_config` with no `_model_config_built_from`):
  its `hf_config` is transformers' AutoConfig of --model-path.
- `sglang.srt.utils.hf_transformers_utils.get_config` (the same registration): transformers'
  AutoConfig of the draft folder, which is what it returns for a Llama- or Qwen3-type config.
- `device`: left unset on the command line, SGLang's `_handle_missing_default_values` sets it
  to `get_device()`, "cuda" on the GPU hosts these lines are for; that value is given here.
Of the resolution pipeline (`sglang.srt.arg_groups.pipeline`), the page-size default runs before
the hook, as there; the hooks that probe the GPU (attention backend, memory) do not run.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import json
import shlex
import sys
import types
from pathlib import Path

PREFIX = ["python", "-m", "sglang.launch_server"]
ABSENT_OK = ("pybase64", "starlette", "zmq")


class _Empty(types.ModuleType):
    """A module none of whose attributes is used by the argument code: every name is another
    empty module, and a call returns its argument when used as a decorator."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Empty(f"{self.__name__}.{name}")
        sub.__path__ = []
        return sub

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else self

    def __or__(self, other):  # type annotations (`zmq.Socket | None`)
        return self

    __ror__ = __or__

    def __getitem__(self, item):  # generic aliases (`cachetools.LRUCache[K, V]`)
        return self

    def __mro_entries__(self, bases):  # a class deriving from one: from object alone
        return (object,)


class _EmptyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path, target=None):
        if any(name == n or name.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Empty(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _prepare_imports():
    absent = [n for n in ABSENT_OK if importlib.util.find_spec(n) is None]
    sys.meta_path.insert(0, _EmptyFinder(absent))
    import sglang.srt  # the package, from the wheel

    configs = types.ModuleType("sglang.srt.configs")
    configs.__path__ = [str(Path(list(sglang.srt.__path__)[0]) / "configs")]
    sys.modules[configs.__name__] = configs

    model_config = types.ModuleType("sglang.srt.configs.model_config")

    class ModelConfig:  # never built: the record carries the target's config (see above)
        @classmethod
        def from_server_args(cls, server_args, **kwargs):
            raise RuntimeError("the test hands the target's config to the record; ModelConfig is not built")

    model_config.ModelConfig = ModelConfig
    sys.modules[model_config.__name__] = model_config

    from transformers import AutoConfig

    hf_utils = types.ModuleType("sglang.srt.utils.hf_transformers_utils")

    def get_config(model, trust_remote_code=False, revision=None, **kwargs):
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)

    hf_utils.get_config = get_config
    sys.modules[hf_utils.__name__] = hf_utils


def resolve(line: str) -> dict:
    from transformers import AutoConfig

    from sglang.srt.arg_groups.overrides import _page_size_default, resolving_view, run_post_process_pass
    from sglang.srt.arg_groups.speculative_hook import handle_speculative_decoding
    from sglang.srt.server_args import prepare_server_args

    words = shlex.split(line)
    if words[:3] != PREFIX:
        return {"line": line, "error": "ValueError", "message": f"not an SGLang launch line (starts {words[:3]})"}
    try:
        args = prepare_server_args(words[3:])
        args._model_config = types.SimpleNamespace(hf_config=AutoConfig.from_pretrained(args.model_path))
        if args.device is None:
            args.device = "cuda"
        run_post_process_pass(args, _page_size_default)  # the pipeline's step before the hook (1 off MUSA / ROCm 5D)
        handle_speculative_decoding(args)
        view = resolving_view(args)
        fields = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                  "speculative_num_draft_tokens", "speculative_draft_model_path", "speculative_token_map")
        return {"line": line, **{name: getattr(view, name) for name in fields}}
    except (Exception, SystemExit) as e:  # argparse exits on an unknown flag
        return {"line": line, "error": type(e).__name__, "message": str(e)}


def main() -> int:
    lines = json.loads(Path(sys.argv[1]).read_text())
    _prepare_imports()
    print(json.dumps([resolve(line) for line in lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
