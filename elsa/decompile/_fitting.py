"""Fitting families to a model (:func:`fit`) and ranking them on held-out
tasks (:func:`identify`), with the field's metrics of each fit."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import warnings
from typing import Any, Sequence

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax

from elsa import _validate, algorithms, ridge, training
from elsa.attention import Array
from elsa.decompile._families import FAMILIES, Family
from elsa.decompile._models import Model

# Counts of optimiser steps above this are refused: a typo (1e12) would run
# for days.
MAX_STEPS = 10**6
# Held-out disagreements at or below this are exact (rounding: float64 stacks
# give about 1e-30); among exact fits the order of FAMILIES decides.
EXACT = 1e-20
# Held-out disagreements within this relative difference are tied (a
# parameter a model does not use, such as gd_lam's lam after one step, moves
# D in its last digits only); the simpler family goes first.
TIE = 1e-6


def _check_task(fn: str, name: str, task) -> None:
  if not isinstance(task, ridge.Task):
    raise TypeError(f"{fn}: {name} must be an elsa.ridge.Task, got "
                    f"{type(task).__name__}.")
  x, y, xq = task.x, task.y, task.x_query
  if (jnp.ndim(x) != 3 or jnp.shape(y) != jnp.shape(x)[:2] or jnp.ndim(xq) != 3
      or jnp.shape(xq)[::2] != jnp.shape(x)[::2]):
    raise ValueError(f"{fn}: {name} must have x [B, N, d], y [B, N], x_query "
                     f"[B, Q, d] (scalar targets); got x {jnp.shape(x)}, y "
                     f"{jnp.shape(y)}, x_query {jnp.shape(xq)}.")
  _validate.float32_or_64(fn, f"{name}.x", x)
  _validate.same_dtype(fn, f"{name}.y", y, f"{name}.x", x)
  _validate.same_dtype(fn, f"{name}.x_query", xq, f"{name}.x", x)


def _check_pair(fn: str, fit_tasks: ridge.Task, test_tasks: ridge.Task
                ) -> None:
  """Fit and test tasks that can be compared; a warning where the comparison
  means something else than a held-out test of the fit."""
  _check_task(fn, "fit_tasks", fit_tasks)
  _check_task(fn, "test_tasks", test_tasks)
  _validate.same_dtype(fn, "test_tasks.x", test_tasks.x, "fit_tasks.x",
                       fit_tasks.x)
  (_, n_fit, d_fit), (_, n_test, d_test) = (fit_tasks.x.shape,
                                            test_tasks.x.shape)
  if d_fit != d_test:
    raise ValueError(f"{fn}: test_tasks have d = {d_test} inputs but fit_tasks "
                     f"d = {d_fit}; a fitted preconditioner or filter applies "
                     "to one d only.")
  q_fit, q_test = fit_tasks.x_query.shape[1], test_tasks.x_query.shape[1]
  if (n_fit, q_fit) != (n_test, q_test):
    warnings.warn(f"{fn}: fit_tasks have N = {n_fit}, Q = {q_fit} but "
                  f"test_tasks N = {n_test}, Q = {q_test}: the held-out "
                  "disagreement then measures how the description transfers "
                  "to another context length, not only the fit.", stacklevel=3)
  elif test_tasks is fit_tasks or all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(fit_tasks, test_tasks)):
    warnings.warn(f"{fn}: test_tasks are the fit_tasks: nothing is held out, "
                  "so the disagreement measures the fit, not whether the "
                  "description generalises; pass other tasks of the same "
                  "distribution.", stacklevel=3)


def _check_optimiser(fn: str, *, lam, restarts, adam_steps, lm_steps) -> None:
  _validate.at_least(fn, "lam", lam, low=0, strict=False)
  _validate.int_at_least(fn, "restarts", restarts, low=1)  # memory: below
  _validate.int_between(fn, "adam_steps", adam_steps, low=0, high=MAX_STEPS)
  _validate.int_between(fn, "lm_steps", lm_steps, low=0, high=MAX_STEPS)


def _check_memory(fn: str, families, task: ridge.Task, layers: int,
                  loops: int, candidates: int, restarts: int) -> None:
  """The Levenberg–Marquardt Jacobians of every restart and candidate,
  ``[restarts, candidates, layers B Q, params]``, must fit in memory."""
  B, Q = task.x_query.shape[:2]
  d = task.x.shape[-1]
  params = max(f.n_params(d=d, loops=loops) for f in families)
  _validate.fits_memory(fn, _validate.array_bytes(
      task.x.dtype, (restarts, candidates, layers * B * Q, params + 2)),
                        {"restarts": restarts, "candidates": candidates,
                         "fit_tasks.x.shape": tuple(task.x.shape)})


def _model_rows(fn: str, model: Model, task: ridge.Task) -> Array:
  """The model's compared predictions ``[S, B, Q]`` (layers 1.., or the final only).

  Any array-like the model returns (a list of ``[B, Q]`` rows, say) is read
  as ``jnp.asarray`` reads it.
  """
  B, Q = task.x_query.shape[:2]
  out = model(task)
  try:
    out = jnp.asarray(out)
  except (TypeError, ValueError):
    raise TypeError(f"{fn}: the model must return predictions [B, Q] or [S, "
                    f"B, Q] (an array or array-like), got "
                    f"{type(out).__name__}.") from None
  shape = out.shape
  if out.dtype != task.x.dtype:
    raise TypeError(f"{fn}: the model returns {out.dtype} predictions on "
                    f"{task.x.dtype} tasks; return the tasks' dtype (cast "
                    "inside the model, as from_model does).")
  if shape == (B, Q):
    return out[None]
  if len(shape) == 3 and shape[1:] == (B, Q) and shape[0] >= 2:
    return out[1:]
  raise ValueError(f"{fn}: the model must return [B, Q] = {[B, Q]} or [S >= 2, "
                   f"B, Q] predictions, got shape {shape}.")


def _comparable_rows(fn: str, name: str, rows) -> np.ndarray:
  """``rows [S, B, Q]`` on the host; ``ValueError`` naming the tasks (axis 1)
  where the model's predictions are NaN or infinite, or where all of them
  are zero: every disagreement is relative to their norm
  (``D = sum (f - g)^2 / sum g^2``), undefined at ``g = 0``."""
  rows = np.asarray(rows)
  bad = np.flatnonzero(~np.all(np.isfinite(rows), axis=(0, 2)))
  if bad.size:
    shown = ", ".join(map(str, bad[:10])) + (", ..." if bad.size > 10 else "")
    raise ValueError(f"{fn}: the model's predictions on {name} are not finite "
                     f"(NaN or inf) on {bad.size} of {rows.shape[1]} tasks "
                     f"(indices {shown}); no family can be compared with "
                     "them.")
  if not np.any(rows):
    raise ValueError(f"{fn}: the model's predictions on {name} are all zero "
                     "(every compared layer): the disagreement D is relative "
                     "to their norm, undefined here, and every family at a "
                     "step size -> 0 matches them; no family can be ranked.")
  return rows


def _steps(fn: str, iterations, layers: int) -> tuple[int, ...]:
  """The family's iterate held against each compared layer (cumulative counts)."""
  if isinstance(iterations, (int, np.integer)) and not isinstance(
      iterations, bool):
    per_layer = (_validate.int_at_least(fn, "iterations", iterations, low=1),
                 ) * layers
  else:
    if isinstance(iterations, (str, bytes)) or not isinstance(iterations,
                                                              Sequence):
      raise TypeError(f"{fn}: iterations must be an int or one int per "
                      f"compared layer ({layers}), got {iterations!r}.")
    per_layer = tuple(_validate.int_at_least(fn, "iterations[i]", k, low=1)
                      for k in iterations)
    if len(per_layer) != layers:
      raise ValueError(f"{fn}: iterations must be an int or one int per "
                       f"compared layer ({layers}), got {iterations!r}.")
  return tuple(int(s) for s in np.cumsum(per_layer))


def _mean_top_eigenvalue(task: ridge.Task, lam) -> Array:
  return jnp.mean(algorithms.eigen_bounds(task.x, lam=lam)[1])


def _first_step(task: ridge.Task, first: Array, iterations: Array) -> Array:
  r"""The GD step size that the model's first compared layer suggests.

  GD's iterate ``k`` from ``w = 0`` is ``k eta b`` to first order in ``eta``
  (exactly at ``k = 1``), ``b = X^T y / N``: the least-squares ``eta`` of
  ``first [B, Q] ~ iterations eta X_q b``,

  .. math::
    \hat\eta = \frac{\langle g_1, X_q b\rangle}{k \, \|X_q b\|^2},

  the scale of every step-size start (:meth:`Parameter.start`). NaN or
  negative where the layer is nothing like a GD step.
  """
  b = jnp.einsum("bnd,bn->bd", task.x, task.y,
                 precision="highest") / task.x.shape[-2]
  p = jnp.einsum("bqd,bd->bq", task.x_query, b, precision="highest")
  return jnp.sum(first * p) / (iterations * jnp.sum(p * p))


# XLA's backend optimisations at level 0, for what a decompilation compiles
# once and runs a few times: on CPU they halve the compile time of a family's
# fit (3.2 s against 6.2 s) and double its run time (0.9 s against 0.4 s),
# one measurement on 2 shared cores; compiling dominates. The same for the
# model's evaluation (each model compiles its own).
QUICK_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnames=("family", "loops", "restarts",
                                             "adam_steps", "lm_steps"),
                   compiler_options=QUICK_COMPILE)
def _fit_and_judge(family: Family, task: ridge.Task, target: Array,
                   rows: Array, compared: Array, key: Array, lam,
                   test_task: ridge.Task, probes: Array, *, loops: int,
                   restarts: int, adam_steps: int, lm_steps: int):
  """Fits ``family`` from ``restarts`` random starts at each candidate
  alignment, and evaluates the best fit on the test tasks: one compilation.

  ``target [S, B, Q]``: the model's predictions at the compared layers;
  ``rows [C, S]`` (traced ints): per candidate, the family's iterate held
  against each layer, all ``<= loops``; ``compared [S]`` (traced bools): the
  layers that count, the first ones (the others pad ``S`` to a shape shared
  by models of other depths: they add nothing to the loss, and the outputs
  are read at the last compared row). The candidate with the lowest loss
  (the first within a relative 1e-6 of it) is the fit. The step-size
  starts are scaled per candidate by the GD step its first row suggests
  (:func:`_first_step`). Returns ``(values,
  candidate, losses [C], outputs)``, ``outputs`` from :func:`_outputs` on
  ``test_task``.

  Iterates past a candidate's last row may overflow (Newton–Schulz squares
  its residual); the Jacobians are forward-mode, whose tangents of a row
  depend on earlier iterates only, and Adam's NaN gradients are zeroed.
  """
  d = task.x.shape[-1]
  mu = _mean_top_eigenvalue(task, lam)
  scale = jnp.sqrt(jnp.sum(target ** 2))

  def residual(u, rows):
    f = family.predict(family.values(u, mu, d), task, loops=loops, lam=lam)
    # where, not a product: a padding row may overflow (inf * 0 is NaN).
    return jnp.where(compared[:, None, None], (f[rows] - target) / scale,
                     0).ravel()

  def loss(u, rows):
    value = jnp.sum(residual(u, rows) ** 2)
    return jnp.where(jnp.isfinite(value), value, jnp.inf)

  def start(k, rows):
    keys = jax.random.split(k, len(family.parameters))
    step = _first_step(task, target[0], rows[0]) * mu
    return {p.name: p.start(kp, mu, d, loops, step)
            for p, kp in zip(family.parameters, keys)}

  tx = optax.chain(optax.zero_nans(), optax.clip_by_global_norm(1.0),
                   optax.adam(0.05))

  def adam(u, rows):
    def step(carry, _):
      u, state = carry
      updates, state = tx.update(jax.grad(loss)(u, rows), state, u)
      return (optax.apply_updates(u, updates), state), None
    return jax.lax.scan(step, (u, tx.init(u)), None, length=adam_steps)[0][0]

  def levenberg_marquardt(u, rows):
    # Each step evaluates the residual and its Jacobian at the trial point
    # only (one trace of the program): the trial is accepted if it lowers
    # the loss, and the next trial is proposed from the best point so far.
    flat, unravel = ravel_pytree(u)
    both = lambda v: (residual(unravel(v), rows),) * 2
    linearise = lambda v: jax.jacfwd(both, has_aux=True)(v)[::-1]

    def propose(v, r, jac, damping):
      gram = jac.T @ jac
      lhs = gram + damping * (jnp.diag(jnp.diag(gram)) + 1e-12 * jnp.eye(
          v.size, dtype=v.dtype))
      return v - jnp.linalg.solve(lhs, jac.T @ r)

    def step(carry, _):
      best, r_best, jac_best, damping, trial = carry
      r, jac = linearise(trial)
      current, new = jnp.sum(r_best ** 2), jnp.sum(r ** 2)
      better = jnp.isfinite(new) & (new < current)
      pick = lambda a, b: jnp.where(better, a, b)
      best, r_best, jac_best = (pick(trial, best), pick(r, r_best),
                                pick(jac, jac_best))
      damping = pick(damping / 3, damping * 4)
      return (best, r_best, jac_best, damping,
              propose(best, r_best, jac_best, damping)), None
    size = math.prod(target.shape)
    # The start is the first trial: an infinite "best" accepts it.
    carry = (flat, jnp.full((size,), jnp.inf, flat.dtype),
             jnp.zeros((size, flat.size), flat.dtype),
             jnp.asarray(3e-3, flat.dtype), flat)
    return unravel(jax.lax.scan(step, carry, None, length=lm_steps)[0][0])

  def one(k, rows):
    u = start(k, rows)
    if adam_steps:  # static: without Adam its gradient is not even traced
      u = adam(u, rows)
    u = levenberg_marquardt(u, rows)
    return u, loss(u, rows)

  keys = jax.random.split(key, restarts)
  per_candidate = lambda rows: jax.vmap(lambda k: one(k, rows))(keys)
  u, losses = jax.vmap(per_candidate)(rows)
  restart = jnp.argmin(losses, axis=1)
  per_candidate = jnp.min(losses, axis=1)
  candidate = jnp.argmax(per_candidate <= jnp.min(per_candidate) * (1 + 1e-6))
  u = jax.tree.map(lambda a: a[candidate, restart[candidate]], u)
  values = family.values(u, mu, d)
  last = rows[candidate][jnp.sum(compared) - 1]
  return (values, candidate, per_candidate,
          _outputs(family, values, test_task, probes, rows[candidate], last,
                   lam, loops=loops))


def _outputs(family: Family, values: dict, task: ridge.Task, probes: Array,
             rows: Array, last: Array, lam, *, loops: int):
  """The family's predictions at ``rows`` ``[S, B, Q]``, the sensitivity of
  its row ``last`` ``[B, Q, d]`` (forward-mode, per task) and that row's
  predictions on the probe queries ``[K, B, Q]``."""
  final = lambda t: family.predict(values, t, loops=loops, lam=lam)[last]
  one_task = lambda t: jax.jacfwd(
      lambda xq: jnp.sum(final(t._replace(x_query=xq))))(t.x_query)
  return (family.predict(values, task, loops=loops, lam=lam)[rows],
          jax.vmap(one_task)(task),
          jax.vmap(lambda xq: final(task._replace(x_query=xq)))(probes))


@dataclasses.dataclass(frozen=True)
class Fit:
  """A family fitted to a model.

  Attributes:
    family: the family's name.
    iterations: the family's iterations per compared layer of the model.
    params: ``{name: numpy array}``, the fitted values (and derived ones).
    disagreement: ``D`` on the evaluation tasks (held-out in
      :func:`identify`): pooled relative squared prediction error over the
      compared layers.
    equivalent: exactly equal descriptions (other families, parameters, GD
      steps); empty if none.
    metrics: ``disagreement_se``, ``disagreement_per_layer``,
      ``final_disagreement``, ``fit_disagreement`` (on the fit tasks),
      ``spd``, ``ilwd``, ``sensitivity_cosine``, ``sensitivity_l2`` (each
      with ``_se``, the standard error over tasks), ``n_params``.
    lam: the ridge strength the family ran at.
  """

  family: str
  iterations: tuple[int, ...]
  params: dict[str, np.ndarray]
  disagreement: float
  equivalent: tuple[dict, ...]
  metrics: dict[str, Any]
  lam: float

  @property
  def n_params(self) -> int:
    return self.metrics["n_params"]

  def predict(self, task: ridge.Task, *, loops: int | None = None) -> Array:
    """The fitted family's iterates ``[loops + 1, B, Q]`` on ``task``
    (default: as many as the fit compared; a schedule is only that long)."""
    loops = int(np.sum(self.iterations)) if loops is None else loops
    family = FAMILIES[self.family]
    values = {p.name: jnp.asarray(self.params[p.name], task.x.dtype)
              for p in family.parameters}
    return family.predict(values, task, loops=loops, lam=self.lam)

  def as_dict(self) -> dict:
    """JSON-ready (arrays as lists)."""
    return _plain(dataclasses.asdict(self))


def _plain(obj):
  if isinstance(obj, dict):
    return {str(k): _plain(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_plain(v) for v in obj]
  if isinstance(obj, (np.ndarray, jax.Array, np.generic)):
    return np.asarray(obj).tolist()
  return obj


def _probes(key: Array, task: ridge.Task) -> Array:
  """Probe queries ``[K, B, Q, d]``, ``K Q >= 2 d``, with the inputs' RMS scale."""
  B, Q, d = task.x_query.shape
  count = -(-2 * d // Q)
  rms = jnp.sqrt(jnp.mean(task.x ** 2))
  return rms * jax.random.normal(key, (count, B, Q, d), task.x.dtype)


def _implicit_weights(probes: Array, preds: Array) -> np.ndarray:
  """Least-squares ``w [B, d]`` with ``probe^T w ~ pred`` (probes ``[K, B, Q, d]``)."""
  K, B, Q, d = probes.shape
  a = np.moveaxis(np.asarray(probes, np.float64), 0, 1).reshape(B, K * Q, d)
  b = np.moveaxis(np.asarray(preds, np.float64), 0, 1).reshape(B, K * Q)
  return np.stack([np.linalg.lstsq(ai, bi, rcond=None)[0]
                   for ai, bi in zip(a, b)])


@dataclasses.dataclass(frozen=True)
class _Reference:
  """What the model does on the evaluation tasks (computed once per call)."""

  task: ridge.Task
  rows: np.ndarray         # [S, B, Q]
  sensitivity: np.ndarray  # [B, Q, d]
  probes: Array            # [K, B, Q, d]
  weights: np.ndarray      # [B, d]


def _layers(fn: str, model: Model, task: ridge.Task) -> int:
  """How many layers the model's rows compare (traced, not run)."""
  return jax.eval_shape(lambda t: _model_rows(fn, model, t), task).shape[0]


def _evaluate(fn: str, model: Model, fit_task: ridge.Task,
              task: ridge.Task, key: Array) -> tuple[Array, _Reference]:
  """The model's compared rows on the fit tasks, and what it does on the
  evaluation tasks: one compilation of the model (and the probes) per call."""

  def outputs(fit_task, task, key):
    final = lambda t: _model_rows(fn, model, t)[-1]
    probes = _probes(key, task)
    return (_model_rows(fn, model, fit_task), _model_rows(fn, model, task),
            training.query_sensitivity(final, task), probes,
            jax.vmap(lambda xq: final(task._replace(x_query=xq)))(probes))
  fit_rows, rows, sens, probes, probe_preds = jax.jit(
      outputs, compiler_options=QUICK_COMPILE)(fit_task, task, key)
  _comparable_rows(fn, "fit_tasks", fit_rows)
  rows = _comparable_rows(fn, "test_tasks", rows)
  return fit_rows, _Reference(task, np.asarray(rows, np.float64),
                              np.asarray(sens, np.float64), probes,
                              _implicit_weights(probes, probe_preds))


def _stat(per_task: np.ndarray) -> tuple[float, float]:
  return (float(per_task.mean()),
          float(per_task.std(ddof=1) / np.sqrt(per_task.size))
          if per_task.size > 1 else float("nan"))


def _judge(outputs, ref: _Reference) -> dict:
  """Every metric of a fitted family's ``outputs`` against the model on ``ref``'s tasks."""
  f, sens, probe_preds = (np.asarray(a, np.float64) for a in outputs)
  g = ref.rows
  per_task = np.mean((f - g) ** 2, axis=(0, 2)) / np.mean(g ** 2)
  out = {}
  out["disagreement"], out["disagreement_se"] = _stat(per_task)
  out["disagreement_per_layer"] = (np.mean((f - g) ** 2, axis=(1, 2)) /
                                   np.mean(g ** 2, axis=(1, 2))).tolist()
  out["final_disagreement"] = out["disagreement_per_layer"][-1]
  out["spd"], out["spd_se"] = _stat(np.mean((f[-1] - g[-1]) ** 2, axis=-1))
  w = _implicit_weights(ref.probes, probe_preds)
  out["ilwd"], out["ilwd_se"] = _stat(np.sum((w - ref.weights) ** 2, axis=-1))
  cos, rel = training.sensitivity_agreement(sens, ref.sensitivity)
  out["sensitivity_cosine"], out["sensitivity_cosine_se"] = _stat(
      np.asarray(cos))
  out["sensitivity_l2"], out["sensitivity_l2_se"] = _stat(np.asarray(rel))
  return out


def _padded(candidates: list[tuple[int, ...]], layers: int
            ) -> list[tuple[int, ...]]:
  """Each candidate's rows continued to ``layers`` at its last layer's count:
  ``(1, 2)`` to 4 layers is ``(1, 2, 3, 4)``. Integer candidates ``k`` of
  models of any depth then run to one length, ``k`` times ``layers``."""
  return [c + tuple(c[-1] + (c[-1] - (c[-2] if len(c) > 1 else 0)) * i
                    for i in range(1, layers - len(c) + 1))
          for c in candidates]


def _fit_family(family: Family, model_rows: Array, fit_task: ridge.Task,
                candidates: list[tuple[int, ...]], ref: _Reference, *, lam,
                key, restarts: int, adam_steps: int, lm_steps: int,
                pad_layers: int | None = None) -> Fit:
  """``family`` fitted at every candidate alignment, judged on ``ref``;
  compiled for ``pad_layers`` compared layers (default the model's)."""
  layers = model_rows.shape[0]
  padded = _padded(candidates, pad_layers or layers)
  loops, d = max(c[-1] for c in padded), fit_task.x.shape[-1]
  dtype = fit_task.x.dtype
  extra = len(padded[0]) - layers
  values, pick, losses, outputs = _fit_and_judge(
      family, fit_task, jnp.pad(model_rows, [(0, extra), (0, 0), (0, 0)]),
      jnp.asarray(padded), jnp.arange(layers + extra) < layers, key,
      jnp.asarray(lam, dtype), ref.task._replace(
          x=ref.task.x.astype(dtype), y=ref.task.y.astype(dtype),
          x_query=ref.task.x_query.astype(dtype)),
      ref.probes.astype(dtype), loops=loops, restarts=restarts,
      adam_steps=adam_steps, lm_steps=lm_steps)
  steps = candidates[int(pick)]
  metrics = _judge((outputs[0][:layers], *outputs[1:]), ref)
  disagreement = metrics.pop("disagreement")
  metrics["fit_disagreement"] = float(losses[int(pick)])
  metrics["n_params"] = family.n_params(d=d, loops=steps[-1])
  plain = {p.name: np.asarray(values[p.name])[:steps[-1]]
           if p.kind == "schedule" else np.asarray(values[p.name])
           for p in family.parameters}
  if family.derived is not None:
    plain.update({k: np.asarray(v)
                  for k, v in family.derived(values, steps[-1]).items()})
  equivalent = () if family.equivalent is None else tuple(
      _plain(family.equivalent(plain, steps)))
  per_layer = tuple(int(s) for s in np.diff((0,) + steps))
  return Fit(family.name, per_layer, plain, disagreement, equivalent, metrics,
             float(lam))


def fit(model: Model, family: Family, fit_tasks: ridge.Task, *,
        iterations=1, test_tasks: ridge.Task | None = None, lam=0.0,
        key: Array | None = None, restarts: int = 8, adam_steps: int = 0,
        lm_steps: int = 20) -> Fit:
  """``family``'s parameters that reproduce ``model``'s predictions at every compared layer.

  Args:
    model: ``task -> [B, Q]`` or ``[S, B, Q]`` (rows ``1..S-1`` compared), in
      the tasks' dtype, an array or array-like (``jnp.asarray``).
    family: an entry of :data:`FAMILIES`.
    fit_tasks: the tasks the parameters are fitted on (float32 or float64).
    iterations: the family's iterations per compared layer: an int (the same
      for every layer) or one int per layer; for a final-only model, the
      total.
    test_tasks: the tasks the returned metrics are measured on (default the
      fit tasks: then nothing is held out), of the fit tasks' ``d`` and dtype.
    lam: the ridge strength the family runs at (``>= 0``).
    key: of the random starts (default ``jax.random.key(0)``).
    restarts, adam_steps, lm_steps: random starts (vmapped, ``>= 1``), Adam
      steps, then Levenberg–Marquardt steps (``>= 0``), each at most
      :data:`MAX_STEPS`. Adam is off by default: Levenberg–Marquardt alone
      reaches the controls' exact fits and, on trained stacks, the held-out
      ``D`` that Adam first reached, to a few percent; without it its
      gradient is neither compiled nor run (docs/guides/decompile.md, "A
      minute per stack").

  Returns:
    the :class:`Fit`, its metrics on ``test_tasks``.

  Raises:
    TypeError: a wrong type or dtype (tasks not float32/float64 or of two
      dtypes, predictions of another dtype than the tasks' or not
      array-like).
    ValueError: a bad value, tasks of different ``d``, predictions that are
      not finite (naming the tasks) or all zero (``D`` is relative to their
      norm), or a request larger than memory.
  """
  fn = "decompile.fit"
  if not isinstance(family, Family):
    raise TypeError(f"{fn}: family must be a decompile.Family (an entry of "
                    f"FAMILIES), got {type(family).__name__}.")
  _check_task(fn, "fit_tasks", fit_tasks)
  if test_tasks is not None:
    _check_pair(fn, fit_tasks, test_tasks)
  test_tasks = fit_tasks if test_tasks is None else test_tasks
  _check_optimiser(fn, lam=lam, restarts=restarts, adam_steps=adam_steps,
                   lm_steps=lm_steps)
  key = jax.random.key(0) if key is None else key
  layers = _layers(fn, model, fit_tasks)
  steps = _steps(fn, iterations, layers)
  _check_memory(fn, [family], fit_tasks, layers, steps[-1], 1, restarts)
  rows, ref = _evaluate(fn, model, fit_tasks, test_tasks,
                        jax.random.fold_in(key, 1))
  return _fit_family(family, rows, fit_tasks, [steps], ref, lam=lam, key=key,
                     restarts=restarts, adam_steps=adam_steps,
                     lm_steps=lm_steps)


def _in_threads(fn, items: Sequence) -> list:
  """``[fn(item) for item in items]``, on as many threads as there are cores.

  Each family's fit is traced (Python, under the GIL), compiled and run
  (XLA, which releases it): on threads, one family compiles or runs while the
  next is traced, and two compile at once on two cores. JAX's configuration
  contexts are per thread, so this thread's 64-bit mode and matmul
  precision (a caller's ``jax.enable_x64(True)``) are set in each.
  """
  workers = min(len(items), os.cpu_count() or 1)
  if workers <= 1:
    return [fn(item) for item in items]
  x64 = jax.config.jax_enable_x64
  precision = jax.config.jax_default_matmul_precision

  def call(item):
    with jax.enable_x64(x64), jax.default_matmul_precision(precision):
      return fn(item)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(call, items))


@dataclasses.dataclass(frozen=True)
class Closest:
  """The family nearest the model, whether or not it is within tolerance.

  Attributes:
    family: the lowest held-out ``D`` (among ties, exact ``D <=``
      :data:`EXACT` or within a relative :data:`TIE`, the simplest: fewest
      parameters, then the order of :data:`FAMILIES`).
    disagreement: its ``D``.
    runner_up: the next family (``None`` if only one was fitted).
    vs_runner_up: ``D(runner_up) / D(family)``: how many times closer.
    vs_gd: ``D(gd) / D(family)`` against constant-step GD (``None`` if
      ``"gd"`` was not fitted; 1 if it is GD).
  """

  family: str
  disagreement: float
  runner_up: str | None
  vs_runner_up: float | None
  vs_gd: float | None


def _ratio(above: float, below: float) -> float:
  return float(above / below) if below > 0 else (
      1.0 if above == below else float("inf"))


def _rank(fits: list[Fit]) -> list[Fit]:
  """By held-out ``D`` (NaN last); tied fits (all ``D <=`` :data:`EXACT`, or
  within a relative :data:`TIE` of the first of their group) simplest first:
  fewest parameters, then the order of :data:`FAMILIES`."""
  order = {name: i for i, name in enumerate(FAMILIES)}
  groups = []  # [(D of the group's first fit, [fits])]
  for f in sorted(fits, key=lambda f: np.nan_to_num(f.disagreement,
                                                    nan=np.inf)):
    d = float(np.nan_to_num(f.disagreement, nan=np.inf))
    if groups and (d <= max(EXACT, groups[-1][0] * (1 + TIE))):
      groups[-1][1].append(f)
    else:
      groups.append((d, [f]))
  return [f for _, group in groups
          for f in sorted(group, key=lambda f: (f.n_params, order[f.family]))]


def _closest(ranked: list[Fit]) -> Closest:
  first = ranked[0]
  second = ranked[1] if len(ranked) > 1 else None
  gd = next((f for f in ranked if f.family == "gd"), None)
  return Closest(first.family, first.disagreement,
                 None if second is None else second.family,
                 None if second is None else _ratio(second.disagreement,
                                                    first.disagreement),
                 None if gd is None else _ratio(gd.disagreement,
                                                first.disagreement))


@dataclasses.dataclass(frozen=True)
class Report:
  """What :func:`identify` found.

  Attributes:
    fits: every family fitted, ranked by held-out disagreement (tied fits,
      see :func:`_rank`, in the order of simplicity).
    best: the simplest fit within ``tol`` (fewest free parameters; then the
      lowest disagreement, ties in the order of :data:`FAMILIES`); ``None``:
      no family within tolerance.
    ties: names of the other fits within ``tol`` with as few parameters.
    tol: the tolerance on the held-out disagreement.
    closest: always the nearest family (:class:`Closest`), with how many
      times closer it is than the runner-up and than constant-step GD: what
      to read when ``best`` is ``None``.
  """

  fits: tuple[Fit, ...]
  best: Fit | None
  ties: tuple[str, ...]
  tol: float
  closest: Closest | None = None

  def as_dict(self) -> dict:
    return {"best": None if self.best is None else self.best.family,
            "ties": list(self.ties), "tol": self.tol,
            "closest": (None if self.closest is None
                        else dataclasses.asdict(self.closest)),
            "fits": [f.as_dict() for f in self.fits]}


def identify(model: Model, fit_tasks: ridge.Task, test_tasks: ridge.Task, *,
             families: Sequence[str] | None = None, tol: float = 1e-3,
             lam=0.0, iterations: Sequence = (1, 2), key: Array | None = None,
             restarts: int = 8, adam_steps: int = 0, lm_steps: int = 20,
             pad_layers: int | None = None) -> Report:
  """Fits every family to ``model`` on ``fit_tasks`` and ranks them on ``test_tasks``.

  Each family is fitted at each candidate of ``iterations`` (an int per
  layer, or a per-layer tuple); the candidate with the lowest fit-task loss is
  the family's (the smaller on a tie). Ranking, ``best`` and ``closest`` use
  only the held-out tasks.

  Args:
    model: ``task -> [B, Q]`` or ``[S, B, Q]``, in the tasks' dtype.
    fit_tasks, test_tasks: disjoint task batches of one ``d`` and dtype
      (float32 or float64); the same tasks twice, or tasks of different
      ``N`` or ``Q``, are warned about.
    families: names in :data:`FAMILIES` (default all).
    tol: the largest held-out disagreement ``D`` that counts as the same
      computation (``D`` is a squared relative error: 1e-3 is ~3% RMS).
    lam: the ridge strength the families run at (``>= 0``; ``gd_lam`` fits
      its own).
    iterations: candidates of the iterations per layer (an int: one
      candidate).
    key, restarts, adam_steps, lm_steps: as :func:`fit`.
    pad_layers: compile each family's fit for this many compared layers (at
      least the model's; default the model's): a loop over stacks of several
      depths passes the largest, and each family compiles once for all of
      them (about 3 s a family on CPU) instead of once a depth. The padding
      layers continue each candidate at its last layer's iterations and are
      masked out of the fit and the metrics; only a schedule's random start
      (drawn for the longer run) differs from an unpadded fit.

  Raises:
    TypeError, ValueError: as :func:`fit`.
  """
  fn = "decompile.identify"
  _check_pair(fn, fit_tasks, test_tasks)
  names = list(FAMILIES) if families is None else list(families)
  unknown = sorted(set(names) - set(FAMILIES))
  if unknown or not names:
    raise ValueError(f"{fn}: families must be names of FAMILIES "
                     f"{sorted(FAMILIES)}, got {names}.")
  _validate.at_least(fn, "tol", tol, low=0, strict=True)
  _check_optimiser(fn, lam=lam, restarts=restarts, adam_steps=adam_steps,
                   lm_steps=lm_steps)
  if isinstance(iterations, (int, np.integer)) and not isinstance(
      iterations, bool):
    iterations = (iterations,)
  if isinstance(iterations, (str, bytes)) or not isinstance(
      iterations, Sequence) or not iterations:
    raise TypeError(f"{fn}: iterations must be an int or a non-empty sequence "
                    f"of candidates, got {iterations!r}.")
  key = jax.random.key(0) if key is None else key
  layers = _layers(fn, model, fit_tasks)
  candidates = [_steps(fn, k, layers) for k in iterations]
  if pad_layers is not None and _validate.int_at_least(
      fn, "pad_layers", pad_layers, low=1) < layers:
    raise ValueError(f"{fn}: pad_layers={pad_layers} is fewer than the "
                     f"{layers} layers the model's predictions compare; pass "
                     f"at least {layers}, or None.")
  padded = _padded(candidates, pad_layers or layers)
  _check_memory(fn, [FAMILIES[n] for n in names], fit_tasks, len(padded[0]),
                max(c[-1] for c in padded), len(candidates), restarts)
  rows, ref = _evaluate(fn, model, fit_tasks, test_tasks,
                        jax.random.fold_in(key, 1))
  fits = _rank(_in_threads(lambda name: _fit_family(
      FAMILIES[name], rows, fit_tasks, candidates, ref, lam=lam, key=key,
      restarts=restarts, adam_steps=adam_steps, lm_steps=lm_steps,
      pad_layers=pad_layers), names))
  closest = _closest(fits)
  within = [f for f in fits if f.disagreement <= tol]
  if not within:
    return Report(tuple(fits), None, (), tol, closest)
  fewest = min(f.n_params for f in within)
  simplest = [f for f in within if f.n_params == fewest]  # ranked already
  return Report(tuple(fits), simplest[0],
                tuple(f.family for f in simplest[1:]), tol, closest)
