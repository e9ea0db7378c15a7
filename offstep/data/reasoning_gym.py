"""A reasoning-gym dataset exported as verl parquet, the rows that ``data.task=reasoning_gym`` trains on
for the same seed and options (``offstep.data.reasoning_gym_task``):

    python -m offstep.data.reasoning_gym --name leg_counting --out data/legs --train-size 400 --val-size 100 \\
        --option max_animals=2

writes ``data/legs/train.parquet`` and ``data/legs/val.parquet``. verl reads them as they are; a reward
function for verl that scores them with the dataset's own verifier is :func:`compute_score`
(``custom_reward_function.path=<this file> custom_reward_function.name=compute_score``).
"""

from __future__ import annotations

import argparse
import json
import sys

from offstep.data.reasoning_gym_task import DEFAULT_PROMPT
from offstep.data.tasks import write_task
from offstep.rewards.reasoning_gym_scorer import reasoning_gym_score as compute_score

__all__ = ["compute_score", "export", "main"]


def export(name: str, out_dir: str, train_size: int, val_size: int, seed: int = 0, **options) -> tuple[str, str]:
    """Write ``<out_dir>/train.parquet`` and ``<out_dir>/val.parquet``; returns their paths."""
    return write_task("reasoning_gym", out_dir, train_size, val_size, seed, name=name, **options)


def _options(items: list[str], ap: argparse.ArgumentParser) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--option {item!r}: write KEY=VALUE, e.g. --option max_animals=2")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value  # a plain word
    return options


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offstep.data.reasoning_gym",
        description="write a reasoning-gym dataset as verl parquet: OUT/train.parquet, OUT/val.parquet",
    )
    ap.add_argument("--name", required=True, help="a reasoning-gym dataset, e.g. leg_counting")
    ap.add_argument("--out", required=True, help="the folder to write into")
    ap.add_argument("--train-size", type=int, default=1000)
    ap.add_argument("--val-size", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--system-prompt",
        default=DEFAULT_PROMPT,
        help="a name of reasoning_gym.utils.SYSTEM_PROMPTS (direct, default, simple, ...) or the text",
    )
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the dataset's config, VALUE read as JSON where it parses: max_animals=2, "
        "'operators=[\"+\", \"-\"]'",
    )
    args = ap.parse_args(argv)
    try:
        paths = export(
            args.name,
            args.out,
            args.train_size,
            args.val_size,
            args.seed,
            system_prompt=args.system_prompt,
            **_options(args.option, ap),
        )
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
