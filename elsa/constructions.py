"""What one ELSA component can express, as parameters: constants, skips, P h Q, products.

Every function returns :class:`elsa.ElsaParams` for ONE component (leaves
without leading axes) such that ``elsa(p, h)`` equals the stated map exactly,
for every ``h`` of the stated shape (products: for every ``h`` obeying the
stated layout). :func:`layer` and :func:`stack` assemble components into
layers and stacks for :func:`elsa.elsa_layer` and :func:`elsa.elsa_stack`.

Writing the component as ``(hW3 + B3)(hW1 + B1)^T(hW2 + B2)`` and expanding
gives eight terms; each construction keeps exactly one of them (see
BUILD_NOTES.md, "What one component expresses").

All functions are traceable in their array arguments (a sweep may pass traced
step sizes inside ``Q``); shapes and index sets are static.
"""

from __future__ import annotations

import jax.numpy as jnp

from elsa.attention import Array, ElsaParams


def _selector(m: int, rows, dtype) -> Array:
  """``[m, len(rows)]`` with a one at ``(rows[j], j)``: ``S^T h`` picks the rows."""
  rows = jnp.asarray(rows, dtype=jnp.int32)
  return jnp.zeros((m, rows.shape[0]), dtype).at[rows, jnp.arange(rows.shape[0])].set(1)


def constant(c: Array, n: int) -> ElsaParams:
  """``elsa(p, h) == c`` for every ``h`` of shape ``[m, n]``, with ``[m, v] = c.shape``.

  Only the term ``B3 B1^T B2`` is nonzero. With inner width ``k = min(m, v)``:
  if ``v <= m``, ``B3 = c`` and ``B1 = B2 = [I_v; 0]`` so ``B1^T B2 = I_v``;
  otherwise ``B3 = B1 = I_m`` and ``B2 = c``.

  Args:
    c: the constant, ``[m, v]``.
    n: feature count of the inputs the component will read.
  """
  c = jnp.asarray(c)
  if c.ndim != 2:
    raise ValueError(f"constant: c must have shape [m, v], got {c.shape}.")
  m, v = c.shape
  k = min(m, v)
  p = ElsaParams.zeros(m=m, n=n, k=k, v=v, dtype=c.dtype)
  if v <= m:
    eye = jnp.eye(m, v, dtype=c.dtype)
    return p._replace(b3=c, b1=eye, b2=eye)
  return p._replace(b3=jnp.eye(m, dtype=c.dtype), b1=jnp.eye(m, dtype=c.dtype),
                    b2=c)


def linear(P, Q: Array, *, m: int | None = None) -> ElsaParams:
  """``elsa(p, h) == P @ h @ Q`` for every ``h`` of shape ``[m, n]``.

  Two terms can carry a linear map:

  * ``P = I`` (pass ``P=None`` and ``m``): the term ``(h W3)(B1^T B2)`` with
    ``W3 = I_n`` and ``B1^T B2 = Q``, which needs ``B1, B2`` of rank ``n``, so
    ``m >= n`` (inner width ``k = n``). When ``m < n`` it falls back to the
    bias route below with ``P = I_m`` (``k = m``). Either way the cost is
    ``O(m n min(m, n))``.
  * General ``P``: the term ``B3 B1^T (h W2)`` with ``B3 B1^T = P`` and
    ``W2 = Q``. A factorisation needs inner width ``k >= rank(P)``: pass
    ``P`` as a pair ``(U, V)`` of ``[m, k]`` factors with ``P = U V^T`` to
    choose ``k`` (e.g. row selectors for a block of rows), or as an ``[m, m]``
    array, which uses ``k = m`` (``U = P``, ``V = I``) so any ``P`` works.

  Args:
    P: ``None`` (identity, then ``m`` is required), an ``[m, m]`` array, or a
      pair ``(U, V)`` of ``[m, k]`` arrays.
    Q: ``[n, v]``.
    m: token count; required when ``P`` is ``None``, checked otherwise.
  """
  Q = jnp.asarray(Q)
  if Q.ndim != 2:
    raise ValueError(f"linear: Q must have shape [n, v], got {Q.shape}.")
  n, v = Q.shape
  if P is None:
    if m is None:
      raise ValueError("linear: pass m when P is None (the identity on rows).")
    if m < n:
      return linear(jnp.eye(m, dtype=Q.dtype), Q)
    p = ElsaParams.zeros(m=m, n=n, k=n, v=v, dtype=Q.dtype)
    eye = jnp.eye(m, n, dtype=Q.dtype)
    return p._replace(w3=jnp.eye(n, dtype=Q.dtype), b1=eye, b2=eye @ Q)
  if isinstance(P, tuple):
    U, V = (jnp.asarray(f, Q.dtype) for f in P)
    if U.ndim != 2 or U.shape != V.shape:
      raise ValueError("linear: the factors (U, V) of P must both have shape "
                       f"[m, k], got {U.shape} and {V.shape}.")
  else:
    P = jnp.asarray(P, Q.dtype)
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
      raise ValueError(f"linear: P must have shape [m, m], got {P.shape}.")
    U, V = P, jnp.eye(P.shape[0], dtype=Q.dtype)
  if m is not None and U.shape[0] != m:
    raise ValueError(f"linear: P has {U.shape[0]} rows but m={m}.")
  p = ElsaParams.zeros(m=U.shape[0], n=n, k=U.shape[1], v=v, dtype=Q.dtype)
  return p._replace(b3=U, b1=V, w2=Q)


def identity(m: int, n: int, *, dtype=jnp.float32) -> ElsaParams:
  """``elsa(p, h) == h`` for every ``h`` of shape ``[m, n]``: a skip connection.

  LSA cannot do this (it is cubic in ``h``); see :func:`linear` for the term
  that carries it.
  """
  return linear(None, jnp.eye(n, dtype=dtype), m=m)


def rows_linear(rows, Q: Array, *, m: int) -> ElsaParams:
  """``elsa(p, h)[rows] == h[rows] @ Q`` and zero on every other row.

  :func:`linear` with ``P`` the diagonal projector onto ``rows``, factored as
  ``S S^T`` with the row selector ``S: [m, len(rows)]`` (inner width
  ``len(rows)``).
  """
  Q = jnp.asarray(Q)
  S = _selector(m, rows, Q.dtype)
  return linear((S, S), Q, m=m)


def _pad_inner(p: ElsaParams, k: int) -> ElsaParams:
  """Pads the inner width of one component or layer to ``k`` with zeros (exact)."""
  pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, k - a.shape[-1])])
  return p._replace(w1=pad(p.w1), w3=pad(p.w3), b1=pad(p.b1), b3=pad(p.b3))


def layer(*components: ElsaParams) -> ElsaParams:
  """Stacks components along a new leading axis ``C``, for :func:`elsa.elsa_layer`.

  Components may have different inner widths ``k``; narrower ones are padded
  with zero columns in ``W1, W3, B1, B3``, which adds nothing to ``Q K^T``, so
  the layer computes exactly the sum of the components.
  """
  if not components:
    raise ValueError("layer: pass at least one component.")
  shapes = {(c.m, c.n, c.v) for c in components}
  if len(shapes) != 1:
    raise ValueError("layer: components must share (m, n, v), got "
                     f"{sorted(shapes)}.")
  k = max(c.k for c in components)
  padded = [_pad_inner(c, k) for c in components]
  return ElsaParams(*(jnp.stack(leaves) for leaves in zip(*padded)))


def stack(*parts: ElsaParams) -> ElsaParams:
  """Concatenates layers (leaves ``[C, ...]``) and stacks (``[L, C, ...]``) in order.

  Returns leaves ``[L, C, ...]`` for :func:`elsa.elsa_stack`, with ``C`` and
  ``k`` padded by zero components and zero inner columns where parts differ.
  """
  if not parts:
    raise ValueError("stack: pass at least one layer or stack.")
  parts = [p if p.w1.ndim == 4 else ElsaParams(*(a[None] for a in p))
           for p in parts]
  k = max(p.k for p in parts)
  c = max(p.w1.shape[1] for p in parts)

  def pad_components(p):
    return ElsaParams(*(jnp.pad(a, [(0, 0), (0, c - a.shape[1])]
                                + [(0, 0)] * (a.ndim - 2)) for a in p))

  parts = [pad_components(_pad_inner(p, k)) for p in parts]
  return ElsaParams(*(jnp.concatenate(leaves) for leaves in zip(*parts)))
