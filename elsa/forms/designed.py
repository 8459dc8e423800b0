r"""The Designed input form: one ELSA layer of two components per GD step, any start w0.

Layout (see :mod:`elsa.forms._gd_form`): rows ``[N examples | Q queries | d
w-rows]``, columns ``[x (d) | y (n_out) | z (d) | p (n_out)]``. The initial state holds
``w0`` and every prediction ``x^T w0``; queries sit in the ``z`` columns from
the start, so they never enter the gradient's key/value sum.
"""

from __future__ import annotations

import jax.numpy as jnp

from elsa.attention import Array
from elsa.forms._gd_form import GDForm


class Designed(GDForm):
  r"""GD on ridge regression, one step per layer, from any ``w0``.

  ``elsa_stack(form.gd_params(lam=lam, eta=eta, depth=L), form.encode(x, y,
  x_query=xq, w0=w0), return_all=True)`` holds ``w_t`` of
  :func:`elsa.ridge.gd` (same ``w0``) in state ``t`` for ``t = 0..L``.
  Every layer of ``gd_params`` is :meth:`gd_layer`, two components (``C =
  2``): the decayed skip and the gradient head (see :mod:`elsa.forms._gd_form`),
  the compiled :attr:`program` with the queries arriving in ``z``.

  Args:
    n_train: examples per task ``N``.
    d: input dimension.
    n_query: query tokens ``Q`` (may be 0).
    n_out: target columns (1: scalar targets, see :class:`GDForm`).

  Example:
    >>> form = Designed(n_train=8, d=3, n_query=2)
    >>> form.m, form.n
    (13, 8)
  """

  def encode(self, x, y, *, x_query=None, w0=None) -> Array:
    """The initial state ``[..., m, n]``.

    Args:
      x: ``[..., N, d]``, floating; its dtype is the state's dtype.
      y: ``[..., N]`` (``n_out == 1``) or ``[..., N, n_out]``.
      x_query: ``[..., Q, d]``; may be ``None`` when ``Q == 0``. Leading axes
        broadcast to those of ``x``.
      w0: start ``[..., d]`` (``n_out == 1``) or ``[..., d, n_out]``; zero if
        ``None``. Leading axes broadcast.

    Raises:
      ValueError: a shape does not match the form (the message names it).
      TypeError: ``y``, ``x_query`` or ``w0`` has a dtype other than ``x``'s.
    """
    x, y, x_query, w0 = self._check_inputs(x, y, x_query, w0)
    if w0 is None:
      w0 = jnp.zeros((*x.shape[:-2], self.d, self.n_out), x.dtype)
    return self._jit("encode", "_initial_state", x, y, x_query, w0)

  @property
  def _query_columns(self) -> slice:
    return self.z_cols

  def _initial_state(self, x, y, x_query, w0) -> Array:
    return self._encode_blocks(X=x, y=y, Xq=x_query, w=w0, Xw=x @ w0,
                               p=x_query @ w0)
