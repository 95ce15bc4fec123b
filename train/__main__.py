"""python -m train [--config configs/NAME.yaml] [dotted.key=value ...] [--resume [CKPT]] [--overwrite] [--print-config]

Without --config it runs configs/quickstart.yaml. Bad input (unknown key, wrong type or range,
missing file, layer id beyond the target, an out_dir holding another run) is one error line and
exit code 2, before any model loads.
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
    parser = _Parser(prog="python -m train", description="Train a speculative-decoding drafter.",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help=f"YAML recipe; unset: configs/{DEFAULT_CONFIG.name}")
    parser.add_argument("--resume", nargs="?", const="last", default=None,
                        help="continue from a checkpoint: a path, or the run's last checkpoint when none is given")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run already in out_dir (its checkpoints, logs and export) when training starts")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--prepare-only", action="store_true",
                        help="fetch and convert the target, tokenize the data and build the draft vocab, then exit")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.max_steps=100")
    args = parser.parse_args(argv)

    from train.config import ConfigError, load_config, to_yaml

    if args.resume is not None and args.overwrite:
        return _fail("--resume continues the run in out_dir and --overwrite replaces it: give one")

    config_path = args.config if args.config is not None else str(DEFAULT_CONFIG)
    try:
        cfg = load_config(config_path, args.overrides)
        resume = None
        if args.resume is not None:
            resume = str(Path(cfg.out_dir) / "checkpoints" / "last.ckpt") if args.resume == "last" else args.resume
            if not Path(resume).is_file():
                raise ConfigError(f"--resume: checkpoint {resume} does not exist")
    except ConfigError as e:
        return _fail(e)
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

    from train.callbacks import NonFiniteTraining
    from train.checkpoint_io import CheckpointError
    from train.run import run
    from train.run_folder import TrainingInterrupted, resume_command

    try:
        run(cfg, resume=resume, prepare_only=args.prepare_only, overwrite=args.overwrite)
    except (ConfigError, AssetError, DataError, CheckpointError, FileNotFoundError, NonFiniteTraining) as e:
        return _fail(e)
    except OSError as e:  # a full disk, a folder that vanished: one line, naming the file
        return _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else e)
    except TrainingInterrupted as e:
        where = f"the last checkpoint is {e.checkpoint}" if e.checkpoint.is_file() else "no checkpoint was written yet"
        print(f"interrupted at step {e.step}; {where}; continue with: "
              f"{resume_command(sys.argv[1:] if argv is None else list(argv))}", file=sys.stderr)
        return 130
    return 0


def _fail(message) -> int:
    print(f"error: {str(message).strip(chr(39))}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
