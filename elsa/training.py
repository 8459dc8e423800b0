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
the rest), see :func:`split`. The baselines (the Bayes-optimal posterior
mean, GD at a step size, ridge, least squares, the constructed ELSA-GD stack)
answer the same question, predictions ``[B, Q]`` for a task batch.

A grid of training settings (learning rate x initial scale) trains as one
compiled program (:func:`grid_init_state`, :func:`train_grid_steps`): the
learning rate is a traced hyper-parameter of the optimiser state
(``optax.inject_hyperparams``), so every grid point sees the same batches and
the grid compiles once.

What trained layers compute (von Oswald et al. 2023, section 3): the query
prediction decoded after every layer (:func:`layer_predictions`), against GD
step ``t`` (:func:`gd_step_predictions`), and the agreement of input
sensitivities ``d pred / d x_q`` (:func:`query_sensitivity`,
:func:`sensitivity_agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from elsa import _validate, constructions, forms, nn, ridge
from elsa.attention import Array, ElsaParams, float_dtype

X_DISTRIBUTIONS = ("normal", "laplace", "exponential", "uniform")
TOKENS = ("natural", "concatenated")
# E[z^2] of one standardised input coordinate z (before covariance and
# x_scale): 1 for the centred ones, mean^2 + variance = 2 for exponential.
_X_SECOND_MOMENT = {"normal": 1.0, "laplace": 1.0, "exponential": 2.0,
                    "uniform": 1.0}


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
      (unit variance), ``'exponential'`` (rate 1: mean 1, variance 1, not
      centred) or ``'uniform'`` (unit variance, ``U(-sqrt 3, sqrt 3)``;
      ``x_scale = 12 ** -0.5`` gives von Oswald et al.'s ``U(-1/2, 1/2)``).
    x_skew: input covariance ``diag(c_j)``, ``c_j`` proportional to
      ``(j + 1) ** -x_skew`` and normalised to trace ``d``; 0 is isotropic.
    tokens: the trained models' token layout: ``'natural'``
      (:class:`elsa.forms.Natural`, also the constructed ELSA-GD stack's) or
      ``'concatenated'`` (:class:`ConcatenatedTokens`, von Oswald et al.'s).
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
  tokens: str = "natural"

  def __post_init__(self):
    if self.x_dist not in X_DISTRIBUTIONS:
      raise ValueError(f"TaskSpec: x_dist must be one of {X_DISTRIBUTIONS}, "
                       f"got {self.x_dist!r}.")
    if self.tokens not in TOKENS:
      raise ValueError(f"TaskSpec: tokens must be one of {TOKENS}, got "
                       f"{self.tokens!r}.")

  def form(self) -> forms.Natural:
    """The natural token form of these tasks (scalar targets)."""
    return forms.Natural(n_train=self.n_train, d=self.d, n_query=self.n_query)

  def model_tokens(self) -> forms.Natural | ConcatenatedTokens:
    """The trained models' tokens (``encode``, ``decode_pred``, ``m``, ``n``)."""
    if self.tokens == "natural":
      return self.form()
    return ConcatenatedTokens(n_train=self.n_train, d=self.d,
                              n_query=self.n_query)

  def x_cov_diag(self, dtype=None) -> Array:
    """The diagonal of the input covariance before ``x_scale``, ``[d]``.

    ``dtype``: default JAX's default float (float32, or float64 under
    ``jax_enable_x64``).
    """
    dtype = float_dtype(dtype)
    c = (jnp.arange(self.d, dtype=dtype) + 1) ** -jnp.asarray(self.x_skew, dtype)
    return c * self.d / c.sum()


@dataclasses.dataclass(frozen=True)
class ConcatenatedTokens:
  """Von Oswald et al.'s tokens: ``(x_i, y_i)`` per example, then ``(x_q, 0)`` per query.

  ``m = N + Q`` rows, ``n = d + 1`` columns (``x``, then ``y``). The
  prediction for query ``q`` is minus its ``y`` entry after the last layer
  (their readout: GD moves ``y_q`` from 0 to ``-x_q^T w``). No GD
  construction here: these tokens are for trained models.
  """

  n_train: int
  d: int
  n_query: int = 1

  @property
  def m(self) -> int:
    return self.n_train + self.n_query

  @property
  def n(self) -> int:
    return self.d + 1

  def encode(self, x: Array, y: Array, *, x_query: Array) -> Array:
    """``x [..., N, d]``, ``y [..., N]``, ``x_query [..., Q, d]`` -> ``[..., m, n]``."""
    rows = lambda xs, ys: jnp.concatenate([xs, ys[..., None]], axis=-1)
    return jnp.concatenate(
        [rows(x, y), rows(x_query, jnp.zeros(x_query.shape[:-1], x.dtype))],
        axis=-2)

  def decode_pred(self, h: Array) -> Array:
    """``h [..., m, n]`` -> predictions ``[..., Q]``."""
    return -h[..., self.n_train:, self.d]


def sample_tasks(key: Array, spec: TaskSpec, *, batch: int,
                 dtype=None) -> ridge.Task:
  """``batch`` tasks of ``spec``: ``x [B, N, d]``, ``y [B, N]``, ``x_query [B, Q, d]``...

  Normal inputs come from :func:`elsa.ridge.sample_tasks`; Laplace and
  exponential inputs are drawn here with the same scaling and labels.
  ``dtype``: default JAX's default float (float32, or float64 under
  ``jax_enable_x64``).

  Raises:
    TypeError, ValueError: as :func:`elsa.ridge.sample_tasks` (sizes, a
      negative or non-finite noise, non-finite scales, a dtype that is not
      floating, tasks that cannot fit in memory), naming the field of
      ``spec``; checked before anything is allocated.
  """
  dtype = _check_tasks("sample_tasks", spec, batch, dtype)
  cov = spec.x_cov_diag(dtype)
  x_cov = None if spec.x_skew == 0 else jnp.diag(cov)
  task = ridge.sample_tasks(key, batch=batch, n_train=spec.n_train, d=spec.d,
                            n_query=spec.n_query, noise=spec.noise,
                            x_scale=spec.x_scale, w_scale=spec.w_scale,
                            x_cov=x_cov, dtype=dtype)
  k_x, k_q, k_n, k_nq, k_y = jax.random.split(jax.random.fold_in(key, 1), 5)
  if spec.x_dist != "normal":
    root3 = jnp.sqrt(jnp.asarray(3, dtype))
    draw = {"laplace": lambda k, s: jax.random.laplace(k, s, dtype) / jnp.sqrt(
                jnp.asarray(2, dtype)),
            "exponential": lambda k, s: jax.random.exponential(k, s, dtype),
            "uniform": lambda k, s: jax.random.uniform(k, s, dtype, -root3,
                                                       root3),
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


def _check_tasks(fn: str, spec: TaskSpec, batch: int, dtype) -> jnp.dtype:
  """The arguments of :func:`sample_tasks`, checked before it allocates (its
  covariance ``[d]``, ``[d, d]`` when skewed, comes before the tasks);
  returns the floating dtype."""
  if not isinstance(spec, TaskSpec):
    raise TypeError(f"{fn}: spec must be a TaskSpec, got "
                    f"{type(spec).__name__}.")
  sizes = {"batch": _validate.int_at_least(fn, "batch", batch, low=1)}
  for field, low in (("n_train", 1), ("d", 1), ("n_query", 0)):
    sizes[f"spec.{field}"] = _validate.int_at_least(
        fn, f"spec.{field}", getattr(spec, field), low=low)
  dtype = _validate.floating_dtype(fn, dtype)
  _validate.at_least(fn, "spec.noise", spec.noise, low=0, strict=False)
  for field in ("x_scale", "w_scale", "x_skew"):
    _validate.finite(fn, f"spec.{field}", getattr(spec, field))
  batch, n_train, d, n_query = sizes.values()
  _validate.fits_memory(fn, _validate.array_bytes(
      dtype, (batch, n_train + n_query, d + 1), (batch, d),
      (d, d) if spec.x_skew else (d,)), sizes)
  return dtype


def init_model(key: Array, spec: TaskSpec, *, depth: int, components: int = 3,
               inner: int | None = None, use_bias: bool = True,
               tied: bool = False, residual: bool = False,
               context_only: bool = False, scale: float = 0.1,
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
    residual: every layer adds to the state, ``h <- h + layer(h)``
      (:func:`elsa.nn.residual_stack`; with ``use_bias=False`` the LSA of von
      Oswald et al. 2023).
    context_only: only the ``N`` example tokens enter the key/value sums
      (``key_mask``, :func:`elsa.elsa`); the queries and w-rows read but are
      not read. With ``residual`` and no biases, the masked LSA of von
      Oswald et al. (``include_query=False``) and Ahn et al. (2023).
    scale, bias_scale: standard deviations of the random weights and biases.
    skip_init: start component 0 of every layer at the exact skip ``h -> h``
      (:func:`elsa.constructions.linear` with ``P = I``, needs biases and
      ``inner >= n``), so a deep stack starts near the identity instead of a
      random cubic of degree ``3^L``. It is an initial value, not a constraint.
    dtype: floating dtype of the parameters; default JAX's default float
      (float32, or float64 under ``jax_enable_x64``).
  """
  dtype = float_dtype(dtype)
  form = spec.model_tokens()
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
  key_mask = (jnp.arange(m) < spec.n_train) if context_only else None
  return nn.ElsaStack(params, tied=tied, depth=depth, use_bias=use_bias,
                      residual=residual, key_mask=key_mask)


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


def model_predict(model: Callable[[Array], Array], form, task: ridge.Task
                  ) -> Array:
  """A token model's query predictions ``[B, Q]``: decode_pred(model(encode(task)))."""
  h0 = form.encode(task.x, task.y, x_query=task.x_query)
  return form.decode_pred(model(h0))


def mse(pred: Array, task: ridge.Task) -> Array:
  """Squared error per task, mean over queries: ``[B]``."""
  return jnp.mean((pred - task.y_query) ** 2, axis=-1)


def loss(params: nnx.State, task: ridge.Task, *, graphdef, rest: nnx.State,
         form) -> Array:
  """The training loss: MSE over tasks and queries (a scalar).

  Residual stacks run with ``reverse_only`` (:func:`elsa.nn.residual_stack`):
  differentiate the loss with ``grad``/``vjp``, not forward mode."""
  return jnp.mean(mse(model_predict(_reverse_only(graphdef, params, rest),
                                   form, task), task))


def grid_loss(params: nnx.State, task: ridge.Task, *, graphdef,
              rest: nnx.State, form) -> Array:
  """Per-task MSE ``[G, B]`` of ``G`` models, ``params`` stacked on axis 0."""
  per_model = lambda p: mse(model_predict(_reverse_only(graphdef, p, rest),
                                          form, task), task)
  return jax.vmap(per_model)(params)


def _reverse_only(graphdef, params: nnx.State, rest: nnx.State):
  """The merged model as the losses call it: a residual stack with its fast
  reverse-mode products (:func:`elsa.nn.residual_stack`, ``reverse_only``),
  since a loss is only ever differentiated in reverse mode."""
  model = merge(graphdef, params, rest)
  if getattr(model, "residual", False):
    return functools.partial(model, reverse_only=True)
  return model


def optimizer(*, learning_rate: float, steps: int, warmup_steps: int = 0,
              end_fraction: float = 0.01, clip_norm: float | None = 1.0,
              weight_decay: float = 0.0) -> optax.GradientTransformation:
  """Adam(W) with global-norm clipping and a warmup-cosine schedule.

  The learning rate rises linearly from 0 over ``warmup_steps`` then decays
  by a cosine to ``end_fraction * learning_rate`` at ``steps``
  (``end_fraction=1, warmup_steps=0``: constant). The peak rate is a traced
  hyper-parameter in the state (``optax.inject_hyperparams``), so
  :func:`grid_init_state` can give each grid point its own without a new
  compilation; ``clip_norm=None`` clips nothing.
  """
  injected = optax.inject_hyperparams(
      _adam_chain, static_args=("steps", "warmup_steps", "end_fraction",
                                "clip_norm", "weight_decay"))
  return injected(learning_rate=learning_rate, steps=steps,
                  warmup_steps=warmup_steps, end_fraction=end_fraction,
                  clip_norm=clip_norm, weight_decay=weight_decay)


def _adam_chain(learning_rate, steps, warmup_steps, end_fraction, clip_norm,
                weight_decay):
  # optax.adamw with the schedule learning_rate * shape(step), written so that
  # learning_rate may be traced (warmup_cosine_decay_schedule branches on its
  # peak value).
  shape = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=1.0, warmup_steps=warmup_steps,
      decay_steps=max(steps, warmup_steps + 1), end_value=end_fraction)
  parts = [] if clip_norm is None else [optax.clip_by_global_norm(clip_norm)]
  parts += [optax.scale_by_adam(), optax.add_decayed_weights(weight_decay),
            optax.scale_by_schedule(shape), optax.scale(-learning_rate)]
  return optax.chain(*parts)


class TrainState(NamedTuple):
  """What a train step carries: the trainable state, optimiser state, step count."""

  params: nnx.State
  opt_state: Any
  step: Array


def init_state(params: nnx.State, tx: optax.GradientTransformation
               ) -> TrainState:
  """The state of one run: ``params``, ``tx``'s state for them, step 0."""
  return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def grid_init_state(params: nnx.State, tx: optax.GradientTransformation, *,
                    learning_rates: Array) -> TrainState:
  """States of ``G`` grid points: ``params`` stacked on axis 0, rates ``[G]``.

  ``tx`` is an :func:`optimizer`; each grid point's peak learning rate
  replaces the one ``tx`` was built with (its schedule keeps its shape).
  """
  learning_rates = jnp.asarray(learning_rates, jnp.float32)
  if jnp.ndim(learning_rates) != 1 or learning_rates.shape[0] != (
      jax.tree.leaves(params)[0].shape[0]):
    raise ValueError(f"grid_init_state: learning_rates must have shape [G] "
                     f"with G the leading axis of params, got "
                     f"{jnp.shape(learning_rates)} for G = "
                     f"{jax.tree.leaves(params)[0].shape[0]}.")

  def one(p, lr):
    state = init_state(p, tx)
    opt = state.opt_state
    hyper = dict(opt.hyperparams, learning_rate=lr.astype(
        jnp.result_type(opt.hyperparams["learning_rate"])))
    return state._replace(opt_state=opt._replace(hyperparams=hyper))
  return jax.vmap(one)(params, learning_rates)


@functools.partial(jax.jit, static_argnames=("graphdef", "form", "tx"))
def train_step_on_batch(state: TrainState, task: ridge.Task, *, graphdef,
                        rest: nnx.State, form, tx: optax.GradientTransformation
                        ) -> tuple[TrainState, Array]:
  """One optimiser step on the tasks ``task`` (read through ``form``'s tokens).

  The part of :func:`train_step` after the draw: the loss and its gradient
  (``jax.value_and_grad``) and the update of ``tx``.

  Returns:
    the new state and the loss on ``task`` (before the update).
  """
  value, grads = jax.value_and_grad(loss)(state.params, task, graphdef=graphdef,
                                          rest=rest, form=form)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return TrainState(params, opt_state, state.step + 1), value


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "tx", "batch",
                                             "batch_sharding"))
def train_step(state: TrainState, key: Array, *, graphdef, rest: nnx.State,
               spec: TaskSpec, tx: optax.GradientTransformation, batch: int,
               batch_sharding: jax.sharding.Sharding | None = None
               ) -> tuple[TrainState, Array]:
  """One optimiser step on fresh tasks from ``fold_in(key, state.step)``.

  ``batch_sharding`` (a sharding of the task axis, e.g. ``NamedSharding(mesh,
  P("batch"))``) splits the batch over devices, data-parallel: the same
  draws (JAX's partitionable random bits), the loss's mean and so the
  gradients reduced over devices by XLA.

  Returns:
    the new state and the loss on this step's batch (before the update).
  """
  task = _draw(key, state.step, spec, batch=batch,
               dtype=jax.tree.leaves(state.params)[0].dtype,
               batch_sharding=batch_sharding)
  return train_step_on_batch(state, task, graphdef=graphdef, rest=rest,
                             form=spec.model_tokens(), tx=tx)


def _draw(key: Array, step: Array, spec: TaskSpec, *, batch: int, dtype,
          batch_sharding) -> ridge.Task:
  """Step ``step``'s batch: tasks from ``fold_in(key, step)``, the task axis
  split by ``batch_sharding`` (if any)."""
  task = sample_tasks(jax.random.fold_in(key, step), spec, batch=batch,
                      dtype=dtype)
  if batch_sharding is not None:
    task = jax.lax.with_sharding_constraint(task, batch_sharding)
  return task


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "tx", "batch",
                                             "steps", "batch_sharding"))
def train_steps(state: TrainState, key: Array, *, graphdef, rest: nnx.State,
                spec: TaskSpec, tx: optax.GradientTransformation, batch: int,
                steps: int, batch_sharding: jax.sharding.Sharding | None = None
                ) -> tuple[TrainState, Array]:
  """``steps`` train steps in one compiled scan; returns the state and losses ``[steps]``."""
  def body(state, _):
    return train_step(state, key, graphdef=graphdef, rest=rest, spec=spec,
                      tx=tx, batch=batch, batch_sharding=batch_sharding)
  return jax.lax.scan(body, state, None, length=steps)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "tx", "batch",
                                             "steps", "batch_sharding"))
def train_grid_steps(states: TrainState, key: Array, *, graphdef,
                     rest: nnx.State, spec: TaskSpec,
                     tx: optax.GradientTransformation, batch: int, steps: int,
                     batch_sharding: jax.sharding.Sharding | None = None
                     ) -> tuple[TrainState, Array]:
  """:func:`train_steps` for ``G`` grid points at once (``states`` from
  :func:`grid_init_state`, all at the same step); every point sees the same
  batches. Returns the states and losses ``[G, steps]``.

  Each step draws its batch once, outside the differentiated function, and
  every grid point takes its :func:`train_step_on_batch` on it.
  """
  form = spec.model_tokens()
  dtype = jax.tree.leaves(states.params)[0].dtype

  def body(states, _):
    # The points advance together: the first one's count is every one's.
    task = _draw(key, states.step[0], spec, batch=batch, dtype=dtype,
                 batch_sharding=batch_sharding)
    # One grid point after another (lax.map), one compilation: on 2 CPU
    # cores a vmapped grid of 4 points at L = 4 was slower (121 ms per step
    # against 86 ms, one noisy measurement each).
    return jax.lax.map(lambda state: train_step_on_batch(
        state, task, graphdef=graphdef, rest=rest, form=form, tx=tx), states)

  states, losses = jax.lax.scan(body, states, None, length=steps)
  return states, losses.T


# --- every prefix at once: Garg et al.'s interleaved prompts -----------------


def interleave(x: Array, y: Array) -> Array:
  """Garg et al.'s prompt ``x_1, y_1, x_2, y_2, ...`` as tokens ``[..., 2N, d + 1]``.

  ``x [..., N, d]``, ``y [..., N]``: token ``2i`` is ``(x_i, 0)`` and token
  ``2i + 1`` is ``(0, ..., 0, y_i)``, so the model tells the two kinds apart
  by where they are nonzero. A causal model's output at token ``2i`` has
  seen the examples ``< i`` and ``x_i``: one pass predicts every prefix
  (:func:`prefix_predictions`).
  """
  fn = "training.interleave"
  _validate.floating(fn, "x", x)
  _validate.same_dtype(fn, "y", y, "x", x)
  if jnp.ndim(x) < 2 or jnp.shape(y) != jnp.shape(x)[:-1]:
    raise ValueError(f"{fn}: x must be [..., N, d] and y [..., N], got "
                     f"shapes {jnp.shape(x)} and {jnp.shape(y)}.")
  zeros = jnp.zeros((*jnp.shape(y), 1), jnp.result_type(x))
  x_tokens = jnp.concatenate([x, zeros], axis=-1)
  y_tokens = jnp.concatenate([jnp.zeros_like(x), y[..., None]], axis=-1)
  tokens = jnp.stack([x_tokens, y_tokens], axis=-2)  # [..., N, 2, d + 1]
  return tokens.reshape(*jnp.shape(x)[:-2], 2 * jnp.shape(x)[-2], -1)


def prefix_predictions(model: Callable[[Array], Array], x: Array, y: Array
                       ) -> Array:
  """``[..., N]``: the prediction for ``y_i`` read at token ``x_i`` of
  ``model(interleave(x, y))`` (its first output column): from the examples
  ``< i`` when ``model`` is causal. ``model``: ``[..., 2N, d + 1] -> [..., 2N,
  d_out]``, e.g. :class:`elsa.nn.Transformer`."""
  out = model(interleave(x, y))
  if jnp.ndim(out) != jnp.ndim(x) or jnp.shape(out)[-2] != 2 * jnp.shape(x)[-2]:
    raise ValueError(f"training.prefix_predictions: the model must map "
                     f"[..., 2N, d + 1] tokens to [..., 2N, d_out]; for x "
                     f"{jnp.shape(x)} it returned {jnp.shape(out)}.")
  return out[..., 0::2, 0]


def prefix_errors(model: Callable[[Array], Array], x: Array, y: Array, *,
                  scale=1.0) -> Array:
  """Squared errors ``(prediction_i - y_i)^2 / scale``, ``[..., N]``: at
  ``i`` examples in context, for error-against-examples curves (``scale``:
  Garg et al.'s normaliser, :meth:`elsa.tasks.TaskFamily.error_scale`)."""
  return (prefix_predictions(model, x, y) - y) ** 2 / scale


def prefix_loss(model: Callable[[Array], Array], x: Array, y: Array, *,
                scale=1.0) -> Array:
  r"""The prefix-averaged loss, a scalar: every prefix of every prompt trained at once.

  .. math::
    \frac{1}{BN} \sum_{b, i} (\hat y_{bi} - y_{bi})^2 / \mathrm{scale},

  with :math:`\hat y_{bi}` read at token ``x_i`` (:func:`prefix_predictions`),
  as Garg et al. (2022) train. Under a curriculum, average
  :func:`prefix_errors` with :meth:`elsa.curriculum.Curriculum.mean`."""
  return jnp.mean(prefix_errors(model, x, y, scale=scale))


# --- baselines: predictions [B, Q] from the same tasks -------------------------


def gd_predict(task: ridge.Task, *, lam, eta, steps: int) -> Array:
  """Predictions ``x_q^T w_steps`` of ridge GD from ``w0 = 0``: ``[B, Q]``."""
  w = ridge.gd(task.x, task.y, lam=lam, eta=eta, steps=steps)[-1]
  return jnp.einsum("bqd,bd->bq", task.x_query, w)


def ridge_predict(task: ridge.Task, *, lam) -> Array:
  """Predictions of the ridge minimiser: ``[B, Q]``."""
  return jnp.einsum("bqd,bd->bq", task.x_query,
                    ridge.solve(task.x, task.y, lam=lam))


def bayes_lam(spec: TaskSpec):
  r"""The ridge strength whose minimiser is the posterior mean: :math:`\sigma^2 / (N s^2)`.

  ``sigma = spec.noise``, ``s = spec.w_scale``, ``N = spec.n_train``; see
  :func:`bayes_predict`.
  """
  return spec.noise**2 / (spec.n_train * spec.w_scale**2)


def bayes_predict(task: ridge.Task, spec: TaskSpec) -> Array:
  r"""The Bayes-optimal predictions for the tasks of ``spec``: ``[B, Q]``.

  Under the prior :math:`w \sim N(0, s^2 I)` and labels :math:`y = X w +
  \sigma \varepsilon` (``s = spec.w_scale``, ``sigma = spec.noise``), the
  posterior of ``w`` given the context is Gaussian with mean

  .. math::
    E[w \mid X, y] = (X^\top X + \tfrac{\sigma^2}{s^2} I)^{-1} X^\top y,

  whatever the distribution of the inputs, and the query prediction that
  minimises the expected squared error is :math:`x_q^\top E[w \mid X, y]`.
  In the library's loss normalisation :math:`L(w) = \frac{1}{2N}\sum_i (y_i
  - x_i^\top w)^2 + \frac{\lambda}{2}\|w\|^2` (stationary point
  :math:`(X^\top X / N + \lambda I) w = X^\top y / N`) this is ridge at
  :math:`\lambda^* = \sigma^2 / (N s^2)` (:func:`bayes_lam`), not at
  ``spec.lam``. With ``sigma = 0`` it is the minimum-norm least-squares
  solution (the limit of the posterior mean). It is optimal only for tasks
  drawn from ``spec`` itself (not under a shift of ``w_scale`` or
  ``noise``, nor with ``noise_labels``).
  """
  return ridge_predict(task, lam=bayes_lam(spec))


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


def gd_step_predictions(task: ridge.Task, *, lam, eta, steps: int) -> Array:
  """Predictions ``x_q^T w_t`` of every GD iterate ``t = 0..steps``: ``[steps + 1, B, Q]``."""
  w = ridge.gd(task.x, task.y, lam=lam, eta=eta, steps=steps)
  return jnp.einsum("bqd,tbd->tbq", task.x_query, w)


def layer_predictions(model: nn.ElsaStack, form, task: ridge.Task) -> Array:
  """The query prediction slot decoded after every layer: ``[L + 1, B, Q]``.

  Row ``t`` is ``form.decode_pred`` of the state after layer ``t`` (row 0 is
  the input, whose slot is 0): the per-layer prediction of von Oswald et al.
  (2023), to hold against GD step ``t`` (:func:`gd_step_predictions`).
  """
  h0 = form.encode(task.x, task.y, x_query=task.x_query)
  return form.decode_pred(model(h0, return_all=True))


def sensitivity_agreement(a: Array, b: Array) -> tuple[Array, Array]:
  """Cosine similarity and relative L2 distance ``||a - b|| / ||b||`` per task: ``[B]`` each.

  ``a, b``: sensitivities ``[B, Q, d]`` (:func:`query_sensitivity`), compared
  as one vector of ``Q d`` numbers per task.
  """
  a = a.reshape(a.shape[0], -1)
  b = b.reshape(b.shape[0], -1)
  norm = lambda v: jnp.sqrt(jnp.sum(v**2, axis=-1))
  cos = jnp.sum(a * b, axis=-1) / (norm(a) * norm(b))
  return cos, norm(a - b) / norm(b)


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
