"""python -m train [--config configs/NAME.yaml] [dotted.key=value ...] [--resume [CKPT]] [--print-config]

Without --config it runs configs/quickstart.yaml. Bad input (unknown key, wrong type, missing
file, layer id beyond the target) is one error line and exit code 2, before any model loads.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    parser = _Parser(prog="python -m train", description="Train a speculative-decoding drafter.")
    parser.add_argument("--config", default=None, help=f"YAML recipe (default: {DEFAULT_CONFIG.name})")
    parser.add_argument("--resume", nargs="?", const="last", default=None,
                        help="continue from a checkpoint: a path, or the run's last checkpoint when none is given")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--prepare-only", action="store_true",
                        help="fetch and convert the target, tokenize the data and build the draft vocab, then exit")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.max_steps=100")
    args = parser.parse_args(argv)

    from train.config import ConfigError, load_config, to_yaml

    config_path = args.config if args.config is not None else str(DEFAULT_CONFIG)
    try:
        cfg = load_config(config_path, args.overrides)
        resume = None
        if args.resume is not None:
            resume = str(Path(cfg.out_dir) / "checkpoints" / "last.ckpt") if args.resume == "last" else args.resume
            if not Path(resume).is_file():
                raise ConfigError(f"--resume: checkpoint {resume} does not exist")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import warnings

    # the frozen target is in eval mode on purpose; the other one is a Lightning-internal notice
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    for noisy in ("httpx", "urllib3", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from models.zoo import AssetError
    from data.sources import DataError

    from train.run import run

    try:
        run(cfg, resume=resume, prepare_only=args.prepare_only)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (AssetError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
