r"""Garg et al.'s curriculum: the input dimension and the prompt length grow in steps during training.

A :class:`Schedule` holds Garg et al.'s four numbers (``start``, ``end``,
``inc``, ``interval``; ``src/curriculum.py``, ``src/conf/*.yaml``): at
training step ``t`` (from 0) the value is

.. math::
  v(t) = \min(\mathrm{start} + \lfloor t / \mathrm{interval} \rfloor \,
  \mathrm{inc}, \ \mathrm{end}),

what their ``Curriculum.update`` reaches after ``t`` updates. A
:class:`Curriculum` pairs a schedule for the dimension ``d`` (their
``n_dims_truncated``) with one for the points per prompt ``N`` (their
``n_points``: a prefix-wise loss predicts each point from the ones before
it). :meth:`Curriculum.garg` gives their defaults: ``d`` from 5 to 20 by 1,
``N`` from 11 to 41 by 2, both every 2000 steps (final sizes at step 30,000).

One compile for the whole run: draw every batch at the final sizes
``(dims.end, points.end)``, then

* :meth:`Curriculum.truncate` zeroes the input coordinates ``>= d(t)`` (as
  Garg et al. do: their sampler zeroes ``x[:, :, n_dims_truncated:]``), so
  the labels depend on the first ``d(t)`` coordinates only;
* :meth:`Curriculum.point_mask` is ``1`` on the first ``N(t)`` positions of a
  prompt and ``0`` beyond, and :meth:`Curriculum.mean` averages a per-position
  loss over the active positions only.

Every method takes a Python int step (returns ints) or a traced one (under
``jit`` or ``lax.scan``: returns jnp int32 scalars), so the sizes are data,
not shapes.

Example:
  >>> from elsa import curriculum
  >>> cur = curriculum.Curriculum.garg()
  >>> cur.at(0), cur.at(4000), cur.at(10**6)
  ((5, 11), (7, 15), (20, 41))
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from elsa import _validate
from elsa.attention import Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """``start`` (``>= 1``), ``end`` (``>= start``), ``inc`` (``>= 0``), ``interval`` (``>= 1``)."""

  start: int
  end: int
  inc: int
  interval: int

  def __post_init__(self):
    fn = "curriculum.Schedule"
    for name, low in (("start", 1), ("end", 1), ("inc", 0), ("interval", 1)):
      object.__setattr__(self, name, _validate.int_at_least(
          fn, name, getattr(self, name), low=low))
    if self.end < self.start:
      raise ValueError(f"{fn}: end must be >= start={self.start}, got "
                       f"{self.end}.")

  def at(self, step):
    """``min(start + (step // interval) * inc, end)``: an int for an int
    ``step >= 0``, a jnp int32 scalar for an array or traced one."""
    if isinstance(step, int) and not isinstance(step, bool):
      if step < 0:
        raise ValueError(f"curriculum.Schedule.at: step must be an int >= 0, "
                         f"got {step}.")
      return min(self.start + (step // self.interval) * self.inc, self.end)
    step = jnp.asarray(step)
    if not jnp.issubdtype(step.dtype, jnp.integer):
      raise TypeError(f"curriculum.Schedule.at: step must be an integer, got "
                      f"dtype {step.dtype}.")
    return jnp.minimum(self.start + (step // self.interval) * self.inc,
                       self.end).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Curriculum:
  """``dims`` and ``points`` schedules (module doc)."""

  dims: Schedule
  points: Schedule

  def __post_init__(self):
    for name in ("dims", "points"):
      if not isinstance(getattr(self, name), Schedule):
        raise TypeError(f"curriculum.Curriculum: {name} must be a "
                        f"curriculum.Schedule, got "
                        f"{type(getattr(self, name)).__name__}.")

  @classmethod
  def garg(cls) -> Curriculum:
    """Garg et al.'s defaults (``src/conf/base.yaml``, ``linear_regression.yaml``)."""
    return cls(dims=Schedule(start=5, end=20, inc=1, interval=2000),
               points=Schedule(start=11, end=41, inc=2, interval=2000))

  @classmethod
  def fixed(cls, *, d: int, n_points: int) -> Curriculum:
    """No curriculum: ``d`` and ``n_points`` at every step."""
    return cls(dims=Schedule(start=d, end=d, inc=0, interval=1),
               points=Schedule(start=n_points, end=n_points, inc=0,
                               interval=1))

  @property
  def final(self) -> tuple[int, int]:
    """``(d, N)`` at the end: the sizes to sample at."""
    return self.dims.end, self.points.end

  def at(self, step):
    """``(d, N)`` at ``step`` (ints, or jnp int32 scalars for a traced step)."""
    return self.dims.at(step), self.points.at(step)

  def input_mask(self, step, *, dtype=None) -> Array:
    """``[dims.end]``: 1 on the first ``d(step)`` coordinates, 0 beyond."""
    return (jnp.arange(self.dims.end) < self.dims.at(step)).astype(
        _validate.float_dtype(dtype))

  def truncate(self, x: Array, step) -> Array:
    """``x [..., dims.end]`` with the coordinates ``>= d(step)`` zeroed."""
    _validate.floating("curriculum.Curriculum.truncate", "x", x)
    if x.shape[-1] != self.dims.end:
      raise ValueError(f"curriculum.Curriculum.truncate: x must have "
                       f"{self.dims.end} (dims.end) features, got shape "
                       f"{x.shape}.")
    return x * self.input_mask(step, dtype=x.dtype)

  def point_mask(self, step, *, dtype=None) -> Array:
    """``[points.end]``: 1 on the first ``N(step)`` prompt positions, 0 beyond."""
    return (jnp.arange(self.points.end) < self.points.at(step)).astype(
        _validate.float_dtype(dtype))

  def mean(self, losses: Array, step) -> Array:
    r"""The mean of ``losses [..., points.end]`` over the first ``N(step)``
    positions of the last axis and every leading one:
    :math:`\sum_{b, i < N} \ell_{b,i} / (B N)`."""
    _validate.floating("curriculum.Curriculum.mean", "losses", losses)
    if losses.shape[-1] != self.points.end:
      raise ValueError(f"curriculum.Curriculum.mean: losses must have "
                       f"{self.points.end} (points.end) positions on the last "
                       f"axis, got shape {losses.shape}.")
    mask = self.point_mask(step, dtype=losses.dtype)
    rows = losses.size // losses.shape[-1]
    return jnp.sum(losses * mask) / (rows * jnp.sum(mask))
