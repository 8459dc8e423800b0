r"""python -m experiments.sweep --workdir=runs/sweep

The main job: L stacked ELSA layers vs L ridge-GD steps, over depth x lambda x eta.


Override any field from the command line, e.g.
``--config.depth=100 --config.lams='(0.0, 0.5)' --config.x64=True``.
Runs in well under a minute on 2 CPU cores (see BUILD_NOTES.md, "The sweep").
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The default sweep: both input forms, 4 x 4 grid of (lambda, eta), depth 50."""
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
  config.lams = (0.0, 0.01, 0.1, 1.0)
  # eta_mode 'fraction': each eta is a fraction of each task's stability
  # limit 2 / (lambda_max(X^T X / N) + lam); 'absolute': the step size itself.
  # A fraction >= 1 is past the limit: that cell is reported as diverged.
  config.eta_mode = "fraction"
  config.etas = (0.1, 0.5, 0.9, 1.1)
  # The deepest stack; every depth 1..depth is measured from one scan.
  config.depth = 50
  # Grid points x tasks per compiled call (rounded up to a multiple of the
  # device count). Sets the granularity of the progress log, not the result.
  config.chunk_size = 64
  config.x64 = False
  return config
