"""Ridge references against plain numpy: loss, gd, solve, stability limit, tasks."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elsa import _validate, ridge
from helpers import rel_err

RTOL = 1e-12


def np_gd(x, y, lam, etas, w0=None):
  """One task at a time: w <- (1 - eta lam) w - (eta/N) X^T (X w - y)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  n = x.shape[0]
  w = np.zeros((x.shape[1], *y.shape[1:])) if w0 is None else np.array(w0)
  out = [w.copy()]
  for eta in etas:
    w = (1 - eta * lam) * w - eta / n * x.T @ (x @ w - y)
    out.append(w.copy())
  return np.stack(out)


def np_solve(x, y, lam):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  n, d = x.shape
  if lam == 0:
    return np.linalg.pinv(x) @ y  # the minimum-norm least-squares solution
  return np.linalg.solve(x.T @ x / n + lam * np.eye(d), x.T @ y / n)


# (N, d, n_out): N > d, N < d, multi-output.
SHAPES = [(9, 4, None), (3, 5, None), (7, 3, 2)]


@pytest.mark.parametrize("n_train,d,n_out", SHAPES)
@pytest.mark.parametrize("lam", [0.0, 0.4])
def test_gd_loss_solve_match_numpy(n_train, d, n_out, lam):
  t = ridge.sample_tasks(jax.random.key(n_train), batch=2, n_train=n_train,
                         d=d, n_out=n_out, noise=0.1, dtype=jnp.float64)
  steps = 7
  etas = np.random.default_rng(d).uniform(0.05, 0.3, steps)
  for eta in (0.2, etas):
    ws = ridge.gd(t.x, t.y, lam=lam, eta=jnp.asarray(eta), steps=steps)
    assert ws.shape == (steps + 1, 2, d, *(() if n_out is None else (n_out,)))
    for b in range(2):
      want = np_gd(t.x[b], t.y[b], lam, np.broadcast_to(eta, (steps,)))
      assert rel_err(ws[:, b], want) < RTOL
  w = ridge.solve(t.x, t.y, lam=lam)
  for b in range(2):
    assert rel_err(w[b], np_solve(t.x[b], t.y[b], lam)) < 1e-9
    xb, yb = np.asarray(t.x[b]), np.asarray(t.y[b])
    res = yb - xb @ np.asarray(w[b])
    want_loss = (0.5 * np.sum(res**2) / n_train
                 + 0.5 * lam * np.sum(np.asarray(w[b])**2))
    assert abs(ridge.loss(w[b], t.x[b], t.y[b], lam=lam) - want_loss) < 1e-12
  a, rhs = ridge.normal_equations(t.x, t.y, lam=lam)
  assert rel_err(a[0], t.x[0].T @ t.x[0] / n_train + lam * np.eye(d)) < RTOL
  assert rel_err(rhs[1], t.x[1].T @ t.y[1] / n_train) < RTOL


def test_gd_from_w0_and_jit():
  t = ridge.sample_tasks(jax.random.key(3), batch=2, n_train=6, d=3, n_out=2,
                         dtype=jnp.float64)
  w0 = jax.random.normal(jax.random.key(4), (2, 3, 2), jnp.float64)
  ws = jax.jit(lambda lam, eta: ridge.gd(t.x, t.y, lam=lam, eta=eta, steps=5,
                                         w0=w0))(0.1, 0.25)
  for b in range(2):
    assert rel_err(ws[:, b], np_gd(t.x[b], t.y[b], 0.1, [0.25] * 5, w0[b])) < RTOL


def test_stability_limit_separates_convergence_from_divergence():
  t = ridge.sample_tasks(jax.random.key(5), batch=1, n_train=10, d=3,
                         dtype=jnp.float64)
  lam = 0.2
  limit = float(ridge.stability_limit(t.x, lam=lam)[0])
  gram = np.asarray(t.x[0]).T @ np.asarray(t.x[0]) / 10
  assert abs(limit - 2 / (np.linalg.eigvalsh(gram)[-1] + lam)) < 1e-12
  w_star = ridge.solve(t.x, t.y, lam=lam)
  err = lambda eta: np.linalg.norm(
      ridge.gd(t.x, t.y, lam=lam, eta=eta, steps=300)[-1] - w_star)
  assert err(0.95 * limit) < 1e-6
  assert err(1.05 * limit) > 1e3


def test_sample_tasks_determinism_and_shapes():
  kw = dict(batch=3, n_train=5, d=4, n_query=2, dtype=jnp.float32)
  a = ridge.sample_tasks(jax.random.key(0), **kw)
  b = ridge.sample_tasks(jax.random.key(0), **kw)
  c = ridge.sample_tasks(jax.random.key(1), **kw)
  for fa, fb, fc in zip(a, b, c):
    np.testing.assert_array_equal(fa, fb)
    assert fa.dtype == jnp.float32
    assert not np.array_equal(fa, fc)
  assert a.x.shape == (3, 5, 4) and a.y.shape == (3, 5)
  assert a.x_query.shape == (3, 2, 4) and a.w_true.shape == (3, 4)
  # noise = 0: labels are exactly linear in x.
  np.testing.assert_allclose(a.y, jnp.einsum("bnd,bd->bn", a.x, a.w_true),
                             rtol=1e-5, atol=1e-5)
  m = ridge.sample_tasks(jax.random.key(0), batch=2, n_train=5, d=4,
                         n_query=0, n_out=3, dtype=jnp.float64)
  assert m.y.shape == (2, 5, 3) and m.x_query.shape == (2, 0, 4)


@pytest.mark.parametrize("call,match", [
    (lambda x, y: ridge.gd(x, y[:, :-1], lam=0.1, eta=0.1, steps=2), "y"),
    (lambda x, y: ridge.gd(x[0, 0], y, lam=0.1, eta=0.1, steps=2), "x"),
    (lambda x, y: ridge.gd(x, y, lam=0.1, eta=jnp.ones(3), steps=2), "eta"),
    (lambda x, y: ridge.gd(x, y, lam=0.1, eta=0.1, steps=-1), "steps"),
    (lambda x, y: ridge.gd(x, y, lam=0.1, eta=0.1, steps=2,
                           w0=jnp.ones(5)), "w0"),
    (lambda x, y: ridge.loss(jnp.ones(3), x, y[..., None, None], lam=0.1), "y"),
    (lambda x, y: ridge.stability_limit(x[0, 0], lam=0.1), "x"),
])
def test_bad_arguments_raise(call, match):
  x, y = jnp.ones((2, 4, 3)), jnp.ones((2, 4))
  with pytest.raises(ValueError, match=rf"\b{match} (must|has|is)\b"):
    call(x, y)


def _xy(dtype=jnp.float64, n_out=None):
  t = ridge.sample_tasks(jax.random.key(7), batch=2, n_train=4, d=3,
                         n_out=n_out, dtype=dtype)
  return t.x, t.y


_ALL = {
    "gd": lambda x, y: ridge.gd(x, y, lam=0.5, eta=0.1, steps=2),
    "loss": lambda x, y: ridge.loss(jnp.zeros((2, 3), jnp.float64), x, y,
                                    lam=0.5),
    "solve": lambda x, y: ridge.solve(x, y, lam=0.5),
    "normal_equations": lambda x, y: ridge.normal_equations(x, y, lam=0.5),
}


@pytest.mark.parametrize("name", sorted(_ALL))
def test_integer_x_and_mixed_dtypes_raise(name):
  """Integer x truncated lam and eta to 0 (gd returned zeros); now refused."""
  x, y = _xy()
  with pytest.raises(TypeError, match=r"x must have a floating dtype, got int"):
    _ALL[name](x.astype(jnp.int32), y.astype(jnp.int32))
  with pytest.raises(TypeError, match=r"y has dtype float32 but x has dtype "
                     r"float64"):
    _ALL[name](x, y.astype(jnp.float32))
  with pytest.raises(TypeError, match=r"y has dtype int32"):
    _ALL[name](x, y.astype(jnp.int32))
  _ALL[name](x, y)  # the same call with matching floats is fine


def test_stability_limit_refuses_integer_x():
  x, _ = _xy()
  with pytest.raises(TypeError, match=r"x must have a floating dtype"):
    ridge.stability_limit(x.astype(jnp.int32), lam=0.1)


def test_gd_w0_dtype_and_steps_type():
  x, y = _xy()
  with pytest.raises(TypeError, match=r"w0 has dtype float32 but x has dtype "
                     r"float64"):
    ridge.gd(x, y, lam=0.1, eta=0.1, steps=2, w0=jnp.ones(3, jnp.float32))
  want = ridge.gd(x, y, lam=0.1, eta=0.1, steps=3)
  for steps in (np.int64(3), np.int32(3)):
    np.testing.assert_array_equal(
        ridge.gd(x, y, lam=0.1, eta=0.1, steps=steps), want)
  for steps in (3.0, "3", True, np.float64(3)):
    with pytest.raises(TypeError, match="steps"):
      ridge.gd(x, y, lam=0.1, eta=0.1, steps=steps)
  with pytest.raises(ValueError, match="steps must be an int >= 0, got -2"):
    ridge.gd(x, y, lam=0.1, eta=0.1, steps=np.int64(-2))


def test_loss_checks_w():
  x, y = _xy()  # x [2, 4, 3], vector y [2, 4]
  with pytest.raises(ValueError, match=r"w must have shape \(2, 3\).*got "
                     r"\(2, 3, 1\)"):
    ridge.loss(jnp.zeros((2, 3, 1)), x, y, lam=0.1)
  with pytest.raises(ValueError, match=r"w must have shape \(2, 3\).*got "
                     r"\(2, 4\)"):
    ridge.loss(jnp.zeros((2, 4)), x, y, lam=0.1)
  with pytest.raises(ValueError, match=r"w must have shape \(2, 3\).*got "
                     r"\(5, 3\)"):
    ridge.loss(jnp.zeros((5, 3)), x, y, lam=0.1)
  with pytest.raises(TypeError, match=r"w has dtype float32"):
    ridge.loss(jnp.zeros((2, 3), jnp.float32), x, y, lam=0.1)
  xm, ym = _xy(n_out=2)
  with pytest.raises(ValueError, match=r"w must have shape \(2, 3, 2\).*got "
                     r"\(2, 3\)"):
    ridge.loss(jnp.zeros((2, 3)), xm, ym, lam=0.1)
  # One w shared by the batch broadcasts, as before.
  w = jnp.asarray([0.5, -1.0, 2.0])
  shared = ridge.loss(w, x, y, lam=0.1)
  np.testing.assert_allclose(
      shared, [ridge.loss(w, x[b], y[b], lam=0.1) for b in range(2)],
      rtol=1e-15)


_REFERENCES = {
    "normal_equations": lambda x, y: ridge.normal_equations(x, y, lam=0.1),
    "gd": lambda x, y: ridge.gd(x, y, lam=0.1, eta=0.1, steps=2),
    "loss": lambda x, y: ridge.loss(x[:, 0], x, y, lam=0.1),
    "solve": lambda x, y: ridge.solve(x, y, lam=0.1),
    "stability_limit": lambda x, y: ridge.stability_limit(x, lam=0.1),
    "sample_tasks": lambda x, y: ridge.sample_tasks(
        jax.random.key(0), batch=2, n_train=3, d=3, x_cov=jnp.eye(3)),
}


@pytest.mark.parametrize("name", sorted(_REFERENCES))
def test_references_use_highest_precision(name):
  """Every matmul is HIGHEST: float32 at default precision runs in bf16/TF32
  on TPUs and Ampere+ GPUs, which would make the references inexact there."""
  x, y = _xy(jnp.float32)
  text = str(jax.make_jaxpr(_REFERENCES[name])(x, y))
  dots = text.count("dot_general[")
  assert dots > 0
  assert text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == dots


def test_sample_tasks_default_dtype():
  kw = dict(batch=1, n_train=2, d=2)
  t = ridge.sample_tasks(jax.random.key(0), **kw)
  assert {a.dtype for a in t} == {jnp.dtype(jnp.float64)}  # x64 in the tests
  with jax.enable_x64(False):
    t = ridge.sample_tasks(jax.random.key(0), **kw)
    assert {a.dtype for a in t} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("name", sorted(_ALL))
def test_no_examples_raise_instead_of_nan(name):
  """N = 0 divided by zero (NaN everywhere); now refused by every reference."""
  x, y = _xy()
  with pytest.raises(ValueError, match=r"x must hold N >= 1 examples.*"
                     r"\(2, 0, 3\)"):
    _ALL[name](x[:, :0], y[:, :0])
  with pytest.raises(ValueError, match=r"N >= 1"):
    ridge.stability_limit(x[:, :0], lam=0.1)


@pytest.mark.parametrize("name", sorted(_ALL))
def test_lam_of_the_wrong_shape_is_refused_the_same_way(name):
  """lam: a scalar or one per task (broadcasting to x's batch [2]); before,
  solve returned a silently enlarged batch and gd failed inside its scan."""
  x, y = _xy()
  call = {
      "gd": lambda lam: ridge.gd(x, y, lam=lam, eta=0.1, steps=2),
      "loss": lambda lam: ridge.loss(jnp.zeros((2, 3)), x, y, lam=lam),
      "solve": lambda lam: ridge.solve(x, y, lam=lam),
      "normal_equations": lambda lam: ridge.normal_equations(x, y, lam=lam),
  }[name]
  for bad in (jnp.full(5, 0.1), jnp.full((3, 2), 0.1), jnp.full((2, 1), 0.1)):
    with pytest.raises(ValueError, match=f"{name}: lam must be a scalar or "
                       r"broadcast to the batch shape \(2,\) of x.*got shape "
                       + re.escape(str(bad.shape))):
      call(bad)
  # One lam per task is the same as each task alone.
  task_1 = (lambda r: r[:, 1]) if name == "gd" else (lambda r: r[1])
  per_task = jax.tree.leaves(call(jnp.asarray([0.1, 0.7])))[0]
  alone = jax.tree.leaves(call(0.7))[0]
  np.testing.assert_allclose(task_1(per_task), task_1(alone), rtol=1e-12)


def test_gd_refuses_negative_lam_and_nonpositive_eta():
  x, y = _xy()
  for lam, eta, message in ((-10.0, 0.1, "gd: lam must be >= 0, got -10"),
                            (0.1, 0.0, "gd: eta must be > 0, got 0"),
                            (0.1, -0.5, "gd: eta must be > 0, got -0.5"),
                            (0.1, jnp.asarray([0.1, -0.1]),
                             r"eta must be > 0, got -0.1 in eta\(2,\)"),
                            (jnp.asarray([0.1, -1.0]), 0.1,
                             "lam must be >= 0, got -1"),
                            (0.1, float("nan"), "eta must be > 0, got nan")):
    with pytest.raises(ValueError, match=message):
      ridge.gd(x, y, lam=lam, eta=eta, steps=2)


def test_solve_refuses_negative_lam_and_computes_the_formula_when_traced():
  """lam = -10 gave zeros (the eigenvalue cut-off assumed A >= 0). A concrete
  negative lam is refused; a traced one gets (X^T X/N + lam I)^{-1} X^T y/N,
  the stationary point of the (then unbounded) objective, as documented."""
  x, y = _xy()
  with pytest.raises(ValueError, match="solve: lam must be >= 0, got -10"):
    ridge.solve(x, y, lam=-10.0)
  w = jax.jit(lambda lam: ridge.solve(x, y, lam=lam))(-10.0)
  for b in range(2):
    xb, yb = np.asarray(x[b]), np.asarray(y[b])
    want = np.linalg.solve(xb.T @ xb / 4 - 10 * np.eye(3), xb.T @ yb / 4)
    assert rel_err(w[b], want) < 1e-12
    assert np.linalg.norm(want) > 0


@pytest.mark.parametrize("n_train, d", [(9, 4), (3, 5), (20, 1)])
def test_safe_alpha_is_one_over_the_frobenius_norm_and_inside_the_limit(
    n_train, d):
  """Against numpy's ||X^T X / N + lam I||_F, per task and per-task lam; and
  alpha * lambda_max(A) in [d^-1/2, 1], so GD with it converges."""
  t = ridge.sample_tasks(jax.random.key(n_train), batch=3, n_train=n_train,
                         d=d, dtype=jnp.float64)
  for lam in (0.0, 0.3, jnp.asarray([0.0, 0.1, 2.0])):
    alpha = ridge.safe_alpha(t.x, lam=lam)
    assert alpha.shape == (3,) and alpha.dtype == jnp.float64
    lams = np.broadcast_to(np.asarray(lam), (3,))
    for b in range(3):
      x = np.asarray(t.x[b])
      a = x.T @ x / n_train + lams[b] * np.eye(d)
      assert rel_err(alpha[b], 1 / np.linalg.norm(a, "fro")) < RTOL
      top = np.linalg.eigvalsh(a)[-1]
      assert d ** -0.5 * (1 - 1e-12) <= alpha[b] * top <= 1 + 1e-12
    assert np.all(alpha < ridge.stability_limit(t.x, lam=lam))
  # Traced lam (one compile), float32 in float32.
  got = jax.jit(lambda lam: ridge.safe_alpha(t.x, lam=lam))(0.3)
  assert rel_err(got, ridge.safe_alpha(t.x, lam=0.3)) < RTOL
  x32 = t.x.astype(jnp.float32)
  assert ridge.safe_alpha(x32, lam=0.3).dtype == jnp.float32


def test_safe_alpha_refuses_what_the_other_references_refuse():
  x, _ = _xy()
  for bad, error, message in (
      (lambda: ridge.safe_alpha(x, lam=-0.1), ValueError,
       "safe_alpha: lam must be >= 0, got -0.1"),
      (lambda: ridge.safe_alpha(x[:, :0], lam=0.1), ValueError, "N >= 1"),
      (lambda: ridge.safe_alpha(jnp.ones(3), lam=0.1), ValueError,
       r"\[\.\.\., N, d\]"),
      (lambda: ridge.safe_alpha(x, lam=jnp.full(5, 0.1)), ValueError,
       r"safe_alpha: lam must be a scalar or broadcast to the batch shape"),
      (lambda: ridge.safe_alpha(jnp.ones((4, 3), jnp.int32), lam=0.1),
       TypeError, "floating")):
    with pytest.raises(error, match=message):
      bad()


# --- one refusal policy (elsa._validate) -------------------------------------

_KEY = jax.random.key(0)
_TASKS = dict(batch=2, n_train=3, d=2)
_NOT_PD = jnp.asarray([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3 and -1
_ASYMMETRIC = jnp.asarray([[1.0, 0.5], [0.0, 1.0]])


@pytest.mark.parametrize("call, error, message", [
    (lambda x, y: ridge.gd(x, y, lam=0.1, eta=jnp.inf, steps=2), ValueError,
     "gd: eta must be > 0, got inf; only finite values are allowed"),
    (lambda x, y: ridge.gd(x, y, lam=0.1, eta=jnp.asarray([0.1, -jnp.inf]),
                           steps=2), ValueError,
     r"gd: eta must be > 0, got -inf in eta\(2,\); only finite"),
    (lambda x, y: ridge.gd(x, y, lam=np.inf, eta=0.1, steps=2), ValueError,
     "gd: lam must be >= 0, got inf; only finite"),
    (lambda x, y: ridge.gd(x, y, lam=-1.0, eta=0.1, steps=2), ValueError,
     "gd: lam must be >= 0, got -1"),
    (lambda x, y: ridge.gd(x, y, lam="0.1", eta=0.1, steps=2), TypeError,
     "gd: lam must be a real number, got '0.1'"),
    (lambda x, y: ridge.gd(x, y, lam=0.1, eta=0.1, steps=True), TypeError,
     "gd: steps must be an int >= 0, got True"),
    (lambda x, y: ridge.solve(x, y, lam=jnp.inf), ValueError,
     "solve: lam must be >= 0, got inf; only finite"),
    (lambda x, y: ridge.solve(jnp.ones((6, 0)), jnp.ones(6), lam=0.1),
     ValueError, r"solve: x must hold d >= 1 features .*got shape \(6, 0\)"),
    (lambda x, y: ridge.gd(x[..., :0], y, lam=0.1, eta=0.1, steps=1),
     ValueError, r"gd: x must hold d >= 1 features"),
    (lambda x, y: ridge.safe_alpha(x, lam=np.nan), ValueError,
     "safe_alpha: lam must be >= 0, got nan; only finite"),
    (lambda x, y: ridge.stability_limit(x, lam=-0.5), ValueError,
     "stability_limit: lam must be >= 0, got -0.5"),
    (lambda x, y: ridge.sample_tasks(_KEY, **{**_TASKS, "n_train": 0}),
     ValueError, "sample_tasks: n_train must be an int >= 1, got 0"),
    (lambda x, y: ridge.sample_tasks(_KEY, **{**_TASKS, "d": 0}),
     ValueError, "sample_tasks: d must be an int >= 1, got 0"),
    (lambda x, y: ridge.sample_tasks(_KEY, **{**_TASKS, "batch": -1}),
     ValueError, "sample_tasks: batch must be an int >= 1, got -1"),
    (lambda x, y: ridge.sample_tasks(_KEY, **{**_TASKS, "batch": 2.0}),
     TypeError, "sample_tasks: batch must be an int >= 1, got 2.0"),
    (lambda x, y: ridge.sample_tasks(_KEY, **{**_TASKS, "n_query": -1}),
     ValueError, "sample_tasks: n_query must be an int >= 0, got -1"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, n_out=0),
     ValueError, "sample_tasks: n_out must be an int >= 1, got 0"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, noise=-1.0),
     ValueError, "sample_tasks: noise must be >= 0, got -1"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, noise=np.nan),
     ValueError, "sample_tasks: noise must be >= 0, got nan; only finite"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, x_scale=np.inf),
     ValueError, "sample_tasks: x_scale must be finite, got inf"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, w_scale=-np.inf),
     ValueError, "sample_tasks: w_scale must be finite, got -inf"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, x_cov=_NOT_PD),
     ValueError, "sample_tasks: x_cov must be symmetric positive definite.*"
     "smallest eigenvalue -1"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, x_cov=jnp.eye(3)),
     ValueError, r"sample_tasks: x_cov must have shape \(2, 2\) for d=2, got "
     r"\(3, 3\)"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, x_cov=_ASYMMETRIC),
     ValueError, "sample_tasks: x_cov must be symmetric"),
    (lambda x, y: ridge.sample_tasks(_KEY, **_TASKS, dtype=jnp.int32),
     TypeError, "sample_tasks: dtype must be a floating dtype"),
])
def test_refusal_policy(call, error, message):
  """Every entry point refuses the same things the same way: negative lam,
  non-positive or non-finite steps and strengths, zero sizes, bools and
  floats as sizes, integer dtypes; the message names the function and the
  argument and says what is allowed."""
  with pytest.raises(error, match=message):
    call(*_xy())


@pytest.mark.parametrize("call, message", [
    (lambda: ridge.sample_tasks(_KEY, batch=100, n_train=100, d=10),
     "sample_tasks: batch=100, n_train=100, d=10, n_query=1, n_out=None need "
     "at least"),
    (lambda: ridge.gd(*_xy(), lam=0.1, eta=0.1, steps=10**5),
     r"gd: steps=100000, x.shape=\(2, 4, 3\), y.shape=\(2, 4\) need at least"),
    (lambda: ridge.solve(jnp.ones((1, 2, 100)), jnp.ones((1, 2)), lam=0.1),
     r"solve: x.shape=\(1, 2, 100\) need at least"),
    (lambda: ridge.normal_equations(jnp.ones((1, 2, 100)), jnp.ones((1, 2)),
                                    lam=0.1),
     r"normal_equations: x.shape=\(1, 2, 100\) need at least"),
    (lambda: ridge.safe_alpha(jnp.ones((1, 2, 100)), lam=0.1),
     r"safe_alpha: x.shape=\(1, 2, 100\) need at least"),
    (lambda: ridge.stability_limit(jnp.ones((1, 2, 100)), lam=0.1),
     r"stability_limit: x.shape=\(1, 2, 100\) need at least"),
])
def test_sizes_that_cannot_fit_are_refused_before_allocation(monkeypatch, call,
                                                              message):
  """Against a device memory of 64 KiB (monkeypatched, so that a regression
  fails here instead of allocating): the outputs (the d x d normal matrix of
  each task, every GD iterate, the tasks) are counted before anything is
  allocated, and the fields that set them are named."""
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**16)
  with pytest.raises(ValueError, match=message + r" .* GiB, more than the "
                     r"6.1e-05 GiB the devices of this process hold"):
    call()
  # With room, the same call passes (traced only: nothing to compile).
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**40)
  jax.eval_shape(call)


def test_a_huge_request_is_refused_not_aborted():
  """Issue 24: sample_tasks(batch=10**6, n_train=10**6, d=10**3) killed the
  Python process inside XLA (a check failure). Against the real memory of
  this machine, in a subprocess so that a regression fails the test rather
  than the test run."""
  code = ("import jax, elsa\n"
          "try:\n"
          "  elsa.ridge.sample_tasks(jax.random.key(0), batch=10**6, "
          "n_train=10**6, d=10**3)\n"
          "except ValueError as e:\n"
          "  print(e)\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-c", code], cwd=root,
                        env={**os.environ, "PYTHONPATH": root},
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert re.match(r"sample_tasks: batch=1000000, n_train=1000000, d=1000, "
                  r"n_query=1, n_out=None need at least 3.7\de\+06 GiB, more "
                  r"than the .* GiB the devices of this process hold",
                  done.stdout)


class _Device:
  def __init__(self, platform, limit=None):
    self.platform, self.limit = platform, limit

  def memory_stats(self):
    if self.limit is None:
      raise NotImplementedError
    return {"bytes_limit": self.limit}


def test_memory_is_that_of_the_addressable_devices(monkeypatch):
  """On CPU: host RAM, counted once however many CPU devices there are;
  accelerators: their limits summed (only jax.local_devices is asked)."""
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert jax.local_devices()[0].platform == "cpu"
  assert _validate.memory_bytes() == ram
  uncached = _validate.memory_bytes.__wrapped__
  monkeypatch.setattr(jax, "local_devices", lambda: [_Device("cpu")] * 4)
  assert uncached() == ram
  monkeypatch.setattr(jax, "local_devices",
                      lambda: [_Device("gpu", 10), _Device("gpu", 20)])
  assert uncached() == 30
  # A device without a limit shares host RAM.
  monkeypatch.setattr(jax, "local_devices",
                      lambda: [_Device("tpu", 10), _Device("metal")])
  assert uncached() == 10 + ram
  assert _validate.array_bytes(jnp.float32, (10**6, 10**6, 10**3), (3,)) == (
      4 * (10**15 + 3))
