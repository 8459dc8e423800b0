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

from elsa.attention import Array, ElsaParams
from elsa.forms._gd_form import GDForm, _component


class Natural(GDForm):
  r"""GD on ridge regression from the naturally enumerated tokens, ``w0 = 0``.

  ``form.decode_w(elsa_stack(form.gd_params(lam=lam, eta=eta, depth=L),
  form.encode(x, y, x_query=xq), return_all=True))[t] ==
  elsa.ridge.gd(x, y, lam=lam, eta=eta, steps=L)[t]`` for ``t = 0..L``.
  ``gd_params`` has ``C = 3`` components per layer (``2`` if ``Q == 0``):
  layer 1 is :meth:`first_layer`; layers ``2..L`` are the Designed layers,
  padded with one zero component (exact: it adds 0) so every layer has the
  same ``C`` for :func:`elsa.elsa_stack`. Both are the compiled
  :attr:`program` with the queries arriving in ``x``: the compiler moves them
  home to ``z`` during the first iteration (:meth:`move_queries`).

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
        start use :class:`~elsa.forms.Designed` (docs/guides/forms.md).

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

  _starts_at_zero = True

  @property
  def _query_columns(self) -> slice:
    return self.x_cols

  def _initial_state(self, x, y, x_query) -> Array:
    return self._encode_blocks(X=x, y=y, Xq=x_query)

  def move_queries(self, *, dtype=None) -> ElsaParams:
    """On the query rows, ``x -> z``: adds ``x_q`` to z and ``-x_q`` to x. One component.

    The compiler's correction of the first layer's column mix on the query
    rows (the mix carries x on every row; the queries' home is z):
    :func:`elsa.constructions.rows_linear` over the query rows with ``Q =
    S_x S_z^T - S_x S_x^T`` (``S_x, S_z`` the column selectors), the term
    ``B3 B1^T (h W2)`` with ``B3 = B1`` the query-row selector. Needs
    ``n_query >= 1``.
    """
    dtype = self._float_dtype("move_queries", dtype)
    if not self.n_query:
      raise ValueError("Natural.move_queries: there are no queries to move "
                       "(n_query=0).")
    return _component(self.first_layer(lam=0, eta=1, dtype=dtype), 2)

  def first_layer(self, *, lam, eta, dtype=None) -> ElsaParams:
    """Layer 1: decayed skip, gradient head, query move; leaves ``[C, ...]``.

    The Designed layer reads queries from x and z alike, so with the queries
    still in x it gives them ``p_q = x_q^T w_1``; the skip's decay acts on
    ``p = 0``. With ``Q == 0`` there is nothing to move (two components).
    ``lam``, ``eta``: scalars (Python numbers or arrays); ``dtype`` as in
    :meth:`gd_params`.
    """
    lam, eta = self._scalars("first_layer", dtype, lam=lam, eta=eta)
    return _component(self._gd_stack(lam, eta[None]), 0)
