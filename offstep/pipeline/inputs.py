"""The run's inputs, prepared in the driver before any worker starts: the model folder (its
safetensors headers read, so a damaged file is named here rather than in a dying worker), the
tokenised prompts of the training and validation sets, and the reward function (checked against
every data source in the data, and called once on a real sample to check its signature)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from offstep.config.choices import OPENAI_AGENT, SINGLE_TURN, TOOL_AGENT
from offstep.config.schema import AgentConfig, Config
from offstep.data.dataset import EncodedPrompt, PromptRecord, check_rule_ground_truths, encode_prompts, load_records
from offstep.data.image_spec import image_spec
from offstep.data.tasks import write_task
from offstep.data.vision_refusals import vision_problems
from offstep.errors import ConfigError, DatasetError, ModelError
from offstep.files import refuse_links_under
from offstep.models.loading import load_tokenizer, resolve_model, with_config_overrides
from offstep.rewards.registry import RewardFunction
from offstep.rollout.agents.agent_tools import agent_tools
from offstep.rollout.agents.openai_agent import load_agent
from offstep.rollout.replica_spec import Request

log = logging.getLogger(__name__)


@dataclass
class Inputs:
    model_path: str
    pad_id: int
    train: list[EncodedPrompt]
    val: list[EncodedPrompt]
    reward: RewardFunction
    agent: AgentConfig | None = None  # rollout.agent, set when some row is answered by a tool loop
    teacher_path: str | None = None  # distill.teacher.path's folder, its vocabulary checked against the policy's


def _files(cfg: Config, out_dir: Path) -> tuple[list[str], list[str]]:
    if cfg.data.train_files:
        return list(cfg.data.train_files), list(cfg.data.val_files)
    refuse_links_under(out_dir / "data")  # the task is written there: through no link
    train, val = write_task(
        cfg.data.task,
        str(out_dir / "data"),
        cfg.data.task_train_size,
        cfg.data.task_val_size,
        cfg.trainer.seed,
        **cfg.data.task_options,
    )
    return [train], [val]


def _records(files: list[str], cfg: Config) -> list[PromptRecord]:
    records = []
    for f in files:
        loaded = load_records(
            f,
            prompt_key=cfg.data.prompt_key,
            answer_key=cfg.data.answer_key,
            default_agent=cfg.rollout.agent.default_agent,
            max_rows=cfg.data.max_rows,
            image_key=cfg.data.image_key,
            max_image_pixels=cfg.data.max_image_pixels,
        )
        scored = [r for r in loaded if r.agent_name != OPENAI_AGENT]  # an OpenAI agent's return is its reward
        if (
            not cfg.reward.custom_path and cfg.reward.needs_rule
        ):  # the built-in scorers compare with one string or number
            check_rule_ground_truths(scored, f)
        records.extend(loaded)
    for i, r in enumerate(records):  # indices unique across files
        r.index = i
    return records


def _tools_for(records: list[PromptRecord], cfg: Config) -> tuple[AgentConfig | None, list[dict] | None]:
    """The agent config when some row is a tool row or an OpenAI agent's, and the tools' schemas
    when some row is a tool row (the tool file and the agent file are imported here, so that a bad
    file or name fails before any worker starts)."""
    names = {r.agent_name for r in records}
    if not names & {TOOL_AGENT, OPENAI_AGENT}:
        return None, None
    if cfg.algorithm.adv_estimator == "remax":
        raise ConfigError(
            "algorithm.adv_estimator=remax with tool rows or OpenAI agents (agent_name=tool_agent or "
            "openai): its greedy baseline is a single-turn response; use grpo, rloo or another estimator"
        )
    if OPENAI_AGENT in names:
        load_agent(cfg.rollout.agent.openai_path, cfg.rollout.agent.openai_name, cfg.rollout.agent.tool_timeout_s)
    if TOOL_AGENT not in names:
        return cfg.rollout.agent, None
    tools = agent_tools(cfg.rollout.agent)
    return cfg.rollout.agent, [t.schema for t in tools]


def check_safetensors(model_path: str) -> None:
    """Open the header of every safetensors file of a model folder (cheap: no tensor is read), and
    check that the shards an index names exist, so that a damaged or missing file is reported with
    its name before the workers load it."""
    from safetensors import SafetensorError, safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(
                f"{index}: cannot read the shard index ({type(exc).__name__}: {exc}). Fix: re-save the "
                f"model with `save_pretrained`, or copy the file again"
            ) from exc
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ModelError(
                f"{index} names shards that are not in {folder}: {missing}. Fix: copy the missing "
                f"files into the folder, or re-save the model with `save_pretrained`"
            )
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ModelError(
                f"model file {f} cannot be read as safetensors ({exc}); it is damaged or incomplete "
                f"(an interrupted download or copy?). Fix: copy it again, or re-save the model with "
                f"`save_pretrained`"
            ) from exc


def prepare_inputs(cfg: Config, out_dir: Path) -> Inputs:
    model_path = with_config_overrides(resolve_model(cfg.model.path), cfg.model.override_config, out_dir)
    check_safetensors(model_path)
    if cfg.rollout.engine == "vllm":  # a model vLLM's backend cannot serve fails here, not in a worker
        from offstep.rollout.engines.vllm_support import attention_head_dim_problem

        problem = attention_head_dim_problem(model_path, "cuda" if cfg.rollout.gpus_per_replica else "cpu")
        if problem is not None:
            raise ModelError(f"rollout.engine=vllm cannot serve model.path={cfg.model.path}: {problem}")
    tok = load_tokenizer(model_path)
    if cfg.env.kind:  # an environment's tasks and rollouts (offstep.envs), loaded here first
        from offstep.pipeline.env_inputs import env_inputs

        train_records, val_records, agent = env_inputs(cfg)
        schemas = None
    else:
        train_files, val_files = _files(cfg, out_dir)
        train_records = _records(train_files, cfg)
        val_records = _records(val_files, cfg) if val_files else []
        agent, schemas = _tools_for(train_records + val_records, cfg)
    d = cfg.data
    spec = None
    if any(r.images for r in train_records + val_records):
        _check_image_run(cfg, train_records + val_records)
        spec = image_spec(model_path)
    kw = dict(overlong=d.overlong_prompts, tools=schemas, image_spec=spec)
    train = encode_prompts(train_records, tok, d.max_prompt_length, **kw)
    val = encode_prompts(val_records, tok, d.max_prompt_length, **kw) if val_records else []
    if cfg.data.val_max_samples:
        val = val[: cfg.data.val_max_samples]
    if len(train) < cfg.data.train_batch_size:
        raise DatasetError(
            f"the training set has {len(train)} usable prompts, fewer than data.train_batch_size="
            f"{cfg.data.train_batch_size}; lower data.train_batch_size or add data"
        )
    abstain = cfg.reward.model.kind is not None and cfg.reward.model.combine == "abstain"
    reward = RewardFunction(cfg.reward.custom_path, cfg.reward.custom_name, cfg.reward.timeout_s, abstain=abstain)
    scored = [p.record for p in train + val if p.record.agent_name != OPENAI_AGENT]  # no scorer for the others
    if cfg.reward.needs_rule:  # a reward model alone scores any data source
        reward.check_sources({r.data_source for r in scored})
    if scored and (cfg.reward.needs_rule or cfg.reward.custom_path):
        reward.check_call(scored[0].data_source, scored[0].ground_truth, scored[0].extra_info or {})
    teacher = None
    if cfg.distill.enabled:
        from offstep.models.teacher import resolve_teacher

        teacher = resolve_teacher(cfg.distill.teacher.path, tok, cfg.model.path)
        check_safetensors(teacher)
    return Inputs(model_path, tok.pad_token_id, train, val, reward, agent, teacher)


def _check_image_run(cfg: Config, records: list[PromptRecord]) -> None:
    """Rows with images: refuse what image prompts do not support yet (docs/multimodal.md)."""
    refused = vision_problems(cfg)
    tools = [r for r in records if r.images and r.agent_name != SINGLE_TURN]
    if tools:
        refused.append(
            f"row {tools[0].index} has images and agent_name={tools[0].agent_name}: the agent loops do not take "
            "images yet. Fix: single-turn rows (agent_name single_turn_agent) for image prompts"
        )
    if refused:
        raise ConfigError("image prompts: " + "; ".join(refused))


def to_request(p: EncodedPrompt, uid: int) -> Request:
    r = p.record
    return Request(
        uid=uid,
        prompt_ids=p.prompt_ids,
        data_source=r.data_source,
        ground_truth=r.ground_truth,
        extra_info=r.extra_info or {},
        agent_name=r.agent_name,
        messages=r.messages,
        images=p.images,
    )
