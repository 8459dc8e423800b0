"""What one ELSA component can express, as parameters: constants, skips, P h Q, products.

Every function returns :class:`elsa.ElsaParams` for ONE component (leaves
without leading axes) such that ``elsa(p, h)`` equals the stated map exactly,
for every ``h`` of the stated shape (products: for every ``h`` obeying the
stated layout). :func:`layer` and :func:`stack` assemble components into
layers and stacks for :func:`elsa.elsa_layer` and :func:`elsa.elsa_stack`;
:func:`pad_inner` widens the inner width with zeros (exactly the same map).

Writing the component as ``(hW3 + B3)(hW1 + B1)^T(hW2 + B2)`` and expanding
gives eight terms; each construction keeps exactly one of them by zeroing the
parameters that feed the other seven:

====  ==========================  ==========================================
term  product                     construction
====  ==========================  ==========================================
1     ``h W3 W1^T h^T h W2``      :func:`product3` (the only term LSA has)
3     ``h W3 B1^T h W2``          :func:`product2`
4     ``h W3 B1^T B2``            :func:`linear` with ``P = I``, :func:`identity`
5     ``B3 W1^T h^T h W2``        :func:`gram`
7     ``B3 B1^T h W2``            :func:`linear` with general ``P``
8     ``B3 B1^T B2``              :func:`constant`
====  ==========================  ==========================================

(Terms 2, ``h W3 W1^T h^T B2``, and 6, ``B3 W1^T h^T B2``, are not used
here.) Terms 4, 7 and 8 need a bias, which is why plain LSA (term 1 alone, a
homogeneous cubic) can express neither a skip connection nor a constant.

Index arguments (``a_cols``, ``b_rows``, ...) are static sequences of
distinct non-negative Python ints; they are checked when the parameters are
built, and a layout that cannot work raises ``ValueError`` naming it. Array
arguments (``c``, ``P``, ``Q``, ``scale``) may be traced (a sweep may pass
traced step sizes); concrete ones must be finite, since the maps are exact
only for finite values (a NaN or an infinity times one of the zeros of a
construction spreads). Sizes are ints ``>= 1``, dtypes floating, and
parameters that cannot fit in the devices' memory are refused before they
are allocated, as :mod:`elsa._validate` says for every entry point.

:func:`selector` and :func:`placement` build the 0/1 matrices that move
columns or rows into place; the constructions here and the input forms in
:mod:`elsa.forms` are assembled from them.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elsa import _validate
from elsa.attention import Array, ElsaParams
from elsa._validate import float_dtype

Indices = Sequence[int]


def _as_float(x, fn: str, name: str) -> Array:
  """``x`` as an array, finite if concrete; integer/bool input becomes JAX's
  default float."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
      raise TypeError(f"{fn}: {name} must be real, got dtype {x.dtype}.")
    x = x.astype(float_dtype())
  _validate.finite(fn, name, x)
  return x


def _size(value, fn: str, name: str) -> int:
  """A positive static int (a shape), else ``ValueError``/``TypeError``."""
  return _validate.int_at_least(fn, name, value, low=1)


def _fits(fn: str, dtype, *, m: int, n: int, v: int, k: int = 1) -> None:
  """Refuses a component ``[m, n] -> [m, v]`` of inner width ``k`` (by
  default the least) whose parameters cannot fit in memory, naming ``m, n,
  v``; called before anything of that size is allocated."""
  nbytes = _validate.array_bytes(dtype, (n, k), (n, v), (n, k), (m, k),
                                 (m, v), (m, k))
  _validate.fits_memory(fn, nbytes, dict(m=m, n=n, v=v))


def _indices(idx, size: int, fn: str, name: str, axis: str) -> tuple[int, ...]:
  """Validates a static index set into an axis of length ``size``.

  Returns the indices as a tuple of Python ints. Raises ``TypeError`` for a
  traced or non-integer argument and ``ValueError`` for an empty set, a
  repeated index or one outside ``[0, size)`` (negative indices are refused
  rather than wrapped: a layout is written out, not computed).
  """
  if isinstance(idx, jax.core.Tracer):
    raise TypeError(f"{fn}: {name} must be static (a sequence of ints), got a "
                    "traced array.")
  arr = np.asarray(idx)
  if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
    raise TypeError(f"{fn}: {name} must be a 1-d sequence of ints, got "
                    f"{idx!r}.")
  out = tuple(int(i) for i in arr)
  if not out:
    raise ValueError(f"{fn}: {name} is empty.")
  bad = [i for i in out if not 0 <= i < size]
  if bad:
    raise ValueError(f"{fn}: {name}={list(out)} has indices {bad} outside the "
                     f"{size} {axis} [0, {size}).")
  if len(set(out)) != len(out):
    repeated = sorted({i for i in out if out.count(i) > 1})
    raise ValueError(f"{fn}: {name}={list(out)} repeats {repeated}; each "
                     f"{axis[:-1]} may appear once.")
  return out


def _same_length(fn: str, name_a: str, a: tuple, name_b: str, b: tuple,
                 why: str) -> None:
  if len(a) != len(b):
    raise ValueError(f"{fn}: {name_a} and {name_b} must have the same length "
                     f"({why}), got {len(a)} and {len(b)}.")


def _scalar(scale, dtype, fn: str) -> Array:
  scale = jnp.asarray(scale, dtype)
  if scale.ndim != 0:
    raise ValueError(f"{fn}: scale must be a scalar, got shape {scale.shape}.")
  _validate.finite(fn, "scale", scale)
  return scale


def placement(src: Indices, dst: Indices, *, shape: tuple[int, int],
              dtype=None) -> Array:
  """Zeros of ``shape = (rows, cols)`` with a one at each ``(src[j], dst[j])``.

  As a right factor, ``x @ S`` moves column ``src[j]`` of ``x`` to column
  ``dst[j]``; as a left factor, ``S^T x`` moves row ``src[j]`` to row
  ``dst[j]``. ``src`` holds distinct ints in ``[0, rows)``, ``dst`` as many
  distinct ints in ``[0, cols)``. ``dtype``: floating dtype of the result
  (default: JAX's default float).

  Example:
    >>> placement([0, 2], [1, 0], shape=(3, 2)).tolist()
    [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
  """
  fn = "placement"
  if len(shape) != 2:
    raise ValueError(f"{fn}: shape must be (rows, cols), got {shape!r}.")
  rows, cols = _size(shape[0], fn, "shape[0]"), _size(shape[1], fn, "shape[1]")
  dtype = _validate.floating_dtype(fn, dtype)
  _validate.fits_memory(fn, _validate.array_bytes(dtype, (rows, cols)),
                        {"shape": (rows, cols)})
  src = _indices(src, rows, fn, "src", "rows")
  dst = _indices(dst, cols, fn, "dst", "columns")
  _same_length(fn, "src", src, "dst", dst, "a one at (src[j], dst[j])")
  s = np.zeros((rows, cols))
  s[list(src), list(dst)] = 1
  return jnp.asarray(s, dtype)


def selector(size: int, idx: Indices, *, dtype=None) -> Array:
  """``S(idx)``: ``[size, len(idx)]`` with a one at ``(idx[j], j)``.

  ``S^T h`` picks the rows ``idx`` of ``h: [size, ...]`` in order, and
  ``h S`` the columns ``idx`` of ``h: [..., size]``. ``idx`` holds distinct
  ints in ``[0, size)``. ``dtype``: floating dtype of the result (default:
  JAX's default float).
  """
  size = _size(size, "selector", "size")
  idx = _indices(idx, size, "selector", "idx", "rows")
  dtype = _validate.floating_dtype("selector", dtype)
  return placement(idx, range(len(idx)), shape=(size, len(idx)), dtype=dtype)


def constant(c: Array, n: int) -> ElsaParams:
  """``elsa(p, h) == c`` for every ``h`` of shape ``[m, n]``, with ``[m, v] = c.shape``.

  Only the term ``B3 B1^T B2`` is nonzero (all ``W = 0``). With inner width
  ``k = min(m, v)``: if ``v <= m``, ``B3 = c`` and ``B1 = B2 = [I_v; 0]`` so
  ``B1^T B2 = I_v``; otherwise ``B3 = B1 = I_m`` and ``B2 = c``. Works for any
  ``m`` and ``v`` relative to ``n``.

  Args:
    c: the constant, ``[m, v]``; may be traced.
    n: feature count of the inputs the component will read.

  Returns:
    ``ElsaParams`` with ``w1, w3: [n, k]``, ``w2: [n, v]``, biases ``[m, *]``,
    in the dtype of ``c``.
  """
  c = _as_float(c, "constant", "c")
  if c.ndim != 2:
    raise ValueError(f"constant: c must have shape [m, v], got {c.shape}.")
  n = _size(n, "constant", "n")
  m, v = c.shape
  k = min(m, v)
  _fits("constant", c.dtype, m=m, n=n, v=v, k=k)
  p = ElsaParams.zeros(m=m, n=n, k=k, v=v, dtype=c.dtype)
  if v <= m:
    eye = jnp.eye(m, v, dtype=c.dtype)
    return p._replace(b3=c, b1=eye, b2=eye)
  return p._replace(b3=jnp.eye(m, dtype=c.dtype), b1=jnp.eye(m, dtype=c.dtype),
                    b2=c)


def _is_factor_pair(P) -> bool:
  """A pair ``(U, V)`` of matrices, as opposed to a nested-sequence matrix."""
  return (isinstance(P, tuple) and len(P) == 2
          and all(np.ndim(f) == 2 for f in P))


def linear(P, Q: Array, *, m: int | None = None) -> ElsaParams:
  """``elsa(p, h) == P @ h @ Q`` for every ``h`` of shape ``[m, n]``.

  Two terms can carry a linear map:

  * ``P = I`` (pass ``P=None`` and ``m``): the term ``(h W3)(B1^T B2)`` with
    ``W3 = I_n`` and ``B1^T B2 = Q``. With ``m >= n`` this takes inner width
    ``k = n``, ``B1 = [I_n; 0]`` and ``B2 = B1 Q``, which reaches every ``Q``.
    When ``m < n``, ``B1^T B2`` has rank at most ``m`` and cannot reach every
    ``Q``, so it falls back to the bias route below with ``P = I_m``
    (``k = m``). The inner width is ``k = min(m, n)``, but the cost is not
    ``O(m n k)``: the primitive always forms ``h W2`` (``O(m n v)``), so a
    component costs ``O(m n (k + v) + m k v)`` like any other.
  * General ``P``: the term ``B3 B1^T (h W2)`` with ``B3 B1^T = P`` and
    ``W2 = Q``. Rank condition: ``P = B3 B1^T`` with ``[m, k]`` factors
    exists if and only if ``rank(P) <= k``. Pass ``P`` as a pair ``(U, V)``
    of ``[m, k]`` factors with ``P = U V^T`` to choose ``k`` (e.g. row
    selectors for a block of rows), or as an ``[m, m]`` array, which uses
    ``k = m`` (``U = P``, ``V = I``) so any ``P`` works.

  Args:
    P: ``None`` (identity, then ``m`` is required), an ``[m, m]`` array, or a
      tuple ``(U, V)`` of two ``[m, k]`` arrays. May be traced.
    Q: ``[n, v]``; may be traced.
    m: token count; required when ``P`` is ``None``, checked otherwise.

  Returns:
    ``ElsaParams`` in the dtype of ``Q`` (``P`` is cast to it).
  """
  Q = _as_float(Q, "linear", "Q")
  if Q.ndim != 2:
    raise ValueError(f"linear: Q must have shape [n, v], got {Q.shape}.")
  n, v = Q.shape
  if P is None:
    if m is None:
      raise ValueError("linear: pass m when P is None (the identity on rows).")
    m = _size(m, "linear", "m")
    _fits("linear", Q.dtype, m=m, n=n, v=v, k=min(m, n))
    if m < n:
      return linear(jnp.eye(m, dtype=Q.dtype), Q)
    p = ElsaParams.zeros(m=m, n=n, k=n, v=v, dtype=Q.dtype)
    # B2 = [I_n; 0] Q = [Q; 0], placed rather than multiplied: a float32
    # matmul may run in bf16/TF32 on accelerators and round Q.
    return p._replace(w3=jnp.eye(n, dtype=Q.dtype),
                      b1=jnp.eye(m, n, dtype=Q.dtype),
                      b2=jnp.pad(Q, [(0, m - n), (0, 0)]))
  if _is_factor_pair(P):
    U, V = (jnp.asarray(f, Q.dtype) for f in P)
    for i, factor in enumerate((U, V)):
      _validate.finite("linear", f"P[{i}]", factor)
    if U.shape != V.shape:
      raise ValueError("linear: the factors (U, V) of P must both have shape "
                       f"[m, k], got {U.shape} and {V.shape}.")
  else:
    P = jnp.asarray(P, Q.dtype)
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
      raise ValueError(f"linear: P must have shape [m, m] or be a pair (U, V) "
                       f"of [m, k] factors, got shape {P.shape}.")
    _validate.finite("linear", "P", P)
    U, V = P, jnp.eye(P.shape[0], dtype=Q.dtype)
  if m is not None and U.shape[0] != m:
    raise ValueError(f"linear: P has {U.shape[0]} rows but m={m}.")
  p = ElsaParams.zeros(m=U.shape[0], n=n, k=U.shape[1], v=v, dtype=Q.dtype)
  return p._replace(b3=U, b1=V, w2=Q)


def identity(m: int, n: int, *, dtype=None) -> ElsaParams:
  """``elsa(p, h) == h`` for every ``h`` of shape ``[m, n]``: a skip connection.

  :func:`linear` with ``P = I``, ``Q = I``: for ``m >= n`` the term
  ``h W3 B1^T B2`` with ``W3 = I_n``, ``B1 = B2 = [I_n; 0]`` (``k = n``); for
  ``m < n`` the term ``B3 B1^T h W2`` with ``B3 = B1 = I_m``, ``W2 = I_n``
  (``k = m``). LSA cannot do this: it is a homogeneous cubic in ``h``.
  ``dtype``: floating dtype of the parameters (default: JAX's default float).
  """
  m, n = _size(m, "identity", "m"), _size(n, "identity", "n")
  dtype = _validate.floating_dtype("identity", dtype)
  _fits("identity", dtype, m=m, n=n, v=n, k=min(m, n))
  return linear(None, jnp.eye(n, dtype=dtype), m=m)


def rows_linear(rows, Q: Array, *, m: int) -> ElsaParams:
  """``elsa(p, h)[rows] == h[rows] @ Q`` and zero on every other row.

  :func:`linear` with ``P`` the diagonal projector onto ``rows``, factored as
  ``S S^T`` with the row selector ``S: [m, len(rows)]`` (inner width
  ``len(rows)``). ``rows`` are distinct ints in ``[0, m)``.
  """
  Q = _as_float(Q, "rows_linear", "Q")
  m = _size(m, "rows_linear", "m")
  rows = _indices(rows, m, "rows_linear", "rows", "rows")
  S = selector(m, rows, dtype=Q.dtype)
  return linear((S, S), Q, m=m)


def _overlap_refused(fn: str, *, data: str, data_rows, data_cols, zero: str,
                     zero_rows, zero_cols) -> None:
  """Raises if block ``data`` has cells the layout of ``zero`` forces to zero.

  The layout of ``zero`` requires ``h[t, zero_cols] == 0`` for every row ``t``
  outside ``zero_rows``; a block ``data`` meant to hold arbitrary values may
  not have a cell there.
  """
  cols = sorted(set(data_cols) & set(zero_cols))
  rows = sorted(set(data_rows) - set(zero_rows))
  if cols and rows:
    raise ValueError(
        f"{fn}: the layout needs h[t, {zero}_cols] == 0 for rows t outside "
        f"{zero}_rows, but block {data} has cells in rows {rows} and columns "
        f"{cols}, which would then have to be zero. Put {data} in other "
        f"columns, or in the rows of {zero}.")


def _product_sizes(fn: str, m, n, v, dtype) -> tuple[int, int, int, jnp.dtype]:
  """``m, n``, the output width ``v`` (default ``n``) and the dtype, checked."""
  m, n = _size(m, fn, "m"), _size(n, fn, "n")
  v = n if v is None else _size(v, fn, "v")
  dtype = _validate.floating_dtype(fn, dtype)
  _fits(fn, dtype, m=m, n=n, v=v)
  return m, n, v, dtype


def _product(fn: str, *, m: int, n: int, v: int, value: tuple, scale, dtype,
             **selectors: Array) -> ElsaParams:
  """One component of the given selector leaves and ``W2``, all else zero.

  ``selectors``: two of ``w1, w3`` (``[n, k]``) and ``b1, b3`` (``[m, k]``).
  ``W2 = scale * placement(*value)`` (``[n, v]``) moves the value columns
  ``value[0]`` to the output columns ``value[1]``.
  """
  k = next(iter(selectors.values())).shape[1]
  w2 = _scalar(scale, dtype, fn) * placement(*value, shape=(n, v), dtype=dtype)
  p = ElsaParams.zeros(m=m, n=n, k=k, v=v, dtype=dtype)
  return p._replace(w2=w2, **selectors)


def product2(*, m: int, n: int, a_cols: Indices, b_rows: Indices,
             b_cols: Indices, out_cols: Indices, a_rows: Indices | None = None,
             v: int | None = None, scale=1.0, dtype=None) -> ElsaParams:
  r"""``A @ B`` of two blocks of ``h``, landing in the rows of ``A``.

  For every ``h`` of shape ``[m, n]`` the component computes

  .. math:: \mathrm{elsa}(p, h)[:, \mathrm{out\_cols}]
            = \mathrm{scale}\cdot h[:, \mathrm{a\_cols}]\,
              h[\mathrm{b\_rows}, \mathrm{b\_cols}]

  and exactly zero in every other column. It keeps only the term
  ``(h W3)(B1^T h W2)``: ``W3 = S(a_cols)`` selects the columns of ``A``,
  ``B1 = S(b_rows)`` the rows of ``B``, ``W2`` moves ``b_cols`` to
  ``out_cols`` (times ``scale``); ``W1 = B2 = B3 = 0``. Inner width
  ``k = len(a_cols)``.

  Layout (``A = h[a_rows, a_cols]``, ``B = h[b_rows, b_cols]``):

  ==============================  ==========================================
  ``A``                           rows ``a_rows``, columns ``a_cols``
  ``B``                           rows ``b_rows``, columns ``b_cols``
  must be zero                    ``h[t, a_cols]`` for ``t`` not in ``a_rows``
  ``A @ B`` lands in              rows ``a_rows``, columns ``out_cols``
  exactly zero                    every other entry of the output
  ==============================  ==========================================

  The zero condition is on the input, so it cannot be checked when the
  parameters are built; :func:`check_layout` checks a concrete ``h``
  (``check_layout(h, rows=a_rows, cols=a_cols)``). Row ``i`` of the output
  is row ``i`` of ``h[:, a_cols]`` times ``B``, so ``a_rows`` needs no
  parameter: it only names where the result lands. It also needs no order:
  output row ``a_rows[i]`` holds row ``i`` of ``A @ B``.

  Args:
    m, n: token count and feature count of ``h``.
    a_cols: the columns of ``A``; ``len(a_cols) == len(b_rows)`` (the inner
      dimension of ``A @ B``).
    b_rows, b_cols: the rows and columns of ``B``.
    out_cols: output columns of ``A @ B``, ``len(out_cols) == len(b_cols)``,
      in ``[0, v)``.
    a_rows: the rows of ``A`` (default all ``m`` rows). Used only for the
      static check below.
    v: output width (default ``n``, as a layer needs).
    scale: scalar multiplying the product; may be traced.
    dtype: floating dtype of the parameters (default: JAX's default float).

  Raises:
    ValueError: an index set is empty, repeats an index or leaves its axis;
      the lengths do not match; or ``B`` has cells in columns ``a_cols``
      outside ``a_rows``, which the layout forces to zero.

  Example:
    >>> p = product2(m=4, n=4, a_rows=[0, 1], a_cols=[0, 1], b_rows=[2, 3],
    ...              b_cols=[2, 3], out_cols=[2, 3])  # rows 0-1: A @ B
  """
  fn = "product2"
  m, n, v, dtype = _product_sizes(fn, m, n, v, dtype)
  a_rows = tuple(range(m)) if a_rows is None else _indices(
      a_rows, m, fn, "a_rows", "rows")
  a_cols = _indices(a_cols, n, fn, "a_cols", "columns")
  b_rows = _indices(b_rows, m, fn, "b_rows", "rows")
  b_cols = _indices(b_cols, n, fn, "b_cols", "columns")
  out_cols = _indices(out_cols, v, fn, "out_cols", "output columns")
  _same_length(fn, "a_cols", a_cols, "b_rows", b_rows,
               "the inner dimension of A @ B")
  _same_length(fn, "b_cols", b_cols, "out_cols", out_cols,
               "the columns of A @ B")
  _overlap_refused(fn, data="B", data_rows=b_rows, data_cols=b_cols, zero="a",
                   zero_rows=a_rows, zero_cols=a_cols)
  return _product(fn, m=m, n=n, v=v, value=(b_cols, out_cols), scale=scale,
                  dtype=dtype, w3=selector(n, a_cols, dtype=dtype),
                  b1=selector(m, b_rows, dtype=dtype))


def gram(*, m: int, n: int, b_cols: Indices, c_cols: Indices,
         out_rows: Indices, out_cols: Indices, v: int | None = None,
         scale=1.0, dtype=None) -> ElsaParams:
  r"""Gram-type product ``h[:, b_cols]^T h[:, c_cols]`` (over tokens), placed anywhere.

  For every ``h`` of shape ``[m, n]``:

  .. math:: \mathrm{elsa}(p, h)[\mathrm{out\_rows}, \mathrm{out\_cols}]
            = \mathrm{scale}\cdot \sum_{t=1}^{m} h[t, \mathrm{b\_cols}]^\top
              h[t, \mathrm{c\_cols}]

  and exactly zero everywhere else. No condition on ``h``. It keeps only the
  term ``B3 (h W1)^T (h W2)``: ``W1 = S(b_cols)``, ``W2`` moves ``c_cols`` to
  ``out_cols`` (times ``scale``), ``B3 = S(out_rows)`` places row ``j`` of
  the ``[len(b_cols), len(c_cols)]`` result on token ``out_rows[j]``;
  ``W3 = B1 = B2 = 0``. Inner width ``k = len(b_cols)``.

  Layout: if columns ``b_cols`` (or ``c_cols``) of ``h`` are zero outside
  some rows ``R``, the result is the block product ``B^T C`` with
  ``B = h[R, b_cols]``, ``C = h[R, c_cols]``; e.g. ``X^T y`` or ``X^T X`` of
  data tokens stored in ``R``.

  Args:
    m, n: token count and feature count of ``h``.
    b_cols, c_cols: the columns of ``B`` and ``C``; they may overlap (for
      ``X^T X`` pass the same columns).
    out_rows: output rows, ``len(out_rows) == len(b_cols)``.
    out_cols: output columns, ``len(out_cols) == len(c_cols)``, in ``[0, v)``.
    v: output width (default ``n``).
    scale: scalar multiplying the product; may be traced.
    dtype: floating dtype of the parameters (default: JAX's default float).

  Raises:
    ValueError: an index set is empty, repeats an index or leaves its axis,
      or the lengths do not match.
  """
  fn = "gram"
  m, n, v, dtype = _product_sizes(fn, m, n, v, dtype)
  b_cols = _indices(b_cols, n, fn, "b_cols", "columns")
  c_cols = _indices(c_cols, n, fn, "c_cols", "columns")
  out_rows = _indices(out_rows, m, fn, "out_rows", "rows")
  out_cols = _indices(out_cols, v, fn, "out_cols", "output columns")
  _same_length(fn, "b_cols", b_cols, "out_rows", out_rows,
               "row j of B^T C lands on token out_rows[j]")
  _same_length(fn, "c_cols", c_cols, "out_cols", out_cols,
               "the columns of B^T C")
  return _product(fn, m=m, n=n, v=v, value=(c_cols, out_cols), scale=scale,
                  dtype=dtype, w1=selector(n, b_cols, dtype=dtype),
                  b3=selector(m, out_rows, dtype=dtype))


def product3(*, m: int, n: int, a_cols: Indices, b_cols: Indices,
             c_cols: Indices, out_cols: Indices, a_rows: Indices | None = None,
             bc_rows: Indices | None = None, v: int | None = None, scale=1.0,
             dtype=None) -> ElsaParams:
  r"""The attention-shaped triple product ``A @ B^T @ C`` of column blocks of ``h``.

  For every ``h`` of shape ``[m, n]`` the component computes

  .. math:: \mathrm{elsa}(p, h)[:, \mathrm{out\_cols}]
            = \mathrm{scale}\cdot h[:, \mathrm{a\_cols}]\,
              h[:, \mathrm{b\_cols}]^\top h[:, \mathrm{c\_cols}]

  and exactly zero in every other column. It keeps only the cubic term
  ``(h W3)(h W1)^T(h W2)`` (the one LSA has), with column selectors
  ``W3 = S(a_cols)``, ``W1 = S(b_cols)`` and ``W2`` moving ``c_cols`` to
  ``out_cols`` (times ``scale``); all biases are zero. Inner width
  ``k = len(a_cols)``. ``B^T C`` is a sum over all tokens.

  Layout (``A = h[a_rows, a_cols]``, ``B = h[bc_rows, b_cols]``,
  ``C = h[bc_rows, c_cols]``):

  ==============================  ============================================
  ``A``                           rows ``a_rows``, columns ``a_cols``
  ``B``, ``C``                    the same rows ``bc_rows``; columns
                                  ``b_cols``, ``c_cols``
  must be zero                    ``h[t, a_cols]`` for ``t`` not in
                                  ``a_rows``; ``h[t, b_cols]`` and
                                  ``h[t, c_cols]`` for ``t`` not in
                                  ``bc_rows``
  ``A @ B^T @ C`` lands in        rows ``a_rows``, columns ``out_cols``
  exactly zero                    every other entry of the output
  ==============================  ============================================

  (For the sum over tokens it is enough that, at each row outside
  ``bc_rows``, ``b_cols`` or ``c_cols`` is zero.) The zero conditions are on
  the input; check a concrete ``h`` with :func:`check_layout`. Example: the
  Newton-Schulz product ``M A M`` with ``A`` symmetric takes ``M`` in
  ``a_cols`` (rows ``a_rows``) as the first factor, ``A = A^T`` in ``b_cols``
  and a second copy of ``M`` in ``c_cols``, these two in rows ``bc_rows``.

  Args:
    m, n: token count and feature count of ``h``.
    a_cols, b_cols: columns of ``A`` and ``B``, of equal length (the inner
      dimension of ``A B^T``).
    c_cols: columns of ``C``.
    out_cols: output columns, ``len(out_cols) == len(c_cols)``, in ``[0, v)``.
    a_rows, bc_rows: rows of ``A`` and of ``B, C`` (default all ``m`` rows).
      Used only for the static check below; they need no parameter.
    v: output width (default ``n``).
    scale: scalar multiplying the product; may be traced.
    dtype: floating dtype of the parameters (default: JAX's default float).

  Raises:
    ValueError: an index set is empty, repeats an index or leaves its axis;
      the lengths do not match; or ``a_cols`` shares a column with ``b_cols``
      or ``c_cols`` while ``a_rows != bc_rows`` (then the zero conditions
      force cells of a block to zero).
  """
  fn = "product3"
  m, n, v, dtype = _product_sizes(fn, m, n, v, dtype)
  all_rows = tuple(range(m))
  a_rows = all_rows if a_rows is None else _indices(a_rows, m, fn, "a_rows",
                                                    "rows")
  bc_rows = all_rows if bc_rows is None else _indices(bc_rows, m, fn,
                                                      "bc_rows", "rows")
  a_cols = _indices(a_cols, n, fn, "a_cols", "columns")
  b_cols = _indices(b_cols, n, fn, "b_cols", "columns")
  c_cols = _indices(c_cols, n, fn, "c_cols", "columns")
  out_cols = _indices(out_cols, v, fn, "out_cols", "output columns")
  _same_length(fn, "a_cols", a_cols, "b_cols", b_cols,
               "the inner dimension of A @ B^T")
  _same_length(fn, "c_cols", c_cols, "out_cols", out_cols,
               "the columns of A @ B^T @ C")
  for name, cols in (("B", b_cols), ("C", c_cols)):
    _overlap_refused(fn, data=name, data_rows=bc_rows, data_cols=cols,
                     zero="a", zero_rows=a_rows, zero_cols=a_cols)
    _overlap_refused(fn, data="A", data_rows=a_rows, data_cols=a_cols,
                     zero="bc", zero_rows=bc_rows, zero_cols=cols)
  return _product(fn, m=m, n=n, v=v, value=(c_cols, out_cols), scale=scale,
                  dtype=dtype, w3=selector(n, a_cols, dtype=dtype),
                  w1=selector(n, b_cols, dtype=dtype))


def check_layout(h: Array, *, rows: Indices, cols: Indices,
                 name: str = "h") -> None:
  """Checks the layout condition of a product on a concrete input.

  Raises ``ValueError`` unless ``h[..., t, cols] == 0`` exactly for every row
  ``t`` not in ``rows`` (the condition :func:`product2` and :func:`product3`
  put on the column blocks they read through ``h W3`` or ``h W1``).

  Args:
    h: a concrete (not traced) input ``[..., m, n]``.
    rows: the rows that may hold data in ``cols``.
    cols: the columns that must be zero outside ``rows``.
    name: how to call ``h`` in the message.
  """
  if isinstance(h, jax.core.Tracer):
    raise TypeError("check_layout: needs a concrete array, got a traced one; "
                    "call it outside jit.")
  h = np.asarray(h)
  if h.ndim < 2:
    raise ValueError(f"check_layout: {name} must have shape [..., m, n], got "
                     f"{h.shape}.")
  m, n = h.shape[-2:]
  rows = _indices(rows, m, "check_layout", "rows", "rows")
  cols = _indices(cols, n, "check_layout", "cols", "columns")
  outside = [t for t in range(m) if t not in set(rows)]
  block = h[..., outside, :][..., list(cols)]
  if np.any(block != 0):
    bad = sorted({outside[t] for t in np.nonzero(block)[-2]})
    raise ValueError(
        f"check_layout: {name}[..., t, {list(cols)}] must be zero for rows t "
        f"outside {list(rows)}, but rows {bad} are nonzero there (max |value| "
        f"{np.abs(block).max():.3g}).")


def pad_inner(p: ElsaParams, k: int) -> ElsaParams:
  """Zero-pads the inner width of ``p`` to ``k``: the same map, exactly.

  Appends ``k - p.k`` zero columns to ``W1, W3, B1, B3`` (any leading axes:
  one component, a layer or a stack). The new columns of ``Q = h W3 + B3``
  and ``K = h W1 + B1`` are zero, so ``Q K^T`` and every output are
  unchanged: the extra products are exact zeros (in floating point only
  the order of the summation over the inner axis may differ).

  Args:
    p: ``ElsaParams`` with leaves ``[..., rows, cols]`` and inner width
      ``p.k <= k``.
    k: the new inner width (a static int).

  Returns:
    ``ElsaParams`` with ``w1, w3: [..., n, k]``, ``b1, b3: [..., m, k]``;
    ``w2, b2`` unchanged.

  Raises:
    TypeError: ``p`` is not ``ElsaParams`` or ``k`` is not an int.
    ValueError: ``k`` is not positive or is smaller than ``p.k``.
  """
  if not isinstance(p, ElsaParams):
    raise TypeError(f"pad_inner: p must be an ElsaParams, got "
                    f"{type(p).__name__}.")
  k = _size(k, "pad_inner", "k")
  if k < p.k:
    raise ValueError(f"pad_inner: k={k} is smaller than the inner width "
                     f"p.k={p.k} (w1 of shape {p.w1.shape}); padding cannot "
                     "narrow.")
  padded = [(*leaf.shape[:-1], k) for leaf in (p.w1, p.w3, p.b1, p.b3)]
  _validate.fits_memory("pad_inner", _validate.array_bytes(
      jnp.result_type(p.w1), *padded), {"k": k, "p.w1.shape": p.w1.shape,
                                        "p.b1.shape": p.b1.shape})
  pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, k - a.shape[-1])])
  return p._replace(w1=pad(p.w1), w3=pad(p.w3), b1=pad(p.b1), b3=pad(p.b3))


def _check_compatible(fn: str, parts: Sequence[ElsaParams]) -> None:
  shapes = {(c.m, c.n, c.v) for c in parts}
  if len(shapes) != 1:
    raise ValueError(f"{fn}: parts must share (m, n, v), got "
                     f"{sorted(shapes)}.")
  dtypes = {jnp.result_type(leaf) for c in parts for leaf in c}
  if len(dtypes) != 1:
    raise TypeError(f"{fn}: parts must share one dtype, got "
                    f"{sorted(map(str, dtypes))}; cast them explicitly.")


def layer(*components: ElsaParams) -> ElsaParams:
  """Stacks components along a new leading axis ``C``, for :func:`elsa.elsa_layer`.

  Components may have different inner widths ``k``; narrower ones are padded
  with zero columns in ``W1, W3, B1, B3``, which adds nothing to ``Q K^T``, so
  the layer computes exactly the sum of the components. They must share
  ``(m, n, v)`` and dtype.

  Returns:
    ``ElsaParams`` with leaves ``[C, ...]``, ``k`` the largest inner width.
  """
  if not components:
    raise ValueError("layer: pass at least one component.")
  for i, c in enumerate(components):
    if not isinstance(c, ElsaParams) or c.w1.ndim != 2:
      raise ValueError(f"layer: component {i} must be ElsaParams of one "
                       "component (leaves without leading axes).")
  _check_compatible("layer", components)
  k = max(c.k for c in components)
  padded = [pad_inner(c, k) for c in components]
  return ElsaParams(*(jnp.stack(leaves) for leaves in zip(*padded)))


def stack(*parts: ElsaParams) -> ElsaParams:
  """Concatenates components, layers and stacks into one stack, in order.

  A part with leaves ``[...]`` (one component) is one layer of one component,
  ``[C, ...]`` (from :func:`layer`) one layer, ``[L, C, ...]`` ``L`` layers.

  Returns:
    leaves ``[L, C, ...]`` for :func:`elsa.elsa_stack`, with ``C`` and ``k``
    padded by zero components and zero inner columns where parts differ
    (exact: a zero component adds zero).
  """
  if not parts:
    raise ValueError("stack: pass at least one layer or stack.")
  for i, p in enumerate(parts):
    if not isinstance(p, ElsaParams) or p.w1.ndim not in (2, 3, 4):
      raise ValueError(f"stack: part {i} must be ElsaParams with leaves "
                       "[...], [C, ...] or [L, C, ...].")
  _check_compatible("stack", parts)
  parts = [ElsaParams(*(a.reshape((1,) * (4 - p.w1.ndim) + a.shape)
                        for a in p)) for p in parts]
  k = max(p.k for p in parts)
  c = max(p.w1.shape[1] for p in parts)

  def pad_components(p):
    return ElsaParams(*(jnp.pad(a, [(0, 0), (0, c - a.shape[1])]
                                + [(0, 0)] * (a.ndim - 2)) for a in p))

  parts = [pad_components(pad_inner(p, k)) for p in parts]
  return ElsaParams(*(jnp.concatenate(leaves) for leaves in zip(*parts)))
