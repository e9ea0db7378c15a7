"""``offstep.models.vl_types``: a model folder's config.json says whether it is a vision-language model,
read without waiting on what is not a regular file and through the links model folders use."""

from __future__ import annotations

import json
import os
import threading

from offstep.models.vl_types import is_vision_language


def test_a_folder_is_vision_language_by_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert is_vision_language(tmp_path) and is_vision_language(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_vision_language(tmp_path)


def test_a_linked_config_is_followed(tmp_path):
    """Hugging Face's cache links a snapshot's files to its blobs."""
    blob, folder = tmp_path / "blob", tmp_path / "snapshot"
    blob.write_text(json.dumps({"model_type": "qwen2_vl"}))
    folder.mkdir()
    (folder / "config.json").symlink_to(blob)
    assert is_vision_language(folder)


def test_what_is_not_a_readable_json_file_is_not_vision_language(tmp_path):
    cases = {
        "missing": lambda d: None,
        "garbled": lambda d: (d / "config.json").write_text("{not json"),
        "a list": lambda d: (d / "config.json").write_text("[1, 2]"),
        "deep": lambda d: (d / "config.json").write_text("[" * 100_000),
        "a folder": lambda d: (d / "config.json").mkdir(),
        "huge": lambda d: (d / "config.json").write_bytes(b" " * (5 * 2**20)),
        "a dangling link": lambda d: (d / "config.json").symlink_to(d / "nowhere"),
    }
    for name, make in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        make(d)
        assert not is_vision_language(d), name


def test_a_fifo_is_never_waited_on(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    answer: list[bool] = []
    t = threading.Thread(target=lambda: answer.append(is_vision_language(tmp_path)), daemon=True)
    t.start()
    t.join(5)
    assert answer == [False], "the check blocked on a FIFO with no writer"
