"""Image prompt rows (``offstep.data.images``): verl's geo3k layout (an ``images`` column of
``{bytes, path}`` structs and ``<image>`` in the prompt) loads and encodes with the image tokens
expanded; bytes and paths under the data folder are read; a missing, unreadable, too large or
outside image, a link, and a placeholder count that does not match are refused naming the row."""

from __future__ import annotations

import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from offstep.data.dataset import DatasetError, load_records
from offstep.data.images import ImageSpec, fit_image, fitted_size, with_image_parts

SPEC = ImageSpec(image_token_id=514, min_pixels=28 * 28, max_pixels=112 * 112, factor=28)


def _png(w: int = 56, h: int = 56) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), "blue").save(buf, format="PNG")
    return buf.getvalue()


def _write(path, images, content="<image>Find x.", image_type=None) -> str:
    row = {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {"index": 0},
    }
    rows = [dict(row, prompt=[{"role": "user", "content": "What is 1 + 2?"}], images=[]), row]
    schema = None
    if image_type is not None:
        schema = pa.schema(
            [
                ("data_source", pa.string()),
                ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                ("images", image_type),
                ("ability", pa.string()),
                ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
                ("extra_info", pa.struct([("index", pa.int64())])),
            ]
        )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return str(path)


GEO3K_IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


@pytest.mark.heavy  # loads the tiny_vl tokenizer and image processor (about 5 s)
def test_geo3k_layout_loads_and_encodes(tmp_path):
    from offstep.data.dataset import encode_prompts
    from offstep.data.image_spec import image_spec
    from offstep.models.loading import load_tokenizer, resolve_model

    f = _write(tmp_path / "train.parquet", [{"bytes": _png(112, 56), "path": None}], image_type=GEO3K_IMAGES)
    records = load_records(f)
    assert [len(r.images) for r in records] == [0, 1]
    path = resolve_model("tiny_vl")
    spec = image_spec(path)
    assert spec == ImageSpec(514, 784, 12544, 28)
    enc = encode_prompts(records, load_tokenizer(path), 64, image_spec=spec)
    assert enc[0].images == () and spec.image_token_id not in enc[0].prompt_ids
    ids = enc[1].prompt_ids
    assert ids.count(spec.image_token_id) == 8  # 112x56: a 4x2 grid of 28-pixel blocks
    first = ids.index(spec.image_token_id)
    assert ids[first - 1] == 512 and ids[first + 8] == 513  # vision_start ... vision_end around the run
    assert Image.open(io.BytesIO(enc[1].images[0])).size == (112, 56)
    # an image row under a limit it cannot fit: dropped (never cut through its image), the text row kept
    short = encode_prompts(records, load_tokenizer(path), 20, overlong="left", image_spec=spec)
    assert [e.record.index for e in short] == [0]


def test_bytes_and_paths_under_the_data_folder(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png(30, 40))
    f = _write(tmp_path / "d.parquet", [{"bytes": None, "path": "img/a.png"}])
    assert Image.open(io.BytesIO(load_records(f)[1].images[0])).size == (30, 40)
    f = _write(tmp_path / "e.parquet", [_png(28, 28)], content="<image> and")
    assert len(load_records(f)[1].images) == 1


@pytest.mark.parametrize(
    "case, want",
    [
        ("missing", "is missing"),
        ("unreadable", "not an image Pillow can read"),
        ("too_large", "refused before decoding"),
        ("outside", "outside the data file's folder"),
        ("link", "symbolic link"),
        ("count", "1 <image> placeholders for 2 images"),
        ("truncated", "cannot be decoded"),
    ],
)
def test_bad_images_are_refused_naming_the_row(tmp_path, case, want):
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "secret.png").write_bytes(_png())
    images = {
        "missing": [{"bytes": None, "path": "nope.png"}],
        "unreadable": [{"bytes": b"not an image at all", "path": None}],
        "too_large": [{"bytes": _png(300, 300), "path": None}],
        "outside": [{"bytes": None, "path": "../secret.png"}],
        "link": [{"bytes": None, "path": "link.png"}],
        "count": [{"bytes": _png(), "path": None}, {"bytes": _png(), "path": None}],
        "truncated": [{"bytes": _png(200, 200)[:-40], "path": None}],
    }[case]
    if case == "link":
        os.symlink(tmp_path / "secret.png", data / "link.png")
    f = _write(data / "train.parquet", images)
    with pytest.raises(DatasetError) as err:
        load_records(f, max_image_pixels=256 * 256)
    msg = str(err.value)
    assert want in msg and "row 1" in msg and "train.parquet" in msg and "Fix" in msg, msg


def test_rows_of_a_text_model_with_images_are_refused(tmp_path):
    from offstep.data.dataset import encode_prompts
    from offstep.models.loading import load_tokenizer, resolve_model

    f = _write(tmp_path / "train.parquet", [_png()])
    with pytest.raises(DatasetError, match="row 1 has images, but model.path is a text model"):
        encode_prompts(load_records(f), load_tokenizer(resolve_model("tiny")), 64, image_spec=None)


def test_fitting_and_placeholders():
    # sides to multiples of 28, pixels into [784, 12544], aspect kept
    assert fitted_size(56, 56, SPEC) == (56, 56)
    assert fitted_size(10, 10, SPEC) == (28, 28)
    assert fitted_size(224, 224, SPEC) == (112, 112)
    assert fitted_size(60, 100, SPEC) == (56, 112)
    png, n = fit_image(_png(100, 60), SPEC)
    assert Image.open(io.BytesIO(png)).size == (112, 56) and n == 8
    parts = with_image_parts([{"role": "user", "content": "a<image>b<image>"}, {"role": "system", "content": "s"}])
    assert parts[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
        {"type": "image"},
    ]
    assert parts[1] == {"role": "system", "content": "s"}


def test_jsonl_rows_with_image_paths(tmp_path):
    import json

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png(56, 28))
    row = {
        "data_source": "shapes",
        "prompt": "<image>How many?",
        "images": ["img/a.png"],
        "reward_model": {"ground_truth": "1"},
    }
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(row) + "\n" + json.dumps(dict(row, images=[])) + "\n")
    with pytest.raises(DatasetError, match="row 1: the prompt has 1 <image> placeholders for 0 images"):
        load_records(str(f))
    f.write_text(json.dumps(row) + "\n")
    [r] = load_records(str(f))
    assert Image.open(io.BytesIO(r.images[0])).size == (56, 28)
