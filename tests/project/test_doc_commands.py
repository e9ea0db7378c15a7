"""Every command in README.md and docs/*.md is run by a test, or is listed here as not run with the
reason.

``COVERAGE`` maps each command, as the page writes it (a ``bash`` block's lines, continuations
joined, comments dropped, and inline code that starts with ``offstep``, ``bash scripts/`` or a
Python command), to how it is covered:

- ``RUN``: a test in this file runs it word for word (``test_the_readme_quick_look``);
- ``CFG``: a training command; this file resolves and validates its configuration with
  ``offstep train --cfg`` and the same arguments (training it would take minutes to hours);
- ``("test", "tests/file.py::name")``: that test runs it (the test's source quotes it);
- ``("synopsis", "...")``: a form with placeholders; the string says which concrete command runs;
- ``("not run", "...")``: the reason.

A command added to a page without an entry here, or an entry whose command left the pages, fails
``test_every_command_on_the_pages_is_covered``."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from offstep.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN = ("run", "test_the_readme_quick_look")
CFG = ("cfg", "test_training_commands_resolve")
TEST_SUITE = (
    "not run",
    "the test runner itself: CI runs `bash scripts/test.sh`; a test running it would run the suite inside the suite",
)
BENCHMARK = (
    "not run",
    "a benchmark (minutes to hours on 2 cores); its figures and command are in benchmarks/README.md",
)
MULTI_MACHINE = (
    "not run",
    "starts a Ray cluster across machines; tests/pipeline/test_multinode.py starts several Ray nodes on one machine and trains across them",
)
GPU = (
    "not run",
    "needs a GPU and vLLM's CUDA build; on this CPU machine `--cfg` refuses it, naming both (tests/rollout/test_vllm_engine.py covers the engine on CPU)",
)

COVERAGE: dict[str, tuple[str, str]] = {
    # README.md
    "bash scripts/train.sh": CFG,
    "bash scripts/test.sh": ("not run", "CI's command (.ci/run runs exactly this)"),
    "bash scripts/test.sh --quick": TEST_SUITE,
    "bash scripts/test.sh --all": TEST_SUITE,
    "bash scripts/test.sh tests/models/test_lora.py -x": TEST_SUITE,
    "bash scripts/test.sh -m slow": TEST_SUITE,
    "bash scripts/train.sh preset=tiny": RUN,
    ".venv/bin/offstep report runs/default": RUN,
    "offstep report": ("synopsis", "`offstep report runs/default` runs here"),
    "offstep report RUN_DIR [RUN_DIR ...]": (
        "synopsis",
        "`offstep report runs/default` runs here; tests/telemetry/test_report.py::test_report_cli reports two runs",
    ),
    "offstep train rollout.agent.tool_config_path=gsm8k_tool_config.yaml rollout.agent.format=hermes "
    "rollout.agent.default_agent=tool_agent": CFG,
    "offstep eval RUN --best": (
        "test",
        "tests/pipeline/test_checkpoint.py::test_export_writes_a_loadable_model_equal_to_the_checkpoint",
    ),
    "offstep eval RUN --best --data FILE": (
        "test",
        "tests/pipeline/test_checkpoint.py::test_export_writes_a_loadable_model_equal_to_the_checkpoint",
    ),
    "offstep export --best": (
        "test",
        "tests/pipeline/test_checkpoint.py::test_export_writes_a_loadable_model_equal_to_the_checkpoint",
    ),
    "offstep export RUN --best --out DIR": (
        "test",
        "tests/pipeline/test_checkpoint.py::test_export_writes_a_loadable_model_equal_to_the_checkpoint",
    ),
    "offstep eval runs/default --data FILE": ("synopsis", "runs here with FILE the run's own data/val.parquet"),
    "offstep export runs/default --out DIR": ("synopsis", "runs here with DIR a fresh folder"),
    ".venv/bin/offstep train ...": ("synopsis", "every concrete `offstep train` form is resolved here"),
    "offstep train key=value ...": ("synopsis", "every concrete `offstep train` form is resolved here"),
    "offstep train --help KEY": ("synopsis", "`offstep train --help rollout.n` runs here"),
    "offstep train --help [KEY or SECTION]": (
        "synopsis",
        "`offstep train --help rollout.n` and `--help algorithm` run here",
    ),
    "offstep train --help [KEY]": ("synopsis", "`offstep train --help rollout.n` runs here"),
    "offstep train --help rollout.n": RUN,
    "offstep train --help algorithm": RUN,
    "offstep train --cfg": RUN,
    "offstep train --cfg ...": ("synopsis", "`offstep train --cfg` and every training command's `--cfg` run here"),
    "offstep train --cfg <the same overrides>": (
        "test",
        "tests/launch/test_verl_fully_async.py::test_offstep_train_cfg_prints_the_fully_async_config",
    ),
    "offstep train": CFG,
    "offstep eval": ("synopsis", "`offstep eval runs/default --data ...` runs here"),
    "offstep eval --out": (
        "synopsis",
        "tests/pipeline/test_eval.py::test_eval_cli_writes_results_and_rejects_missing_data writes --out",
    ),
    "offstep eval MODEL --data FILE": ("synopsis", "`offstep eval runs/default --data ...` runs here"),
    "offstep eval MODEL --data FILE [--n N --temperature T --max-new-tokens M --out results.json]": (
        "synopsis",
        "`offstep eval runs/default --data ...` runs here; tests/pipeline/test_eval.py runs --n and --out",
    ),
    "offstep export": ("synopsis", "`offstep export runs/default --out DIR` runs here"),
    "offstep export --out": ("synopsis", "`offstep export runs/default --out DIR` runs here"),
    "offstep export --force": (
        "synopsis",
        "tests/pipeline/test_run_files.py::test_export_force_never_replaces_a_folder_holding_runs_at_any_depth runs it",
    ),
    "offstep eval --max-rows": (
        "synopsis",
        "tests/launch/test_user_code_safety.py refuses a 20M-row parquet file under the default --max-rows",
    ),
    "offstep export RUN_DIR [--step N] --out DIR": ("synopsis", "`offstep export runs/default --out DIR` runs here"),
    ".venv/bin/python -m benchmarks.preset_runs --label default --preset default --seeds 1,2": BENCHMARK,
    "python -m benchmarks.delta_sync": BENCHMARK,
    # docs/testing.md
    "python -m benchmarks.NAME": ("synopsis", "every concrete benchmark command on the pages is listed here"),
    "OFFSTEP_TEST_TIMELINE=/tmp/timeline.jsonl bash scripts/test.sh": TEST_SUITE,
    ".venv/bin/python -m tests.scheduling /tmp/timeline.jsonl": (
        "not run",
        "rewrites tests/durations.json from a whole suite's timeline; tests/project/test_scheduling.py "
        "runs its functions on a timeline of its own",
    ),
    "python -m benchmarks.readme --check": (
        "test",
        "tests/project/test_bench_readme.py::test_the_stored_results_give_the_committed_page",
    ),
    # docs/environments.md, reasoning-gym
    ".venv/bin/offstep train preset=reasoning_gym": CFG,
    ".venv/bin/offstep train preset=tiny data.task=reasoning_gym +data.task_options.name=chain_sum "
    "+data.task_options.max_terms=2 data.max_prompt_length=512": CFG,
    ".venv/bin/python -m offstep.data.reasoning_gym --name leg_counting --out data/legs --train-size 400 --val-size 100 "
    "--option min_animals=1 --option max_animals=2": (
        "synopsis",
        "tests/data/test_reasoning_gym.py::test_verl_export_round_trips_and_scores_the_same runs it with 5 and 3 rows",
    ),
    ".venv/bin/offstep eval smollm2-135m-instruct --data data/legs/val.parquet --max-new-tokens 32": (
        "synopsis",
        "`offstep eval runs/default --data ...` runs here; the exported parquet is verl's format, which eval reads",
    ),
    ".venv/bin/python -m benchmarks.reasoning_gym_candidates --example --train 100": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --preset reasoning_gym --seeds 0,1,2": BENCHMARK,
    'python -c "import reasoning_gym.factory as f; print(sorted(f.DATASETS))"': (
        "not run",
        "prints the library's own list of dataset names; tests/data/test_reasoning_gym.py reads the same registry",
    ),
    ".venv/bin/python -m benchmarks.preset_runs --label stale4_decoupled --preset default --seeds 0,1,2 --extra "
    "pipeline.mode=fully_async pipeline.max_staleness=4 algorithm.correction_mode=decoupled": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --label stale4_off --preset default --seeds 0,1,2 --extra "
    "pipeline.mode=fully_async pipeline.max_staleness=4 algorithm.correction_mode=off": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --label fully_async --preset default --seeds 1,2 --extra pipeline.mode=fully_async": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --rows benchmarks/results/results_recipe.jsonl --plot t19_const "
    "--plot-cpu AVX2 --plot-out benchmarks/results/default_run.png": (
        "test",
        "tests/project/test_bench_readme.py::test_preset_runs_draws_the_committed_rows",
    ),
    "python -m benchmarks.recipe_runs": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --plot default,fully_async --plot-cpu AVX2 --plot-out "
    "benchmarks/results/fully_async_vs_one_step.png": (
        "test",
        "tests/project/test_bench_readme.py::test_preset_runs_draws_the_committed_rows",
    ),
    ".venv/bin/python -m benchmarks.preset_runs --plot default,fully_async --plot-cpu 'AVX-512 BF16' --plot-out "
    "benchmarks/results/fully_async_vs_one_step_avx512.png": (
        "test",
        "tests/project/test_bench_readme.py::test_preset_runs_draws_the_committed_rows",
    ),
    ".venv/bin/python -m benchmarks.preset_runs --label long_tail --preset default --seeds 0,1,2 --extra "
    "+data.task_options.num_operands=[2,2,2,3,5,8] rollout.max_new_tokens=128 trainer.total_steps=15 "
    "actor.micro_token_budget=1024": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --label long_tail_fully_async --preset default --seeds 0,1,2 --extra "
    "+data.task_options.num_operands=[2,2,2,3,5,8] rollout.max_new_tokens=128 trainer.total_steps=15 "
    "actor.micro_token_budget=1024 pipeline.mode=fully_async": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --plot long_tail,long_tail_fully_async --plot-cpu AVX2 --plot-out "
    "benchmarks/results/long_tail_fully_async_vs_one_step.png": (
        "test",
        "tests/project/test_bench_readme.py::test_preset_runs_draws_the_committed_rows",
    ),
    ".venv/bin/python -m benchmarks.preset_runs --preset code --seeds 0,1,2": BENCHMARK,
    ".venv/bin/python -m benchmarks.judge_agreement": BENCHMARK,
    "python -m benchmarks.compile_update": BENCHMARK,
    "python -m benchmarks.update_throughput --packed --out benchmarks/results/results_update_avx512.md": BENCHMARK,
    "python -m benchmarks.update_throughput --compute-dtype float32 --out benchmarks/results/results_update_fp32_avx512.md": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --preset calculator_openai --seeds 0,1": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --preset calculator --seeds 0": BENCHMARK,
    ".venv/bin/python -m benchmarks.preset_runs --label judge_only --preset default --seeds 0,1,2 --extra "
    "reward.model.kind=generative reward.model.path=smollm2-135m-instruct reward.model.template=yes_no "
    "reward.model.parser=yes_no": BENCHMARK,
    # docs/clusters-and-gpus.md
    "python -m benchmarks.gpu_check": (
        "not run",
        "needs a GPU (CUDA); its CPU form at tiny shapes runs in tests/project/test_gpu_check.py",
    ),
    "python -m benchmarks.gpu_check --device cpu --tiny": (
        "test",
        "tests/project/test_gpu_check.py::test_the_cpu_form_runs_without_ray_and_prints_every_check",
    ),
    "ray start --head --port=6379": MULTI_MACHINE,
    "ray start --address=HEAD_IP:6379": MULTI_MACHINE,
    "offstep train resources.ray_address=auto ...": MULTI_MACHINE,
    "ray start --head --num-cpus=0": MULTI_MACHINE,
    "ray start --address=HEAD_IP:6379 --num-cpus=8 --resources='{\"node_train\": 1}'": MULTI_MACHINE,
    "ray start --address=HEAD_IP:6379 --num-cpus=8 --resources='{\"node_rollout\": 1}'": MULTI_MACHINE,
    "offstep train resources.ray_address=auto resources.trainer_workers=2 resources.cpus_per_trainer_worker=8 "
    "rollout.cpus_per_replica=8 +resources.custom_resources_per_trainer_worker.node_train=1 "
    "+rollout.custom_resources_per_replica.node_rollout=1": MULTI_MACHINE,
    "flock /tmp/offstep-heavy.lock .venv/bin/python -m pytest -q tests/pipeline/test_multinode.py": (
        "not run",
        "runs a test file of the suite (the slow tier runs it)",
    ),
    # docs/engines.md
    'OFFSTEP_VLLM="vllm==0.32.0" bash scripts/setup.sh': GPU,
    ".venv/bin/offstep train rollout.engine=vllm rollout.gpus_per_replica=1 resources.gpus_per_trainer_worker=1 "
    "rollout.dtype=bfloat16": GPU,
    "bash scripts/setup.sh": ("not run", "sourced by scripts/train.sh, which runs here (and by scripts/test.sh in CI)"),
    # docs/from-verl.md: the two scripts run by the migration test, line by line
    "set -x": ("test", "tests/launch/test_verl_migration.py::test_page_command_runs_on_the_tiny_model"),
    ".venv/bin/python -c \"from offstep.data.tasks import write_task; write_task('gsm8k_synthetic', 'data/gsm8k', 8, 4, 0)\"": (
        "test",
        "tests/launch/test_verl_migration.py::test_page_command_runs_on_the_tiny_model",
    ),
    "MODEL_PATH=tiny TRAIN_FILE=data/gsm8k/train.parquet TEST_FILE=data/gsm8k/val.parquet CKPTS_DIR=runs/from-verl "
    "NGPUS_PER_NODE=2 N_GPUS_ROLLOUT=1 TRAIN_PROMPT_BSZ=4 MINI_BSZ=4 MICRO_BSZ=8 N_RESP=2 MAX_PROMPT_LEN=256 "
    "MAX_RESP_LEN=12 EPOCHS=1 PATH=.venv/bin:$PATH bash from-verl.sh preset=tiny": (
        "test",
        "tests/launch/test_verl_migration.py::test_page_command_runs_on_the_tiny_model",
    ),
    "python scripts/verl_keys_table.py": (
        "test",
        "tests/launch/test_verl_compat.py::test_docs_page_holds_the_table_and_one_command",
    ),
    # docs/from-verl.md and docs/clusters-and-gpus.md: a GPU script checked here
    "offstep train --cfg --gpus N ...": (
        "test",
        "tests/launch/test_verl_layout.py::test_gpus_flag_checks_a_gpu_script_here",
    ),
    "offstep train --help actor_rollout_ref.actor.ppo_mini_batch_size": (
        "test",
        "tests/launch/test_config.py::test_help_explains_a_verl_key_by_the_table",
    ),
    # docs/fully-async.md
    "offstep train pipeline.mode=fully_async": CFG,
    "offstep train pipeline.mode=fully_async pipeline.max_staleness=4 rollout.partial=recompute": CFG,
    "python -m benchmarks.staleness_runs --only sync,one_step,batch_k4,fully_async_k4,fully_async_k4_naive "
    "--seeds 0,1,2": BENCHMARK,
    "offstep train pipeline.mode=fully_async trainer.output_dir=runs/first": CFG,
    "offstep train pipeline.mode=fully_async trainer.output_dir=runs/again pipeline.replay=runs/first": (
        "test",
        "tests/rollout/test_replay.py::test_a_replayed_run_reproduces_the_recorded_one",
    ),
    "python -m benchmarks.replay_runs": BENCHMARK,
    # docs/lora.md
    ".venv/bin/offstep train actor.lora.rank=16 actor.optim.lr=1e-4": CFG,
    "bash scripts/train.sh actor.lora.rank=16 actor.optim.lr=1e-4 trainer.total_steps=10 trainer.val_freq=10": CFG,
    ".venv/bin/offstep export runs/default --out adapter": (
        "test",
        "tests/models/test_lora.py::test_export_peft_folder_and_merged_model",
    ),
    ".venv/bin/offstep export runs/default --out merged --merge": (
        "test",
        "tests/models/test_lora.py::test_export_peft_folder_and_merged_model",
    ),
    # docs/multimodal.md
    "offstep train preset=tiny_vl": CFG,
    # docs/distillation.md
    "offstep train trainer.output_dir=runs/teacher trainer.total_steps=25": CFG,
    "offstep export runs/teacher --out models/teacher": (
        "not run",
        "needs the teacher's run; tests/pipeline/test_checkpoint.py::test_export_writes_a_loadable_model_equal_to_the_checkpoint runs export",
    ),
    "offstep train trainer.output_dir=runs/student distill.teacher.path=models/teacher": (
        "not run",
        "needs the exported teacher on disk; tests/e2e/test_distill.py trains with tiny teachers built in code",
    ),
    "offstep train distill.teacher.path=models/teacher distill.teacher.placement=pool resources.teacher_workers=1 "
    "resources.gpus_per_teacher_worker=1": (
        "not run",
        "needs a teacher on disk and a GPU; tests/e2e/test_distill.py runs a teacher pool on CPU",
    ),
    # docs/reward-models.md
    "offstep train reward.model.kind=discriminative reward.model.path=/models/Skywork-Reward-V2-Qwen3-0.6B": (
        "not run",
        "needs a reward model on disk; tests/e2e/test_reward_models_e2e.py trains with tiny ones built in code",
    ),
    "offstep train reward.model.kind=discriminative reward.model.path=/models/rm reward.model.placement=pool "
    "resources.reward_workers=1 resources.gpus_per_reward_worker=1": (
        "not run",
        "needs a reward model on disk and a GPU; tests/e2e/test_reward_models_e2e.py runs a reward pool on CPU",
    ),
    "offstep train reward.model.kind=generative reward.model.path=smollm2-135m-instruct "
    "reward.model.rule_weight=1.0 reward.model.weight=0.5 reward.model.parser=last_number": CFG,
    "offstep train --help reward.model": (
        "test",
        "tests/launch/test_reward_model_config.py::test_help_shows_the_reward_model_keys",
    ),
    # docs/running.md
    "offstep eval smollm2-135m-instruct --data runs/default/data/val.parquet --max-new-tokens 32": (
        "not run",
        "needs a default run's data folder; `offstep eval` of a run's data runs here on the tiny run",
    ),
    # docs/safety.md
    ".venv/bin/python -m benchmarks.random_kills --only builtin-k0 builtin-k1 builtin-k2": BENCHMARK,
    ".venv/bin/python -m benchmarks.random_kills --only lora-k1 tools-k1 vllm-k1": BENCHMARK,
    "python -m benchmarks.random_kills --only fully-async-k0": BENCHMARK,
    ".venv/bin/python -m benchmarks.trl_side_by_side": BENCHMARK,
    # docs/tools-and-agents.md
    "offstep train data.train_files=[examples/tools/shop.jsonl] data.val_files=[examples/tools/shop.jsonl] "
    "data.train_batch_size=2 rollout.agent.tools_path=examples/tools/shop_tools.py "
    "rollout.agent.tools=[price,convert,calculator] reward.custom_path=examples/tools/shop_tools.py": CFG,
    "offstep eval runs/default --data examples/tools/shop.jsonl --tools price,convert,calculator "
    "--tools-path examples/tools/shop_tools.py --reward-path examples/tools/shop_tools.py": RUN,
    ".venv/bin/offstep train preset=calculator": CFG,
    "offstep train preset=calculator": CFG,
    "offstep train preset=calculator_openai": CFG,
    "offstep train preset=code": CFG,
    ".venv/bin/python -m benchmarks.calculator_runs --seeds 0": BENCHMARK,
    # docs/performance.md
    "offstep report RUN": ("synopsis", "`offstep report runs/default` runs here"),
    "python -m benchmarks.lend_cores --rounds 1 --steps 5 --share false true": BENCHMARK,
    "python -m benchmarks.lend_devices_sim": BENCHMARK,
    ".venv/bin/offstep eval smollm2-135m-instruct --data runs/bench_calculator/seed0/no_tools/val.parquet --max-new-tokens 48": (
        "not run",
        "evaluates the data that benchmarks/calculator_runs.py writes (a benchmark)",
    ),
    ".venv/bin/offstep eval smollm2-135m-instruct --data runs/bench_calculator/seed0/data/val.parquet "
    "--tools calculator --max-turns 3 --max-new-tokens 48": (
        "not run",
        "evaluates the data that benchmarks/calculator_runs.py writes (a benchmark)",
    ),
    # docs/environments.md (the runs themselves: tests/envs/test_env_verifiers.py, tests/envs/test_env_openenv.py)
    "offstep train preset=tiny env.kind=verifiers env.id=vf_arith env.path=[examples/environments] +env.args.size=16 "
    "data.train_batch_size=2 rollout.n=2 trainer.total_steps=2 trainer.val_before_train=false": CFG,
    "offstep train preset=tiny env.kind=openenv env.id=oe_arith:ArithEnvironment env.path=[examples/environments] "
    "+env.args.size=16 data.train_batch_size=2 rollout.n=2 trainer.total_steps=2 trainer.val_before_train=false": CFG,
    "python -m offstep.envs.openenv_server": (
        "not run",
        "a server's own entry point, started by offstep's pool (tests/envs/test_env_openenv.py runs it through train)",
    ),
}

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(
    r"`((?:\.venv/bin/)?(?:offstep (?:train|report|eval|export)\b|bash scripts/|python |\.venv/bin/python )[^`]*)`"
)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=(?!.*\b(?:bash|offstep|python3?)\b)")


def page_commands(text: str) -> list[str]:
    """The commands a page shows: each line of a ``bash`` block (continuations joined, comments and
    shell variable assignments dropped; a verl-style script's entry-point line counts by its first
    words) and each inline code span that starts like a command."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang != "bash":
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            line = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if not line or ASSIGNMENT.match(line):
                continue
            if "${" in line and line.split()[0] in ("offstep", "python3"):
                line = " ".join(line.split()[:3]) + " ...script"  # a script's entry point, run as a whole
            out.append(line)
    for match in INLINE.finditer(FENCE.sub("", text)):
        command = " ".join(match.group(1).split())
        out.append(command)
    return out


SCRIPT_LINES = {
    "offstep train algorithm.adv_estimator=grpo ...script": (
        "test",
        "tests/launch/test_verl_migration.py::test_page_command_runs_on_the_tiny_model",
    ),
    "python3 -m verl.experimental.one_step_off_policy.main_ppo ...script": (
        "not run",
        "verl's own script, shown beside offstep's; the offstep one runs in tests/launch/test_verl_migration.py",
    ),
}
COVERAGE.update(SCRIPT_LINES)


def all_commands() -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for page in PAGES:
        for command in page_commands(page.read_text(encoding="utf-8")):
            seen.setdefault(command, []).append(page.name)
    return seen


def test_every_command_on_the_pages_is_covered():
    on_pages = all_commands()
    missing = sorted(set(on_pages) - set(COVERAGE))
    stale = sorted(set(COVERAGE) - set(on_pages))
    assert not missing, (
        "commands on the pages with no entry in COVERAGE (run them in a test, or give the reason):\n"
        + "\n".join(f"  {c!r} ({', '.join(on_pages[c])})" for c in missing)
    )
    assert not stale, "COVERAGE lists commands no page shows any more:\n" + "\n".join(f"  {c!r}" for c in stale)


def test_every_entry_names_a_test_that_exists_or_a_reason():
    here = Path(__file__).read_text(encoding="utf-8")
    for command, (kind, what) in COVERAGE.items():
        assert kind in ("run", "cfg", "test", "synopsis", "not run"), (command, kind)
        if kind in ("run", "cfg"):
            assert f"def {what}(" in here, (command, what)
        elif kind == "test":
            file, _, name = what.partition("::")
            assert re.search(rf"^def {name}\(", (ROOT / file).read_text(encoding="utf-8"), re.M), (command, what)
        else:
            assert len(what) > 20, (command, "give the reason")


def test_the_command_extractor_sees_blocks_and_spans():
    page = (
        "Run `offstep train preset=tiny` or `offstep/cli.py`.\n```bash\nX=1\nbash scripts/train.sh \\\n"
        "    a=1   # note\n```\n```\nnot a command\n```\n"
    )
    assert page_commands(page) == ["bash scripts/train.sh a=1", "offstep train preset=tiny"]
    assert page_commands("`offstep: placement ...` `offstep.algos` `offstep report x`") == ["offstep report x"]


def _training_commands() -> list:
    """LoRA's configuration reads the model's module names, so those cases need SmolLM2."""
    return [
        pytest.param(c, marks=[pytest.mark.model] if "lora" in c else [], id=c[:60])
        for c in sorted(c for c, how in COVERAGE.items() if how == CFG)
    ]


@pytest.mark.parametrize("command", _training_commands())
def test_training_commands_resolve(command, monkeypatch, capsys):
    """A training command's configuration resolves and validates (`offstep train --cfg` + its
    arguments), from the repository root as the pages run them."""
    words = shlex.split(command)
    if words[0].endswith("offstep"):
        args = words[2:]
    else:
        assert words[:2] == ["bash", "scripts/train.sh"], command  # train.sh runs `offstep train "$@"`
        args = words[2:]
    monkeypatch.chdir(ROOT)
    rc = main(["train", "--cfg", *args])
    out, err = capsys.readouterr()
    assert rc == 0, f"{command}: {err}"
    assert "trainer:" in out and "rollout:" in out


@pytest.mark.parametrize(
    "command", ["offstep train --help rollout.n", "offstep train --help algorithm", "offstep train --cfg"]
)
def test_help_and_cfg_commands_run(command, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)[1:]) == 0
    out = capsys.readouterr().out
    word = command.split()[-1]
    assert (word in out) if word != "--cfg" else ("trainer:" in out)
    assert not list(tmp_path.iterdir()), "a command that only shows something wrote a file"


@pytest.mark.ray
@pytest.mark.heavy
def test_the_readme_quick_look(tmp_path):
    """README's quick look, word for word, in a copy of the repository's scripts beside the same
    .venv: `bash scripts/train.sh preset=tiny` trains (into runs/tiny, moved to runs/default); then `offstep report`,
    `offstep eval` (the run's own validation data, and the tools page's shop example) and `offstep
    export` work on that run."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "scripts/train.sh", "scripts/constraints.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    (root / ".venv").symlink_to(ROOT / ".venv")
    (root / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}

    def sh(command: str, timeout: int = 600) -> str:
        p = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"{command} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout + p.stderr

    if not (ROOT / ".venv" / "bin" / "offstep").exists():
        pytest.fail("the quick look runs the set-up's .venv; run `bash scripts/test.sh`, which creates it")
    # The copy's set-up must find the .venv done (setup.sh's stamp, made from these files): otherwise it
    # would install offstep into the shared .venv from the copy, which holds no package.
    files = b"".join(
        (root / name).read_bytes() for name in ("pyproject.toml", "scripts/setup.sh", "scripts/constraints.txt")
    )
    stamp = (ROOT / ".venv" / ".offstep-setup").read_text().split(" ")[0]
    if stamp != hashlib.sha256(files).hexdigest():
        pytest.fail(
            "the .venv was set up from other versions of pyproject.toml, scripts/setup.sh or "
            "scripts/constraints.txt; run `bash scripts/setup.sh` first"
        )
    sh("bash scripts/train.sh preset=tiny")
    # the tiny preset's folder is runs/tiny; the README's next commands name the default's folder
    (root / "runs" / "tiny").rename(root / "runs" / "default")
    run = root / "runs" / "default"
    assert (run / "metrics.jsonl").exists() and list((run / "checkpoints").iterdir())
    sh(".venv/bin/offstep report runs/default")
    assert (run / "report" / "reward.png").exists()
    out_dir = tmp_path / "exported"
    sh(f"offstep export runs/default --out {out_dir}")
    assert (out_dir / "config.json").exists()
    results = sh("offstep eval runs/default --data runs/default/data/val.parquet")
    assert "acc" in results
    sh(
        "offstep eval runs/default --data examples/tools/shop.jsonl --tools price,convert,calculator "
        "--tools-path examples/tools/shop_tools.py --reward-path examples/tools/shop_tools.py"
    )
