r"""In-context ridge-regression algorithms as matrix programs, from the natural tokens.

Every function returns an :class:`elsa.programs.Program` that starts from the
naturally enumerated tokens: one token ``(x_i, y_i)`` per example and one
``(x_q, 0)`` per query, ``x`` in the same columns (inputs ``X``, ``y``,
``Xq`` pinned there). Each solves

.. math::
  A w = b, \qquad A = X^\top X / N + \lambda I, \qquad b = X^\top y / N,

the ridge problem of :mod:`elsa.ridge`, and ends with one read-out layer
``p = Xq @ w`` (the query predictions). Compile with
:func:`elsa.programs.compile`; the state ``w`` after every layer is the
iterate (``compiled.read(hs, "w")``).

Step sizes and eigenvalue bounds that depend on the data (``1 / mu_max``,
Chebyshev coefficients, ``alpha = 2 / (mu_min + mu_max)``) are computed
outside the stack (:func:`eigen_bounds` and the schedule helpers below) and
passed as runtime scalars: an ELSA stack computes polynomials of its tokens
only, so a scalar that is a ratio of data cannot be formed inside it. For the
same reason conjugate gradient (its step ``r^T r / p^T A p`` is a ratio of
data) and normalised power iteration (``v / ||v||``) cannot be compiled; the
language refuses a block divided by a block.

Convergence with ``kappa = mu_max / mu_min`` of ``A`` (iterations to a
relative error ``eps``): GD ``O(kappa log 1/eps)``; heavy-ball, Nesterov and
Chebyshev ``O(sqrt(kappa) log 1/eps)``; Newton–Schulz ``O(log kappa + log log
1/eps)`` (each layer squares the residual); the third-order hyperpower
iteration cubes it. docs/guides/algorithms.md, "The race to the ridge
solution", has the measured layer counts (``python -m experiments.algorithms``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from elsa import _validate, forms, programs
from elsa.attention import Array, float_dtype


def _natural_tokens(prog: programs.Program, *, n_train: int, d: int,
                    n_query: int, n_out: int):
  """Pins ``X``, ``y`` and ``Xq`` to the natural tokens; returns them (``Xq``
  is ``None`` without queries)."""
  N, Q, k = n_train, n_query, n_out
  X = prog.input("X", (N, d), at=(range(N), range(d)))
  y = prog.input("y", (N, k), at=(range(N), range(d, d + k)))
  Xq = prog.input("Xq", (Q, d), at=(range(N, N + Q), range(d))) if Q else None
  return X, y, Xq


def _read_out(prog: programs.Program, Xq, w) -> None:
  """The last layer: query predictions ``p = Xq @ w`` (none without queries)."""
  if Xq is not None:
    p = prog.state("p", (Xq.shape[0], w.shape[1]))
    prog.layer({p: Xq @ w})


def _gd_loop(prog: programs.Program, X, y, w, r) -> None:
  """The ridge-GD step on ``w`` and its residual ``r = y - X w``, with runtime
  scalars ``lam`` and ``eta``: one loop of ``prog``."""
  N = X.shape[0]
  lam, eta = prog.scalar("lam"), prog.scalar("eta")
  prog.loop({
      w: (1 - eta * lam) * w + (eta / N) * (X.T @ r),
      r: (1 - eta * lam) * r + (eta * lam) * y - (eta / N) * (X @ X.T @ r),
  })


def ridge_gd(*, n_train: int, d: int, n_query: int = 1, n_out: int = 1
             ) -> programs.Program:
  r"""Gradient descent with the residual ``r = y - X w`` kept as a state.

  .. math::
    w' = (1 - \eta\lambda) w + \tfrac{\eta}{N} X^\top r, \qquad
    r' = (1 - \eta\lambda) r + \eta\lambda y - \tfrac{\eta}{N} X X^\top r .

  ``r`` makes the gradient a product of at most three blocks (``X^T X w``
  would read ``X`` transposed first). Converges for ``0 < eta < 2 / mu_max``;
  with ``eta = 2 / (mu_min + mu_max)`` the error shrinks by ``(kappa - 1) /
  (kappa + 1)`` per layer. Scalars: ``lam``, ``eta`` (a ``[loops]``
  schedule allowed). Layer ``1 + t`` holds GD step ``t`` from ``w0 = 0``.
  """
  prog = programs.Program()
  X, y, Xq = _natural_tokens(prog, n_train=n_train, d=d, n_query=n_query,
                             n_out=n_out)
  w = prog.state("w", (d, n_out))
  r = prog.state("r", (n_train, n_out), init=y)
  _gd_loop(prog, X, y, w, r)
  _read_out(prog, Xq, w)
  return prog


def ridge_gd_natural(*, n_train: int, d: int, n_query: int = 1,
                     n_out: int = 1) -> programs.Program:
  r"""Gradient descent in the algebra of :class:`elsa.forms.Natural`: every prediction a state.

  .. math::
    w' = (1 - \eta\lambda) w + \tfrac{\eta}{N} X^\top (y - Xw), \qquad
    (Xw)' = (1 - \eta\lambda) Xw + \tfrac{\eta}{N} X X^\top (y - Xw), \qquad
    p' = (1 - \eta\lambda) p + \tfrac{\eta}{N} X_q X^\top (y - Xw),

  from zero: ``Xw`` (the example predictions) and ``p = Xq w`` (the query
  predictions) are updated with ``w`` instead of read out from it, so there
  is no read-out layer, and all three decay alike, so the compiler lays them
  out in one column. The query tokens move out of ``X``'s columns during the
  first iteration (they meet ``p`` there, still zero), so layer ``t`` holds
  GD step ``t``: ``compiled.read(hs, "w")[t] == ridge.gd(...)[t]``. It is the
  program :class:`elsa.forms.Natural` is built on (``Natural(...).program``).
  Scalars: ``lam``, ``eta`` (a ``[loops]`` schedule allowed).
  """
  return forms.Natural(n_train=n_train, d=d, n_query=n_query,
                       n_out=n_out).program


def preconditioned_gd(*, n_train: int, d: int, preconditioner, n_query: int = 1,
                      n_out: int = 1) -> programs.Program:
  r"""GD with a constant preconditioner ``P`` ``[d, d]``: :math:`w' = w - \eta P (A w - b)`.

  .. math::
    w' = w - \eta\lambda P w + \tfrac{\eta}{N} P X^\top r, \qquad
    r' = r + \eta\lambda (XP) w - \tfrac{\eta}{N} (XP) X^\top r,

  with ``XP = X @ P`` computed once by the set-up layer (a constant between
  two blocks is not one component). Converges when the spectrum of ``P A``
  lies in ``(0, 2 / eta)``; the rate is GD's with ``kappa(P A)``.
  """
  prog = programs.Program()
  X, y, Xq = _natural_tokens(prog, n_train=n_train, d=d, n_query=n_query,
                             n_out=n_out)
  N = n_train
  P = programs.constant(preconditioner)
  w = prog.state("w", (d, n_out))
  r = prog.state("r", (N, n_out), init=y)
  XP = prog.state("XP", (N, d), init=X @ P)
  lam, eta = prog.scalar("lam"), prog.scalar("eta")
  prog.loop({
      w: w - (eta * lam) * (P @ w) + (eta / N) * (P @ X.T @ r),
      r: r + (eta * lam) * (XP @ w) - (eta / N) * (XP @ X.T @ r),
  })
  _read_out(prog, Xq, w)
  return prog


def heavy_ball(*, n_train: int, d: int, n_query: int = 1, n_out: int = 1
               ) -> programs.Program:
  r"""Polyak's heavy ball, with the step ``v = w_t - w_{t-1}`` as a state.

  .. math::
    v' = \beta v + \eta (b - A w), \qquad w' = w + v', \qquad r' = y - X w',

  ``b - A w = X^T r / N - lam w``. With :func:`heavy_ball_parameters` the
  error shrinks like :math:`((\sqrt\kappa - 1) / (\sqrt\kappa + 1))^t`.
  With ``eta`` and ``beta`` as per-loop schedules from
  :func:`chebyshev_schedule` this is the Chebyshev semi-iteration.
  Scalars: ``lam``, ``eta``, ``beta``.
  """
  prog = programs.Program()
  X, y, Xq = _natural_tokens(prog, n_train=n_train, d=d, n_query=n_query,
                             n_out=n_out)
  N = n_train
  w, v = prog.state("w", (d, n_out)), prog.state("v", (d, n_out))
  r = prog.state("r", (N, n_out), init=y)
  lam, eta, beta = (prog.scalar(s) for s in ("lam", "eta", "beta"))
  step = beta * v - (eta * lam) * w + (eta / N) * (X.T @ r)
  prog.loop({
      v: step,
      w: w + step,
      r: r - beta * (X @ v) + (eta * lam) * (X @ w)
         - (eta / N) * (X @ X.T @ r),
  })
  _read_out(prog, Xq, w)
  return prog


chebyshev = heavy_ball  # the same program, run with chebyshev_schedule


def nesterov(*, n_train: int, d: int, n_query: int = 1, n_out: int = 1
             ) -> programs.Program:
  r"""Nesterov's accelerated gradient: the gradient taken at the look-ahead ``w + beta v``.

  .. math::
    v' = \beta v + \eta\,(b - A (w + \beta v)), \qquad w' = w + v' .

  Kept as states: ``r = y - X w`` and ``u = X v`` (so that ``X^T X v`` is
  ``X^T u``, two blocks). With :func:`nesterov_parameters` the error shrinks
  like :math:`(1 - 1/\sqrt\kappa)^t`. Scalars: ``lam``, ``eta``, ``beta``.
  """
  prog = programs.Program()
  X, y, Xq = _natural_tokens(prog, n_train=n_train, d=d, n_query=n_query,
                             n_out=n_out)
  N = n_train
  w, v = prog.state("w", (d, n_out)), prog.state("v", (d, n_out))
  r = prog.state("r", (N, n_out), init=y)
  u = prog.state("u", (N, n_out))
  lam, eta, beta = (prog.scalar(s) for s in ("lam", "eta", "beta"))
  # b - A (w + beta v) = X^T (r - beta u) / N - lam (w + beta v)
  step = (beta * (1 - eta * lam)) * v - (eta * lam) * w + (eta / N) * (
      X.T @ r - beta * (X.T @ u))
  # X v' = X step, with X w = y - r
  x_step = (beta * (1 - eta * lam)) * u - (eta * lam) * (y - r) + (eta / N) * (
      X @ X.T @ r - beta * (X @ X.T @ u))
  prog.loop({v: step, w: w + step, u: x_step, r: r - x_step})
  _read_out(prog, Xq, w)
  return prog


def newton_schulz(*, n_train: int, d: int, n_query: int = 1, n_out: int = 1
                  ) -> programs.Program:
  r"""Newton–Schulz, :math:`M' = 2M - M A M`, with ``w`` refined by the running inverse.

  .. math::
    M_0 = \alpha I, \qquad w_0 = \alpha b, \qquad
    w' = w + M (b - A w),

  ``A`` and ``M`` symmetric (``M`` is a polynomial in ``A``), so ``M A M``
  reads as ``M A^T M``. ``I - A M_t = (I - \alpha A)^{2^t}``: layer ``t``
  holds GD step ``2^t``, the residual squares each layer. ``w`` is iterative
  refinement (docs/guides/newton.md): rounding in ``w`` corrects itself.
  Scalars: ``lam``, ``alpha`` (``0 < alpha < 2 / mu_max``). The same program
  as :class:`elsa.forms.Newton`.
  """
  prog = programs.Program()
  X, y, Xq = _natural_tokens(prog, n_train=n_train, d=d, n_query=n_query,
                             n_out=n_out)
  N = n_train
  lam, alpha = prog.scalar("lam"), prog.scalar("alpha")
  A = prog.state("A", (d, d), init=X.T @ X / N + lam * programs.eye(d),
                 symmetric=True)
  M = prog.state("M", (d, d), init=alpha * programs.eye(d), symmetric=True)
  w = prog.state("w", (d, n_out), init=(alpha / N) * (X.T @ y))
  prog.loop({M: 2 * M - M @ A @ M,
             w: w + (1 / N) * (M @ X.T @ y) - M @ A @ w})
  _read_out(prog, Xq, w)
  return prog


def newton_schulz_natural(*, n_train: int, d: int, n_query: int = 1,
                          n_out: int = 1) -> programs.Program:
  r"""Newton–Schulz in the algebra of :class:`elsa.forms.Newton`: the queries carry ``x_q^T M`` and ``x_q^T w``.

  .. math::
    M' = 2M - M A M, \quad w' = w + M (b - A w), \quad
    U' = 2U - U A M, \quad p' = p + U (b - A w),

  with ``U = X_q M`` (from ``U_0 = alpha X_q``, set by the first layer,
  which also takes the queries out of ``X``'s columns: ``Xq`` is not read
  again) and ``p = X_q w`` on the query rows; the second layer sets ``A``,
  ``M_0 = alpha I``, ``w_0 = alpha b`` and ``p_0 = U_0 b``: the same
  iterates as :func:`newton_schulz`, with the predictions updated alongside
  ``w`` instead of read out. ``U`` shares ``M``'s columns and ``p`` shares
  ``w``'s. It is the program :class:`elsa.forms.Newton` is built on
  (``Newton(...).program``): two set-up layers, then one layer per step.
  Scalars: ``lam``, ``alpha``.
  """
  return forms.Newton(n_train=n_train, d=d, n_query=n_query,
                      n_out=n_out).program


def third_order(*, n_train: int, d: int, n_query: int = 1, n_out: int = 1,
                w_update: str = "refine") -> programs.Program:
  r"""The third-order hyperpower iteration with its residual ``R = I - A M`` as a block.

  .. math::
    M' = M + M R + M R^2, \qquad R' = R^3,

  from ``M_0 = alpha I``, ``R_0 = I - alpha A``: ``R_t = R_0^{3^t}``, the
  residual cubes each layer (Newton–Schulz squares it). ``R`` is a
  polynomial in ``A``, hence symmetric, so ``M R R`` reads as ``M R^T R``
  (three blocks). ``R`` is not recomputed from ``M`` (``I - A M'`` would be
  four blocks), so its rounding is never corrected; how ``w`` follows:

  * ``w_update="refine"`` (default): iterative refinement on the true
    residual, ``w' = w + M (b - A w)`` from ``w_0 = alpha b``, with ``A``
    kept as a block. The error is ``e_{t+1} = (I - M_t A) e_t``, so ``w_t``
    holds GD step ``(3^t + 1) / 2`` (about ``log_3 2`` of a layer behind the
    ideal ``3^t``), and rounding in ``w`` or ``R`` corrects itself: ``w``
    reaches the ridge solution to ``~kappa eps``.
  * ``w_update="residual"``: ``w' = w + M s + M R s``, ``s' = R^2 s`` from
    ``w_0 = 0``, ``s_0 = b``: ``s = b - A w`` in exact arithmetic, so ``w_t``
    holds GD step ``3^t - 1``, and ``A`` is never stored; but ``s`` follows
    the rounded ``R``, and ``w`` stalls where ``R`` has drifted
    (docs/guides/algorithms.md: a floor of ``~1e-8`` at ``kappa = 1e6`` in
    float64).

  Scalars: ``lam``, ``alpha`` (``0 < alpha < 2 / mu_max``).
  """
  if w_update not in ("refine", "residual"):
    raise ValueError(f"third_order: w_update must be 'refine' or 'residual', "
                     f"got {w_update!r}.")
  prog = programs.Program()
  X, y, Xq = _natural_tokens(prog, n_train=n_train, d=d, n_query=n_query,
                             n_out=n_out)
  N = n_train
  lam, alpha = prog.scalar("lam"), prog.scalar("alpha")
  # M is symmetric too (a polynomial in A), but only because M and R
  # commute, which the compiler cannot prove from M + M R + M R^2; no term
  # reads M transposed, so it is declared general.
  M = prog.state("M", (d, d), init=alpha * programs.eye(d))
  R = prog.state("R", (d, d), symmetric=True,
                 init=(1 - alpha * lam) * programs.eye(d)
                 - (alpha / N) * (X.T @ X))
  if w_update == "refine":
    A = prog.state("A", (d, d), init=X.T @ X / N + lam * programs.eye(d),
                   symmetric=True)
    w = prog.state("w", (d, n_out), init=(alpha / N) * (X.T @ y))
    prog.loop({M: M + M @ R + M @ R @ R, R: R @ R @ R,
               w: w + (1 / N) * (M @ X.T @ y) - M @ A @ w})
  else:
    w = prog.state("w", (d, n_out))
    s = prog.state("s", (d, n_out), init=(X.T @ y) / N)
    prog.loop({M: M + M @ R + M @ R @ R, R: R @ R @ R,
               w: w + M @ s + M @ R @ s, s: R @ R @ s})
  _read_out(prog, Xq, w)
  return prog


def third_order_residual(*, n_train: int, d: int, n_query: int = 1,
                         n_out: int = 1) -> programs.Program:
  """:func:`third_order` with ``w_update="residual"`` (``s' = R^2 s``)."""
  return third_order(n_train=n_train, d=d, n_query=n_query, n_out=n_out,
                     w_update="residual")


ALGORITHMS = {
    "gd": ridge_gd, "heavy_ball": heavy_ball, "nesterov": nesterov,
    "chebyshev": chebyshev, "newton_schulz": newton_schulz,
    "third_order": third_order, "third_order_residual": third_order_residual,
}


# --- step sizes, computed outside the stack -----------------------------------


def eigen_bounds(x: Array, *, lam) -> tuple[Array, Array]:
  """``mu_min, mu_max`` of ``A = X^T X / N + lam I``, each ``[...]`` for ``x [..., N, d]``."""
  n_train = x.shape[-2]
  gram = jnp.matmul(jnp.swapaxes(x, -1, -2), x,
                    precision="highest") / n_train
  evals = jnp.linalg.eigvalsh(gram) + jnp.asarray(lam, x.dtype)
  return evals[..., 0], evals[..., -1]


def gd_step(mu_min, mu_max):
  """``eta = 2 / (mu_min + mu_max)``, GD's fastest constant step."""
  return 2 / (mu_min + mu_max)


def heavy_ball_parameters(mu_min, mu_max):
  """Polyak's optimal ``(eta, beta)``: ``4 / (sqrt L + sqrt mu)^2``, ``((sqrt k - 1)/(sqrt k + 1))^2``."""
  sl, sm = jnp.sqrt(mu_max), jnp.sqrt(mu_min)
  return 4 / (sl + sm) ** 2, ((sl - sm) / (sl + sm)) ** 2


def nesterov_parameters(mu_min, mu_max):
  """``(eta, beta) = (1 / L, (sqrt k - 1) / (sqrt k + 1))`` for strongly convex quadratics."""
  sk = jnp.sqrt(mu_max / mu_min)
  return 1 / mu_max, (sk - 1) / (sk + 1)


def chebyshev_schedule(mu_min, mu_max, loops: int):
  r"""Chebyshev semi-iteration as heavy-ball schedules ``(eta [loops], beta [loops])``.

  With ``theta = (L + mu) / 2``, ``delta = (L - mu) / 2``, ``sigma = theta /
  delta`` the semi-iteration is heavy ball with ``eta_0 = 1 / theta``,
  ``beta_0 = 0`` and, for ``t >= 1``,

  .. math::
    \rho_t = \frac{T_t(\sigma)}{T_{t+1}(\sigma)}, \qquad
    \eta_t = \frac{2 \rho_t}{\delta}, \qquad
    \beta_t = \rho_t \rho_{t-1},

  the recurrence ``rho_0 = 1 / sigma``, ``rho_t = 1 / (2 sigma - rho_{t-1})``
  in closed form: with ``q = (sqrt L - sqrt mu) / (sqrt L + sqrt mu) = sigma -
  sqrt(sigma^2 - 1)``, ``T_t(sigma) = (q^-t + q^t) / 2``, so ``rho_t = q (1 +
  q^{2t}) / (1 + q^{2t + 2})`` (no overflow for any ``t``) and ``eta_t = 4 (1
  + q^{2t}) / ((sqrt L + sqrt mu)^2 (1 + q^{2t + 2}))``, which tends to
  heavy ball's :func:`heavy_ball_parameters` as ``beta_t`` does. After ``t`` steps
  the error is ``T_t((theta - A) / delta) / T_t(sigma)`` times the start: the
  polynomial of degree ``t`` with value 1 at 0 that is smallest on ``[mu,
  L]``, at most ``1 / T_t(sigma)`` there.

  Args:
    mu_min, mu_max: ``0 < mu_min < mu_max`` (may be traced scalars).
    loops: the schedule length, a static int ``>= 1``.

  Returns:
    ``(eta, beta)``, each ``[loops]`` in the dtype of the bounds; no Python
    loop over ``loops``, so any length costs one vectorised expression.
  """
  if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
    raise ValueError(f"chebyshev_schedule: loops must be an int >= 1, got "
                     f"{loops!r}.")
  mu_min, mu_max = jnp.asarray(mu_min), jnp.asarray(mu_max)
  if not jnp.issubdtype(jnp.result_type(mu_min, mu_max), jnp.floating):
    mu_min, mu_max = (jnp.asarray(a, float_dtype(None))
                      for a in (mu_min, mu_max))
  sl, sm = jnp.sqrt(mu_max), jnp.sqrt(mu_min)
  q = (sl - sm) / (sl + sm)
  t = jnp.arange(loops, dtype=q.dtype)
  ratio = (1 + q ** (2 * t)) / (1 + q ** (2 * t + 2))
  rho = q * ratio  # rho_0 = 1 / sigma
  rho_prev = jnp.concatenate([jnp.zeros_like(rho[:1]), rho[:-1]])
  # 2 rho_t / delta with delta = (sl + sm)^2 q / 2 divided out: finite at
  # mu_min == mu_max (q = 0), where every step is 1 / L.
  eta = jnp.where(t == 0, 2 / (mu_max + mu_min), 4 / (sl + sm) ** 2 * ratio)
  beta = rho * rho_prev  # beta_0 = 0
  return eta, beta


def ridge_gd_from(*, n_train: int, d: int, w0, n_query: int = 1
                  ) -> programs.Program:
  r"""Ridge GD (:func:`ridge_gd`) from a fixed start ``w0``, held in the stack's biases.

  .. math::
    w_0 = w^{(0)}, \quad r_0 = y - X w^{(0)}, \qquad
    w' = (1 - \eta\lambda) w + \tfrac{\eta}{N} X^\top r, \quad
    r' = (1 - \eta\lambda) r + \eta\lambda y - \tfrac{\eta}{N} X X^\top r .

  ``w0`` (``[d]`` or ``[d, 1]``, concrete) is a constant of the program: the
  set-up layer writes it with an ELSA bias (a constant output, which plain
  LSA cannot produce) and forms ``r_0 = y - X w0``. It is the algorithm that
  is near Bayes-optimal when ``w ~ N(w0, s^2 I)`` (Zhang, Wu, Bartlett 2024,
  arXiv 2402.14951). Layer ``setup_layers + t`` holds GD step ``t`` from
  ``w0`` (``compiled.read(hs, "w")[1 + t] == ridge.gd(..., w0=w0)[t]``); the
  last layer reads out ``p = Xq @ w``. Scalars: ``lam``, ``eta``.
  """
  fn = "ridge_gd_from"
  for name, value in (("n_train", n_train), ("d", d), ("n_query", n_query)):
    _validate.int_at_least(fn, name, value, low=1)
  if _validate.concrete(w0) is None or jnp.size(w0) != d:
    raise ValueError(f"{fn}: w0 must be a concrete array of d={d} numbers "
                     f"(shape [d] or [d, 1]), got shape {jnp.shape(w0)}.")
  _validate.finite(fn, "w0", w0)
  # numpy, not jnp: a constant of the program, also when built under a trace.
  w0 = np.reshape(np.asarray(w0, np.float64), (d, 1))
  prog = programs.Program()
  X, y, Xq = _natural_tokens(prog, n_train=n_train, d=d, n_query=n_query,
                             n_out=1)
  start = programs.constant(w0)
  w = prog.state("w", (d, 1), init=start)
  r = prog.state("r", (n_train, 1), init=y - X @ start)
  _gd_loop(prog, X, y, w, r)
  _read_out(prog, Xq, w)
  return prog
