"""How well SmolLM2-135M-Instruct judges the arithmetic task's answers, against the rule that knows.

    .venv/bin/python -m benchmarks.judge_agreement                 # 64 problems, 2 answers each
    .venv/bin/python -m benchmarks.judge_agreement --problems 16   # a quick look

The untrained policy (the default preset's model) answers held-out problems of the default
preset's task (``arithmetic``, one digit) with its token budget at temperature 1, so both right and
wrong answers come up; the task's rule
scores each (1: the final number is right). The generative judge of ``reward.model.kind=generative``
(offstep.rollout.scoring.replica_reward_model.JudgeScorer, the same code the runs use, greedy) then scores every
(question, response, ground truth) once per template and parser below. Reported per judge
setting: agreement with the rule (a judge score >= 0.5 counts as "right"), the confusion counts,
Cohen's kappa, the share of answers the parser could not read (those get the fallback score 0 in
a run), and the judge's seconds per sample. Writes ``benchmarks/results/results_judge.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.common import RESULTS, cpu_kind, provenance
from benchmarks.readme import refresh

# (name, reward.model.template, parser): the shipped default first
SETTINGS = [("default template, last_number", "score", "last_number"), ("yes/no template, yes_no", "yes_no", "yes_no")]


def policy_answers(model: str, problems: int, n: int, seed: int, out: Path) -> tuple[list[dict], list]:
    """Held-out arithmetic problems and the policy's sampled answers, rule-scored."""
    import pyarrow.parquet as pq

    from offstep.data.tasks import write_task
    from offstep.launch.loader import load_config
    from offstep.pipeline.evaluation import run_eval

    d, ro = (cfg := load_config([])).data, cfg.rollout  # the default preset's task and token budget
    _, val = write_task(d.task, str(out), 8, problems, seed, **d.task_options)
    rows = pq.read_table(val).to_pylist()
    _, samples = run_eval(
        model, val, n=n, temperature=ro.temperature, max_new_tokens=ro.max_new_tokens, threads=os.cpu_count(), seed=seed
    )
    return rows, samples


def cohen_kappa(a: list[int], b: list[int]) -> float:
    agree = sum(x == y for x, y in zip(a, b)) / len(a)
    pa, pb = sum(a) / len(a), sum(b) / len(b)
    chance = pa * pb + (1 - pa) * (1 - pb)
    return (agree - chance) / (1 - chance) if chance < 1 else float("nan")


def judge(rows: list[dict], samples: list, template: str, parser: str, model: str) -> dict:
    import torch

    from offstep.launch.loader import load_config
    from offstep.rollout.scoring.replica_reward_model import Item, JudgeScorer

    rm = load_config(["reward.model.kind=generative", f"reward.model.path={model}"]).reward.model
    rm = replace(rm, parser=parser, template=template)
    torch.set_num_threads(os.cpu_count() or 1)
    scorer = JudgeScorer(rm, torch.device("cpu"))
    items = [Item(rows[s.uid]["prompt"], s.text, rows[s.uid]["reward_model"]["ground_truth"]) for s in samples]
    scores, texts, t0 = [], [], time.perf_counter()
    for i in range(0, len(items), rm.batch_size):
        scores += scorer(items[i : i + rm.batch_size])
        texts += scorer.last_texts
    seconds = time.perf_counter() - t0
    rule = [int(s.score >= 1.0) for s in samples]
    said = [int(v is not None and v >= 0.5) for v in scores]
    return {
        "rule": rule,
        "judge": said,
        "unparsed": sum(v is None for v in scores),
        "seconds": seconds,
        "examples": texts[:3],
        "batch_size": rm.batch_size,
        "max_new_tokens": rm.max_new_tokens,
    }


def write(results: dict, args, n_samples: int, right: int, out: Path) -> str:
    import torch

    lines = [
        "# SmolLM2-135M-Instruct as a judge of the arithmetic task, against the rule",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores ({cpu_kind()}), torch {torch.__version__}, Python "
        f"{platform.python_version()}. {args.remark + ' ' if args.remark else ''}{args.problems} held-out problems (seed {args.seed}), "
        f"{args.answers} answers each from the untrained policy at temperature 1: {n_samples} answers, {right} of them "
        "right by the rule. The judge answers greedily; a score >= 0.5 counts as \"right\".",
        "",
        provenance(),
        "",
        "| judge setting | agreement | judge right / rule right | judge right / rule wrong | judge wrong / rule right "
        "| judge wrong / rule wrong | Cohen's kappa | unparseable | judge s per answer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        pairs = list(zip(r["judge"], r["rule"]))
        agree = sum(j == g for j, g in pairs) / len(pairs)
        count = lambda j, g: sum(p == (j, g) for p in pairs)  # noqa: E731
        lines.append(
            f"| {name} | {100 * agree:.0f}% | {count(1, 1)} | {count(1, 0)} | {count(0, 1)} | {count(0, 0)} | "
            f"{cohen_kappa(r['judge'], r['rule']):.2f} | {r['unparsed']} of {len(pairs)} | "
            f"{r['seconds'] / len(pairs):.3f} |"
        )
    lines += ["", "The judge's first answers per setting (what the parser reads):", ""]
    for name, r in results.items():
        lines.append(f"- {name}: " + "; ".join(json.dumps(t) for t in r["examples"]))
    lines += ["", "Regenerate: `.venv/bin/python -m benchmarks.judge_agreement`."]
    out.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the policy and the judge")
    ap.add_argument("--problems", type=int, default=64, help="held-out problems (the one-digit task has 155 in all)")
    ap.add_argument("--answers", type=int, default=2, help="sampled answers per problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "results_judge.md"))
    ap.add_argument("--remark", default="", help="a sentence for the results file (what else ran on the machine)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows, samples = policy_answers(args.model, args.problems, args.answers, args.seed, Path(tmp))
    right = sum(s.score >= 1.0 for s in samples)
    results = {name: judge(rows, samples, template, parser, args.model) for name, template, parser in SETTINGS}
    print(write(results, args, len(samples), right, Path(args.out)))
    print(json.dumps({k: statistics.mean(v["judge"]) for k, v in results.items()}))
    refresh("judge", args.out)


if __name__ == "__main__":
    main()
