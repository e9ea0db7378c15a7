"""Tests for offstep.data: dataset loading, prompt encoding and built-in tasks (the prompt stream: test_data_stream.py)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from offstep.data.dataset import (
    DatasetError,
    EncodedPrompt,
    PromptRecord,
    _to_plain,
    encode_prompts,
    load_records,
)

# --------------------------------------------------------------------------------------------------
# helpers

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
    """A tiny word-level ChatML tokenizer, built in memory (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += "what is a b c d e f g h one two three four five six seven eight nine ten ?".split()
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML,
    )


def verl_rows():
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "what is one ?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"split": "train", "index": 0, "question": "q0"},
        },
        {
            "data_source": "arithmetic",
            "prompt": [
                {"role": "system", "content": "a b"},
                {"role": "user", "content": "what is two ?"},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"split": "train", "index": 1, "question": "q1"},
        },
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rec(index, content, source="s"):
    return PromptRecord(index, source, [{"role": "user", "content": content}], "0")


# --------------------------------------------------------------------------------------------------
# load_records: round trips


def test_parquet_round_trip_pandas(tmp_path):
    path = tmp_path / "train.parquet"
    pd.DataFrame(verl_rows()).to_parquet(path)
    records = load_records(str(path))
    assert len(records) == 2
    r0, r1 = records
    assert r0 == PromptRecord(
        index=0,
        data_source="openai/gsm8k",
        messages=[{"role": "user", "content": "what is one ?"}],
        ground_truth="1",
        ability="math",
        extra_info={"split": "train", "index": 0, "question": "q0"},
    )
    assert r1.index == 1 and r1.data_source == "arithmetic"
    assert [m["role"] for m in r1.messages] == ["system", "user"]
    # plain Python values, not numpy / pyarrow
    assert type(r1.messages) is list and type(r1.messages[0]) is dict
    assert type(r1.extra_info) is dict and type(r1.extra_info["index"]) is int


def test_parquet_round_trip_pyarrow_and_missing_optional_columns(tmp_path):
    path = tmp_path / "mydata.parquet"
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "7"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    (r,) = load_records(str(path))
    assert r.data_source == "mydata"  # defaults to the file stem
    assert r.ability == "" and r.extra_info == {}
    assert r.ground_truth == "7"


def test_parquet_string_prompt_and_answer_key(tmp_path):
    path = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["what is a ?", "b"], "label": [3, 4]}).to_parquet(path)
    records = load_records(str(path), prompt_key="question", answer_key="label")
    assert records[0].messages == [{"role": "user", "content": "what is a ?"}]
    assert [r.ground_truth for r in records] == [3, 4]
    assert all(type(r.ground_truth) is int for r in records)


def test_jsonl_round_trip(tmp_path):
    rows = verl_rows()
    rows[0].pop("data_source")
    rows.append({"prompt": "plain string prompt", "reward_model": {"ground_truth": 5}})
    path = write_jsonl(tmp_path / "stuff.jsonl", rows)
    records = load_records(path)
    assert len(records) == 3
    assert records[0].data_source == "stuff"
    assert records[1].data_source == "arithmetic"
    assert records[1].messages == rows[1]["prompt"]
    assert records[2].messages == [{"role": "user", "content": "plain string prompt"}]
    assert records[2].ground_truth == 5
    assert records[0].extra_info == {"split": "train", "index": 0, "question": "q0"}


def test_jsonl_blank_lines_and_answer_key(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"q": "a", "ans": "1"}\n\n{"q": "b", "ans": "2"}\n')
    records = load_records(str(path), prompt_key="q", answer_key="ans")
    assert [r.ground_truth for r in records] == ["1", "2"]
    assert [r.index for r in records] == [0, 1]


def test_json_array_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(verl_rows()))
    assert [r.ground_truth for r in load_records(str(path))] == ["1", "2"]


def test_parquet_and_jsonl_agree(tmp_path):
    rows = verl_rows()
    pq_path = tmp_path / "same.parquet"
    pd.DataFrame(rows).to_parquet(pq_path)
    js_path = write_jsonl(tmp_path / "same.jsonl", rows)
    assert load_records(str(pq_path)) == load_records(js_path)


def test_to_plain_converts_numpy():
    value = {"a": np.array([1, 2]), "b": np.float32(0.5), "c": [np.int64(3)], "d": np.bool_(True)}
    out = _to_plain(value)
    assert out == {"a": [1, 2], "b": 0.5, "c": [3], "d": True}
    assert type(out["a"][0]) is int and type(out["c"][0]) is int and type(out["d"]) is bool


# --------------------------------------------------------------------------------------------------
# load_records: errors


def test_error_missing_file(tmp_path):
    path = str(tmp_path / "nope.parquet")
    with pytest.raises(DatasetError, match="not found") as ei:
        load_records(path)
    assert path in str(ei.value) and "Fix" in str(ei.value)


def test_error_unsupported_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unsupported file extension '\.csv'") as ei:
        load_records(str(path))
    assert ".parquet" in str(ei.value) and str(path) in str(ei.value)


def test_error_directory(tmp_path):
    with pytest.raises(DatasetError, match="directory"):
        load_records(str(tmp_path))


def test_error_corrupt_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"this is not parquet at all")
    with pytest.raises(DatasetError, match="cannot read the parquet file") as ei:
        load_records(str(path))
    assert str(path) in str(ei.value) and "Fix" in str(ei.value)
    assert ei.value.__cause__ is not None


def test_error_corrupt_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "reward_model": {"ground_truth": 1}}\n{not json\n')
    with pytest.raises(DatasetError, match="line 2 is not valid JSON") as ei:
        load_records(str(path))
    assert str(path) in str(ei.value)


def test_error_jsonl_non_object_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('"just a string"\n')
    with pytest.raises(DatasetError, match="row 0 is a JSON str"):
        load_records(str(path))


def test_error_jsonl_not_utf8(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DatasetError, match="UTF-8"):
        load_records(str(path))


def test_error_empty_jsonl(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DatasetError, match="empty") as ei:
        load_records(str(path))
    assert str(path) in str(ei.value)


def test_error_empty_parquet(tmp_path):
    path = tmp_path / "empty.parquet"
    schema = pa.schema([("prompt", pa.string()), ("reward_model", pa.string())])
    pq.write_table(schema.empty_table(), path)
    with pytest.raises(DatasetError, match="empty"):
        load_records(str(path))


def test_error_missing_prompt_column(tmp_path):
    path = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["a"], "reward_model": [{"ground_truth": "1"}]}).to_parquet(path)
    with pytest.raises(DatasetError) as ei:
        load_records(str(path))
    msg = str(ei.value)
    assert "'prompt'" in msg and "question" in msg and "reward_model" in msg
    assert "data.prompt_key" in msg and str(path) in msg


def test_error_missing_reward_model_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DatasetError) as ei:
        load_records(path)
    msg = str(ei.value)
    assert "reward_model" in msg and "data.answer_key" in msg and "'answer'" in msg


def test_error_missing_answer_key_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DatasetError, match="missing answer column 'label'") as ei:
        load_records(path, answer_key="label")
    assert "data.answer_key" in str(ei.value)


def test_error_reward_model_without_ground_truth(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "reward_model": {"style": "rule"}}])
    with pytest.raises(DatasetError, match="row 0: 'reward_model' must be a dict with a 'ground_truth'"):
        load_records(path)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "non-empty list"),
        (42, "non-empty list"),
        (["hello"], "message 0 .* is a str"),
        ([{"content": "x"}], "no string 'role'"),
        ([{"role": "user", "content": 3}], "no string 'content'"),
        ([{"role": "user"}], "no string 'content'"),
    ],
)
def test_error_bad_message_format(tmp_path, prompt, match):
    rows = [{"prompt": "fine", "reward_model": {"ground_truth": 1}}]
    rows.append({"prompt": prompt, "reward_model": {"ground_truth": 1}})
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=match) as ei:
        load_records(path)
    assert "row 1" in str(ei.value) and path in str(ei.value) and "Fix" in str(ei.value)


def test_error_bad_extra_info(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "reward_model": {"ground_truth": 1}, "extra_info": 3}])
    with pytest.raises(DatasetError, match="extra_info"):
        load_records(path)


def test_dataset_error_is_value_error():
    assert issubclass(DatasetError, ValueError)


# --------------------------------------------------------------------------------------------------
# encode_prompts


def test_encode_prompts_uses_chat_template():
    tok = make_tokenizer()
    (enc,) = encode_prompts([rec(0, "what is one ?")], tok, max_prompt_length=100)
    assert isinstance(enc, EncodedPrompt) and enc.record.index == 0
    ids = tok.convert_tokens_to_ids
    expected = [ids("<|im_start|>"), ids("user"), ids("what"), ids("is"), ids("one"), ids("?")]
    expected += [ids("<|im_end|>"), ids("<|im_start|>"), ids("assistant")]
    assert enc.prompt_ids == expected
    assert all(type(t) is int for t in enc.prompt_ids)


def test_encode_prompts_filter(caplog):
    tok = make_tokenizer()
    # each prompt is 5 template tokens + its words
    records = [rec(0, "a"), rec(1, "a b c d e f g h"), rec(2, "b c"), rec(3, "a b c d e f")]
    with caplog.at_level(logging.WARNING, logger="offstep.data.dataset"):
        out = encode_prompts(records, tok, max_prompt_length=9)
    assert [e.record.index for e in out] == [0, 2]
    assert [len(e.prompt_ids) for e in out] == [6, 7]
    assert "dropped 2 of 4" in caplog.text


def test_encode_prompts_length_limit_is_inclusive():
    tok = make_tokenizer()
    out = encode_prompts([rec(0, "a b c d")], tok, max_prompt_length=9)
    assert len(out[0].prompt_ids) == 9


def test_encode_prompts_error_mode():
    tok = make_tokenizer()
    records = [rec(0, "a"), rec(5, "a b c d e f g h"), rec(7, "a b c d e f g h a b")]
    with pytest.raises(DatasetError) as ei:
        encode_prompts(records, tok, max_prompt_length=9, overlong="error")
    msg = str(ei.value)
    assert "row 5" in msg and "13 tokens" in msg
    assert "data.max_prompt_length" in msg and "data.overlong_prompts=filter" in msg
    # all short: no error
    assert len(encode_prompts(records[:1], tok, max_prompt_length=9, overlong="error")) == 1


def test_truncate_prompt_as_verl():
    from offstep.data.truncate import truncate_prompt

    ids = list(range(10))
    assert truncate_prompt(ids, 4, "left") == [6, 7, 8, 9]  # the last tokens
    assert truncate_prompt(ids, 4, "right") == [0, 1, 2, 3]  # the first
    assert truncate_prompt(ids, 5, "middle") == [0, 1, 7, 8, 9]  # first 5 // 2 = 2, last 3
    assert truncate_prompt(ids, 10, "left") is ids  # fits: unchanged
    with pytest.raises(ValueError, match="left, right, middle"):
        truncate_prompt(ids, 4, "sideways")


def test_encode_prompts_truncates_overlong_prompts():
    tok = make_tokenizer()
    records = [rec(0, "a"), rec(1, "a b c d e f g h")]  # 6 and 13 tokens
    full = encode_prompts(records, tok, max_prompt_length=20)[1].prompt_ids
    for how, want in (("left", full[-9:]), ("right", full[:9]), ("middle", full[:4] + full[-5:])):
        out = encode_prompts(records, tok, max_prompt_length=9, overlong=how)
        assert [e.record.index for e in out] == [0, 1]  # nothing dropped
        assert out[1].prompt_ids == want, how
        assert len(out[0].prompt_ids) == 6


def test_encode_prompts_everything_filtered():
    tok = make_tokenizer()
    with pytest.raises(DatasetError, match="data.max_prompt_length"):
        encode_prompts([rec(0, "a b c d"), rec(1, "a b c d e")], tok, max_prompt_length=5)


def test_encode_prompts_bad_arguments():
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="overlong"):
        encode_prompts([rec(0, "a")], tok, 10, overlong="truncate")
    with pytest.raises(ValueError, match="positive"):
        encode_prompts([rec(0, "a")], tok, 0)
    with pytest.raises(DatasetError, match="no records"):
        encode_prompts([], tok, 10)


def test_encode_prompts_without_chat_template():
    tok = make_tokenizer()
    tok.chat_template = None
    with pytest.raises(DatasetError, match="chat template"):
        encode_prompts([rec(3, "a")], tok, 10)


def test_load_then_encode(tmp_path):
    path = tmp_path / "t.parquet"
    pd.DataFrame(verl_rows()).to_parquet(path)
    out = encode_prompts(load_records(str(path)), make_tokenizer(), max_prompt_length=64)
    assert len(out) == 2
    assert len(out[1].prompt_ids) > len(out[0].prompt_ids)  # the system message is included
