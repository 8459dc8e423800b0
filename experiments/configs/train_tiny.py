r"""python -m experiments.train --config=experiments/configs/train_tiny.py --workdir=/tmp/train_tiny

The training driver shrunk to seconds (tests and Colab): depths 1 and 2,
a few hundred steps, few test tasks, two shifts.
"""

import ml_collections

from experiments.configs import train


def get_config() -> ml_collections.ConfigDict:
  config = train.get_config()
  config.n_train = 8
  config.d = 2
  config.depths = (1, 2)
  config.steps = 200
  config.warmup_steps = 20
  config.batch = 64
  config.log_every = 20
  config.checkpoint_every = 100
  config.n_test = 256
  config.eta_grid = 20
  config.shifts = ml_collections.ConfigDict({
      "x_scale_x2": {"x_scale": 2.0},
      "x_laplace": {"x_dist": "laplace"},
  })
  return config
