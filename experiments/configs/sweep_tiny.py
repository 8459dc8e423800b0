r"""python -m experiments.sweep --config=experiments/configs/sweep_tiny.py --workdir=runs/sweep_tiny

A seconds-long sweep for tests and a quick look: small grid, shallow stacks.
"""

import ml_collections

from experiments.configs import sweep


def get_config() -> ml_collections.ConfigDict:
  """The default sweep shrunk: 2 x 2 grid (one diverged eta), 3 tasks, depth 6."""
  config = sweep.get_config()
  config.n_train = 6
  config.d = 3
  config.n_query = 2
  config.n_tasks = 3
  config.lams = (0.0, 0.1)
  config.etas = (0.5, 1.1)
  config.depth = 6
  config.chunk_size = 8
  return config
