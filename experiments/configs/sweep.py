r"""python -m experiments.sweep --workdir=runs/sweep

The main job: L stacked ELSA layers vs L ridge-GD steps, over depth x lambda x eta.

``--config=experiments/configs/sweep.py:tiny`` shrinks it to seconds (a 2 x 2
grid with one diverged eta, 3 tasks, depth 6: what the tests and the notebook
run). Override any field from the command line, e.g.
``--config.depth=100 --config.lams='(0.0, 0.5)' --config.dtype=float64``
(float64 turns on ``jax_enable_x64`` for the run and restores it after).
Runs in well under a minute on 2 CPU cores (see docs/guides/sweep.md).
"""

import ml_collections

from experiments import checks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The default sweep: both input forms, 4 x 4 grid of (lambda, eta), depth 50.

  ``arg``: ``None`` for the default, ``"tiny"`` for the seconds-long variant.
  """
  arg = checks.variant("sweep", arg, ("tiny",))
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Input forms to sweep, names of elsa.forms classes in lower case.
  config.forms = ("designed", "natural")
  # One ridge task: N training examples of dimension d, Q queries, scalar y.
  config.n_train = 20
  config.d = 5
  config.n_query = 4
  config.n_tasks = 8
  config.noise = 0.1
  config.lams = (0.0, 0.01, 0.1, 1.0)  # each >= 0
  # eta_mode 'fraction': each eta is a fraction of each task's stability
  # limit 2 / (lambda_max(X^T X / N) + lam); 'absolute': the step size itself.
  # A fraction >= 1 is past the limit: that cell is reported as diverged.
  config.eta_mode = "fraction"
  config.etas = (0.1, 0.5, 0.9, 1.1)  # each > 0
  # The deepest stack; every depth 1..depth is measured from one scan.
  config.depth = 50
  # Grid points x tasks per compiled call (rounded up to a multiple of the
  # device count). Sets the granularity of the progress log, not the result.
  config.chunk_size = 64
  config.dtype = "float32"  # or "float64"
  if arg == "tiny":
    config.n_train = 6
    config.d = 3
    config.n_query = 2
    config.n_tasks = 3
    config.lams = (0.0, 0.1)
    config.etas = (0.5, 1.1)
    config.depth = 6
    config.chunk_size = 8
  return config
