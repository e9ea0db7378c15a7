"""A verifiers (v1) taskset over a local dataset: two-number sums, with a calculator tool.

Written with verifiers' own classes (``Taskset``, ``Task``, ``TaskData``, ``@vf.reward``,
``Toolset`` + ``@vf.tool``), so it trains in offstep as any Environments Hub taskset does:
``env.kind=verifiers env.id=vf_arith``. Arguments (``env.args``): ``size`` (tasks), ``tools``
(offer the calculator), ``seed``.
"""

from vf_arith.taskset import ArithTaskset

__all__ = ["ArithTaskset"]
