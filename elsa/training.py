r"""In-context training of ELSA/LSA stacks on ridge regression: tasks, loss, train step, evaluation.

The model reads the naturally enumerated tokens of a task
(:meth:`elsa.forms.Natural.encode`: examples ``(x_i, y_i)``, then queries
``(x_q, 0)``, then zero w-rows) and its prediction for query ``q`` is the
query's prediction slot after the last layer
(:meth:`elsa.forms.Natural.decode_pred`). The training objective is the mean
squared error over tasks and queries,

.. math::
  \ell(\theta) = \frac{1}{BQ} \sum_{b, q} \big(\hat y_{bq}(\theta) - y_{bq}\big)^2,

on fresh tasks every step: step ``s`` draws its batch from
``jax.random.fold_in(key, s)``, so a run is a pure function of ``key`` and a
resumed run sees exactly the batches an uninterrupted one would.

Everything here is pure and jit-able: a model enters as the split of an
:class:`elsa.nn.ElsaStack` (``graphdef``, the trainable ``nnx.Param`` state,
the rest), see :func:`split`. The baselines (GD at a step size, ridge, least
squares, the constructed ELSA-GD stack) answer the same question, predictions
``[B, Q]`` for a task batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from elsa import constructions, forms, nn, ridge
from elsa.attention import Array, ElsaParams, float_dtype

X_DISTRIBUTIONS = ("normal", "laplace", "exponential")
# E[z^2] of one standardised input coordinate z (before covariance and
# x_scale): 1 for the centred ones, mean^2 + variance = 2 for exponential.
_X_SECOND_MOMENT = {"normal": 1.0, "laplace": 1.0, "exponential": 2.0}


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """A distribution of ridge tasks; hashable, so it can be a static argument.

  Attributes:
    n_train, d, n_query: examples ``N``, input dimension, queries ``Q``.
    lam: the ridge strength of the tasks (used by the baselines).
    noise: label noise standard deviation.
    x_scale: inputs are multiplied by this (input range shift).
    w_scale: ``w_true`` standard deviation (weight scale shift).
    x_dist: ``'normal'`` (via :func:`elsa.ridge.sample_tasks`), ``'laplace'``
      (unit variance), or ``'exponential'`` (rate 1: mean 1, variance 1, not
      centred).
    x_skew: input covariance ``diag(c_j)``, ``c_j`` proportional to
      ``(j + 1) ** -x_skew`` and normalised to trace ``d``; 0 is isotropic.
    noise_labels: if true, the CONTEXT labels are replaced by independent
      normal noise with the clean labels' variance ``E[(x^T w_true +
      noise)^2] = w_scale^2 x_scale^2 mu_2 sum_j c_j + noise^2``, ``mu_2 =
      E[z^2]`` of one standardised input coordinate (1 for normal and
      laplace, 2 for exponential, which is not centred) and ``c_j`` the
      covariance diagonal :meth:`x_cov_diag` (the query labels stay ``x_q^T
      w_true + noise``).
  """

  n_train: int
  d: int
  n_query: int = 1
  lam: float = 0.05
  noise: float = 0.0
  x_scale: float = 1.0
  w_scale: float = 1.0
  x_dist: str = "normal"
  x_skew: float = 0.0
  noise_labels: bool = False

  def __post_init__(self):
    if self.x_dist not in X_DISTRIBUTIONS:
      raise ValueError(f"TaskSpec: x_dist must be one of {X_DISTRIBUTIONS}, "
                       f"got {self.x_dist!r}.")

  def form(self) -> forms.Natural:
    """The natural token form of these tasks (scalar targets)."""
    return forms.Natural(n_train=self.n_train, d=self.d, n_query=self.n_query)

  def x_cov_diag(self, dtype=None) -> Array:
    """The diagonal of the input covariance before ``x_scale``, ``[d]``.

    ``dtype``: default JAX's default float (float32, or float64 under
    ``jax_enable_x64``).
    """
    dtype = float_dtype(dtype)
    c = (jnp.arange(self.d, dtype=dtype) + 1) ** -jnp.asarray(self.x_skew, dtype)
    return c * self.d / c.sum()


def sample_tasks(key: Array, spec: TaskSpec, *, batch: int,
                 dtype=None) -> ridge.Task:
  """``batch`` tasks of ``spec``: ``x [B, N, d]``, ``y [B, N]``, ``x_query [B, Q, d]``...

  Normal inputs come from :func:`elsa.ridge.sample_tasks`; Laplace and
  exponential inputs are drawn here with the same scaling and labels.
  ``dtype``: default JAX's default float (float32, or float64 under
  ``jax_enable_x64``).
  """
  dtype = float_dtype(dtype)
  cov = spec.x_cov_diag(dtype)
  x_cov = None if spec.x_skew == 0 else jnp.diag(cov)
  task = ridge.sample_tasks(key, batch=batch, n_train=spec.n_train, d=spec.d,
                            n_query=spec.n_query, noise=spec.noise,
                            x_scale=spec.x_scale, w_scale=spec.w_scale,
                            x_cov=x_cov, dtype=dtype)
  k_x, k_q, k_n, k_nq, k_y = jax.random.split(jax.random.fold_in(key, 1), 5)
  if spec.x_dist != "normal":
    draw = {"laplace": lambda k, s: jax.random.laplace(k, s, dtype) / jnp.sqrt(
                jnp.asarray(2, dtype)),
            "exponential": lambda k, s: jax.random.exponential(k, s, dtype)
            }[spec.x_dist]
    scale = spec.x_scale * jnp.sqrt(cov)
    x = draw(k_x, (batch, spec.n_train, spec.d)) * scale
    x_query = draw(k_q, (batch, spec.n_query, spec.d)) * scale
    label = lambda xs, k: jnp.einsum("bnd,bd->bn", xs, task.w_true) + (
        spec.noise * jax.random.normal(k, xs.shape[:2], dtype))
    task = task._replace(x=x, y=label(x, k_n), x_query=x_query,
                         y_query=label(x_query, k_nq))
  if spec.noise_labels:
    second_moment = _X_SECOND_MOMENT[spec.x_dist] * cov.sum()
    std = jnp.sqrt(spec.w_scale**2 * spec.x_scale**2 * second_moment
                   + spec.noise**2)
    task = task._replace(y=std * jax.random.normal(k_y, task.y.shape, dtype))
  return task


def init_model(key: Array, spec: TaskSpec, *, depth: int, components: int = 3,
               inner: int | None = None, use_bias: bool = True,
               tied: bool = False, scale: float = 0.1,
               bias_scale: float | None = None, skip_init: bool = True,
               dtype=None) -> nn.ElsaStack:
  """A stack for the natural tokens of ``spec``: leaves ``[depth, components, ...]``.

  Args:
    key: ``jax.random`` key of the random parameters.
    spec: the tasks; fixes ``m`` and ``n`` through :meth:`TaskSpec.form`.
    depth, components: ``L`` and ``C``.
    inner: inner width ``k``; default ``n`` (what the GD construction uses).
    use_bias: ELSA (true) or LSA (false).
    tied: one layer's parameters looped ``depth`` times.
    scale, bias_scale: standard deviations of the random weights and biases.
    skip_init: start component 0 of every layer at the exact skip ``h -> h``
      (:func:`elsa.constructions.linear` with ``P = I``, needs biases and
      ``inner >= n``), so a deep stack starts near the identity instead of a
      random cubic of degree ``3^L``. It is an initial value, not a constraint.
    dtype: floating dtype of the parameters; default JAX's default float
      (float32, or float64 under ``jax_enable_x64``).
  """
  dtype = float_dtype(dtype)
  form = spec.form()
  m, n = form.m, form.n
  inner = n if inner is None else inner
  params = ElsaParams.init(key, m=m, n=n, k=inner, lead=(1 if tied else depth,
                                                   components),
                     scale=scale, bias_scale=bias_scale, dtype=dtype)
  if skip_init:
    if not use_bias or inner < n:
      raise ValueError(f"init_model: skip_init needs use_bias=True and inner >= "
                       f"n={n}, got use_bias={use_bias}, inner={inner}.")
    skip = constructions.pad_inner(constructions.identity(m, n, dtype=dtype),
                                   inner)
    params = jax.tree.map(lambda p, s: p.at[:, 0].set(s), params, skip)
  return nn.ElsaStack(params, tied=tied, depth=depth, use_bias=use_bias)


# --- the model as a pure function ----------------------------------------------


class Split(NamedTuple):
  """A module split for pure training: ``merge(graphdef, params, rest)``."""

  graphdef: Any
  params: nnx.State
  rest: nnx.State


def split(model: nn.ElsaStack) -> Split:
  """Splits ``model`` into its structure, trainable ``nnx.Param`` state, the rest."""
  return Split(*nnx.split(model, nnx.Param, ...))


def merge(graphdef, params: nnx.State, rest: nnx.State) -> nn.ElsaStack:
  """The module back from :func:`split` (with possibly updated ``params``)."""
  return nnx.merge(graphdef, params, rest)


def model_predict(model: Callable[[Array], Array], form: forms.GDForm,
                  task: ridge.Task) -> Array:
  """A token model's query predictions ``[B, Q]``: decode_pred(model(encode(task)))."""
  h0 = form.encode(task.x, task.y, x_query=task.x_query)
  return form.decode_pred(model(h0))


def mse(pred: Array, task: ridge.Task) -> Array:
  """Squared error per task, mean over queries: ``[B]``."""
  return jnp.mean((pred - task.y_query) ** 2, axis=-1)


def loss(params: nnx.State, task: ridge.Task, *, graphdef, rest: nnx.State,
         form: forms.GDForm) -> Array:
  """The training loss: MSE over tasks and queries (a scalar)."""
  model = merge(graphdef, params, rest)
  return jnp.mean(mse(model_predict(model, form, task), task))


def optimizer(*, learning_rate: float, steps: int, warmup_steps: int = 0,
              end_fraction: float = 0.01, clip_norm: float | None = 1.0,
              weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Adam(W) with global-norm clipping and a warmup-cosine schedule.

  The learning rate rises linearly from 0 over ``warmup_steps`` then decays
  by a cosine to ``end_fraction * learning_rate`` at ``steps``.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=max(steps, warmup_steps + 1),
      end_value=end_fraction * learning_rate)
  parts = [] if clip_norm is None else [optax.clip_by_global_norm(clip_norm)]
  parts.append(optax.adamw(schedule, weight_decay=weight_decay))
  return optax.chain(*parts)


class TrainState(NamedTuple):
  """What a train step carries: the trainable state, optimiser state, step count."""

  params: nnx.State
  opt_state: Any
  step: Array


def init_state(params: nnx.State, tx: optax.GradientTransformation
               ) -> TrainState:
  return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "tx", "batch"))
def train_step(state: TrainState, key: Array, *, graphdef, rest: nnx.State,
               spec: TaskSpec, tx: optax.GradientTransformation, batch: int
               ) -> tuple[TrainState, Array]:
  """One optimiser step on fresh tasks from ``fold_in(key, state.step)``.

  Returns:
    the new state and the loss on this step's batch (before the update).
  """
  dtype = jax.tree.leaves(state.params)[0].dtype
  task = sample_tasks(jax.random.fold_in(key, state.step), spec, batch=batch,
                      dtype=dtype)
  value, grads = jax.value_and_grad(loss)(state.params, task, graphdef=graphdef,
                                          rest=rest, form=spec.form())
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return TrainState(params, opt_state, state.step + 1), value


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "tx", "batch",
                                             "steps"))
def train_steps(state: TrainState, key: Array, *, graphdef, rest: nnx.State,
                spec: TaskSpec, tx: optax.GradientTransformation, batch: int,
                steps: int) -> tuple[TrainState, Array]:
  """``steps`` train steps in one compiled scan; returns the state and losses ``[steps]``."""
  def body(state, _):
    return train_step(state, key, graphdef=graphdef, rest=rest, spec=spec,
                      tx=tx, batch=batch)
  return jax.lax.scan(body, state, None, length=steps)


# --- baselines: predictions [B, Q] from the same tasks -------------------------


def gd_predict(task: ridge.Task, *, lam, eta, steps: int) -> Array:
  """Predictions ``x_q^T w_steps`` of ridge GD from ``w0 = 0``: ``[B, Q]``."""
  w = ridge.gd(task.x, task.y, lam=lam, eta=eta, steps=steps)[-1]
  return jnp.einsum("bqd,bd->bq", task.x_query, w)


def ridge_predict(task: ridge.Task, *, lam) -> Array:
  """Predictions of the ridge minimiser: ``[B, Q]``."""
  return jnp.einsum("bqd,bd->bq", task.x_query,
                    ridge.solve(task.x, task.y, lam=lam))


def least_squares_predict(task: ridge.Task) -> Array:
  """Predictions of (minimum-norm) least squares, ``lam = 0``: ``[B, Q]``."""
  return ridge_predict(task, lam=0.0)


def constructed_gd_predict(task: ridge.Task, spec: TaskSpec, *, eta,
                           depth: int) -> Array:
  """Predictions of the constructed ELSA-GD stack (``Natural.gd_params``): ``[B, Q]``."""
  form = spec.form()
  params = form.gd_params(lam=spec.lam, eta=eta, depth=depth,
                          dtype=task.x.dtype)
  return model_predict(nn.ElsaStack.from_params(params), form, task)


def gd_eta_grid_losses(task: ridge.Task, *, lam, etas: Array, steps: int
                       ) -> Array:
  """Mean test MSE of GD at each step size of ``etas [E]``: ``[E]``."""
  per_eta = lambda eta: jnp.mean(mse(gd_predict(task, lam=lam, eta=eta,
                                                steps=steps), task))
  return jax.lax.map(per_eta, etas)


def query_sensitivity(predict: Callable[[ridge.Task], Array], task: ridge.Task
                      ) -> Array:
  """``d (sum_q' prediction_q') / d x_q`` per task and query: ``[B, Q, d]``.

  With ``Q == 1``, or for GD (whose queries do not interact), this is
  ``d prediction_q / d x_q``; a trained model may let queries interact, and
  then this sums the column of the Jacobian.
  """
  def summed(x_query):
    return jnp.sum(predict(task._replace(x_query=x_query)))
  return jax.grad(summed)(task.x_query)
