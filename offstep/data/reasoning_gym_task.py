"""The ``reasoning_gym`` task: reasoning-gym's procedural datasets (PyPI ``reasoning-gym``) as verl rows,
``data.task=reasoning_gym data.task_options='{name: leg_counting, max_animals: 2}'``.

``name`` picks one of the library's datasets; every other option but ``system_prompt`` is an argument of
its config (``reasoning_gym.create_dataset(name, seed=..., size=..., **options)``). The rows are the
library's items ``0 .. n_train + n_val - 1`` for the run's seed, repeats of a question skipped: the library
seeds item ``i`` with ``seed + i``, so train (the first ``n_train``) and validation (the rest) never share a
question, whereas two datasets with seeds ``s`` and ``s + 1`` would share nearly all.

Each row: a system prompt asking for the answer in ``<answer>`` tags (``system_prompt``: a name of the
library's ``SYSTEM_PROMPTS``, or the text itself; default ``direct``), with ``example: true`` one more item
of the dataset answered in tags as a demonstration turn, the question as the user's message,
data_source ``reasoning_gym/<name>``, the item's answer as the ground truth and, in ``extra_info``, the
item and config as JSON for the dataset's own ``score_answer`` (``offstep.rewards.reasoning_gym_scorer``).
reasoning_gym is imported only when this task is used.
"""

from __future__ import annotations

import dataclasses
import difflib
import json

from offstep.errors import ConfigError
from offstep.rewards.reasoning_gym_scorer import INFO_KEY, SOURCE_PREFIX, dataset, decode, encode

DEFAULT_PROMPT = "direct"
OWN_OPTIONS = ("name", "system_prompt", "example")  # offstep's options; the rest go to the library's config
MANAGED = ("seed", "size")  # the config fields that offstep sets
KEY = "data.task_options"


def library():
    """reasoning_gym, its registry of datasets and its system prompts (imported here, on first use)."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError as exc:
        raise ImportError(
            f"data.task=reasoning_gym needs the reasoning-gym package ({exc}). Fix: pip install "
            "reasoning-gym==0.1.25 (offstep's dependencies include it: pip install -e .)"
        ) from exc
    return reasoning_gym, DATASETS, SYSTEM_PROMPTS


def _unknown_name(name, datasets: dict) -> str:
    if not name:
        return (
            f"data.task=reasoning_gym needs {KEY}.name, one of reasoning-gym's {len(datasets)} datasets. Fix: e.g. "
            f"data.task_options='{{name: leg_counting}}' (all of them: python -c \"import reasoning_gym.factory as f; "
            "print(sorted(f.DATASETS))\")"
        )
    close = difflib.get_close_matches(str(name), list(datasets), n=3)
    return (
        f"{KEY}.name={name!r} is not a reasoning-gym dataset"
        + (f" (did you mean {' or '.join(close)}?)" if close else f" (they are {sorted(datasets)})")
        + f". Fix: set {KEY}.name to one of them"
    )


def check_options(options: dict) -> list[str]:
    """Problems with ``data.task_options`` for ``data.task=reasoning_gym``, each naming the key and the fix:
    checked before anything starts (the library would refuse them only in data preparation)."""
    _, datasets, prompts = library()
    name = options.get("name")
    if not name or name not in datasets:
        return [_unknown_name(name, datasets)]
    config_cls = datasets[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in MANAGED]
    problems = []
    for opt in options:
        if opt in MANAGED:
            problems.append(
                f"{KEY}.{opt} is set by offstep (from trainer.seed; data.task_train_size + "
                f"data.task_val_size). Fix: drop {KEY}.{opt}"
            )
        elif opt not in fields and opt not in OWN_OPTIONS:
            close = difflib.get_close_matches(str(opt), fields, n=1)
            problems.append(
                f"{KEY}.{opt} is not an option of reasoning-gym's {name} (its options: {fields}). Fix: "
                + (f"did you mean {KEY}.{close[0]}? Otherwise drop it" if close else "drop it")
            )
    prompt = options.get("system_prompt", DEFAULT_PROMPT)
    if not isinstance(prompt, str) or not prompt.strip():
        problems.append(
            f"{KEY}.system_prompt={prompt!r} must be a name of reasoning-gym's SYSTEM_PROMPTS "
            f"({sorted(prompts)}) or the prompt's text. Fix: e.g. {KEY}.system_prompt={DEFAULT_PROMPT}"
        )
    if problems:
        return problems
    config = {k: v for k, v in options.items() if k not in OWN_OPTIONS}
    try:
        made = config_cls(**config, seed=0, size=1)
        if hasattr(made, "validate"):
            made.validate()  # the library's configs assert their ranges
    except Exception as exc:
        return [
            f"{KEY} {config} are refused by reasoning-gym's {name}: {type(exc).__name__}: {exc}. Fix: change "
            f"them (the fields of reasoning_gym's {config_cls.__name__} say what they take)"
        ]
    return []


def _answered(entry: dict) -> list[dict]:
    """One solved item as a demonstration: its question, and its answer in tags as the assistant's turn."""
    return [
        {"role": "user", "content": entry["question"]},
        {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"},
    ]


def _row(name: str, config: dict, entry: dict, system: str, category: str, example: list[dict]) -> dict:
    answer = entry.get("answer")
    info = {"dataset": name, "config": config, "entry": encode(entry)}
    return {
        "data_source": SOURCE_PREFIX + name,
        "prompt": [{"role": "system", "content": system}, *example, {"role": "user", "content": entry["question"]}],
        "ability": category,
        "reward_model": {"style": "rule", "ground_truth": "" if answer is None else str(answer)},
        "extra_info": {"question": entry["question"], INFO_KEY: json.dumps(info)},
    }


def _check_round_trip(name: str, config: dict, entries: list[dict]) -> None:
    """Refuse a dataset whose items its own scorer judges differently after the JSON round trip."""
    scorer = dataset(name, json.dumps(config, sort_keys=True))
    for entry in entries:
        back = decode(json.loads(json.dumps(encode(entry))))
        answer = entry.get("answer")
        for response in (None if answer is None else str(answer), "?"):
            if scorer.score_answer(response, entry) != scorer.score_answer(response, back):
                raise ConfigError(
                    f"reasoning-gym's {name}: its items do not survive being stored as JSON (its scorer "
                    f"judges the stored item differently). Fix: pick another dataset ({KEY}.name)"
                )


def _distinct(rg, name: str, seed: int, n: int, options: dict) -> tuple[list[dict], str]:
    """The first ``n`` items of the library's dataset with distinct questions, and the dataset's category."""
    size, start, items, seen = n, 0, [], set()
    while True:
        ds = rg.create_dataset(name, seed=seed, size=size, **options)
        for i in range(start, size):
            entry = ds[i]
            if entry["question"] not in seen:
                seen.add(entry["question"])
                items.append(entry)
                if len(items) == n:
                    return items, ds.category
        if size >= 50 * n + 2000:  # as the built-in tasks: a problem space too small fails clearly
            raise ConfigError(
                f"reasoning-gym's {name}: only {len(items)} distinct questions in its first {size} items, "
                f"{n} requested. Fix: request fewer (data.task_train_size + data.task_val_size) or widen "
                f"its options ({KEY})"
            )
        start, size = size, 2 * size  # a larger size keeps the items so far: item i is seeded with seed + i


def reasoning_gym(
    n: int, seed: int, name: str = "", system_prompt: str = DEFAULT_PROMPT, example: bool = False, **options
) -> list[dict]:
    """``n`` rows of reasoning-gym's dataset ``name`` (see the module docstring): the library's items
    ``0, 1, ...`` for ``seed``, repeated questions skipped. ``example``: the next distinct item, solved, as
    a demonstration turn before each question (a small model learns the tags from it)."""
    problems = check_options({"name": name, "system_prompt": system_prompt, **options})
    if problems:
        raise ConfigError("; ".join(problems))
    rg, _, prompts = library()
    system = prompts.get(system_prompt, system_prompt)
    config = json.loads(json.dumps(options))  # what the scorer rebuilds the dataset from
    items, category = _distinct(rg, name, int(seed), int(n) + bool(example), options)
    demo = _answered(items.pop()) if example else []
    _check_round_trip(name, config, items[:3])
    return [_row(name, config, entry, system, category, demo) for entry in items]


reasoning_gym.check_options = check_options  # config.validate's check: the options are the library's, not parameters
