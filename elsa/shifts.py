r"""Garg et al.'s evaluation-time distribution shifts, as samplers of :class:`elsa.ridge.Task` batches.

A model trained on a family's own distribution is evaluated on prompts drawn
from a shifted one (Garg et al. 2022, ``src/eval.py``, ``build_evals``); the
names are theirs. ``sample(family, name, key, ...)`` draws the family's
standard batch from ``key`` (exactly ``family.sample(key, ...)``) and
transforms it, so that every shift of one key is paired with the same
underlying inputs ``z``, weights ``w`` and label noise ``e`` (``y = z^T w +
e``). Labels of moved inputs are recomputed as ``y' = y + (x' - z)^T w``,
which is ``x'^T w + e``: the family's own noise is kept (``mixed_noise``: the
same level per prompt).

=============================  ====================================================================
``standard``                   the family's batch, unchanged (every family)
``random_quadrants``           context ``x_i = |z_i| * s``, ``s = sign(g)``, ``g ~ N(0, I_d)`` per prompt
                               (one orthant); queries ``z_q`` as drawn (any orthant)
``orthogonal_train_test``      query ``z_q - P z_q`` rescaled to ``|z_q|``, ``P`` the projector on
                               the span of the context inputs (zero where that span is all of R^d)
``overlapping_train_test``     each query a uniformly random one of the context inputs
``half_subspace``              every input ``z T``, ``T = U diag(1_{d//2}, 0) U^T sqrt(d / (d//2))``
``skewed``                     every input ``z T``, ``T = U diag(1 / (i + 1)) U^T sqrt(d / sum_i (i+1)^-2)``
``scale-x=c``                  every input ``c z``, ``c`` in 0.333, 0.5, 2, 3
``scale-y=c``                  weights ``c w``: ``y = c z^T w + e``
``noisyLR``                    ``y <- (y + eps) sqrt(d) / std(y + eps)``, ``eps ~ N(0, 1)``, the
                               standard deviation over every label of the batch (``w_true`` scaled alike)
``opposite_quadrants``         context as ``random_quadrants``, queries ``-|z_q| * s`` (in Garg et al.'s
                               ``eval.py``, not in ``build_evals``' suite)
=============================  ====================================================================

``U`` is a random rotation (the left singular vectors of a standard normal
``d x d`` matrix, as theirs), one for the whole batch, drawn from the option
``basis_key`` (default: from ``key``); pass the same ``basis_key`` to every
batch of an evaluation for Garg et al.'s single transformation per
evaluation. The input covariance is ``T^T T = T^2`` (trace ``d``):
:func:`skewed_factor` and :func:`half_subspace_factor` give ``T``.

Two layouts of the queries:

* ``prefix=False`` (default): ``n_query`` queries, each against the whole
  context of ``n_train`` examples.
* ``prefix=True``: Garg et al.'s prompt, ``n_train + 1`` queries, query ``i``
  against the first ``i`` examples (``i = 0..n_train``;
  :func:`at_prefix`). Where a shift moves no query off the prompt's points,
  query ``i < n_train`` is example ``i`` itself (``x_query[:, :N] == x``), so a
  causal model reads every prefix from one pass over the prompt. As theirs,
  ``orthogonal_train_test`` queries are zero (label: the noise) for ``i >= d``
  and the query of ``overlapping_train_test`` at ``i = 0`` is the drawn point.

Shifts other than ``standard`` apply to the families whose labels are
``x^T w + e`` with ``e`` independent of ``x`` (:data:`LINEAR_FAMILIES`): Garg
et al. evaluate them on linear regression.

Example:
  >>> from elsa import shifts, tasks
  >>> batch = shifts.sample(tasks.get("linear"), "scale-x=2", jax.random.key(0),
  ...                       batch=8, n_train=10, d=5)
  >>> batch.x.shape, batch.x_query.shape
  ((8, 10, 5), (8, 1, 5))

References: Garg, Tsipras, Liang, Valiant (2022), "What can transformers
learn in-context? A case study of simple function classes", and their code
(dtsip/in-context-learning, ``src/eval.py``, ``src/samplers.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from elsa import _validate, ridge, tasks
from elsa.attention import Array

#: The kinds of shift, one transform each (module doc).
KINDS = ("standard", "random_quadrants", "opposite_quadrants",
         "orthogonal_train_test", "overlapping_train_test", "half_subspace",
         "skewed", "scale-x", "scale-y", "noisyLR")
#: The families every shift applies to: labels ``x^T w + e``, ``e`` independent of ``x``.
LINEAR_FAMILIES = ("linear", "noisy_linear", "sparse_linear", "nonzero_mean",
                   "mixed_noise", "anisotropic")
_OPTIONS = {"half_subspace": {"basis_key": None},
            "skewed": {"basis_key": None}, "noisyLR": {"noise_std": 1.0}}


@dataclasses.dataclass(frozen=True)
class Shift:
  """One shift: its ``name``, its ``kind`` (one of :data:`KINDS`) and, for
  ``scale-x`` and ``scale-y``, the ``scale`` (a finite number > 0)."""

  name: str
  kind: str
  scale: float | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"shifts.Shift: kind must be one of {', '.join(KINDS)}"
                       f"; got {self.kind!r}.")
    if self.kind in ("scale-x", "scale-y"):
      _validate.at_least("shifts.Shift", "scale", self.scale, low=0,
                         strict=True)
      object.__setattr__(self, "scale", float(self.scale))
    elif self.scale is not None:
      raise ValueError(f"shifts.Shift: {self.kind} takes no scale, got "
                       f"{self.scale!r}.")


def _suite() -> dict[str, Shift]:
  kinds = ("standard", "random_quadrants", "orthogonal_train_test",
           "overlapping_train_test", "half_subspace", "skewed")
  suite = [Shift(kind, kind) for kind in kinds]
  suite += [Shift(f"scale-{axis}={c}", f"scale-{axis}", c)
            for axis in "xy" for c in (0.333, 0.5, 2, 3)]
  suite += [Shift("noisyLR", "noisyLR"),
            Shift("opposite_quadrants", "opposite_quadrants")]
  return {shift.name: shift for shift in suite}


#: ``{name: Shift}``: Garg et al.'s suite (``build_evals``) and ``opposite_quadrants``.
SHIFTS: dict[str, Shift] = _suite()


def transformation(key: Array, eigenvalues: Array, *, normalize: bool = False
                   ) -> Array:
  r"""``T = U diag(eigenvalues) U^T`` ``[d, d]``, ``U`` a random rotation from ``key``.

  ``U``: the left singular vectors of a standard normal ``d x d`` matrix
  (Garg et al.'s ``sample_transformation``; the signs of its columns cancel in
  ``T``). With ``normalize``, ``T`` is scaled by ``sqrt(d / sum_i
  eigenvalues_i^2)`` so that inputs ``z T``, ``z ~ N(0, I)``, have covariance
  ``T^2`` of trace ``d``. ``eigenvalues [d]`` set the dtype.
  """
  eigenvalues = jnp.asarray(eigenvalues)
  _validate.floating("shifts.transformation", "eigenvalues", eigenvalues)
  d = eigenvalues.shape[-1]
  u = jnp.linalg.svd(jax.random.normal(key, (d, d), eigenvalues.dtype))[0]
  t = jnp.einsum("ij,j,kj->ik", u, eigenvalues, u,
                 precision=jax.lax.Precision.HIGHEST)
  if normalize:
    t = t * jnp.sqrt(d / jnp.sum(eigenvalues ** 2))
  return t


def skewed_factor(key: Array, d: int, *, dtype=None) -> Array:
  r"""Garg et al.'s skewed covariance factor ``T [d, d]``: eigenvalues ``1 / (i + 1)``,
  normalised; inputs ``z T`` have covariance with eigenvalues
  :math:`(i+1)^{-2} \, d / \sum_j (j+1)^{-2}`."""
  d = _validate.int_at_least("shifts.skewed_factor", "d", d, low=1)
  dtype = _validate.floating_dtype("shifts.skewed_factor", dtype)
  return transformation(key, 1 / jnp.arange(1, d + 1, dtype=dtype),
                        normalize=True)


def half_subspace_factor(key: Array, d: int, *, dtype=None) -> Array:
  r"""Garg et al.'s half-subspace factor ``T [d, d]``: eigenvalues 1 on ``d // 2``
  directions, 0 on the rest, normalised (covariance eigenvalues ``d / (d //
  2)`` on a random ``d // 2``-dimensional subspace). Needs ``d >= 2``."""
  d = _validate.int_at_least("shifts.half_subspace_factor", "d", d, low=2)
  dtype = _validate.floating_dtype("shifts.half_subspace_factor", dtype)
  eig = (jnp.arange(d) < d // 2).astype(dtype)
  return transformation(key, eig, normalize=True)


def at_prefix(task: ridge.Task, i: int) -> ridge.Task:
  """The prompt of prefix ``i`` of a ``prefix=True`` batch: the first ``i``
  examples and query ``i`` (``x [B, i, d]``, ``x_query [B, 1, d]``)."""
  return task._replace(x=task.x[:, :i], y=task.y[:, :i],
                       x_query=task.x_query[:, i:i + 1],
                       y_query=task.y_query[:, i:i + 1])


def _resolve(family, shift, options) -> tuple[tasks.TaskFamily, Shift, dict]:
  fn = "shifts.sample"
  if isinstance(family, str):
    family = tasks.get(family)
  if not isinstance(family, tasks.TaskFamily):
    raise TypeError(f"{fn}: family must be a tasks.TaskFamily or a family "
                    f"name, got {type(family).__name__}.")
  if isinstance(shift, str):
    if shift not in SHIFTS:
      raise ValueError(f"{fn}: name must be one of {', '.join(SHIFTS)}; got "
                       f"{shift!r}.")
    shift = SHIFTS[shift]
  if not isinstance(shift, Shift):
    raise TypeError(f"{fn}: name must be a shift name or a shifts.Shift, got "
                    f"{type(shift).__name__}.")
  if shift.kind != "standard" and family.name not in LINEAR_FAMILIES:
    raise ValueError(f"{fn}: {shift.name} applies to the families with labels "
                     f"x^T w + noise ({', '.join(LINEAR_FAMILIES)}); got "
                     f"{family.name}.")
  allowed = _OPTIONS.get(shift.kind, {})
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    have = (f"the options of {shift.name} are {', '.join(allowed)}" if allowed
            else f"{shift.name} takes none")
    raise TypeError(f"{fn}({shift.name!r}): no option {', '.join(unknown)}; "
                    f"{have}.")
  options = {**allowed, **options}
  if "noise_std" in options:
    _validate.at_least(fn, "noise_std", options["noise_std"], low=0,
                       strict=False)
  return family, shift, options


def sample(family, name, key: Array, *, batch: int, n_train: int, d: int,
           n_query: int | None = None, prefix: bool = False, dtype=None,
           **options) -> ridge.Task:
  """A batch of ``family``'s prompts under the shift ``name`` (module doc).

  Args:
    family: a :class:`elsa.tasks.TaskFamily` (from :func:`elsa.tasks.get`)
      or a family name.
    name: a name of :data:`SHIFTS`, or a :class:`Shift`.
    key: ``jax.random`` key; the same key gives the same batch, and the
      ``standard`` batch of that key is ``family.sample(key, ...)``.
    batch, n_train, d: prompts, examples per prompt, input dimension.
    n_query: queries per prompt (default 1); set by ``prefix=True`` to
      ``n_train + 1``, so leave it out there.
    prefix: Garg et al.'s per-prefix queries (module doc).
    dtype: floating dtype of every array (default: JAX's default float).
    **options: ``basis_key`` (``half_subspace``, ``skewed``: the key of
      ``U``), ``noise_std`` (``noisyLR``, default 1).

  Returns:
    An :class:`elsa.ridge.Task`: ``x [B, N, d]``, ``y [B, N]``, ``x_query [B,
    Q, d]``, ``y_query [B, Q]``, ``w_true [B, d]``.

  Raises:
    ValueError: an unknown shift (the message lists them), a family the
      shift does not apply to, sizes the family or the shift cannot take
      (``orthogonal_train_test`` without ``prefix`` needs ``n_train < d``;
      ``half_subspace`` needs ``d >= 2``), a negative ``noise_std``.
    TypeError: an option the shift does not have, a family that is not one,
      ``n_query`` given with ``prefix=True``, a bad size or dtype.
  """
  fn = "shifts.sample"
  family, shift, options = _resolve(family, name, options)
  if not isinstance(prefix, bool):
    raise TypeError(f"{fn}: prefix must be True or False, got {prefix!r}.")
  if prefix and n_query is not None:
    raise TypeError(f"{fn}: prefix=True sets n_query to n_train + 1; leave "
                    f"n_query out, got {n_query!r}.")
  n_train = _validate.int_at_least(fn, "n_train", n_train, low=1)
  d = _validate.int_at_least(fn, "d", d, low=1)
  draw_q = 1 if prefix else (1 if n_query is None else n_query)
  if shift.kind == "orthogonal_train_test" and not prefix and n_train >= d:
    raise ValueError(f"{fn}: orthogonal_train_test needs n_train < d (a "
                     f"direction orthogonal to the context), got n_train="
                     f"{n_train}, d={d}; or use prefix=True.")
  if shift.kind == "half_subspace" and d < 2:
    raise ValueError(f"{fn}: half_subspace needs d >= 2, got d={d}.")
  std = family.sample(key, batch=batch, n_train=n_train, d=d, n_query=draw_q,
                      dtype=dtype)
  basis_key = options.get("basis_key")
  if basis_key is None:
    basis_key = jax.random.fold_in(key, 2)
  return _apply(shift, std, jax.random.fold_in(key, 1), basis_key,
                options.get("noise_std", 1.0), prefix=prefix)


def _dot(x, w):
  return jnp.einsum("bmd,bd->bm", x, w, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("shift", "prefix"))
def _apply(shift: Shift, std: ridge.Task, key, basis_key, noise_std, *,
           prefix: bool) -> ridge.Task:
  n, d = std.x.shape[1], std.x.shape[2]
  z = jnp.concatenate([std.x, std.x_query], 1)    # every drawn point
  y = jnp.concatenate([std.y, std.y_query], 1)
  w = std.w_true
  kind = shift.kind

  def relabel(x_new, x_old, y_old):
    # x_new^T w + e, exactly y_old where the input did not move.
    return y_old + _dot(x_new - x_old, w)

  if kind in ("standard", "scale-x", "half_subspace", "skewed", "scale-y",
              "noisyLR"):
    if kind == "scale-x":
      x = shift.scale * z
      y = relabel(x, z, y)
    elif kind in ("half_subspace", "skewed"):
      factor = half_subspace_factor if kind == "half_subspace" else (
          skewed_factor)
      x = jnp.einsum("bmd,de->bme", z, factor(basis_key, d, dtype=z.dtype),
                     precision=jax.lax.Precision.HIGHEST)
      y = relabel(x, z, y)
    else:
      x = z
    if kind == "scale-y":
      y = y + (shift.scale - 1) * _dot(z, w)
      w = shift.scale * w
    elif kind == "noisyLR":
      y = y + noise_std * jax.random.normal(key, y.shape, y.dtype)
      c = jnp.sqrt(jnp.asarray(d, y.dtype)) / jnp.std(y, ddof=1)
      y, w = c * y, c * w
    if prefix:
      return ridge.Task(x=x[:, :n], y=y[:, :n], x_query=x, y_query=y,
                        w_true=w)
    return ridge.Task(x=x[:, :n], y=y[:, :n], x_query=x[:, n:],
                      y_query=y[:, n:], w_true=w)
  # Train and test from different distributions: queries are built from
  # their base points against the first `active` context examples.
  base = z if prefix else z[:, n:]
  base_y = y if prefix else y[:, n:]
  q = base.shape[1]
  active = jnp.arange(q) if prefix else jnp.full((q,), n)
  ctx = z[:, :n]
  kq, ks = jax.random.split(key)
  if kind in ("random_quadrants", "opposite_quadrants"):
    s = jnp.sign(jax.random.normal(ks, (z.shape[0], 1, d), z.dtype))
    ctx = jnp.abs(ctx) * s
    xq = base if kind == "random_quadrants" else -jnp.abs(base) * s
  elif kind == "orthogonal_train_test":
    xq = _orthogonal_queries(ctx, base, active)
  else:  # overlapping_train_test
    u = jax.random.uniform(kq, base.shape[:2], z.dtype)
    pick = jnp.minimum(jnp.floor(u * active).astype(jnp.int32),
                       jnp.maximum(active - 1, 0))
    picked = jnp.take_along_axis(ctx, pick[..., None], axis=1)
    xq = jnp.where((active > 0)[None, :, None], picked, base)
  return ridge.Task(x=ctx, y=relabel(ctx, z[:, :n], y[:, :n]), x_query=xq,
                    y_query=relabel(xq, base, base_y), w_true=w)


def _orthogonal_queries(ctx: Array, base: Array, active: Array) -> Array:
  """``base [B, Q, d]`` minus its projection on the span of the first
  ``active[q]`` rows of ``ctx [B, N, d]``, rescaled to its norm; zero where
  ``active[q] >= d`` (Garg et al.: no orthogonal direction is left)."""
  d = ctx.shape[-1]
  # Gram-Schmidt of the context: the first i columns of Q span its first i
  # rows (i <= d), so one factorisation serves every prefix.
  basis = jnp.linalg.qr(jnp.swapaxes(ctx, 1, 2))[0]          # [B, d, K]
  k = basis.shape[-1]
  coef = jnp.einsum("bqd,bdk->bqk", base, basis,
                    precision=jax.lax.Precision.HIGHEST)
  coef = jnp.where(jnp.arange(k)[None, None, :] < active[None, :, None],
                   coef, 0)
  resid = base - jnp.einsum("bqk,bdk->bqd", coef, basis,
                            precision=jax.lax.Precision.HIGHEST)
  norm = jnp.linalg.norm(resid, axis=-1, keepdims=True)
  keep = (active < d)[None, :, None]
  scale = jnp.linalg.norm(base, axis=-1, keepdims=True) / jnp.where(
      keep, norm, 1)
  return jnp.where(keep, resid * scale, 0)


__all__ = ["KINDS", "LINEAR_FAMILIES", "SHIFTS", "Shift", "at_prefix",
           "half_subspace_factor", "sample", "skewed_factor", "transformation"]
