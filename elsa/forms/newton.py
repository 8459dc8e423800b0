r"""Newton–Schulz ridge regression compiled into an ELSA stack, from naturally enumerated tokens.

Ridge regression asks for :math:`w^* = A^{-1} b` with

.. math::
  A = X^\top X / N + \lambda I, \qquad b = X^\top y / N .

One ELSA component forms a product of three matrices held in its input, which
is exactly what the Newton–Schulz iteration needs:

.. math::
  M_{t+1} = M_t (2I - A M_t) = 2 M_t - M_t A M_t, \qquad M_0 = \alpha I,
  \qquad w_t = M_t b .

Since :math:`I - A M_{t+1} = (I - A M_t)^2`, induction gives
:math:`I - A M_t = (I - \alpha A)^{2^t}`, and gradient descent from zero with
step :math:`\alpha` has :math:`w^{GD}_s = A^{-1}(I - (I - \alpha A)^s) b`. So
Newton–Schulz step ``t`` *is* GD step ``2^t``: each layer doubles the number
of GD steps done, and ``O(log(kappa log(1/eps)))`` layers reach the solution
where GD needs ``O(kappa log(1/eps))``.

Layout, ``m = N + Q + d`` tokens by ``n = 3d + 2 n_out`` features (``N``
examples, ``Q`` queries), as encoded (left of the arrow) and after the set-up,
before Newton step ``t`` (right):

=================  ===========  ========  ========  ================  ==============
rows \ columns     x (d)        y (n_out) a (d)     mcol (d)          w (n_out)
=================  ===========  ========  ========  ================  ==============
example i  (N)     x_i          y_i       0         0                 0
query q    (Q)     x_q -> 0     0         0         0 -> x_q^T M_t    0 -> x_q^T w_t
M-row j    (d)     0            0         0 -> A_j  0 -> (M_t)_j      0 -> (w_t)_j
=================  ===========  ========  ========  ================  ==============

The encoded tokens are the natural ones: ``(x_i, y_i)`` and ``(x_q, 0)`` in
the same columns, in arrival order, everything else zero. The form is the
compiled :attr:`Newton.program`; its two set-up layers and the Newton layer
are derived term by term in docs/guides/newton.md and in the building blocks
below.

Reference: Hagiwara, "An extension of linear self-attention for in-context
learning", arXiv:2503.23814 (2025).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from elsa import programs
from elsa.attention import Array, ElsaParams
from elsa.ridge import safe_alpha  # 1/||A||_F; Newton.safe_alpha
from elsa.forms._token_form import TokenForm, _component


class Newton(TokenForm):
  r"""Ridge regression by Newton–Schulz in an ELSA stack, from the natural tokens.

  ``form.decode_w(elsa_stack(form.newton_params(lam=lam, alpha=alpha,
  depth=T), form.encode(x, y, x_query=xq), return_all=True))[2 + t] ==
  elsa.ridge.gd(x, y, lam=lam, eta=alpha, steps=2**t)[-1]`` for ``t = 0..T``.

  Args:
    n_train: examples per task ``N``.
    d: input dimension.
    n_query: query tokens ``Q`` (may be 0).
    n_out: target columns. With ``n_out == 1`` ``encode`` takes ``y`` as
      ``[..., N]`` (or ``[..., N, 1]``) and the decoders return ``[..., d]``,
      ``[..., Q]``; with ``n_out > 1`` ``[..., d, n_out]``, ``[..., Q, n_out]``.

  Attributes:
    n_train, d, n_query, n_out: examples ``N``, input dimension ``d``, queries ``Q``,
      target columns ``n_out``.
    m, n: token count ``N + Q + d`` and feature count ``3d + 2 n_out``.
    setup_layers: 2, the layers that build ``A``, ``b`` and ``M_0``.
    example_rows, query_rows, m_rows; x_cols, y_cols, a_cols, mcol_cols,
    w_cols: the blocks of the layout table (python ``range`` objects).

  Forms compare and hash by value (static arguments of :func:`jax.jit`).

  Example:
    >>> form = Newton(n_train=8, d=3, n_query=2)
    >>> (form.m, form.n, form.setup_layers)
    (13, 11, 2)
  """

  setup_layers = 2

  def _blocks(self) -> dict:
    example_rows, query_rows, m_rows = self._row_blocks(range)
    x_cols, y_cols, a_cols, mcol_cols, w_cols = self._consecutive(
        range, self.d, self.n_out, self.d, self.d, self.n_out)
    return dict(example_rows=example_rows, query_rows=query_rows,
                m_rows=m_rows, x_cols=x_cols, y_cols=y_cols, a_cols=a_cols,
                mcol_cols=mcol_cols, w_cols=w_cols, _w_block=(m_rows, w_cols),
                _pred_block=(query_rows, w_cols))

  @property
  def n(self) -> int:
    """Feature count of a state, ``3d + 2 n_out``."""
    return 3 * self.d + 2 * self.n_out

  safe_alpha = staticmethod(safe_alpha)

  # --- encoding and decoding ------------------------------------------------

  def encode(self, x: Array, y: Array, *, x_query: Array | None = None
             ) -> Array:
    """The naturally enumerated tokens ``[..., m, n]`` (table in the module doc).

    Args:
      x: examples ``[..., N, d]``, floating; its dtype is the state's dtype.
      y: targets ``[..., N]`` (``n_out == 1``) or ``[..., N, n_out]``.
      x_query: queries ``[..., Q, d]`` (leading axes broadcast to ``x``'s);
        may be ``None`` when ``Q == 0``.

    Raises:
      ValueError: a shape does not match.
      TypeError: ``x`` is not floating, or ``y``/``x_query`` has another dtype.
    """
    x, y, x_query, _ = self._check_inputs(x, y, x_query)
    return self._jit("encode", "_initial_state", x, y, x_query)

  def _initial_state(self, x, y, x_query) -> Array:
    return self._encode_blocks(X=x, y=y, Xq=x_query)

  # --- the program ------------------------------------------------------------

  @property
  def program(self) -> programs.Program:
    r"""Newton–Schulz with the query predictions carried along:

    .. math::
      U_0 = \alpha X_q;\quad A = X^\top X / N + \lambda I,\ M_0 = \alpha I,
      \ w_0 = \tfrac{\alpha}{N} X^\top y,\ p_0 = \tfrac{1}{N} U_0 X^\top y;
      \quad M' = 2M - MAM,\ w' = w + \tfrac{1}{N} M X^\top y - M A w,
      \ U' = 2U - UAM,\ p' = p + \tfrac{1}{N} U X^\top y - U A w,

    two set-up layers then one loop: ``U = X_q M`` and ``p = X_q w`` on the
    query rows. Inputs ``X``, ``y``, ``Xq`` pinned to the natural tokens
    (``Xq`` is cleared once ``U_0`` holds it), scalars ``lam`` and ``alpha``.
    """
    N, d, Q, k = self.n_train, self.d, self.n_query, self.n_out
    prog = programs.Program()
    X = prog.input("X", (N, d), at=(range(N), self.x_cols))
    y = prog.input("y", (N, k), at=(range(N), self.y_cols))
    lam, alpha = prog.scalar("lam"), prog.scalar("alpha")
    # Every state starts at zero (encode takes none), so the layout may use
    # their cells before the set-up layers assign them.
    A = prog.state("A", (d, d), init=0, symmetric=True)
    M = prog.state("M", (d, d), init=0, symmetric=True)
    w = prog.state("w", (d, k), init=0)
    moves = {}
    setup = {A: X.T @ X / N + lam * programs.eye(d),
             M: alpha * programs.eye(d), w: (alpha / N) * (X.T @ y)}
    step = {M: 2 * M - M @ A @ M, w: w + (1 / N) * (M @ X.T @ y) - M @ A @ w}
    if Q:
      Xq = prog.input("Xq", (Q, d), at=(self.query_rows, self.x_cols))
      U, p = prog.state("U", (Q, d), init=0), prog.state("p", (Q, k), init=0)
      moves[U] = alpha * Xq
      setup[p] = (1 / N) * (U @ X.T @ y)
      step.update({U: 2 * U - U @ A @ M,
                   p: p + (1 / N) * (U @ X.T @ y) - U @ A @ w})
    prog.layer(moves)
    prog.layer(setup)
    prog.loop(step)
    return prog

  def _block_columns(self) -> dict:
    return dict(X=self.x_cols, y=self.y_cols, Xq=self.x_cols, A=self.a_cols,
                M=self.mcol_cols, U=self.mcol_cols, w=self.w_cols,
                p=self.w_cols)

  # decode_w (``w_t = M_t b`` from the M rows) and decode_pred (``x_q^T
  # w_t``) are TokenForm's, on _w_block and _pred_block.

  def decode_inverse(self, h: Array) -> Array:
    """``M_t``, the running approximation of ``A^{-1}``: ``[..., d, d]``."""
    return self._read("decode_inverse", h, self.m_rows, self.mcol_cols)

  def decode_gram(self, h: Array) -> Array:
    """``A = X^T X / N + lam I`` as the set-up built it: ``[..., d, d]``."""
    return self._read("decode_gram", h, self.m_rows, self.a_cols)

  # --- parameters: the compiled layers and their components ----------------------

  def _layers(self, lam: Array, alpha: Array, depth: int) -> ElsaParams:
    """``compiled.params`` in the form's columns: ``[2 + depth, 3, ...]``."""
    return self._from_compiled_params(self.compiled.params(
        lam=lam, alpha=alpha, loops=depth, dtype=lam.dtype))

  def move_queries(self, *, alpha, dtype=None) -> ElsaParams:
    """Set-up layer 1, beside the skip: on query rows, ``x -> 0`` and ``alpha x -> mcol``.

    The correction of the layer's column mix on the query rows (the mix
    carries ``x`` on every row; ``U_0 = alpha X_q`` replaces the queries):
    :func:`elsa.constructions.rows_linear` over the query rows with ``Q =
    alpha E(x -> mcol) - E(x -> x)``, the term ``B3 B1^T (h W2)`` with ``B3
    = B1`` the query-row selector. The query rows then hold ``u_q = x_q^T
    M_0 = alpha x_q^T``, and their x columns are empty so the Gram sum of
    layer 2 runs over the examples only. Needs ``n_query >= 1``.

    ``alpha`` (and ``lam`` of the other set-up blocks): scalars, Python
    numbers or arrays (may be traced); ``dtype`` as in :meth:`newton_params`.
    """
    alpha, = self._scalars("move_queries", dtype, alpha=alpha)
    if not self.n_query:
      raise ValueError("Newton.move_queries: there are no queries to move "
                       "(n_query=0).")
    return _component(self._layers(jnp.ones_like(alpha), alpha, 0), (0, 1))

  def gram_head(self, *, lam, alpha, dtype=None) -> ElsaParams:
    """Set-up layer 2: M rows get ``[A | alpha I]`` in columns ``[a | mcol]``. One component.

    ``Q = B3`` (``e_j`` on M row ``j``), ``K = h W1 + B1`` (x columns, plus
    the constant's inner columns on rows where ``h`` is zero in the x
    columns), ``V = h W2 + B2`` (``x / N`` into a, plus ``[lam e_j | alpha
    e_j]`` in ``[a | mcol]`` on those rows), so

    ``K^T V = [X^T X / N | 0] + [lam I | alpha I] = [A | alpha I]``:

    the compiler's Gram component hosting the layer's constant
    (:mod:`elsa.programs.codegen`); the cross terms vanish because ``B1,
    B2`` live on rows where ``h W1`` and ``h W2`` are zero, and after layer
    1 the queries hold nothing in x.
    """
    lam, alpha = self._scalars("gram_head", dtype, lam=lam, alpha=alpha)
    return _component(self._layers(lam, alpha, 0), (1, 1))

  def alpha_b_head(self, *, alpha, dtype=None) -> ElsaParams:
    """Set-up layer 2: ``w_0 = alpha b`` on M rows, ``p_0 = x_q^T M_0 b`` on queries. One component.

    ``Q = h W3 + B3`` (``W3 = S_mcol / N``: ``U_0 / N = alpha x_q / N`` on the
    query rows, zero elsewhere; ``B3 = (alpha / N) e_j`` on M row ``j``),
    ``K = h W1`` (x columns: only the examples), ``V = h W2`` (``y`` into w),
    so ``K^T V = X^T y = N b``; the compiler's merge of ``w_0`` and ``p_0``,
    equal in keys and values but for the coefficient, which moves to ``Q``.
    """
    alpha, = self._scalars("alpha_b_head", dtype, alpha=alpha)
    return _component(self._layers(jnp.ones_like(alpha), alpha, 0), (1, 2))

  def setup_params(self, *, lam, alpha, dtype=None) -> ElsaParams:
    """The two set-up layers, leaves ``[2, C, ...]`` (arguments as :meth:`newton_params`)."""
    lam, alpha = self._lam_alpha("setup_params", lam=lam, alpha=alpha,
                                 dtype=dtype)
    return self._jit("setup_params", "_newton_stack", lam, alpha, depth=0)

  def newton_layer(self, *, dtype=None) -> ElsaParams:
    r"""One Newton–Schulz step, leaves ``[3, ...]``; it does not depend on lam or alpha.

    The column mix (``2`` on mcol: the skip), the correction
    ``-[M_t; u] A [M_t | w_t]`` (one product of three blocks for ``M``,
    ``w`` and, sharing their columns, ``u``, ``p``) and the fresh ``[M_t; u]
    X^T y / N``. On M rows and on query rows:

    .. math::
      M_{t+1} = 2M_t - M_t A M_t, \quad w_{t+1} = w_t + M_t (b - A w_t),
      \quad u_{t+1} = 2u_t - u_t A M_t, \quad p_{t+1} = p_t + u_t (b - A w_t),

    and nothing on example rows (their mcol is zero). If ``w_t = M_t b`` then
    ``w_{t+1} = (2M_t - M_t A M_t) b = M_{t+1} b`` and ``p_{t+1} = x_q^T
    w_{t+1}``. The w update is iterative refinement with the approximate
    inverse ``M_t``: an error ``e`` in ``w_t`` becomes ``(I - M_t A) e``, so
    rounding in ``w`` is self-correcting, and the error of ``M_t`` itself
    enters only through the small residual ``b - A w_t``
    (docs/guides/newton.md).

    ``dtype``: of every leaf; default JAX's default float (float32, or
    float64 under ``jax_enable_x64``).
    """
    dtype = self._float_dtype("newton_layer", dtype)
    one = jnp.ones((), dtype)
    return _component(self._layers(one, one, 1), 2)

  def newton_params(self, *, lam, alpha, depth: int, dtype=None
                    ) -> ElsaParams:
    r"""Set-up plus ``depth`` Newton–Schulz layers, leaves ``[2 + depth, 3, ...]``.

    After ``setup_layers + t`` layers the state holds ``w_t = M_t b``, equal
    to GD step ``2^t`` with step ``alpha`` from zero, and every query holds
    ``x_q^T w_t``.

    Args:
      lam: ridge strength, a scalar; may be a traced array.
      alpha: ``M_0 = alpha I``, a scalar; may be traced. It converges iff
        ``0 < alpha < 2 / lambda_max(A)``: :func:`elsa.ridge.safe_alpha` gives
        ``1 / ||A||_F``; ``2 / (mu_min + mu_max)`` is fastest when known.
      depth: Newton–Schulz steps ``T >= 0`` (static).
      dtype: dtype of every leaf; it must equal the state's dtype. Default:
        the dtype of ``lam``/``alpha`` if either is an array, else JAX's default
        float (float64 under ``jax_enable_x64``).

    Raises:
      ValueError: ``depth < 0``, ``lam``/``alpha`` is not a scalar, or a
        concrete ``alpha <= 0``, ``lam < 0``, or either not finite.
      TypeError: ``depth`` is not an int, or ``dtype`` is not floating.
    """
    self._check_int(self._name("newton_params"), "depth", depth, low=0)
    lam, alpha = self._lam_alpha("newton_params", lam=lam, alpha=alpha,
                                 dtype=dtype)
    return self._jit("newton_params", "_newton_stack", lam, alpha,
                     depth=depth)

  def _newton_stack(self, lam: Array, alpha: Array, *, depth: int
                    ) -> ElsaParams:
    """The layers of :meth:`newton_params` from checked scalars of one dtype."""
    return self._layers(lam, alpha, depth)

  def _lam_alpha(self, method: str, *, lam, alpha, dtype):
    """``lam, alpha`` as scalar arrays of one floating dtype, validated: a
    concrete (not traced) ``alpha`` must be finite and ``> 0``, ``lam``
    finite and ``>= 0``."""
    lam, alpha = self._scalars(method, dtype, lam=lam, alpha=alpha)
    if not isinstance(alpha, jax.core.Tracer) and not np.asarray(alpha) > 0:
      raise ValueError(f"{self._name(method)}: alpha must be > 0 (M_0 = alpha "
                       f"I; converges for 0 < alpha < 2 / lambda_max(A)), got "
                       f"{np.asarray(alpha)}.")
    self._in_range(method, "alpha", alpha, low=0, strict=True)
    self._in_range(method, "lam", lam, low=0, strict=False)
    return lam, alpha
