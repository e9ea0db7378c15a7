"""verl's geo3k layout, as its preprocessing script writes it (``examples/data_preprocess/geo3k.py``: an
``images`` column of ``{bytes, path}`` structs, ``<image>`` at the start of the user turn, the boxed-answer
instruction, ``reward_model.ground_truth``), made here with pictures drawn in code, trains 2 steps on the tiny
vision-language model, named with verl's keys; the rows are scored by verl's geo3k scorer (data_source
``hiyouga/geometry3k``)."""

from __future__ import annotations

import io
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw

from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def _figure(i: int) -> bytes:
    """A line segment labelled with its length, in the manner of a geometry diagram."""
    img = Image.new("RGB", (84 + 14 * (i % 3), 56), "white")
    draw = ImageDraw.Draw(img)
    draw.line([(8, 40), (70, 12 + 4 * (i % 5))], fill="black", width=2)
    draw.text((30, 40), str(3 + i), fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _geo3k(path, n: int, split: str) -> str:
    rows = [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": f"<image>Find the length of the segment. {INSTRUCTION}"}],
            "images": [{"bytes": _figure(i), "path": None}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(3 + i)},
            "extra_info": {"split": split, "index": i, "answer": str(3 + i), "question": "Find the length."},
        }
        for i in range(n)
    ]
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("images", IMAGES),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
                ),
            ),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return str(path)


def test_verl_geo3k_parquet_trains_two_steps(tmp_path, ray_session):
    train_file, val_file = _geo3k(tmp_path / "train.parquet", 8, "train"), _geo3k(tmp_path / "test.parquet", 4, "test")
    notes: list[str] = []
    cfg = load_config(
        [
            "preset=tiny_vl",  # the engine and pipeline settings that take images (docs/multimodal.md)
            "algorithm.adv_estimator=grpo",  # as verl's geo3k scripts (verl's default is gae)
            "actor_rollout_ref.model.path=tiny_vl",
            f"data.train_files=[{train_file}]",
            f"data.val_files=[{val_file}]",
            "data.image_key=images",
            "data.prompt_key=prompt",
            "data.max_prompt_length=256",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "data.max_response_length=8",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.test_freq=2",
            "trainer.progress=off",
        ],
        notes=notes,
    )
    assert cfg.data.train_files == [train_file] and cfg.data.image_key == "images"
    train(cfg)
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    steps = [m for m in metrics if m["step"] >= 1 and "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0 for m in steps), steps
    assert abs(steps[0]["actor/mismatch_kl_k1"]) < 1e-4, steps[0]  # the trainer saw the images the engine saw
    val = {k for m in metrics for k in m if k.startswith("val/")}
    assert any("geometry3k" in k for k in val), sorted(val)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {s["data_source"] for s in samples} == {"hiyouga/geometry3k"}
