"""A distillation teacher on disk (``distill.teacher.path``): resolved like the policy (a folder or
an alias), its weights from safetensors, and its tokenizer checked against the policy's before any
worker starts.

The teacher reads the student's own token ids, so both must mean the same thing by every id:
offstep aligns them only when the two vocabularies are equal (same token for every id). Any other
pair is refused here, naming both sizes and the first id that differs; re-tokenizing text across
vocabularies is not done (its per-token log-probs would no longer line up with the student's)."""

from __future__ import annotations

from offstep.errors import ModelError
from offstep.models.loading import load_tokenizer, resolve_model

KEY = "distill.teacher.path"


def _first_difference(mine: dict[str, int], theirs: dict[str, int]) -> str:
    by_id_mine = {i: t for t, i in mine.items()}
    by_id_theirs = {i: t for t, i in theirs.items()}
    for i in sorted(set(by_id_mine) | set(by_id_theirs)):
        if by_id_mine.get(i) != by_id_theirs.get(i):
            return f"id {i} is {by_id_theirs.get(i)!r} to the teacher and {by_id_mine.get(i)!r} to the policy"
    return "the same ids"


def resolve_teacher(path: str, policy_tokenizer, policy_path: str) -> str:
    """The teacher's local folder, after checking that its vocabulary is the policy's (``ModelError``
    naming the difference and the fix otherwise)."""
    try:
        folder = resolve_model(path)
    except ModelError as e:
        raise ModelError(f"{KEY}={path!r}: {e}") from None
    tok = load_tokenizer(folder)
    mine, theirs = policy_tokenizer.get_vocab(), tok.get_vocab()
    if mine != theirs:
        raise ModelError(
            f"{KEY}={path!r} has a vocabulary of {len(theirs)} tokens and the policy ({policy_path}) one of {len(mine)}, "
            f"not the same ({_first_difference(mine, theirs)}); the teacher scores the student's own token ids, so both "
            f"must share one tokenizer. Fix: give a teacher of the policy's model family (same tokenizer), or distil "
            f"into a student with the teacher's tokenizer"
        )
    return folder
