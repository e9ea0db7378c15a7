"""The built-in tasks: verl-format files, determinism, train/validation disjointness, and the
arithmetic task's options (offstep/data/tasks.py)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from offstep.data.dataset import load_records
from offstep.data.tasks import TASKS, write_task


# the numeric tasks; code: tests/data/test_code_task.py, reasoning_gym (a library's datasets, by name): tests/data/test_reasoning_gym.py;
# shapes (images): test_shapes_task below
@pytest.mark.parametrize("name", sorted(set(TASKS) - {"code", "reasoning_gym", "shapes"}))
def test_task_files_and_verl_columns(tmp_path, name):
    train, val = write_task(name, str(tmp_path / name), n_train=40, n_val=10, seed=0)
    assert train.endswith("train.parquet") and val.endswith("val.parquet")
    for path, n, split in ((train, 40, "train"), (val, 10, "val")):
        table = pq.read_table(path)
        assert set(table.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"} | (
            {"agent_name"} if name == "calculator" else set()
        )  # verl's column: its rows are tool rows
        assert table.num_rows == n
        records = load_records(path)
        for i, r in enumerate(records):
            assert r.ability == "math"
            assert r.extra_info["split"] == split and r.extra_info["index"] == i
            assert isinstance(r.ground_truth, str) and int(r.ground_truth) >= 0
            assert r.messages[-1]["role"] == "user"  # after the calculator task's system prompt and example
            assert r.extra_info["question"] in r.messages[-1]["content"]
        rows = table.to_pylist()
        assert all(row["reward_model"]["style"] == "rule" for row in rows)


def test_task_deterministic_and_disjoint(tmp_path):
    for name in [
        t for t in TASKS if t != "reasoning_gym"
    ]:  # it needs a dataset's name: tests/data/test_reasoning_gym.py
        a = write_task(name, str(tmp_path / "a"), 50, 20, seed=5)
        b = write_task(name, str(tmp_path / "b"), 50, 20, seed=5)
        c = write_task(name, str(tmp_path / "c"), 50, 20, seed=6)
        ta, va = (pq.read_table(p).to_pylist() for p in a)
        tb, vb = (pq.read_table(p).to_pylist() for p in b)
        tc, _ = (pq.read_table(p).to_pylist() for p in c)
        assert ta == tb and va == vb
        assert ta != tc
        key = "shapes" if name == "shapes" else "question"  # shapes: the picture drawn
        train_q = {r["extra_info"][key] for r in ta}
        val_q = {r["extra_info"][key] for r in va}
        assert len(train_q) == 50 and len(val_q) == 20 and not train_q & val_q


def test_arithmetic_answers_and_defaults(tmp_path):
    train, _ = write_task("arithmetic", str(tmp_path), 200, 10, seed=0)
    for r in load_records(train):
        assert r.data_source == "arithmetic"
        expr = r.extra_info["expression"]
        a, op, b = expr.split()
        assert op in "+-" and 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert int(r.ground_truth) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert r.messages[0]["content"].startswith(f"What is {expr}?")


def test_arithmetic_kwargs_change_difficulty(tmp_path):
    train, _ = write_task("arithmetic", str(tmp_path), 100, 10, seed=1, digits=3, ops="*", num_operands=3)
    for r in load_records(train):
        a, _, b, _, c = r.extra_info["expression"].split()
        assert int(r.ground_truth) == int(a) * int(b) * int(c)
    train, _ = write_task("arithmetic", str(tmp_path / "neg"), 150, 10, seed=1, allow_negative=True)
    assert any(int(r.ground_truth) < 0 for r in load_records(train))


def test_arithmetic_operand_counts_drawn_from_a_list(tmp_path):
    """A list of counts mixes problem lengths; one count keeps the problems a seed always gave."""
    from offstep.data.tasks import _eval_expression, arithmetic

    rows = arithmetic(300, seed=3, digits=1, num_operands=[2, 2, 3, 6])
    counts = [len(r["extra_info"]["expression"].split()) // 2 + 1 for r in rows]
    assert set(counts) == {2, 3, 6} and counts.count(2) > counts.count(6)
    for r in rows:
        parts = r["extra_info"]["expression"].split()
        assert int(r["reward_model"]["ground_truth"]) == _eval_expression([int(v) for v in parts[::2]], parts[1::2])
    assert arithmetic(20, seed=3, digits=1, num_operands=[3]) == arithmetic(20, seed=3, digits=1, num_operands=3)
    with pytest.raises(ValueError, match="num_operands must be >= 2"):
        arithmetic(5, seed=0, num_operands=[2, 1])


def test_arithmetic_max_value_bounds_the_operands():
    from offstep.data.tasks import arithmetic

    # operands 0..19 with + and - (results not negative): 20 x 20 sums and 210 differences, all drawn
    rows = arithmetic(610, seed=0, digits=2, max_value=19)
    operands = [int(v) for r in rows for v in r["extra_info"]["expression"].split()[::2]]
    assert min(operands) == 0 and max(operands) == 19
    with pytest.raises(ValueError, match="distinct problems"):
        arithmetic(611, seed=0, digits=2, max_value=19)
    with pytest.raises(ValueError, match="max_value=120 is not a 2-digit number"):
        arithmetic(5, seed=0, digits=2, max_value=120)
    with pytest.raises(ValueError, match="min_value=7 exceeds the largest operand \\(5\\)"):
        arithmetic(5, seed=0, min_value=7, max_value=5)


def test_arithmetic_precedence():
    from offstep.data.tasks import _eval_expression

    assert _eval_expression([2, 3, 4], ["+", "*"]) == 14
    assert _eval_expression([10, 2, 3], ["-", "*"]) == 4
    assert _eval_expression([10, 2, 3], ["*", "-"]) == 17


def test_arithmetic_problem_space_too_small(tmp_path):
    with pytest.raises(ValueError, match="distinct problems"):
        write_task("arithmetic", str(tmp_path), 150, 50, seed=0, digits=1, ops="+")


def test_gsm8k_synthetic_answers_score(tmp_path):
    from offstep.rewards.scorers import gsm8k_score

    train, _ = write_task("gsm8k_synthetic", str(tmp_path), 100, 10, seed=0)
    records = load_records(train)
    assert {r.data_source for r in records} == {"openai/gsm8k"}
    for r in records:
        assert "####" in r.messages[0]["content"]
        # the reference solution gets full marks from the GSM8K scorer
        assert gsm8k_score(r.extra_info["answer"], r.ground_truth) == 1.0


def test_write_task_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'nope'.*arithmetic"):
        write_task("nope", str(tmp_path), 1, 1, 0)
    with pytest.raises(ValueError, match="n_val"):
        write_task("arithmetic", str(tmp_path), 10, 0, 0)
    with pytest.raises(ValueError, match="ops"):
        write_task("arithmetic", str(tmp_path), 10, 1, 0, ops="/")


def test_shapes_task(tmp_path):
    import io

    from PIL import Image

    train, _ = write_task("shapes", str(tmp_path), 30, 5, seed=0, max_shapes=3)
    records = load_records(train)
    counts = set()
    for r in records:
        assert r.data_source == "shapes" and r.messages[-1]["content"].startswith("<image>How many shapes")
        assert len(r.images) == 1 and Image.open(io.BytesIO(r.images[0])).size == (56, 56)
        assert r.ground_truth == str(r.extra_info["count"]) and 1 <= r.extra_info["count"] <= 3
        counts.add(r.extra_info["count"])
    assert counts == {1, 2, 3}
    assert len({r.images[0] for r in records}) == 30  # distinct pictures
