"""Typed containers passed between pipeline stages.

``Sample`` is one scored response as a rollout worker returns it. ``TrainBatch`` is the padded
tensor form the trainer consumes: prompts left-padded to P, responses right-padded to R, so
``input_ids = [prompt | response]`` has shape [B, P + R] and every per-token quantity of the
response (log-probs, advantages, ...) has shape [B, R].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Sample:
    """One response, scored, tagged with the policy version that generated it."""

    uid: int  # group id: every sample of one prompt shares it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    score: float
    version: int
    data_source: str = ""
    text: str = ""
    reward_extra: dict = field(default_factory=dict)
    ref_logprobs: Optional[list[float]] = None  # set when the rollout worker holds the reference


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, P+R] long
    attention_mask: torch.Tensor  # [B, P+R] long
    position_ids: torch.Tensor  # [B, P+R] long
    response_mask: torch.Tensor  # [B, R] float
    rollout_logprobs: torch.Tensor  # [B, R] float
    scores: torch.Tensor  # [B] float
    group_ids: torch.Tensor  # [B] long
    versions: torch.Tensor  # [B] long
    prompt_len: int  # P
    old_logprobs: Optional[torch.Tensor] = None  # [B, R] trainer's log-probs before the update
    ref_logprobs: Optional[torch.Tensor] = None  # [B, R]
    values: Optional[torch.Tensor] = None  # [B, R]
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]

    def select(self, idx: torch.Tensor | slice) -> "TrainBatch":
        """Rows ``idx`` of every tensor field."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name)[idx]
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def chunks(self, size: int) -> list["TrainBatch"]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def to(self, device: torch.device | str) -> "TrainBatch":
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def collate(samples: list[Sample], pad_id: int) -> TrainBatch:
    """Pad samples into a ``TrainBatch`` (prompts left-padded, responses right-padded)."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    P = max(len(s.prompt_ids) for s in samples)
    R = max(1, max(len(s.response_ids) for s in samples))
    B = len(samples)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    rollout_logprobs = torch.zeros((B, R), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, P - p : P] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention_mask[i, P - p : P + r] = 1
        if r:
            input_ids[i, P : P + r] = torch.tensor(s.response_ids, dtype=torch.long)
            response_mask[i, :r] = 1.0
            rollout_logprobs[i, :r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    ref_logprobs = None
    if all(s.ref_logprobs is not None for s in samples):
        ref_logprobs = torch.zeros((B, R), dtype=torch.float32)
        for i, s in enumerate(samples):
            if s.response_ids:
                ref_logprobs[i, : len(s.response_ids)] = torch.tensor(s.ref_logprobs, dtype=torch.float32)
    # Positions count real tokens only, so a left-padded prompt sees the same positions as unpadded.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        scores=torch.tensor([s.score for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.uid for s in samples], dtype=torch.long),
        versions=torch.tensor([s.version for s in samples], dtype=torch.long),
        prompt_len=P,
        ref_logprobs=ref_logprobs,
    )
