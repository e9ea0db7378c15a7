"""Cutting a prompt to ``data.max_prompt_length`` tokens, as verl's ``data.truncation`` does
(its RL dataset cuts the token ids of the rendered prompt): ``left`` keeps the last tokens,
``right`` the first, ``middle`` the first and the last halves (the first half rounded down)."""

from __future__ import annotations


def truncate_prompt(ids: list[int], max_len: int, how: str) -> list[int]:
    """``ids`` cut to ``max_len`` tokens by ``how`` (left | right | middle); unchanged when it fits."""
    if len(ids) <= max_len:
        return ids
    if how == "left":
        return ids[len(ids) - max_len :]
    if how == "right":
        return ids[:max_len]
    if how == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head) :]
    raise ValueError(f"truncation {how!r} is not one of left, right, middle")
