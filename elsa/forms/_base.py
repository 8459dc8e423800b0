r"""The token layout shared by the GD input forms, and the GD layer built on it.

Both :class:`~elsa.forms.Designed` and :class:`~elsa.forms.Natural` lay a
ridge task (``x: [N, d]``, ``y: [N, k]``, queries ``x_q: [Q, d]``) out as the
same ``[m, n]`` grid, ``m = N + Q + d`` tokens by ``n = 2d + 2k`` features:

=================  ==========  ==========  ==========  ====================
rows \ columns     x  (d)      y  (k)      z  (d)      p  (k)
=================  ==========  ==========  ==========  ====================
example i  (N)     x_i         y_i         0           x_i^T w_t
query q    (Q)     0           0           x_q         x_q^T w_t
w-row j    (d)     0           0           0           w_t[j, :]
=================  ==========  ==========  ==========  ====================

(the state after step ``t``; the forms differ only in the initial state, see
their docstrings). One GD step on every prediction slot at once is

.. math::
  p' = (1 - \eta\lambda)\, p + \frac{\eta}{N}\, q^\top X^\top (y - p_{\mathrm{ex}}),

with ``q = x_i`` (example), ``x_q`` (query) or ``e_j`` (w-row ``j``): one ELSA
layer of two components, :func:`decayed_skip` and :func:`gradient_head`.
Queries sit in the ``z`` columns so that they never enter the key/value sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from elsa import constructions
from elsa.attention import Array, ElsaParams


def _shape_error(fn: str, arg: str, want: str, got) -> ValueError:
  return ValueError(f"{fn}: {arg} must have shape {want}, got {tuple(got)}.")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jitted(form: "GDForm", method: str, *args):
  """``form.method(*args)`` compiled once per form and shape: eager callers
  would otherwise compile each of the many small ops separately."""
  return getattr(form, method)(*args)


class GDForm:
  """Base of the GD input forms: layout, validation, decoding, the GD layer.

  Subclasses define ``encode`` (the initial state) and ``gd_params`` (the
  stack); everything else is shared.

  Attributes:
    n_train, d, n_query, n_out: ``N``, ``d``, ``Q``, ``k``.
    m, n: token count ``N + Q + d`` and feature count ``2d + 2k`` of a state.
    example_rows, query_rows, w_rows: row slices of the three token blocks.
    x_cols, y_cols, z_cols, p_cols: column slices of the four feature blocks.

  ``n_out = k`` is the number of target columns. With ``k == 1`` the targets
  are scalars: ``encode`` takes ``y`` as ``[..., N]`` (or ``[..., N, 1]``) and
  the decoders return ``[..., d]`` and ``[..., Q]``, the shapes
  :func:`elsa.ridge.gd` gives for ``y: [..., N]``. With ``k > 1`` ``y`` is
  ``[..., N, k]`` and the decoders return ``[..., d, k]`` and ``[..., Q, k]``.
  The decoders see only ``h``, so their shape depends on ``n_out`` alone.
  """

  def __init__(self, *, n_train: int, d: int, n_query: int = 1,
               n_out: int = 1):
    name = type(self).__name__
    for arg, value, low in (("n_train", n_train, 1), ("d", d, 1),
                            ("n_query", n_query, 0), ("n_out", n_out, 1)):
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: {arg} must be an int >= {low}, got "
                         f"{value!r}.")
    self.n_train, self.d, self.n_query, self.n_out = n_train, d, n_query, n_out
    N, Q, k = n_train, n_query, n_out
    self.example_rows = slice(0, N)
    self.query_rows = slice(N, N + Q)
    self.w_rows = slice(N + Q, N + Q + d)
    self.x_cols = slice(0, d)
    self.y_cols = slice(d, d + k)
    self.z_cols = slice(d + k, 2 * d + k)
    self.p_cols = slice(2 * d + k, 2 * d + 2 * k)

  @property
  def m(self) -> int:
    """Token count of a state, ``N + Q + d``."""
    return self.n_train + self.n_query + self.d

  @property
  def n(self) -> int:
    """Feature count of a state, ``2d + 2k``."""
    return 2 * self.d + 2 * self.n_out

  def _key(self) -> tuple:
    return (type(self), self.n_train, self.d, self.n_query, self.n_out)

  # Forms compare by value so that they can be static arguments of jax.jit.
  def __eq__(self, other) -> bool:
    return isinstance(other, GDForm) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(n_train={self.n_train}, d={self.d}, "
            f"n_query={self.n_query}, n_out={self.n_out})")

  # --- decoding -------------------------------------------------------------

  def _out(self, block: Array) -> Array:
    return block[..., 0] if self.n_out == 1 else block

  def _check_state(self, fn: str, h) -> Array:
    h = jnp.asarray(h)
    if h.ndim < 2 or h.shape[-2:] != (self.m, self.n):
      raise _shape_error(f"{type(self).__name__}.{fn}", "h",
                         f"[..., m={self.m}, n={self.n}]", h.shape)
    return h

  def decode_w(self, h) -> Array:
    """The weights held in the w-rows: ``[..., m, n] -> [..., d(, k)]``.

    Works on any leading axes, e.g. all states ``[L + 1, ..., m, n]`` of
    ``elsa_stack(..., return_all=True)``.
    """
    h = self._check_state("decode_w", h)
    return self._out(h[..., self.w_rows, self.p_cols])

  def decode_pred(self, h) -> Array:
    """Query predictions ``x_q^T w``: ``[..., m, n] -> [..., Q(, k)]``."""
    h = self._check_state("decode_pred", h)
    return self._out(h[..., self.query_rows, self.p_cols])

  def decode_train_pred(self, h) -> Array:
    """Predictions on the examples ``x_i^T w``: ``[..., m, n] -> [..., N(, k)]``."""
    h = self._check_state("decode_train_pred", h)
    return self._out(h[..., self.example_rows, self.p_cols])

  # --- encoding helpers ------------------------------------------------------

  def _check_inputs(self, x, y, x_query, w0):
    """Validates the task; returns ``x, y [..., N, k], x_query, w0 [..., d, k]``
    with ``x_query``/``w0`` broadcast to the batch shape of ``x`` (``w0`` may be
    ``None``)."""
    fn = f"{type(self).__name__}.encode"
    N, d, Q, k = self.n_train, self.d, self.n_query, self.n_out
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{fn}: x must have a floating dtype, got {x.dtype}.")
    if x.ndim < 2 or x.shape[-2:] != (N, d):
      raise _shape_error(fn, "x", f"[..., N={N}, d={d}]", x.shape)
    batch = x.shape[:-2]

    def same_dtype(arg, a):
      a = jnp.asarray(a)
      if a.dtype != x.dtype:
        raise TypeError(f"{fn}: {arg} has dtype {a.dtype} but x has dtype "
                        f"{x.dtype}; cast one of them explicitly.")
      return a

    y = same_dtype("y", y)
    if k == 1 and y.shape == (*batch, N):
      y = y[..., None]
    if y.shape != (*batch, N, k):
      want = f"{(*batch, N)} or " if k == 1 else ""
      raise _shape_error(fn, "y", f"{want}{(*batch, N, k)} (x has shape "
                         f"{x.shape}, n_out={k})", y.shape)

    def broadcast(arg, a, tail, want):
      if a.ndim < len(tail) or a.shape[a.ndim - len(tail):] != tail:
        raise _shape_error(fn, arg, want, a.shape)
      try:
        return jnp.broadcast_to(a, (*batch, *tail))
      except ValueError:
        raise _shape_error(fn, arg, f"{want} with leading axes broadcastable "
                           f"to x's {batch}", a.shape) from None

    if x_query is None:
      if Q:
        raise ValueError(f"{fn}: x_query is required with n_query={Q}; pass "
                         f"an array of shape [..., {Q}, {d}].")
      x_query = jnp.zeros((*batch, 0, d), x.dtype)
    x_query = broadcast("x_query", same_dtype("x_query", x_query), (Q, d),
                        f"[..., Q={Q}, d={d}]")
    if w0 is not None:
      w0 = same_dtype("w0", w0)
      if k == 1 and w0.ndim >= 1 and w0.shape[-1] == d:
        w0 = w0[..., None]
      w0 = broadcast("w0", w0, (d, k), f"[..., d={d}]" if k == 1
                     else f"[..., d={d}, k={k}]")
    return x, y, x_query, w0

  def _assemble(self, *, x_cols_ex, y_ex, p_ex, x_cols_q, z_q, p_q, p_w):
    """Concatenates the blocks of the layout table into ``[..., m, n]``."""
    batch, dtype = y_ex.shape[:-2], y_ex.dtype
    zeros = lambda rows, cols: jnp.zeros((*batch, rows, cols), dtype)
    N, Q, d, k = self.n_train, self.n_query, self.d, self.n_out
    example = jnp.concatenate([x_cols_ex, y_ex, zeros(N, d), p_ex], axis=-1)
    query = jnp.concatenate([x_cols_q, zeros(Q, k), z_q, p_q], axis=-1)
    w = jnp.concatenate([zeros(d, 2 * d + k), p_w], axis=-1)
    return jnp.concatenate([example, query, w], axis=-2)

  # --- parameters ------------------------------------------------------------

  def _params(self, *, lam, eta, depth, dtype) -> ElsaParams:
    """Validates, then builds ``self._gd_stack(lam, etas)`` under jit."""
    lam, etas = self._schedule(lam=lam, eta=eta, depth=depth, dtype=dtype)
    return _jitted(self, "_gd_stack", lam, etas)

  def _schedule(self, *, lam, eta, depth, dtype):
    """Validates ``lam, eta, depth``; returns ``lam`` and ``eta`` as ``[depth]``."""
    fn = f"{type(self).__name__}.gd_params"
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
      raise ValueError(f"{fn}: depth must be an int >= 1, got {depth!r}.")
    if dtype is None:
      # Arrays (also tracers) carry a dtype; plain Python numbers do not.
      typed = [a for a in (lam, eta) if hasattr(a, "dtype")]
      dtype = jnp.result_type(*typed) if typed else jnp.float32
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"{fn}: dtype must be floating, got {dtype}.")
    lam, eta = jnp.asarray(lam, dtype), jnp.asarray(eta, dtype)
    if lam.ndim != 0:
      raise _shape_error(fn, "lam", "() (a scalar)", lam.shape)
    if eta.shape not in ((), (depth,)):
      raise _shape_error(fn, "eta", f"() or the schedule ({depth},) for "
                         f"depth={depth}", eta.shape)
    return lam, jnp.broadcast_to(eta, (depth,))

  def _col_selector(self, cols: slice, dtype) -> Array:
    """``[n, width]``: ``h @ S`` reads the columns ``cols``."""
    return constructions._selector(self.n, range(self.n)[cols], dtype)

  def decayed_skip(self, *, lam, eta) -> ElsaParams:
    """``h -> h D``, ``D = diag(1 on x, y, z; 1 - eta lam on p)``: one component.

    :func:`elsa.constructions.linear` with ``P = I``: the term
    ``(h W3)(B1^T B2)`` with ``W3 = I_n``, ``B1^T B2 = D`` when ``m >= n``,
    else the bias route ``B3 B1^T (h W2)`` with ``B3 = B1 = I_m``, ``W2 = D``.
    """
    is_p = jnp.zeros(self.n, bool).at[self.p_cols].set(True)
    diag = jnp.where(is_p, 1 - eta * lam, jnp.ones((), lam.dtype))
    return constructions.linear(None, jnp.diag(diag), m=self.m)

  def gradient_head(self, *, eta) -> ElsaParams:
    r"""Adds ``(eta/N) q^T X^T (y - p)`` to the p columns of every row: one component.

    Inner width ``d``. Only two of the eight terms of
    ``(hW3 + B3)(hW1 + B1)^T(hW2 + B2)`` are nonzero (``B1 = B2 = 0``):

    * ``K = h W1``, ``W1`` reads the x columns: ``x_i`` on examples, 0 on
      queries (their x sits in z) and on w-rows.
    * ``V = h W2``, ``W2 = (eta/N)(y cols -> p cols) - (eta/N)(p cols -> p
      cols)``: ``(eta/N)(y_i - p_i)`` in the p columns. So ``K^T V = (eta/N)
      X^T (y - X w_t)``, ``[d, k]`` placed in the p columns.
    * ``Q = h W3 + B3``: ``W3`` reads x and z columns (``x_i`` on examples,
      ``x_q`` on queries), ``B3 = e_j`` on w-row ``j``. Term
      ``(hW3)(hW1)^T(hW2)`` updates the predictions, ``B3 (hW1)^T (hW2)``
      the weights.
    """
    dtype = eta.dtype
    sel_x = self._col_selector(self.x_cols, dtype)
    sel_z = self._col_selector(self.z_cols, dtype)
    sel_y = self._col_selector(self.y_cols, dtype)
    sel_p = self._col_selector(self.p_cols, dtype)
    w_rows = constructions._selector(self.m, range(self.m)[self.w_rows], dtype)
    head = ElsaParams.zeros(m=self.m, n=self.n, k=self.d, dtype=dtype)
    return head._replace(w1=sel_x, w3=sel_x + sel_z, b3=w_rows,
                         w2=(eta / self.n_train) * (sel_y - sel_p) @ sel_p.T)

  def gd_layer(self, *, lam, eta) -> ElsaParams:
    """One GD step on a state of the layout table: leaves ``[2, ...]``."""
    return constructions.layer(self.decayed_skip(lam=lam, eta=eta),
                               self.gradient_head(eta=eta))

  def gd_layers(self, *, lam, etas) -> ElsaParams:
    """``len(etas)`` GD layers, one per step size: leaves ``[L, 2, ...]``."""
    return jax.vmap(lambda eta: self.gd_layer(lam=lam, eta=eta))(etas)
