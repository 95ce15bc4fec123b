"""Every `python -m ...` command in the README's code blocks is accepted by its command line as
written: its flags exist and take the values shown, and `python -m train`'s overrides name fields
of the resolved config. Nothing runs past the parsing."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split(" # ")[0].strip()
            for part in line.split("&&"):
                words = shlex.split(part)
                if words[:2] == ["python", "-m"] and words[2] != "pytest":
                    out.append(words[2:])
    return out


class _Parsed(Exception):
    pass


def test_the_readme_shows_commands():
    modules = {c[0] for c in _commands()}
    assert {"train", "export", "export.check", "inference.validate", "inference.bench"} <= modules


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c)[:60])
def test_readme_command_parses(command, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parsed = parse(self, args, namespace)
        raise _Parsed(parsed)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = importlib.import_module(command[0])
    if not hasattr(module, "main"):  # a package run as `python -m`: its __main__
        module = importlib.import_module(command[0] + ".__main__")
    main = module.main
    with pytest.raises(_Parsed) as parsed:
        main(command[1:])
    if command[0] == "train":
        from train.__main__ import DEFAULT_CONFIG
        from train.config import load_config

        ns = parsed.value.args[0]
        load_config(ns.config or str(DEFAULT_CONFIG), ns.overrides or [])  # unknown keys, bad values raise
