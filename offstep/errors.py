"""The one base of offstep's own errors.

An :class:`OffstepError` carries a message that names the problem and its fix, and the exit code
the ``offstep`` command ends with; the command prints the message alone (a traceback would only
bury it). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class OffstepError(Exception):
    exit_code = 2  # bad input: a config key, a file, a model, data, a reward function
