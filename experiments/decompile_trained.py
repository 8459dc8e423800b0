"""The spectral description of a train run's stacks, printed as polynomials and schedules.

python -m experiments.decompile_trained TRAIN_WORKDIR [VARIANT]

The models, depths and tasks of the finished train run in ``TRAIN_WORKDIR``
(its ``config.json``), each at the grid point it chose on its validation
tasks; the spectral degree, extras and task counts of the decompile driver's
config ``VARIANT`` (default, ``tiny`` or ``vonoswald``). Prints; writes
nothing.
"""

import sys

import jax
import numpy as np

from elsa import decompile
from experiments import decompile as driver
from experiments import train
from experiments import workdirs
from experiments.configs import decompile as decompile_config


def main(train_workdir, variant=None):
  config = decompile_config.get_config(variant)
  try:
    config.train, train_results = train.finished_run(train_workdir)
  except workdirs.CorruptOutput as err:
    raise SystemExit(f"decompile_trained: {err}") from None
  spec = train.task_spec(config.train)
  with jax.enable_x64(True), jax.default_matmul_precision("highest"):
    fit_tasks, test_tasks = driver.sharded_tasks(config)[2:]
    for name in config.train.models:
      for depth in config.train.depths:
        model = train.trained_model(config.train, train_workdir,
                                    train_results, name=name, depth=depth)
        if model is None:
          print(f"{name} L={depth}: diverged")
          continue
        s = decompile.spectral(decompile.from_model(model, spec), fit_tasks,
                               test_tasks, degree=config.spectral_degree,
                               extras=tuple(config.spectral_extras),
                               lam=spec.lam)
        ladder = {k: f"{v['disagreement']:.2e}" for k, v in s.ladder.items()}
        print(f"## {name} L={depth}  ladder {ladder}  "
              f"gd eta {s.ladder['gd']['eta'][0]:.4f} x "
              f"{s.ladder['gd']['per_layer_steps']}/layer, gd_lam "
              f"(eta {s.ladder['gd_lam']['eta'][0]:.4f}, lam "
              f"{s.ladder['gd_lam']['lam']:.4f}); spectrum [{s.lo:.3f}, "
              f"{s.hi:.3f}]; shares (last layer) "
              + str({k: round(v[-1], 4) for k, v in s.shares.items()}))
        for layer in range(depth):
          roots = s.roots[layer]
          sched = s.schedules[layer]
          print(f"  layer {layer + 1}: g = "
                + " + ".join(f"{c:.4g} l^{k}" for k, c in
                             enumerate(s.monomial[layer]))
                + f"; roots of r: {np.round(roots, 3).tolist()}; "
                + ("schedule " + str(np.round(sched, 4).tolist())
                   if sched is not None else "complex: no real schedule")
                + f"; max|r| {s.max_residual[layer]:.3f} vs Chebyshev "
                f"{s.chebyshev_optimum[layer]:.3f}")


if __name__ == "__main__":
  main(*sys.argv[1:])
