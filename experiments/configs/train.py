r"""python -m experiments.train --workdir=runs/train

In-context training of ELSA and LSA stacks (depths 1, 2, 4) on ridge
regression from the natural tokens, against GD with the best step size,
the constructed ELSA-GD stack, ridge and least squares, in distribution and
under shifts. A few minutes on 2 CPU cores (see BUILD_NOTES.md, "Training").
Override any field, e.g. ``--config.depths='(1, 2, 4, 8)' --config.steps=4000``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The default training run."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Tasks: y = x^T w + noise, x ~ N(0, I_d), w ~ N(0, I_d); natural tokens.
  config.n_train = 16
  config.d = 4
  config.n_query = 1
  config.lam = 0.05
  config.noise = 0.3
  # Models: leaves [L, C, ...], inner width k (None: n, as the GD construction).
  config.depths = (1, 2, 4)
  config.components = 3
  config.inner = ml_collections.config_dict.placeholder(int)
  config.tied = False
  # Standard deviation of the random weights and biases, ELSA and LSA alike
  # (LSA at 0.1 or 0.3 diverges to NaN at depth 4; see BUILD_NOTES.md).
  config.init_scale = 0.03
  # ELSA: component 0 of every layer starts at the exact skip h -> h.
  config.skip_init = True
  # Optimiser: Adam, global-norm clipping, warmup + cosine decay.
  config.learning_rate = 3e-3
  config.clip_norm = 1.0
  config.steps = 1500
  config.warmup_steps = 100
  config.batch = 128
  config.log_every = 50
  config.checkpoint_every = 250
  config.keep_checkpoints = 2
  # Evaluation: held-out tasks; GD step-size grid (best on these tasks).
  config.n_test = 4096
  config.eta_min = 0.02
  config.eta_max = 2.0
  config.eta_grid = 100
  config.shifts = ml_collections.ConfigDict({
      "x_scale_x0_5": {"x_scale": 0.5},
      "x_scale_x2": {"x_scale": 2.0},
      "w_scale_x0_5": {"w_scale": 0.5},
      "w_scale_x2": {"w_scale": 2.0},
      "w_scale_x5": {"w_scale": 5.0},
      "x_skew_1": {"x_skew": 1.0},
      "x_laplace": {"x_dist": "laplace"},
      "x_exponential": {"x_dist": "exponential"},
      "noise_labels": {"noise_labels": True},
  })
  return config
