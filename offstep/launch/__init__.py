"""From a command line to a checked config, before anything is prepared: loading (Hydra, presets,
verl's keys translated), the checks of the config and of this machine (run once, here), and
``offstep train --help``. Sits between ``offstep.cli`` and ``offstep.pipeline``; ``offstep.config``
below holds the typed tree itself."""
