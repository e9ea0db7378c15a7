"""Built-in synthetic tasks, written as verl-format parquet files.

Every task generator has the signature ``generator(n: int, seed: int, **kw) -> list[dict]`` and
returns ``n`` distinct verl rows (``data_source``, ``prompt``, ``ability``, ``reward_model``,
``extra_info``); :func:`write_task` draws ``n_train + n_val`` of them at once, so train and
validation never share a question, and fills ``extra_info["split"]`` / ``extra_info["index"]``.

Tasks
-----
``arithmetic``
    "What is 23 + 58?" with an instruction to end the reply with the final number. Scored by the
    last number in the reply (data_source ``"arithmetic"``). Keyword arguments:
    ``digits`` (max digits per operand, default 2), ``min_value`` (smallest operand, default 0),
    ``max_value`` (largest operand, default the largest ``digits``-digit number),
    ``ops`` (operators from ``"+-*"``, default ``"+-"``), ``num_operands`` (default 2; a list, such
    as ``[2, 2, 2, 3, 5, 8]``, draws each problem's count from it: problems, and the model's replies,
    of mixed lengths with a long tail), ``allow_negative`` (default False: results are never negative).
``calculator``
    Multiplications of multi-digit numbers ("What is 47 * 86?") that a small model cannot do in
    its head, with a calculator tool described in the system prompt (``<calculator>47 * 86
    </calculator>``, ``rollout.agent.format=tag``) and ``agent_name=tool_agent``; scored by the last
    number of the model's final turn, only when the loop ended because the model answered without a
    call (data_source ``"calculator"``, ``rewards.scorers.plain_answer_score``). Keyword arguments: ``digits``
    (default 2), ``min_value`` (default 10), ``ops`` (default ``"*"``), ``num_operands`` (default 2),
    ``example`` (default True: one worked call as a demonstration turn before the question),
    ``tools`` (default True; False: the same problems as plain single-turn rows, the baseline),
    ``agent`` (default ``tool_agent``; ``openai``: answered by an OpenAI agent, docs/openai-agents.md).
``gsm8k_synthetic``
    Templated one- and two-step word problems (apples, coins, pages, ...) that ask for the final
    answer after ``"####"``; data_source ``"openai/gsm8k"`` so the GSM8K scorer applies. Keyword
    arguments: ``max_value`` (largest base quantity, default 20), ``two_step`` (fraction of
    two-step problems, default 0.5).
``code``
    "Write a Python function scale(x) that ...", with unit tests in verl's call-based format as the
    ground truth, scored by running them in the sandbox (data_source ``"code"``;
    ``offstep.data.code_task``).
``shapes``
    "How many shapes are in the image?" over a drawn picture, in verl's multimodal layout, for
    vision-language models (data_source ``"shapes"``; ``offstep.data.shapes_task``).
``reasoning_gym``
    One of reasoning-gym's procedural datasets, scored by its own verifier: ``name`` (e.g.
    ``leg_counting``), ``system_prompt`` and the dataset's config options (data_source
    ``"reasoning_gym/<name>"``; ``offstep.data.reasoning_gym_task``).
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from offstep.data.code_task import code
from offstep.data.reasoning_gym_task import reasoning_gym
from offstep.data.shapes_task import shapes
from offstep.errors import ConfigError

ARITHMETIC_INSTRUCTION = "Give the final answer as a single number at the end of your reply."
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


class _Unique:
    """Draw distinct problems by rejection, failing clearly when the problem space is too small."""

    def __init__(self, task: str, n: int, hint: str):
        self.task, self.n, self.hint = task, n, hint
        self.seen: set[str] = set()
        self.max_attempts = 50 * n + 2000

    def run(self, draw: Callable[[], tuple[str, dict] | None]) -> list[dict]:
        rows: list[dict] = []
        attempts = 0
        while len(rows) < self.n:
            attempts += 1
            if attempts > self.max_attempts:
                raise ConfigError(
                    f"task {self.task!r}: could only generate {len(rows)} distinct problems of "
                    f"the {self.n} requested. Fix: request fewer (n_train + n_val) or {self.hint}."
                )
            drawn = draw()
            if drawn is None:
                continue
            key, row = drawn
            if key in self.seen:
                continue
            self.seen.add(key)
            rows.append(row)
        return rows


# --------------------------------------------------------------------------------------------------
# arithmetic


def _eval_expression(operands: list[int], ops: list[str]) -> int:
    """Evaluate ``a op b op c ...`` with ``*`` binding tighter than ``+``/``-``."""
    terms: list[int] = [operands[0]]
    signs: list[int] = [1]
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def arithmetic(
    n: int,
    seed: int,
    digits: int = 2,
    min_value: int = 0,
    ops: str | list[str] = "+-",
    num_operands: int | list[int] = 2,
    allow_negative: bool = False,
    max_value: int | None = None,
) -> list[dict]:
    """``n`` distinct integer-expression questions (see the module docstring)."""
    counts = [int(num_operands)] if isinstance(num_operands, (int, str)) else [int(c) for c in num_operands]
    ops_list = [o for o in ops if not o.isspace()] if isinstance(ops, str) else list(ops)
    bad = [o for o in ops_list if o not in ("+", "-", "*")]
    if not ops_list or bad:
        raise ConfigError(f"arithmetic: ops must be drawn from '+', '-', '*', got {ops!r}.")
    if int(digits) < 1:
        raise ConfigError(f"arithmetic: digits must be >= 1, got {digits}.")
    if not counts or min(counts) < 2:
        raise ConfigError(f"arithmetic: num_operands must be >= 2 (or a list of such counts), got {num_operands}.")
    hi = 10 ** int(digits) - 1 if max_value is None else int(max_value)
    lo = int(min_value)
    if max_value is not None and not 0 <= hi < 10 ** int(digits):
        raise ConfigError(
            f"arithmetic: max_value={hi} is not a {digits}-digit number. Fix: raise digits or lower max_value."
        )
    if lo > hi:
        raise ConfigError(f"arithmetic: min_value={lo} exceeds the largest operand ({hi}).")

    rng = np.random.default_rng([int(seed), 0xA51])

    def draw():
        count = counts[0] if len(counts) == 1 else counts[int(rng.integers(0, len(counts)))]
        operands = [int(v) for v in rng.integers(lo, hi + 1, size=count)]
        chosen = [ops_list[int(i)] for i in rng.integers(0, len(ops_list), size=len(operands) - 1)]
        result = _eval_expression(operands, chosen)
        if result < 0 and not allow_negative:
            return None
        expression = str(operands[0])
        for op, value in zip(chosen, operands[1:]):
            expression += f" {op} {value}"
        question = f"What is {expression}?"
        row = {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": f"{question} {ARITHMETIC_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(result)},
            "extra_info": {"question": question, "expression": expression},
        }
        return question, row

    return _Unique("arithmetic", n, "raise digits / add ops").run(draw)


# --------------------------------------------------------------------------------------------------
# calculator

CALCULATOR_SYSTEM = (
    "You have a calculator. To use it, write <calculator>expression</calculator>, for example "
    "<calculator>12 * 34</calculator>, and stop: its result comes back to you. Then give the final answer "
    "as a single number at the end of your reply."
)
# One worked call, as turns before the question (the smallest change that made SmolLM2-135M call
# the tool: see docs/tools-and-agents.md, the calculator preset). Its final answer is short: call, tool turn and
# "The answer is 9801.<|im_end|>" are 39 tokens, inside the preset's 48-token budget; the longer
# "99 * 99 = 9801. The answer is 9801." took 52, so a model copying it was always cut off.
CALCULATOR_EXAMPLE = [
    {"role": "user", "content": "What is 23 * 19?"},
    {"role": "assistant", "content": "<calculator>23 * 19</calculator>"},
    {"role": "tool", "content": "437"},
    {"role": "assistant", "content": "The answer is 437."},
]


def calculator(
    n: int,
    seed: int,
    digits: int = 2,
    min_value: int = 10,
    ops: str | list[str] = "*",
    num_operands: int = 2,
    example: bool = True,
    tools: bool = True,
    agent: str = "tool_agent",
) -> list[dict]:
    """``n`` distinct problems for the calculator tool (see the module docstring); ``agent``: the
    rows' agent_name when they have tools (``openai``: an OpenAI agent answers them)."""
    rows = arithmetic(n, seed, digits=digits, min_value=min_value, ops=ops, num_operands=num_operands)
    out = []
    for row in rows:
        question = row["extra_info"]["question"]
        if tools:
            messages = [
                {"role": "system", "content": CALCULATOR_SYSTEM},
                *(CALCULATOR_EXAMPLE if example else []),
                {"role": "user", "content": question},
            ]
        else:
            messages = [{"role": "user", "content": f"{question} {ARITHMETIC_INSTRUCTION}"}]
        out.append(
            {
                **row,
                "data_source": "calculator",
                "prompt": messages,
                "agent_name": agent if tools else "single_turn_agent",
            }
        )
    return out


# --------------------------------------------------------------------------------------------------
# gsm8k_synthetic

_NAMES = [
    ("Alice", "She"),
    ("Ben", "He"),
    ("Carla", "She"),
    ("David", "He"),
    ("Emma", "She"),
    ("Farid", "He"),
    ("Grace", "She"),
    ("Hiro", "He"),
    ("Ines", "She"),
    ("Jamal", "He"),
    ("Kira", "She"),
    ("Liam", "He"),
    ("Maya", "She"),
    ("Noah", "He"),
    ("Olga", "She"),
    ("Pedro", "He"),
]
_ITEMS = ["apples", "coins", "marbles", "stickers", "pencils", "cookies", "stamps", "books"]
_CONTAINERS = ["boxes", "bags", "jars", "packs", "baskets"]


def _one_step(rng: np.random.Generator, m: int) -> tuple[str, list[str], int] | None:
    """A one-step problem: (question, solution steps, answer)."""
    name, pron = _NAMES[int(rng.integers(len(_NAMES)))]
    item = _ITEMS[int(rng.integers(len(_ITEMS)))]
    kind = int(rng.integers(4))
    a, b = int(rng.integers(2, m + 1)), int(rng.integers(2, m + 1))
    if kind == 0:
        q = f"{name} has {a} {item}. {pron} gets {b} more {item}. How many {item} does {name} have now?"
        return q, [f"{a} + {b} = {a + b}"], a + b
    if kind == 1:
        a, b = max(a, b), min(a, b)
        if a == b:
            return None
        q = f"{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?"
        return q, [f"{a} - {b} = {a - b}"], a - b
    if kind == 2:
        box = _CONTAINERS[int(rng.integers(len(_CONTAINERS)))]
        q = f"{name} has {a} {box} with {b} {item} in each. How many {item} does {name} have in total?"
        return q, [f"{a} * {b} = {a * b}"], a * b
    per = b
    total = a * per
    box = _CONTAINERS[int(rng.integers(len(_CONTAINERS)))]
    q = f"{name} has {total} {item} and puts them into {box} of {per}. How many {box} does {name} fill?"
    return q, [f"{total} / {per} = {a}"], a


def _two_step(rng: np.random.Generator, m: int) -> tuple[str, list[str], int] | None:
    name, pron = _NAMES[int(rng.integers(len(_NAMES)))]
    item = _ITEMS[int(rng.integers(len(_ITEMS)))]
    kind = int(rng.integers(4))
    a, b, c = (int(v) for v in rng.integers(2, m + 1, size=3))
    if kind == 0:
        box = _CONTAINERS[int(rng.integers(len(_CONTAINERS)))]
        q = (
            f"{name} has {a} {item}. {pron} buys {b} {box} with {c} {item} in each. "
            f"How many {item} does {name} have now?"
        )
        return q, [f"{b} * {c} = {b * c}", f"{a} + {b * c} = {a + b * c}"], a + b * c
    if kind == 1:
        earned = a * b
        if c >= earned:
            return None
        q = (
            f"{name} earns {a} dollars per hour and works {b} hours. {pron} then spends {c} "
            f"dollars on lunch. How many dollars does {name} have left?"
        )
        return q, [f"{a} * {b} = {earned}", f"{earned} - {c} = {earned - c}"], earned - c
    if kind == 2:
        total = a + b + c
        q = (
            f"A book has {total} pages. {name} reads {a} pages on Monday and {b} pages on "
            f"Tuesday. How many pages are left to read?"
        )
        return q, [f"{a} + {b} = {a + b}", f"{total} - {a + b} = {c}"], c
    q = f"{name} has {a} {item}. {pron} finds {b} more and then loses {c}. How many {item} does {name} have now?"
    if a + b - c < 0:
        return None
    return q, [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"], a + b - c


def gsm8k_synthetic(n: int, seed: int, max_value: int = 20, two_step: float = 0.5) -> list[dict]:
    """``n`` distinct GSM8K-style word problems (see the module docstring)."""
    m = int(max_value)
    if m < 3:
        raise ConfigError(f"gsm8k_synthetic: max_value must be >= 3, got {max_value}.")
    if not 0.0 <= float(two_step) <= 1.0:
        raise ConfigError(f"gsm8k_synthetic: two_step must be in [0, 1], got {two_step}.")
    rng = np.random.default_rng([int(seed), 0x65A])

    def draw():
        maker = _two_step if rng.random() < float(two_step) else _one_step
        made = maker(rng, m)
        if made is None:
            return None
        question, steps, answer = made
        solution = " ".join(f"{s}." for s in steps) + f"\n#### {answer}"
        row = {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"question": question, "answer": solution},
        }
        return question, row

    return _Unique("gsm8k_synthetic", n, "raise max_value").run(draw)


# --------------------------------------------------------------------------------------------------

TASKS: dict[str, Callable[..., list[dict]]] = {
    "arithmetic": arithmetic,
    "calculator": calculator,
    "gsm8k_synthetic": gsm8k_synthetic,
    "code": code,
    "reasoning_gym": reasoning_gym,
    "shapes": shapes,
}


def write_task(name: str, out_dir: str, /, n_train: int, n_val: int, seed: int, **kw) -> tuple[str, str]:
    """Generate task ``name`` and write ``<out_dir>/train.parquet`` and ``<out_dir>/val.parquet``.

    The output is a deterministic function of ``(name, n_train, n_val, seed, kw)``; validation
    questions never appear in the training file. ``name`` and ``out_dir`` are positional only: a task
    may take an option called ``name`` (reasoning_gym's dataset). Returns ``(train_path, val_path)``.
    """
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}. Built-in tasks: {sorted(TASKS)}.")
    n_train, n_val = int(n_train), int(n_val)
    if n_train < 1 or n_val < 1:
        raise ConfigError(
            f"write_task needs n_train >= 1 and n_val >= 1, got n_train={n_train}, n_val={n_val}. "
            "Fix: set data.task_train_size and data.task_val_size to at least 1."
        )
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = TASKS[name](n_train + n_val, int(seed), **kw)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, chunk in (("train", rows[:n_train]), ("val", rows[n_train:])):
        out_rows = []
        for index, row in enumerate(chunk):
            row = dict(row)
            row["extra_info"] = {"split": split, "index": index, **row["extra_info"]}
            out_rows.append(row)
        path = os.path.join(out_dir, f"{split}.parquet")
        tmp = path + ".tmp"
        pq.write_table(pa.Table.from_pylist(out_rows), tmp)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]
