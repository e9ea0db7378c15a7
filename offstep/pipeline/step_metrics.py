"""A step's record: the rollout metrics of its batch, the rollout side's stages on the timeline,
and the sample log (``samples.jsonl``). Metric names are grouped: ``rollout/``, ``reward/``,
``response_length/``, ``agent/`` (tool loops), ``sandbox/`` (model-written code), ``timing_s/``, ``perf/``."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import torch

from offstep.batch import GenTiming, Sample, TrainBatch
from offstep.rewards.combine import FALLBACK, MODEL, RULE
from offstep.telemetry.metrics import Timeline
from offstep.telemetry.names import Env, ResponseLength, Reward, Rollout, Sandbox, Stage, replica, reward_lane


@dataclass
class StepRecord:
    """What a step hands to the completion of its record (after its weight sync is checked):
    the metrics, and the control data beside them."""

    step: int
    version: int  # the policy version the step's update made
    metrics: dict
    export_s: float  # seconds of the weight export
    loads: asyncio.Future  # the replicas' loads (SyncReport), checked
    validate: bool  # a validation of the new version follows this step
    validation: asyncio.Future | None = None  # already queued (batch mode) or None (started after the loads)


def record_generation(
    timeline: Timeline, results: list[tuple[list[Sample], GenTiming]], step: int, stage: str = Stage.GEN
) -> tuple[list[Sample], float, float]:
    """Every replica's samples, in replica order, and the seconds of the slowest replica's
    generation and of its reference pass; the replicas' stages go on the timeline."""
    samples, gen_s, ref_s = [], 0.0, 0.0
    for i, (part, t) in enumerate(results):
        samples.extend(part)
        timeline.add(replica(i), stage, step, t.gen.start, t.gen.end, version=t.gen.version)
        gen_s = max(gen_s, t.gen.seconds)
        if t.ref is not None:
            timeline.add(replica(i), Stage.REF, step, t.ref.start, t.ref.end)
            ref_s = max(ref_s, t.ref.seconds)
        for span in t.tools:  # tools running (some sample's), inside the generation
            timeline.add(replica(i), Stage.TOOL, step, span.start, span.end)
        for span in t.reward:  # the reward model's batches, beside the generation
            timeline.add(reward_lane(i), Stage.REWARD_MODEL, step, span.start, span.end)
        for span in t.teacher:  # the distillation teacher's batches, on the same lane
            timeline.add(reward_lane(i), Stage.TEACHER, step, span.start, span.end)
    return samples, gen_s, ref_s


def reward_model_seconds(results: list[tuple[list[Sample], GenTiming]], field: str = "reward") -> float | None:
    """The slowest replica's seconds in reward-model batches (``field="teacher"``: the teacher's),
    or None without one."""
    if not any(getattr(t, field) for _, t in results):
        return None
    return max(sum(s.seconds for s in getattr(t, field)) for _, t in results)


def reward_component_metrics(samples: list[Sample]) -> dict:
    """``reward/rule/mean`` and ``reward/model/mean`` over the samples each scored, and the model's
    fallbacks (``offstep.rewards.combine``); none without a reward model."""
    m = {}
    for name, key in ((Reward.RULE_MEAN, RULE), (Reward.MODEL_MEAN, MODEL)):
        values = [s.reward_extra[key] for s in samples if key in s.reward_extra]
        if values:
            m[name] = sum(values) / len(values)
    if Reward.MODEL_MEAN in m:
        m[Reward.MODEL_FALLBACKS] = int(sum(s.reward_extra.get(FALLBACK, 0.0) for s in samples))
    return m


def agent_metrics(samples: list[Sample], prefix: str = "agent/") -> dict:
    """The tool loops' figures over the samples that ran one (none: no metrics). ``tool_errors``
    and ``tool_time_s`` are totals over the batch; ``well_formed_calls/frac`` is over the call
    attempts; ``masked_token_frac`` is the share of response tokens that are tool tokens."""
    looped = [s for s in samples if s.agent is not None]
    if not looped:
        return {}
    n = len(looped)
    turns = [s.agent.turns for s in looped]
    attempts = sum(s.agent.attempts for s in looped)
    tokens = sum(len(s.response_ids) for s in looped)
    masked = sum(len(s.loss_mask) - sum(s.loss_mask) for s in looped if s.loss_mask is not None)
    return {
        f"{prefix}turns/mean": sum(turns) / n,
        f"{prefix}turns/max": max(turns),
        f"{prefix}tool_calls/mean": sum(s.agent.tool_calls for s in looped) / n,
        f"{prefix}tool_errors": sum(s.agent.tool_errors for s in looped),
        f"{prefix}tool_time_s": sum(s.agent.tool_time_s for s in looped),
        f"{prefix}tool_use_frac": sum(s.agent.well_formed > 0 for s in looped) / n,
        f"{prefix}well_formed_calls/frac": sum(s.agent.well_formed for s in looped) / attempts if attempts else 0.0,
        f"{prefix}budget_cut_frac": sum(s.finish_reason == "length" for s in looped) / n,
        f"{prefix}max_turns_frac": sum(s.agent.max_turns_hit for s in looped) / n,
        f"{prefix}masked_token_frac": masked / tokens if tokens else 0.0,
        f"{prefix}prefix_breaks": sum(s.agent.prefix_breaks for s in looped),
    }


def sandbox_metrics(results: list[tuple[list[Sample], GenTiming]]) -> dict:
    """The ``sandbox/`` figures of a generation's replicas (:func:`executions_metrics`)."""
    return executions_metrics([run for _, t in results for run in t.sandbox])


def executions_metrics(runs: list) -> dict:
    """The ``sandbox/`` figures of sandboxed runs (``offstep.sandbox.Execution``; none without one):
    how many ran and timed out, their seconds (mean, 95th percentile) and their mean wait for a slot."""
    if not runs:
        return {}
    seconds = sorted(run.seconds for run in runs)
    return {
        Sandbox.EXECUTIONS: len(runs),
        Sandbox.TIMEOUTS: sum(run.timed_out for run in runs),
        Sandbox.SECONDS_MEAN: sum(seconds) / len(runs),
        Sandbox.SECONDS_P95: seconds[min(len(seconds) - 1, math.ceil(0.95 * len(seconds)) - 1)],  # nearest rank
        Sandbox.QUEUE_WAIT_S: sum(run.queue_wait_s for run in runs) / len(runs),
    }


def batch_metrics(step: int, epoch: int, samples: list[Sample], batch: TrainBatch, staleness: torch.Tensor) -> dict:
    lengths = batch.attention_mask[:, batch.prompt_len :].sum(-1).float()  # tool turns included
    return {
        "step": step,
        "epoch": epoch,
        Rollout.STALENESS_MAX: int(staleness.max()),
        Rollout.STALENESS_MEAN: float(staleness.float().mean()),
        Rollout.VERSION_MIN: int(batch.versions.min()),
        Reward.MEAN: float(batch.scores.mean()),
        Reward.MAX: float(batch.scores.max()),
        Reward.MIN: float(batch.scores.min()),
        **uniform_group_frac(samples),
        ResponseLength.MEAN: float(lengths.mean()),
        ResponseLength.MAX: float(lengths.max()),
        ResponseLength.CLIP_RATIO: sum(s.finish_reason == "length" for s in samples) / len(samples),
        **agent_metrics(samples),
        **reward_component_metrics(samples),
        **env_metrics(samples),
    }


def uniform_group_frac(samples: list[Sample]) -> dict:
    """``reward/uniform_group_frac``: the share of groups of two samples or more whose scores are all
    equal (their advantages are all 0 under GRPO); none where every group has one sample."""
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.uid, []).append(float(s.score))
    sized = [g for g in groups.values() if len(g) > 1]
    return {Reward.UNIFORM_GROUP_FRAC: sum(max(g) == min(g) for g in sized) / len(sized)} if sized else {}


def env_metrics(samples: list[Sample]) -> dict:
    """An environment's reward parts (``reward/<name>``, means) and its failed rollouts
    (``env/errors``, ``env/timeouts``, sums); none for a run without ``env.*``."""
    keys = {
        k for s in samples for k in s.reward_extra if k.startswith(Env.PART_PREFIX) or k in (Env.ERRORS, Env.TIMEOUTS)
    }
    m = {}
    for k in sorted(keys):
        values = [float(s.reward_extra[k]) for s in samples if k in s.reward_extra]
        m[k] = sum(values) if k in (Env.ERRORS, Env.TIMEOUTS) else sum(values) / len(values)
    return m


def dropped_metrics(dropped: list[Sample], m: dict) -> dict:
    """The failures of the groups a step dropped (env.on_error) added to ``m``'s counts, and how many
    groups were dropped; nothing for a run without ``env.*``."""
    from offstep.envs.failures import DROPPED_GROUPS

    if not dropped and Env.ERRORS not in m:
        return {}
    out = {
        k: m.get(k, 0.0) + sum(float(s.reward_extra.get(k, 0.0)) for s in dropped) for k in (Env.ERRORS, Env.TIMEOUTS)
    }
    out[DROPPED_GROUPS] = len({s.uid for s in dropped})
    return out


def sample_rows(step: int, samples: list[Sample], prompt_text: dict[int, str], count: int) -> list[dict]:
    """``count`` samples spread evenly over the batch, for ``samples.jsonl``; ``prompt_text``
    maps a group (uid) to its prompt's last message."""
    every = max(1, len(samples) // max(1, count))
    return [
        {
            "step": step,
            "version": s.version,
            "data_source": s.data_source,
            "prompt": prompt_text[s.uid],
            "response": s.text,
            "reward": s.score,
            "finish_reason": s.finish_reason,
            **({"turns": s.agent.turns, "tool_calls": s.agent.tool_calls} if s.agent is not None else {}),
        }
        for s in samples[::every][:count]
    ]
