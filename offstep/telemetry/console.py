"""Progress on the console: a live bar on a terminal, plain lines otherwise.

``trainer.progress``:

- ``bar``: a rich progress bar with a live status line (where the current step is, from
  ``progress.LiveStatus``), elapsed time and ETA, and one compact line per step above it.
- ``plain``: the quiet mode for logs and CI. One line per step and, when nothing was printed
  for ``trainer.status_interval_s`` seconds, one status line; never a control character (no
  colours, no carriage returns, no cursor movement).
- ``auto`` (default): ``bar`` on a terminal, ``plain`` when stdout is not a terminal, when
  ``CI`` is set or when ``TERM=dumb``.
- ``off``: nothing.

ETA = median step time so far x steps left (the median ignores a slow first step, which waits
for the first batch, and the occasional validation step).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from offstep.files import CONTROL
from offstep.telemetry.names import Actor, Perf, ResponseLength, Reward, Rollout, Timing, Val

# The compact per-step line: (metric key, label, format).
_LINE = (
    (Reward.MEAN, "reward", "{:.3f}"),
    (Val.ACC, "val_acc", "{:.3f}"),
    (ResponseLength.MEAN, "len", "{:.1f}"),
    (Actor.PG_LOSS, "pg", "{:+.4f}"),
    (Actor.KL, "kl", "{:.4f}"),
    (Actor.ENTROPY, "ent", "{:.3f}"),
    (Rollout.STALENESS_MAX, "stale", "{:.0f}"),
    (Timing.GEN, "gen", "{:.1f}s"),
    (Timing.WAIT_GEN, "wait", "{:.1f}s"),
    (Timing.UPDATE_ACTOR, "upd", "{:.1f}s"),
    (Timing.SYNC_WEIGHTS, "sync", "{:.2f}s"),
    (Timing.STEP, "step", "{:.1f}s"),
    (Perf.TOKENS_PER_S, "tok/s", "{:.0f}"),
    (Perf.SAMPLES_PER_S, "smp/s", "{:.2f}"),
)

# C0 controls except newline and tab, DEL, and C1 controls (ESC starts every ANSI sequence).


def plain_text(text: str) -> str:
    """``text`` without control characters (a sample's text could carry any)."""
    return CONTROL.sub("", text)


def eta_seconds(step_times: list[float], steps_left: int) -> float | None:
    """Median step time x steps left; None before the first timed step.

    E.g. times [12, 30, 10] s, 5 steps left: median 12 s -> 60 s.
    """
    if steps_left <= 0:
        return 0.0
    if not step_times:
        return None
    return statistics.median(step_times) * steps_left


def format_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``1h02m``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_line(m: dict, eta: float | None = None) -> str:
    parts = [f"step {m['step']:>4}"]
    for key, label, fmt in _LINE:
        if m.get(key) is not None:
            parts.append(f"{label} {fmt.format(m[key])}")
    if eta is not None:
        parts.append(f"eta {format_duration(eta)}")
    return " | ".join(parts)


class _BarWithStatus(Progress):
    """The bar, and under it the live status on a line of its own (cut to the terminal's width)."""

    status = ""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if self.status:
            yield Text("  " + self.status, no_wrap=True, overflow="ellipsis")


def auto_mode(stream) -> str:
    isatty = getattr(stream, "isatty", lambda: False)()
    if not isatty or os.environ.get("CI") or os.environ.get("TERM") == "dumb":
        return "plain"
    return "bar"


ENTROPY_WARN_FRACTION = 0.25  # warn once the entropy is under this share of the first step's


def entropy_warning(first: float | None, m: dict) -> str | None:
    """The warning for a step whose ``actor/entropy`` fell under ENTROPY_WARN_FRACTION of ``first``
    (the first step's of this process), or None."""
    e = m.get(Actor.ENTROPY)
    if first is None or e is None or not first > 0 or e >= ENTROPY_WARN_FRACTION * first:
        return None
    return (
        f"offstep: actor/entropy fell from {first:.3g} to {e:.3g} nats per token by step {m['step']}: the policy "
        f"may be collapsing onto the answers it already gives; watch reward/uniform_group_frac and val/acc, and "
        f"see the knobs in docs/running.md (Seeing a collapse coming)"
    )


class ConsoleProgress:
    def __init__(self, total: int, mode: str = "auto", status_interval_s: float = 30.0, stream=None):
        self.stream = stream if stream is not None else sys.stdout
        self.mode = auto_mode(self.stream) if mode == "auto" else mode
        self.total = total
        self.status_interval_s = status_interval_s
        self.step_times: list[float] = []
        self.done = 0
        self.first_entropy: float | None = None
        self.warned_entropy = False
        self.info = ""
        self._t0 = self._last_print = time.monotonic()
        self.progress = None
        if self.mode == "bar":
            tty = getattr(self.stream, "isatty", lambda: False)()
            self.console = Console(file=self.stream, highlight=False, force_terminal=tty, soft_wrap=True)
            self.progress = _BarWithStatus(
                TextColumn("[bold]offstep[/]"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task("train", total=total, eta="?")
            self.progress.start()

    def eta(self) -> float | None:
        return eta_seconds(self.step_times, self.total - self.done)

    def log(self, text: str) -> None:
        if self.mode == "off":
            return
        if self.progress is not None:
            self.console.print(plain_text(text), markup=False)
        else:
            self.stream.write(plain_text(text) + "\n")
            self.stream.flush()
        self._last_print = time.monotonic()

    def status(self, info: str) -> None:
        """Where the run is now. Bar: the live field. Plain: a line only when the log has been
        silent for ``status_interval_s`` (0: never), so a slow step still shows signs of life."""
        self.info = info
        if self.progress is not None:
            self.progress.status = info
            self.progress.update(self.task, eta=format_duration(self.eta()))
        elif self.mode == "plain" and self.status_interval_s > 0:
            now = time.monotonic()
            if now - self._last_print >= self.status_interval_s:
                self.log(
                    f"status | {info} | elapsed {format_duration(now - self._t0)} | eta {format_duration(self.eta())}"
                )

    def step(self, metrics: dict) -> None:
        if metrics["step"] >= 1 and metrics.get(Timing.STEP) is not None:
            self.step_times.append(float(metrics[Timing.STEP]))
        self.done = max(self.done, int(metrics["step"]))
        eta = self.eta() if 0 < self.done < self.total else None
        self.log(step_line(metrics, eta))
        if metrics["step"] >= 1 and self.first_entropy is None:
            self.first_entropy = metrics.get(Actor.ENTROPY)
        if not self.warned_entropy and (warning := entropy_warning(self.first_entropy, metrics)):
            self.warned_entropy = True
            self.log(warning)
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done, eta=format_duration(self.eta()))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
