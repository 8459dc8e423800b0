r"""Ridge regression and its references: loss, batch gradient descent, closed form, tasks.

Objective, for examples ``x: [N, d]`` and targets ``y: [N]`` (or ``[N, k]``):

.. math::
  L(w) = \frac{1}{2N} \sum_i \|y_i - x_i^\top w\|^2 + \frac{\lambda}{2}\|w\|^2,
  \qquad w_{t+1} = (1 - \eta\lambda) w_t - \frac{\eta}{N} X^\top (X w_t - y).

Nothing here knows about attention: these are the independent references the
ELSA constructions are checked against.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


def _check_xy(fn: str, x: Array, y: Array) -> None:
  if jnp.ndim(x) < 2:
    raise ValueError(f"{fn}: x must have shape [..., N, d], got {jnp.shape(x)}.")
  n_x = jnp.shape(x)[-2]
  lead = jnp.shape(x)[:-2]
  if jnp.shape(y)[:len(lead) + 1] != (*lead, n_x) or jnp.ndim(y) not in (
      jnp.ndim(x) - 1, jnp.ndim(x)):
    raise ValueError(f"{fn}: y must have shape [..., N] or [..., N, k] matching "
                     f"x of shape {jnp.shape(x)} (N={n_x}), got {jnp.shape(y)}.")


def _as_matrix(x: Array, y: Array) -> tuple[Array, bool]:
  """``y`` as ``[..., N, k]``, and whether it came as ``[..., N]``."""
  vector = jnp.ndim(y) == jnp.ndim(x) - 1
  return (y[..., None] if vector else y), vector


def normal_equations(x: Array, y: Array, *, lam) -> tuple[Array, Array]:
  """``A = X^T X / N + lam I`` ``[..., d, d]`` and ``b = X^T y / N`` ``[..., d(, k)]``."""
  _check_xy("normal_equations", x, y)
  n_train, d = jnp.shape(x)[-2:]
  a = jnp.swapaxes(x, -1, -2) @ x / n_train
  a = a + jnp.asarray(lam, x.dtype)[..., None, None] * jnp.eye(d, dtype=x.dtype)
  y2, vector = _as_matrix(x, y)
  b = jnp.swapaxes(x, -1, -2) @ y2 / n_train
  return a, (b[..., 0] if vector else b)


def loss(w: Array, x: Array, y: Array, *, lam) -> Array:
  """The ridge objective ``L(w)`` for ``w: [..., d(, k)]``; returns ``[...]``."""
  _check_xy("loss", x, y)
  y2, vector = _as_matrix(x, y)
  w2 = w[..., None] if vector else w
  residual = x @ w2 - y2
  n_train = jnp.shape(x)[-2]
  return (0.5 * jnp.sum(residual**2, axis=(-2, -1)) / n_train
          + 0.5 * jnp.asarray(lam, x.dtype) * jnp.sum(w2**2, axis=(-2, -1)))


# Jitted so that eager calls compile once per shape instead of once per op.
@functools.partial(jax.jit, static_argnames=("steps",))
def gd(x: Array, y: Array, *, lam, eta, steps: int, w0: Array | None = None
       ) -> Array:
  """All iterates of batch gradient descent on :func:`loss`.

  Args:
    x: ``[..., N, d]``.
    y: ``[..., N]`` or ``[..., N, k]``.
    lam: ridge strength, a scalar (may be traced).
    eta: step size, a scalar or a schedule ``[steps]`` (may be traced).
    steps: number of steps (static).
    w0: start ``[..., d(, k)]``; zero by default.

  Returns:
    ``[steps + 1, ..., d(, k)]``: ``w_0, w_1, ..., w_steps``.
  """
  _check_xy("gd", x, y)
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
    raise ValueError(f"gd: steps must be an int >= 0, got {steps!r}.")
  eta = jnp.asarray(eta, x.dtype)
  if eta.shape not in ((), (steps,)):
    raise ValueError(f"gd: eta must be a scalar or a schedule of shape "
                     f"({steps},) for steps={steps}, got shape {eta.shape}.")
  etas = jnp.broadcast_to(eta, (steps,))
  a, b = normal_equations(x, y, lam=lam)
  vector = jnp.ndim(y) == jnp.ndim(x) - 1
  bm = b[..., None] if vector else b
  if w0 is not None:
    w0 = jnp.asarray(w0)
    try:
      w0 = jnp.broadcast_to(w0[..., None] if vector else w0, bm.shape)
    except ValueError:
      raise ValueError(f"gd: w0 must broadcast to {b.shape}, got shape "
                       f"{w0.shape}.") from None
  w = jnp.zeros_like(bm) if w0 is None else w0.astype(x.dtype)

  def step(w, eta_t):
    # a @ w - b is the gradient of the ridge objective.
    new = w - eta_t * (a @ w - bm)
    return new, new

  _, ws = jax.lax.scan(step, w, etas)
  ws = jnp.concatenate([w[None], ws], axis=0)
  return ws[..., 0] if vector else ws


def solve(x: Array, y: Array, *, lam) -> Array:
  """The minimiser of :func:`loss`, ``(X^T X/N + lam I)^+ X^T y / N``, ``[..., d(, k)]``.

  Solved by an eigendecomposition of the symmetric ``A``; directions with a
  numerically zero eigenvalue (``lam = 0`` and ``N < d``) are dropped, which
  gives the minimum-norm solution: the limit of :func:`gd` from ``w0 = 0``.
  """
  a, b = normal_equations(x, y, lam=lam)
  evals, evecs = jnp.linalg.eigh(a)
  tol = evals[..., -1:] * a.shape[-1] * jnp.finfo(a.dtype).eps
  inv = jnp.where(evals > tol, 1 / jnp.where(evals > tol, evals, 1), 0)
  vector = b.ndim == a.ndim - 1
  bm = b[..., None] if vector else b
  w = evecs @ (inv[..., None] * (jnp.swapaxes(evecs, -1, -2) @ bm))
  return w[..., 0] if vector else w


def stability_limit(x: Array, *, lam) -> Array:
  """``2 / (lambda_max(X^T X / N) + lam)``: GD converges iff ``0 < eta <`` this. ``[...]``."""
  if jnp.ndim(x) < 2:
    raise ValueError(f"stability_limit: x must have shape [..., N, d], got "
                     f"{jnp.shape(x)}.")
  gram = jnp.swapaxes(x, -1, -2) @ x / jnp.shape(x)[-2]
  return 2 / (jnp.linalg.eigvalsh(gram)[..., -1] + jnp.asarray(lam, x.dtype))


class Task(NamedTuple):
  """A batch of ridge tasks. ``x: [B, N, d]``, ``y: [B, N(, k)]``, ``x_query:
  [B, Q, d]``, ``y_query: [B, Q(, k)]``, ``w_true: [B, d(, k)]``."""

  x: Array
  y: Array
  x_query: Array
  y_query: Array
  w_true: Array


@functools.partial(jax.jit, static_argnames=(
    "batch", "n_train", "d", "n_query", "n_out", "dtype"))
def sample_tasks(key: Array, *, batch: int, n_train: int, d: int,
                 n_query: int = 1, n_out: int | None = None,
                 noise: float = 0.0, x_scale: float = 1.0, w_scale: float = 1.0,
                 x_cov: Array | None = None, dtype=jnp.float32) -> Task:
  """Random linear-regression tasks: ``y = x w_true + noise * eps``.

  Args:
    key: ``jax.random`` key; the same key gives the same tasks.
    batch, n_train, d, n_query: task count, examples, input dimension, queries.
    n_out: ``None`` for scalar targets ``[..., N]``, or ``k`` for ``[..., N, k]``.
    noise: standard deviation of the label noise.
    x_scale: inputs are ``x_scale * L z`` with ``z`` standard normal.
    w_scale: ``w_true`` is ``w_scale`` times standard normal.
    x_cov: optional input covariance ``[d, d]`` (``L`` its Cholesky factor).
    dtype: floating dtype of every array.
  """
  kx, kq, kw, kn, knq = jax.random.split(key, 5)
  out = () if n_out is None else (n_out,)
  chol = (jnp.eye(d, dtype=dtype) if x_cov is None
          else jnp.linalg.cholesky(jnp.asarray(x_cov, dtype)))
  draw_x = lambda k, rows: x_scale * jax.random.normal(
      k, (batch, rows, d), dtype) @ chol.T
  x, x_query = draw_x(kx, n_train), draw_x(kq, n_query)
  w_true = w_scale * jax.random.normal(kw, (batch, d, *out), dtype)
  label = lambda xs, k: jnp.einsum("bnd,bd...->bn...", xs, w_true) + (
      noise * jax.random.normal(k, (batch, xs.shape[1], *out), dtype))
  return Task(x=x, y=label(x, kn), x_query=x_query, y_query=label(x_query, knq),
              w_true=w_true)
