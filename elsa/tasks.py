r"""In-context task families: samplers of :class:`elsa.ridge.Task` batches and their reference predictors.

A family is data (a frozen dataclass of its options) with three jobs:

* ``family.sample(key, batch=B, n_train=N, d=d, n_query=Q, dtype=...)``: a
  batch of prompts as an :class:`elsa.ridge.Task` (``x [B, N, d]``, ``y [B,
  N]``, ``x_query [B, Q, d]``, ``y_query [B, Q]``, ``w_true [B, d]``; scalar
  targets, so :mod:`elsa.forms`, :mod:`elsa.training` and
  :mod:`elsa.decompile` take every family). Pure JAX, jit-compiled, from an
  explicit key: the same key gives the same batch. Families without a weight
  vector (``quadratic``, ``relu_2nn``, ``decision_tree``) fill ``w_true``
  with NaN, so that nothing can use it by mistake. Any floating dtype;
  prompts that cannot fit in memory (a network ``hidden`` or a tree
  ``depth`` too large included) are refused before anything is allocated.
* ``family.references``: ``{name: predictor}``, each ``predictor(task) ->
  [B, Q]``; ``"bayes"`` (also ``family.bayes``) where the posterior mean has
  a closed form, plus the baselines of Garg et al. (2022), named for what
  they compute (table below). A task in float16 or bfloat16 is computed in
  float32 (upcast exactly) and predicted in float32: the references' linear
  algebra does not run below it, and a comparison needs its digits.
* ``family.error_scale(d)``: the divisor of the squared error in tables and
  figures, Garg et al.'s normalisation (the zero predictor scores about 1):
  ``d``, but ``k`` for ``sparse_linear`` and 1 for ``decision_tree`` and
  ``linear_classification``; ``family.reports_accuracy`` says where
  :func:`accuracy` belongs beside it (labels +-1).

The families (inputs ``x ~ N(0, I_d)`` unless said; Garg et al.'s scales:
unit-variance weights, so that ``E[y^2] = d`` on the linear, quadratic and
ReLU-network tasks):

===========================  ===============================================================
``linear``                   ``y = x^T w``, ``w ~ N(0, w_scale^2 I)``, ``noise`` (default 0)
``sparse_linear``            ``k`` (default 3) of the ``d`` coordinates of ``w`` nonzero (a random support per prompt)
``noisy_linear``             Garg et al.'s noisy regression: ``linear`` with ``noise = 1``, labels rescaled to ``E[y^2] = d``
``linear_classification``    ``y = sign(x^T w)``
``quadratic``                ``y = (x * x)^T w / sqrt(3)``
``relu_2nn``                 ``y = sqrt(2 / hidden) relu(x^T W1) w2``, a random network per prompt
``decision_tree``            a random depth-``depth`` tree per prompt: node feature uniform, split at 0, leaves ``N(0, 1)``
``nonzero_mean``             ``w ~ N(mu, w_scale^2 I)``, ``mu = mu_scale * 1_d`` fixed, unknown to the model
``mixed_noise``              the noise level drawn per prompt from ``noise_levels`` (``noise_probs``)
``anisotropic``              ``x ~ N(0, U diag(lam_i) U^T)``, ``lam_i`` geometric from 1 to ``1 / kappa``
                             (trace ``d``); ``U = I``, or a fresh random rotation per prompt (``rotate``)
===========================  ===============================================================

The baselines (Garg et al.'s name in their code, and where they run):

====================  ==============================================================  ====================
``least_squares``     ``x_q^T X^+ y``, minimum norm (``LeastSquaresModel``)           every family
``ridge``             ridge at ``ridge_lam``, library normalisation                   every family
``knn``               mean label of the 3 nearest examples (``NNModel``)              every family
``knn_distance``      the 3 nearest weighted by inverse distance                      every family
``averaging``         ``w = mean_i y_i x_i`` (``AveragingModel``)                     every family
``lasso_1`` ...       Lasso at 1, 0.1, 0.01, 0.001, 0.0001 (``LassoModel``)           ``sparse_linear``
``mlp_adam``          2-layer ReLU net, 100 Adam steps (``GDModel``)                  ``quadratic``, ``relu_2nn`` (its width), ``decision_tree``
``mlp_lbfgs``         the same network fitted by L-BFGS (scikit-learn)                ``quadratic``, ``relu_2nn``
``tree``              CART tree of the task's depth (``DecisionTreeModel``)           ``decision_tree``
``tree_unbounded``    CART tree without a depth limit                                 ``decision_tree``
``boosted_trees``     gradient boosting at XGBoost's defaults (``XGBoostModel``)      ``decision_tree``
====================  ==============================================================  ====================

Every baseline but the scikit-learn ones (:data:`HOST_REFERENCES`: Lasso,
``mlp_lbfgs``, the trees; host-side, one prompt at a time, on concrete
tasks, the slow ones) is a jnp function: jit-able.

Least squares, ridge and the Bayes predictors solve through the SVD of
``X`` itself, never ``X^T X``, so that float32 keeps its digits at ``N =
d`` (the double-descent peak, where ``X^T X`` squares a large condition
number).

Bayes-optimal predictors (the posterior mean of ``y_q``, optimal for the
squared error under the family's own distribution): with a Gaussian prior
``w ~ N(mu, s^2 I)`` and noise ``sigma``,

.. math::
  E[w \mid X, y] = \mu + (X^\top X + \tfrac{\sigma^2}{s^2} I)^{+} X^\top (y - X\mu),

(the minimum-norm limit at ``sigma = 0``), whatever the inputs' distribution
(``anisotropic`` included). For ``mixed_noise`` the posterior over the level
``sigma_j`` is ``pi_j ∝ p_j N(y; 0, s^2 X X^T + sigma_j^2 I)`` and the
prediction is ``sum_j pi_j x_q^T E[w | X, y, sigma_j]``, exactly.

Example:
  >>> from elsa import tasks
  >>> family = tasks.get("nonzero_mean", mu_scale=1.0)
  >>> batch = family.sample(jax.random.key(0), batch=8, n_train=16, d=4,
  ...                       dtype=jnp.float32)
  >>> family.bayes(batch).shape
  (8, 1)
  >>> sparse = tasks.get("sparse_linear")
  >>> sparse.error_scale(20), sorted(sparse.references)[:3]
  (3.0, ['averaging', 'knn', 'knn_distance'])

References: Garg, Tsipras, Liang, Valiant (2022), "What can transformers
learn in-context?" (task set and baselines; their code,
github.com/dtsip/in-context-learning, for the settings and the
normalisation); Zhang, Wu, Bartlett (2024), arXiv 2402.14951 (non-zero
mean); Vladymyrov, von Oswald et al. (2024), arXiv 2402.14180 (mixed
noise); Fu et al. (2023), arXiv 2310.17086, and Gatmiry et al. (2024),
arXiv 2410.21698 (ill-conditioned inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elsa import _validate, ridge
from elsa.attention import Array

Predictor = Callable[[ridge.Task], Array]


# --- reference predictors: task -> [B, Q] ---------------------------------------

_EXACT = jax.lax.Precision.HIGHEST


def _predict(task: ridge.Task, w: Array) -> Array:
  return jnp.einsum("bqd,bd->bq", task.x_query, w, precision=_EXACT)


def _reference_task(task: ridge.Task) -> ridge.Task:
  """``task`` itself, or in float32 when it is in a half precision (float16,
  bfloat16): the references' linear algebra (SVD, least squares) does not
  run below float32, and a comparison needs their digits. Upcasting is
  exact: the references see the prompts the model sees."""
  if jnp.finfo(task.x.dtype).bits >= 32:
    return task
  return jax.tree.map(lambda a: a.astype(jnp.float32), task)


class _Svd(NamedTuple):
  """The thin SVD ``X = U diag(s) V^T`` of every prompt's examples (``U [B, N,
  k]``, ``s [B, k]``, ``vt [B, k, d]``, ``k = min(N, d)``) and ``kept [B,
  k]``, the singular values above the pseudo-inverse's cutoff ``max(N, d)
  eps s_max`` (numpy's and JAX's ``pinv`` rule)."""

  u: Array
  s: Array
  vt: Array
  kept: Array


def _svd(x: Array) -> _Svd:
  u, s, vt = jnp.linalg.svd(x, full_matrices=False)
  tol = max(x.shape[-2:]) * jnp.finfo(x.dtype).eps * s[..., :1]
  return _Svd(u, s, vt, s > tol)


def _shrunk_solve(svd: _Svd, y: Array, q) -> Array:
  r"""``(X^T X + q^2 I)^+ X^T y = V diag(1 / (s + q^2 / s)) U^T y``: ``[B, d]``.

  Through the SVD of ``X`` itself, never ``X^T X`` (whose condition number
  is the square of ``X``'s: in float32 the normal matrix at ``N = d`` loses
  every digit a least-squares fit needs). ``q = 0`` is the minimum-norm
  least-squares solution, ``X^+ y``. The gain ``1 / (s + q (q / s))`` is
  finite for every ``q`` in ``[0, inf]`` (no ``q^2`` is formed: a prior of
  scale 1e-30 makes it overflow float32) and singular values below the
  cutoff (:class:`_Svd`) get none. ``q``: a scalar or ``[B]``.
  """
  s = jnp.where(svd.kept, svd.s, 1)
  q = jnp.asarray(q, s.dtype)[..., None]
  gain = jnp.where(svd.kept, 1 / (s + q * (q / s)), 0)
  coef = jnp.einsum("bnk,bn->bk", svd.u, y, precision=_EXACT)
  return jnp.einsum("bkd,bk->bd", svd.vt, gain * coef, precision=_EXACT)


def _noise_to_prior(noise: float, w_scale: float, dtype) -> float:
  """``noise / w_scale`` (``q`` of :func:`_shrunk_solve`), computed in Python
  floats and capped at the dtype's largest finite value (the gain is then
  0, the prior mean: the same limit)."""
  return min(noise / w_scale, float(jnp.finfo(dtype).max))


def posterior_mean_w(task: ridge.Task, *, mu, noise: float, w_scale: float
                     ) -> Array:
  r"""``E[w | X, y] = mu + (X^T X + (noise / w_scale)^2 I)^+ X^T (y - X mu)``: ``[B, d]``.

  The posterior mean under the prior ``w ~ N(mu, w_scale^2 I)`` and label
  noise ``noise`` (``mu`` ``[d]`` or ``[B, d]``); ``noise = 0`` gives the
  minimum-norm correction of ``mu`` (the noiseless posterior mean). Solved
  through the SVD of ``X`` (:func:`_shrunk_solve`): exact in float32 at
  every ``N`` and finite at any scale ratio. Half-precision tasks are
  computed in float32 (:func:`least_squares`).
  """
  task = _reference_task(task)
  mu = jnp.broadcast_to(jnp.asarray(mu, task.x.dtype), task.w_true.shape)
  resid = task.y - jnp.einsum("bnd,bd->bn", task.x, mu, precision=_EXACT)
  return mu + _shrunk_solve(_svd(task.x), resid, _noise_to_prior(
      noise, w_scale, task.x.dtype))


def least_squares(task: ridge.Task) -> Array:
  """Minimum-norm least squares, ``x_q^T X^+ y`` (Garg et al.'s
  ``LeastSquaresModel``, ``torch.linalg.lstsq``), through the SVD of ``X``.

  Like every reference here, a task in float16 or bfloat16 is computed in
  float32 and the prediction returned in float32.
  """
  task = _reference_task(task)
  return _predict(task, _shrunk_solve(_svd(task.x), task.y, 0.0))


def ridge_predictor(task: ridge.Task, *, lam: float) -> Array:
  """Ridge at ``lam`` in the library's normalisation (the minimiser of
  :func:`elsa.ridge.loss`, ``(X^T X / N + lam I)^{-1} X^T y / N``), through
  the SVD of ``X`` (``q^2 = N lam``)."""
  task = _reference_task(task)
  n_train = task.x.shape[-2]
  q = jnp.sqrt(jnp.asarray(lam, task.x.dtype) * n_train)
  return _predict(task, _shrunk_solve(_svd(task.x), task.y, q))


def averaging(task: ridge.Task) -> Array:
  r"""Garg et al.'s averaging estimator, :math:`x_q^\top \frac1N \sum_i y_i x_i`."""
  task = _reference_task(task)
  return _predict(task, jnp.mean(task.x * task.y[..., None], axis=-2))


def _nearest(task: ridge.Task, k: int) -> tuple[Array, Array]:
  """Distances ``[B, Q, k]`` (ascending; ties: the earlier example) and the
  labels of the ``k`` nearest examples (``k`` capped at ``N``)."""
  k = min(k, task.x.shape[-2])
  dist = jnp.sqrt(jnp.maximum(jnp.sum(
      (task.x_query[..., :, None, :] - task.x[..., None, :, :]) ** 2, -1),
      0.0))  # [B, Q, N]
  neg, idx = jax.lax.top_k(-dist, k)
  return -neg, jnp.take_along_axis(task.y[..., None, :], idx, axis=-1)


def knn(task: ridge.Task, *, k: int = 3) -> Array:
  """The mean label of the ``k`` nearest examples (Euclidean): Garg et al.'s
  ``NNModel(n_neighbors=3)``, uniform weights (scikit-learn's
  ``KNeighborsRegressor(k)``). ``k`` is capped at ``N``."""
  task = _reference_task(task)
  return jnp.mean(_nearest(task, k)[1], -1)


def knn_distance(task: ridge.Task, *, k: int = 3) -> Array:
  """The ``k`` nearest examples weighted by inverse distance
  (``KNeighborsRegressor(k, weights='distance')``; Garg et al.'s ``NNModel``
  with ``weights='distance'``, not the one they report): a query that
  coincides with an example gets that example's label."""
  task = _reference_task(task)
  near, labels = _nearest(task, k)
  exact = near == 0
  weights = jnp.where(jnp.any(exact, -1, keepdims=True), exact.astype(
      near.dtype), 1 / jnp.where(exact, 1, near))
  return jnp.sum(weights * labels, -1) / jnp.sum(weights, -1)


def _init_mlp(key: Array, d: int, hidden: int, dtype) -> dict[str, Array]:
  """``torch.nn.Linear``'s default initialisation of ``d -> hidden -> 1``:
  every weight and bias ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``; ``key``
  split into ``w1, b1, w2, b2`` in that order."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  u = lambda key, shape, fan_in: jax.random.uniform(
      key, shape, dtype, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
  return {"w1": u(k1, (d, hidden), d), "b1": u(k2, (hidden,), d),
          "w2": u(k3, (hidden,), hidden), "b2": u(k4, (), hidden)}


def _mlp(params: dict[str, Array], x: Array) -> Array:
  """``relu(x W1 + b1) w2 + b2``: ``x [M, d] -> [M]``."""
  act = jax.nn.relu(jnp.matmul(x, params["w1"], precision=_EXACT)
                    + params["b1"])
  return jnp.matmul(act, params["w2"], precision=_EXACT) + params["b2"]


@functools.partial(jax.jit, static_argnames=("hidden", "steps", "lr",
                                             "batch_size", "seed"))
def _mlp_adam(task: ridge.Task, *, hidden, steps, lr, batch_size, seed):
  n_train, d = task.x.shape[-2:]
  k_init, k_batch = jax.random.split(jax.random.key(seed))
  prompts = task.x.shape[0]
  params = jax.vmap(lambda key: _init_mlp(key, d, hidden, task.x.dtype))(
      jax.random.split(k_init, prompts))
  optimizer = optax.adam(lr)  # torch.optim.Adam's defaults

  def loss(params, x, y):
    return jnp.mean((_mlp(params, x) - y) ** 2)

  def step(state, key):
    params, opt_state = state
    if n_train > batch_size:  # Garg et al.: a fresh subset at every step
      keys = jax.random.split(key, prompts)
      rows = jax.vmap(lambda k: jax.random.permutation(k, n_train)[
          :batch_size])(keys)
      x = jnp.take_along_axis(task.x, rows[..., None], axis=1)
      y = jnp.take_along_axis(task.y, rows, axis=1)
    else:
      x, y = task.x, task.y
    grads = jax.vmap(jax.grad(loss))(params, x, y)
    updates, opt_state = jax.vmap(optimizer.update)(grads, opt_state)
    return (optax.apply_updates(params, updates), opt_state), None

  state = (params, jax.vmap(optimizer.init)(params))
  (params, _), _ = jax.lax.scan(step, state, jax.random.split(k_batch, steps))
  return jax.vmap(_mlp)(params, task.x_query)


def mlp_adam(task: ridge.Task, *, hidden: int = 100, steps: int = 100,
             lr: float = 5e-3, batch_size: int = 100, seed: int = 0) -> Array:
  r"""Garg et al.'s "2-layer NN, GD" baseline: a network ``d -> hidden ->
  1`` (ReLU) per prompt, trained by Adam on the prompt's examples.

  Their ``GDModel(NeuralNetwork, hidden_size=100, opt_alg='adam', lr=5e-3,
  num_steps=100, batch_size=100)``: ``torch.nn.Linear``'s initialisation
  (every parameter ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``), ``steps`` Adam
  steps (``lr``, betas ``(0.9, 0.999)``, ``eps = 1e-8``) on the mean
  squared error over ``min(N, batch_size)`` examples, a fresh random subset
  at every step when ``N > batch_size`` (all of them otherwise: every ``N``
  Garg et al. evaluate). Their loss also averages over the batch of
  prompts, which scales each network's gradient by ``1 / B``; Adam is
  invariant to that scale up to ``eps``, so here each prompt's loss is its
  own mean.

  Pure JAX (``vmap`` over prompts, ``lax.scan`` over steps): jit-able, one
  compilation per shape. Randomness from ``jax.random.key(seed)``: split in
  two, the first split into one key per prompt for :func:`_init_mlp`, the
  second into one key per step for the subsets.

  Raises:
    ValueError: a size below 1, or parameters, Adam's state and the hidden
      activations that cannot fit in memory.
  """
  fn = "tasks.mlp_adam"
  sizes = {name: _validate.int_at_least(fn, name, value, low=1)
           for name, value in (("hidden", hidden), ("steps", steps),
                               ("batch_size", batch_size))}
  _validate.at_least(fn, "lr", lr, low=0, strict=True)
  task = _reference_task(task)
  prompts, rows, d = task.x.shape
  _validate.fits_memory(fn, _validate.array_bytes(
      task.x.dtype, (4, prompts, d + 2, hidden),
      (prompts, rows + task.x_query.shape[1], hidden)),
                        {**sizes, "x.shape": task.x.shape})
  return _mlp_adam(task, lr=float(lr), seed=seed, **sizes)


def _per_prompt(task: ridge.Task, fit_predict) -> Array:
  """``fit_predict(x [N, d], y [N], x_query [Q, d]) -> [Q]`` on the host, for
  every prompt, in float64; returned in the task's dtype (float32 for a
  half-precision one)."""
  task = _reference_task(task)
  x, y, xq = (np.asarray(a, np.float64) for a in (task.x, task.y,
                                                   task.x_query))
  out = np.stack([fit_predict(x[b], y[b], xq[b]) for b in range(x.shape[0])])
  return jnp.asarray(out, task.x.dtype)


def lasso(task: ridge.Task, *, alpha: float) -> Array:
  r"""Lasso per prompt (scikit-learn, no intercept), host-side:
  :math:`\min_w \frac{1}{2N}\|y - Xw\|^2 + \alpha \|w\|_1`.

  Garg et al.'s ``LassoModel(alpha)``: coordinate descent, ``max_iter =
  100000``, run to a duality gap of ``1e-8`` rather than scikit-learn's
  ``1e-4``, since the reference is the minimiser. Where it stops at
  ``max_iter`` short of that (prompts with fewer examples than dimensions at
  small ``alpha``: its iterate keeps more nonzeros than the minimiser, whose
  prediction can differ by a large fraction of the output's scale), the
  exact homotopy solution of the same objective (``LassoLars``, KKT
  conditions met to rounding) replaces it."""
  import warnings  # pylint: disable=import-outside-toplevel
  from sklearn.exceptions import ConvergenceWarning  # pylint: disable=import-outside-toplevel
  from sklearn.linear_model import Lasso, LassoLars  # pylint: disable=import-outside-toplevel

  def fit_predict(x, y, xq):
    with warnings.catch_warnings():
      warnings.simplefilter("error", ConvergenceWarning)
      try:
        model = Lasso(alpha=alpha, fit_intercept=False, max_iter=100_000,
                      tol=1e-8).fit(x, y)
      except ConvergenceWarning:
        model = LassoLars(alpha=alpha, fit_intercept=False).fit(x, y)
    return model.predict(xq)
  return _per_prompt(task, fit_predict)


def mlp_lbfgs(task: ridge.Task, *, hidden: int = 100, seed: int = 0) -> Array:
  """A one-hidden-layer ReLU network fitted per prompt by L-BFGS
  (scikit-learn ``MLPRegressor``, at most 500 iterations, ``alpha = 1e-4``
  weight decay), host-side: a full-batch optimiser beside Garg et al.'s
  Adam (:func:`mlp_adam`)."""
  from sklearn.neural_network import MLPRegressor  # pylint: disable=import-outside-toplevel
  import warnings  # pylint: disable=import-outside-toplevel
  from sklearn.exceptions import ConvergenceWarning  # pylint: disable=import-outside-toplevel

  def fit_predict(x, y, xq):
    model = MLPRegressor(hidden_layer_sizes=(hidden,), solver="lbfgs",
                         max_iter=500, random_state=seed)
    with warnings.catch_warnings():
      # An iteration cap is the baseline's budget, not an error.
      warnings.simplefilter("ignore", ConvergenceWarning)
      return model.fit(x, y).predict(xq)
  return _per_prompt(task, fit_predict)


def tree(task: ridge.Task, *, max_depth: int | None = 4) -> Array:
  """A CART regression tree fitted per prompt (scikit-learn
  ``DecisionTreeRegressor``; ``max_depth=None``: grown until its leaves are
  pure), host-side: Garg et al.'s ``DecisionTreeModel``."""
  from sklearn.tree import DecisionTreeRegressor  # pylint: disable=import-outside-toplevel

  def fit_predict(x, y, xq):
    model = DecisionTreeRegressor(max_depth=max_depth, random_state=0)
    return model.fit(x, y).predict(xq)
  return _per_prompt(task, fit_predict)


# XGBoost's defaults (XGBRegressor(), Garg et al.'s baseline), in
# HistGradientBoostingRegressor's terms: 100 rounds at learning rate 0.3,
# depth-wise trees of depth 6, L2 leaf penalty 1, a leaf may hold one
# example (min_child_weight 1 is a hessian of 1: one squared-error example),
# no early stopping.
BOOSTED_TREES_OPTIONS = {"max_iter": 100, "learning_rate": 0.3, "max_depth": 6,
                         "max_leaf_nodes": None, "min_samples_leaf": 1,
                         "l2_regularization": 1.0, "early_stopping": False}


def boosted_trees(task: ridge.Task) -> Array:
  """Gradient-boosted trees fitted per prompt, host-side: Garg et al.'s
  ``XGBoostModel`` (``xgboost.XGBRegressor()``) through scikit-learn's
  ``HistGradientBoostingRegressor`` at XGBoost's default settings
  (:data:`BOOSTED_TREES_OPTIONS`).

  Why scikit-learn's and not XGBoost: it is already a dependency (no new
  package, no native build to pin), it implements the same algorithm (a
  second-order boosting of histogram trees, leaf value ``-G / (H +
  lambda)`` times the learning rate, the mean label as the start), and on
  a prompt of at most 255 examples its bins are the examples' own distinct
  values, so the histogram is exact. What differs: the two libraries'
  split tie-breaking and thresholds (scikit-learn splits at midpoints).
  """
  from sklearn.ensemble import HistGradientBoostingRegressor  # pylint: disable=import-outside-toplevel

  def fit_predict(x, y, xq):
    model = HistGradientBoostingRegressor(**BOOSTED_TREES_OPTIONS,
                                          random_state=0)
    return model.fit(x, y).predict(xq)
  return _per_prompt(task, fit_predict)


# Garg et al.'s five Lasso strengths on sparse regression, each a reference.
LASSO_ALPHAS = (1.0, 0.1, 0.01, 0.001, 0.0001)


def lasso_name(alpha: float) -> str:
  """``lasso_0.01``: the reference name of the Lasso at ``alpha``."""
  return f"lasso_{alpha:g}"


# Not jit-able (scikit-learn, on concrete arrays): call them on concrete tasks.
HOST_REFERENCES = (*(lasso_name(a) for a in LASSO_ALPHAS), "mlp_lbfgs", "tree",
                   "tree_unbounded", "boosted_trees")


def accuracy(pred: Array, task: ridge.Task) -> Array:
  """The share of queries whose predicted sign is the label, per prompt:
  ``[B]`` (Garg et al.'s classification metric, ``y == sign(pred)``; a
  prediction of exactly 0 is wrong). For labels ``+-1``
  (``linear_classification``, :attr:`TaskFamily.reports_accuracy`)."""
  return jnp.mean((jnp.sign(pred) == task.y_query).astype(jnp.result_type(
      pred, jnp.float32)), axis=-1)


# --- families ---------------------------------------------------------------------


def _check_option(name: str, option: str, value, *, low=None, strict=False,
                  integer=False):
  fn = f"tasks.get({name!r})"
  if integer:
    return _validate.int_at_least(fn, option, value, low=low)
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{fn}: {option} must be a real number, got {value!r}.")
  if low is None:
    _validate.finite(fn, option, value)
  else:
    _validate.at_least(fn, option, value, low=low, strict=strict)
  return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskFamily:
  """The shared part of every family: sampling, splitting, the baselines.

  Attributes:
    ridge_lam: the strength of the ``ridge`` reference (library
      normalisation, ``>= 0``).
  """

  ridge_lam: float = 0.05

  name = "family"   # class attributes, not options
  has_w = True
  reports_accuracy = False  # labels +-1: tables add :func:`accuracy`

  def __post_init__(self):
    _check_option(self.name, "ridge_lam", self.ridge_lam, low=0)

  def options(self) -> dict:
    """The family's options and their values."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def error_scale(self, d: int) -> float:
    """The divisor of the squared error in tables and figures: Garg et al.'s
    normalisation, under which predicting zero scores about 1.

    ``d`` here (``E[y^2] = d`` for unit-variance weights on ``N(0, I_d)``
    inputs, the quadratic and ReLU-network tasks included: their code's
    default); ``k`` for ``sparse_linear``; 1 for ``decision_tree`` (leaves
    ``N(0, 1)``) and ``linear_classification`` (labels ``+-1``: the zero
    predictor's error is exactly 1; Garg et al. report accuracy there).
    """
    return float(_validate.int_at_least(f"tasks.{self.name}.error_scale",
                                        "d", d, low=1))

  def sample(self, key: Array, *, batch: int, n_train: int, d: int,
             n_query: int = 1, dtype=None, input_mask: Array | None = None
             ) -> ridge.Task:
    """``batch`` prompts of ``n_train`` examples and ``n_query`` queries in ``d`` dimensions.

    ``input_mask`` (``[d]``, may be traced): multiplies every input before
    the labels are drawn, so a 0/1 mask of the first ``d'`` coordinates gives
    prompts of a ``d'``-dimensional task at width ``d`` (Garg et al.'s
    curriculum, :meth:`elsa.curriculum.Curriculum.input_mask`).

    Raises:
      TypeError: a size that is not an int, a dtype that is not floating.
      ValueError: a size below 1, a size the family cannot take (``k > d``),
        prompts that cannot fit in memory.
    """
    fn = f"tasks.{self.name}.sample"
    sizes = {name: _validate.int_at_least(fn, name, value, low=1)
             for name, value in (("batch", batch), ("n_train", n_train),
                                 ("d", d), ("n_query", n_query))}
    dtype = _validate.floating_dtype(fn, dtype)
    self._check_sizes(fn, sizes["d"])
    if input_mask is not None:
      _validate.floating(fn, "input_mask", input_mask)
      if jnp.shape(input_mask) != (sizes["d"],):
        raise ValueError(f"{fn}: input_mask must be [d] = [{sizes['d']}], got "
                         f"shape {jnp.shape(input_mask)}.")
      input_mask = jnp.asarray(input_mask, dtype)
    rows = sizes["n_train"] + sizes["n_query"]
    _validate.fits_memory(fn, _validate.array_bytes(
        dtype, (batch, rows, d + 1), (batch, d)) + self._label_bytes(
            sizes["batch"], rows, sizes["d"], dtype),
                          {**sizes, **self.options()})
    return _sample(self, key, input_mask, dtype=dtype, **sizes)

  def _check_sizes(self, fn: str, d: int) -> None:
    del fn, d

  def _label_bytes(self, batch: int, rows: int, d: int, dtype) -> int:
    """What the labels need beyond the prompts (a random network, a tree)."""
    del batch, rows, d, dtype
    return 0

  def _inputs(self, key, shape, dtype) -> Array:
    """``x [B, N + Q, d]`` (standard normal unless the family says)."""
    return jax.random.normal(key, shape, dtype)

  def _labels(self, key, x, dtype) -> tuple[Array, Array]:
    """``(y [B, M], w_true [B, d])`` for inputs ``x [B, M, d]``."""
    raise NotImplementedError

  @property
  def references(self) -> dict[str, Predictor]:
    """``{name: predictor(task) -> [B, Q]}``; see the module doc."""
    refs = {}
    if hasattr(self, "bayes"):
      refs["bayes"] = self.bayes
    refs.update(self._baselines())
    return refs

  def _baselines(self) -> dict[str, Predictor]:
    return {"least_squares": least_squares,
            "ridge": functools.partial(ridge_predictor, lam=self.ridge_lam),
            "knn": knn, "knn_distance": knn_distance, "averaging": averaging}


@functools.partial(jax.jit, static_argnames=("family", "batch", "n_train", "d",
                                             "n_query", "dtype"))
def _sample(family: TaskFamily, key, input_mask, *, batch, n_train, d,
            n_query, dtype):
  kx, ky = jax.random.split(key)
  x = family._inputs(kx, (batch, n_train + n_query, d), dtype)  # pylint: disable=protected-access
  if input_mask is not None:
    x = x * input_mask
  y, w = family._labels(ky, x, dtype)  # pylint: disable=protected-access
  if w is None:
    w = jnp.full((batch, d), jnp.nan, dtype)
  return ridge.Task(x=x[:, :n_train], y=y[:, :n_train],
                    x_query=x[:, n_train:], y_query=y[:, n_train:], w_true=w)


def _dot(x, w):
  return jnp.einsum("bmd,bd->bm", x, w, precision=jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Linear(TaskFamily):
  """``y = x^T w + noise * eps``, ``w ~ N(0, w_scale^2 I)``."""

  w_scale: float = 1.0
  noise: float = 0.0
  name = "linear"

  def __post_init__(self):
    super().__post_init__()
    _check_option(self.name, "w_scale", self.w_scale, low=0, strict=True)
    _check_option(self.name, "noise", self.noise, low=0)

  def _mean(self, d, dtype):
    return jnp.zeros((d,), dtype)

  def _labels(self, key, x, dtype):
    kw, kn = jax.random.split(key)
    batch, rows, d = x.shape
    w = self._mean(d, dtype) + self.w_scale * jax.random.normal(
        kw, (batch, d), dtype)
    return _dot(x, w) + self.noise * jax.random.normal(
        kn, (batch, rows), dtype), w

  def bayes(self, task: ridge.Task) -> Array:
    """The posterior mean ``x_q^T E[w | X, y]`` (module doc): ``[B, Q]``."""
    task = _reference_task(task)
    d = task.x.shape[-1]
    return _predict(task, posterior_mean_w(
        task, mu=self._mean(d, task.x.dtype), noise=self.noise,
        w_scale=self.w_scale))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoisyLinear(Linear):
  """Garg et al.'s noisy linear regression (their ``noisyLR`` evaluation:
  ``noise_std = 1``, ``renormalize_ys``): :class:`Linear` with label noise
  ``noise`` (default 1), and with ``renormalize`` the labels scaled by
  ``c = sqrt(d / (d w_scale^2 + noise^2))`` to the noiseless task's scale
  (``E[y^2] = d``).

  Garg et al. divide by the standard deviation of each batch of labels; the
  expected one is used here, so that a prompt does not depend on the
  others and the posterior stays exact: ``y = x^T (c w) + c noise eps``
  is :class:`Linear` with weights ``c w`` (``w_true``) and noise ``c
  noise``, the same ratio ``noise / w_scale``, the same Bayes predictor.
  """

  noise: float = 1.0
  renormalize: bool = True
  name = "noisy_linear"

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.renormalize, (bool, np.bool_)):
      raise TypeError(f"tasks.get('noisy_linear'): renormalize must be True "
                      f"or False, got {self.renormalize!r}.")

  def _labels(self, key, x, dtype):
    y, w = super()._labels(key, x, dtype)
    if not self.renormalize:
      return y, w
    d = x.shape[-1]
    scale = math.sqrt(d / (d * self.w_scale ** 2 + self.noise ** 2))
    return scale * y, scale * w


@dataclasses.dataclass(frozen=True, kw_only=True)
class NonzeroMean(Linear):
  """``w ~ N(mu, w_scale^2 I)`` with ``mu = mu_scale * 1_d``, the same for
  every prompt (a property of the distribution the model must learn)."""

  mu_scale: float = 1.0
  noise: float = 0.3
  name = "nonzero_mean"

  def __post_init__(self):
    super().__post_init__()
    _check_option(self.name, "mu_scale", self.mu_scale)

  def mu(self, d: int, dtype=None) -> Array:
    """The prior mean ``[d]``."""
    return jnp.full((d,), self.mu_scale, _validate.float_dtype(dtype))

  def _mean(self, d, dtype):
    return self.mu(d, dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Anisotropic(Linear):
  """Inputs ``x = U diag(sqrt(lam)) z``, ``z ~ N(0, I)``: eigenvalues
  ``lam_i = kappa^(-i / (d - 1))`` rescaled to sum ``d``; ``U = I`` or,
  with ``rotate``, a Haar-random rotation drawn per prompt (examples and
  queries share it)."""

  kappa: float = 10.0
  rotate: bool = False
  noise: float = 0.1
  name = "anisotropic"

  def __post_init__(self):
    super().__post_init__()
    _check_option(self.name, "kappa", self.kappa, low=1)
    if not isinstance(self.rotate, (bool, np.bool_)):
      raise TypeError(f"tasks.get('anisotropic'): rotate must be True or "
                      f"False, got {self.rotate!r}.")

  def eigenvalues(self, d: int, dtype=None) -> Array:
    """``[d]``, from largest to smallest, ratio ``kappa``, sum ``d``."""
    dtype = _validate.float_dtype(dtype)
    t = jnp.arange(d, dtype=dtype) / max(d - 1, 1)
    lam = jnp.asarray(self.kappa, dtype) ** -t
    return lam * d / jnp.sum(lam)

  def _inputs(self, key, shape, dtype):
    kz, ku = jax.random.split(key)
    batch, _, d = shape
    x = jax.random.normal(kz, shape, dtype) * jnp.sqrt(self.eigenvalues(
        d, dtype))
    if not self.rotate:
      return x
    # The rotation in float32 at least: no QR below it.
    wide = jnp.promote_types(dtype, jnp.float32)
    q, r = jnp.linalg.qr(jax.random.normal(ku, (batch, d, d), wide))
    # Sign fix: QR of a Gaussian matrix with diag(R) > 0 is Haar.
    q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
    return jnp.einsum("bmd,bed->bme", x.astype(wide), q,
                      precision=jax.lax.Precision.HIGHEST).astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseLinear(TaskFamily):
  """``w`` with ``k`` nonzero ``N(0, w_scale^2)`` coordinates on a uniformly
  random support per prompt; noiseless. Needs ``k <= d``. Garg et al.'s
  sparsity 3 and their five Lasso baselines (:data:`LASSO_ALPHAS`)."""

  k: int = 3
  w_scale: float = 1.0
  name = "sparse_linear"

  def __post_init__(self):
    super().__post_init__()
    _check_option(self.name, "k", self.k, low=1, integer=True)
    _check_option(self.name, "w_scale", self.w_scale, low=0, strict=True)

  def error_scale(self, d):
    super().error_scale(d)
    return float(self.k)

  def _check_sizes(self, fn, d):
    if self.k > d:
      raise ValueError(f"{fn}: k={self.k} nonzero coordinates need d >= k, "
                       f"got d={d}.")

  def _labels(self, key, x, dtype):
    kw, ks = jax.random.split(key)
    batch, _, d = x.shape
    w = self.w_scale * jax.random.normal(kw, (batch, d), dtype)
    rank = jnp.argsort(jnp.argsort(jax.random.uniform(ks, (batch, d)), -1), -1)
    w = jnp.where(rank < self.k, w, 0)
    return _dot(x, w), w

  def _baselines(self):
    return {**super()._baselines(),
            **{lasso_name(alpha): functools.partial(lasso, alpha=alpha)
               for alpha in LASSO_ALPHAS}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearClassification(TaskFamily):
  """``y = sign(x^T w)``, ``w ~ N(0, I)``: labels +-1, scored by squared
  error and by :func:`accuracy` (Garg et al.'s metric)."""

  name = "linear_classification"
  reports_accuracy = True

  def error_scale(self, d):
    super().error_scale(d)
    return 1.0

  def _labels(self, key, x, dtype):
    w = jax.random.normal(key, (x.shape[0], x.shape[-1]), dtype)
    return jnp.sign(_dot(x, w)), w


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quadratic(TaskFamily):
  """Garg et al.'s quadratic regression: ``y = (x * x)^T w / sqrt(3)``,
  ``w ~ N(0, I)`` (unit variance per coordinate, as the linear task's)."""

  name = "quadratic"
  has_w = False

  def _labels(self, key, x, dtype):
    w = jax.random.normal(key, (x.shape[0], x.shape[-1]), dtype)
    return _dot(x * x, w) / math.sqrt(3), None

  def _baselines(self):
    return {**super()._baselines(), "mlp_adam": mlp_adam,
            "mlp_lbfgs": mlp_lbfgs}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Relu2nn(TaskFamily):
  """A random network per prompt: ``y = sqrt(2 / hidden) relu(x^T W1) w2``,
  ``W1 [d, hidden]`` and ``w2 [hidden]`` standard normal."""

  hidden: int = 100
  name = "relu_2nn"
  has_w = False

  def __post_init__(self):
    super().__post_init__()
    _check_option(self.name, "hidden", self.hidden, low=1, integer=True)

  def _labels(self, key, x, dtype):
    k1, k2 = jax.random.split(key)
    batch, _, d = x.shape
    w1 = jax.random.normal(k1, (batch, d, self.hidden), dtype)
    w2 = jax.random.normal(k2, (batch, self.hidden), dtype)
    act = jax.nn.relu(jnp.einsum("bmd,bdh->bmh", x, w1,
                                 precision=jax.lax.Precision.HIGHEST))
    return math.sqrt(2 / self.hidden) * _dot(act, w2), None

  def _label_bytes(self, batch, rows, d, dtype):
    # W1, w2 and the hidden activations of every example.
    return _validate.array_bytes(dtype, (batch, d, self.hidden),
                                 (batch, self.hidden),
                                 (batch, rows, self.hidden))

  def _baselines(self):
    # The task's own architecture, as Garg et al.'s baseline is.
    return {**super()._baselines(),
            "mlp_adam": functools.partial(mlp_adam, hidden=self.hidden),
            "mlp_lbfgs": functools.partial(mlp_lbfgs, hidden=self.hidden)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionTree(TaskFamily):
  """A random full binary tree of ``depth`` per prompt (Garg et al.): node
  ``i`` sends ``x`` right when ``x[f_i] > 0``, ``f_i`` uniform over the
  ``d`` coordinates; the ``2^depth`` leaves hold ``N(0, 1)`` values.
  ``depth <= 30``: node indices are int32 (and a tree of depth 30 holds 2^30
  leaves per prompt, refused by the memory check anyway)."""

  depth: int = 4
  name = "decision_tree"
  has_w = False

  def __post_init__(self):
    super().__post_init__()
    _validate.int_between(f"tasks.get({self.name!r})", "depth", self.depth,
                          low=1, high=30)

  def error_scale(self, d):
    super().error_scale(d)
    return 1.0

  def _label_bytes(self, batch, rows, d, dtype):
    # Leaf values, node features, and each example's node index.
    return (_validate.array_bytes(dtype, (batch, 2 ** self.depth))
            + _validate.array_bytes(jnp.int32, (batch, 2 ** self.depth - 1),
                                    (batch, rows)))

  def _labels(self, key, x, dtype):
    kf, kl = jax.random.split(key)
    batch, rows, d = x.shape
    nodes = 2 ** self.depth - 1
    feature = jax.random.randint(kf, (batch, nodes), 0, d)
    leaves = jax.random.normal(kl, (batch, nodes + 1), dtype)
    node = jnp.zeros((batch, rows), jnp.int32)
    for _ in range(self.depth):
      f = jnp.take_along_axis(feature, node, axis=1)  # [B, M]
      right = jnp.take_along_axis(x, f[..., None], axis=2)[..., 0] > 0
      node = 2 * node + 1 + right.astype(jnp.int32)
    return jnp.take_along_axis(leaves, node - nodes, axis=1), None

  def _baselines(self):
    # Garg et al.'s: a tree of the task's depth, one grown without a limit,
    # gradient-boosted trees; and the 2-layer network of their figure.
    return {**super()._baselines(),
            "tree": functools.partial(tree, max_depth=self.depth),
            "tree_unbounded": functools.partial(tree, max_depth=None),
            "boosted_trees": boosted_trees, "mlp_adam": mlp_adam}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedNoise(TaskFamily):
  """``y = x^T w + sigma eps`` with ``sigma`` drawn per prompt from
  ``noise_levels`` (probabilities ``noise_probs``, default uniform), ``w ~
  N(0, w_scale^2 I)``. The levels must be ``> 0``."""

  noise_levels: tuple = (0.1, 0.5, 1.0)
  noise_probs: tuple | None = None
  w_scale: float = 1.0
  name = "mixed_noise"

  def __post_init__(self):
    super().__post_init__()
    fn = "tasks.get('mixed_noise')"
    levels = self.noise_levels
    if not isinstance(levels, (tuple, list)) or not levels:
      raise TypeError(f"{fn}: noise_levels must be a non-empty tuple of "
                      f"numbers > 0, got {levels!r}.")
    for level in levels:
      _check_option(self.name, "noise_levels", level, low=0, strict=True)
    object.__setattr__(self, "noise_levels", tuple(float(v) for v in levels))
    if self.noise_probs is not None:
      probs = self.noise_probs
      if not isinstance(probs, (tuple, list)) or len(probs) != len(levels):
        raise ValueError(f"{fn}: noise_probs must be a tuple of "
                         f"{len(levels)} probabilities (one per level), got "
                         f"{probs!r}.")
      for p in probs:
        _check_option(self.name, "noise_probs", p, low=0)
      if abs(sum(probs) - 1) > 1e-9:
        raise ValueError(f"{fn}: noise_probs must sum to 1, got "
                         f"{sum(probs)!r}.")
      object.__setattr__(self, "noise_probs", tuple(float(p) for p in probs))
    _check_option(self.name, "w_scale", self.w_scale, low=0, strict=True)

  def probs(self) -> tuple[float, ...]:
    n = len(self.noise_levels)
    return self.noise_probs or tuple([1 / n] * n)

  def _labels(self, key, x, dtype):
    kw, kl, kn = jax.random.split(key, 3)
    batch, rows, d = x.shape
    w = self.w_scale * jax.random.normal(kw, (batch, d), dtype)
    level = jax.random.choice(kl, len(self.noise_levels), (batch,),
                              p=jnp.asarray(self.probs()))
    sigma = jnp.asarray(self.noise_levels, dtype)[level]
    return _dot(x, w) + sigma[:, None] * jax.random.normal(
        kn, (batch, rows), dtype), w

  def level_posterior(self, task: ridge.Task) -> Array:
    r"""Posterior probabilities of the noise levels given the context: ``[B, J]``.

    :math:`\pi_j \propto p_j \, N(y; 0, s^2 X X^\top + \sigma_j^2 I)`, the
    marginal likelihood in the basis of the SVD ``X = U diag(s_i) V^T``:
    along ``u_i`` the label has standard deviation ``D_ij = hypot(s s_i,
    sigma_j)``, off the column space ``sigma_j``, so that

    .. math::
      \log N = -\tfrac12 \sum_i (u_i^\top y / D_{ij})^2
        - \tfrac12 \|y - U U^\top y\|^2 / \sigma_j^2
        - \sum_i \log D_{ij} - (N - k) \log \sigma_j + \text{const},

    finite in float32 at any level (a Cholesky factor of the ``N x N`` kernel
    is not: at ``sigma = 1e-3`` its condition number passes ``1 / eps``), the
    weights normalised in the log domain.
    """
    task = _reference_task(task)
    x, y = task.x, task.y
    u, s, _ = jnp.linalg.svd(x, full_matrices=False)
    coef = jnp.einsum("bnk,bn->bk", u, y, precision=_EXACT)
    off = jnp.linalg.norm(y - jnp.einsum("bnk,bk->bn", u, coef,
                                         precision=_EXACT), axis=-1)
    outside = x.shape[-2] - s.shape[-1]

    def log_marginal(sigma):
      spread = jnp.hypot(self.w_scale * s, sigma)
      return -(0.5 * jnp.sum((coef / spread) ** 2, -1)
               + 0.5 * (off / sigma) ** 2 + jnp.sum(jnp.log(spread), -1)
               + outside * math.log(sigma))
    logp = jnp.stack([log_marginal(s_j) + math.log(p) if p > 0 else
                      jnp.full(x.shape[:1], -jnp.inf, x.dtype)
                      for s_j, p in zip(self.noise_levels, self.probs())], -1)
    return jax.nn.softmax(logp, axis=-1)

  def bayes(self, task: ridge.Task) -> Array:
    """``sum_j pi_j x_q^T E[w | X, y, sigma_j]`` (module doc): ``[B, Q]``."""
    task = _reference_task(task)
    svd = _svd(task.x)
    preds = jnp.stack([_predict(task, _shrunk_solve(svd, task.y, _noise_to_prior(
        sigma, self.w_scale, task.x.dtype))) for sigma in self.noise_levels],
                      -1)
    return jnp.sum(preds * self.level_posterior(task)[:, None, :], -1)


FAMILIES: dict[str, TaskFamily] = {
    family.name: family for family in (
        Linear(), SparseLinear(), NoisyLinear(), LinearClassification(),
        Quadratic(), Relu2nn(), DecisionTree(), NonzeroMean(), MixedNoise(),
        Anisotropic())}


def get(name: str, **options) -> TaskFamily:
  """The family ``name`` with ``options`` (its own fields; the rest keep their defaults).

  Raises:
    ValueError: ``name`` is not a family (the message lists them), or an
      option's value is out of range.
    TypeError: an option the family does not have (the message lists its
      options), or of the wrong type.
  """
  if not isinstance(name, str) or name not in FAMILIES:
    raise ValueError(f"tasks.get: name must be one of {', '.join(FAMILIES)}; "
                     f"got {name!r}.")
  family = FAMILIES[name]
  allowed = tuple(f.name for f in dataclasses.fields(family))
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise TypeError(f"tasks.get({name!r}): no option {', '.join(unknown)}; "
                    f"the options of {name} are {', '.join(allowed)}.")
  options = {k: tuple(v) if isinstance(v, list) else v
             for k, v in options.items()}
  return dataclasses.replace(family, **options)
