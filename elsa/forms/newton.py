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
the same columns, in arrival order, everything else zero. The two set-up
layers and the Newton layer are derived term by term in BUILD_NOTES.md
("Newton–Schulz from natural tokens") and in the builders below.

Reference: Hagiwara, "An extension of linear self-attention for in-context
learning", arXiv:2503.23814 (2025).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from elsa import constructions
from elsa.attention import Array, ElsaParams
from elsa.ridge import safe_alpha  # 1/||A||_F; Newton.safe_alpha
from elsa.forms._token_form import TokenForm


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
    zeros = lambda rows, cols: jnp.zeros((*x.shape[:-2], rows, cols), x.dtype)
    tokens = jnp.concatenate(
        [jnp.concatenate([x, y], axis=-1),
         jnp.concatenate([x_query, zeros(self.n_query, self.n_out)], axis=-1),
         zeros(self.d, self.d + self.n_out)], axis=-2)
    return jnp.concatenate([tokens, zeros(self.m, self.n - self.d - self.n_out)],
                           axis=-1)

  # decode_w (``w_t = M_t b`` from the M rows) and decode_pred (``x_q^T
  # w_t``) are TokenForm's, on _w_block and _pred_block.

  def decode_inverse(self, h: Array) -> Array:
    """``M_t``, the running approximation of ``A^{-1}``: ``[..., d, d]``."""
    return self._read("decode_inverse", h, self.m_rows, self.mcol_cols)

  def decode_gram(self, h: Array) -> Array:
    """``A = X^T X / N + lam I`` as the set-up built it: ``[..., d, d]``."""
    return self._read("decode_gram", h, self.m_rows, self.a_cols)

  # --- parameters -----------------------------------------------------------

  def move_queries(self, *, alpha, dtype=None) -> ElsaParams:
    """Set-up layer 1, with the skip: on query rows, ``x -> 0`` and ``alpha x -> mcol``.

    :func:`elsa.constructions.rows_linear` over the query rows with
    ``Q = alpha E(x -> mcol) - E(x -> x)`` (the term ``B3 B1^T (h W2)``,
    ``B3 = B1`` the query-row selector; ``TokenForm._move_query_x``). The
    query rows then hold ``u_q = x_q^T M_0 = alpha x_q^T``, and their x
    columns are empty so the Gram sum of layer 2 runs over the examples only.
    Needs ``n_query >= 1``.

    ``alpha`` (and ``lam`` of the other set-up blocks): scalars, Python
    numbers or arrays (may be traced); ``dtype`` as in :meth:`newton_params`.
    """
    alpha, = self._scalars("move_queries", dtype, alpha=alpha)
    return self._move_query_x(self.mcol_cols, scale=alpha, dtype=alpha.dtype)

  def gram_head(self, *, lam, alpha, dtype=None) -> ElsaParams:
    """Set-up layer 2: M rows get ``[A | alpha I]`` in columns ``[a | mcol]``. One component.

    ``Q = B3`` (``e_j`` on M row ``j``), ``K = h W1 + B1`` (x columns, plus
    ``e_j`` on M row ``j``), ``V = h W2 + B2`` (``x / N`` into a, plus
    ``[lam e_j | alpha e_j]`` in ``[a | mcol]`` on M row ``j``), so

    ``K^T V = X^T X / N + B1^T B2 + W1^T h^T B2 + B1^T h W2 = [A | alpha I]``:

    the two cross terms vanish because ``B1, B2`` live on the M rows, where
    ``h`` is still zero, and after layer 1 the queries hold nothing in x.
    """
    lam, alpha = self._scalars("gram_head", dtype, lam=lam, alpha=alpha)
    d, m, n = self.d, self.m, self.n
    place = functools.partial(constructions.placement, dtype=lam.dtype)
    inner = range(d)
    on_m_rows = place(self.m_rows, inner, shape=(m, d))
    b2 = (lam * place(self.m_rows, self.a_cols, shape=(m, n))
          + alpha * place(self.m_rows, self.mcol_cols, shape=(m, n)))
    p = ElsaParams.zeros(m=m, n=n, k=d, dtype=lam.dtype)
    return p._replace(
        w1=place(self.x_cols, inner, shape=(n, d)),
        b1=on_m_rows, b3=on_m_rows, b2=b2,
        w2=place(self.x_cols, self.a_cols, shape=(n, n)) / self.n_train)

  def alpha_b_head(self, *, alpha, dtype=None) -> ElsaParams:
    """Set-up layer 2: ``w_0 = alpha b`` on M rows, ``p_q = alpha x_q^T b`` on queries. One component.

    ``Q = h W3 + B3`` (mcol columns, which hold ``alpha x_q`` on query rows
    and zero elsewhere, plus ``alpha e_j`` on M row ``j``), ``K = h W1`` (x
    columns: only the examples), ``V = h W2`` (``y / N`` into w), so
    ``K^T V = X^T y / N = b``; example rows have ``Q = 0``.
    """
    alpha, = self._scalars("alpha_b_head", dtype, alpha=alpha)
    d, m, n = self.d, self.m, self.n
    place = functools.partial(constructions.placement, dtype=alpha.dtype)
    inner = range(d)
    p = ElsaParams.zeros(m=m, n=n, k=d, dtype=alpha.dtype)
    return p._replace(
        w3=place(self.mcol_cols, inner, shape=(n, d)),
        b3=alpha * place(self.m_rows, inner, shape=(m, d)),
        w1=place(self.x_cols, inner, shape=(n, d)),
        w2=place(self.y_cols, self.w_cols, shape=(n, n)) / self.n_train)

  def newton_skip(self, *, dtype) -> ElsaParams:
    """``h -> h diag(s)``: ``s = 2`` on mcol, 1 elsewhere. One component."""
    scale = jnp.ones((self.n,), dtype)
    scale = scale.at[self.mcol_cols.start:self.mcol_cols.stop].set(2)
    return constructions.linear(None, jnp.diag(scale), m=self.m)

  def newton_correction(self, *, dtype) -> ElsaParams:
    """``-q A [M_t | w_t]`` into ``[mcol | w]`` of every row ``q`` of the mcol block. One component.

    :func:`elsa.constructions.product3` with ``A_ = h[:, mcol]`` (``M_t`` on M
    rows, ``u_q = x_q^T M_t`` on queries, zero on examples), ``B = h[:, a]``
    and ``C = h[:, mcol | w]``, scale -1. ``B`` is nonzero on the M rows only,
    so the key sum ``B^T C = A^T [M_t | w_t] = A [M_t | w_t]`` (``A``
    symmetric) sees neither queries nor examples.
    """
    cols = [*self.mcol_cols, *self.w_cols]
    return constructions.product3(m=self.m, n=self.n, a_cols=self.mcol_cols,
                                  b_cols=self.a_cols, c_cols=cols,
                                  out_cols=cols, scale=-1.0, dtype=dtype)

  def fresh_mb(self, *, dtype) -> ElsaParams:
    """``q b`` into the w columns, ``b`` re-read from the examples. One component.

    :func:`elsa.constructions.product3` with ``A_ = h[:, mcol]``,
    ``B = h[:, x]`` (only the examples: the queries left x in layer 1),
    ``C = h[:, y]`` into w, scale ``1/N``: ``B^T C = X^T y / N = b``.
    """
    return constructions.product3(m=self.m, n=self.n, a_cols=self.mcol_cols,
                                  b_cols=self.x_cols, c_cols=self.y_cols,
                                  out_cols=self.w_cols,
                                  scale=1.0 / self.n_train, dtype=dtype)

  def setup_params(self, *, lam, alpha, dtype=None) -> ElsaParams:
    """The two set-up layers, leaves ``[2, C, ...]`` (arguments as :meth:`newton_params`)."""
    lam, alpha = self._lam_alpha("setup_params", lam=lam, alpha=alpha,
                                 dtype=dtype)
    return self._jit("setup_params", "_setup_stack", lam, alpha)

  def _setup_stack(self, lam: Array, alpha: Array) -> ElsaParams:
    """The layers of :meth:`setup_params` from checked scalars of one dtype."""
    skip = constructions.identity(self.m, self.n, dtype=lam.dtype)
    first = [skip] + ([self.move_queries(alpha=alpha)] if self.n_query else [])
    return constructions.stack(
        constructions.layer(*first),
        constructions.layer(skip, self.gram_head(lam=lam, alpha=alpha),
                            self.alpha_b_head(alpha=alpha)))

  def newton_layer(self, *, dtype=None) -> ElsaParams:
    r"""One Newton–Schulz step, leaves ``[3, ...]``; it does not depend on lam or alpha.

    Skip + correction + fresh ``M b`` give, on M rows and on query rows,

    .. math::
      M_{t+1} = 2M_t - M_t A M_t, \quad w_{t+1} = w_t + M_t (b - A w_t),
      \quad u_{t+1} = 2u_t - u_t A M_t, \quad p_{t+1} = p_t + u_t (b - A w_t),

    and nothing on example rows (their mcol is zero). If ``w_t = M_t b`` then
    ``w_{t+1} = (2M_t - M_t A M_t) b = M_{t+1} b`` and ``p_{t+1} = x_q^T
    w_{t+1}``. The w update is iterative refinement with the approximate
    inverse ``M_t``: an error ``e`` in ``w_t`` becomes ``(I - M_t A) e``, so
    rounding in ``w`` is self-correcting, and the error of ``M_t`` itself
    enters only through the small residual ``b - A w_t`` (BUILD_NOTES.md).

    ``dtype``: of every leaf; default JAX's default float (float32, or
    float64 under ``jax_enable_x64``).
    """
    dtype = self._float_dtype("newton_layer", dtype)
    return constructions.layer(self.newton_skip(dtype=dtype),
                               self.newton_correction(dtype=dtype),
                               self.fresh_mb(dtype=dtype))

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
    setup = self._setup_stack(lam, alpha)
    if depth == 0:
      return setup
    step = self.newton_layer(dtype=lam.dtype)
    steps = ElsaParams(*(jnp.broadcast_to(a, (depth, *a.shape)) for a in step))
    return constructions.stack(setup, steps)

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
