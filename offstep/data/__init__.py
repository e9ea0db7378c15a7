"""Prompt data: dataset files, tokenization, the resumable prompt stream, built-in tasks."""

from offstep.data.dataset import (
    DatasetError,
    EncodedPrompt,
    PromptRecord,
    encode_prompts,
    load_records,
)
from offstep.data.stream import PromptStream
from offstep.data.tasks import TASKS, write_task

__all__ = [
    "DatasetError",
    "EncodedPrompt",
    "PromptRecord",
    "PromptStream",
    "TASKS",
    "encode_prompts",
    "load_records",
    "write_task",
]
