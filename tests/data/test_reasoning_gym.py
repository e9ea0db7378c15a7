"""reasoning-gym's datasets as a built-in task (``data.task=reasoning_gym``, offstep/data/reasoning_gym_task.py)
and as verl parquet (offstep/data/reasoning_gym.py): the rows and scores are the library's own, the export
round-trips, bad names and options are refused before Ray, and a tiny run trains on one."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from offstep.data.dataset import check_rule_ground_truths, load_records  # noqa: E402
from offstep.data.reasoning_gym import main as export_main  # noqa: E402
from offstep.data.tasks import write_task  # noqa: E402
from offstep.launch.loader import load_config  # noqa: E402
from offstep.launch.validate import problems  # noqa: E402
from offstep.rewards.reasoning_gym_scorer import INFO_KEY, decode  # noqa: E402
from offstep.rewards.registry import RewardFunction  # noqa: E402

# two datasets with enough distinct questions that the first items have no repeat
TASKS = {
    "leg_counting": {"min_animals": 1, "max_animals": 3},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "max_digits": 2},
}


def _entries(path) -> list[dict]:
    return [decode(json.loads(r.extra_info[INFO_KEY])["entry"]) for r in load_records(path)]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rows_and_scores_are_the_librarys(tmp_path, name):
    options = TASKS[name]
    train, val = write_task("reasoning_gym", str(tmp_path), 6, 4, 3, name=name, **options)
    library = reasoning_gym.create_dataset(name, seed=3, size=10, **options)
    reward = RewardFunction()
    for path, first in ((train, 0), (val, 6)):
        records = load_records(path)
        check_rule_ground_truths(records, path)  # the built-in scorers take them as they are
        assert len(records) == (6 if first == 0 else 4)
        for i, r in enumerate(records):
            item = library[first + i]
            assert r.data_source == f"reasoning_gym/{name}"
            assert r.messages[-1] == {"role": "user", "content": item["question"]}
            assert r.messages[0]["role"] == "system" and "<answer>" in r.messages[0]["content"]
            assert r.ground_truth == item["answer"]
            for answer in (item["answer"], "7"):  # right, and wrong (or right by chance: both sides agree)
                score, _ = reward(r.data_source, f"Sure. <answer>{answer}</answer>", r.ground_truth, r.extra_info)
                assert score == library.score_answer(answer, item)
            assert reward(r.data_source, item["answer"], r.ground_truth, r.extra_info)[0] == 0.0  # no tags, no answer
    assert {q["question"] for q in _entries(train)}.isdisjoint(q["question"] for q in _entries(val))


def test_same_seed_same_rows_other_seed_others(tmp_path):
    rows = {}
    for label, seed in (("a", 5), ("b", 5), ("c", 6)):
        paths = write_task("reasoning_gym", str(tmp_path / label), 8, 4, seed, name="leg_counting")
        rows[label] = [pq.read_table(p).to_pylist() for p in paths]
    assert rows["a"] == rows["b"] and rows["a"] != rows["c"]


def test_verl_export_round_trips_and_scores_the_same(tmp_path, capsys):
    out = tmp_path / "legs"
    assert (
        export_main(
            [
                "--name",
                "leg_counting",
                "--out",
                str(out),
                "--train-size",
                "5",
                "--val-size",
                "3",
                "--seed",
                "2",
                "--option",
                "min_animals=1",
                "--option",
                "max_animals=2",
            ]
        )
        == 0
    )
    library = reasoning_gym.create_dataset("leg_counting", seed=2, size=8, min_animals=1, max_animals=2)
    rows = pq.read_table(out / "val.parquet").to_pylist()
    assert set(rows[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}  # verl's columns
    for i, row in enumerate(rows):
        info = json.loads(row["extra_info"][INFO_KEY])
        entry = decode(info["entry"])
        assert entry == library[5 + i]  # metadata included, tuples as tuples
        assert info["config"] == {"min_animals": 1, "max_animals": 2}
        assert row["reward_model"]["ground_truth"] == entry["answer"]
    # scored from the file as training scores it, and as a verl reward function would
    from offstep.data.reasoning_gym import compute_score

    for r in load_records(out / "val.parquet"):
        entry = decode(json.loads(r.extra_info[INFO_KEY])["entry"])
        for answer in (entry["answer"], "3"):
            text = f"<answer>{answer}</answer>"
            expected = library.score_answer(answer, entry)
            assert RewardFunction()(r.data_source, text, r.ground_truth, r.extra_info)[0] == expected
            assert compute_score(r.data_source, text, r.ground_truth, r.extra_info) == expected


def test_rows_from_elsewhere_score_with_their_ground_truth():
    """A reasoning_gym/<name> row without offstep's extra_info: its ground truth is the item's answer."""
    reward = RewardFunction()
    assert reward("reasoning_gym/chain_sum", "<answer>12</answer>", "12", {})[0] == 1.0
    assert reward("reasoning_gym/chain_sum", "<answer>13</answer>", "12", {})[0] == 0.0


def test_example_turn_is_an_item_of_neither_split(tmp_path):
    train, val = write_task("reasoning_gym", str(tmp_path), 6, 4, 0, name="leg_counting", example=True)
    records = load_records(train) + load_records(val)
    demo = records[0].messages[1:3]
    assert [m["role"] for m in records[0].messages] == ["system", "user", "assistant", "user"]
    assert all(r.messages[1:3] == demo for r in records)
    item = reasoning_gym.create_dataset("leg_counting", seed=0, size=11)[10]  # the one after the 10 rows
    assert demo == [
        {"role": "user", "content": item["question"]},
        {"role": "assistant", "content": f"<answer>{item['answer']}</answer>"},
    ]
    assert item["question"] not in {r.messages[-1]["content"] for r in records}


@pytest.mark.parametrize(
    "options,expected",
    [
        (["name=leg_conting"], ["data.task_options.name='leg_conting'", "did you mean leg_counting", "Fix"]),
        ([], ["data.task_options.name", "leg_counting", "Fix"]),
        (
            ["name=leg_counting", "max_animal=2"],
            ["data.task_options.max_animal", "did you mean data.task_options.max_animals"],
        ),
        (["name=leg_counting", "seed=3"], ["data.task_options.seed", "trainer.seed", "Fix: drop"]),
        (
            ["name=leg_counting", "min_animals=4", "max_animals=2"],
            ["refused by reasoning-gym's leg_counting", "max_animals must be >= min_animals", "Fix"],
        ),
    ],
)
def test_bad_name_or_option_refused_with_the_key(options, expected):
    msgs = problems(
        load_config(["preset=tiny", "data.task=reasoning_gym", *(f"+data.task_options.{o}" for o in options)])
    )
    text = "; ".join(msgs)
    for part in expected:
        assert part in text, (part, text)


@pytest.mark.heavy  # the command's checks, about 10 s
def test_bad_option_stops_the_command_before_ray(tmp_path, capsys, monkeypatch):
    from offstep.cli import main
    from offstep.pipeline import controller

    monkeypatch.setattr(controller, "start_workers", lambda *a: pytest.fail("workers started"))
    rc = main(
        [
            "train",
            "preset=tiny",
            "data.task=reasoning_gym",
            "+data.task_options.name=leg_conting",
            f"trainer.output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "did you mean leg_counting" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_dataset_too_small_for_the_sizes_says_so(tmp_path):
    with pytest.raises(ValueError, match="distinct questions.*data.task_train_size"):
        write_task(
            "reasoning_gym",
            str(tmp_path),
            80,
            20,
            0,
            name="leg_counting",
            min_animals=1,
            max_animals=1,
            max_instances=2,
        )  # about 70 distinct questions


# the tiny model's tokenizer spends a token on about a character: a short question, no demonstration turn
TINY_RG = [
    "data.task=reasoning_gym",
    "+data.task_options.name=chain_sum",
    "+data.task_options.max_terms=2",
    "data.task_train_size=16",
    "data.task_val_size=4",
    "data.max_prompt_length=512",
    "trainer.total_steps=2",
    "trainer.progress=off",
]


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["batch", "fully_async"])
def test_tiny_run_trains_on_a_reasoning_gym_task(tmp_path, ray_session, mode):
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl

    train(load_config(["preset=tiny", f"pipeline.mode={mode}", f"trainer.output_dir={tmp_path}", *TINY_RG]))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics if m["step"] >= 1 and "reward/mean" in m] == [1, 2]
    val = [m for m in metrics if "val/acc" in m]
    assert val and "val/reasoning_gym/chain_sum/acc" in val[-1]
