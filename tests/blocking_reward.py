"""A reward function file for kill-and-resume tests: deterministic and not constant (the tiny models
earn nothing on the built-in tasks), and blocking forever once the file named by ``$BLOCK_AFTER``
exists, so that a run is stuck mid-step with a batch generating: the moment at which a test kills it."""

BLOCKING_REWARD = '''
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    gate = os.environ.get("BLOCK_AFTER")
    if gate and os.path.exists(gate):
        time.sleep(3600)
    return (len(solution_str) % 3) / 2.0
'''
