r"""What the decompiler reports for the stacks of a tasks run (``train.py:tasks``).

python -m experiments.decompile_tasks TASKS_WORKDIR [RUN ...] [--identify]

For each run of the workdir (default: every run it holds; ``RUN`` names
some), each trained model and depth, read back from its checkpoint
(:func:`experiments.train.load_trained`, verified against the run's
``config.json``): :func:`elsa.decompile.spectral` on the family's own
prompts (fit and held-out sets from their own keys, float64), with the
extra terms that matter there:

* ``start`` on ``nonzero_mean``: ``x_q^T S(A)`` with ``S(lambda) = sum_k
  c_k T_k(lambda)`` (Chebyshev polynomials on the fit spectrum's range),
  ``c_k [d]`` fitted; GD from ``w0`` has ``S(A) = r(A)
  w0`` with ``r(0) = 1``, so ``S(0)`` is the start the stack behaves as if
  it began from. Printed: ``S(0)`` of the last layer, its cosine with the
  prior mean ``mu`` and its norm over ``|mu|``, and the start term's share
  of the prediction. The compiled GD-from-``mu`` stack is read the same
  way, as the control (its ``S(0)`` must be ``mu``).
* ``y_energy`` on ``mixed_noise``: ``(y^T y / N) x_q^T h(A) b``, the
  noise-adaptive rescaling (Vladymyrov et al. 2024), and its share.
* ``query_key`` for the unmasked models (``elsa_trained``, ``lsa_trained``):
  the query's own token among the keys.

Beside it the explained-share ladder (held-out ``D``, relative squared
error, of GD at one step, at a schedule, the polynomial, and with the
extras), and with ``--identify`` :func:`elsa.decompile.identify`'s closest
family of :data:`IDENTIFY_FAMILIES`. Prints Markdown; writes nothing.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from numpy.polynomial import chebyshev

from elsa import decompile
from elsa import tasks as task_families
from experiments import train
from experiments import train_setup
from experiments import workdirs

# The extra terms of elsa.decompile.spectral per family (the rest: none).
FAMILY_EXTRAS = {"nonzero_mean": ("start",), "mixed_noise": ("y_energy",)}
# Families that identify fits with --identify (the cheap, common ones).
IDENTIFY_FAMILIES = ("gd", "gd_schedule", "heavy_ball", "gd_plus_plus")
DEGREE = 4       # the filter's degree K (r of K + 1)
N_FIT = 512      # fit and held-out prompts
N_TEST = 512


def learned_start(spec: decompile.Spectral, d: int) -> np.ndarray:
  """``S_l(0) [layers, d]``: the start term's matrix polynomial at ``A = 0``
  (the ``start`` extra's coefficients, ``[K + 1, d]`` per layer, after the
  filter's ``K + 1``, in the Chebyshev basis of ``[lo, hi]``)."""
  k = spec.degree + 1
  at = k + sum(k * d if e == "start" else k
               for e in spec.extras[:spec.extras.index("start")])
  coef = spec.coefficients[:, at:at + k * d].reshape(-1, k, d)
  zero = -(spec.hi + spec.lo) / (spec.hi - spec.lo)  # lambda = 0, scaled
  return np.stack([chebyshev.chebval(zero, c) for c in coef])


def _describe(row: dict) -> str:
  found, start, mu = row["spectral"], row["start"], row["mu"]
  ladder = ", ".join(f"{rung} {v['disagreement']:.2g}"
                     for rung, v in found.ladder.items())
  shares = ", ".join(f"{name} {v[-1]:.2f}" for name, v in found.shares.items())
  text = (f"- {row['name']} L={row['depth']}: D: {ladder}; last layer's "
          f"shares: {shares}")
  schedule = found.schedules[-1]
  text += ("; last layer's GD schedule " + ", ".join(
      f"{eta:.3g}" for eta in schedule) if schedule is not None else
           "; last layer's r has complex roots")
  if start is not None:
    w0 = start[-1]
    cos = float(w0 @ mu / (np.linalg.norm(w0) * np.linalg.norm(mu)))
    text += (f"; S(0) = [{', '.join(f'{v:.3f}' for v in w0)}] (cosine with "
             f"mu {cos:.3f}, |S(0)| / |mu| "
             f"{np.linalg.norm(w0) / np.linalg.norm(mu):.3f})")
  if row["closest"] is not None:
    text += "; identify: " + row["closest"]
  return text


def _identify(predict, fit, test, lam: float) -> str:
  report = decompile.identify(predict, fit, test, families=IDENTIFY_FAMILIES,
                              lam=lam, restarts=2)
  best = report.closest
  return (f"closest {best.family} (D {best.disagreement:.2g}"
          + (", within tol" if report.best is not None else "") + ")")


def decompile_run(run_dir: str, *, identify: bool = False) -> list[dict]:
  """One run of a tasks workdir, every trained model and depth (and on
  ``nonzero_mean`` the compiled GD-from-``mu`` stack, ``gd_from_mu_compiled``):
  rows ``{"name", "depth", "spectral", "start", "mu", "closest"}``, ``start``
  the :func:`learned_start` ``[layers, d]`` on ``nonzero_mean`` (else
  None), ``closest`` identify's closest family (with ``identify``) or None;
  a diverged model's ``spectral`` is None. Call under ``jax.enable_x64``."""
  config, results = train.finished_run(run_dir)
  family = task_families.get(config.task, **train_setup.task_options(config))
  extras = FAMILY_EXTRAS.get(config.task, ())
  spec = train.task_spec(config)
  keys = jax.random.split(jax.random.key(config.seed + 50_000))
  fit, test = (family.sample(k, batch=n, n_train=config.n_train, d=config.d,
                             n_query=config.n_query, dtype=jnp.float64)
               for k, n in zip(keys, (N_FIT, N_TEST)))
  mu = (np.asarray(family.mu(config.d, np.float64))
        if isinstance(family, task_families.NonzeroMean) else None)

  def row(name, depth, predict, extras):
    # An L-layer stack is a polynomial of degree at most (3^L - 1) / 2 in A
    # (one layer: 1); a higher K fits rounding, with spurious roots.
    found = decompile.spectral(predict, fit, test,
                               degree=min(DEGREE, (3 ** depth - 1) // 2),
                               extras=extras, lam=config.lam)
    return {"name": name, "depth": depth, "spectral": found, "mu": mu,
            "start": None if mu is None else learned_start(found, config.d),
            "closest": (_identify(predict, fit, test, config.lam)
                        if identify else None)}

  rows = []
  for name in config.models:
    model_extras = extras + (("query_key",) if not train.MODELS[name][
        "context_only"] else ())
    for depth in config.depths:
      model = train.trained_model(config, run_dir, results, name=name,
                                  depth=depth)
      rows.append({"name": name, "depth": depth, "spectral": None}
                  if model is None else
                  row(name, depth, decompile.from_model(model, spec),
                      model_extras))
  if mu is not None:  # the control: GD from mu, compiled, must read mu
    compiled = train.compiled_gd_from(
        config.n_train, config.d, config.n_query, tuple(mu.tolist()))
    for i, depth in enumerate(config.depths):
      rows.append(row("gd_from_mu_compiled", depth, decompile.from_compiled(
          compiled, loops=depth, params=compiled.params(
              loops=depth, lam=jnp.float64(config.lam),
              eta=jnp.float64(results["gd_from_mu_eta"][i]),
              dtype=jnp.float64)), extras))
  return rows


def main(argv: list[str]) -> None:
  identify = "--identify" in argv
  args = [a for a in argv if a != "--identify"]
  if not args:
    raise SystemExit(__doc__.split("\n\n")[1])
  workdir, runs = args[0], args[1:]
  if not runs:
    runs = sorted(r for r in os.listdir(workdir)
                  if os.path.exists(os.path.join(workdir, r, "results.json")))
  try:
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
      for run in runs:
        rows = decompile_run(os.path.join(workdir, run), identify=identify)
        config, _ = train.finished_run(os.path.join(workdir, run))
        print(f"### {run} ({config.task}, {train_setup.task_options(config)})\n")
        for row in rows:
          print(_describe(row) if row["spectral"] is not None else
                f"- {row['name']} L={row['depth']}: diverged")
        print()
  except workdirs.CorruptOutput as err:
    raise SystemExit(f"decompile_tasks: {err}") from None

if __name__ == "__main__":
  main(sys.argv[1:])
