"""verl's geo3k parquet layout as its preprocessing script writes it (``examples/data_preprocess/geo3k.py``):
an ``images`` column of ``{bytes, path}`` structs, ``<image>`` at the start of the user turn, the
boxed-answer instruction, ``reward_model.ground_truth``, data_source ``hiyouga/geometry3k``; the figures
are drawn in code."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def figure(i: int) -> bytes:
    """A line segment labelled with its length, in the manner of a geometry diagram."""
    img = Image.new("RGB", (84 + 14 * (i % 3), 56), "white")
    draw = ImageDraw.Draw(img)
    draw.line([(8, 40), (70, 12 + 4 * (i % 5))], fill="black", width=2)
    draw.text((30, 40), str(3 + i), fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_geo3k(path, n: int, split: str) -> str:
    rows = [
        {
            "data_source": "hiyouga/geometry3k",
            "prompt": [{"role": "user", "content": f"<image>Find the length of the segment. {INSTRUCTION}"}],
            "images": [{"bytes": figure(i), "path": None}],
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
