"""An OpenEnv environment (openenv-core's server API: ``Environment``, ``Action``, ``Observation``):
two-number sums, two tries per episode. offstep serves it on 127.0.0.1 and trains on it with
``env.kind=openenv env.id=oe_arith:ArithEnvironment`` (docs/environments.md). No OpenEnv package on
PyPI runs here without a container or a hub download, so this one is written with openenv-core's
own classes. Constructor arguments (``env.args``): ``tries``; for tests, ``fail_every`` (every n-th
step, over all servers, raises), ``hang_at`` (the n-th step over all servers hangs), ``record`` (a file each
server appends its pid and port to, and each failure a line)."""

from oe_arith.environment import ArithAction, ArithEnvironment, ArithObservation

__all__ = ["ArithAction", "ArithEnvironment", "ArithObservation"]
