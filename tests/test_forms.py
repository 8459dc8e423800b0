"""The GD input forms: L stacked ELSA layers hold exactly the L iterates of ridge GD.

Reference: :func:`elsa.ridge.gd` (itself checked against a numpy loop in
test_ridge.py) on fresh random tasks. Relative error of a trajectory: the
largest absolute deviation over all steps, tasks and entries, divided by the
largest absolute entry of the reference trajectory.
"""

import dataclasses
import functools
import itertools
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elsa
from elsa import forms, ridge
from helpers import rel_err

FORMS = [forms.Designed, forms.Natural]
F64_RTOL = 1e-10
# float32 bound at depth 200, eta = 0.9 * stability limit: the worst relative
# error measured over these SHAPES, lam in {0, 0.3}, 3 seeds, both forms, was
# 7.0e-6, as accurate as float32 GD itself (docs/guides/forms.md);
# asserted with a margin.
F32_RTOL = 1e-4

# (batch, N, d, Q, k): N > d, N < d, Q = 0 with n_out = 2, two batch axes, 1x1.
SHAPES = [((), 8, 3, 2, 1), ((2,), 3, 5, 2, 1), ((2,), 6, 4, 0, 2),
          ((2, 3), 5, 2, 3, 2), ((), 1, 1, 1, 1)]


def task(seed, batch, n_train, d, n_query, n_out, dtype):
  """Fresh random task with arbitrary batch axes; y is [..., N] when n_out == 1."""
  size = int(np.prod(batch))
  t = ridge.sample_tasks(jax.random.key(seed), batch=size, n_train=n_train,
                         d=d, n_query=n_query,
                         n_out=None if n_out == 1 else n_out, dtype=dtype)
  shape = lambda a: a.reshape(*batch, *a.shape[1:])
  return shape(t.x), shape(t.y), shape(t.x_query)


def eta_for(x, lam, fraction=0.9):
  """``fraction`` of the smallest stability limit over the batch, a float."""
  limit = ridge.stability_limit(jnp.asarray(x, jnp.float64), lam=lam)
  return fraction * float(np.min(limit))


def predictions(x_query, ws):
  """``x_q^T w_t`` for every step: ``[T, ..., Q(, k)]``."""
  return jnp.einsum("...qd,t...d->t...q" if ws.ndim == x_query.ndim else
                    "...qd,t...dk->t...qk", x_query, ws)


@functools.lru_cache(maxsize=None)
def runner(form_cls, n_train, d, n_query, n_out, depth):
  """A jitted (x, y, x_query, lam, eta) -> (all w, all predictions) for one form."""
  form = form_cls(n_train=n_train, d=d, n_query=n_query, n_out=n_out)

  @jax.jit
  def run(x, y, x_query, lam, eta):
    params = form.gd_params(lam=lam, eta=eta, depth=depth, dtype=x.dtype)
    hs = elsa.elsa_stack(params, form.encode(x, y, x_query=x_query),
                         return_all=True)
    return form.decode_w(hs), form.decode_pred(hs)

  return run


@pytest.mark.parametrize("lam,schedule", [(0.0, False), (0.3, True)])
@pytest.mark.parametrize("batch,n_train,d,n_query,n_out", SHAPES)
@pytest.mark.parametrize("form_cls", FORMS)
def test_every_layer_is_one_gd_step(form_cls, batch, n_train, d, n_query,
                                    n_out, lam, schedule):
  depth = 12
  seed = zlib.crc32(repr((form_cls.__name__, batch, lam)).encode()) % 2**31
  x, y, x_query = task(seed, batch, n_train, d, n_query, n_out, jnp.float64)
  eta = eta_for(x, lam)
  if schedule:
    eta = eta * jax.random.uniform(jax.random.key(seed), (depth,),
                                   jnp.float64, 0.1, 1.0)
  eta = jnp.asarray(eta, jnp.float64)
  run = runner(form_cls, n_train, d, n_query, n_out, depth)
  w_all, pred_all = run(x, y, x_query, jnp.asarray(lam, jnp.float64), eta)
  want = ridge.gd(x, y, lam=lam, eta=eta, steps=depth)
  assert w_all.shape == want.shape == (depth + 1, *batch, d,
                                       *((n_out,) if n_out > 1 else ()))
  assert w_all.dtype == jnp.float64
  assert rel_err(w_all, want) < F64_RTOL
  assert pred_all.shape == (depth + 1, *batch, n_query,
                            *((n_out,) if n_out > 1 else ()))
  assert rel_err(pred_all, predictions(x_query, want)) < F64_RTOL
  assert np.max(np.abs(np.asarray(want[-1]))) > 1e-8  # not all zeros


@pytest.mark.parametrize("form_cls", FORMS)
def test_depth_200_float64_and_float32(form_cls):
  # float64 with lam > 0; float32 with lam = 0, the worst case measured (the
  # slowest directions never decay), on the largest measured shape.
  depth = 200
  cases = [(jnp.float64, F64_RTOL, 0.3, SHAPES[3]),
           (jnp.float32, F32_RTOL, 0.0, ((4,), 40, 8, 4, 3))]
  for dtype, rtol, lam, (batch, n_train, d, n_query, n_out) in cases:
    x, y, x_query = task(7, batch, n_train, d, n_query, n_out, dtype)
    eta = eta_for(x, lam)
    run = runner(form_cls, n_train, d, n_query, n_out, depth)
    w_all, pred_all = run(x, y, x_query, jnp.asarray(lam, dtype),
                          jnp.asarray(eta, dtype))
    assert w_all.dtype == dtype
    up = lambda a: jnp.asarray(a, jnp.float64)
    want = ridge.gd(up(x), up(y), lam=lam, eta=eta, steps=depth)
    assert rel_err(w_all, want) < rtol
    assert rel_err(pred_all, predictions(up(x_query), want)) < rtol


@pytest.mark.parametrize("lam", [0.0, 0.5])
@pytest.mark.parametrize("form_cls", FORMS)
def test_iterates_approach_the_solution(form_cls, lam):
  depth = 60
  batch, n_train, d, n_query, n_out = SHAPES[1]  # N < d: min-norm at lam=0
  x, y, x_query = task(3, batch, n_train, d, n_query, n_out, jnp.float64)
  eta = eta_for(x, lam, fraction=0.9)
  run = runner(form_cls, n_train, d, n_query, n_out, depth)
  w_all, _ = run(x, y, x_query, jnp.float64(lam), jnp.float64(eta))
  w_star = np.asarray(ridge.solve(x, y, lam=lam))
  # GD from 0 contracts the error by rho = max |1 - eta * mu| over the nonzero
  # eigenvalues mu of A = X^T X / N + lam I (the error stays in their span).
  a, _ = ridge.normal_equations(x, y, lam=lam)
  for b in range(batch[0]):
    mu = np.linalg.eigvalsh(np.asarray(a[b]))
    mu = mu[mu > 1e-10 * mu[-1]]
    rho = np.max(np.abs(1 - eta * mu))
    err = np.linalg.norm(np.asarray(w_all[:, b]) - w_star[b], axis=-1)
    assert rho < 1
    assert err[-1] <= rho**depth * err[0] * (1 + 1e-8) + 1e-12
    assert np.all(np.diff(err) <= 1e-12) and err[-1] < 0.1 * err[0]


def test_natural_after_layer_one_is_a_designed_state():
  batch, n_train, d, n_query, _ = SHAPES[1]
  x, y, x_query = task(11, batch, n_train, d, n_query, 1, jnp.float64)
  lam, eta = jnp.float64(0.2), jnp.float64(0.3)
  natural = forms.Natural(n_train=n_train, d=d, n_query=n_query)
  designed = forms.Designed(n_train=n_train, d=d, n_query=n_query)
  h_nat = natural.encode(x, y, x_query=x_query)
  h_des = designed.encode(x, y, x_query=x_query)
  # The inputs differ only where the queries' x sit.
  q, xc, zc = natural.query_rows, natural.x_cols, natural.z_cols
  np.testing.assert_array_equal(h_nat[..., q, xc], x_query)
  np.testing.assert_array_equal(h_des[..., q, zc], x_query)
  np.testing.assert_array_equal(h_nat[..., q, zc], 0)
  np.testing.assert_array_equal(h_des[..., q, xc], 0)
  one = lambda form, h: elsa.elsa_stack(
      form.gd_params(lam=lam, eta=eta, depth=1), h)
  assert rel_err(one(natural, h_nat), one(designed, h_des)) < 1e-14


@pytest.mark.parametrize("shared_w0", [False, True])
def test_designed_from_nonzero_w0(shared_w0):
  depth, lam = 15, 0.1
  batch, n_train, d, n_query, n_out = SHAPES[3]
  x, y, x_query = task(5, batch, n_train, d, n_query, n_out, jnp.float64)
  w0_batch = () if shared_w0 else batch  # a shared w0 broadcasts over tasks
  w0 = jax.random.normal(jax.random.key(9), (*w0_batch, d, n_out), jnp.float64)
  eta = eta_for(x, lam)
  form = forms.Designed(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
  h0 = form.encode(x, y, x_query=x_query, w0=w0)
  hs = elsa.elsa_stack(form.gd_params(lam=lam, eta=eta, depth=depth,
                                      dtype=jnp.float64), h0, return_all=True)
  want = ridge.gd(x, y, lam=lam, eta=eta, steps=depth, w0=w0)
  assert rel_err(form.decode_w(hs), want) < F64_RTOL
  assert rel_err(form.decode_pred(hs), predictions(x_query, want)) < F64_RTOL
  assert rel_err(form.decode_train_pred(hs), predictions(x, want)) < F64_RTOL
  np.testing.assert_array_equal(form.decode_w(h0),
                                np.broadcast_to(w0, (*batch, d, n_out)))


@pytest.mark.parametrize("form_cls", FORMS)
def test_jit_traced_lam_eta_compiles_once(form_cls):
  depth = 8
  batch, n_train, d, n_query, _ = SHAPES[0]
  x, y, x_query = task(2, batch, n_train, d, n_query, 1, jnp.float64)
  form = form_cls(n_train=n_train, d=d, n_query=n_query)
  h0 = form.encode(x, y, x_query=x_query)
  chex.clear_trace_counter()  # counts are kept per function body, across tests

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(lam, eta):
    params = form.gd_params(lam=lam, eta=eta, depth=depth)
    return form.decode_w(elsa.elsa_stack(params, h0, return_all=True))

  for lam, eta in ((0.0, 0.1), (0.3, 0.2), (1.0, 0.05)):
    got = run(jnp.float64(lam), jnp.float64(eta))
    want = ridge.gd(x, y, lam=lam, eta=eta, steps=depth)
    assert rel_err(got, want) < F64_RTOL


@pytest.mark.parametrize("form_cls", FORMS)
def test_vmap_over_a_lam_eta_grid(form_cls):
  depth = 10
  batch, n_train, d, n_query, n_out = SHAPES[3]
  x, y, x_query = task(4, batch, n_train, d, n_query, n_out, jnp.float64)
  form = form_cls(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
  h0 = form.encode(x, y, x_query=x_query)
  lams, etas = jnp.meshgrid(jnp.array([0.0, 0.1, 1.0]),
                            jnp.array([0.05, 0.2]), indexing="ij")
  lams, etas = lams.ravel(), etas.ravel()
  chex.clear_trace_counter()  # counts are kept per function body, across tests

  @jax.jit
  @chex.assert_max_traces(n=1)
  def sweep(lams, etas):
    def one(lam, eta):
      params = form.gd_params(lam=lam, eta=eta, depth=depth)
      return form.decode_w(elsa.elsa_stack(params, h0, return_all=True))

    return jax.vmap(one)(lams, etas)

  got = sweep(lams, etas)
  sweep(2 * lams, etas)  # new values, same shapes: no new trace
  for i, (lam, eta) in enumerate(zip(lams, etas)):
    want = ridge.gd(x, y, lam=lam, eta=eta, steps=depth)
    assert rel_err(got[i], want) < F64_RTOL


def test_every_form_compiles_to_its_layout_at_every_small_shape():
  # The compiler's choices (rows, column shares, moves, merges) give each
  # form's tokens, components per layer and set-up layers, and fit its
  # columns, at all 192 shapes N <= 6, d <= 4, Q <= 3, n_out <= 2.
  for n_train, d, n_query, n_out in itertools.product(
      range(1, 7), range(1, 5), range(4), (1, 2)):
    for form_cls, C, setup in ((forms.Designed, 2, 0),
                               (forms.Natural, 3 if n_query else 2, 0),
                               (forms.Newton, 3, 2)):
      form = form_cls(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
      compiled = form.compiled
      assert (compiled.m, compiled.width, compiled.setup_layers) == (
          form.m, C, setup), (form, repr(compiled))
      cols = form._columns()  # distinct form columns, one per compiled one
      assert len(set(cols)) == len(cols) == compiled.n <= form.n


@pytest.mark.parametrize("form_cls", FORMS)
@pytest.mark.parametrize("n_train,d,n_query,n_out", [
    (8, 3, 2, 1), (4, 2, 2, 1), (2, 4, 2, 3), (6, 4, 0, 2), (1, 1, 1, 1)])
def test_forms_are_their_compiled_programs(form_cls, n_train, d, n_query,
                                           n_out):
  # The compiled program has the form's tokens, no set-up layer and the
  # form's components per layer, also where the queries are as many as the
  # w-rows (Q = d: rows not shared with the pinned tokens) or the examples
  # (N = Q: the queries move, not the examples); without queries it drops
  # the empty z columns. Its stack, run on its own columns, gives the form's
  # states in the form's columns at every layer.
  form = form_cls(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
  compiled = form.compiled
  C = 2 if form_cls is forms.Designed or not n_query else 3
  assert (compiled.m, compiled.n, compiled.width, compiled.setup_layers) == (
      form.m, form.n - (0 if n_query else d), C, 0)
  assert compiled.layout["X"] == (list(range(n_train)), list(range(d)))
  x, y, xq = task(3, (2,), n_train, d, n_query, n_out, jnp.float64)
  lam, L = 0.1, 6
  eta = eta_for(x, lam, fraction=0.3)
  hs = elsa.elsa_stack(form.gd_params(lam=lam, eta=eta, depth=L),
                       form.encode(x, y, x_query=xq), return_all=True)
  blocks = dict(X=x, y=y.reshape(2, n_train, n_out))
  if n_query:
    blocks["Xq"] = xq
  if form_cls is forms.Designed:
    zeros = lambda rows: np.zeros((2, rows, n_out))
    blocks.update(w=zeros(d), Xw=zeros(n_train),
                  **({"p": zeros(n_query)} if n_query else {}))
  own = elsa.elsa_stack(compiled.params(lam=lam, eta=eta, loops=L),
                        compiled.encode(**blocks), return_all=True)
  np.testing.assert_allclose(hs[..., form._columns()], own, rtol=0,
                             atol=1e-13)
  assert not np.any(np.delete(np.asarray(hs), form._columns(), axis=-1))


@pytest.mark.parametrize("form_cls", FORMS)
def test_layout_and_params_shapes(form_cls):
  n_train, d, n_query, n_out = 5, 3, 2, 2
  form = form_cls(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
  assert (form.m, form.n) == (n_train + n_query + d, 2 * d + 2 * n_out)
  params = form.gd_params(lam=0.1, eta=0.2, depth=4)
  components = 2 if form_cls is forms.Designed else 3
  assert params.w1.shape[:2] == (4, components)
  assert (params.m, params.n, params.v) == (form.m, form.n, form.n)
  # Python numbers: JAX's default float, float64 here (x64 is on in tests).
  assert params.w1.dtype == jnp.float64
  assert form.gd_params(lam=jnp.float64(0.1), eta=0.2,
                        depth=1).w1.dtype == jnp.float64
  assert form.gd_params(lam=0.1, eta=0.2, depth=2,
                        dtype=jnp.float64).b3.dtype == jnp.float64


@pytest.mark.parametrize("form_cls", FORMS)
def test_scalar_targets_and_dtype_follow_x(form_cls):
  batch, n_train, d, n_query, _ = SHAPES[1]
  x, y, x_query = (a.astype(jnp.float32) for a in
                   task(6, batch, n_train, d, n_query, 1, jnp.float64))
  form = form_cls(n_train=n_train, d=d, n_query=n_query)
  h_vec = form.encode(x, y, x_query=x_query)
  h_col = form.encode(x, y[..., None], x_query=x_query)
  assert h_vec.dtype == jnp.float32
  np.testing.assert_array_equal(h_vec, h_col)
  params = form.gd_params(lam=0.1, eta=0.2, depth=3, dtype=jnp.float32)
  hs = elsa.elsa_stack(params, h_vec, return_all=True)
  assert form.decode_w(hs).shape == (4, *batch, d)
  assert form.decode_pred(hs).shape == (4, *batch, n_query)
  with pytest.raises(TypeError, match="dtype"):
    elsa.elsa_stack(form.gd_params(lam=0.1, eta=0.2, depth=3,
                                   dtype=jnp.float64), h_vec)


def bad_calls(form_cls):
  N, d, Q, k = 4, 3, 2, 1
  form = form_cls(n_train=N, d=d, n_query=Q, n_out=k)
  x = jnp.zeros((2, N, d), jnp.float32)
  y = jnp.zeros((2, N), jnp.float32)
  xq = jnp.zeros((2, Q, d), jnp.float32)
  return [
      (ValueError, "y", lambda: form.encode(x, y[:, 1:], x_query=xq)),
      (ValueError, "x", lambda: form.encode(x[..., 1:], y, x_query=xq)),
      (ValueError, "x", lambda: form.encode(x[:, 1:], y[:, 1:], x_query=xq)),
      (ValueError, "x_query", lambda: form.encode(x, y, x_query=xq[:, 1:])),
      (ValueError, "x_query", lambda: form.encode(x, y, x_query=xq[..., 1:])),
      (ValueError, "x_query", lambda: form.encode(
          x, y, x_query=jnp.zeros((3, Q, d), jnp.float32))),
      (ValueError, "x_query", lambda: form.encode(x, y)),
      (ValueError, "y", lambda: form.encode(x, jnp.zeros((2, N, 2), jnp.float32),
                                            x_query=xq)),
      (TypeError, "y", lambda: form.encode(x, jnp.zeros((2, N), jnp.float64),
                                           x_query=xq)),
      (TypeError, "x", lambda: form.encode(jnp.zeros((2, N, d), jnp.int32), y,
                                           x_query=xq)),
      (ValueError, "depth", lambda: form.gd_params(lam=0.1, eta=0.1, depth=0)),
      (ValueError, "eta", lambda: form.gd_params(lam=0.1, eta=jnp.ones(3),
                                                 depth=4)),
      (ValueError, "lam", lambda: form.gd_params(lam=jnp.ones(2), eta=0.1,
                                                 depth=4)),
      (ValueError, "h", lambda: form.decode_w(jnp.zeros((form.m + 1, form.n)))),
      (ValueError, "n_train", lambda: form_cls(n_train=0, d=d)),
      (ValueError, "n_out", lambda: form_cls(n_train=N, d=d, n_out=0)),
  ]


@pytest.mark.parametrize("form_cls", FORMS)
def test_bad_arguments_raise(form_cls):
  for error, name, call in bad_calls(form_cls):
    with pytest.raises(error, match=rf"\b{name} (must|has|is)\b"):
      call()


def test_bad_w0():
  N, d, Q = 4, 3, 2
  x, y, xq = jnp.zeros((2, N, d)), jnp.zeros((2, N)), jnp.zeros((2, Q, d))
  with pytest.raises(ValueError, match="w0"):
    forms.Natural(n_train=N, d=d, n_query=Q).encode(x, y, x_query=xq,
                                                     w0=jnp.zeros((2, d)))
  with pytest.raises(ValueError, match="w0"):
    forms.Designed(n_train=N, d=d, n_query=Q).encode(x, y, x_query=xq,
                                                      w0=jnp.zeros((2, d + 1)))


def test_building_blocks_take_python_numbers():
  # Each block with Python numbers equals the same block with float64 arrays
  # (JAX's default float under x64), and the blocks compose to gd_params.
  f64 = lambda v: jnp.asarray(v, jnp.float64)
  for form_cls in FORMS:
    form = form_cls(n_train=5, d=2, n_query=2)
    for name, kwargs in (("decayed_skip", dict(lam=0.1, eta=0.2)),
                         ("gradient_head", dict(eta=0.2)),
                         ("gd_layer", dict(lam=0.1, eta=0.2)),
                         ("gd_layers", dict(lam=0.1, etas=[0.2, 0.3]))):
      got = getattr(form, name)(**kwargs)
      want = getattr(form, name)(**{k: f64(v) for k, v in kwargs.items()})
      assert got.w1.dtype == elsa.attention.float_dtype() == jnp.float64
      chex.assert_trees_all_equal(got, want)
    f32 = form.gd_layer(lam=0.1, eta=0.2, dtype=jnp.float32)
    assert all(leaf.dtype == jnp.float32 for leaf in f32)
    with pytest.raises(ValueError, match="etas"):
      form.gd_layers(lam=0.1, etas=0.2)
    with pytest.raises(ValueError, match="lam must be a scalar"):
      form.decayed_skip(lam=[0.1, 0.2], eta=0.2)
  natural = forms.Natural(n_train=5, d=2, n_query=2)
  first = natural.first_layer(lam=0.1, eta=0.2)
  stacked = natural.gd_params(lam=0.1, eta=0.2, depth=1)
  for a, b in zip(first, stacked):  # eager vs jitted eta / N: 1 ulp
    np.testing.assert_allclose(a, b[0], rtol=1e-15, atol=0)


def test_natural_move_queries_moves_x_to_z_on_query_rows_only():
  form = forms.Natural(n_train=3, d=2, n_query=2, n_out=2)
  h = jax.random.normal(jax.random.key(0), (form.m, form.n), jnp.float64)
  got = elsa.elsa(form.move_queries(dtype=jnp.float64), h)
  want = np.zeros((form.m, form.n))
  q = form.query_rows
  want[q, form.z_cols] = h[q, form.x_cols]
  want[q, form.x_cols] = -h[q, form.x_cols]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
  assert form.move_queries().w2.dtype == jnp.float64  # default float


def test_w0_with_d_1_and_one_output():
  # [d, k] = [1, 1] is a w0 of shape [d, k], not [..., d] to be expanded.
  form = forms.Designed(n_train=3, d=1, n_query=1)
  x, y, xq = jnp.ones((3, 1)), jnp.ones(3), jnp.ones((1, 1))
  h_dk = form.encode(x, y, x_query=xq, w0=jnp.full((1, 1), 0.5))
  h_d = form.encode(x, y, x_query=xq, w0=jnp.full((1,), 0.5))
  np.testing.assert_array_equal(h_dk, h_d)
  np.testing.assert_array_equal(form.decode_w(h_dk), [0.5])
  batched = forms.Designed(n_train=3, d=1, n_query=1)
  hb = batched.encode(jnp.ones((4, 3, 1)), jnp.ones((4, 3)),
                      x_query=jnp.ones((4, 1, 1)), w0=jnp.arange(4.)[:, None])
  np.testing.assert_array_equal(batched.decode_w(hb), jnp.arange(4.)[:, None])
  # Errors report the shape the caller passed, not the expanded one.
  form3 = forms.Designed(n_train=4, d=3, n_query=2)
  x, y, xq = jnp.zeros((2, 4, 3)), jnp.zeros((2, 4)), jnp.zeros((2, 2, 3))
  with pytest.raises(ValueError, match=r"w0 .*got \(5, 3\)"):
    form3.encode(x, y, x_query=xq, w0=jnp.zeros((5, 3)))


@pytest.mark.parametrize("batch,n_train,d,n_query,n_out",
                         [SHAPES[0], SHAPES[2]])  # with queries; Q = 0, k = 2
@pytest.mark.parametrize("form_cls", FORMS)
def test_basis_with_coefficients_is_gd_params(form_cls, batch, n_train, d,
                                              n_query, n_out):
  """gd_basis scaled by gd_coefficients: the same states as gd_params, and GD."""
  depth = 5
  form = form_cls(n_train=n_train, d=d, n_query=n_query, n_out=n_out)
  x, y, x_query = task(zlib.crc32(repr(batch).encode()) + 7, batch, n_train,
                       d, n_query, n_out, jnp.float64)
  lam = 0.3
  etas = eta_for(x, lam) * jnp.linspace(0.5, 1.0, depth)  # a schedule
  h0 = form.encode(x, y, x_query=x_query)
  basis = form.gd_basis(depth=depth)
  coeffs = form.gd_coefficients(lam=lam, eta=etas, depth=depth)
  params = form.gd_params(lam=lam, eta=etas, depth=depth)
  assert basis.w1.shape[:2] == params.w1.shape[:2]
  assert coeffs.shape == (*params.w1.shape[:2], form.n)
  hs = elsa.elsa_stack(basis, h0, coeffs=coeffs, return_all=True)
  want = elsa.elsa_stack(params, h0, return_all=True)
  assert rel_err(hs, want) < 1e-12
  ws = ridge.gd(x, y, lam=lam, eta=etas, steps=depth)
  assert rel_err(form.decode_w(hs), ws) < F64_RTOL


def test_basis_and_coefficients_validate():
  form = forms.Natural(n_train=4, d=2, n_query=1)
  assert form.gd_basis(depth=3, dtype=jnp.float32).w1.dtype == jnp.float32
  with pytest.raises(ValueError, match="gd_basis: depth"):
    form.gd_basis(depth=0)
  with pytest.raises(ValueError, match="gd_coefficients: eta"):
    form.gd_coefficients(lam=0.1, eta=jnp.ones(2), depth=3)
  with pytest.raises(ValueError, match="gd_coefficients: lam"):
    form.gd_coefficients(lam=jnp.ones(2), eta=0.1, depth=3)
  with pytest.raises(TypeError, match="dtype must be floating"):
    form.gd_basis(depth=3, dtype=jnp.int32)


def test_forms_are_frozen_values():
  """Forms are static arguments of jit: equal by type and sizes, hashable,
  immutable once built (their row and column blocks derive from the sizes)."""
  a = forms.Natural(n_train=6, d=2, n_query=1)
  assert a == forms.Natural(n_train=6, d=2, n_query=1)
  assert hash(a) == hash(forms.Natural(n_train=6, d=2, n_query=1))
  assert a != forms.Designed(n_train=6, d=2, n_query=1)
  assert a != forms.Natural(n_train=6, d=2, n_query=2)
  assert repr(a) == "Natural(n_train=6, d=2, n_query=1, n_out=1)"
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.d = 3
  with pytest.raises(TypeError):
    forms.Natural(6, 2)  # keyword-only, as everywhere in the library


# Concrete values that cannot mean anything: refused by the parameter
# builders (traced values pass unchecked, as elsa._validate documents).
GD_BAD_SCALARS = [
    (dict(lam=0.1, eta=np.inf), r"eta must be > 0, got inf; only finite"),
    (dict(lam=np.nan, eta=0.1), r"lam must be >= 0, got nan"),
    (dict(lam=np.inf, eta=0.1), r"lam must be >= 0, got inf; only finite"),
    (dict(lam=-1.0, eta=0.1), r"lam must be >= 0, got -1"),
    (dict(lam=0.1, eta=0.0), r"eta must be > 0, got 0"),
    (dict(lam=0.1, eta=np.array([0.1, np.nan, 0.1])), r"eta must be > 0"),
]


@pytest.mark.parametrize("form_cls", FORMS)
@pytest.mark.parametrize("scalars,pattern", GD_BAD_SCALARS)
def test_gd_params_refuse_concrete_scalars_out_of_range(form_cls, scalars,
                                                        pattern):
  form = form_cls(n_train=4, d=2)
  for method in ("gd_params", "gd_coefficients"):
    with pytest.raises(ValueError, match=rf"{form_cls.__name__}\.{method}: "
                       + pattern):
      getattr(form, method)(depth=3, **scalars)
  traced = jax.jit(lambda lam, eta: form.gd_params(lam=lam, eta=eta, depth=3))
  traced(*(jnp.asarray(scalars[k], jnp.float64) for k in ("lam", "eta")))


@pytest.mark.parametrize("scalars,pattern", [
    (dict(lam=0.1, alpha=np.inf), r"alpha must be > 0, got inf; only finite"),
    (dict(lam=np.nan, alpha=0.1), r"lam must be >= 0, got nan"),
    (dict(lam=-1.0, alpha=0.1), r"lam must be >= 0, got -1"),
    (dict(lam=np.inf, alpha=0.1),
     r"lam must be >= 0, got inf; only finite")])
def test_newton_params_refuse_concrete_scalars_out_of_range(scalars, pattern):
  form = forms.Newton(n_train=4, d=2)
  for method, kwargs in (("newton_params", dict(depth=2)),
                         ("setup_params", {})):
    with pytest.raises(ValueError, match=rf"Newton\.{method}: " + pattern):
      getattr(form, method)(**scalars, **kwargs)


@pytest.mark.parametrize("build", [
    lambda: forms.Natural(n_train=4, d=2).gd_params(lam=0.1, eta=0.1,
                                                    depth=10**8),
    lambda: forms.Designed(n_train=4, d=2).gd_basis(depth=10**8),
    lambda: forms.Newton(n_train=4, d=2).newton_params(lam=0.1, alpha=0.1,
                                                       depth=10**8),
], ids=["natural_gd_params", "designed_gd_basis", "newton_params"])
def test_a_depth_that_cannot_fit_is_refused_before_allocation(build):
  # On main these returned at once and blocked, or failed, only when read.
  with pytest.raises(ValueError, match=r"need at least .* GiB, more than"):
    build()


@pytest.mark.parametrize("form", [elsa.forms.Natural, elsa.forms.Designed,
                                  elsa.forms.Newton])
def test_a_form_larger_than_memory_is_refused_before_its_program_is_built(
    form):
  """Issue 33 (N1): ``Natural(n_train=10**9, d=10**4).gd_params`` grew past
  10 GB for minutes (the program pins every row)."""
  big = form(n_train=10 ** 9, d=10 ** 4)
  with pytest.raises(ValueError, match=rf"^{form.__name__}: n_train=10+, "
                     r"d=10000, .* need at least .* GiB"):
    if form is elsa.forms.Newton:
      big.newton_params(lam=0.1, alpha=0.1, depth=1)
    else:
      big.gd_params(lam=0.1, eta=0.1, depth=1)
