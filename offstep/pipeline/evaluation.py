"""Accuracy and reward of scored samples, overall and per data source — shared by validation
during training and by ``offstep eval``.

A sample counts as correct when its scorer says so (an ``acc`` field in a dict result) or, for
rule scorers that return only a score, when the score is at least 1; with a reward model
(``reward.model``) that score is the rule's component, where a rule scored the sample: the
accuracy stays the rule's whatever the model says. With n samples per prompt,
``mean@n`` averages over all samples and ``best@n`` takes each prompt's best sample.
"""

from __future__ import annotations

from collections import defaultdict

from offstep.batch import Sample
from offstep.envs.failures import FAILED
from offstep.pipeline.step_metrics import agent_metrics
from offstep.rewards.combine import RULE
from offstep.telemetry.names import Val, per_source

# What messages call the settings: offstep eval's flags (offstep.data.dataset.TRAIN_KEYS and
# offstep.rollout.agents.tools.TRAIN_KEYS name the config keys of offstep train).
DATA_FLAGS = {
    "files": "--data",
    "prompt_key": "--prompt-key",
    "answer_key": "--answer-key",
    "max_prompt_length": "--max-prompt-length",
    "tools": "--tools",
    "reward_path": "--reward-path",
    "max_rows": "--max-rows",
}
TOOL_FLAGS = {"path": "--tools-path", "names": "--tools", "timeout": "--tool-timeout"}


def is_correct(s: Sample) -> float:
    return float(s.reward_extra.get("acc", s.reward_extra.get(RULE, s.score) >= 1.0))


def acc_stderr(samples: list[Sample]) -> float:
    """The standard error of the accuracy over prompts: each prompt's mean accuracy (its samples are
    not independent of one another), their standard deviation (n - 1) over the square root of the
    number of prompts; 0 for a single prompt. A held-out accuracy that moves by less than about
    twice this between two validations has not clearly moved."""
    per_prompt: dict[tuple, list[float]] = defaultdict(list)
    for s in samples:
        per_prompt[s.data_source, s.uid].append(is_correct(s))
    means = [sum(v) / len(v) for v in per_prompt.values()]
    if len(means) < 2:
        return 0.0
    mu = sum(means) / len(means)
    return (sum((a - mu) ** 2 for a in means) / (len(means) - 1)) ** 0.5 / len(means) ** 0.5


def summarise(samples: list[Sample], prefix: str = Val.PREFIX) -> dict[str, float]:
    """Metrics named ``{prefix}acc`` (and its standard error ``{prefix}acc_stderr``),
    ``{prefix}reward/mean``, ``{prefix}<source>/acc``,
    ``{prefix}<source>/reward/mean``, and with several samples per prompt
    ``{prefix}<source>/acc/best@n``. An environment's rollouts that failed for good (env.on_error)
    are left out, never scored as 0."""
    samples = [s for s in samples if not s.reward_extra.get(FAILED)]
    if not samples:
        return {}
    m = {
        f"{prefix}acc": sum(map(is_correct, samples)) / len(samples),
        f"{prefix}acc_stderr": acc_stderr(samples),
        f"{prefix}reward/mean": sum(s.score for s in samples) / len(samples),
        **agent_metrics(samples, f"{prefix}agent/"),
    }
    by_source: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_source[s.data_source].append(s)
    for src, group in sorted(by_source.items()):
        m[per_source(prefix, src, "acc")] = sum(map(is_correct, group)) / len(group)
        m[per_source(prefix, src, "reward/mean")] = sum(s.score for s in group) / len(group)
        per_prompt: dict[int, list[Sample]] = defaultdict(list)
        for s in group:
            per_prompt[s.uid].append(s)
        n = max(len(v) for v in per_prompt.values())
        if n > 1:
            m[per_source(prefix, src, f"acc/best@{n}")] = sum(
                max(map(is_correct, v)) for v in per_prompt.values()
            ) / len(per_prompt)
            m[per_source(prefix, src, f"reward/best@{n}")] = sum(
                max(s.score for s in v) for v in per_prompt.values()
            ) / len(per_prompt)
    return m


def run_eval(
    model: str,
    data: str,
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    max_prompt_length: int = 1024,
    reward_path: str | None = None,
    reward_name: str = "compute_score",
    reward_timeout: float | None = 30.0,
    batch_size: int = 32,
    threads: int | None = None,
    seed: int = 0,
    on_progress=None,
    agent=None,
    max_rows: int = 10_000_000,
) -> tuple[dict[str, float], list[Sample]]:
    """Generate with the built-in engine and score with the training scorers (no Ray). A scorer
    call that takes over ``reward_timeout`` seconds (None: no limit) fails with the sample named.
    ``agent`` (an ``AgentConfig``): the tool loop that answers the file's tool_agent rows (their
    prompts then carry the tools' schemas); without it every row is answered in one turn."""
    import os

    from offstep.data.dataset import check_rule_ground_truths, encode_prompts, load_records
    from offstep.data.image_spec import image_spec
    from offstep.models.loading import check_model_path, load_tokenizer, resolve_model
    from offstep.pipeline.inputs import check_safetensors, to_request
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RolloutSpec
    from offstep.rollout.types import SamplingParams
    from offstep.rollout.worker import RolloutWorker

    check_model_path(model)
    reward = RewardFunction(
        reward_path,
        reward_name,
        reward_timeout,
        timeout_key="--reward-timeout",
        path_key="--reward-path",
        name_key="--reward-name",
    )
    records = load_records(data, prompt_key=prompt_key, answer_key=answer_key, keys=DATA_FLAGS, max_rows=max_rows)
    if not reward_path:
        check_rule_ground_truths(records, data, DATA_FLAGS)
    reward.check_sources({r.data_source for r in records})
    reward.check_call(records[0].data_source, records[0].ground_truth, records[0].extra_info or {})
    path = resolve_model(model)
    check_safetensors(path)
    schemas = None
    if agent is not None:
        from offstep.rollout.agents.tools import load_tools

        schemas = [t.schema for t in load_tools(agent.tools_path, list(agent.tools), agent.tool_timeout_s, TOOL_FLAGS)]
    spec = image_spec(path) if any(r.images for r in records) else None  # a VL model's image rows
    prompts = encode_prompts(
        records, load_tokenizer(path), max_prompt_length, tools=schemas, keys=DATA_FLAGS, image_spec=spec
    )
    worker = RolloutWorker(
        RolloutSpec.local(
            path,
            reward,
            max(batch_size * n, 1),
            num_threads=threads or os.cpu_count() or 1,
            reward_threads=2,
            agent=agent,
        )
    )
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    samples: list[Sample] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        out, _ = worker.generate([to_request(p, start + i) for i, p in enumerate(chunk)], params, seed + start)
        samples.extend(out)
        if on_progress is not None:
            on_progress(min(start + batch_size, len(prompts)), len(prompts))
    return summarise(samples, prefix=""), samples
