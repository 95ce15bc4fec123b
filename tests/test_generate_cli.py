import json
import subprocess
import sys

import pytest

from tests.conftest import run_module


def _command(*args):
    """`python -m inference.generate ARGS` in a process of its own (import-time output included)."""
    return subprocess.run([sys.executable, "-m", "inference.generate", *args], capture_output=True, text=True, timeout=300)


def _run(*args, command: bool = False):
    """The same in this process (tests.conftest.run_module), unless `command`: seconds of imports saved a call."""
    return _command(*args) if command else run_module("inference.generate", *args)


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_generate_prints_text_and_stats(tiny_target, temperature, tmp_path):
    metrics = tmp_path / "metrics.prom"
    res = _run("--target", "tiny-random-llama", "--prompt", "hello there", "--max-new-tokens", "8", "--stats",
               "--temperature", temperature, "--prometheus", str(metrics), command=temperature == "0")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "draftsmith_spec_decode_num_draft_tokens_total" in metrics.read_text()
    stats = json.loads(res.stderr.strip().splitlines()[-1])
    assert stats["new_tokens"] == 8 and stats["k"] == 4 and "acceptance" in stats
    assert stats["kernels"] == "auto"  # the kernel setting the answer was made with (--kernels)


@pytest.mark.parametrize("args,message", [
    (["--prompt", "x", "--temperature", "-1"], "--temperature: must be >= 0"),
    (["--prompt", "x", "--proposer", "eagle3"], "--drafter: the eagle3 proposer needs an export folder"),
    (["--prompt", "x", "--drafter", "/no/such"], "--drafter: /no/such is not an export folder"),
    (["--prompt", "x", "--proposer", "dflash"], "invalid choice: 'dflash'"),
    (["--chat", "/no/such.json"], "--chat: /no/such.json is not a JSON list"),
    (["--prompt", "x", "-k", "0"], "-k: must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    res = _run(*args, command=args[-1] == "dflash")  # one as a command: nothing else reaches stderr on the way
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
