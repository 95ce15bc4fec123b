"""The proposer interface is typing.Protocols with declared capabilities (inference/proposers/
base.py): every shipped proposer speaks the protocols its declarations promise, the runtime
reads those declarations through `capabilities` alone, and a proposer that declares what it
does not implement is refused in one line."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from inference.proposers import (DeviceProposer, HostProposer, NgramProposer, GpuNgramProposer, SuffixProposer,
                                 TreeProposer, capabilities, drafter_proposer)
from inference.proposers.base import NONE

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def drafter_proposers(tiny_target):
    from inference.runtime.model import RuntimeModel
    from inference.tree.loop import EagleTreeProposer
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.medusa import MedusaConfig, MedusaDrafter
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_target)
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(0)
    eagle = Eagle3Drafter(Eagle3Config.from_target(hf, hf.vocab_size)).eval()
    medusa = MedusaDrafter(MedusaConfig.from_target(hf, hf.vocab_size, 3)).eval()
    return {"eagle3": drafter_proposer(eagle, 3, 1, 64, rt.config), "medusa": drafter_proposer(medusa, 3, 1, 64, rt.config),
            "tree": EagleTreeProposer(eagle, 2, 2, 4, 1, 64, rt.config)}


def test_shipped_proposers_declare_what_they_implement(drafter_proposers):
    host = [NgramProposer(3), SuffixProposer(3)]
    for p in host:
        caps = capabilities(p)
        assert isinstance(p, HostProposer) and not caps.on_device and not caps.tree and caps.aux_layers == ()
    assert capabilities(SuffixProposer(3)).end and not capabilities(NgramProposer(3)).end  # suffix caches responses
    gpu = capabilities(GpuNgramProposer(3, 1, 16))
    assert gpu.on_device and not gpu.draft_sampled and not gpu.tree
    for name in ("eagle3", "medusa"):
        p = drafter_proposers[name]
        caps = capabilities(p)
        assert isinstance(p, DeviceProposer) and caps.on_device and caps.draft_sampled and caps.propose_sampled
        assert not caps.tree and caps.verify_tokens is None and caps.aux_layers
    tree = capabilities(drafter_proposers["tree"])
    assert isinstance(drafter_proposers["tree"], TreeProposer)
    assert tree.tree and tree.feeds_verify and tree.verify_tokens == 4 and tree.begin_graphed
    assert capabilities(None) == NONE


def test_a_proposer_declaring_what_it_lacks_is_refused_in_one_line():
    class Half:
        k, on_device = 2, True

        def begin(self, *a):
            pass

        def draft(self):
            return torch.zeros(1, 2, dtype=torch.long)

    with pytest.raises(TypeError, match=r"Half \(on_device = True\) lacks advance, drafts of the DeviceProposer interface"):
        capabilities(Half())

    class HostOnly:
        k = 2

        def begin(self, *a):
            pass

    with pytest.raises(TypeError, match=r"HostOnly \(on_device = False\) lacks accepted, propose of the HostProposer"):
        capabilities(HostOnly())


def test_the_runtime_probes_no_proposer_with_getattr():
    probes = re.compile(r"(getattr|hasattr)\((self\.)?proposer\b")
    found = [f"{path.relative_to(ROOT)}:{i}" for folder in ("inference/runtime", "inference/tree")
             for path in (ROOT / folder).glob("*.py")
             for i, line in enumerate(path.read_text().splitlines(), 1) if probes.search(line)]
    assert not found  # capabilities(proposer) reads the declarations (inference/proposers/base.py)
