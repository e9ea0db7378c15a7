"""Progress on the console: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# The compact per-step line: (metric key, label, format).
_LINE = (
    ("reward/mean", "reward", "{:.3f}"),
    ("val/acc", "val_acc", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/pg_loss", "pg", "{:+.4f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("rollout/staleness_max", "stale", "{:.0f}"),
    ("timing_s/gen", "gen", "{:.1f}s"),
    ("timing_s/wait_gen", "wait", "{:.1f}s"),
    ("timing_s/update_actor", "upd", "{:.1f}s"),
    ("timing_s/sync_weights", "sync", "{:.2f}s"),
    ("timing_s/step", "step", "{:.1f}s"),
)


def step_line(m: dict) -> str:
    parts = [f"step {m['step']:>4}"]
    for key, label, fmt in _LINE:
        if m.get(key) is not None:
            parts.append(f"{label} {fmt.format(m[key])}")
    return " | ".join(parts)


class ConsoleProgress:
    def __init__(self, total: int, mode: str = "auto"):
        tty = sys.stdout.isatty()
        self.mode = ("bar" if tty else "plain") if mode == "auto" else mode
        self.console = Console(highlight=False, force_terminal=tty and self.mode == "bar", soft_wrap=True)
        self.progress = None
        if self.mode == "bar":
            self.progress = Progress(
                TextColumn("[bold]offstep[/]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self.task = self.progress.add_task("train", total=total, info="")
            self.progress.start()

    def log(self, text: str) -> None:
        if self.mode != "off":
            self.console.print(text, markup=False)

    def status(self, info: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, info=info)

    def step(self, metrics: dict) -> None:
        self.log(step_line(metrics))
        if self.progress is not None:
            self.progress.update(self.task, completed=metrics["step"], info=f"reward {metrics.get('reward/mean', 0):.3f}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
