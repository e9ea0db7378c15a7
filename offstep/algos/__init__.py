"""Pure RL algorithm maths: masked reductions, advantages, losses, off-policy correction, KL
control and DAPO's reward shaping. docs/algorithms.md maps each to its paper and config key.

Everything here is a function of tensors and floats (no configs, no models). Response tensors are
right-padded ``[B, R]`` with a ``response_mask`` (1 on real response tokens, 0 on padding), and
padded entries never affect a result.
"""
