r"""In-context task families: samplers of :class:`elsa.ridge.Task` batches and their reference predictors.

A family is data (a frozen dataclass of its options) with two jobs:

* ``family.sample(key, batch=B, n_train=N, d=d, n_query=Q, dtype=...)``: a
  batch of prompts as an :class:`elsa.ridge.Task` (``x [B, N, d]``, ``y [B,
  N]``, ``x_query [B, Q, d]``, ``y_query [B, Q]``, ``w_true [B, d]``; scalar
  targets, so :mod:`elsa.forms`, :mod:`elsa.training` and
  :mod:`elsa.decompile` take every family). Pure JAX, jit-compiled, from an
  explicit key: the same key gives the same batch. Families without a weight
  vector (``quadratic``, ``relu_2nn``, ``decision_tree``) fill ``w_true``
  with NaN, so that nothing can use it by mistake.
* ``family.references``: ``{name: predictor}``, each ``predictor(task) ->
  [B, Q]``; ``"bayes"`` (also ``family.bayes``) where the posterior mean has
  a closed form, plus the baselines of Garg et al. (2022):
  ``least_squares`` (minimum norm), ``ridge`` (at ``ridge_lam`` in the
  library's normalisation, :func:`elsa.ridge.solve`), ``lasso`` (sparse
  tasks), ``knn`` (the 3 nearest examples weighted by inverse distance),
  ``averaging`` (:math:`w = \frac1N \sum_i y_i x_i`), and for the nonlinear
  tasks a network (``mlp``) or a tree (``tree``) fitted per prompt.
  ``lasso``, ``mlp`` and ``tree`` run scikit-learn on the host, one prompt
  at a time: they are not jit-able (call them on concrete tasks) and are
  the slow ones; every other predictor is a jnp function.

The families (inputs ``x ~ N(0, I_d)`` unless said; Garg et al.'s scales,
so that a zero predictor has squared error about ``d`` on the linear ones):

===========================  ===============================================================
``linear``                   ``y = x^T w``, ``w ~ N(0, w_scale^2 I)``, ``noise`` (default 0)
``sparse_linear``            ``k`` of the ``d`` coordinates of ``w`` nonzero (a random support per prompt)
``noisy_linear``             ``linear`` with ``noise = 0.5``
``linear_classification``    ``y = sign(x^T w)``
``quadratic``                ``y = (x * x)^T w / sqrt(3)``
``relu_2nn``                 ``y = sqrt(2 / hidden) relu(x^T W1) w2``, a random network per prompt
``decision_tree``            a random depth-``depth`` tree per prompt: node feature uniform, split at 0, leaves ``N(0, 1)``
``nonzero_mean``             ``w ~ N(mu, w_scale^2 I)``, ``mu = mu_scale * 1_d`` fixed, unknown to the model
``mixed_noise``              the noise level drawn per prompt from ``noise_levels`` (``noise_probs``)
``anisotropic``              ``x ~ N(0, U diag(lam_i) U^T)``, ``lam_i`` geometric from 1 to ``1 / kappa``
                             (trace ``d``); ``U = I``, or a fresh random rotation per prompt (``rotate``)
===========================  ===============================================================

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
  >>> batch = family.sample(jax.random.key(0), batch=8, n_train=16, d=4)
  >>> family.bayes(batch).shape
  (8, 1)

References: Garg, Tsipras, Liang, Valiant (2022), "What can transformers
learn in-context?" (task set and baselines); Zhang, Wu, Bartlett (2024),
arXiv 2402.14951 (non-zero mean); Vladymyrov, von Oswald et al. (2024),
arXiv 2402.14180 (mixed noise); Fu et al. (2023), arXiv 2310.17086, and
Gatmiry et al. (2024), arXiv 2410.21698 (ill-conditioned inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from elsa import _validate, ridge
from elsa.attention import Array

Predictor = Callable[[ridge.Task], Array]


# --- reference predictors: task -> [B, Q] ---------------------------------------


def _predict(task: ridge.Task, w: Array) -> Array:
  return jnp.einsum("bqd,bd->bq", task.x_query, w,
                    precision=jax.lax.Precision.HIGHEST)


def posterior_mean_w(task: ridge.Task, *, mu, ratio) -> Array:
  r"""``E[w | X, y] = mu + (X^T X + ratio I)^+ X^T (y - X mu)``: ``[B, d]``.

  ``ratio = sigma^2 / s^2`` (noise variance over prior variance), ``mu``
  ``[d]`` or ``[B, d]``; ``ratio = 0`` gives the minimum-norm correction of
  ``mu`` (the noiseless posterior mean). Solved as ridge in the library's
  normalisation, :func:`elsa.ridge.solve` at ``lam = ratio / N``.
  """
  mu = jnp.broadcast_to(jnp.asarray(mu, task.x.dtype), task.w_true.shape)
  resid = task.y - jnp.einsum("bnd,bd->bn", task.x, mu,
                              precision=jax.lax.Precision.HIGHEST)
  n_train = task.x.shape[-2]
  return mu + ridge.solve(task.x, resid, lam=ratio / n_train)


def least_squares(task: ridge.Task) -> Array:
  """Minimum-norm least squares, ``x_q^T X^+ y``."""
  return _predict(task, ridge.solve(task.x, task.y, lam=0.0))


def ridge_predictor(task: ridge.Task, *, lam: float) -> Array:
  """Ridge at ``lam`` in the library's normalisation (:func:`elsa.ridge.solve`)."""
  return _predict(task, ridge.solve(task.x, task.y, lam=lam))


def averaging(task: ridge.Task) -> Array:
  r"""Garg et al.'s averaging estimator, :math:`x_q^\top \frac1N \sum_i y_i x_i`."""
  return _predict(task, jnp.mean(task.x * task.y[..., None], axis=-2))


def knn(task: ridge.Task, *, k: int = 3) -> Array:
  """The ``k`` nearest examples (Euclidean), weighted by inverse distance.

  Garg et al.'s ``NNModel`` (and scikit-learn's ``KNeighborsRegressor(k,
  weights='distance')``): a query that coincides with an example gets that
  example's label. ``k`` is capped at ``N``.
  """
  k = min(k, task.x.shape[-2])
  dist = jnp.sqrt(jnp.maximum(jnp.sum(
      (task.x_query[..., :, None, :] - task.x[..., None, :, :]) ** 2, -1),
      0.0))  # [B, Q, N]
  neg, idx = jax.lax.top_k(-dist, k)
  near = -neg
  labels = jnp.take_along_axis(task.y[..., None, :], idx, axis=-1)
  exact = near == 0
  weights = jnp.where(jnp.any(exact, -1, keepdims=True), exact.astype(
      near.dtype), 1 / jnp.where(exact, 1, near))
  return jnp.sum(weights * labels, -1) / jnp.sum(weights, -1)


def _per_prompt(task: ridge.Task, fit_predict) -> Array:
  """``fit_predict(x [N, d], y [N], x_query [Q, d]) -> [Q]`` on the host, for
  every prompt, in float64; returned in the task's dtype."""
  x, y, xq = (np.asarray(a, np.float64) for a in (task.x, task.y,
                                                   task.x_query))
  out = np.stack([fit_predict(x[b], y[b], xq[b]) for b in range(x.shape[0])])
  return jnp.asarray(out, task.x.dtype)


def lasso(task: ridge.Task, *, alpha: float) -> Array:
  r"""Lasso per prompt (scikit-learn, no intercept), host-side:
  :math:`\min_w \frac{1}{2N}\|y - Xw\|^2 + \alpha \|w\|_1`."""
  from sklearn.linear_model import Lasso  # pylint: disable=import-outside-toplevel

  def fit_predict(x, y, xq):
    model = Lasso(alpha=alpha, fit_intercept=False, max_iter=10_000,
                  tol=1e-8)
    return model.fit(x, y).predict(xq)
  return _per_prompt(task, fit_predict)


def mlp(task: ridge.Task, *, hidden: int = 100, seed: int = 0) -> Array:
  """A one-hidden-layer ReLU network fitted per prompt (scikit-learn
  ``MLPRegressor``, L-BFGS, ``alpha = 1e-4`` weight decay), host-side:
  Garg et al.'s "2-layer NN, GD" baseline with a full-batch optimiser."""
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


def tree(task: ridge.Task, *, max_depth: int = 4) -> Array:
  """A CART regression tree of ``max_depth`` fitted per prompt
  (scikit-learn ``DecisionTreeRegressor``), host-side."""
  from sklearn.tree import DecisionTreeRegressor  # pylint: disable=import-outside-toplevel

  def fit_predict(x, y, xq):
    model = DecisionTreeRegressor(max_depth=max_depth, random_state=0)
    return model.fit(x, y).predict(xq)
  return _per_prompt(task, fit_predict)


HOST_REFERENCES = ("lasso", "mlp", "tree")  # not jit-able: scikit-learn


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

  def __post_init__(self):
    _check_option(self.name, "ridge_lam", self.ridge_lam, low=0)

  def options(self) -> dict:
    """The family's options and their values."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def sample(self, key: Array, *, batch: int, n_train: int, d: int,
             n_query: int = 1, dtype=None) -> ridge.Task:
    """``batch`` prompts of ``n_train`` examples and ``n_query`` queries in ``d`` dimensions.

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
    _validate.fits_memory(fn, _validate.array_bytes(
        dtype, (batch, n_train + n_query, d + 1), (batch, d)), sizes)
    return _sample(self, key, dtype=dtype, **sizes)

  def _check_sizes(self, fn: str, d: int) -> None:
    del fn, d

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
            "knn": knn, "averaging": averaging}


@functools.partial(jax.jit, static_argnames=("family", "batch", "n_train", "d",
                                             "n_query", "dtype"))
def _sample(family: TaskFamily, key, *, batch, n_train, d, n_query, dtype):
  kx, ky = jax.random.split(key)
  x = family._inputs(kx, (batch, n_train + n_query, d), dtype)  # pylint: disable=protected-access
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
    d = task.x.shape[-1]
    return _predict(task, posterior_mean_w(
        task, mu=self._mean(d, task.x.dtype),
        ratio=(self.noise / self.w_scale) ** 2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoisyLinear(Linear):
  """:class:`Linear` with label noise (default 0.5)."""

  noise: float = 0.5
  name = "noisy_linear"


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
    q, r = jnp.linalg.qr(jax.random.normal(ku, (batch, d, d), dtype))
    # Sign fix: QR of a Gaussian matrix with diag(R) > 0 is Haar.
    q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
    return jnp.einsum("bmd,bed->bme", x, q,
                      precision=jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseLinear(TaskFamily):
  """``w`` with ``k`` nonzero ``N(0, w_scale^2)`` coordinates on a uniformly
  random support per prompt; noiseless. Needs ``k <= d``."""

  k: int = 2
  w_scale: float = 1.0
  lasso_alpha: float = 0.01
  name = "sparse_linear"

  def __post_init__(self):
    super().__post_init__()
    _check_option(self.name, "k", self.k, low=1, integer=True)
    _check_option(self.name, "w_scale", self.w_scale, low=0, strict=True)
    _check_option(self.name, "lasso_alpha", self.lasso_alpha, low=0,
                  strict=True)

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
            "lasso": functools.partial(lasso, alpha=self.lasso_alpha)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearClassification(TaskFamily):
  """``y = sign(x^T w)``, ``w ~ N(0, I)`` (labels +-1, scored by squared error)."""

  name = "linear_classification"

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
    return {**super()._baselines(), "mlp": mlp}


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

  def _baselines(self):
    return {**super()._baselines(), "mlp": mlp}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionTree(TaskFamily):
  """A random full binary tree of ``depth`` per prompt (Garg et al.): node
  ``i`` sends ``x`` right when ``x[f_i] > 0``, ``f_i`` uniform over the
  ``d`` coordinates; the ``2^depth`` leaves hold ``N(0, 1)`` values."""

  depth: int = 4
  name = "decision_tree"
  has_w = False

  def __post_init__(self):
    super().__post_init__()
    _check_option(self.name, "depth", self.depth, low=1, integer=True)

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
    return {**super()._baselines(),
            "tree": functools.partial(tree, max_depth=self.depth)}


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
    marginal likelihood from the Cholesky factor of the ``N x N`` kernel.
    """
    x, y = task.x, task.y
    gram = self.w_scale ** 2 * jnp.einsum(
        "bnd,bmd->bnm", x, x, precision=jax.lax.Precision.HIGHEST)
    eye = jnp.eye(x.shape[-2], dtype=x.dtype)

    def log_marginal(sigma):
      chol = jnp.linalg.cholesky(gram + sigma ** 2 * eye)
      z = jax.scipy.linalg.solve_triangular(chol, y[..., None], lower=True)
      logdet = 2 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)),
                           -1)
      return -0.5 * (jnp.sum(z[..., 0] ** 2, -1) + logdet)
    logp = jnp.stack([log_marginal(s) + math.log(p) if p > 0 else
                      jnp.full(x.shape[:1], -jnp.inf, x.dtype)
                      for s, p in zip(self.noise_levels, self.probs())], -1)
    return jax.nn.softmax(logp, axis=-1)

  def bayes(self, task: ridge.Task) -> Array:
    """``sum_j pi_j x_q^T E[w | X, y, sigma_j]`` (module doc): ``[B, Q]``."""
    preds = jnp.stack([_predict(task, posterior_mean_w(
        task, mu=0.0, ratio=(s / self.w_scale) ** 2))
                       for s in self.noise_levels], -1)
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
