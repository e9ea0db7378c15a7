"""offstep's own errors, all in one module that imports nothing, so any layer can raise them.

An :class:`OffstepError` carries a message that names the problem and its fix, and the exit code
the ``offstep`` command ends with; the command prints the message alone (a traceback would only
bury it). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class OffstepError(Exception):
    exit_code = 2  # bad input: a config key, a file, a model, data, a reward function


# ------------------------------------------------------------------ bad input (exit code 2)


class ConfigError(OffstepError, ValueError):
    """A configuration that cannot work; the message names the key and the fix."""


class VerlKeyError(OffstepError, ValueError):
    """A verl key that offstep refuses, or a verl value it cannot translate."""


class DatasetError(OffstepError, ValueError):
    """A dataset file cannot be used. The message names the file, the problem and the fix."""


class ModelError(OffstepError, ValueError):
    """A model name or folder that cannot be used; the message says what is wrong and how to fix it."""


class RewardError(OffstepError, RuntimeError):
    """A reward scorer failed or is misconfigured."""


class RewardConfigError(RewardError, ValueError):
    """The reward configuration is wrong (bad custom scorer path/name, unknown data source).

    Both a :class:`RewardError` and a ``ValueError``.
    """


class ToolConfigError(OffstepError, ValueError):
    """The tool configuration is wrong (a missing file, an unknown name, a schema that cannot be read)."""


class LinkRefused(OffstepError):
    """A path among a run's own files (or a checkpoint's) is a symbolic link."""


class NotAFile(OffstepError, ValueError):
    """Where a run reads or writes a regular file there is something else (a FIFO, a device, a
    folder), or a tree too large to be a run's."""


class RunFileError(OffstepError, ValueError):
    """A run's own file (``metrics.jsonl``, ``timeline.jsonl``) that is missing or cannot be read;
    the message names the file and the line."""


class CheckpointError(OffstepError, ValueError):
    """A checkpoint that cannot be written (e.g. a full disk) or read (damaged, or holding
    something a checkpoint never holds); the message names the path and what to do."""


# ------------------------------------------------------------------ a run that failed


class NonFiniteError(OffstepError, FloatingPointError):
    """An update's loss or gradient norm was NaN/inf under ``actor.nonfinite=stop`` (or ``critic.``)."""

    exit_code = 1  # the input was fine; the run stopped as asked


class SyncNotVerified(OffstepError):
    """A rollout worker does not hold the weights the trainer sent (a lost, stale or corrupted sync)."""


class StalenessError(OffstepError):
    pass


class PlacementFailed(OffstepError):
    """A pool that the Ray cluster cannot hold (too few cores or GPUs, or no node with its custom resources)."""


class RolloutFailed(OffstepError):
    """Generation could not be completed (rollout workers died or hung too often)."""


class TrainerFailed(OffstepError):
    """A trainer worker (actor, reference or critic) died."""
