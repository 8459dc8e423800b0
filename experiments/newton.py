r"""Layers to reach the ridge solution as kappa grows: ELSA Newton–Schulz vs ELSA-GD vs GD.

For each condition number ``kappa`` of ``A = X^T X / N + lam I`` (tasks built
with eigenvalues of ``A`` log-spaced in ``[1/kappa, 1]``) it counts the layers
until ``||w - w*|| / ||w*|| <= tol``:

* ELSA-Newton: the :class:`elsa.forms.Newton` stack, run (float64 and
  float32), with ``alpha = safe_alpha`` (``1/||A||_F``) and with the best
  ``alpha = 2/(mu_min + mu_max)``; counts include the 2 set-up layers. Also
  the count the theory predicts: ``2 + min{t : err_GD(2^t) <= tol}``.
* ELSA-GD with the best constant step ``eta = 2/(mu_min + mu_max)``: the
  Natural form's stack is plain GD exactly, one layer per step and no set-up
  (tests/test_forms.py checks it), so its count is the GD step count,
  computed analytically in the eigenbasis of ``A`` (millions of steps at
  ``kappa = 1e6``) and checked against :func:`elsa.ridge.gd` where cheap.
* plain GD with the textbook step ``eta = 1/mu_max``, counted the same way.

Each kappa draws its tasks from its own generator,
``np.random.default_rng([seed, i])``, and is saved as ``partial_kappa<i>.json``
as soon as it is done (tied to the config by its hash, verified on resume),
so a rerun resumes at the first unfinished kappa. Then ``results.json`` and
``figures/newton_layers.png`` (:func:`experiments.plotting.newton_layers`),
all in ``--workdir``, claimed as every driver claims it
(:func:`experiments.workdirs.claim_workdir`).
The float32 and float64 runs use full-precision matmuls
(``jax.default_matmul_precision("highest")``): GPUs and TPUs would otherwise
run float32 products in TF32 or bfloat16. ``jax_enable_x64`` is on during
:func:`run` (the float64 run and references) and restored after it.
"""

from __future__ import annotations

import math

from absl import app
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import elsa
from elsa import ridge
from elsa.forms.newton import Newton
from experiments import checks
from experiments import cli
from experiments import distributed
from experiments import metrics
from experiments import plotting
from experiments import workdirs


def spectrum_tasks(rng: np.random.Generator, *, kappa: float, count: int,
                   n_train: int, d: int, n_query: int, lam: float,
                   noise: float):
  """``count`` tasks (float64 numpy) with ``eig(A)`` log-spaced in ``[1/kappa, 1]``.

  ``X = sqrt(N) U diag(sqrt(mu - lam)) V^T`` with random orthonormal ``U: [N,
  d]`` and ``V: [d, d]``, so ``X^T X / N = V diag(mu - lam) V^T``;
  ``y = X w_true + noise * eps``. Returns ``x [B, N, d]``, ``y [B, N]``,
  ``x_query [B, Q, d]``.
  """
  if n_train < d:
    raise ValueError(f"spectrum_tasks: needs n_train >= d, got {n_train} < {d}.")
  mu = np.geomspace(1 / kappa, 1, d)
  if mu[0] <= lam:
    raise ValueError(f"spectrum_tasks: lam={lam} must be below 1/kappa="
                     f"{1 / kappa} (eigenvalues of X^T X / N are mu - lam).")
  xs, ys = [], []
  for _ in range(count):
    u, _ = np.linalg.qr(rng.normal(size=(n_train, d)))
    v, _ = np.linalg.qr(rng.normal(size=(d, d)))
    x = math.sqrt(n_train) * (u * np.sqrt(mu - lam)) @ v.T
    xs.append(x)
    ys.append(x @ rng.normal(size=d) + noise * rng.normal(size=n_train))
  xq = rng.normal(size=(count, n_query, d))
  return np.stack(xs), np.stack(ys), xq


def gd_steps_to_tol(evals, coeffs, *, eta: float, tol: float,
                    max_steps: int = 2**45) -> int | None:
  """Fewest GD steps from 0 with ``||w_s - w*|| <= tol ||w*||``, exactly in the eigenbasis.

  ``w* - w_s = (I - eta A)^s w*``, so with ``c = V^T w*`` the error is
  ``||r^s * c||`` for ``r = 1 - eta mu``; it is non-increasing in ``s`` when
  ``|r| < 1``, so bisection finds the first ``s``. ``None`` past ``max_steps``.
  """
  r = 1 - eta * np.asarray(evals)
  coeffs = np.asarray(coeffs)
  target = tol * np.linalg.norm(coeffs)
  err = lambda s: np.linalg.norm(np.abs(r) ** s * coeffs)
  if err(max_steps) > target:
    return None
  lo, hi = -1, max_steps  # err(lo) > target >= err(hi)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if err(mid) <= target else (mid, hi)
  return hi


def newton_decoder(form: Newton, *, lam: float, depth: int, mesh):
  """A jitted ``(x, y, xq, alpha) -> w`` after every layer, ``[B, 2 + depth + 1, d]``.

  Batched over tasks and their ``alpha`` (traced: one compile per dtype),
  the tasks split over ``mesh`` (host arrays in, numpy out,
  :func:`experiments.distributed.put_tasks`).
  """

  def states(x, y, xq, alpha):
    params = form.newton_params(lam=jnp.asarray(lam, x.dtype), alpha=alpha,
                                depth=depth)
    h0 = form.encode(x, y, x_query=xq)
    return form.decode_w(elsa.elsa_stack(params, h0, return_all=True))

  decode = jax.jit(jax.vmap(states),
                   out_shardings=distributed.replicated(mesh))
  return lambda *args: distributed.take_tasks(
      decode(*distributed.put_tasks(args, mesh)), len(args[0]))


def _relative_errors(ws, w_star) -> np.ndarray:
  """``||w - w*|| / ||w*||`` per task and layer, in float64: ``[B, L + 1]``."""
  return metrics.relative_error(np.asarray(ws, np.float64), w_star[:, None])


def _first_below(errors: np.ndarray, tol: float) -> list[int | None]:
  """Per row, the first layer index whose error is ``<= tol`` (``None``: never)."""
  out = []
  for row in errors:
    hits = np.nonzero(row <= tol)[0]
    out.append(int(hits[0]) if hits.size else None)
  return out


def _kappa_result(config, kappa: float, rng: np.random.Generator, decoder
                  ) -> dict:
  """Every count and floor for one condition number (see the module doc)."""
  x, y, xq = spectrum_tasks(rng, kappa=kappa, count=config.tasks_per_kappa,
                            n_train=config.n_train, d=config.d,
                            n_query=config.n_query, lam=config.lam,
                            noise=config.noise)
  a, _ = ridge.normal_equations(jnp.asarray(x), jnp.asarray(y), lam=config.lam)
  evals, evecs = np.linalg.eigh(np.asarray(a))
  w_star = np.asarray(ridge.solve(jnp.asarray(x), jnp.asarray(y),
                                  lam=config.lam))
  coeffs = np.einsum("bdi,bd->bi", evecs, w_star)
  mu_min, mu_max = evals[:, 0], evals[:, -1]
  alphas = {"safe": np.asarray(ridge.safe_alpha(jnp.asarray(x), lam=config.lam)),
            "best": 2 / (mu_min + mu_max)}
  form = Newton(n_train=config.n_train, d=config.d, n_query=config.n_query)
  setup = form.setup_layers
  out = {"kappa": kappa, "kappa_measured": (mu_max / mu_min).tolist()}
  for name, alpha in alphas.items():
    steps = [gd_steps_to_tol(e, c, eta=al, tol=config.tol)
             for e, c, al in zip(evals, coeffs, alpha)]
    out[f"newton_theory_{name}"] = [
        None if s is None else setup + max(0, math.ceil(math.log2(max(s, 1))))
        for s in steps]
    for dtype, tol in ((jnp.float64, config.tol),
                       (jnp.float32, config.tol_float32)):
      cast = lambda arr: np.asarray(arr, dtype)  # pylint: disable=cell-var-from-loop
      errors = _relative_errors(decoder(cast(x), cast(y), cast(xq),
                                        cast(alpha)), w_star)
      key = f"newton_{jnp.dtype(dtype).name}_{name}"
      out[key] = _first_below(errors, tol)
      out[key + "_floor"] = errors[:, setup + 1:].min(axis=1).tolist()
      out[key + "_final"] = errors[:, -1].tolist()
      if name == "safe":
        out[key + "_curve"] = np.median(errors, axis=0).tolist()
  for name, eta in (("elsa_gd_best", 2 / (mu_min + mu_max)),
                    ("gd_plain", 1 / mu_max)):
    out[name] = [gd_steps_to_tol(e, c, eta=et, tol=config.tol)
                 for e, c, et in zip(evals, coeffs, eta)]
    out[name + "_eta"] = eta.tolist()
  out["gd_check"] = _check_gd_count(x[0], y[0], w_star[0], lam=config.lam,
                                    eta=float(1 / mu_max[0]), tol=config.tol,
                                    steps=out["gd_plain"][0])
  return out


def _check_gd_count(x, y, w_star, *, lam, eta, tol, steps) -> bool | None:
  """Runs :func:`elsa.ridge.gd` to confirm the analytic count (``None``: too long)."""
  if steps is None or steps > 50_000:
    return None
  ws = np.asarray(ridge.gd(jnp.asarray(x), jnp.asarray(y), lam=lam, eta=eta,
                           steps=steps))
  errors = metrics.relative_error(ws, w_star)
  return bool(errors[-1] <= tol and (steps == 0 or errors[-2] > tol))


def _median(values) -> float | None:
  """Median over tasks; ``None`` if any task never reached the tolerance."""
  if any(v is None for v in values):
    return None
  return float(np.median(values))


def summary_rows(results: dict) -> list[dict]:
  """One row per kappa: median layer counts and the worst floors.

  A floor is ``None`` where an error was not finite (JSON null); the worst
  floor is over the finite ones (``None`` if there are none).
  """
  rows = []
  for r in results["per_kappa"]:
    worst = lambda floors: max((f for f in floors if f is not None),
                               default=None)
    rows.append({
        "kappa": r["kappa"],
        "newton_f64_safe": _median(r["newton_float64_safe"]),
        "newton_f64_best": _median(r["newton_float64_best"]),
        "newton_theory_safe": _median(r["newton_theory_safe"]),
        "newton_f32_safe": _median(r["newton_float32_safe"]),
        "elsa_gd_best": _median(r["elsa_gd_best"]),
        "gd_plain": _median(r["gd_plain"]),
        "floor_f64": worst(r["newton_float64_safe_floor"]),
        "floor_f32": worst(r["newton_float32_safe_floor"]),
    })
  return rows


def markdown_table(results: dict) -> str:
  """The summary as a markdown table (what the notes show)."""
  cols = ["kappa", "newton_f64_safe", "newton_f64_best", "newton_theory_safe",
          "newton_f32_safe", "elsa_gd_best", "gd_plain", "floor_f64",
          "floor_f32"]
  fmt = lambda v: "never" if v is None else (
      f"{v:.1e}" if isinstance(v, float) and (v < 1e-2 or v >= 1e5)
      else f"{v:g}")
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for row in summary_rows(results):
    lines.append("| " + " | ".join(fmt(row[c]) for c in cols) + " |")
  return "\n".join(lines)


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, in one line naming the field.

  Raises:
    experiments.checks.ConfigError: a field outside its range, a NaN or inf,
      an empty ``kappas``, or arrays that would not fit in memory.
  """
  checks.check_seed(config)
  kappas = checks.check_items(config, "kappas", low=1)
  for field in ("d", "n_query", "tasks_per_kappa", "depth"):
    checks.check_int(config, field)
  if checks.check_int(config, "n_train") < config.d:
    raise checks.ConfigError(f"config.n_train must be an int >= config.d "
                             f"({config.d}), got {config.n_train}.")
  checks.check_float(config, "lam", low=0, high=1 / max(kappas),
                     high_open=True)
  checks.check_float(config, "noise", low=0)
  for field in ("tol", "tol_float32"):
    checks.check_float(config, field, low=0, high=1, low_open=True,
                       high_open=True)
  form = Newton(n_train=config.n_train, d=config.d, n_query=config.n_query)
  layers = form.setup_layers + config.depth + 1
  # Every layer's state and parameters, for a kappa's tasks, in float64.
  checks.check_fits(8 * 3 * config.tasks_per_kappa * layers
                    * (form.m + form.n) ** 2,
                    fields="n_train, d, n_query, tasks_per_kappa and depth")


def per_kappa(config, wd: workdirs.Workdir, compute, *,
              name: str) -> list[dict]:
  """``compute(kappa, rng)`` for every ``config.kappas`` at the highest matmul
  precision, each saved as ``partial_kappa<i>.json`` when done and loaded on
  a rerun; non-finite numbers as ``None``. ``rng`` is
  ``np.random.default_rng([config.seed, i])``: a resumed kappa draws the
  same."""
  names = [f"partial_kappa{i}.json" for i in range(len(config.kappas))]
  results = [wd.read_json(n) for n in names]
  progress = cli.Progress(len(names), name=name, unit="kappas")
  progress.resumed(sum(r is not None for r in results))
  with jax.default_matmul_precision("highest"):
    for i, kappa in enumerate(config.kappas):
      if results[i] is None:
        rng = np.random.default_rng([config.seed, i])
        results[i] = workdirs.finite_or_none(compute(float(kappa), rng))
        wd.write_json(names[i], results[i])
        progress.update()
  return results


def _per_kappa(config, wd: workdirs.Workdir) -> list[dict]:
  """Every kappa's result: loaded if an earlier run saved it, else computed and saved."""
  form = Newton(n_train=config.n_train, d=config.d, n_query=config.n_query)
  decoder = newton_decoder(form, lam=config.lam, depth=config.depth,
                           mesh=distributed.mesh())
  return per_kappa(
      config, wd, lambda kappa, rng: _kappa_result(config, kappa, rng, decoder),
      name="newton")


def run(config, workdir: str, *, overwrite: bool = False) -> dict:
  """Runs the layers-vs-kappa experiment in ``workdir``; returns the results.

  Checks the config, claims the workdir (``overwrite`` first deletes what an
  earlier newton run wrote there), then skips the work if ``results.json``
  exists, and resumes from the ``partial_kappa<i>.json`` files if not.
  Non-finite numbers are ``None`` (JSON null) in the returned dict as in the
  file. ``jax_enable_x64`` is on inside, restored after.

  Raises:
    experiments.checks.ConfigError: the config cannot run (nothing written).
    experiments.workdirs.WorkdirInUse: another run holds ``workdir``, or it
      holds a different config and ``overwrite`` is off.
    experiments.workdirs.CorruptOutput: a saved file is damaged, altered or of
      another config.
  """
  distributed.agree("validate", validate, config)
  with jax.enable_x64(True), distributed.claim_workdir(
      workdir, config, overwrite=overwrite) as wd:
    results = wd.results(lambda: {"config": checks.config_dict(config),
                                  "per_kappa": _per_kappa(config, wd)},
                         name="newton")
    wd.save_figure(plotting.newton_layers(results, summary_rows(results)),
                   "figures/newton_layers.png")
  logging.info("newton summary:\n%s", markdown_table(results))
  return results


def main(argv):
  distributed.run_main(argv, "newton", run)


if __name__ == "__main__":
  cli.define_flags("newton")
  distributed.define_flags()
  app.run(main)
