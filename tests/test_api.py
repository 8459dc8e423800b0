"""The public API of DESIGN.md, called exactly as written there."""

import jax
import jax.numpy as jnp
import numpy as np

import elsa


def _task(n_train=12, d=3, n_query=2, seed=0):
  t = elsa.ridge.sample_tasks(jax.random.key(seed), batch=1, n_train=n_train,
                              d=d, n_query=n_query, dtype=jnp.float64)
  return t.x[0], t.y[0], t.x_query[0]


def _close(a, b, rtol=1e-10):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape, (a.shape, b.shape)
  assert np.max(np.abs(a - b)) <= rtol * max(np.max(np.abs(b)), 1e-300)


def test_primitive_names():
  m, n, k, v = 6, 4, 3, 4
  key = jax.random.key(0)
  w1, w2, w3, b1, b2, b3 = (jax.random.normal(jax.random.fold_in(key, i), s,
                                              jnp.float64)
                            for i, s in enumerate([(n, k), (n, v), (n, k),
                                                   (m, k), (m, v), (m, k)]))
  p = elsa.ElsaParams(w1, w2, w3, b1, b2, b3)
  h = jax.random.normal(key, (2, m, n), jnp.float64)
  _close(elsa.elsa(p, h), (h @ w3 + b3) @ (jnp.swapaxes(h @ w1 + b1, -1, -2)
                                           @ (h @ w2 + b2)))
  _close(elsa.lsa(p, h), (h @ w3) @ (jnp.swapaxes(h @ w1, -1, -2) @ (h @ w2)))
  layer = elsa.ElsaParams(*(jnp.stack([a, 2 * a]) for a in p))
  assert elsa.elsa_layer(layer, h).shape == (2, m, n)
  stack = elsa.ElsaParams(*(0.1 * a[None] for a in layer))
  assert elsa.elsa_stack(stack, h).shape == (2, m, n)
  assert elsa.elsa_stack(stack, h, return_all=True).shape == (2, 2, m, n)


def test_constructions_names():
  h = jax.random.normal(jax.random.key(1), (5, 3), jnp.float64)
  c = jnp.arange(10.0, dtype=jnp.float64).reshape(5, 2)
  _close(elsa.elsa(elsa.constructions.constant(c, 3), h), c)
  _close(elsa.elsa(elsa.constructions.identity(5, 3, dtype=jnp.float64), h), h)
  P = jax.random.normal(jax.random.key(2), (5, 5), jnp.float64)
  Q = jax.random.normal(jax.random.key(3), (3, 2), jnp.float64)
  _close(elsa.elsa(elsa.constructions.linear(P, Q), h), P @ h @ Q)
  assert callable(elsa.constructions.product2)
  assert callable(elsa.constructions.product3)


def test_ridge_names():
  x, y, _ = _task()
  ws = elsa.ridge.gd(x, y, lam=0.1, eta=0.2, steps=5, w0=None)
  assert ws.shape == (6, 3)
  w_star = elsa.ridge.solve(x, y, lam=0.1)
  assert elsa.ridge.loss(w_star, x, y, lam=0.1) < elsa.ridge.loss(ws[-1], x, y,
                                                                  lam=0.1)


def test_gd_forms_as_in_design():
  x, y, xq = _task()
  lam, eta, L = 0.1, 0.3, 7
  for cls in (elsa.forms.Designed, elsa.forms.Natural):
    form = cls(n_train=12, d=3, n_query=2, n_out=1)
    h0 = form.encode(x, y, x_query=xq, w0=None)
    assert h0.shape == (form.m, form.n)
    params = form.gd_params(lam=lam, eta=eta, depth=L)
    assert params.w1.shape[0] == L
    hs = elsa.elsa_stack(params, h0, return_all=True)
    gd = elsa.ridge.gd(x, y, lam=lam, eta=eta, steps=L)
    for t in range(L + 1):
      _close(form.decode_w(hs)[t], gd[t])
    _close(form.decode_pred(hs[-1]), xq @ gd[-1])
    model = elsa.nn.ElsaStack.from_params(params)
    _close(model(h0), elsa.elsa_stack(params, h0), rtol=0)


def test_newton_form_as_in_design():
  x, y, xq = _task(n_train=20, d=3)
  lam, T = 0.1, 5
  form = elsa.forms.Newton(n_train=20, d=3, n_query=2, n_out=1)
  alpha = form.safe_alpha(x, lam=lam)
  h0 = form.encode(x, y, x_query=xq)
  params = form.newton_params(lam=lam, alpha=alpha, depth=T, dtype=h0.dtype)
  assert params.w1.shape[0] == form.setup_layers + T
  hs = elsa.elsa_stack(params, h0, return_all=True)
  for t in range(T + 1):
    want = elsa.ridge.gd(x, y, lam=lam, eta=alpha, steps=2**t)[-1]
    _close(form.decode_w(hs[form.setup_layers + t]), want)
    _close(form.decode_pred(hs[form.setup_layers + t]), xq @ want)
