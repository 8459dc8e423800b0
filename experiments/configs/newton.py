"""python -m experiments.newton --workdir=runs/newton

Layers needed to reach a relative tolerance on the ridge solution as the
condition number of ``A = X^T X / N + lam I`` grows: ELSA Newton–Schulz
against the ELSA-GD stack with the best constant step and plain GD.
Override fields with ``--config.field=value`` (``--config.kappas='(10.0,
1e4)'``); ``--config=experiments/configs/newton.py:tiny`` shrinks the run to
seconds (what the driver test uses). The driver runs both float64 and float32
stacks: it turns on ``jax_enable_x64`` for the run and restores the previous
setting after it.
"""

import ml_collections

from experiments import checks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The default run (6 kappas up to 1e6); ``arg='tiny'``: 2 kappas, small tasks."""
  arg = checks.variant("newton", arg, ("tiny",))
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.kappas = (10.0, 1e2, 1e3, 1e4, 1e5, 1e6)  # each >= 1
  config.n_train = 32        # >= d
  config.d = 8
  config.n_query = 2
  config.tasks_per_kappa = 4
  # Eigenvalues of A are log-spaced in [1/kappa, 1]; X^T X / N gets them
  # minus lam, so 0 <= lam < 1 / max(kappas).
  config.lam = 1e-7
  config.noise = 0.1
  config.tol = 1e-6          # relative error ||w - w*|| / ||w*|| (float64)
  config.tol_float32 = 1e-3  # the same for the float32 run
  config.depth = 40          # Newton–Schulz layers run after the set-up
  if arg == "tiny":
    config.kappas = (10.0, 1e3)
    config.n_train = 6
    config.d = 3
    config.tasks_per_kappa = 2
    config.depth = 20
  return config
