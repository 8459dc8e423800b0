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

The forms are built on the compiler: :attr:`GDForm.program` writes this step
as a matrix program with ``w``, the example predictions ``Xw`` and the query
predictions ``p`` as states, :func:`elsa.programs.compile` lays them out in
one column (they decay alike) and emits the components, and the form reads
the compiled stack in its own column order. docs/guides/forms.md derives the
components the compiler emits.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from elsa import programs
from elsa.attention import Array, ElsaParams
from elsa.forms._token_form import TokenForm, _component


class GDForm(TokenForm):
  """Base of the GD input forms: layout, program, decoding, the GD layer and stack.

  Subclasses define ``encode`` (the initial state) and ``_query_columns``
  (where the queries arrive: ``x`` for :class:`~elsa.forms.Natural`, ``z``
  for :class:`~elsa.forms.Designed`); everything else is shared. Sizes,
  validation and value equality come from
  :class:`~elsa.forms._token_form.TokenForm`.

  Attributes:
    n_train, d, n_query, n_out: examples ``N``, input dimension ``d``, queries ``Q``,
      target columns ``n_out``.
    m, n: token count ``N + Q + d`` and feature count ``2d + 2 n_out`` of a state.
    example_rows, query_rows, w_rows: row slices of the three token blocks.
    x_cols, y_cols, z_cols, p_cols: column slices of the four feature blocks.
    program, compiled: the GD step as a matrix program, and its compiled stack.

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

  # --- the program ------------------------------------------------------------

  # Whether the form starts from w0 = 0 (its program's states init=0), set
  # by the subclass.
  _starts_at_zero: ClassVar[bool] = False

  @property
  def _query_columns(self) -> slice:
    """The columns where :meth:`encode` puts the queries (set by the subclass)."""
    raise NotImplementedError

  @property
  def program(self) -> programs.Program:
    r"""GD on ridge regression with every prediction a state:

    .. math::
      w' = (1 - \eta\lambda) w + \tfrac{\eta}{N} X^\top (y - Xw), \quad
      (Xw)' = (1 - \eta\lambda) Xw + \tfrac{\eta}{N} X X^\top (y - Xw), \quad
      p' = (1 - \eta\lambda) p + \tfrac{\eta}{N} X_q X^\top (y - Xw),

    inputs ``X``, ``y`` and ``Xq`` pinned to the rows and columns of the
    layout table (the queries in :attr:`_query_columns`), states ``w``, the
    example predictions ``Xw`` and the query predictions ``p``, scalars
    ``lam`` and ``eta`` (a ``[loops]`` schedule allowed), one loop.
    """
    N, d, Q, k = self.n_train, self.d, self.n_query, self.n_out
    cols = lambda block: range(self.n)[block]
    prog = programs.Program()
    X = prog.input("X", (N, d), at=(range(N), cols(self.x_cols)))
    y = prog.input("y", (N, k), at=(range(N), cols(self.y_cols)))
    # A form that starts from w0 = 0 says so (init=0): its first iteration
    # may then move the queries while w, Xw and p are still zero.
    start = 0 if self._starts_at_zero else None
    w = prog.state("w", (d, k), init=start)
    Xw = prog.state("Xw", (N, k), init=start)
    lam, eta = prog.scalar("lam"), prog.scalar("eta")
    decay = 1 - eta * lam
    body = {w: decay * w + (eta / N) * (X.T @ y - X.T @ Xw),
            Xw: decay * Xw + (eta / N) * (X @ X.T @ y - X @ X.T @ Xw)}
    if Q:
      Xq = prog.input("Xq", (Q, d), at=(range(self.m)[self.query_rows],
                                        cols(self._query_columns)))
      p = prog.state("p", (Q, k), init=start)
      body[p] = decay * p + (eta / N) * (Xq @ X.T @ y - Xq @ X.T @ Xw)
    prog.loop(body)
    return prog

  def _block_columns(self) -> dict:
    cols = lambda block: range(self.n)[block]
    return dict(X=cols(self.x_cols), y=cols(self.y_cols),
                Xq=cols(self.z_cols), w=cols(self.p_cols),
                Xw=cols(self.p_cols), p=cols(self.p_cols))

  # --- decoding -------------------------------------------------------------
  # decode_w and decode_pred are TokenForm's, on _w_block and _pred_block.

  def decode_train_pred(self, h) -> Array:
    """Predictions on the examples ``x_i^T w``: ``[..., m, n] -> [..., N(, n_out)]``."""
    return self._out(self._read("decode_train_pred", h, self.example_rows,
                                self.p_cols))

  # --- parameters ------------------------------------------------------------

  def gd_params(self, *, lam, eta, depth: int, dtype=None) -> ElsaParams:
    r"""``depth`` GD layers: leaves ``[depth, C, ...]`` for :func:`elsa.elsa_stack`.

    Layer ``t`` (1-based) performs :math:`w_t = (1 - \eta_t\lambda) w_{t-1} -
    \frac{\eta_t}{N} X^\top (X w_{t-1} - y)`: ``compiled.params(lam=lam,
    eta=eta, loops=depth)`` in the form's columns. Its components, and so
    ``C``, are in the docstrings of :class:`~elsa.forms.Designed` and
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
    """The layers of :meth:`gd_params` from checked ``lam: []``, ``etas: [L]``:
    ``compiled.params`` in the form's columns."""
    return self._from_compiled_params(self.compiled.params(
        lam=lam, eta=etas, loops=etas.shape[0], dtype=lam.dtype))

  def gd_basis(self, *, depth: int, dtype=None) -> ElsaParams:
    r"""The components of :meth:`gd_params` with ``lam`` and ``eta`` taken out: ``[depth, C, ...]``.

    With ``a = gd_coefficients(lam=lam, eta=eta, depth=depth)``,
    ``elsa.elsa_stack(gd_basis(depth=L), h, coeffs=a)`` computes
    ``elsa.elsa_stack(gd_params(lam=lam, eta=eta, depth=L), h)``: the
    decayed skip is the skip at ``lam = 0`` with its output columns scaled
    by ``diag(D)``, ``D = diag(1 on x, y, z; 1 - eta_t lam on p)``, and the
    gradient head is linear in ``eta``,

    .. math::
      h \mapsto h\, D_t + \eta_t\, \mathrm{head}_1(h).

    So the basis is :meth:`gd_params` at ``lam = 0, eta = 1``: ``C`` as
    there. It does not depend on ``lam`` or ``eta``, so one basis serves
    every item of a sweep, and the items' projections run as one matmul
    instead of one parameter stack per item.

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

  def _gd_basis(self, *, depth: int, dtype) -> ElsaParams:
    return self._from_compiled_params(self.compiled.params(
        lam=0.0, eta=1.0, loops=depth, dtype=dtype))

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

  def _gd_coefficients(self, lam: Array, etas: Array) -> Array:
    """``[L, C, n]``: skip, head, then 1 for every further component."""
    is_p = jnp.zeros(self.n, bool).at[self.p_cols].set(True)
    skip = jnp.where(is_p, 1 - etas[:, None] * lam, jnp.ones((), etas.dtype))
    head = jnp.broadcast_to(etas[:, None], skip.shape)
    rest = [jnp.ones_like(skip)] * (self.compiled.width - 2)
    return jnp.stack([skip, head, *rest], axis=1)

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

  # --- building blocks: components of the compiled layers -----------------------

  def decayed_skip(self, *, lam, eta, dtype=None) -> ElsaParams:
    """``h -> h D``, ``D = diag(1 on x, y, z; 1 - eta lam on p)``: one component.

    The compiler's column mix, :func:`elsa.constructions.linear`'s ``P = I``
    route: the term ``(h W3)(B1^T B2)`` with ``W3 = I_n``, ``B1^T B2 = D``
    when ``m >= n``, else ``B3 B1^T (h W2)`` with ``B3 = B1 = I_m``,
    ``W2 = D``.

    ``lam``, ``eta``: scalars (Python numbers or arrays, may be traced);
    ``dtype`` as in :meth:`gd_params`. The same holds for the other building
    blocks (:meth:`gradient_head`, :meth:`gd_layer`, :meth:`gd_layers`).
    """
    lam, eta = self._scalars("decayed_skip", dtype, lam=lam, eta=eta)
    return _component(self.gd_layer(lam=lam, eta=eta), 0)

  def gradient_head(self, *, eta, dtype=None) -> ElsaParams:
    r"""Adds ``(eta/N) q^T X^T (y - p)`` to the p columns of every row: one component.

    The compiler merges the program's three gradient terms (into ``w``,
    ``Xw`` and ``p``, equal in their second and third factors) into one
    component; only two of the eight terms of ``(hW3 + B3)(hW1 + B1)^T(hW2 +
    B2)`` are nonzero (``B1 = B2 = 0``):

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
    return _component(self.gd_layer(lam=0, eta=eta), 1)

  def gd_layer(self, *, lam, eta, dtype=None) -> ElsaParams:
    """One GD step on a state of the layout table: leaves ``[2, ...]``."""
    lam, eta = self._scalars("gd_layer", dtype, lam=lam, eta=eta)
    return _component(self.gd_layers(lam=lam, etas=eta[None]), 0)

  def gd_layers(self, *, lam, etas, dtype=None) -> ElsaParams:
    """``len(etas)`` GD layers, one per step size ``etas [L]``: leaves ``[L, 2, ...]``.

    The layers after the first of :meth:`gd_params` (for
    :class:`~elsa.forms.Natural` the first also moves the queries), without
    the padding component.
    """
    method = "gd_layers"
    dtype = self._float_dtype(method, dtype, lam, etas)
    lam, etas = self._scalar(method, "lam", lam, dtype), jnp.asarray(etas, dtype)
    if etas.ndim != 1:
      raise self._shape_error(self._name(method), "etas", "[L]", etas.shape)
    stack = self._gd_stack(lam, jnp.concatenate([etas[:1], etas]))
    return jax.tree.map(lambda a: a[1:, :2], stack)

