"""A step's record: the rollout metrics of its batch, the rollout side's stages on the timeline,
and the sample log (``samples.jsonl``). Metric names are grouped: ``rollout/``, ``reward/``,
``response_length/``, ``timing_s/``, ``perf/``."""

from __future__ import annotations

import torch

from offstep.batch import GenTiming, Sample, TrainBatch
from offstep.telemetry.metrics import Timeline


def record_generation(timeline: Timeline, results: list[tuple[list[Sample], GenTiming]], step: int,
                      stage: str = "gen") -> tuple[list[Sample], float, float]:
    """Every replica's samples, in replica order, and the seconds of the slowest replica's
    generation and of its reference pass; the replicas' stages go on the timeline."""
    samples, gen_s, ref_s = [], 0.0, 0.0
    for i, (part, t) in enumerate(results):
        samples.extend(part)
        timeline.add(f"rollout/{i}", stage, step, t.gen.start, t.gen.end, version=t.gen.version)
        gen_s = max(gen_s, t.gen.seconds)
        if t.ref is not None:
            timeline.add(f"rollout/{i}", "ref", step, t.ref.start, t.ref.end)
            ref_s = max(ref_s, t.ref.seconds)
    return samples, gen_s, ref_s


def batch_metrics(step: int, epoch: int, samples: list[Sample], batch: TrainBatch, staleness: torch.Tensor) -> dict:
    lengths = batch.response_mask.sum(-1)
    return {
        "step": step,
        "epoch": epoch,
        "rollout/staleness_max": int(staleness.max()),
        "rollout/staleness_mean": float(staleness.float().mean()),
        "rollout/version_min": int(batch.versions.min()),
        "reward/mean": float(batch.scores.mean()),
        "reward/max": float(batch.scores.max()),
        "reward/min": float(batch.scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }


def sample_rows(step: int, samples: list[Sample], prompt_text: dict[int, str], count: int) -> list[dict]:
    """``count`` samples spread evenly over the batch, for ``samples.jsonl``; ``prompt_text``
    maps a group (uid) to its prompt's last message."""
    every = max(1, len(samples) // max(1, count))
    return [
        {"step": step, "version": s.version, "data_source": s.data_source, "prompt": prompt_text[s.uid],
         "response": s.text, "reward": s.score, "finish_reason": s.finish_reason}
        for s in samples[::every][:count]
    ]
