"""The ELSA primitive: extended linear self-attention and its stacks.

For an input ``h`` of ``m`` tokens (rows) by ``n`` features (columns), one
ELSA component with parameters ``p`` computes

    elsa(p, h) = (h W3 + B3) (h W1 + B1)^T (h W2 + B2)          [m, v]

with ``W1, W3: [n, k]``, ``W2: [n, v]`` and position-dependent biases
``B1, B3: [m, k]``, ``B2: [m, v]`` (one row per token). Without biases this is
the linear self-attention (LSA) of the paper, a homogeneous cubic in ``h``.

The product is evaluated right to left, ``Q @ (K^T @ V)``: the ``[m, m]``
attention matrix ``Q K^T`` is never formed. Cost per batch element is
``O(m n (k + v) + m k v)`` and memory ``O(m (k + v) + k v)``.

Reference: Hagiwara, "An extension of linear self-attention for in-context
learning", arXiv:2503.23814 (2025).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from elsa import _validate
# The library's default dtype; elsa.attention.float_dtype is kept for callers.
from elsa._validate import float_dtype

Array = jax.Array


class ElsaParams(NamedTuple):
  """Parameters of ELSA components (a pytree).

  For one component: ``w1, w3: [n, k]``, ``w2: [n, v]``, ``b1, b3: [m, k]``,
  ``b2: [m, v]``. A layer of ``C`` summed components carries a leading axis
  ``[C, ...]`` on every leaf; a stack of ``L`` layers carries ``[L, C, ...]``.
  """

  w1: Array
  w2: Array
  w3: Array
  b1: Array
  b2: Array
  b3: Array

  @property
  def m(self) -> int:
    """Token count the biases are laid out for."""
    return self.b1.shape[-2]

  @property
  def n(self) -> int:
    """Feature count of the input."""
    return self.w1.shape[-2]

  @property
  def k(self) -> int:
    """Inner (query/key) width."""
    return self.w1.shape[-1]

  @property
  def v(self) -> int:
    """Value width, the feature count of the output."""
    return self.w2.shape[-1]

  @classmethod
  def zeros(cls, *, m: int, n: int, k: int, v: int | None = None,
            lead: tuple[int, ...] = (), dtype=None) -> ElsaParams:
    """All-zero parameters with leaves ``[*lead, ...]`` (``v`` defaults to ``n``).

    ``dtype``: floating dtype of every leaf (default: JAX's default float).
    """
    v = n if v is None else v
    dtype = float_dtype(dtype)
    z = lambda *shape: jnp.zeros((*lead, *shape), dtype)
    return cls(w1=z(n, k), w2=z(n, v), w3=z(n, k),
               b1=z(m, k), b2=z(m, v), b3=z(m, k))

  @classmethod
  def init(cls, key: Array, *, m: int, n: int, k: int, v: int | None = None,
           lead: tuple[int, ...] = (), scale: float | None = None,
           bias_scale: float | None = None, dtype=None) -> ElsaParams:
    """Random normal parameters with leaves ``[*lead, ...]``.

    Args:
      key: a ``jax.random`` key; the same key gives the same parameters.
      m, n, k, v: token count, feature count, inner width, value width
        (``v`` defaults to ``n``).
      lead: leading axes, e.g. ``(L, C)`` for a stack.
      scale: standard deviation of the weights; default ``n ** -0.5``.
      bias_scale: standard deviation of the biases; default ``scale``.
      dtype: floating dtype of every leaf (default: JAX's default float).
    """
    v = n if v is None else v
    dtype = float_dtype(dtype)
    scale = n ** -0.5 if scale is None else scale
    bias_scale = scale if bias_scale is None else bias_scale
    shapes = cls.zeros(m=m, n=n, k=k, v=v, lead=lead, dtype=dtype)
    keys = jax.random.split(key, len(shapes))
    stds = (scale, scale, scale, bias_scale, bias_scale, bias_scale)
    return cls(*(std * jax.random.normal(kk, leaf.shape, dtype)
                 for kk, leaf, std in zip(keys, shapes, stds)))


_NAMES = ElsaParams._fields


def _check(p: ElsaParams, h: Array, *, lead: tuple[str, ...], fn: str,
           names: tuple[str, ...] = _NAMES) -> None:
  """Validates shapes and dtypes at trace time; ``lead`` names the leading axes.

  Only the leaves in ``names`` are checked (:func:`lsa` ignores the biases,
  so it checks only the weights).
  """
  if not isinstance(p, ElsaParams):
    raise TypeError(f"{fn}: p must be an ElsaParams, got {type(p).__name__}.")
  _validate.floating(fn, "h", h)
  if jnp.ndim(h) < 2:
    raise ValueError(f"{fn}: h must have shape [..., m, n] (rank >= 2), got "
                     f"shape {jnp.shape(h)}.")
  rank = len(lead) + 2
  leaves = [(name, getattr(p, name)) for name in names]
  for name, leaf in leaves:
    if jnp.ndim(leaf) != rank:
      axes = ", ".join((*lead, "rows", "cols"))
      raise ValueError(f"{fn}: p.{name} must have rank {rank} [{axes}], got "
                       f"shape {jnp.shape(leaf)}.")
    _validate.same_dtype(fn, f"p.{name}", leaf, "h", h)
  m, n = jnp.shape(h)[-2:]
  k, v = p.w1.shape[-1], p.w2.shape[-1]
  lead_shape = p.w1.shape[:-2]
  expected = dict(w1=(n, k), w2=(n, v), w3=(n, k), b1=(m, k), b2=(m, v),
                  b3=(m, k))
  for name, leaf in leaves:
    want = (*lead_shape, *expected[name])
    if jnp.shape(leaf) != want:
      raise ValueError(
          f"{fn}: p.{name} must have shape {want} for h of shape "
          f"{jnp.shape(h)} (m={m}, n={n}, k={k}, v={v}), got "
          f"{jnp.shape(leaf)}.")


def _attend(q: Array, k: Array, v: Array, precision) -> Array:
  """``q @ (k^T @ v)`` over the last two axes, never forming ``q @ k^T``."""
  kv = jnp.einsum("...mk,...mv->...kv", k, v, precision=precision)
  return jnp.einsum("...mk,...kv->...mv", q, kv, precision=precision)


def _elsa(p: ElsaParams, h: Array, precision) -> Array:
  """``(h W3 + B3) S`` as ``h (W3 S) + B3 S`` with ``S = K^T V``.

  The re-association never materialises ``Q = h W3 + B3``: one fewer
  ``[m, k]`` array written and read again (and one fewer elementwise pass),
  the same FLOPs up to the ``[n, k] @ [k, v]`` product ``W3 S``.
  """
  mm = lambda a, b: jnp.matmul(a, b, precision=precision)
  kv = jnp.einsum("...mk,...mv->...kv", mm(h, p.w1) + p.b1,
                  mm(h, p.w2) + p.b2, precision=precision)
  return mm(h, mm(p.w3, kv)) + mm(p.b3, kv)


def elsa(p: ElsaParams, h: Array, *, precision=None) -> Array:
  r"""One ELSA component: :math:`(hW_3 + B_3)(hW_1 + B_1)^\top(hW_2 + B_2)`.

  Args:
    p: parameters of one component, ``w1, w3: [n, k]``, ``w2: [n, v]``,
      ``b1, b3: [m, k]``, ``b2: [m, v]``.
    h: input tokens ``[..., m, n]``; leading axes are batch and broadcast.
    precision: passed to every matmul (``jax.lax.Precision``). At the
      default, float32 matmuls on TPU and Ampere-or-newer GPUs run in
      bfloat16/TF32; on TPU and Ampere-or-newer GPUs use
      ``precision='highest'`` for float32-exact products (CPU is always
      exact).

  Returns:
    ``[..., m, v]``, in the dtype of ``h``.

  Raises:
    ValueError: a shape or rank of ``p`` does not match ``h``.
    TypeError: a dtype is not floating or ``p`` and ``h`` disagree.

  Example:
    >>> p = ElsaParams.init(jax.random.key(0), m=5, n=3, k=2)
    >>> elsa(p, jnp.ones((5, 3))).shape
    (5, 3)
  """
  _check(p, h, lead=(), fn="elsa")
  return _elsa(p, h, precision)


def lsa(p: ElsaParams, h: Array, *, precision=None) -> Array:
  r"""Linear self-attention, the bias-free baseline: :math:`(hW_3)(hW_1)^\top(hW_2)`.

  Takes the same ``p`` as :func:`elsa` and ignores its biases: they are
  neither used nor checked, so parameters laid out for another token count
  ``m`` work. It is a homogeneous cubic: ``lsa(p, c * h) == c**3 * lsa(p, h)``.

  Args:
    p: as for :func:`elsa`; ``b1, b2, b3`` are not used (any shape).
    h: ``[..., m, n]``.
    precision: passed to every matmul.

  Returns:
    ``[..., m, v]``.
  """
  _check(p, h, lead=(), fn="lsa", names=("w1", "w2", "w3"))
  mm = lambda a, b: jnp.matmul(a, b, precision=precision)
  return _attend(mm(h, p.w3), mm(h, p.w1), mm(h, p.w2), precision)


def _layer(p: ElsaParams, h: Array, precision) -> Array:
  """``sum_c elsa(p_c, h)`` as ``h (sum_c W3_c S_c) + sum_c B3_c S_c``, ``S_c = K_c^T V_c``.

  Summing the ``[n, v]`` and ``[m, v]`` pieces over components first leaves
  one ``[m, n] @ [n, v]`` product per layer instead of one per component.
  """
  ein = functools.partial(jnp.einsum, precision=precision)
  # Biases [C, m, .] line up with the batch axes of h as [C, 1.., m, .].
  per_component = lambda b: b.reshape(b.shape[:1] + (1,) * (jnp.ndim(h) - 2)
                                      + b.shape[1:])
  k = ein("...mn,cnk->c...mk", h, p.w1) + per_component(p.b1)
  v = ein("...mn,cnv->c...mv", h, p.w2) + per_component(p.b2)
  s = ein("c...mk,c...mv->c...kv", k, v)
  return (ein("...mn,...nv->...mv", h, ein("cnk,c...kv->...nv", p.w3, s))
          + ein("cmk,c...kv->...mv", p.b3, s))


def _check_square(p: ElsaParams, h: Array, fn: str) -> None:
  if p.w2.shape[-1] != jnp.shape(h)[-1]:
    raise ValueError(
        f"{fn}: a layer maps h to a state of the same shape, so p.w2 must have "
        f"v == n == {jnp.shape(h)[-1]} columns, got p.w2 of shape "
        f"{jnp.shape(p.w2)}.")


def elsa_layer(p: ElsaParams, h: Array, *, precision=None) -> Array:
  r"""One ELSA layer: the sum of ``C`` components, :math:`\sum_c \mathrm{elsa}(p_c, h)`.

  There is no implicit residual: a skip connection is itself a component
  (see :func:`elsa.constructions.identity`).

  Args:
    p: leaves with a leading component axis ``[C, ...]``, and ``v == n``.
    h: ``[..., m, n]``.
    precision: passed to every matmul.

  Returns:
    ``[..., m, n]``.
  """
  _check(p, h, lead=("C",), fn="elsa_layer")
  _check_square(p, h, "elsa_layer")
  return _layer(p, h, precision)


def elsa_stack(p: ElsaParams, h: Array, *, return_all: bool = False,
               precision=None) -> Array:
  """``L`` ELSA layers applied in order by ``lax.scan`` (compile time flat in ``L``).

  Args:
    p: leaves with leading axes ``[L, C, ...]`` and ``v == n``.
    h: ``[..., m, n]``, the state before the first layer.
    return_all: if true, return every state ``h_0 = h, h_1, ..., h_L``.
    precision: passed to every matmul.

  Returns:
    ``[..., m, n]``, the state after layer ``L``; or ``[L + 1, ..., m, n]``
    with ``return_all``.
  """
  _check(p, h, lead=("L", "C"), fn="elsa_stack")
  _check_square(p, h, "elsa_stack")

  def step(state, layer_params):
    new = _layer(layer_params, state, precision)
    return new, (new if return_all else None)

  last, states = jax.lax.scan(step, h, p)
  if not return_all:
    return last
  return jnp.concatenate([h[None], states], axis=0)
