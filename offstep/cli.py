"""The ``offstep`` command.

    offstep train [key=value ...]     train (Hydra overrides over the typed config; preset=tiny)
    offstep train --cfg [overrides]   print the resolved config and exit
    offstep report RUN_DIR [RUN_DIR]  plots and summary.md of one run, or several compared
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _train(argv: list[str]) -> int:
    from offstep.config.loader import ConfigError, load_config, to_yaml
    from offstep.config.validate import validate

    show = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    try:
        cfg = load_config(overrides)
        validate(cfg)
    except ConfigError as e:
        print(f"offstep: {e}", file=sys.stderr)
        return 2
    if show:
        print(to_yaml(cfg))
        return 0
    from offstep.pipeline.controller import StalenessError, train
    from offstep.rewards.registry import RewardError

    try:
        history = train(cfg)
    except KeyboardInterrupt:
        print("offstep: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RewardError, StalenessError) as e:
        # Data, model and reward problems carry their fix in the message.
        print(f"offstep: {e}", file=sys.stderr)
        return 2
    last = [m for m in history if "reward/mean" in m]
    if last:
        print(f"offstep: done; metrics in {cfg.trainer.output_dir}/metrics.jsonl")
    return 0


def _report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="offstep report", description="plots and summary.md from run directories")
    parser.add_argument("runs", nargs="+", help="trainer.output_dir of one or more runs")
    parser.add_argument("--out", default=None, help="where to write (default: <first run>/report)")
    args = parser.parse_args(argv)
    from offstep.telemetry.report import write_report

    try:
        out = write_report(args.runs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"offstep: {e}", file=sys.stderr)
        return 2
    print(f"offstep: report in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="offstep", description="k-step off-policy RL post-training for LLMs")
    parser.add_argument("command", choices=["train", "report"], help="what to do")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "train":
        return _train(argv[1:])
    return _report(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
