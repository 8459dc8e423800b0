"""python -m experiments.algorithms --workdir=runs/algorithms

The race to the ridge solution in layers: every program of
:mod:`elsa.algorithms` (GD, heavy ball, Nesterov, Chebyshev, Newton–Schulz,
the third-order hyperpower iteration), compiled to an ELSA stack, on tasks
with ``kappa(A)`` from 10 to 1e6; the layers each needs to reach a relative
error ``tol`` (float64) and ``tol_float32`` (float32), beside the reference
interpreter's count. Override fields with ``--config.field=value``
(``--config.kappas='(10.0, 1e4)'``, ``--config.layer_budget=20000``);
``--config=experiments/configs/algorithms.py:tiny`` shrinks the run to
seconds (what the driver test uses). The driver turns on ``jax_enable_x64``
for the run and restores the previous setting after it.
"""

import ml_collections

from experiments import checks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The default race: 7 programs, 5 kappas up to 1e6, d = 20.

  ``arg``: ``None`` for the default, ``"tiny"`` for the seconds-long variant
  (2 programs, 2 kappas, small tasks).
  """
  arg = checks.variant("algorithms", arg, ("tiny",))
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Names in elsa.algorithms.ALGORITHMS.
  config.algorithms = ("gd", "heavy_ball", "nesterov", "chebyshev",
                       "newton_schulz", "third_order", "third_order_residual")
  config.kappas = (10.0, 1e2, 1e3, 1e4, 1e6)  # each >= 1
  config.n_train = 40        # >= d
  config.d = 20
  config.n_query = 2
  config.tasks_per_kappa = 2
  # Eigenvalues of A are log-spaced in [1/kappa, 1]; X^T X / N gets them
  # minus lam, so 0 <= lam < 1 / max(kappas).
  config.lam = 1e-8
  config.noise = 0.1
  config.tol = 1e-10         # relative error ||w - w*|| / ||w*|| (float64)
  config.tol_float32 = 1e-5  # the same for the float32 run
  # Total layers (set-up + loops) the first-order methods may run; past it a
  # count is null ("beyond the budget").
  config.layer_budget = 5000
  # The same for the float32 run, whose first-order errors stall above
  # tol_float32 from kappa = 1e3 on (docs/guides/algorithms.md).
  config.layer_budget_float32 = 2000
  # Loops of Newton-Schulz and the third-order iteration.
  config.depth = 40
  # Loops the reference interpreter (elsa.programs.run) may run to confirm a
  # count; past it the interpreter's count is null (not checked). At the
  # layer budget every count the stack reaches is checked.
  config.interpreter_loops = 5000
  if arg == "tiny":
    # A scheduled first-order method (past its budget at kappa 100) and a
    # second-order one.
    config.algorithms = ("chebyshev", "newton_schulz")
    config.kappas = (10.0, 1e2)
    config.n_train = 6
    config.d = 3
    config.tasks_per_kappa = 2
    config.lam = 1e-6
    config.layer_budget = 100
    config.layer_budget_float32 = 100
    config.depth = 14
    config.interpreter_loops = 40
  return config
