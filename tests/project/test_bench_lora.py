"""benchmarks/lora.py: the command its table names remakes every stored run."""

from benchmarks import lora


def test_regenerate_runs_name_every_stored_run_and_only_those():
    plan = lora.plan_runs("0::0+2,8:3e-4:1,8:1e-4:0+1", 1e-5)
    stored = {name: {"rank": r, "lr": lr, "seed": s} for name, (r, lr, s) in plan.items()}
    arg = lora.runs_arg(stored)
    assert arg == "0:1e-05:0+2,8:0.0001:0+1,8:0.0003:1"
    assert lora.plan_runs(arg, 1e-5).keys() == plan.keys()
    assert lora.runs_arg({}) == ""
