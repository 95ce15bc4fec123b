"""Run by tests/test_dflash_external.py in a subprocess whose path holds z-lab's `dflash` package:
load a draftsmith `dflash` export with z-lab's own DFlashDraftModel, draft one block over the
given context and print its hidden states' path and the load report as JSON.

    python tests/dflash_forward.py EXPORT INPUTS.pt OUTPUT.pt
INPUTS.pt: {position_ids [1,T+B], noise_embedding [1,B,H], hidden_states: list of [1,T,H]}."""
import json
import sys

import torch


def main(export, inputs, output):
    from dflash.model import DFlashDraftModel, extract_context_feature

    model, info = DFlashDraftModel.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    model.eval()
    x = torch.load(inputs, weights_only=True)
    with torch.no_grad():
        context = extract_context_feature(x["hidden_states"], model.target_layer_ids)[:, : x["context_len"]]
        hidden = model(position_ids=x["position_ids"], noise_embedding=x["noise_embedding"], target_hidden=context)
    torch.save(hidden, output)
    print(json.dumps({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                      "target_layer_ids": list(model.target_layer_ids), "block_size": model.block_size,
                      "mask_token_id": model.mask_token_id,
                      "causal": [bool(layer.self_attn.is_causal) for layer in model.layers]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
