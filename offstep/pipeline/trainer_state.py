"""``trainer_state.json``, the driver's share of a checkpoint: its format (``encode_state``) and
its reading (``decode_state``), which decodes the JSON field by field and checks each value's type
(floats round-trip exactly; NaN and infinities are written as Python's json writes them), the
stored samples, the prompt stream's position and the fully asynchronous stream's groups
(``decode_stream_groups``) included, so that a damaged file is refused before any worker starts.
``offstep/pipeline/checkpoints.py`` writes and opens the checkpoints that hold it."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

from offstep.batch import AgentStats, GenTiming, Sample, Span
from offstep.files import loads_json, short
from offstep.pipeline.dynamic_sampling import Generated
from offstep.rollout.agents.agent_loop import LOOP_LISTS, AgentResult

STATE_FILE = "trainer_state.json"
FORMAT = 2  # 2: with the files' digests (format 1, without them, is still read)
# A run id as offstep writes it (a uuid4's hex); anything else read from a file is refused, so that
# what the console prints of it holds no escape codes.
RUN_ID = re.compile(r"[0-9A-Za-z_.-]{0,128}")


@dataclass
class TrainerState:
    """The driver's share of a checkpoint (the trainer roles write their own shards)."""

    step: int  # the last step done
    version: int  # the trainer's policy version
    t0: float  # the run's clock origin (timeline.jsonl is relative to it)
    stream: dict  # PromptStream.state_dict(): epoch, position, order
    in_flight: list  # (batch index, epoch, prompt indices, Generated) of each batch generating ahead
    restarts: int  # rollout replicas replaced so far
    kl_ctrl: dict | None = None  # the KL-in-reward controller's state
    stream_groups: dict | None = None  # pipeline.mode=fully_async: SampleStream.state()


def _span(s: Span | None) -> list | None:
    return None if s is None else [s.start, s.end, s.version]


def _unspan(v: list | None) -> Span | None:
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 3 and _num(v[0]) and _num(v[1]) and (v[2] is None or _int(v[2]))):
        raise ValueError(f"a span {short(v)} is not [start, end, version]")
    return Span(float(v[0]), float(v[1]), v[2])


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ints(v) -> bool:
    return isinstance(v, list) and all(_int(x) for x in v)


def _nums(v) -> bool:
    return isinstance(v, list) and all(_num(x) for x in v)


def _get_int(doc: dict, key: str) -> int:
    v = doc.get(key)
    if not _int(v):
        raise ValueError(f"{key} is {short(v)}, not an integer")
    return v


# What each field of a stored sample must be (None allowed for the optional ones).
_SAMPLE_CHECKS: dict[str, Callable] = {
    "uid": _int,
    "prompt_ids": _ints,
    "response_ids": _ints,
    "rollout_logprobs": _nums,
    "finish_reason": lambda v: isinstance(v, str),
    "score": _num,
    "version": _int,
    "data_source": lambda v: isinstance(v, str),
    "text": lambda v: isinstance(v, str),
    "reward_extra": lambda v: isinstance(v, dict),
    "ref_logprobs": lambda v: v is None or _nums(v),
    "baseline_score": lambda v: v is None or _num(v),
    "baseline_length": lambda v: v is None or _int(v),
    "loss_mask": lambda v: v is None or _ints(v),
    "token_versions": lambda v: v is None or _ints(v),
    "kv_age": _int,
    "teacher_logprobs": lambda v: v is None or _nums(v),
    "teacher_topk_ids": lambda v: v is None or (isinstance(v, list) and all(_ints(row) for row in v)),
    "teacher_topk_logprobs": lambda v: v is None or (isinstance(v, list) and all(_nums(row) for row in v)),
    "agent": lambda v: (
        v is None
        or (
            isinstance(v, dict)
            and set(v) <= {f.name for f in fields(AgentStats)}
            and all(isinstance(x, (int, float)) for x in v.values())
        )
    ),  # max_turns_hit a bool
}
_REQUIRED = {
    f.name for f in fields(Sample) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
}


def _sample(d: dict) -> Sample:
    if not isinstance(d, dict) or not set(d) <= set(_SAMPLE_CHECKS) or not _REQUIRED <= set(d):
        raise ValueError(f"a sample with fields {sorted(d) if isinstance(d, dict) else type(d).__name__}")
    bad = [k for k, v in d.items() if not _SAMPLE_CHECKS[k](v)]
    if bad:
        raise ValueError(f"a sample whose {bad[0]} is {short(d[bad[0]])}")
    return Sample(**d)


def _encode_generated(g: Generated) -> dict:
    """Every sample once: those of the rounds in order, then the training samples as indices into
    them (they are the same objects), so a decoded batch shares samples as the original did."""
    flat: list[dict] = []
    where: dict[int, int] = {}
    rounds = []
    for results in g.rounds:
        per_replica = []
        for samples, timing in results:
            for s in samples:
                where[id(s)] = len(flat)
                flat.append(dataclasses.asdict(s))
            per_replica.append([len(samples), _span(timing.gen), _span(timing.ref), timing.cut])
        rounds.append(per_replica)
    chosen = [where[id(s)] if id(s) in where else dataclasses.asdict(s) for s in g.samples]
    return {
        "round_samples": flat,
        "rounds": rounds,
        "samples": chosen,
        "prompt_of": [[u, i] for u, i in g.prompt_of.items()],
        "kept_groups": g.kept_groups,
        "filled_groups": g.filled_groups,
        "dropped": [where[id(s)] for s in g.dropped if id(s) in where],
    }  # env.on_error's, for the step's counts


def _decode_generated(d: dict) -> Generated:
    flat = [_sample(s) for s in d["round_samples"]]
    pos, rounds = 0, []
    for per_replica in d["rounds"]:
        results = []
        for entry in per_replica:
            if not isinstance(entry, list) or len(entry) not in (3, 4):  # 3: before over-sampling was counted
                raise ValueError(f"a round's replica entry {short(entry)} is not [samples, gen, ref, cut]")
            n, gen, ref, cut = (*entry, 0) if len(entry) == 3 else entry
            if not _int(n) or n < 0:
                raise ValueError(f"a round holds {short(n)} samples")
            if not _int(cut) or cut < 0:
                raise ValueError(f"a round's replica cut {short(cut)} samples")
            results.append((flat[pos : pos + n], GenTiming(_unspan(gen), _unspan(ref), cut=cut)))
            pos += n
        rounds.append(results)
    if pos != len(flat):
        raise ValueError(f"the rounds hold {pos} samples, the file {len(flat)}")
    samples = [flat[x] if _int(x) and 0 <= x < len(flat) else _sample(x) for x in d["samples"]]
    if not all(isinstance(p, list) and len(p) == 2 and _int(p[0]) and _int(p[1]) for p in d["prompt_of"]):
        raise ValueError("prompt_of is not a list of [uid, prompt index] pairs")
    dropped = d.get("dropped", [])  # absent from a checkpoint written before groups were dropped
    if not isinstance(dropped, list) or not all(_int(x) and 0 <= x < len(flat) for x in dropped):
        raise ValueError("dropped is not a list of indices into the rounds' samples")
    return Generated(
        rounds,
        samples,
        {u: i for u, i in d["prompt_of"]},
        _get_int(d, "kept_groups"),
        _get_int(d, "filled_groups"),
        [flat[x] for x in dropped],
    )


_STATE_CHECKS: dict[str, Callable] = {
    "tokens": _ints,
    "logprobs": _nums,
    "versions": _ints,
    "finish_reason": lambda v: isinstance(v, str),
    "score": lambda v: v is None or _num(v),
    "extra": lambda v: isinstance(v, dict),
    "text": lambda v: isinstance(v, str),
    "loss_mask": lambda v: v is None or _ints(v),
    "agent": lambda v: v is None or isinstance(v, dict),
    "info": lambda v: v is None or isinstance(v, dict),
    "prompt_ids": lambda v: v is None or _ints(v),
    "loop": lambda v: v is None or _loop(v),
    "kv_age": _int,
}


def _loop(v) -> bool:
    """A stored tool loop (``SampleState.loop``): an AgentResult's fields only, each of its field's
    kind (an int where the field is an int, ...), its per-token lists of one length."""
    kinds = {
        bool: lambda x: isinstance(x, bool),
        int: _int,
        float: _num,
        str: lambda x: isinstance(x, str),
        list: lambda x: isinstance(x, list),
    }
    like = {
        f.name: type(f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        for f in dataclasses.fields(AgentResult)
    }
    like["request_pos"] = int  # no default
    return (
        isinstance(v, dict)
        and set(v) <= set(like)
        and "request_pos" in v
        and all(kinds[like[k]](x) for k, x in v.items())
        and _ints(v.get("response_ids", []))
        and _nums(v.get("logprobs", []))
        and _ints(v.get("versions", []))
        and _ints(v.get("loss_mask", []))
        and len({len(v.get(k, [])) for k in LOOP_LISTS}) == 1
        and all(isinstance(c, dict) for c in v.get("calls", []))
    )


def decode_stream_groups(d, num_items: int | None = None, replicas: int | None = None) -> list[dict]:
    """The fully asynchronous stream's groups from a checkpoint (``SampleStream.state``), checked:
    each group's admission number, prompt and version, and either its samples' states (unfinished;
    tokens, log-probs and versions of equal length) or its finished samples."""
    if not isinstance(d, dict) or not _int(d.get("admitted")) or not _ints(d.get("drawn")) or not _int(d.get("epoch")):
        raise ValueError("stream_groups is not an object with integer admitted, drawn and epoch")
    if not isinstance(d.get("groups"), list):
        raise ValueError("stream_groups.groups is not a list")
    out = []
    for grp in d["groups"]:
        if not isinstance(grp, dict) or not all(
            _int(grp.get(k)) for k in ("g", "epoch", "prompt", "replica", "version")
        ):
            raise ValueError(f"a stream group {short(grp)} without integer g, epoch, prompt, replica and version")
        if num_items is not None and not 0 <= grp["prompt"] < num_items:
            raise ValueError(
                f"a stream group's prompt {grp['prompt']} is outside the training set ({num_items} prompts)"
            )
        states, samples = grp.get("states"), grp.get("samples")
        if (states is None) == (samples is None):
            raise ValueError("a stream group needs exactly one of states (unfinished) and samples (finished)")
        if states is not None:
            if not isinstance(states, list) or not all(
                isinstance(s, dict)
                and set(s) <= set(_STATE_CHECKS)
                and all(_STATE_CHECKS[k](v) for k, v in s.items())
                and len(s.get("tokens", [])) == len(s.get("logprobs", [])) == len(s.get("versions", []))
                for s in states
            ):
                raise ValueError(
                    f"stream group {grp['g']}: a sample state that is not tokens, log-probs and versions of one length"
                )
            out.append({**grp, "states": states})
        else:
            if not isinstance(samples, list):
                raise ValueError(f"stream group {grp['g']}: samples is not a list")
            out.append({**grp, "samples": [_sample(s) for s in samples]})
    return out


def _plain(o):
    """json's hook for what it cannot write: NumPy scalars and arrays (e.g. in reward_extra)."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"a {type(o).__name__} cannot be stored in {STATE_FILE}")


def encode_state(state: TrainerState, run_id: str, files: dict[str, list] | None = None) -> str:
    in_flight = [
        {"batch": b, "epoch": e, "prompts": list(idx), "generated": _encode_generated(g)}
        for b, e, idx, g in state.in_flight
    ]
    doc = {
        "format": FORMAT,
        "run_id": run_id,
        "step": state.step,
        "version": state.version,
        "t0": state.t0,
        "restarts": state.restarts,
        "stream": state.stream,
        "kl_ctrl": state.kl_ctrl,
        "in_flight": in_flight,
        "files": files or {},
    }
    if state.stream_groups is not None:
        doc["stream_groups"] = state.stream_groups
    return json.dumps(doc, default=_plain)


def _check_stream(stream) -> None:
    if not isinstance(stream, dict) or not _int(stream.get("epoch")) or not _int(stream.get("position")):
        raise ValueError(f"stream is {short(stream)}, not a prompt stream state with integer epoch and position")
    for key, ok in (
        ("num_items", _int),
        ("batch_size", _int),
        ("seed", _int),
        ("shuffle", lambda v: isinstance(v, bool)),
    ):
        if stream.get(key) is not None and not ok(stream[key]):
            raise ValueError(f"stream.{key} is {short(stream[key])}")


def decode_state(text: str) -> tuple[TrainerState, str, dict[str, list]]:
    """(state, run id, files' digests) from ``trainer_state.json``; ``ValueError`` (or
    ``KeyError``/``TypeError``) for anything that is not what :func:`encode_state` writes."""
    doc = loads_json(text)
    if not isinstance(doc, dict) or doc.get("format") not in (1, FORMAT):
        raise ValueError(f"not a trainer state of format {FORMAT}")
    if not isinstance(doc.get("in_flight"), list) or not all(isinstance(b, dict) for b in doc["in_flight"]):
        raise ValueError("in_flight is not a list of objects")
    in_flight = []
    for b in doc["in_flight"]:
        if not _ints(b.get("prompts")) or not isinstance(b.get("generated"), dict):
            raise ValueError("an in-flight batch without integer prompts or its samples")
        in_flight.append(
            (_get_int(b, "batch"), _get_int(b, "epoch"), list(b["prompts"]), _decode_generated(b["generated"]))
        )
    stream, kl = doc["stream"], doc["kl_ctrl"]
    _check_stream(stream)
    if not (kl is None or (isinstance(kl, dict) and all(_num(v) for v in kl.values()))):
        raise ValueError(f"kl_ctrl is {short(kl)}, not an object of numbers")
    if not _num(doc.get("t0")) or not isinstance(doc.get("run_id"), str) or not RUN_ID.fullmatch(doc["run_id"]):
        raise ValueError(
            f"t0 is not a number or run_id ({short(doc.get('run_id'))}) not a run id of letters, digits, "
            f"'_', '.' and '-'"
        )
    files = doc.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(v, list) and len(v) == 2 and _int(v[0]) and isinstance(v[1], str) for v in files.values()
    ):
        raise ValueError("files is not an object of [size, sha256] pairs")
    groups = doc.get("stream_groups")
    if groups is not None:
        decode_stream_groups(groups)  # checked now: a damaged checkpoint is refused before any worker starts
    state = TrainerState(
        _get_int(doc, "step"),
        _get_int(doc, "version"),
        float(doc["t0"]),
        stream,
        in_flight,
        _get_int(doc, "restarts"),
        kl,
        groups,
    )
    return state, doc["run_id"], files
