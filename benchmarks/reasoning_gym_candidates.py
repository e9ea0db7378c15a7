"""The base model on reasoning-gym candidates: held-out accuracy, greedy, as training validates (the same
rows, prompt, scorer and token budget), to pick the task of ``preset=reasoning_gym``: one the model
starts on between 10% and 50%.

    .venv/bin/python -m benchmarks.reasoning_gym_candidates                 # every candidate below
    .venv/bin/python -m benchmarks.reasoning_gym_candidates --only leg_counting_1

Writes ``benchmarks/results/results_reasoning_gym_candidates.md`` (a rerun of some candidates keeps the others' rows).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, cpu_kind

# label: (dataset, options): easy settings, where a 135M model may answer some
CANDIDATES = {
    "leg_counting_1": ("leg_counting", {"min_animals": 1, "max_animals": 1}),
    "leg_counting_2": ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 5}),
    "basic_arithmetic_1d": (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    ),
    "chain_sum_1d": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "chain_sum_2d": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "products_1d": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "letter_counting_3w": ("letter_counting", {"min_words": 1, "max_words": 3}),
    "letter_counting_6w": ("letter_counting", {"min_words": 3, "max_words": 6}),
    "number_sorting_3": ("number_sorting", {"min_numbers": 3, "max_numbers": 3, "max_decimals": 0}),
    "spell_backward_3to5": ("spell_backward", {"min_word_len": 3, "max_word_len": 5}),
    "count_bits_small": ("count_bits", {"min_n": 1, "max_n": 63}),
    "word_sequence_reversal_3": ("word_sequence_reversal", {"min_words": 3, "max_words": 3}),
    "gcd_small": ("gcd", {"min_value": 1, "max_value": 30}),
}


def measure(label: str, rows: int, max_new_tokens: int, prompt: str, train: int, example: bool) -> dict | None:
    from offstep.data.reasoning_gym import export
    from offstep.pipeline.evaluation import run_eval

    name, options = CANDIDATES[label]
    with tempfile.TemporaryDirectory() as tmp:
        # the held-out rows of a seed-0 run with `train` training rows
        try:
            _, val = export(name, tmp, train, rows, 0, system_prompt=prompt, example=example, **options)
        except ValueError as exc:  # too few distinct problems
            print(f"{label}: {exc}", flush=True)
            return None
        t0 = time.time()
        metrics, samples = run_eval("smollm2-135m-instruct", val, max_new_tokens=max_new_tokens, threads=1)
    tagged = sum("</answer>" in s.text for s in samples) / len(samples)
    return {
        "label": label,
        "dataset": name,
        "options": options,
        "prompt": prompt,
        "example": example,
        "train": train,
        "rows": rows,
        "max_new_tokens": max_new_tokens,
        "acc": metrics["acc"],
        "reward": metrics["reward/mean"],
        "tagged": tagged,
        "sample": samples[0].text[:120],
        "seconds": time.time() - t0,
        "load": round(os.getloadavg()[0], 1),
        "cpu": cpu_kind(),
    }


def write(rows: list[dict], out: Path) -> None:
    lines = [
        "# reasoning-gym candidates: SmolLM2-135M-Instruct before training",
        "",
        "Held-out accuracy, greedy, on the validation rows a seed-0 run of `data.task=reasoning_gym` makes after "
        "`train` training rows, with the preset's budget of new tokens; `tagged`: the share of replies holding `</answer>` "
        "(no tags: score 0). One core for generation. Regenerate: `.venv/bin/python -m benchmarks.reasoning_gym_candidates`.",
        "",
        "| candidate | dataset | options | system prompt | example | train | rows | new tokens | acc | reward | tagged | s | CPU | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['dataset']} | `{json.dumps(r['options'])}` | {r['prompt']} | {r.get('example', False)} | {r['train']} | {r['rows']} | "
            f"{r['max_new_tokens']} | {100 * r['acc']:.0f}% | {r['reward']:.2f} | {100 * r['tagged']:.0f}% | "
            f"{r['seconds']:.0f} | {r['cpu']} | {r['load']} |"
        )
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated candidate labels")
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument(
        "--train", type=int, default=200, help="training rows before the held-out ones (as data.task_train_size)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument(
        "--prompt", default="direct", help="system_prompt: a name of reasoning_gym's SYSTEM_PROMPTS or text"
    )
    ap.add_argument(
        "--example", action="store_true", help="one solved item as a demonstration turn (task option example)"
    )
    ap.add_argument("--out", default=str(RESULTS / "results_reasoning_gym_candidates.md"))
    ap.add_argument("--json", default=str(RESULTS / "results_reasoning_gym_candidates.jsonl"))
    args = ap.parse_args()
    path = Path(args.json)
    done = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    for label in args.only.split(",") if args.only else list(CANDIDATES):
        row = measure(label, args.rows, args.max_new_tokens, args.prompt, args.train, args.example)
        if row is None:
            continue
        key = lambda r: (r["label"], r["prompt"], r.get("example", False), r["max_new_tokens"])  # noqa: E731
        done = [r for r in done if key(r) != key(row)] + [row]
        path.write_text("".join(json.dumps(r) + "\n" for r in done))
        print(json.dumps(row), flush=True)
        write(done, Path(args.out))


if __name__ == "__main__":
    main()
