"""``offstep report RUN_DIR [RUN_DIR ...]``: PNG plots and a ``summary.md`` from what a run left.

Plots (written into the first run's directory, under ``report/``):

* ``reward.png``      — training reward and validation accuracy over steps and over wall-clock time;
* ``timing.png``      — stacked time per step: waiting for generation, reference, old log-probs,
                        critic, actor update, weight sync (one panel per run);
* ``timeline.png``    — the pipeline timeline: one lane per role (rollout replicas, trainer), a bar
                        per stage and step, so overlap and idle gaps are visible at a glance;
* ``offpolicy.png``   — staleness and rollout-vs-trainer mismatch metrics over steps.
* ``health.png``      — the signs of a collapse coming: entropy, groups with no signal, KL to the
  reference, response length.

Several runs (e.g. synchronous vs one-step) share the line plots and get a panel each otherwise.
"""

from __future__ import annotations

import io
import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from offstep.errors import RunFileError
from offstep.files import refuse_links, write_file  # noqa: E402
from offstep.telemetry.metrics import read_jsonl  # noqa: E402
from offstep.telemetry.names import Actor, ResponseLength, Reward, Role, Rollout, Stage, Timing, Val  # noqa: E402

# Trainer-side stages stacked in timing.png, in execution order.
TIMING_STACK = (
    (Timing.WAIT_GEN, "wait for generation", "#bbbbbb"),
    (Timing.REF, "reference", "tab:purple"),
    (Timing.OLD_LOGPROBS, "old log-probs", "tab:pink"),
    (Timing.VALUES, "critic values", "tab:olive"),
    (Timing.UPDATE_CRITIC, "critic update", "tab:brown"),
    (Timing.UPDATE_ACTOR, "actor update", "tab:orange"),
    (Timing.SYNC_WEIGHTS, "weight sync (export + load)", "tab:red"),
)
STAGE_COLORS = {
    Stage.GEN: "tab:blue",
    Stage.VAL: "tab:cyan",
    Stage.REF: "tab:purple",
    Stage.LOAD_WEIGHTS: "tab:gray",
    Stage.WAIT_GEN: "#dddddd",
    Stage.OLD_LOGPROBS: "tab:pink",
    Stage.VALUES: "tab:olive",
    Stage.UPDATE_CRITIC: "tab:brown",
    Stage.UPDATE_ACTOR: "tab:orange",
    Stage.SYNC_EXPORT: "tab:red",
    Stage.GEN_MORE: "tab:blue",
    Stage.CHECKPOINT: "black",
    Stage.PREPARE: "goldenrod",
    Stage.TOOL: "limegreen",
    Stage.REWARD_MODEL: "teal",
    Stage.TEACHER: "cadetblue",
    Stage.SLEEP: "#eeeeee",
    Stage.WAKE: "darkgray",
}


@dataclass
class Run:
    name: str
    path: Path
    steps: list[dict]  # training steps (step >= 1)
    val: list[dict]  # records carrying validation metrics (step 0 included)
    timeline: list[dict]

    @classmethod
    def load(cls, path: str | Path) -> "Run":
        path = Path(path)
        metrics_file = path / "metrics.jsonl"
        if not metrics_file.is_file():
            raise RunFileError(f"{metrics_file} does not exist: give the trainer.output_dir of an offstep run")
        records = read_jsonl(metrics_file)
        timeline_file = path / "timeline.jsonl"
        return cls(
            name=path.name,
            path=path,
            steps=[m for m in records if m.get("step", 0) >= 1 and Reward.MEAN in m],
            val=[m for m in records if Val.ACC in m],
            timeline=read_jsonl(timeline_file) if timeline_file.is_file() else [],
        )

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(m["step"], m[key]) for m in self.steps if m.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def wall_clock(self) -> list[float]:
        """Seconds since the first step began, at the end of each step."""
        t, out = 0.0, []
        for m in self.steps:
            t += m.get(Timing.STEP, 0.0)
            out.append(t)
        return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_file(path, buf.getvalue(), durable=False)  # replaces a link at path, never writes through it
    return path


def plot_reward(runs: list[Run], out: Path) -> Path:
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in runs:
        x, y = r.series(Reward.MEAN)
        (line,) = ax_s.plot(x, y, marker=".", label=f"{r.name} reward")
        ax_t.plot(r.wall_clock()[: len(y)], y, marker=".", color=line.get_color(), label=f"{r.name} reward")
        if r.val:
            vx = [m["step"] for m in r.val]
            vy = [m[Val.ACC] for m in r.val]
            err = [m.get(Val.ACC_STDERR, 0.0) for m in r.val]  # runs before the standard error was logged: none
            ax_s.errorbar(
                vx,
                vy,
                yerr=err,
                fmt="s--",
                color=line.get_color(),
                alpha=0.7,
                capsize=3,
                label=f"{r.name} val acc (± 1 s.e.)",
            )
    ax_s.set(xlabel="step", ylabel="reward / accuracy", title="reward and validation accuracy")
    ax_t.set(xlabel="wall-clock seconds since step 1 began", ylabel="reward", title="reward over time")
    for ax in (ax_s, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "reward.png")


def plot_timing(runs: list[Run], out: Path) -> Path:
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.4 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        steps = [m["step"] for m in r.steps]
        bottom = [0.0] * len(steps)
        for key, label, color in TIMING_STACK:
            vals = [m.get(key) or 0.0 for m in r.steps]
            if any(vals):
                ax.bar(steps, vals, bottom=bottom, label=label, color=color)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(steps, [m.get(Timing.STEP, 0.0) for m in r.steps], "k.-", label="step time")
        ax.plot(steps, [m.get(Timing.GEN, 0.0) for m in r.steps], "b:", label="generation (rollout)")
        ax.set(xlabel="step", ylabel="seconds", title=f"{r.name}: where the trainer's time goes")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, ncol=4)
    return _save(fig, out / "timing.png")


def plot_timeline(runs: list[Run], out: Path) -> Path:
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(14, 1.2 + 1.1 * max(2, _lanes_max(runs)) * len(runs)), squeeze=False
    )
    for ax, r in zip(axes[:, 0], runs):
        lanes = sorted({e["role"] for e in r.timeline}, key=lambda s: (s != Role.TRAINER, s))
        seen = set()
        for y, lane in enumerate(lanes):
            for e in (e for e in r.timeline if e["role"] == lane):
                color = STAGE_COLORS.get(e["stage"], "tab:green")
                label = e["stage"] if e["stage"] not in seen else None
                seen.add(e["stage"])
                # tools run inside a generation: a thinner bar over it
                ax.barh(
                    y,
                    e["end"] - e["start"],
                    left=e["start"],
                    height=0.3 if e["stage"] == Stage.TOOL else 0.6,
                    color=color,
                    edgecolor="black",
                    linewidth=0.3,
                    label=label,
                )
                if e["stage"] in (Stage.GEN, Stage.UPDATE_ACTOR) and e["end"] - e["start"] > 0:
                    ax.text((e["start"] + e["end"]) / 2, y, str(e["step"]), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set(xlabel="seconds since the run started", title=f"{r.name}: pipeline timeline (numbers: step)")
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=7, ncol=6, loc="upper left", bbox_to_anchor=(0, -0.35))
    return _save(fig, out / "timeline.png")


def _lanes_max(runs: list[Run]) -> int:
    return max((len({e["role"] for e in r.timeline}) for r in runs), default=1)


def plot_offpolicy(runs: list[Run], out: Path) -> Path:
    keys = [
        (Rollout.STALENESS_MAX, "staleness (max)"),
        (Actor.MISMATCH_KL_K1, "mismatch KL k1"),
        (Actor.IS_WEIGHT_MEAN, "IS weight mean"),
        (Actor.KL, "KL to reference"),
    ]
    return _plot_series(runs, keys, out / "offpolicy.png")


def _plot_series(runs: list[Run], keys: list[tuple[str, str]], path: Path) -> Path:
    """One panel per (metric, title), a line per run over steps."""
    fig, axes = plt.subplots(1, len(keys), figsize=(15, 3.6))
    for ax, (key, title) in zip(axes, keys):
        for r in runs:
            x, y = r.series(key)
            if y:
                ax.plot(x, y, marker=".", label=r.name)
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_health(runs: list[Run], out: Path) -> Path:
    keys = [
        (Actor.ENTROPY, "entropy (nats per token)"),
        (Reward.UNIFORM_GROUP_FRAC, "groups with one score (no signal)"),
        (Actor.KL, "KL to reference"),
        (ResponseLength.MEAN, "response length (mean)"),
    ]
    return _plot_series(runs, keys, out / "health.png")


def summary(runs: list[Run]) -> str:
    """A Markdown table of each run's headline numbers, taken straight from metrics.jsonl."""
    rows = []
    for r in runs:
        rewards = [m[Reward.MEAN] for m in r.steps]
        step_t = [m[Timing.STEP] for m in r.steps[1:]] or [m[Timing.STEP] for m in r.steps]
        k = min(5, len(rewards))
        rows.append(
            {
                "run": r.name,
                "steps": len(r.steps),
                f"reward, first {k} steps": sum(rewards[:k]) / k if k else float("nan"),
                f"reward, last {k} steps": sum(rewards[-k:]) / k if k else float("nan"),
                "val acc, first": r.val[0][Val.ACC] if r.val else float("nan"),
                "val acc, last": r.val[-1][Val.ACC] if r.val else float("nan"),
                "median step s": statistics.median(step_t) if step_t else float("nan"),
                "median gen s": statistics.median(m[Timing.GEN] for m in r.steps) if r.steps else float("nan"),
                "max staleness": max((m[Rollout.STALENESS_MAX] for m in r.steps), default=0),
                "wall s (steps)": r.wall_clock()[-1] if r.steps else 0.0,
            }
        )
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(fmt(row[c]) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> Path:
    runs = [Run.load(d) for d in run_dirs]
    if not any(r.steps for r in runs):
        raise RunFileError(f"no training steps in {', '.join(str(d) for d in run_dirs)}: metrics.jsonl has none yet")
    out = Path(out_dir) if out_dir else runs[0].path / "report"
    if not out_dir:
        refuse_links(out)  # the run's own report folder: not a link out of it
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        plot_reward(runs, out),
        plot_timing(runs, out),
        plot_timeline(runs, out),
        plot_offpolicy(runs, out),
        plot_health(runs, out),
    ]
    text = ["# offstep report", "", summary(runs), ""]
    text += [f"![{p.stem}]({p.name})" for p in plots]
    write_file(out / "summary.md", "\n".join(text) + "\n", durable=False)
    return out
