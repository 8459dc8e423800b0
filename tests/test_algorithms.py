"""elsa.algorithms: every program's compiled stack against the interpreter and against the textbook iteration.

Each algorithm is checked three ways on fresh random tasks of several shapes
(N > d, N < d, n_out > 1, a batch axis): the compiled stack
(``elsa_stack(compiled.params(...), compiled.encode(...), return_all=True)``,
read with ``compiled.read``) equals :func:`elsa.programs.run` at every layer
and every block; its ``w`` equals an independent plain-numpy implementation
of the algorithm's textbook iteration at every iterate; the read-out is
``p = Xq @ w``. Run long enough, ``w`` is :func:`elsa.ridge.solve`. Float64
to 1e-10 relative; float32 to the bound measured in
docs/guides/algorithms.md. Then the step-size helpers against their textbook
formulas, and the refusals the module doc promises.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elsa
from elsa import algorithms as alg
from elsa import programs, ridge
from helpers import rel_norm as rel

F64_RTOL = 1e-10
# The float32 stack (float32 data) against the float64 textbook iterate of
# the float64 data, N = 12, d = 4, lam = 0.3: worst over every algorithm,
# iterate and seeds 7-9 measured 4.1e-7 (heavy ball; docs/guides/algorithms.md);
# the bound leaves a factor 5.
F32_RTOL = 2e-6
LAM = 0.3


# --- the textbook iterations, in plain numpy (float64) ------------------------


def normal_equations(x, y, lam):
  n = x.shape[-2]
  a = np.swapaxes(x, -1, -2) @ x / n + lam * np.eye(x.shape[-1])
  return a, np.swapaxes(x, -1, -2) @ y / n


def textbook_gd(a, b, *, eta, steps, precond=None):
  """``w_{t+1} = w_t - eta P (A w_t - b)`` from 0."""
  p = np.eye(a.shape[-1]) if precond is None else precond
  ws = [np.zeros_like(b)]
  for _ in range(steps):
    ws.append(ws[-1] - eta * p @ (a @ ws[-1] - b))
  return ws


def textbook_heavy_ball(a, b, *, eta, beta, steps):
  """Polyak: ``w_{t+1} = w_t - eta (A w_t - b) + beta (w_t - w_{t-1})``, ``w_{-1} = w_0 = 0``."""
  ws, prev = [np.zeros_like(b)], np.zeros_like(b)
  for _ in range(steps):
    w = ws[-1]
    ws.append(w - eta * (a @ w - b) + beta * (w - prev))
    prev = w
  return ws


def textbook_nesterov(a, b, *, eta, beta, steps):
  """``z = w_t + beta (w_t - w_{t-1})``, ``w_{t+1} = z - eta (A z - b)``."""
  ws, prev = [np.zeros_like(b)], np.zeros_like(b)
  for _ in range(steps):
    w = ws[-1]
    z = w + beta * (w - prev)
    ws.append(z - eta * (a @ z - b))
    prev = w
  return ws


def textbook_chebyshev(a, b, *, mu, L, steps):
  """Chebyshev iteration in its three-term form (Saad, *Iterative Methods for
  Sparse Linear Systems*, Algorithm 12.1), in its own variables."""
  theta, delta = (L + mu) / 2, (L - mu) / 2
  sigma = theta / delta
  x = np.zeros_like(b)
  r = b - a @ x
  rho = 1 / sigma
  d = r / theta
  ws = [x]
  for _ in range(steps):
    x = x + d
    r = r - a @ d
    rho_next = 1 / (2 * sigma - rho)
    d = rho_next * rho * d + 2 * rho_next / delta * r
    rho = rho_next
    ws.append(x)
  return ws


def textbook_newton_schulz(a, b, *, alpha, steps):
  """``M' = 2M - M A M`` from ``alpha I``; ``w' = w + M (b - A w)`` from ``alpha b``."""
  m, w = alpha * np.eye(a.shape[-1]), alpha * b
  ws, ms = [w], [m]
  for _ in range(steps):
    m, w = 2 * m - m @ a @ m, w + m @ (b - a @ w)
    ws.append(w)
    ms.append(m)
  return ws, ms


def textbook_third_order(a, b, *, alpha, steps, w_update="refine"):
  """The hyperpower iteration of order 3, ``M' = M (I + R + R^2)`` with ``R =
  I - A M`` computed from ``M``. ``w``: ``"refine"``, ``w' = w + M (b - A w)``
  from ``alpha b``; ``"residual"``, ``w' = w + M (I + R)(b - A w)`` from 0 (the
  program's ``s = b - A w`` written out)."""
  eye = np.eye(a.shape[-1])
  m = alpha * eye
  w = alpha * b if w_update == "refine" else np.zeros_like(b)
  ws, ms = [w], [m]
  for _ in range(steps):
    r = eye - a @ m
    step = m if w_update == "refine" else m @ (eye + r)
    m, w = m @ (eye + r + r @ r), w + step @ (b - a @ w)
    ws.append(w)
    ms.append(m)
  return ws, ms


# --- tasks and the runs of each algorithm -------------------------------------


def task(seed, batch, N, d, Q, k, dtype=np.float64):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(*batch, N, d))
  y = rng.normal(size=(*batch, N, k))
  xq = rng.normal(size=(*batch, Q, d))
  return x.astype(dtype), y.astype(dtype), xq.astype(dtype)


def bounds(x):
  """Eigenvalue bounds of A over every task of the batch (one step for all)."""
  mu, L = (np.asarray(v) for v in alg.eigen_bounds(jnp.asarray(x), lam=LAM))
  return float(mu.min()), float(L.max())


def jacobi(x):
  """A constant preconditioner ``diag(A)^-1`` (of the first task), and ``1 /
  lambda_max(P A)``."""
  x0 = x.reshape(-1, *x.shape[-2:])[0]
  a = x0.T @ x0 / x0.shape[0] + LAM * np.eye(x0.shape[1])
  p = np.diag(1 / np.diag(a))
  return p, float(1 / np.max(np.linalg.eigvals(p @ a).real))


def setup_case(name, x):
  """``(program builder kwargs, scalars, loops, textbook(a, b) -> w list)``."""
  mu, L = bounds(x)
  if name in ("gd", "gd_natural"):
    eta = float(alg.gd_step(mu, L))
    return {}, dict(lam=LAM, eta=eta), 12, lambda a, b, n: textbook_gd(
        a, b, eta=eta, steps=n)
  if name == "preconditioned_gd":
    p, eta = jacobi(x)
    return dict(preconditioner=p), dict(lam=LAM, eta=eta), 12, (
        lambda a, b, n: textbook_gd(a, b, eta=eta, steps=n, precond=p))
  if name == "heavy_ball":
    eta, beta = (float(v) for v in alg.heavy_ball_parameters(mu, L))
    return {}, dict(lam=LAM, eta=eta, beta=beta), 12, (
        lambda a, b, n: textbook_heavy_ball(a, b, eta=eta, beta=beta, steps=n))
  if name == "nesterov":
    eta, beta = (float(v) for v in alg.nesterov_parameters(mu, L))
    return {}, dict(lam=LAM, eta=eta, beta=beta), 12, (
        lambda a, b, n: textbook_nesterov(a, b, eta=eta, beta=beta, steps=n))
  if name == "chebyshev":
    eta, beta = (np.asarray(v) for v in alg.chebyshev_schedule(mu, L, 12))
    return {}, dict(lam=LAM, eta=eta, beta=beta), 12, (
        lambda a, b, n: textbook_chebyshev(a, b, mu=mu, L=L, steps=n))
  alpha = float(alg.gd_step(mu, L))
  if name in ("newton_schulz", "newton_schulz_natural"):
    ref = textbook_newton_schulz
  else:
    ref = functools.partial(textbook_third_order, w_update=(
        "residual" if name == "third_order_residual" else "refine"))
  return {}, dict(lam=LAM, alpha=alpha), 5, (
      lambda a, b, n: ref(a, b, alpha=alpha, steps=n)[0])


BUILDERS = dict(alg.ALGORITHMS, preconditioned_gd=alg.preconditioned_gd,
                gd_natural=alg.ridge_gd_natural,
                newton_schulz_natural=alg.newton_schulz_natural)
# Programs without a read-out layer (the predictions follow w), and the
# inputs they clear from the tokens after their last use.
NATURAL = {"gd_natural", "newton_schulz_natural"}
# (batch, N, d, Q, n_out): N < d; N > d with a batch axis and n_out > 1.
SHAPES = [((), 5, 8, 2, 1), ((3,), 10, 3, 2, 2)]


def compiled_run(name, x, y, xq, dtype=np.float64):
  """The compiled stack's states and the interpreter's, on one task set."""
  kwargs, scalars, loops, textbook = setup_case(name, x.astype(np.float64))
  N, d = x.shape[-2:]
  prog = BUILDERS[name](n_train=N, d=d, n_query=xq.shape[-2],
                        n_out=y.shape[-1], **kwargs)
  compiled = programs.compile(prog)
  hs, ref = both(prog, compiled, loops, dtype, x, y, xq, scalars)
  return prog, compiled, hs, ref, scalars, loops, textbook


def both(prog, compiled, loops, dtype, x, y, xq, scalars):
  """The stack's states and the interpreter's blocks, in one jit (one XLA
  compile instead of an eager compile per op and shape)."""

  @jax.jit
  def run(x, y, xq, scalars):
    params = compiled.params(loops=loops, dtype=dtype, **scalars)
    hs = elsa.elsa_stack(params, compiled.encode(X=x, y=y, Xq=xq),
                         return_all=True)
    ref = programs.run(prog, loops=loops, X=x, y=y, Xq=xq, dtype=dtype,
                       **scalars)
    return hs, ref

  return run(x, y, xq, {k: jnp.asarray(v, dtype) for k, v in scalars.items()})


def states(compiled, loops, x, y, xq, scalars):
  """Every state of the float64 stack (jitted: one compile)."""
  return jax.jit(lambda x, y, xq, scalars: elsa.elsa_stack(
      compiled.params(loops=loops, **scalars),
      compiled.encode(X=x, y=y, Xq=xq), return_all=True))(
          x, y, xq, {k: jnp.asarray(v) for k, v in scalars.items()})


def textbook_iterates(textbook, x, y, loops):
  """``[loops + 1, *batch, d, k]`` textbook iterates, task by task."""
  batch = x.shape[:-2]
  flat_x = x.reshape(-1, *x.shape[-2:]).astype(np.float64)
  flat_y = y.reshape(-1, *y.shape[-2:]).astype(np.float64)
  out = [np.stack(textbook(*normal_equations(xi, yi, LAM), loops))
         for xi, yi in zip(flat_x, flat_y)]
  out = np.stack(out, axis=1)
  return out.reshape(out.shape[0], *batch, *out.shape[2:])


@pytest.mark.parametrize("shape", SHAPES, ids=["N<d", "N>d,batch,n_out=2"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_stack_equals_interpreter_and_textbook_at_every_layer(name, shape):
  batch, N, d, Q, k = shape
  x, y, xq = task(hash((name, shape)) % 2**32, batch, N, d, Q, k)
  prog, compiled, hs, ref, scalars, loops, textbook = compiled_run(
      name, x, y, xq)
  setup = compiled.setup_layers
  assert hs.shape == (compiled.layers(loops) + 1, *batch, compiled.m,
                      compiled.n)
  # Every block at every layer equals the interpreter (a pinned input the
  # first layer moves, Xq, is at home from layer 1 on). Relative to the
  # block's largest value over the layers: a step v or a residual R shrinks
  # towards zero, and its rounding stays at the scale it had.
  for block, want in ref.items():
    if block in compiled._layout.dropped:  # zero after its last reader
      continue
    got, want = np.asarray(compiled.read(hs, block)), np.asarray(want)
    skip = 1 if prog.blocks[block].kind == "input" else 0
    scale = max(np.linalg.norm(v) for v in want)
    for t in range(skip, want.shape[0]):
      err = np.linalg.norm(got[t] - want[t]) / scale
      assert err <= F64_RTOL, (block, t, err)
  # w after set-up + t loops is the textbook iterate t.
  w = np.asarray(compiled.read(hs, "w"))
  want = textbook_iterates(textbook, x, y, loops)
  for t in range(loops + 1):
    assert rel(w[setup + t], want[t]) <= F64_RTOL, (t, rel(w[setup + t],
                                                           want[t]))
  # The read-out layer: p = Xq @ w, and w unchanged by it (gd_natural
  # updates p with w in every layer instead).
  p = np.asarray(compiled.read(hs, "p"))[-1]
  assert rel(p, xq @ w[-1]) <= F64_RTOL
  if name not in NATURAL:
    assert rel(w[-1], w[-2]) == 0.0


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_float32_stack_within_the_measured_bound(name):
  batch, N, d, Q, k = (), 12, 4, 3, 1
  x, y, xq = task(7, batch, N, d, Q, k)
  _, compiled, hs, _, _, loops, textbook = compiled_run(
      name, *(a.astype(np.float32) for a in (x, y, xq)), dtype=np.float32)
  assert hs.dtype == jnp.float32
  w = np.asarray(compiled.read(hs, "w"))
  want = textbook_iterates(textbook, x, y, loops)
  worst = max(rel(w[compiled.setup_layers + t], want[t])
              for t in range(1, loops + 1))
  assert worst <= F32_RTOL, worst


CONVERGED_LOOPS = {"gd": 200, "gd_natural": 200, "newton_schulz_natural": 8,
                   "preconditioned_gd": 200, "heavy_ball": 80,
                   "nesterov": 120, "chebyshev": 80, "newton_schulz": 8,
                   "third_order": 6, "third_order_residual": 6}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_converged_w_is_the_ridge_solution(name):
  N, d = 16, 4
  x, y, xq = task(11, (), N, d, 2, 1)
  kwargs, scalars, _, _ = setup_case(name, x)
  loops = CONVERGED_LOOPS[name]
  if name == "chebyshev":
    mu, L = bounds(x)
    scalars["eta"], scalars["beta"] = alg.chebyshev_schedule(mu, L, loops)
  compiled = programs.compile(BUILDERS[name](n_train=N, d=d, n_query=2,
                                             **kwargs))
  h = jax.jit(lambda x, y, xq, scalars: elsa.elsa_stack(
      compiled.params(loops=loops, **scalars),
      compiled.encode(X=x, y=y, Xq=xq)))(
          x, y, xq, {k: jnp.asarray(v) for k, v in scalars.items()})
  w_star = ridge.solve(jnp.asarray(x), jnp.asarray(y), lam=LAM)
  assert rel(compiled.read(h, "w"), w_star) <= F64_RTOL
  assert rel(compiled.read(h, "p"), xq @ np.asarray(w_star)) <= F64_RTOL


@pytest.mark.parametrize("w_update", ["refine", "residual"])
def test_third_order_residual_block_and_its_gd_step(w_update):
  """The docstring's claims: ``R_t = I - A M_t``; ``w_t`` is GD step ``(3^t +
  1) / 2`` (refine) or ``3^t - 1`` (residual)."""
  N, d, loops = 10, 3, 4
  x, y, xq = task(3, (), N, d, 2, 1)
  _, scalars, _, _ = setup_case("third_order", x)
  compiled = programs.compile(alg.third_order(n_train=N, d=d, n_query=2,
                                              w_update=w_update))
  hs = states(compiled, loops, x, y, xq, scalars)
  a, b = normal_equations(x, y, LAM)
  _, ms = textbook_third_order(a, b, alpha=scalars["alpha"], steps=loops)
  gd = textbook_gd(a, b, eta=scalars["alpha"], steps=3**loops)
  step = (lambda t: (3**t + 1) // 2) if w_update == "refine" else (
      lambda t: 3**t - 1)
  setup = compiled.setup_layers
  for t in range(loops + 1):
    m, r = (np.asarray(compiled.read(hs, n))[setup + t] for n in ("M", "R"))
    assert rel(m, ms[t]) <= F64_RTOL
    assert np.linalg.norm(r - (np.eye(d) - a @ m)) <= F64_RTOL
    assert rel(np.asarray(compiled.read(hs, "w"))[setup + t],
               gd[step(t)]) <= F64_RTOL
  with pytest.raises(ValueError, match="w_update must be 'refine' or"):
    alg.third_order(n_train=N, d=d, w_update="cubed")


def test_newton_schulz_block_m_is_the_textbook_inverse_iterate():
  N, d, loops = 12, 4, 8
  x, y, xq = task(4, (), N, d, 2, 1)
  _, scalars, _, _ = setup_case("newton_schulz", x)
  compiled = programs.compile(alg.newton_schulz(n_train=N, d=d, n_query=2))
  hs = states(compiled, loops, x, y, xq, scalars)
  a, b = normal_equations(x, y, LAM)
  _, ms = textbook_newton_schulz(a, b, alpha=scalars["alpha"], steps=loops)
  m = np.asarray(compiled.read(hs, "M"))
  for t in range(loops + 1):
    assert rel(m[compiled.setup_layers + t], ms[t]) <= F64_RTOL
  assert rel(m[-1], np.linalg.inv(a)) <= 1e-12


# --- the helpers --------------------------------------------------------------


def chebyshev_recurrence(mu, L, loops):
  """The schedule by the recurrence ``rho_t = 1 / (2 sigma - rho_{t-1})``."""
  theta, delta = (L + mu) / 2, (L - mu) / 2
  sigma = theta / delta
  rhos = [1 / sigma]
  for _ in range(loops - 1):
    rhos.append(1 / (2 * sigma - rhos[-1]))
  eta = [1 / theta] + [2 * r / delta for r in rhos[1:]]
  beta = [0.0] + [r * q for r, q in zip(rhos[1:], rhos)]
  return np.array(eta), np.array(beta)


@pytest.mark.parametrize("mu,L", [(0.01, 1.0), (1e-6, 1.0), (0.3, 2.5)])
def test_chebyshev_schedule_is_the_recurrence(mu, L):
  eta, beta = (np.asarray(v) for v in alg.chebyshev_schedule(mu, L, 2000))
  want_eta, want_beta = chebyshev_recurrence(mu, L, 2000)
  assert eta.shape == beta.shape == (2000,)
  assert np.max(np.abs(eta - want_eta) / want_eta) <= 1e-12
  assert beta[0] == 0
  assert np.max(np.abs(beta[1:] - want_beta[1:]) / want_beta[1:]) <= 1e-12
  # The tail tends to heavy ball's optimal constants.
  hb_eta, hb_beta = alg.heavy_ball_parameters(mu, L)
  if L / mu < 1e3:
    assert abs(eta[-1] / hb_eta - 1) <= 1e-12
    assert abs(beta[-1] / hb_beta - 1) <= 1e-12


def test_chebyshev_error_is_the_chebyshev_polynomial_and_meets_its_bound():
  """Heavy ball with the schedule: ``e_t(lambda) = T_t((theta - lambda)/delta) / T_t(sigma)``."""
  mu, L, loops = 0.02, 1.0, 40
  lams = np.concatenate([[mu, L], np.linspace(mu, L, 50)])
  a, e0 = np.diag(lams), np.ones((lams.size, 1))
  eta, beta = (np.asarray(v) for v in alg.chebyshev_schedule(mu, L, loops))
  # Iterate on the error: w* = e0, b = A e0.
  b = a @ e0
  ws, prev = [np.zeros_like(b)], np.zeros_like(b)
  for t in range(loops):
    w = ws[-1]
    ws.append(w - eta[t] * (a @ w - b) + beta[t] * (w - prev))
    prev = w
  theta, delta = (L + mu) / 2, (L - mu) / 2
  cheb = np.polynomial.chebyshev.Chebyshev
  for t in range(loops + 1):
    tt = cheb.basis(t)
    want = tt((theta - lams) / delta) / tt(theta / delta)
    err = (e0 - ws[t])[:, 0]
    assert np.max(np.abs(err - want)) <= 1e-10 * max(1, np.max(np.abs(want)))
    bound = 1 / math.cosh(t * math.acosh(theta / delta))
    assert np.max(np.abs(err)) <= bound * (1 + 1e-9)
    assert abs(abs(err[0]) - bound) <= 1e-10 * bound + 1e-15  # at mu: equal


def test_chebyshev_schedule_is_traceable_and_cheap_for_long_schedules():
  f = jax.jit(alg.chebyshev_schedule, static_argnums=2)
  eta, beta = f(jnp.float64(1e-6), jnp.float64(1.0), 10**6)
  assert eta.shape == (10**6,) and np.all(np.isfinite(eta))
  assert np.all(np.isfinite(beta))
  # No Python loop over loops: the traced program does not grow with it.
  size = lambda n: len(jax.make_jaxpr(lambda a, b: alg.chebyshev_schedule(
      a, b, n))(0.1, 1.0).eqns)
  assert size(10) == size(10**5)
  # Traced bounds under vmap: one schedule per task.
  etas, _ = jax.vmap(lambda a, b: alg.chebyshev_schedule(a, b, 5))(
      jnp.array([0.1, 0.2]), jnp.array([1.0, 2.0]))
  assert etas.shape == (2, 5)
  np.testing.assert_allclose(etas[1], np.asarray(alg.chebyshev_schedule(
      0.2, 2.0, 5)[0]), rtol=1e-14)
  # mu == L: one step of 1/L solves it, and nothing is NaN.
  eta1, beta1 = alg.chebyshev_schedule(2.0, 2.0, 3)
  np.testing.assert_allclose(eta1, 0.5, rtol=1e-15)
  np.testing.assert_array_equal(beta1, 0.0)
  with pytest.raises(ValueError, match="loops must be an int >= 1"):
    alg.chebyshev_schedule(0.1, 1.0, 0)


@pytest.mark.parametrize("mu,L", [(0.01, 1.0), (1e-4, 3.0)])
def test_heavy_ball_and_nesterov_parameters_are_the_textbook_ones(mu, L):
  kappa = L / mu
  q = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
  eta, beta = alg.heavy_ball_parameters(mu, L)
  assert abs(eta - 4 / (math.sqrt(L) + math.sqrt(mu)) ** 2) <= 1e-15 * eta
  assert abs(beta - q**2) <= 1e-14
  # Polyak's rate: the iteration matrix [[1 + beta - eta lam, -beta], [1, 0]]
  # has spectral radius sqrt(beta) at both ends of the spectrum.
  for lam in (mu, L, (mu + L) / 2):
    t = np.array([[1 + beta - eta * lam, -beta], [1, 0]])
    assert abs(np.max(np.abs(np.linalg.eigvals(t))) - q) <= 1e-7
  eta, beta = alg.nesterov_parameters(mu, L)
  assert abs(eta - 1 / L) <= 1e-15 * eta and abs(beta - q) <= 1e-14
  assert abs(alg.gd_step(mu, L) - 2 / (mu + L)) <= 1e-15


def test_eigen_bounds_are_the_extreme_eigenvalues_of_a():
  x, y, _ = task(5, (3,), 9, 4, 1, 1)
  mu, L = alg.eigen_bounds(jnp.asarray(x), lam=LAM)
  evals = np.linalg.eigvalsh(normal_equations(x, y, LAM)[0])
  np.testing.assert_allclose(mu, evals[:, 0], rtol=1e-12)
  np.testing.assert_allclose(L, evals[:, -1], rtol=1e-12)


# --- what cannot be compiled --------------------------------------------------


def cg_program():
  N, d = 6, 3
  prog = programs.Program()
  X = prog.input("X", (N, d))
  y = prog.input("y", (N, 1))
  w = prog.state("w", (d, 1))
  r = prog.state("r", (d, 1), init=X.T @ y)
  p = prog.state("p", (d, 1), init=X.T @ y)
  return prog, X, w, r, p


def test_conjugate_gradient_step_is_refused_as_a_ratio_of_data():
  prog, X, w, r, p = cg_program()
  # CG's step r^T r / p^T A p: a block divided by a block.
  with pytest.raises(TypeError, match="divides by a block: ELSA computes "
                     "polynomials of its tokens"):
    prog.loop({w: w + (r.T @ r) / (p.T @ X.T @ X @ p) * p})
  with pytest.raises(TypeError, match="ratios of data cannot be compiled"):
    _ = (r.T @ r) / (p.T @ p)
  # Nor as a data-dependent coefficient times a block.
  with pytest.raises(TypeError, match="multiplies blocks elementwise"):
    _ = (r.T @ r) * p


def test_normalised_power_iteration_is_refused():
  prog, X, w, r, p = cg_program()
  with pytest.raises(TypeError, match="symbolic block, not an array"):
    np.linalg.norm(p)
  with pytest.raises(TypeError, match="divides by a block"):
    prog.loop({p: p / (p.T @ p)})
  with pytest.raises(TypeError, match="no truth value"):
    bool(p.T @ p)


def test_a_schedule_where_a_set_up_layer_reads_the_scalar_is_refused():
  """Newton–Schulz's alpha builds M_0 in the set-up layer: a schedule is refused."""
  compiled = programs.compile(alg.newton_schulz(n_train=6, d=3))
  with pytest.raises(ValueError, match="alpha is a schedule of shape"):
    compiled.params(loops=4, lam=0.1, alpha=np.full(4, 0.1))
