r"""Ridge regression and its references: loss, batch gradient descent, closed form, tasks.

Objective, for examples ``x: [N, d]`` and targets ``y: [N]`` (or ``[N, n_out]``):

.. math::
  L(w) = \frac{1}{2N} \sum_i \|y_i - x_i^\top w\|^2 + \frac{\lambda}{2}\|w\|^2,
  \qquad w_{t+1} = (1 - \eta\lambda) w_t - \frac{\eta}{N} X^\top (X w_t - y).

Nothing here knows about attention: these are the independent references the
ELSA constructions are checked against.

Arguments are checked as :mod:`elsa._validate` says (wrong type or dtype:
``TypeError``; wrong shape or value: ``ValueError``): ``N >= 1`` examples of
``d >= 1`` features; ``lam`` a scalar or an array whose shape broadcasts to
the batch axes of ``x``, the same rule in every function; and, where ridge GD
and its minimiser need them, finite ``lam >= 0`` and ``eta > 0``, checked
when the values are concrete. A call whose outputs (the ``[d, d]`` normal
matrix of every task, every GD iterate, the sampled tasks) cannot fit in the
devices' memory is refused before anything is allocated.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from elsa import _validate

Array = jax.Array

# The references must be exact on every backend: at the default precision a
# float32 matmul runs in bf16/TF32 on TPUs and Ampere-or-newer GPUs.
_EXACT = jax.lax.Precision.HIGHEST


def _mm(a: Array, b: Array) -> Array:
  return jnp.matmul(a, b, precision=_EXACT)


def _check_x(fn: str, x: Array) -> None:
  """``x [..., N, d]``, floating, with ``N >= 1`` (the objective divides by N)
  and ``d >= 1``."""
  if jnp.ndim(x) < 2:
    raise ValueError(f"{fn}: x must have shape [..., N, d], got {jnp.shape(x)}.")
  _validate.floating(fn, "x", x)
  if jnp.shape(x)[-2] < 1:
    raise ValueError(f"{fn}: x must hold N >= 1 examples (shape [..., N, d]), "
                     f"got shape {jnp.shape(x)}.")
  if jnp.shape(x)[-1] < 1:
    raise ValueError(f"{fn}: x must hold d >= 1 features (shape [..., N, d]), "
                     f"got shape {jnp.shape(x)}.")


def _check_gram_fits(fn: str, x: Array, more: tuple[tuple[int, ...], ...] = (),
                     fields: dict | None = None) -> None:
  """Refuses ``x [..., N, d]`` whose ``[..., d, d]`` normal matrices, with
  arrays of the shapes ``more``, cannot fit in memory; the message names
  ``fields`` (default: the shape of ``x``)."""
  batch, d = jnp.shape(x)[:-2], jnp.shape(x)[-1]
  nbytes = _validate.array_bytes(jnp.result_type(x), (*batch, d, d), *more)
  _validate.fits_memory(fn, nbytes, fields or {"x.shape": jnp.shape(x)})


def _check_xy(fn: str, x: Array, y: Array) -> None:
  """Shapes and dtypes of ``x [..., N, d]`` and ``y [..., N(, n_out)]``."""
  _check_x(fn, x)
  _validate.same_dtype(fn, "y", y, "x", x)
  n_x = jnp.shape(x)[-2]
  lead = jnp.shape(x)[:-2]
  if jnp.shape(y)[:len(lead) + 1] != (*lead, n_x) or jnp.ndim(y) not in (
      jnp.ndim(x) - 1, jnp.ndim(x)):
    raise ValueError(f"{fn}: y must have shape [..., N] or [..., N, n_out] "
                     f"matching x of shape {jnp.shape(x)} (N={n_x}), got "
                     f"{jnp.shape(y)}.")


def _as_matrix(x: Array, y: Array) -> tuple[Array, bool]:
  """``y`` as ``[..., N, n_out]``, and whether it came as ``[..., N]``."""
  vector = jnp.ndim(y) == jnp.ndim(x) - 1
  return (y[..., None] if vector else y), vector


def _check_lam(fn: str, lam, x: Array) -> None:
  """``lam`` is a scalar or broadcasts to the batch axes ``[...]`` of ``x``
  (one strength per task), without adding axes of its own."""
  batch = jnp.shape(x)[:-2]
  try:
    fits = jnp.broadcast_shapes(jnp.shape(lam), batch) == batch
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"{fn}: lam must be a scalar or broadcast to the batch "
                     f"shape {batch} of x (shape {jnp.shape(x)}), got shape "
                     f"{jnp.shape(lam)}.")


def normal_equations(x: Array, y: Array, *, lam) -> tuple[Array, Array]:
  """``A = X^T X / N + lam I`` ``[..., d, d]`` and ``b = X^T y / N`` ``[..., d(, n_out)]``."""
  _check_xy("normal_equations", x, y)
  _check_lam("normal_equations", lam, x)
  _check_gram_fits("normal_equations", x)
  return _normal_equations(x, y, lam=lam)


def _normal_equations(x: Array, y: Array, *, lam) -> tuple[Array, Array]:
  n_train, d = jnp.shape(x)[-2:]
  xt = jnp.swapaxes(x, -1, -2)
  a = _mm(xt, x) / n_train
  a = a + jnp.asarray(lam, x.dtype)[..., None, None] * jnp.eye(d, dtype=x.dtype)
  y2, vector = _as_matrix(x, y)
  b = _mm(xt, y2) / n_train
  return a, (b[..., 0] if vector else b)


def _check_w(fn: str, w: Array, x: Array, y: Array) -> None:
  """``w`` must be ``[..., d]`` (vector ``y``) or ``[..., d, n_out]``, batch axes
  broadcasting with those of ``x``, in the dtype of ``x``."""
  d = jnp.shape(x)[-1]
  tail = (d,) if jnp.ndim(y) == jnp.ndim(x) - 1 else (d, jnp.shape(y)[-1])
  shape = jnp.shape(w)
  want = (*jnp.shape(x)[:-2], *tail)
  ok = jnp.ndim(w) >= len(tail) and shape[len(shape) - len(tail):] == tail
  if ok:
    try:
      jnp.broadcast_shapes(shape[:len(shape) - len(tail)], jnp.shape(x)[:-2])
    except ValueError:
      ok = False
  if not ok:
    raise ValueError(f"{fn}: w must have shape {want} (or batch axes that "
                     f"broadcast) for x of shape {jnp.shape(x)} and y of shape "
                     f"{jnp.shape(y)}, got {shape}.")
  if jnp.result_type(w) != jnp.result_type(x):
    raise TypeError(f"{fn}: w has dtype {jnp.result_type(w)} but x has dtype "
                    f"{jnp.result_type(x)}; cast one of them explicitly.")


def loss(w: Array, x: Array, y: Array, *, lam) -> Array:
  """The ridge objective ``L(w)`` for ``w: [..., d(, n_out)]``; returns ``[...]``."""
  _check_xy("loss", x, y)
  _check_lam("loss", lam, x)
  _check_w("loss", w, x, y)
  y2, vector = _as_matrix(x, y)
  w2 = w[..., None] if vector else w
  residual = _mm(x, w2) - y2
  n_train = jnp.shape(x)[-2]
  return (0.5 * jnp.sum(residual**2, axis=(-2, -1)) / n_train
          + 0.5 * jnp.asarray(lam, x.dtype) * jnp.sum(w2**2, axis=(-2, -1)))


def gd(x: Array, y: Array, *, lam, eta, steps: int, w0: Array | None = None
       ) -> Array:
  """All iterates of batch gradient descent on :func:`loss`.

  Args:
    x: ``[..., N, d]``, floating, ``N >= 1``.
    y: ``[..., N]`` or ``[..., N, n_out]``, in the dtype of ``x``.
    lam: ridge strength ``>= 0``, a scalar or one per task (a shape that
      broadcasts to ``[...]``); may be traced.
    eta: step size ``> 0``, a scalar or a schedule ``[steps]``; may be traced.
    steps: number of steps (static), an int or numpy integer ``>= 0``.
    w0: start ``[..., d(, n_out)]`` in the dtype of ``x``; zero by default.

  Returns:
    ``[steps + 1, ..., d(, n_out)]``: ``w_0, w_1, ..., w_steps``.

  Raises:
    ValueError: a shape does not match, ``N = 0``, ``d = 0``, ``steps < 0``,
      a concrete ``lam < 0`` or ``eta <= 0`` or a non-finite one, or the
      iterates cannot fit in memory.
    TypeError: ``x`` is not floating, ``y`` or ``w0`` has another dtype, or
      ``steps`` is not an integer.
  """
  steps = _validate.int_at_least("gd", "steps", steps, low=0)
  _validate.at_least("gd", "lam", lam, low=0, strict=False)
  _validate.at_least("gd", "eta", eta, low=0, strict=True)
  return _gd(x, y, lam=lam, eta=eta, steps=steps, w0=w0)


# Jitted so that eager calls compile once per shape instead of once per op.
@functools.partial(jax.jit, static_argnames=("steps",))
def _gd(x: Array, y: Array, *, lam, eta, steps: int, w0: Array | None
        ) -> Array:
  # Shapes are checked here, once per compile, not on every eager call.
  _check_xy("gd", x, y)
  _check_lam("gd", lam, x)
  iterates = (steps + 1, *jnp.shape(x)[:-2], jnp.shape(x)[-1],
              *jnp.shape(y)[jnp.ndim(x) - 1:])
  _check_gram_fits("gd", x, (iterates,), {
      "steps": steps, "x.shape": jnp.shape(x), "y.shape": jnp.shape(y)})
  eta = jnp.asarray(eta, x.dtype)
  if eta.shape not in ((), (steps,)):
    raise ValueError(f"gd: eta must be a scalar or a schedule of shape "
                     f"({steps},) for steps={steps}, got shape {eta.shape}.")
  etas = jnp.broadcast_to(eta, (steps,))
  y2, vector = _as_matrix(x, y)
  a, b = _normal_equations(x, y2, lam=lam)
  if w0 is None:
    w = jnp.zeros_like(b)
  else:
    w0 = jnp.asarray(w0)
    if w0.dtype != x.dtype:
      raise TypeError(f"gd: w0 has dtype {w0.dtype} but x has dtype "
                      f"{x.dtype}; cast it explicitly.")
    want = b[..., 0].shape if vector else b.shape
    try:
      w = jnp.broadcast_to(w0[..., None] if vector else w0, b.shape)
    except ValueError:
      raise ValueError(f"gd: w0 must broadcast to {want}, got shape "
                       f"{w0.shape}.") from None

  def step(w, eta_t):
    # a @ w - b is the gradient of the ridge objective.
    new = w - eta_t * (_mm(a, w) - b)
    return new, new

  _, ws = jax.lax.scan(step, w, etas)
  ws = jnp.concatenate([w[None], ws], axis=0)
  return ws[..., 0] if vector else ws


def solve(x: Array, y: Array, *, lam) -> Array:
  """The minimiser of :func:`loss`, ``(X^T X/N + lam I)^+ X^T y / N``, ``[..., d(, n_out)]``.

  Solved by an eigendecomposition of the symmetric ``A``; directions with a
  numerically zero eigenvalue (``lam = 0`` and ``N < d``) are dropped, which
  gives the minimum-norm solution: the limit of :func:`gd` from ``w0 = 0``.

  ``lam`` (a scalar, or one per task as in :func:`gd`) must be ``>= 0``: a
  concrete ``lam < 0`` raises ``ValueError``. A traced one cannot be checked;
  for it the formula is computed as written (pseudo-inverse over eigenvalues
  of either sign), which is the minimiser only while ``A`` stays positive
  semi-definite, ``lam >= -lambda_min(X^T X / N)``; below that the objective
  is unbounded below and the result is its stationary point (a saddle).
  """
  _check_xy("solve", x, y)
  _check_lam("solve", lam, x)
  _validate.at_least("solve", "lam", lam, low=0, strict=False)
  _check_gram_fits("solve", x)
  y2, vector = _as_matrix(x, y)
  a, b = _normal_equations(x, y2, lam=lam)
  evals, evecs = jnp.linalg.eigh(a)
  # Relative to the largest |eigenvalue|: A may be indefinite (traced lam < 0).
  tol = jnp.max(jnp.abs(evals), axis=-1, keepdims=True) * (
      a.shape[-1] * jnp.finfo(a.dtype).eps)
  kept = jnp.abs(evals) > tol
  inv = jnp.where(kept, 1 / jnp.where(kept, evals, 1), 0)
  w = _mm(evecs, inv[..., None] * _mm(jnp.swapaxes(evecs, -1, -2), b))
  return w[..., 0] if vector else w


def stability_limit(x: Array, *, lam) -> Array:
  """``2 / (lambda_max(X^T X / N) + lam)``: GD converges iff ``0 < eta <`` this. ``[...]``.

  :func:`safe_alpha` is a step inside it without an eigendecomposition.
  ``lam``: ridge strength ``>= 0`` (a concrete one is checked), broadcasting
  with the batch axes ``[...]`` of ``x``.
  """
  _check_x("stability_limit", x)
  _validate.at_least("stability_limit", "lam", lam, low=0, strict=False)
  _check_gram_fits("stability_limit", x)
  gram = _mm(jnp.swapaxes(x, -1, -2), x) / jnp.shape(x)[-2]
  return 2 / (jnp.linalg.eigvalsh(gram)[..., -1] + jnp.asarray(lam, x.dtype))


def safe_alpha(x: Array, *, lam) -> Array:
  r"""A convergent step :math:`\alpha = 1 / \|A\|_F`, ``A = X^T X / N + lam I``: ``[...]``.

  GD (and Newton–Schulz) on ``A`` converge for :math:`0 < \alpha < 2 /
  \lambda_{max}(A)`. The Frobenius norm bounds the top eigenvalue from both
  sides, :math:`\lambda_{max} \le \|A\|_F \le \sqrt{d}\, \lambda_{max}`
  (``A`` is symmetric positive semi-definite), so :math:`\alpha
  \lambda_{max} \in [d^{-1/2}, 1]`: always inside the limit of
  :func:`stability_limit`, with no eigendecomposition. From :math:`G = X^\top
  X / N`:

  .. math::
    \|A\|_F^2 = \|G\|_F^2 + 2\lambda\,\mathrm{tr}\,G + d\lambda^2.

  Args:
    x: ``[..., N, d]``, floating, ``N >= 1``.
    lam: ridge strength ``>= 0``, a scalar or one per task (a shape that
      broadcasts to ``[...]``, as in :func:`gd`); may be traced.

  Returns:
    ``[...]``, in the dtype of ``x``. Infinite where ``A = 0`` (``X = 0``,
    ``lam = 0``): any step is safe there.

  Raises:
    ValueError: ``x`` is not ``[..., N, d]`` with ``N >= 1``, ``lam`` has the
      wrong shape, or a concrete ``lam < 0``.
    TypeError: ``x`` is not floating.
  """
  _check_x("safe_alpha", x)
  _check_lam("safe_alpha", lam, x)
  _validate.at_least("safe_alpha", "lam", lam, low=0, strict=False)
  _check_gram_fits("safe_alpha", x)
  d = jnp.shape(x)[-1]
  gram = _mm(jnp.swapaxes(x, -1, -2), x) / jnp.shape(x)[-2]
  lam = jnp.asarray(lam, x.dtype)
  trace = jnp.trace(gram, axis1=-2, axis2=-1)
  frob2 = jnp.sum(gram**2, axis=(-2, -1)) + 2 * lam * trace + d * lam**2
  return 1 / jnp.sqrt(frob2)


class Task(NamedTuple):
  """A batch of ridge tasks. ``x: [B, N, d]``, ``y: [B, N(, n_out)]``, ``x_query:
  [B, Q, d]``, ``y_query: [B, Q(, n_out)]``, ``w_true: [B, d(, n_out)]``."""

  x: Array
  y: Array
  x_query: Array
  y_query: Array
  w_true: Array


def sample_tasks(key: Array, *, batch: int, n_train: int, d: int,
                 n_query: int = 1, n_out: int | None = None,
                 noise: float = 0.0, x_scale: float = 1.0, w_scale: float = 1.0,
                 x_cov: Array | None = None, dtype=None) -> Task:
  """Random linear-regression tasks: ``y = x w_true + noise * eps``.

  Args:
    key: ``jax.random`` key; the same key gives the same tasks.
    batch, n_train, d: task count, examples, input dimension (ints ``>= 1``).
    n_query: queries per task, an int ``>= 0``.
    n_out: ``None`` for scalar targets ``[..., N]``, or an int ``n_out >= 1``
      for ``[..., N, n_out]``.
    noise: standard deviation of the label noise, ``>= 0``.
    x_scale: inputs are ``x_scale * L z`` with ``z`` standard normal.
    w_scale: ``w_true`` is ``w_scale`` times standard normal.
    x_cov: optional input covariance ``[d, d]``, symmetric positive definite
      (``L`` its Cholesky factor).
    dtype: floating dtype of every array (default: JAX's default float).

  Raises:
    ValueError: a size below its minimum; a concrete ``noise < 0``, a
      non-finite ``noise``, ``x_scale`` or ``w_scale``; a concrete ``x_cov``
      of the wrong shape or not symmetric positive definite; tasks that
      cannot fit in the devices' memory (checked before allocating).
    TypeError: a size that is not an int (a bool is not one), or a dtype
      that is not floating.
  """
  fn = "sample_tasks"
  sizes = {name: _validate.int_at_least(fn, name, value, low=low)
           for name, value, low in (("batch", batch, 1),
                                    ("n_train", n_train, 1), ("d", d, 1),
                                    ("n_query", n_query, 0))}
  if n_out is not None:
    n_out = _validate.int_at_least(fn, "n_out", n_out, low=1)
  dtype = _validate.floating_dtype(fn, dtype)
  _validate.at_least(fn, "noise", noise, low=0, strict=False)
  _validate.finite(fn, "x_scale", x_scale)
  _validate.finite(fn, "w_scale", w_scale)
  if x_cov is not None:
    _check_cov(fn, x_cov, sizes["d"], dtype)
  batch, n_train, d, n_query = sizes.values()
  out = () if n_out is None else (n_out,)
  _validate.fits_memory(fn, _validate.array_bytes(
      dtype, (batch, n_train + n_query, d), (batch, n_train + n_query, *out),
      (batch, d, *out)), {**sizes, "n_out": n_out})
  return _sample_tasks(key, batch=batch, n_train=n_train, d=d, n_query=n_query,
                       n_out=n_out, noise=noise, x_scale=x_scale,
                       w_scale=w_scale, x_cov=x_cov, dtype=dtype)


def _check_cov(fn: str, x_cov, d: int, dtype) -> None:
  """``x_cov [d, d]``; a concrete one symmetric with a finite Cholesky factor
  in ``dtype`` (positive definite), since the inputs are ``L z``."""
  if jnp.shape(x_cov) != (d, d):
    raise ValueError(f"{fn}: x_cov must have shape ({d}, {d}) for d={d}, got "
                     f"{jnp.shape(x_cov)}.")
  _validate.finite(fn, "x_cov", x_cov)
  cov = _validate.concrete(x_cov)
  if cov is None:
    return
  cov = cov.astype(np.float64)
  if not np.allclose(cov, cov.T):
    raise ValueError(f"{fn}: x_cov must be symmetric (a covariance), got max "
                     f"|x_cov - x_cov^T| = {np.abs(cov - cov.T).max():.3g}.")
  if not np.all(np.isfinite(jnp.linalg.cholesky(jnp.asarray(cov, dtype)))):
    smallest = np.linalg.eigvalsh(cov)[0]
    raise ValueError(f"{fn}: x_cov must be symmetric positive definite (its "
                     f"Cholesky factor scales the inputs), got smallest "
                     f"eigenvalue {smallest:.3g} (in {dtype}).")


@functools.partial(jax.jit, static_argnames=(
    "batch", "n_train", "d", "n_query", "n_out", "dtype"))
def _sample_tasks(key: Array, *, batch: int, n_train: int, d: int,
                  n_query: int, n_out: int | None, noise, x_scale, w_scale,
                  x_cov: Array | None, dtype) -> Task:
  kx, kq, kw, kn, knq = jax.random.split(key, 5)
  out = () if n_out is None else (n_out,)
  chol = (jnp.eye(d, dtype=dtype) if x_cov is None
          else jnp.linalg.cholesky(jnp.asarray(x_cov, dtype)))
  # Exact products (as in the references): x and the noise-free labels are
  # then the same on every backend.
  draw_x = lambda key, rows: _mm(
      x_scale * jax.random.normal(key, (batch, rows, d), dtype), chol.T)
  x, x_query = draw_x(kx, n_train), draw_x(kq, n_query)
  w_true = w_scale * jax.random.normal(kw, (batch, d, *out), dtype)
  label = lambda xs, key: jnp.einsum("bnd,bd...->bn...", xs, w_true,
                                   precision=_EXACT) + (
      noise * jax.random.normal(key, (batch, xs.shape[1], *out), dtype))
  return Task(x=x, y=label(x, kn), x_query=x_query, y_query=label(x_query, knq),
              w_true=w_true)
