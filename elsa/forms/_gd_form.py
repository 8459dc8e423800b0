r"""The token layout shared by the GD input forms, and the GD layer built on it.

Both :class:`~elsa.forms.Designed` and :class:`~elsa.forms.Natural` lay a
ridge task (``x: [N, d]``, ``y: [N, n_out]``, queries ``x_q: [Q, d]``) out as the
same ``[m, n]`` grid, ``m = N + Q + d`` tokens by ``n = 2d + 2k`` features:

=================  ==========  ==========  ==========  ====================
rows \ columns     x  (d)      y (n_out)   z  (d)      p (n_out)
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

import jax
import jax.numpy as jnp

from elsa import constructions
from elsa.attention import Array, ElsaParams
from elsa.forms._token_form import TokenForm


class GDForm(TokenForm):
  """Base of the GD input forms: layout, decoding, the GD layer and stack.

  Subclasses define ``encode`` (the initial state) and ``_gd_stack`` (the
  layers of :meth:`gd_params`); everything else is shared. Sizes, validation
  and value equality come from :class:`~elsa.forms._token_form.TokenForm`.

  Attributes:
    n_train, d, n_query, n_out: examples ``N``, input dimension ``d``, queries ``Q``,
      target columns ``n_out``.
    m, n: token count ``N + Q + d`` and feature count ``2d + 2 n_out`` of a state.
    example_rows, query_rows, w_rows: row slices of the three token blocks.
    x_cols, y_cols, z_cols, p_cols: column slices of the four feature blocks.

  ``n_out`` is the number of target columns. With ``n_out == 1`` the targets
  are scalars: ``encode`` takes ``y`` as ``[..., N]`` (or ``[..., N, 1]``) and
  the decoders return ``[..., d]`` and ``[..., Q]``, the shapes
  :func:`elsa.ridge.gd` gives for ``y: [..., N]``. With ``n_out > 1`` ``y`` is
  ``[..., N, n_out]`` and the decoders return ``[..., d, n_out]`` and ``[..., Q, n_out]``.
  The decoders see only ``h``, so their shape depends on ``n_out`` alone.
  """

  def _blocks(self) -> dict:
    example_rows, query_rows, w_rows = self._row_blocks(slice)
    x_cols, y_cols, z_cols, p_cols = self._consecutive(
        slice, self.d, self.n_out, self.d, self.n_out)
    return dict(example_rows=example_rows, query_rows=query_rows,
                w_rows=w_rows, x_cols=x_cols, y_cols=y_cols, z_cols=z_cols,
                p_cols=p_cols, _w_block=(w_rows, p_cols),
                _pred_block=(query_rows, p_cols))

  @property
  def n(self) -> int:
    """Feature count of a state, ``2d + 2 n_out``."""
    return 2 * self.d + 2 * self.n_out

  # --- decoding -------------------------------------------------------------
  # decode_w and decode_pred are TokenForm's, on _w_block and _pred_block.

  def decode_train_pred(self, h) -> Array:
    """Predictions on the examples ``x_i^T w``: ``[..., m, n] -> [..., N(, n_out)]``."""
    return self._out(self._read("decode_train_pred", h, self.example_rows,
                                self.p_cols))

  # --- encoding helpers ------------------------------------------------------

  def _assemble(self, *, x_cols_ex, y_ex, p_ex, x_cols_q, z_q, p_q, p_w):
    """Concatenates the blocks of the layout table into ``[..., m, n]``."""
    batch, dtype = y_ex.shape[:-2], y_ex.dtype
    zeros = lambda rows, cols: jnp.zeros((*batch, rows, cols), dtype)
    N, Q, d, n_out = self.n_train, self.n_query, self.d, self.n_out
    example = jnp.concatenate([x_cols_ex, y_ex, zeros(N, d), p_ex], axis=-1)
    query = jnp.concatenate([x_cols_q, zeros(Q, n_out), z_q, p_q], axis=-1)
    w = jnp.concatenate([zeros(d, 2 * d + n_out), p_w], axis=-1)
    return jnp.concatenate([example, query, w], axis=-2)

  # --- parameters ------------------------------------------------------------

  def gd_params(self, *, lam, eta, depth: int, dtype=None) -> ElsaParams:
    r"""``depth`` GD layers: leaves ``[depth, C, ...]`` for :func:`elsa.elsa_stack`.

    Layer ``t`` (1-based) performs :math:`w_t = (1 - \eta_t\lambda) w_{t-1} -
    \frac{\eta_t}{N} X^\top (X w_{t-1} - y)`. How, and so ``C``, is in the
    docstrings of :class:`~elsa.forms.Designed` and
    :class:`~elsa.forms.Natural`.

    Args:
      lam: ridge strength, a scalar; may be a traced array.
      eta: step size, a scalar or a schedule ``[depth]``; may be traced.
      depth: number of layers ``L >= 1`` (static).
      dtype: dtype of every leaf; it must equal the state's dtype. Default:
        the dtype of ``lam``/``eta`` if either is an array, else JAX's default
        float (float64 under ``jax_enable_x64``).

    Raises:
      ValueError: ``depth < 1``, ``lam`` is not a scalar, or ``eta`` is
        neither a scalar nor ``[depth]``; a concrete (not traced) ``lam`` is
        negative or ``eta`` not positive, or either is not finite.
      TypeError: ``depth`` is not an int, or ``dtype`` is not floating.
    """
    lam, etas = self._schedule(lam=lam, eta=eta, depth=depth, dtype=dtype)
    return self._jit("gd_params", "_gd_stack", lam, etas)

  def _gd_stack(self, lam: Array, etas: Array) -> ElsaParams:
    """The layers of :meth:`gd_params` from checked ``lam: []``, ``etas: [L]``."""
    raise NotImplementedError

  def gd_basis(self, *, depth: int, dtype=None) -> ElsaParams:
    r"""The components of :meth:`gd_params` with ``lam`` and ``eta`` taken out: ``[depth, C, ...]``.

    With ``a = gd_coefficients(lam=lam, eta=eta, depth=depth)``,
    ``elsa.elsa_stack(gd_basis(depth=L), h, coeffs=a)`` computes
    ``elsa.elsa_stack(gd_params(lam=lam, eta=eta, depth=L), h)``: the
    decayed skip is the identity with its output columns scaled by
    ``diag(D)``, ``D = diag(1 on x, y, z; 1 - eta_t lam on p)``, and the
    gradient head is linear in ``eta``,

    .. math::
      h \mapsto h\, D_t + \eta_t\, \mathrm{head}_1(h).

    So the components are :func:`elsa.constructions.identity` and
    :meth:`gradient_head` with ``eta = 1`` (and, for
    :class:`~elsa.forms.Natural`, its query move): ``C`` as in
    :meth:`gd_params`. They do not depend on ``lam`` or ``eta``, so one basis
    serves every item of a sweep, and the items' projections run as one
    matmul instead of one parameter stack per item.

    Args:
      depth: number of layers ``L >= 1`` (static).
      dtype: floating dtype of every leaf (default: JAX's default float).

    Raises:
      ValueError: ``depth`` is not an int >= 1.
      TypeError: ``dtype`` is not floating.
    """
    self._check_int(self._name("gd_basis"), "depth", depth, low=1)
    dtype = self._float_dtype("gd_basis", dtype)
    return self._jit("gd_basis", "_gd_basis", depth=depth, dtype=dtype)

  def gd_coefficients(self, *, lam, eta, depth: int, dtype=None) -> Array:
    r"""Per-column coefficients ``[depth, C, n]`` of :meth:`gd_basis`, the ``coeffs`` of :func:`elsa.elsa_stack`.

    Layer ``t``: the diagonal of ``D_t`` (1, and ``1 - eta_t lam`` on the p
    columns) for the skip, ``eta_t`` on every column for the gradient head
    (whose output is zero outside the p columns), and 1 for
    :class:`~elsa.forms.Natural`'s query move. Arguments, defaults and
    errors as in :meth:`gd_params`; for a batch of items, vmap over ``lam``
    and ``eta``.
    """
    lam, etas = self._schedule(lam=lam, eta=eta, depth=depth, dtype=dtype,
                               method="gd_coefficients")
    return self._jit("gd_coefficients", "_gd_coefficients", lam, etas)

  def _gd_basis(self, *, depth: int, dtype) -> ElsaParams:
    """The layers of :meth:`gd_basis` (set by the subclass)."""
    raise NotImplementedError

  def _basis_components(self, dtype) -> list[ElsaParams]:
    """The identity and the gradient head with ``eta = 1``."""
    return [constructions.identity(self.m, self.n, dtype=dtype),
            self.gradient_head(eta=1, dtype=dtype)]

  def _gd_coefficients(self, lam: Array, etas: Array) -> Array:
    """``[L, 2, n]``: the coefficients of :meth:`_basis_components`."""
    is_p = jnp.zeros(self.n, bool).at[self.p_cols].set(True)
    skip = jnp.where(is_p, 1 - etas[:, None] * lam, jnp.ones((), etas.dtype))
    head = jnp.broadcast_to(etas[:, None], skip.shape)
    return jnp.stack([skip, head], axis=1)

  def _schedule(self, *, lam, eta, depth, dtype, method="gd_params"):
    """Validates ``lam, eta, depth``; returns ``lam`` and ``eta`` as ``[depth]``."""
    self._check_int(self._name(method), "depth", depth, low=1)
    dtype = self._float_dtype(method, dtype, lam, eta)
    lam, eta = self._scalar(method, "lam", lam, dtype), jnp.asarray(eta, dtype)
    if eta.shape not in ((), (depth,)):
      raise self._shape_error(self._name(method), "eta", f"() or the schedule "
                              f"({depth},) for depth={depth}", eta.shape)
    self._in_range(method, "lam", lam, low=0, strict=False)
    self._in_range(method, "eta", eta, low=0, strict=True)
    return lam, jnp.broadcast_to(eta, (depth,))

  def _col_selector(self, cols: slice, dtype) -> Array:
    """``[n, width]``: ``h @ S`` reads the columns ``cols``."""
    return constructions.selector(self.n, range(self.n)[cols], dtype=dtype)

  def decayed_skip(self, *, lam, eta, dtype=None) -> ElsaParams:
    """``h -> h D``, ``D = diag(1 on x, y, z; 1 - eta lam on p)``: one component.

    :func:`elsa.constructions.linear` with ``P = I``: the term
    ``(h W3)(B1^T B2)`` with ``W3 = I_n``, ``B1^T B2 = D`` when ``m >= n``,
    else the bias route ``B3 B1^T (h W2)`` with ``B3 = B1 = I_m``, ``W2 = D``.

    ``lam``, ``eta``: scalars (Python numbers or arrays, may be traced);
    ``dtype`` as in :meth:`gd_params`. The same holds for the other building
    blocks (:meth:`gradient_head`, :meth:`gd_layer`, :meth:`gd_layers`).
    """
    lam, eta = self._scalars("decayed_skip", dtype, lam=lam, eta=eta)
    is_p = jnp.zeros(self.n, bool).at[self.p_cols].set(True)
    diag = jnp.where(is_p, 1 - eta * lam, jnp.ones((), lam.dtype))
    return constructions.linear(None, jnp.diag(diag), m=self.m)

  def gradient_head(self, *, eta, dtype=None) -> ElsaParams:
    r"""Adds ``(eta/N) q^T X^T (y - p)`` to the p columns of every row: one component.

    Inner width ``d``. Only two of the eight terms of
    ``(hW3 + B3)(hW1 + B1)^T(hW2 + B2)`` are nonzero (``B1 = B2 = 0``):

    * ``K = h W1``, ``W1`` reads the x columns: ``x_i`` on examples, 0 on
      queries (their x sits in z) and on w-rows.
    * ``V = h W2``, ``W2 = (eta/N)(y cols -> p cols) - (eta/N)(p cols -> p
      cols)``: ``(eta/N)(y_i - p_i)`` in the p columns. So ``K^T V = (eta/N)
      X^T (y - X w_t)``, ``[d, n_out]`` placed in the p columns.
    * ``Q = h W3 + B3``: ``W3`` reads x and z columns (``x_i`` on examples,
      ``x_q`` on queries), ``B3 = e_j`` on w-row ``j``. Term
      ``(hW3)(hW1)^T(hW2)`` updates the predictions, ``B3 (hW1)^T (hW2)``
      the weights.
    """
    eta, = self._scalars("gradient_head", dtype, eta=eta)
    dtype = eta.dtype
    sel_x = self._col_selector(self.x_cols, dtype)
    sel_z = self._col_selector(self.z_cols, dtype)
    sel_y = self._col_selector(self.y_cols, dtype)
    sel_p = self._col_selector(self.p_cols, dtype)
    w_rows = constructions.selector(self.m, range(self.m)[self.w_rows],
                                    dtype=dtype)
    head = ElsaParams.zeros(m=self.m, n=self.n, k=self.d, dtype=dtype)
    return head._replace(w1=sel_x, w3=sel_x + sel_z, b3=w_rows,
                         w2=(eta / self.n_train) * (sel_y - sel_p) @ sel_p.T)

  def gd_layer(self, *, lam, eta, dtype=None) -> ElsaParams:
    """One GD step on a state of the layout table: leaves ``[2, ...]``."""
    lam, eta = self._scalars("gd_layer", dtype, lam=lam, eta=eta)
    return constructions.layer(self.decayed_skip(lam=lam, eta=eta),
                               self.gradient_head(eta=eta))

  def gd_layers(self, *, lam, etas, dtype=None) -> ElsaParams:
    """``len(etas)`` GD layers, one per step size ``etas [L]``: leaves ``[L, 2, ...]``."""
    method = "gd_layers"
    dtype = self._float_dtype(method, dtype, lam, etas)
    lam, etas = self._scalar(method, "lam", lam, dtype), jnp.asarray(etas, dtype)
    if etas.ndim != 1:
      raise self._shape_error(self._name(method), "etas", "[L]", etas.shape)
    return jax.vmap(lambda eta: self.gd_layer(lam=lam, eta=eta))(etas)
