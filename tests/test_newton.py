"""Newton form: ELSA Newton–Schulz against plain GD at step 2^t, the closed form, and numpy."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elsa
from elsa import constructions, ridge
from elsa.forms import Newton
from elsa.ridge import safe_alpha
from helpers import rel_norm as rel

# float32 floor after convergence, against the float64 ridge solution: the
# measured relative error of w and of the predictions was 0.37, 0.06 and 0.50
# times kappa * eps_f32 for kappa = 10, 1e2, 1e3 (docs/guides/newton.md),
# the conditioning of the task itself; asserted as < 10 kappa eps_f32.
F32_EPS = float(np.finfo(np.float32).eps)
F64_RTOL = 1e-10




def random_task(rng, *, batch, n_train, d, n_query, n_out, dtype):
  out = () if n_out == 1 else (n_out,)
  x = rng.normal(size=(*batch, n_train, d))
  y = rng.normal(size=(*batch, n_train, *out))
  xq = rng.normal(size=(*batch, n_query, d))
  return (jnp.asarray(x, dtype), jnp.asarray(y, dtype), jnp.asarray(xq, dtype))


def spectrum_task(rng, *, kappa, n_train, d, lam):
  """``x`` with ``eig(X^T X / N + lam I)`` log-spaced in ``[1/kappa, 1]``."""
  mu = np.geomspace(1 / kappa, 1, d)
  u, _ = np.linalg.qr(rng.normal(size=(n_train, d)))
  v, _ = np.linalg.qr(rng.normal(size=(d, d)))
  x = math.sqrt(n_train) * u * np.sqrt(mu - lam) @ v.T
  y = x @ rng.normal(size=d) + 0.1 * rng.normal(size=n_train)
  return jnp.asarray(x), jnp.asarray(y)


def run(form, x, y, xq, *, lam, alpha, depth):
  params = form.newton_params(lam=lam, alpha=alpha, depth=depth,
                              dtype=x.dtype)
  return elsa.elsa_stack(params, form.encode(x, y, x_query=xq),
                         return_all=True)


# (batch, N, d, Q, k, alpha * lambda_max / 2): N < d and N > d, no queries,
# several outputs; alpha past 1 / lambda_max, where I - alpha A has negative
# eigenvalues, and below it.
SHAPES = [((), 9, 3, 2, 1, 1.0), ((2,), 4, 6, 3, 1, 1.9), ((), 7, 4, 0, 1, 1.9),
          ((3,), 8, 2, 1, 3, 1.0)]


@pytest.mark.parametrize("batch,n_train,d,n_query,n_out,alpha_factor", SHAPES)
def test_layer_t_is_gd_step_two_to_the_t(batch, n_train, d, n_query, n_out,
                                         alpha_factor):
  rng = np.random.default_rng(n_train * 100 + d)
  x, y, xq = random_task(rng, batch=batch, n_train=n_train, d=d,
                         n_query=n_query, n_out=n_out, dtype=jnp.float64)
  lam, depth = 0.3, 12
  alpha = alpha_factor * float(jnp.min(ridge.stability_limit(x, lam=lam))) / 2
  form = Newton(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
  hs = run(form, x, y, xq, lam=lam, alpha=alpha, depth=depth)
  assert hs.shape == (form.setup_layers + depth + 1, *batch, form.m, form.n)
  ws, preds = form.decode_w(hs), form.decode_pred(hs)
  gd = ridge.gd(x, y, lam=lam, eta=alpha, steps=2**depth)
  for t in range(depth + 1):
    want = gd[2**t]
    got = ws[form.setup_layers + t]
    assert got.shape == want.shape
    assert rel(got, want) < F64_RTOL, t
    want_pred = jnp.einsum("...qd,...d->...q" if n_out == 1 else
                           "...qd,...dk->...qk", xq, want)
    if n_query:
      assert rel(preds[form.setup_layers + t], want_pred) < F64_RTOL, t


@pytest.mark.parametrize("kappa,d", [(10.0, 4), (1e2, 5), (1e3, 4), (1e4, 5),
                                     (1e4, 4)])
def test_reaches_ridge_solution_in_log_kappa_layers(kappa, d):
  rng = np.random.default_rng(int(kappa) + d)
  lam, n_train = 1e-5, 16
  x, y = spectrum_task(rng, kappa=kappa, n_train=n_train, d=d, lam=lam)
  xq = jnp.asarray(rng.normal(size=(2, d)))
  a, _ = ridge.normal_equations(x, y, lam=lam)
  evals = np.linalg.eigvalsh(np.asarray(a))
  assert evals[-1] / evals[0] == pytest.approx(kappa, rel=1e-6)
  layers = math.ceil(math.log2(kappa * math.log(1e10))) + 2
  form = Newton(n_train=n_train, d=d, n_query=2)
  alpha = safe_alpha(x, lam=lam)
  hs = run(form, x, y, xq, lam=lam, alpha=alpha, depth=layers)
  w_star = ridge.solve(x, y, lam=lam)
  assert rel(form.decode_w(hs[form.setup_layers + layers]), w_star) < 1e-10
  assert rel(form.decode_pred(hs[-1]), xq @ w_star) < 1e-10
  # Not earlier than theory allows: the error bound max|1 - alpha mu|^(2^t)
  # is tight along the smallest eigenvalue, so a few layers fewer must fail.
  assert rel(form.decode_w(hs[form.setup_layers + layers - 4]), w_star) > 1e-10


def test_state_matches_numpy_newton_schulz():
  """Every block of the state against an independent numpy Newton–Schulz."""
  rng = np.random.default_rng(7)
  n_train, d, n_query, lam = 6, 3, 2, 0.2
  x, y, xq = random_task(rng, batch=(), n_train=n_train, d=d, n_query=n_query,
                         n_out=1, dtype=jnp.float64)
  alpha = float(safe_alpha(x, lam=lam))
  form = Newton(n_train=n_train, d=d, n_query=n_query)
  hs = np.asarray(run(form, x, y, xq, lam=lam, alpha=alpha, depth=5))
  xn, yn, xqn = (np.asarray(a) for a in (x, y, xq))
  a = xn.T @ xn / n_train + lam * np.eye(d)
  b = xn.T @ yn / n_train
  m = alpha * np.eye(d)
  for t in range(6):
    h = hs[form.setup_layers + t]
    np.testing.assert_allclose(form.decode_gram(h), a, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(form.decode_inverse(h), m, rtol=1e-10,
                               atol=1e-14)
    np.testing.assert_allclose(form.decode_w(h), m @ b, rtol=1e-10)
    q = h[n_train:n_train + n_query]
    np.testing.assert_allclose(q[:, form.mcol_cols.start:form.mcol_cols.stop],
                               xqn @ m, rtol=1e-10, atol=1e-14)
    # Examples are untouched; queries keep no x; nothing else is written.
    np.testing.assert_array_equal(h[:n_train, :d], xn)
    np.testing.assert_array_equal(h[:n_train, d], yn)
    assert not np.any(h[:n_train, d + 1:])
    assert not np.any(q[:, :form.a_cols.stop])
    m = 2 * m - m @ a @ m


def test_float32_floor():
  rng = np.random.default_rng(3)
  lam, form = 1e-4, Newton(n_train=12, d=4, n_query=1)
  for kappa in (10.0, 1e2, 1e3):
    x, y = spectrum_task(rng, kappa=kappa, n_train=12, d=4, lam=lam)
    xq = jnp.asarray(rng.normal(size=(1, 4)))
    w_star = ridge.solve(x, y, lam=lam)
    x32, y32, xq32 = (a.astype(jnp.float32) for a in (x, y, xq))
    hs = run(form, x32, y32, xq32, lam=lam, alpha=safe_alpha(x32, lam=lam),
             depth=18)
    assert hs.dtype == jnp.float32
    err = max(rel(form.decode_w(hs[-1]), w_star),
              rel(form.decode_pred(hs[-1]), xq @ w_star))
    print(f"float32, kappa={kappa:g}: {err:.2e} = "
          f"{err / (kappa * F32_EPS):.2f} kappa eps")
    assert err < 10 * kappa * F32_EPS


def test_vmap_over_lam_and_alpha_does_not_retrace():
  rng = np.random.default_rng(0)
  x, y, xq = random_task(rng, batch=(), n_train=5, d=3, n_query=1, n_out=1,
                         dtype=jnp.float64)
  form = Newton(n_train=5, d=3, n_query=1)
  chex.clear_trace_counter()  # counts are kept per function body, across tests

  @jax.jit
  @chex.assert_max_traces(n=1)
  def final_w(lam, alpha):
    params = form.newton_params(lam=lam, alpha=alpha, depth=4)
    return form.decode_w(elsa.elsa_stack(params, form.encode(x, y,
                                                             x_query=xq)))

  sweep = jax.jit(jax.vmap(final_w))
  lams = jnp.array([0.1, 0.5, 1.0])
  alphas = 0.5 * ridge.stability_limit(x, lam=lams)
  got = sweep(lams, alphas)
  sweep(lams * 2, alphas / 2)  # new values, same shapes: no new trace
  for i in range(3):
    want = ridge.gd(x, y, lam=lams[i], eta=alphas[i], steps=16)[-1]
    assert rel(got[i], want) < F64_RTOL


def test_safe_alpha_is_within_the_stability_limit():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 10, 6)) * rng.uniform(0.1, 10, (4, 1, 1)))
  for lam in (0.0, 0.5):
    alpha = safe_alpha(x, lam=lam)
    a, _ = ridge.normal_equations(x, x[..., 0], lam=lam)
    top = np.linalg.eigvalsh(np.asarray(a))[..., -1]
    assert alpha.shape == (4,)
    assert np.all(alpha * top <= 1 + 1e-12)
    assert np.all(alpha * top >= 1 / math.sqrt(6) - 1e-12)
  assert Newton.safe_alpha is safe_alpha


def test_layout_sizes_and_decoders_on_stacked_states():
  form = Newton(n_train=5, d=2, n_query=3, n_out=2)
  assert (form.m, form.n, form.setup_layers) == (10, 10, 2)
  assert list(form.w_cols) == [8, 9] and list(form.m_rows) == [8, 9]
  h = jnp.arange(4 * 7 * 10 * 10, dtype=jnp.float32).reshape(4, 7, 10, 10)
  assert form.decode_w(h).shape == (4, 7, 2, 2)
  assert form.decode_pred(h).shape == (4, 7, 3, 2)
  np.testing.assert_array_equal(form.decode_w(h)[1, 2], h[1, 2, 8:, 8:])
  params = form.newton_params(lam=0.1, alpha=0.2, depth=3)
  assert params.w1.shape[:2] == (5, 3) and params.w1.dtype == jnp.float64  # x64 default
  assert form.newton_params(lam=jnp.float64(0.1), alpha=0.2,
                            depth=0).w1.dtype == jnp.float64


def test_encode_is_the_natural_enumeration():
  rng = np.random.default_rng(2)
  x, y, xq = random_task(rng, batch=(2,), n_train=3, d=2, n_query=2, n_out=1,
                         dtype=jnp.float32)
  form = Newton(n_train=3, d=2, n_query=2)
  h = np.array(form.encode(x, y, x_query=xq[0]))  # queries broadcast
  assert h.shape == (2, form.m, form.n) and h.dtype == np.float32
  np.testing.assert_array_equal(h[:, :3, :2], x)
  np.testing.assert_array_equal(h[:, :3, 2], y)
  np.testing.assert_array_equal(h[:, 3:5, :2], np.broadcast_to(xq[0], (2, 2, 2)))
  h[:, :3, :3] = 0
  h[:, 3:5, :2] = 0
  assert not np.any(h)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="n_train"):
    Newton(n_train=0, d=2)
  with pytest.raises(TypeError, match="d must be an int"):  # a type, not a value
    Newton(n_train=3, d=2.0)
  with pytest.raises(TypeError):
    Newton(3, 2)  # keyword-only, like the GD forms
  form = Newton(n_train=3, d=2, n_query=1)
  x, y, xq = (jnp.ones(s, jnp.float32) for s in ((3, 2), (3,), (1, 2)))
  with pytest.raises(ValueError, match="x must have shape"):
    form.encode(jnp.ones((4, 2), jnp.float32), y, x_query=xq)
  with pytest.raises(ValueError, match="y must have shape"):
    form.encode(x, jnp.ones((3, 2), jnp.float32), x_query=xq)
  with pytest.raises(ValueError, match="x_query"):
    form.encode(x, y)
  with pytest.raises(ValueError, match="x_query"):
    form.encode(x, y, x_query=jnp.ones((2, 2), jnp.float32))
  with pytest.raises(TypeError, match="dtype"):
    form.encode(x, y.astype(jnp.float64), x_query=xq)
  with pytest.raises(TypeError, match="floating"):
    form.encode(jnp.ones((3, 2), jnp.int32), y, x_query=xq)
  with pytest.raises(ValueError, match="depth"):
    form.newton_params(lam=0.1, alpha=0.1, depth=-1)
  with pytest.raises(ValueError, match="alpha must be > 0"):
    form.newton_params(lam=0.1, alpha=0.0, depth=2)
  with pytest.raises(ValueError, match="lam must be a scalar"):
    form.newton_params(lam=jnp.ones(2), alpha=0.1, depth=2)
  with pytest.raises(TypeError, match="floating"):
    form.newton_params(lam=0.1, alpha=0.1, depth=2, dtype=jnp.int32)
  with pytest.raises(ValueError, match="h must have shape"):
    form.decode_w(jnp.ones((form.m, form.n + 1)))
  with pytest.raises(ValueError, match="x must have shape"):
    safe_alpha(jnp.ones(3), lam=0.1)


def test_concrete_nonpositive_alpha_raises_for_arrays_too():
  form = Newton(n_train=3, d=2, n_query=1)
  for alpha in (jnp.asarray(-1.0), np.float64(0.0), jnp.float32(-0.5),
                jnp.asarray(np.nan)):
    for method in (form.newton_params, form.setup_params):
      kwargs = dict(depth=1) if method == form.newton_params else {}
      with pytest.raises(ValueError, match="alpha must be > 0"):
        method(lam=0.1, alpha=alpha, **kwargs)
  # A traced alpha cannot be checked and is accepted.
  params = jax.jit(lambda a: form.newton_params(lam=0.1, alpha=a, depth=1))(
      jnp.asarray(-1.0))
  assert params.w1.shape[:2] == (3, 3)


@pytest.mark.parametrize("n_train,d,n_query,n_out", [
    (9, 3, 2, 1), (4, 2, 2, 1), (2, 4, 2, 3), (7, 4, 0, 1), (3, 1, 1, 1),
    (20, 5, 3, 1)])
def test_newton_is_its_compiled_program(n_train, d, n_query, n_out):
  # The compiled program has the hand layout's tokens, features, three
  # components per layer and two set-up layers, also where the constants
  # cannot ride in the column mix (m < n + d), Q = d, N = Q, Q = 0 and d = 1;
  # its stack on its own columns gives the form's states in the form's
  # columns at every layer.
  form = Newton(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
  compiled = form.compiled
  assert (compiled.m, compiled.n, compiled.width, compiled.setup_layers) == (
      form.m, form.n, 3, 2)
  x, y, xq = random_task(np.random.default_rng(4), batch=(2,), n_train=n_train,
                         d=d, n_query=n_query, n_out=n_out, dtype=jnp.float64)
  lam, T = 0.1, 4
  alpha = float(np.min(safe_alpha(x, lam=lam)))
  hs = run(form, x, y, xq, lam=lam, alpha=alpha, depth=T)
  blocks = dict(X=x, y=y.reshape(2, n_train, n_out))
  if n_query:
    blocks["Xq"] = xq
  own = elsa.elsa_stack(compiled.params(lam=lam, alpha=alpha, loops=T),
                        compiled.encode(**blocks), return_all=True)
  np.testing.assert_allclose(hs[..., form._columns()], own, rtol=0,
                             atol=1e-13)
  gd = ridge.gd(x, y, lam=lam, eta=alpha, steps=2 ** T)
  assert rel(form.decode_w(hs[-1]), gd[-1]) < F64_RTOL


def test_building_blocks_take_python_numbers():
  form = Newton(n_train=4, d=2, n_query=2)
  f64 = lambda v: jnp.asarray(v, jnp.float64)
  for name, kwargs in (("move_queries", dict(alpha=0.5)),
                       ("gram_head", dict(lam=0.1, alpha=0.5)),
                       ("alpha_b_head", dict(alpha=0.5))):
    got = getattr(form, name)(**kwargs)
    want = getattr(form, name)(**{k: f64(v) for k, v in kwargs.items()})
    assert got.w1.dtype == elsa.attention.float_dtype() == jnp.float64
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
  assert form.alpha_b_head(alpha=0.5, dtype=jnp.float32).b3.dtype == jnp.float32
  # newton_layer defaults to JAX's default float (float64 under x64).
  assert all(leaf.dtype == jnp.float64 for leaf in form.newton_layer())
  # The blocks are the set-up layers (padded to the layer's inner width).
  setup = form.setup_params(lam=0.1, alpha=0.5)
  pad = lambda p: constructions.pad_inner(p, setup.k)
  for a, b in zip(pad(form.move_queries(alpha=0.5)), setup):
    np.testing.assert_array_equal(a, b[0, 1])
  for a, b in zip(pad(form.gram_head(lam=0.1, alpha=0.5)), setup):
    np.testing.assert_array_equal(a, b[1, 1])
  # move_queries moves x to alpha x in mcol on the query rows, nothing else.
  h = jax.random.normal(jax.random.key(0), (form.m, form.n), jnp.float64)
  got = np.asarray(elsa.elsa(form.move_queries(alpha=0.5), h))
  q, xc, mc = (slice(r.start, r.stop) for r in (form.query_rows, form.x_cols,
                                                form.mcol_cols))
  want = np.zeros((form.m, form.n))
  want[q, mc], want[q, xc] = 0.5 * h[q, xc], -h[q, xc]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)


def test_params_validate_once_and_compile_once(monkeypatch):
  form = Newton(n_train=5, d=3, n_query=2)
  calls = []
  check = Newton._lam_alpha
  monkeypatch.setattr(Newton, "_lam_alpha",
                      lambda self, *a, **k: calls.append(1) or check(self, *a,
                                                                     **k))
  eager = constructions.stack(form.setup_params(lam=0.2, alpha=0.3),
                              *[form.newton_layer()] * 3)
  calls.clear()
  params = form.newton_params(lam=0.2, alpha=0.3, depth=3)
  assert len(calls) == 1
  for a, b in zip(params, eager):
    np.testing.assert_allclose(a, b, rtol=1e-15, atol=0)
  # Built by one compiled function per form, depth and dtype: another lam,
  # alpha reuses it.
  from elsa.forms import _token_form
  size = _token_form._jitted._cache_size()
  form.newton_params(lam=0.5, alpha=0.1, depth=4)
  assert _token_form._jitted._cache_size() == size + 1
  form.newton_params(lam=0.2, alpha=0.2, depth=4)
  assert _token_form._jitted._cache_size() == size + 1
