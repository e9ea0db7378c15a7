"""verl's command lines in offstep. A verl user's script
(``python3 -m verl.experimental.one_step_off_policy.main_ppo key=value ...``) runs as
``offstep train key=value ...``; so does a fully-async one
(``python3 -m verl.experimental.fully_async_policy.fully_async_main``), as ``pipeline.mode=fully_async``.

* ``table``: every verl key offstep knows, and what becomes of it (translated, derived, noted or
  refused); ``convert`` holds the value conversions its entries name;
* ``translate``: the command line as offstep overrides, before Hydra composes the config;
* ``derive``: the keys that need the composed config or the data files, after composition
  (``fully_async``: verl's fully-async command line).

Nothing is silently ignored, and every refusal of a command line is reported at once, in one
message. ``offstep.launch.loader.load_config`` calls ``translate`` and ``apply_derived`` and prints
the notes; ``scripts/verl_keys_table.py`` writes the table into docs/from-verl.md.
"""
