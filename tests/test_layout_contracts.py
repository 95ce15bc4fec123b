"""Each export layout owns what export.check holds it to (export/formats.py): what its writer
puts in config.json is what its own contract expects, and a config.json edited away from it is
named. Runs on configs alone (no training, no tensors)."""
import copy

import pytest
from transformers import AutoConfig

from export import dflash, eagle1, medusa, mtp, sglang, speculators
from export.formats import layout_modules
from models.dflash import DFlashConfig
from models.eagle1 import Eagle1Config
from models.eagle3 import Eagle3Config
from models.layers import rope_config
from models.medusa import MedusaConfig
from models.mtp import MTPConfig

K = 3


@pytest.fixture(scope="module")
def hf():
    from models.zoo import resolve_target

    return AutoConfig.from_pretrained(resolve_target("tiny-random-llama"))


def _written(hf) -> list:
    """(layout module, method, trained drafter config, config.json as the writer writes it)."""
    V, arch = hf.vocab_size, list(hf.architectures or [])
    e3 = Eagle3Config.from_target(hf, V // 2, norm_before_fc=True)
    df = DFlashConfig.from_target(hf, V // 2, mask_token_id=5, num_layers=2, block_size=4, target_layer_ids=[0, 1])
    e1 = Eagle1Config.from_target(hf, V // 2)
    md = MedusaConfig.from_target(hf, V, num_heads=3)
    mt = MTPConfig.from_target(hf, V, num_modules=2)
    return [(speculators, "eagle3", e3, speculators.speculators_config(e3, "tiny-random-llama", arch, K, "bfloat16")),
            (speculators, "dflash", df, speculators.dflash_speculators_config(df, "tiny-random-llama", arch, "bfloat16")),
            (sglang, "eagle3", e3, sglang.sglang_config(e3, "tiny-random-llama")),
            (eagle1, "eagle1", e1, eagle1.eagle1_config(e1, "tiny-random-llama")),
            (medusa, "medusa", md, medusa.medusa_config(md, "tiny-random-llama")),
            (mtp, "mtp", mt, {**hf.to_dict(), "num_nextn_predict_layers": mt.num_modules}),
            (dflash, "dflash", df, dflash.dflash_config(df, "tiny-random-llama"))]


def test_every_shipped_layout_states_its_contract():
    for layout in layout_modules():
        assert callable(layout.served_facts) and callable(layout.expected_facts), layout.__name__
        assert isinstance(layout.REQUIRED_KEYS, (tuple, dict)), layout.__name__


def test_what_each_writer_writes_is_what_its_contract_expects(hf):
    for layout, method, trained, config in _written(hf):
        served = layout.served_facts(config)
        expected = layout.expected_facts(method, trained.to_dict(), K)
        assert expected, (layout.__name__, method)
        for name, (want, why) in expected.items():
            assert served[name] == want and type(served[name]) is type(want), (layout.__name__, method, name)
        required = layout.REQUIRED_KEYS[method] if isinstance(layout.REQUIRED_KEYS, dict) else layout.REQUIRED_KEYS
        assert set(required) <= set(config), (layout.__name__, method)
        # the target's shape, where the layout states it, is the target's
        assert served["vocab_size"] == hf.vocab_size and served["hidden_size"] == hf.hidden_size, layout.__name__
        if "rope_theta" in served:
            assert float(served["rope_theta"]) == float(rope_config(hf)[0]), layout.__name__


@pytest.mark.parametrize("layout,method,key", [(speculators, "eagle3", "norm_output"), (speculators, "dflash", "sample_from_anchor"),
                                               (sglang, "eagle3", "norm_before_residual"), (eagle1, "eagle1", "bias"),
                                               (medusa, "medusa", "num_heads"), (mtp, "mtp", "num_nextn_predict_layers"),
                                               (dflash, "dflash", "block_size")])
def test_a_config_json_edited_away_from_the_contract_is_named(hf, tmp_path, layout, method, key):
    import json

    from export.check import served_problems

    _, _, trained, config = next(w for w in _written(hf) if w[0] is layout and w[1] == method)
    meta = {"method": method, "drafter_config": trained.to_dict(), "training_config": {"eval": {"k": K}}}

    def problems(config):
        (tmp_path / "config.json").write_text(json.dumps(config))
        return served_problems(tmp_path, layout, meta, config)

    assert problems(config) == []  # as written: the served drafter is the trained one, every fact as expected
    edited = copy.deepcopy(config)
    edited[key] = 7 if isinstance(edited.get(key), int) and not isinstance(edited.get(key), bool) else True
    assert any(p.startswith(f"{key}: config.json says") for p in problems(edited)), problems(edited)
