"""offstep's benchmarks: each script is a module of this package, run from the checkout's root as

    python -m benchmarks.NAME [--help]

``benchmarks.common`` holds what a run records (command, CPU kind, date) and where its results go
(``benchmarks/results/``); ``benchmarks.readme`` builds the page ``benchmarks/README.md`` from the
stored results and imports no script; the scripts import both (never each other's ``__main__``).
"""
