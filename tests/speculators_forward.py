"""Run as a script by test_speculators_external.py (a separate process: importing speculators
registers its classes with transformers). Loads a draftsmith speculators-layout EAGLE-3 export
with the `speculators` package's own config and model classes, without any verifier, and
prints JSON: the tensors that package found missing / unexpected, and the largest difference
between its first draft step's logits and draftsmith's on the same inputs. Then the other way
round: the package saves its model (its own config.json and tensor set, no draftsmith.json),
draftsmith reads that folder, and the same comparison is made.

    python tests/speculators_forward.py EXPORT_DIR SCRATCH_DIR [STEPS]

STEPS (default 1): that many teacher-forced TTT steps are compared, each step's logits (the
package feeds step s the tokens shifted by 1 + s, as draftsmith's unroll does); more than one
exercises what a step feeds the next (EAGLE-3.1's norm_output).
"""
import importlib.abc
import importlib.machinery
import json
import sys
import types


class _TrainingOnlyStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """speculators' model modules import its training data pipeline, which imports `openai`
    and `hs_connectors` (dataset download clients) at module level; the models never call
    them. Empty modules stand in, so the check needs neither."""

    names = ("openai", "hs_connectors")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {})
        return module

    def exec_module(self, module):
        pass


def main(folder: str, scratch: str, steps: int = 1):
    sys.meta_path.insert(0, _TrainingOnlyStub())
    import torch
    from safetensors.torch import load_file
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except ModuleNotFoundError as e:  # a dependency of the package this environment lacks
        print(json.dumps({"unavailable": f"speculators needs {e.name}"}))
        return

    from export.load import load_export
    from models.eagle3 import shift_left

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: a dense mask, no flex attention
    theirs = Eagle3DraftModel(config).float().eval()
    missing, unexpected = theirs.load_state_dict(load_file(f"{folder}/model.safetensors"), strict=False)

    ours = load_export(folder).float().eval()
    torch.manual_seed(0)
    T = 24
    ids = torch.randint(0, ours.config.vocab_size, (1, T))
    aux = torch.randn(1, T, ours.config.target_hidden_size * len(ours.aux_layer_ids))
    captured = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        mine = ours.unroll(ids, aux, steps)  # step 0 at t: reads x_{t+1}, drafts x_{t+2}
        # speculators pairs the feature at t with input_ids[t]: hand it the next tokens
        theirs(hidden_states=aux, input_ids=shift_left(ids, 1), document_ids=torch.zeros(1, T, dtype=torch.long),
               ttt_steps=steps)
    # step s's last s positions read padding in both: compared up to T - s
    diff = max((captured[s] - mine[s])[:, : T - s].abs().max().item() for s in range(steps))

    theirs.save_pretrained(scratch)  # the package's own folder: its config.json, its tensor set
    back = load_export(scratch).float().eval()
    with torch.no_grad():
        diff_back = max((b - captured[s])[:, : T - s].abs().max().item()
                        for s, b in enumerate(back.unroll(ids, aux, steps)))
    print(json.dumps({"missing": sorted(missing), "unexpected": sorted(unexpected), "max_abs_diff": diff,
                      "logits_scale": max(m.abs().max().item() for m in mine), "positions": T, "steps": steps,
                      "their_folder_read_by_draftsmith_max_abs_diff": diff_back}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
