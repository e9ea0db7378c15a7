"""The ``offstep`` command.

offstep train [key=value ...]     train (Hydra overrides over the typed config; preset=tiny)
offstep train --cfg [overrides]   print the resolved config and exit
offstep train --cfg --gpus N ...  the same, checked as if N GPUs were visible on each node
offstep report RUN_DIR [RUN_DIR]  plots and summary.md of one run, or several compared
offstep eval MODEL --data FILE    accuracy and reward per data source of a model folder, alias or run
offstep export RUN_DIR --out DIR  the policy of a run checkpoint as a Hugging Face model folder
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _say(e: BaseException) -> None:
    """An error's message on stderr, its control characters (escape codes of a file's text) shown escaped."""
    from offstep.files import printable

    print(f"offstep: {printable(str(e))}", file=sys.stderr)


def _unwrap(e: BaseException) -> BaseException:
    """The exception a Ray worker raised, without Ray's wrapper (whose text is a traceback)."""
    exceptions = sys.modules.get("ray.exceptions")
    while exceptions is not None and isinstance(e, exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if not isinstance(cause, BaseException):
            break
        e = cause
    return e


def _gpus_flag(argv: list[str], show: bool) -> tuple[int | None, list[str]]:
    """``--gpus N`` (or ``--gpus=N``) and the arguments without it; ConfigError naming the fix."""
    from offstep.errors import ConfigError

    rest, gpus, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--gpus" or arg.startswith("--gpus="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit():
                raise ConfigError(f"--gpus {value!r}: give the GPUs of each node as a whole number, e.g. --gpus 8")
            gpus = int(value)
            continue
        rest.append(arg)
        i += 1
    if gpus is not None and not show:
        raise ConfigError(
            f"--gpus {gpus} only checks a config (offstep train --cfg --gpus {gpus} ...): a run uses the "
            f"GPUs it finds. Fix: add --cfg, or drop --gpus"
        )
    return gpus, rest


def _visible_gpus(gpus: int | None):
    """Within it, the config is resolved and checked as if ``gpus`` GPUs were on each node."""
    from contextlib import nullcontext

    from offstep.config.machine import simulated_gpus

    return nullcontext() if gpus is None else simulated_gpus(gpus)


def _nodes(overrides: list[str]) -> int:
    from offstep.launch.verl.layout import nodes_of

    return nodes_of(overrides)


def train_command(argv: list[str], on_phase=None) -> int:
    """``offstep train ARGV``: its exit code. ``on_phase``: see ``offstep.pipeline.controller.train``."""
    if "--help" in argv or "-h" in argv:
        from offstep.launch.help import print_help
        from offstep.launch.verl.keyhelp import describe

        return print_help(argv, describe)
    from offstep.config.schema import to_yaml
    from offstep.errors import ConfigError
    from offstep.launch.loader import load_config
    from offstep.launch.preflight import simulated_notes, validate
    from offstep.pipeline.ray_address import check_ray_address

    show = "--cfg" in argv
    try:
        gpus, argv = _gpus_flag(argv, show)
    except ConfigError as e:
        _say(e)
        return 2
    overrides = [a for a in argv if a != "--cfg"]
    try:
        with _visible_gpus(gpus):
            errors: list[str] = []  # verl's refusals, reported with offstep's own checks in one pass
            cfg = load_config(overrides, errors=errors)
            validate(cfg, gpu_count=None if gpus is None else gpus * _nodes(overrides), earlier=errors)
            said = simulated_notes(cfg)
        if said:
            print("offstep: " + "\n  ".join(said), file=sys.stderr)
        if not show:
            check_ray_address(cfg.resources.ray_address)  # seconds, not the minutes of data preparation
    except ConfigError as e:
        _say(e)
        return 2
    if show:
        print(to_yaml(cfg))
        return 0
    from offstep.errors import OffstepError
    from offstep.pipeline.controller import train
    from offstep.telemetry.names import Reward

    try:
        history = train(cfg, on_phase=on_phase)  # checked above, once, with the verl keys' refusals
    except KeyboardInterrupt:
        print("offstep: interrupted", file=sys.stderr)
        return 130
    except OffstepError as e:
        # offstep's own errors carry their fix in the message; a worker's traceback would only bury
        # it. Anything else is a bug and keeps its traceback.
        cause = _unwrap(e)
        _say(cause)
        return getattr(cause, "exit_code", 2)
    steps = [m["step"] for m in history if Reward.MEAN in m]
    if steps and steps[-1] < cfg.trainer.total_steps:  # stopped by Ctrl-C / SIGTERM between steps
        print(
            f"offstep: stopped at step {steps[-1]} of {cfg.trainer.total_steps}; continue with the same command "
            f"(trainer.resume=auto picks up the last checkpoint)",
            file=sys.stderr,
        )
        return 130
    if steps:
        print(f"offstep: done; metrics in {cfg.trainer.output_dir}/metrics.jsonl")
    return 0


def _report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="offstep report", description="plots and summary.md from run directories")
    parser.add_argument("runs", nargs="+", help="trainer.output_dir of one or more runs")
    parser.add_argument("--out", default=None, help="where to write (default: <first run>/report)")
    args = parser.parse_args(argv)
    from offstep.errors import OffstepError
    from offstep.telemetry.report import write_report

    try:
        out = write_report(args.runs, args.out)
    except OffstepError as e:
        _say(e)
        return 2
    print(f"offstep: report in {out}")
    return 0


def _eval(argv: list[str]) -> int:
    from offstep.config.choices import TOOL_FORMATS

    parser = argparse.ArgumentParser(prog="offstep eval", description="accuracy and reward per data source")
    parser.add_argument(
        "model",
        help="a local Hugging Face model folder, a peft adapter folder (merged onto its "
        "base), an alias (smollm2-135m-instruct, tiny), or a run directory / checkpoint (its latest policy)",
    )
    parser.add_argument(
        "--best",
        nargs="?",
        const="val/acc",
        default=None,
        metavar="METRIC",
        help="with a run directory: its checkpoint whose step scored the highest METRIC at its "
        "validation (default val/acc) instead of its latest",
    )
    parser.add_argument("--data", required=True, help="verl parquet or JSONL file")
    parser.add_argument(
        "--max-rows",
        type=int,
        default=10_000_000,
        help="rows the file may hold at most, checked before it is read (0: no limit; data.max_rows)",
    )
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (best@n is reported for n > 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-key", default="prompt")
    parser.add_argument("--answer-key", default=None)
    parser.add_argument("--max-prompt-length", type=int, default=1024)
    parser.add_argument("--reward-path", default=None, help="a file with compute_score(...) (verl signature)")
    parser.add_argument("--reward-name", default="compute_score")
    parser.add_argument(
        "--reward-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds one scorer call may take before eval stops with the sample named (0: no limit)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per generation call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="eval_results.json", help="results file (JSON)")
    parser.add_argument(
        "--tools",
        default=None,
        metavar="NAMES",
        help="answer the file's tool_agent rows with these tools (comma-separated; rollout.agent.tools), "
        "e.g. calculator; without it every row is answered in one turn",
    )
    parser.add_argument(
        "--tools-path", default=None, help="the Python file defining the tools (rollout.agent.tools_path)"
    )
    parser.add_argument("--tool-format", default="tag", choices=list(TOOL_FORMATS), help="rollout.agent.format")
    parser.add_argument("--max-turns", type=int, default=4, help="rollout.agent.max_turns")
    parser.add_argument(
        "--tool-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds a tool call (and the import of --tools-path) may take (rollout.agent.tool_timeout_s)",
    )
    args = parser.parse_args(argv)
    # The flags are checked here, before anything loads (the engine refuses them only after the model has).
    import math

    from offstep.launch.validate import temperature_problem

    at_least_one = {
        "--n": (args.n, "samples per prompt"),
        "--batch-size": (args.batch_size, "prompts per generation call, e.g. 32"),
        "--max-new-tokens": (args.max_new_tokens, "response tokens at most, e.g. 64"),
        "--max-prompt-length": (args.max_prompt_length, "prompt tokens at most, e.g. 1024"),
        "--max-turns": (args.max_turns, "model turns per sample at most, e.g. 4"),
    }
    for flag, (value, what) in at_least_one.items():
        if value < 1:
            parser.error(f"{flag} {value} must be >= 1 ({what})")
    if problem := temperature_problem(args.temperature, "--temperature"):
        parser.error(problem)
    if not 0 < args.top_p <= 1:
        parser.error(
            f"--top-p {args.top_p:g} must be in (0, 1]: the probability mass sampled from (1: all of it), "
            "e.g. --top-p 0.9"
        )
    if not (math.isfinite(args.reward_timeout) and args.reward_timeout >= 0):
        parser.error(f"--reward-timeout {args.reward_timeout:g} must be a number of seconds >= 0 (0: no limit)")
    if not (math.isfinite(args.tool_timeout) and args.tool_timeout > 0):
        parser.error(f"--tool-timeout {args.tool_timeout:g} must be a number of seconds > 0, e.g. 10")
    import json

    from offstep.pipeline.evaluation import run_eval

    def progress(done: int, total: int) -> None:
        print(f"offstep eval: {done}/{total} prompts", file=sys.stderr, flush=True)

    from offstep.config.schema import AgentConfig
    from offstep.errors import OffstepError
    from offstep.pipeline.export import best_step, model_for_eval

    agent = None
    if args.tools:
        agent = AgentConfig(
            tools=args.tools.split(","),
            tools_path=args.tools_path,
            format=args.tool_format,
            max_turns=args.max_turns,
            tool_timeout_s=args.tool_timeout,
        )
    try:
        model = model_for_eval(args.model, best_step(args.model, args.best) if args.best else None)
        metrics, samples = run_eval(
            model,
            args.data,
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            prompt_key=args.prompt_key,
            answer_key=args.answer_key,
            max_prompt_length=args.max_prompt_length,
            reward_path=args.reward_path,
            reward_name=args.reward_name,
            reward_timeout=args.reward_timeout or None,
            batch_size=args.batch_size,
            seed=args.seed,
            on_progress=progress,
            agent=agent,
            max_rows=args.max_rows,
        )
    except OffstepError as e:
        _say(e)
        return 2
    result = {
        "model": args.model,
        "data": args.data,
        "n": args.n,
        "temperature": args.temperature,
        "metrics": metrics,
        "samples": [
            {
                "uid": s.uid,
                "data_source": s.data_source,
                "response": s.text,
                "score": s.score,
                **({"turns": s.agent.turns, "tool_calls": s.agent.tool_calls} if s.agent is not None else {}),
            }
            for s in samples
        ],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for k, v in metrics.items():
        print(f"{k:<40} {v:.4f}")
    print(f"offstep: results in {args.out}")
    return 0


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="offstep export", description="a run checkpoint as a Hugging Face model folder"
    )
    parser.add_argument("run", help="a run directory (trainer.output_dir) or one of its checkpoints/step_<N> folders")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="which checkpoint (default: the latest)")
    which.add_argument(
        "--best",
        nargs="?",
        const="val/acc",
        default=None,
        metavar="METRIC",
        help="the checkpoint whose step scored the highest METRIC at its validation (default val/acc; "
        "trainer.keep_best keeps it)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="the folder to write (safetensors, config, tokenizer); it must not exist or be empty",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty --out (deleted only once the new folder is in place)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the base model folder or alias (default: the checkpoint's "
        "model.path, which must be an alias or a local folder)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: the base model with the adapters merged in "
        "(a plain Hugging Face folder) instead of a peft adapter folder",
    )
    args = parser.parse_args(argv)
    from offstep.errors import OffstepError
    from offstep.pipeline.export import best_step, export_checkpoint

    try:
        step = best_step(args.run, args.best) if args.best else args.step
        out = export_checkpoint(args.run, args.out, step, force=args.force, base=args.model, merge=args.merge)
    except OffstepError as e:
        _say(e)
        return 2
    print(f"offstep: model written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] in (["train"], ["eval"]):  # the process's own command, not a call in-process
        from offstep import reaper

        reaper.guard_command()  # what a reward, tool or agent file starts ends with the command
        return reaper.end_command(_main(sys.argv[1:]))
    return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="offstep", description="k-step off-policy RL post-training for LLMs")
    parser.add_argument("command", choices=["train", "report", "eval", "export"], help="what to do")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "train":
        return train_command(argv[1:])
    if args.command == "eval":
        return _eval(argv[1:])
    if args.command == "export":
        return _export(argv[1:])
    return _report(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
