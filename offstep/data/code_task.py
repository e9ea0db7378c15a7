"""The built-in ``code`` task: "write a function that ...", with unit tests as the ground truth.

Each problem is one of a few small function families with its own parameters (``scale(x)``
returning ``x * 7 + 3``, ``count_above(xs)`` counting elements above 12, ...). The ground truth is
verl's call-based test format (``fn_name``, ``inputs`` with one JSON argument a line, ``outputs``
as JSON), so the problems are scored by the same code scorer as verl's ``apps`` rows, in the
sandbox (data_source ``"code"``, ``offstep.rewards.code``). The expected outputs are computed here
by offstep's own reference functions; the model's code only ever runs in the sandbox.
"""

from __future__ import annotations

import json
import string
from typing import Callable

import numpy as np

from offstep.errors import ConfigError

CODE_INSTRUCTION = "Answer with the function only, in a ```python code block."
TESTS = 5  # unit tests per problem


def _ints(rng, lo=-20, hi=20, size=None):
    return [int(v) for v in rng.integers(lo, hi + 1, size=size if size is not None else int(rng.integers(1, 7)))]


def _words(rng):
    return " ".join(
        "".join(rng.choice(list("abcdefg"), size=int(rng.integers(1, 5)))) for _ in range(int(rng.integers(1, 5)))
    )


# (name, signature, description given the parameters, parameter grid, draws one argument list, reference)
Family = tuple[str, str, Callable[..., str], list[dict], Callable, Callable[..., object]]
FAMILIES: list[Family] = [
    (
        "scale",
        "scale(x)",
        lambda a, b: f"takes an integer x and returns x * {a} + {b}",
        [{"a": a, "b": b} for a in range(2, 10) for b in range(0, 21)],
        lambda rng: [_ints(rng, size=1)[0]],
        lambda x, a, b: x * a + b,
    ),
    (
        "count_above",
        "count_above(xs)",
        lambda k: f"takes a list of integers and returns how many of them are greater than {k}",
        [{"k": k} for k in range(-10, 11)],
        lambda rng: [_ints(rng)],
        lambda xs, k: sum(v > k for v in xs),
    ),
    (
        "clamp",
        "clamp(x)",
        lambda lo, hi: f"takes an integer x and returns the nearest integer to x between {lo} and {hi} inclusive",
        [{"lo": lo, "hi": lo + w} for lo in range(-5, 6) for w in range(3, 15)],
        lambda rng: [_ints(rng, size=1)[0]],
        lambda x, lo, hi: min(max(x, lo), hi),
    ),
    (
        "count_letter",
        "count_letter(s)",
        lambda c: f"takes a string s and returns how many times the letter '{c}' occurs in s",
        [{"c": c} for c in string.ascii_lowercase[:7]],
        lambda rng: [_words(rng)],
        lambda s, c: s.count(c),
    ),
    (
        "divisible",
        "divisible(n)",
        lambda k: f"takes an integer n and returns True if n is divisible by {k}, otherwise False",
        [{"k": k} for k in range(2, 13)],
        lambda rng: [_ints(rng, -50, 50, 1)[0]],
        lambda n, k: n % k == 0,
    ),
    (
        "repeat",
        "repeat(s)",
        lambda k: f"takes a string s and returns s repeated {k} times",
        [{"k": k} for k in range(2, 6)],
        lambda rng: [_words(rng)],
        lambda s, k: s * k,
    ),
    (
        "shift_all",
        "shift_all(xs)",
        lambda d: f"takes a list of integers and returns a new list with {d} added to every element",
        [{"d": d} for d in range(1, 21)],
        lambda rng: [_ints(rng)],
        lambda xs, d: [v + d for v in xs],
    ),
    (
        "sum_even",
        "sum_even(xs)",
        lambda: "takes a list of integers and returns the sum of its even elements",
        [{}],
        lambda rng: [_ints(rng)],
        lambda xs: sum(v for v in xs if v % 2 == 0),
    ),
    (
        "spread",
        "spread(xs)",
        lambda: "takes a non-empty list of integers and returns its largest element minus its smallest",
        [{}],
        lambda rng: [_ints(rng)],
        lambda xs: max(xs) - min(xs),
    ),
    (
        "reverse_words",
        "reverse_words(s)",
        lambda: (
            "takes a string of words separated by single spaces and returns the "
            "words in reverse order, separated by single spaces"
        ),
        [{}],
        lambda rng: [_words(rng)],
        lambda s: " ".join(reversed(s.split(" "))),
    ),
]


def code(n: int, seed: int) -> list[dict]:
    """``n`` distinct "write a function" problems (see the module docstring), in a seeded order."""
    problems = [(f, p) for f in FAMILIES for p in f[3]]
    if n > len(problems):
        raise ConfigError(
            f"task 'code': only {len(problems)} distinct problems, {n} requested. Fix: request fewer "
            "(data.task_train_size + data.task_val_size)"
        )
    rng = np.random.default_rng([int(seed), 0xC0DE])
    rows = []
    for k in rng.permutation(len(problems))[:n]:
        (name, signature, describe, _, draw, reference), params = problems[int(k)]
        args = [draw(rng) for _ in range(TESTS)]
        question = f"Write a Python function {signature} that {describe(**params)}."
        truth = {
            "fn_name": name,
            "inputs": ["\n".join(json.dumps(a) for a in call) for call in args],
            "outputs": [json.dumps(reference(*call, **params)) for call in args],
        }
        rows.append(
            {
                "data_source": "code",
                "prompt": [{"role": "user", "content": f"{question} {CODE_INSTRUCTION}"}],
                "ability": "code",
                "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
                "extra_info": {"question": question},
            }
        )
    return rows
