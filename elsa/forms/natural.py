r"""The Natural input form: the naturally enumerated tokens, one GD step per layer from w0 = 0.

The input is one token ``(x_i, y_i)`` per example in arrival order, then one
token ``(x_q, 0)`` per query in the SAME columns, plus zero-initialised extras:
``d`` w-rows at the end and the columns ``z`` (d) and ``p`` (n_out):

=================  ======  ======  ======  ======
rows \ columns     x       y       z       p
=================  ======  ======  ======  ======
example i  (N)     x_i     y_i     0       0
query q    (Q)     x_q     0       0       0
w-row j    (d)     0       0       0       0
=================  ======  ======  ======  ======

Layer 1 takes the first GD step AND moves every query's ``x`` into ``z``;
afterwards the state is exactly the layout of :mod:`elsa.forms._gd_form` (the
Designed one), and layers ``2..L`` are Designed layers. Layer ``t`` is GD step
``t``: no set-up layer.

Why ``w0 = 0``: in layer 1 the queries still sit in the x columns, so they are
inside the key/value sum, each looking like an example with label 0. Their
value ``(eta/N)(0 - p_q)`` vanishes only because ``p_q = x_q^T w0 = 0``.
"""

from __future__ import annotations

import jax.numpy as jnp

from elsa import constructions
from elsa.attention import Array, ElsaParams
from elsa.forms._gd_form import GDForm


class Natural(GDForm):
  r"""GD on ridge regression from the naturally enumerated tokens, ``w0 = 0``.

  ``form.decode_w(elsa_stack(form.gd_params(lam=lam, eta=eta, depth=L),
  form.encode(x, y, x_query=xq), return_all=True))[t] ==
  elsa.ridge.gd(x, y, lam=lam, eta=eta, steps=L)[t]`` for ``t = 0..L``.
  ``gd_params`` has ``C = 3`` components per layer (``2`` if ``Q == 0``):
  layer 1 is :meth:`first_layer`; layers ``2..L`` are the Designed layers,
  padded with one zero component (exact: it adds 0) so every layer has the
  same ``C`` for :func:`elsa.elsa_stack`.

  Args:
    n_train: examples per task ``N``.
    d: input dimension.
    n_query: query tokens ``Q`` (may be 0).
    n_out: target columns (1: scalar targets, see :class:`GDForm`).
  """

  def encode(self, x, y, *, x_query=None, w0=None) -> Array:
    """The naturally enumerated tokens ``[..., m, n]`` (table in the module doc).

    Args:
      x: ``[..., N, d]``, floating; its dtype is the state's dtype.
      y: ``[..., N]`` (``n_out == 1``) or ``[..., N, n_out]``.
      x_query: ``[..., Q, d]``; may be ``None`` when ``Q == 0``.
      w0: must be ``None``: this form starts from ``w0 = 0``. For another
        start use :class:`~elsa.forms.Designed` (BUILD_NOTES.md, "Input forms").

    Raises:
      ValueError: a shape does not match, or ``w0`` is given.
      TypeError: ``y`` or ``x_query`` has a dtype other than ``x``'s.
    """
    if w0 is not None:
      raise ValueError(
          "Natural.encode: w0 must be None; the natural form starts from w0 = 0 "
          "(a query inside the first layer's key/value sum acts as an example "
          "with label 0 once x_q^T w0 != 0). Use elsa.forms.Designed for a "
          "nonzero start.")
    x, y, x_query, _ = self._check_inputs(x, y, x_query)
    return self._jit("encode", "_initial_state", x, y, x_query)

  def _initial_state(self, x, y, x_query) -> Array:
    zeros = lambda rows: jnp.zeros((*x.shape[:-2], rows, self.n_out), x.dtype)
    return self._assemble(
        x_cols_ex=x, y_ex=y, p_ex=zeros(self.n_train),
        x_cols_q=x_query, z_q=jnp.zeros_like(x_query),
        p_q=zeros(self.n_query), p_w=zeros(self.d))

  def move_queries(self, *, dtype=None) -> ElsaParams:
    """On the query rows, ``x -> z``: adds ``x_q`` to z and ``-x_q`` to x. One component.

    :func:`elsa.constructions.rows_linear` over the query rows with
    ``Q = S_x S_z^T - S_x S_x^T`` (``S_x, S_z`` the column selectors): the term
    ``B3 B1^T (h W2)`` with ``B3 = B1`` the query-row selector
    (``TokenForm._move_query_x`` with scale 1). Needs ``n_query >= 1``.
    """
    dtype = self._float_dtype("move_queries", dtype)
    return self._move_query_x(self.z_cols, scale=1, dtype=dtype)

  def first_layer(self, *, lam, eta, dtype=None) -> ElsaParams:
    """Layer 1: decayed skip, gradient head, query move; leaves ``[C, ...]``.

    The Designed layer reads queries from x and z alike, so with the queries
    still in x it gives them ``p_q = x_q^T w_1``; the skip's decay acts on
    ``p = 0``. With ``Q == 0`` there is nothing to move (two components).
    ``lam``, ``eta``: scalars (Python numbers or arrays); ``dtype`` as in
    :meth:`gd_params`.
    """
    lam, eta = self._scalars("first_layer", dtype, lam=lam, eta=eta)
    parts = [self.decayed_skip(lam=lam, eta=eta), self.gradient_head(eta=eta)]
    if self.n_query:
      parts.append(self.move_queries(dtype=eta.dtype))
    return constructions.layer(*parts)

  def _gd_stack(self, lam, etas) -> ElsaParams:
    """Layer 1 is :meth:`first_layer`, the rest :meth:`gd_layer` (padded)."""
    first = self.first_layer(lam=lam, eta=etas[0])
    if etas.shape[0] == 1:
      return constructions.stack(first)
    return constructions.stack(first, self.gd_layers(lam=lam, etas=etas[1:]))

  def _gd_basis(self, *, depth, dtype) -> ElsaParams:
    """Layer 1: :meth:`_basis_components` and the query move; the rest:
    :meth:`_basis_components` (padded). ``C`` as in :meth:`gd_params`."""
    parts = self._basis_components(dtype)
    if self.n_query:
      parts.append(self.move_queries(dtype=dtype))
    first = constructions.layer(*parts)
    if depth == 1:
      return constructions.stack(first)
    rest = constructions.layer(*self._basis_components(dtype))
    return constructions.stack(first, ElsaParams(*(
        jnp.broadcast_to(a, (depth - 1, *a.shape)) for a in rest)))

  def _gd_coefficients(self, lam, etas) -> Array:
    """Those of :class:`GDForm`, and 1 for the query move (zero after layer 1)."""
    coeffs = super()._gd_coefficients(lam, etas)
    if not self.n_query:
      return coeffs
    return jnp.concatenate([coeffs, jnp.ones_like(coeffs[:, :1])], axis=1)
