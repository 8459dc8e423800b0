"""Every trained model, baseline and reference on the test tasks, and GD's
step sizes chosen on the validation tasks.

On the ridge task (:func:`evaluate_ridge`): the Bayes-optimal predictor, GD
at its chosen step size, the constructed ELSA-GD stack, ridge, least squares
and zero, the trained models' agreement with GD (predictions and input
sensitivities) and their per-layer predictions, in distribution and under
the config's shifts. On a family of :mod:`elsa.tasks`
(:func:`evaluate_family`): the family's references
(:func:`reference_losses`, refused when not finite), GD from zero, on
``nonzero_mean`` GD from the prior mean as the reference and as the compiled
ELSA stack (:func:`compiled_gd_from_predict`), with the per-prompt summaries
and paired differences of :mod:`experiments.loss_stats`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from elsa import algorithms
from elsa import attention
from elsa import programs
from elsa import ridge
from elsa import tasks as task_families
from elsa import training
from experiments import checks
from experiments import loss_stats
from experiments import train_setup


# The paired model-to-model differences ``a - b`` of a family's results,
# where both ran: trained ELSA (with the key mask, and the paper's without)
# against the field's masked LSA with a residual and against each other,
# and every trained model against the compiled GD-from-mu stack
# (nonzero_mean).
FAMILY_PAIRS = (("elsa_masked", "lsa_residual_trained"),
                ("elsa_trained", "lsa_residual_trained"),
                ("elsa_masked", "elsa_trained"),
                ("elsa_masked", "gd_from_mu_compiled"),
                ("elsa_trained", "gd_from_mu_compiled"),
                ("lsa_residual_trained", "gd_from_mu_compiled"))


def gd_from_predict(task, *, w0, lam, eta, steps: int):
  """Predictions ``x_q^T w_steps`` of ridge GD from ``w0 [d]``: ``[B, Q]``."""
  start = jnp.broadcast_to(jnp.asarray(w0, task.x.dtype), task.w_true.shape)
  w = ridge.gd(task.x, task.y, lam=lam, eta=eta, steps=steps, w0=start)[-1]
  return jnp.einsum("bqd,bd->bq", task.x_query, w)


@functools.lru_cache(maxsize=None)
def compiled_gd_from(n_train: int, d: int, n_query: int, w0: tuple):
  """The compiled GD-from-``w0`` program (:func:`elsa.algorithms.ridge_gd_from`)."""
  return programs.compile(algorithms.ridge_gd_from(
      n_train=n_train, d=d, n_query=n_query, w0=np.asarray(w0)))


def compiled_gd_from_predict(task, *, w0, lam, eta, depth: int,
                             return_all: bool = False):
  """The compiled ELSA stack of ``depth`` GD steps from ``w0`` on ``task``:
  predictions ``[B, Q]``, or with ``return_all`` the ``w`` block after
  every layer, ``[depth + 3, B, d]`` (input, set-up, ``depth`` steps,
  read-out)."""
  _, n_train, d = task.x.shape
  compiled = compiled_gd_from(n_train, d, task.x_query.shape[1],
                               tuple(np.asarray(w0, np.float64).tolist()))
  h0 = compiled.encode(X=task.x, y=task.y[..., None], Xq=task.x_query)
  params = compiled.params(loops=depth, lam=jnp.asarray(lam, task.x.dtype),
                           eta=jnp.asarray(eta, task.x.dtype),
                           dtype=task.x.dtype)
  if return_all:
    hs = attention.elsa_stack(params, h0, return_all=True)
    return compiled.read(hs, "w")[..., 0]
  return compiled.read(attention.elsa_stack(params, h0), "p")[..., 0]


def best_etas(config, task) -> tuple[dict[int, float], dict[str, list]]:
  """GD's step size per depth: the lowest mean MSE on ``task`` (validation)."""
  etas = jnp.linspace(config.eta_min, config.eta_max, config.eta_grid,
                      dtype=train_setup.dtype(config))
  best, curves = {}, {}
  for depth in config.depths:
    losses = training.gd_eta_grid_losses(task, lam=config.lam, etas=etas,
                                         steps=depth)
    best[depth] = float(etas[int(jnp.nanargmin(losses))])
    curves[str(depth)] = np.asarray(losses).tolist()
  return best, {"etas": np.asarray(etas).tolist(), "val_loss": curves}


def best_etas_from(config, task, w0) -> dict[int, float]:
  """GD-from-``w0``'s step size per depth, chosen on ``task`` (validation)."""
  etas = jnp.linspace(config.eta_min, config.eta_max, config.eta_grid,
                      dtype=train_setup.dtype(config))
  best = {}
  for depth in config.depths:
    loss = jax.jit(lambda etas, depth=depth: jax.lax.map(
        lambda eta: jnp.mean(training.mse(gd_from_predict(
            task, w0=w0, lam=config.lam, eta=eta, steps=depth), task)), etas))
    best[depth] = float(etas[int(np.nanargmin(np.asarray(loss(etas))))])
  return best


def depth_evaluator(config, trained: dict, eta: float, depth: int):
  """A jitted ``task -> (per-task MSE, agreement with GD, per-layer)`` for one depth.

  ``trained``: ``{name: module}`` of the chosen grid points (models whose
  whole grid diverged are absent). Built once per depth and reused for every
  shift: shifts change the tasks, not the token layout or the lambda; the
  Bayes predictor keeps the in-distribution prior.
  """
  spec = train_setup.task_spec(config)
  form = spec.model_tokens()

  def evaluate(task):
    gd = lambda t: training.gd_predict(t, lam=spec.lam, eta=eta, steps=depth)
    preds = {"bayes_optimal": training.bayes_predict(task, spec),
             "gd_best_eta": gd(task),
             "elsa_constructed_gd": training.constructed_gd_predict(
                 task, spec, eta=jnp.asarray(eta, train_setup.dtype(config)), depth=depth),
             "ridge": training.ridge_predict(task, lam=spec.lam),
             "least_squares": training.least_squares_predict(task),
             "zero": jnp.zeros_like(task.y_query)}
    gd_sens = training.query_sensitivity(gd, task)
    gd_steps = training.gd_step_predictions(task, lam=spec.lam, eta=eta,
                                            steps=depth)
    to = lambda target: task._replace(y_query=target)
    agree, layers = {}, {}
    for name, model in trained.items():
      predict = lambda t, model=model: training.model_predict(model, form, t)
      preds[name] = predict(task)
      cos, rel = training.sensitivity_agreement(
          training.query_sensitivity(predict, task), gd_sens)
      agree[name] = {"pred_mse_to_gd": training.mse(preds[name],
                                                    to(preds["gd_best_eta"])),
                     "sensitivity_cosine": cos, "sensitivity_rel_l2": rel}
      per_layer = training.layer_predictions(model, form, task)
      layers[name] = {
          "test_loss": jax.vmap(lambda p: training.mse(p, task).mean())(
              per_layer),
          "mse_to_gd_step": jax.vmap(
              lambda p, g: training.mse(p, to(g)).mean())(per_layer, gd_steps),
          "mse_to_bayes": jax.vmap(lambda p: training.mse(
              p, to(preds["bayes_optimal"])).mean())(per_layer)}
    layers["gd_steps"] = {"test_loss": jax.vmap(
        lambda p: training.mse(p, task).mean())(gd_steps)}
    losses = {name: training.mse(pred, task) for name, pred in preds.items()}
    return losses, agree, layers

  return jax.jit(evaluate)


def _in_chunks(evaluate, task, size: int):
  """``evaluate(task)`` over chunks of ``size`` tasks: per-task arrays
  (losses, agreement) concatenated, per-layer means (equal chunks) averaged."""
  n = task.x.shape[0]
  parts = [evaluate(jax.tree.map(lambda a, i=i: a[i:i + size], task))
           for i in range(0, n, size)]
  losses, agree, layers = zip(*parts)
  join = lambda *xs: np.concatenate([np.asarray(x) for x in xs])
  mean = lambda *xs: np.mean([np.asarray(x) for x in xs], axis=0)
  return (jax.tree.map(join, *losses), jax.tree.map(join, *agree),
          jax.tree.map(mean, *layers))


def _evaluate(config, evaluators: list, task, *, layers: bool = False
              ) -> dict[str, Any]:
  """Per-depth test losses (mean, se) of every model and baseline on ``task``.

  A model whose grid diverged at a depth gets NaN there (``null`` in JSON).
  """
  size = min(config.eval_chunk, config.n_test)
  per_depth = [_in_chunks(evaluate, task, size) for evaluate in evaluators]
  names = [*config.models, *train_setup.BASELINES]
  out = {"test_loss": {}, "test_loss_se": {}, "vs_bayes": {},
         "trained_vs_gd": {}}
  for name in names:
    stats = [loss_stats.mean_se(res[0][name]) if name in res[0] else None
             for res in per_depth]
    out["test_loss"][name] = [s["mean"] if s else np.nan for s in stats]
    out["test_loss_se"][name] = [s["se"] if s else np.nan for s in stats]
  for name in config.models:
    diff = [loss_stats.mean_se(res[0][name] - res[0]["bayes_optimal"]) if name in res[0]
            else {"mean": np.nan, "se": np.nan} for res in per_depth]
    out["vs_bayes"][name] = {"mean": [d["mean"] for d in diff],
                             "se": [d["se"] for d in diff]}
    agree = {}
    for key in ("pred_mse_to_gd", "sensitivity_cosine", "sensitivity_rel_l2"):
      agree[key] = [float(np.mean(np.asarray(res[1][name][key], np.float64)))
                    if name in res[1] else np.nan for res in per_depth]
    out["trained_vs_gd"][name] = agree
  if layers:
    out["layers"] = {
        name: [{k: np.asarray(v, np.float64).tolist()
                for k, v in res[2][name].items()} if name in res[2] else None
               for res in per_depth]
        for name in (*config.models, "gd_steps")}
  return out


def evaluate_ridge(config, trained: dict, etas: dict[int, float]
                  ) -> dict[str, Any]:
  """Every model and baseline on the test tasks, in distribution and shifted."""
  evaluators = [depth_evaluator(
      config, {name: by_depth[depth] for name, by_depth in trained.items()
               if depth in by_depth}, etas[depth], depth)
                for depth in config.depths]
  out = _evaluate(config, evaluators, train_setup.sample_tasks(config, 20_000), layers=True)
  out["shifted"] = {}
  for name, shift in config.shifts.items():
    shifted = _evaluate(config, evaluators, train_setup.sample_tasks(config, 20_000, **shift))
    out["shifted"][name] = {k: shifted[k] for k in
                            ("test_loss", "test_loss_se", "trained_vs_gd")}
  return out


def test_chunks(config) -> list:
  """The test tasks (salt 20_000) in chunks of ``config.eval_chunk``."""
  task = train_setup.sample_tasks(config, 20_000)
  size = min(config.eval_chunk, config.n_test)
  return [jax.tree.map(lambda a, i=i: a[i:i + size], task)
          for i in range(0, config.n_test, size)]


def _per_task(chunks: list, predicts: dict, *, host: bool = False) -> dict:
  """``{name: per-task MSE [n_test]}`` of every predictor of ``predicts``,
  one compiled function for all of them (``host`` ones run eagerly)."""
  run = lambda c: {name: training.mse(predict(c), c)
                   for name, predict in predicts.items()}
  run = run if host else jax.jit(run)
  parts = [run(c) for c in chunks]
  return {name: np.concatenate([np.asarray(p[name], np.float64)
                                for p in parts]) for name in predicts}


class NonFiniteReference(checks.ConfigError):
  """A family's reference is NaN or inf on some test prompts: a table would
  show an empty cell where its comparison belongs."""


def reference_losses(config) -> dict[str, np.ndarray]:
  """Per-prompt MSE ``[n_test]`` of every reference of the config's family
  and of ``zero`` on the test prompts, in the family's order.

  Independent of the models: computed before any training, so that a
  reference that cannot be compared stops the run at once.

  Raises:
    NonFiniteReference: a reference is not finite on some prompts, naming
      the family, the reference and how many.
  """
  chunks = test_chunks(config)
  references = train_setup.train_spec(config).family.references
  host = {n: p for n, p in references.items()
          if n in task_families.HOST_REFERENCES}
  refs = _per_task(chunks, {
      **{n: p for n, p in references.items() if n not in host},
      "zero": lambda c: jnp.zeros_like(c.y_query)})
  refs.update(_per_task(chunks, host, host=True))
  for name in references:
    bad = int(np.sum(~np.isfinite(refs[name])))
    if bad:
      raise NonFiniteReference(
          f"task {config.task} ({train_setup.task_options(config) or 'default options'}): "
          f"its reference {name!r} is not finite (NaN or inf) on {bad} of "
          f"{config.n_test} test prompts in {config.dtype}; nothing would "
          "compare to it. Change the family's options (a larger noise or "
          "scale) or run in float64 (JAX_ENABLE_X64=1 "
          "--config.dtype=float64).")
  return {name: refs[name] for name in (*references, "zero")}


def evaluate_family(config, trained: dict, etas: dict[int, float], val_task,
                    refs: dict[str, np.ndarray]) -> dict[str, Any]:
  """Every model, reference and GD on the family's test prompts.

  Per name and depth (:func:`loss_summary` of the per-prompt MSE):
  ``test_loss`` (mean), ``test_loss_se``, ``test_loss_median``,
  ``test_loss_median_se`` and ``test_loss_worst_share``, for each model,
  ``gd_best_eta`` (from zero), on ``nonzero_mean`` ``gd_from_mu`` and
  ``gd_from_mu_compiled`` (at their own validation-chosen step size), and
  every reference (``refs``, :func:`reference_losses`: the same value at
  every depth) and ``zero``. Paired per-prompt differences
  (:func:`paired_summary`: mean, se, median, median_se per depth):
  ``vs_best_reference[name]``, each name minus ``best_reference``
  (``bayes`` where the family has one, else the reference of lowest test
  MSE); ``paired["a - b"]`` for the pairs of :data:`FAMILY_PAIRS` that ran.
  """
  spec = train_setup.train_spec(config)
  family, form = spec.family, spec.model_tokens()
  chunks = test_chunks(config)
  losses = {}  # name -> {depth: per-task MSE}
  mu = (family.mu(config.d, train_setup.dtype(config))
        if isinstance(family, task_families.NonzeroMean) else None)
  mu_etas = None if mu is None else best_etas_from(config, val_task, mu)
  for depth in config.depths:
    preds = {name: functools.partial(training.model_predict,
                                     by_depth[depth], form)
             for name, by_depth in trained.items() if depth in by_depth}
    preds["gd_best_eta"] = functools.partial(
        training.gd_predict, lam=config.lam, eta=etas[depth], steps=depth)
    if mu is not None:
      preds["gd_from_mu"] = functools.partial(
          gd_from_predict, w0=mu, lam=config.lam, eta=mu_etas[depth],
          steps=depth)
      preds["gd_from_mu_compiled"] = functools.partial(
          compiled_gd_from_predict, w0=mu, lam=config.lam,
          eta=mu_etas[depth], depth=depth)
    for name, per in _per_task(chunks, preds).items():
      losses.setdefault(name, {})[depth] = per
  if "bayes" in refs:
    best = "bayes"
  else:
    best = min((n for n in refs if n != "zero"), key=lambda n: refs[n].mean())
  for name, per in refs.items():  # a reference is the same at every depth
    losses[name] = {depth: per for depth in config.depths}
  for name in config.models:  # diverged at every depth: NaN (null in JSON)
    losses.setdefault(name, {})
  names = [*config.models, *(n for n in losses if n not in config.models)]
  out = {"task": config.task, "task_options": family.options(),
         "references": list(refs), "best_reference": best,
         "gd_from_mu_eta": (None if mu_etas is None else
                            [mu_etas[d] for d in config.depths])}
  by_depth = lambda stats: {key: [s[key] for s in stats] for key in stats[0]}
  missing = lambda keys: dict.fromkeys(keys, np.nan)
  summaries = {name: by_depth([
      loss_stats.loss_summary(losses[name][d]) if d in losses[name]
      else missing(("mean", "se", "median", "median_se", "worst_share"))
      for d in config.depths]) for name in names}
  for key, field in (("mean", "test_loss"), ("se", "test_loss_se"),
                     ("median", "test_loss_median"),
                     ("median_se", "test_loss_median_se"),
                     ("worst_share", "test_loss_worst_share")):
    out[field] = {name: summaries[name][key] for name in names}

  def paired(a: str, b: str) -> dict[str, list[float]]:
    return by_depth([
        loss_stats.paired_summary(losses[a][d], losses[b][d])
        if d in losses[a] and d in losses[b]
        else missing(("mean", "se", "median", "median_se"))
        for d in config.depths])
  out["vs_best_reference"] = {name: paired(name, best) for name in names
                              if name != best}
  out["paired"] = {f"{a} - {b}": paired(a, b) for a, b in FAMILY_PAIRS
                   if a in losses and b in losses}
  return out

