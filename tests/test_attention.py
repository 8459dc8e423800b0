"""The ELSA primitive against an independent float64 numpy implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import elsa
from elsa import ElsaParams, _validate
from helpers import rel_err

# float32 bound: the worst relative error (max abs error / max abs value)
# measured over SHAPES with 20 seeds each was 3.0e-7
# (docs/guides/primitive.md); asserted with a margin.
F32_RTOL = 5e-6
F64_RTOL = 1e-12


def np_elsa(p, h, *, bias=True, mask=None):
  """Left-to-right numpy reference, through the [m, m] attention matrix.

  ``mask [..., m]``: column ``j`` of the attention matrix weighted by
  ``mask[j]`` (a 0/1 mask drops token ``j`` from the key/value sum).
  """
  p = [np.asarray(a, np.float64) for a in p]
  w1, w2, w3, b1, b2, b3 = p
  if not bias:
    b1, b2, b3 = 0.0, 0.0, 0.0
  h = np.asarray(h, np.float64)
  q, k, v = h @ w3 + b3, h @ w1 + b1, h @ w2 + b2
  attention = q @ np.swapaxes(k, -1, -2)
  if mask is not None:
    attention = attention * np.asarray(mask, np.float64)[..., None, :]
  return attention @ v


def random_params(rng, m, n, k, v, dtype, lead=()):
  shapes = dict(w1=(n, k), w2=(n, v), w3=(n, k), b1=(m, k), b2=(m, v),
                b3=(m, k))
  return ElsaParams(**{name: jnp.asarray(rng.normal(size=(*lead, *s)), dtype)
                       for name, s in shapes.items()})


# (batch, m, n, k, v): k, v, n all different; m < n and m > n.
SHAPES = [((), 9, 4, 3, 5), ((), 3, 7, 2, 5), ((2,), 11, 6, 4, 3),
          ((2, 3), 5, 8, 6, 7), ((), 1, 1, 1, 1)]


@pytest.mark.parametrize("dtype,rtol", [(jnp.float64, F64_RTOL),
                                        (jnp.float32, F32_RTOL)])
@pytest.mark.parametrize("batch,m,n,k,v", SHAPES)
def test_elsa_matches_numpy(batch, m, n, k, v, dtype, rtol, variant):
  rng = np.random.default_rng(abs(hash((batch, m, n, k, v))) % 2**32)
  p = random_params(rng, m, n, k, v, dtype)
  h = jnp.asarray(rng.normal(size=(*batch, m, n)), dtype)
  got = variant(elsa.elsa)(p, h)
  assert got.shape == (*batch, m, v) and got.dtype == dtype
  assert rel_err(got, np_elsa(p, h)) < rtol
  assert rel_err(variant(elsa.lsa)(p, h), np_elsa(p, h, bias=False)) < rtol


def test_vmap_over_h_and_params():
  rng = np.random.default_rng(1)
  m, n, k, v = 6, 4, 3, 5
  ps = random_params(rng, m, n, k, v, jnp.float64, lead=(3,))
  hs = jnp.asarray(rng.normal(size=(3, m, n)))
  got = jax.vmap(elsa.elsa)(ps, hs)
  want = np.stack([np_elsa(ElsaParams(*(a[i] for a in ps)), hs[i])
                   for i in range(3)])
  assert rel_err(got, want) < F64_RTOL
  # Params batched, h shared.
  got = jax.jit(jax.vmap(elsa.elsa, in_axes=(0, None)))(ps, hs[0])
  want = np.stack([np_elsa(ElsaParams(*(a[i] for a in ps)), hs[0])
                   for i in range(3)])
  assert rel_err(got, want) < F64_RTOL


def test_grad_matches_finite_differences():
  rng = np.random.default_rng(2)
  m, n, k, v = 5, 4, 3, 2
  p = random_params(rng, m, n, k, v, jnp.float64)
  h = jnp.asarray(rng.normal(size=(m, n)))
  weights = jnp.asarray(rng.normal(size=(m, v)))
  f = lambda p, h: jnp.sum(jnp.sin(elsa.elsa(p, h)) * weights)
  grad_p, grad_h = jax.grad(f, argnums=(0, 1))(p, h)
  eps = 1e-6
  # Central differences along random directions, for every leaf and for h.
  for name in ElsaParams._fields + ("h",):
    direction = jnp.asarray(rng.normal(size=(h if name == "h" else
                                             getattr(p, name)).shape))
    if name == "h":
      fd = (f(p, h + eps * direction) - f(p, h - eps * direction)) / (2 * eps)
      analytic = jnp.vdot(grad_h, direction)
    else:
      shift = lambda s: p._replace(**{name: getattr(p, name) + s * direction})
      fd = (f(shift(eps), h) - f(shift(-eps), h)) / (2 * eps)
      analytic = jnp.vdot(getattr(grad_p, name), direction)
    assert abs(fd - analytic) <= 1e-7 * max(1.0, abs(analytic)), name


def np_stack(ps, h, coeffs=None, mask=None):
  """Every state of a stack, by explicit loops over layers and components.

  ``coeffs [..., L, C, v or 1]`` scales the output columns of each component;
  ``mask [..., m]`` as for :func:`np_elsa`.
  """
  L, C = ps.w1.shape[:2]
  states = [np.asarray(h, np.float64)]
  for layer in range(L):
    total = 0
    for c in range(C):
      out = np_elsa(ElsaParams(*(a[layer, c] for a in ps)), states[-1],
                    mask=mask)
      if coeffs is not None:
        out = out * np.asarray(coeffs, np.float64)[..., layer, c, None, :]
      total = total + out
    states.append(total)
  return states


# (L, C, m, n, k, scale): per-item m k v on both sides of the layer's switch
# from a fused multiply-and-sum to one dot per component
# (attention._SMALL_CONTRACTION); scale keeps the cubic layers O(1).
LAYER_SHAPES = [(4, 3, 7, 5, 2, 0.3), (2, 2, 40, 30, 30, 0.05)]


def _stack_case(L, C, m, n, k, scale, *, seed=3):
  rng = np.random.default_rng(seed)
  ps = random_params(rng, m, n, k, n, jnp.float64, lead=(L, C))
  return rng, jax.tree.map(lambda a: scale * a, ps)


@pytest.mark.parametrize("L,C,m,n,k,scale", LAYER_SHAPES)
def test_layer_and_stack_match_loops(L, C, m, n, k, scale):
  rng, ps = _stack_case(L, C, m, n, k, scale)
  h = jnp.asarray(rng.normal(size=(2, m, n)))
  states = np_stack(ps, h)
  one = ElsaParams(*(a[0] for a in ps))
  assert rel_err(elsa.elsa_layer(one, h), states[1]) < F64_RTOL
  assert rel_err(elsa.elsa_stack(ps, h), states[-1]) < 1e-11
  all_states = jax.jit(elsa.elsa_stack, static_argnames="return_all")(
      ps, h, return_all=True)
  assert all_states.shape == (L + 1, 2, m, n)
  for t in range(L + 1):
    assert rel_err(all_states[t], states[t]) < 1e-11


@pytest.mark.parametrize("L,C,m,n,k,scale", LAYER_SHAPES)
@pytest.mark.parametrize("per_column", [True, False])
def test_coeffs_scale_each_component(L, C, m, n, k, scale, per_column):
  """coeffs [..., L, C, v | 1] against the numpy loop, jitted, batch broadcast."""
  rng, ps = _stack_case(L, C, m, n, k, scale, seed=4)
  h = jnp.asarray(rng.normal(size=(m, n)))
  # Items differ only in coeffs: h [m, n] broadcasts against coeffs [3, ...].
  coeffs = jnp.asarray(rng.uniform(-2, 2, size=(3, L, C, n if per_column else 1)))
  states = np_stack(ps, np.broadcast_to(h, (3, m, n)), coeffs)
  got = jax.jit(elsa.elsa_stack, static_argnames="return_all")(
      ps, h, coeffs=coeffs, return_all=True)
  assert got.shape == (L + 1, 3, m, n)
  for t in range(L + 1):
    assert rel_err(got[t], states[t]) < 1e-11
  one = ElsaParams(*(a[0] for a in ps))
  assert rel_err(elsa.elsa_layer(one, h, coeffs=coeffs[:, 0]), states[1]) < F64_RTOL


def _fold(ps, coeffs):
  """The same stack with coeffs [L, C, v] folded into the value weights."""
  return ps._replace(w2=ps.w2 * coeffs[:, :, None, :],
                     b2=ps.b2 * coeffs[:, :, None, :])


def test_coeffs_under_vmap_and_grad_equal_folded_weights():
  """Shared p with per-item coeffs == per-item folded params, values and grads."""
  L, C, m, n, k = 3, 2, 6, 4, 3
  rng, ps = _stack_case(L, C, m, n, k, 0.3, seed=5)
  hs = jnp.asarray(rng.normal(size=(4, m, n)))
  coeffs = jnp.asarray(rng.uniform(-1, 1, size=(4, L, C, n)))
  shared = jax.jit(jax.vmap(lambda h, a: elsa.elsa_stack(ps, h, coeffs=a)))
  folded = jax.vmap(lambda h, a: elsa.elsa_stack(_fold(ps, a), h))
  assert rel_err(shared(hs, coeffs), folded(hs, coeffs)) < F64_RTOL
  weights = jnp.asarray(rng.normal(size=(m, n)))
  loss = lambda stack: lambda a, p, h: jnp.sum(jnp.sin(stack(a, p, h)) * weights)
  with_coeffs = loss(lambda a, p, h: elsa.elsa_stack(p, h, coeffs=a))
  with_folded = loss(lambda a, p, h: elsa.elsa_stack(_fold(p, a), h))
  got = jax.grad(with_coeffs, argnums=(0, 1, 2))(coeffs[0], ps, hs[0])
  want = jax.grad(with_folded, argnums=(0, 1, 2))(coeffs[0], ps, hs[0])
  # Gradients of three cubic layers reach 1e4 here; their rounding is
  # amplified accordingly (measured 6e-12 worst over the leaves).
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(g, w) < 1e-10


@pytest.mark.parametrize("coeffs_shape,pattern", [
    ((2, 3), r"coeffs must have shape \[\.\.\., L, C, v\] = \[\.\.\., L=2, C=3, 5\]"),
    ((2, 3, 4), r"\[\.\.\., L=2, C=3, 1\].*got shape \(2, 3, 4\)"),
    ((3, 3, 5), r"got shape \(3, 3, 5\)"),
    ((2, 2, 1), r"got shape \(2, 2, 1\)"),
    ((4, 2, 3, 1), r"batch axes of coeffs \(4, 2, 3, 1\).*broadcast with those "
                   r"of h \(3, 7, 5\)"),
])
def test_bad_coeffs_raise(coeffs_shape, pattern):
  ps = ElsaParams.init(jax.random.key(0), m=7, n=5, k=2, lead=(2, 3))
  h = jnp.ones((3, 7, 5), ps.w1.dtype)
  with pytest.raises(ValueError, match=pattern):
    jax.jit(elsa.elsa_stack)(ps, h, coeffs=jnp.ones(coeffs_shape, h.dtype))
  with pytest.raises(TypeError, match="coeffs has dtype float32 but h has "
                     "dtype float64"):
    elsa.elsa_stack(ps, h, coeffs=jnp.ones((2, 3, 1), jnp.float32))
  layer = ElsaParams(*(a[0] for a in ps))
  with pytest.raises(ValueError, match=r"elsa_layer: coeffs must have shape "
                     r"\[\.\.\., C, v\] = \[\.\.\., C=3, 5\]"):
    elsa.elsa_layer(layer, h, coeffs=jnp.ones((3, 4), h.dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_lsa_is_homogeneous_cubic_and_elsa_without_bias_is_lsa(dtype):
  rng = np.random.default_rng(4)
  m, n, k, v = 6, 4, 3, 5
  p = random_params(rng, m, n, k, v, dtype)
  h = jnp.asarray(rng.normal(size=(m, n)), dtype)
  tol = F64_RTOL if dtype == jnp.float64 else F32_RTOL
  for c in (-2.0, 0.5, 3.0):
    assert rel_err(elsa.lsa(p, c * h), c**3 * elsa.lsa(p, h)) < tol
  assert np.all(np.asarray(elsa.lsa(p, 0 * h)) == 0)
  zero_bias = p._replace(b1=0 * p.b1, b2=0 * p.b2, b3=0 * p.b3)
  assert rel_err(elsa.elsa(zero_bias, h), elsa.lsa(p, h)) < tol
  # With its biases, ELSA is not homogeneous: elsa(p, 0) is B3 B1^T B2.
  assert rel_err(elsa.elsa(p, 0 * h), np.asarray(p.b3 @ p.b1.T @ p.b2)) < tol


def test_never_forms_the_m_by_m_matrix():
  m, n, k = 97, 5, 3  # m distinct from every other size
  p = ElsaParams.zeros(m=m, n=n, k=k, lead=(2, 2), dtype=jnp.float32)
  h = jnp.zeros((m, n), jnp.float32)
  for fn, params in ((elsa.elsa, ElsaParams(*(a[0, 0] for a in p))),
                     (elsa.lsa, ElsaParams(*(a[0, 0] for a in p))),
                     (elsa.elsa_layer, ElsaParams(*(a[0] for a in p))),
                     (elsa.elsa_stack, p)):
    text = str(jax.make_jaxpr(fn)(params, h))
    assert f"{m},{m}]" not in text.replace(" ", ""), fn.__name__
    # And the compiled temporaries stay linear in m.
    temp = jax.jit(fn).lower(params, h).compile().memory_analysis()
    if temp is not None:
      assert temp.temp_size_in_bytes < m * m * 4, fn.__name__


def test_init_and_zeros():
  p = ElsaParams.init(jax.random.key(0), m=5, n=4, k=3, v=2, lead=(2,))
  assert (p.m, p.n, p.k, p.v) == (5, 4, 3, 2)
  assert p.w1.shape == (2, 4, 3) and p.b2.shape == (2, 5, 2)
  again = ElsaParams.init(jax.random.key(0), m=5, n=4, k=3, v=2, lead=(2,))
  assert all(np.array_equal(a, b) for a, b in zip(p, again))
  other = ElsaParams.init(jax.random.key(1), m=5, n=4, k=3, v=2, lead=(2,))
  assert not np.array_equal(p.w1, other.w1)
  z = ElsaParams.zeros(m=5, n=4, k=3, dtype=jnp.float64)
  assert z.w2.shape == (4, 4) and z.w1.dtype == jnp.float64
  assert not np.any(np.asarray(elsa.elsa(z, jnp.ones((5, 4)))))


def _good(m=5, n=4, k=3, v=4, dtype=jnp.float32):
  return (ElsaParams.init(jax.random.key(0), m=m, n=n, k=k, v=v, dtype=dtype),
          jnp.ones((m, n), dtype))


@pytest.mark.parametrize("mutate,error,pattern", [
    (lambda p, h: (p, jnp.ones((6, 4), h.dtype)), ValueError,
     r"p is laid out for m=5 tokens .* h of shape \(6, 4\) has 6"),
    (lambda p, h: (p._replace(b1=p.b1[:-1]), h[:-1]), ValueError,
     r"p.b1 must have shape \(5, 3\)"),
    (lambda p, h: (p, h[:, :-1]), ValueError, r"p.w1 must have shape \(3, 3\)"),
    (lambda p, h: (p._replace(w3=p.w3[:, :2]), h), ValueError,
     r"p.w3 must have shape \(4, 3\).*got \(4, 2\)"),
    (lambda p, h: (p._replace(b2=p.b2[:, :2]), h), ValueError,
     r"p.b2 must have shape \(5, 4\)"),
    (lambda p, h: (p, h[0]), ValueError, r"h must have shape \[..., m, n\]"),
    (lambda p, h: (p._replace(w1=p.w1[None]), h), ValueError,
     r"p.w1 must have rank 2"),
    (lambda p, h: (p, h.astype(jnp.int32)), TypeError, "floating dtype"),
    (lambda p, h: (p, h.astype(jnp.float64)), TypeError,
     "p.w1 has dtype float32 but h has dtype float64"),
    (lambda p, h: (tuple(p), h), TypeError, "must be an ElsaParams"),
])
def test_bad_input_raises_at_trace_time(mutate, error, pattern):
  p, h = mutate(*_good())
  with pytest.raises(error, match=pattern):
    elsa.elsa(p, h)
  with pytest.raises(error, match=pattern):
    jax.jit(elsa.elsa)(p, h)


def test_layer_and_stack_validation():
  p, h = _good(v=4)
  layer = ElsaParams(*(a[None] for a in p))
  with pytest.raises(ValueError, match=r"p.w1 must have rank 3 \[C, rows, cols\]"):
    elsa.elsa_layer(p, h)
  with pytest.raises(ValueError, match=r"rank 4 \[L, C, rows, cols\]"):
    elsa.elsa_stack(layer, h)
  narrow = ElsaParams.init(jax.random.key(0), m=5, n=4, k=3, v=2, lead=(1, 1),
                           dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"v == n == 4.*\(1, 1, 4, 2\)"):
    elsa.elsa_stack(narrow, h)
  mixed = layer._replace(b3=jnp.concatenate([layer.b3, layer.b3]))
  with pytest.raises(ValueError, match=r"p.b3 must have shape \(1, 5, 3\)"):
    elsa.elsa_layer(mixed, h)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 6), k=st.integers(1, 5),
       v=st.integers(1, 6), batch=st.lists(st.integers(1, 3), max_size=2),
       seed=st.integers(0, 2**31 - 1),
       scale=st.floats(1e-3, 1e3))
def test_property_matches_numpy_over_shapes_and_scales(m, n, k, v, batch, seed,
                                                       scale):
  rng = np.random.default_rng(seed)
  p = random_params(rng, m, n, k, v, jnp.float64)
  h = jnp.asarray(scale * rng.normal(size=(*batch, m, n)))
  got = elsa.elsa(p, h)
  assert got.shape == (*batch, m, v)
  want = np_elsa(p, h)
  # Cancellation in sums of products: bound relative to the magnitude of the
  # terms, not of the (possibly tiny) result.
  terms = np_elsa([np.abs(np.asarray(a)) for a in p], np.abs(np.asarray(h)))
  assert np.all(np.abs(np.asarray(got) - want) <= 1e-12 * (terms + 1e-300))


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 8), n=st.integers(1, 5),
       c=st.floats(-10, 10).filter(lambda c: abs(c) > 1e-3),
       seed=st.integers(0, 2**31 - 1))
def test_property_lsa_homogeneity(m, n, c, seed):
  rng = np.random.default_rng(seed)
  p = random_params(rng, m, n, 3, n, jnp.float64)
  h = jnp.asarray(rng.normal(size=(m, n)))
  terms = np_elsa([np.abs(np.asarray(a)) for a in p], np.abs(np.asarray(h)),
                  bias=False)
  err = np.abs(np.asarray(elsa.lsa(p, c * h)) - c**3 * np.asarray(elsa.lsa(p, h)))
  assert np.all(err <= 1e-12 * abs(c)**3 * (terms + 1e-300))


def test_bfloat16_stays_bfloat16():
  p, h = _good(dtype=jnp.bfloat16)
  assert elsa.elsa(p, h).dtype == jnp.bfloat16
  assert elsa.elsa_stack(ElsaParams(*(a[None, None] for a in
                                       ElsaParams.init(jax.random.key(1), m=5,
                                                       n=4, k=2, v=4,
                                                       dtype=jnp.bfloat16))),
                         h).dtype == jnp.bfloat16


def test_lsa_checks_only_the_weights():
  """DESIGN: lsa ignores biases, so params laid out for another m are fine."""
  rng = np.random.default_rng(30)
  n, k, v = 4, 3, 5
  p = random_params(rng, 6, n, k, v, jnp.float64)  # biases for m = 6
  for m in (2, 9):
    h = jnp.asarray(rng.normal(size=(m, n)))
    got = elsa.lsa(p, h)
    assert got.shape == (m, v)
    assert rel_err(got, np_elsa(p, h, bias=False)) < F64_RTOL
  # elsa uses the biases: m = 2 is a prefix (their first rows), m = 9 is
  # longer than they are laid out for and refused.
  h = jnp.asarray(rng.normal(size=(2, n)))
  assert rel_err(elsa.elsa(p, h), np_elsa(jax.tree.map(
      lambda a: a[:2] if a.shape[0] == 6 else a, p), h)) < F64_RTOL
  with pytest.raises(ValueError, match=r"laid out for m=6 tokens"):
    elsa.elsa(p, jnp.asarray(rng.normal(size=(9, n))))
  # Biases of another rank or dtype are ignored too.
  odd = p._replace(b1=jnp.zeros(3, jnp.int32), b3=None)
  h = jnp.asarray(rng.normal(size=(6, n)))
  np.testing.assert_array_equal(elsa.lsa(odd, h), elsa.lsa(p, h))
  # The weights are still checked: shape, rank and dtype.
  with pytest.raises(ValueError, match=r"p.w3 must have shape \(4, 3\)"):
    elsa.lsa(p._replace(w3=p.w3[:, :2]), h)
  with pytest.raises(ValueError, match=r"p.w2 must have rank 2"):
    elsa.lsa(p._replace(w2=p.w2[None]), h)
  with pytest.raises(TypeError, match=r"p.w1 has dtype float32"):
    elsa.lsa(p._replace(w1=p.w1.astype(jnp.float32)), h)


def test_default_dtype_is_jax_default_float():
  """float32 by default, float64 under jax_enable_x64 (on in the tests)."""
  assert elsa.attention.float_dtype() == jnp.float64
  assert elsa.attention.float_dtype(jnp.bfloat16) == jnp.bfloat16
  kw = dict(m=3, n=2, k=2, lead=(2,))
  for p in (ElsaParams.zeros(**kw), ElsaParams.init(jax.random.key(0), **kw)):
    assert {a.dtype for a in p} == {jnp.dtype(jnp.float64)}
  with jax.enable_x64(False):
    assert elsa.attention.float_dtype() == jnp.float32
    for p in (ElsaParams.zeros(**kw), ElsaParams.init(jax.random.key(0), **kw)):
      assert {a.dtype for a in p} == {jnp.dtype(jnp.float32)}


def test_one_validation_policy():
  """elsa._validate: wrong type -> TypeError, wrong value -> ValueError;
  float_dtype lives there and stays importable from elsa.attention."""
  assert elsa.attention.float_dtype is _validate.float_dtype
  assert _validate.int_at_least("f", "n", np.int64(3), low=1) == 3
  for bad in (2.0, True, "3", None):
    with pytest.raises(TypeError, match="f: n must be an int >= 1"):
      _validate.int_at_least("f", "n", bad, low=1)
  with pytest.raises(ValueError, match="f: n must be an int >= 1, got 0"):
    _validate.int_at_least("f", "n", 0, low=1)
  with pytest.raises(TypeError, match="f: h must have a floating dtype"):
    _validate.floating("f", "h", jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match="f: eta must be > 0, got -1"):
    _validate.at_least("f", "eta", -1.0, low=0, strict=True)
  # A traced value cannot be checked; it passes.
  jax.jit(lambda v: _validate.at_least("f", "eta", v, low=0, strict=True))(-1.0)
  # Non-finite values are refused by range checks and by finite; a bool or a
  # string is not a number; dtypes must be floating.
  with pytest.raises(ValueError, match="f: eta must be > 0, got inf; only"):
    _validate.at_least("f", "eta", np.inf, low=0, strict=True)
  with pytest.raises(ValueError, match=r"f: s must be finite, got nan in s"):
    _validate.finite("f", "s", jnp.asarray([1.0, np.nan], jnp.bfloat16))
  for bad in (True, "1"):
    with pytest.raises(TypeError, match="f: s must be a real number"):
      _validate.finite("f", "s", bad)
  jax.jit(lambda v: _validate.finite("f", "s", v))(np.nan)
  assert _validate.floating_dtype("f", None) == _validate.float_dtype()
  for bad in (jnp.int32, "int8", "no-such-dtype", 3):
    with pytest.raises(TypeError, match="f: dtype must be a floating dtype"):
      _validate.floating_dtype("f", bad)


@pytest.mark.parametrize("dtype, bound", [(jnp.float64, 1e-12),
                                          (jnp.float32, 2e-6)])
def test_small_token_contraction_layouts_agree_with_numpy(dtype, bound):
  """Both layouts of the per-item K^T V (the float64 default is the dot, the
  float32 one the multiply-and-sum) against numpy, and the float32 stack on
  the small path against the float64 loop. float32, measured over 8 seeds:
  the contraction 1.4e-7 (bound 2e-6), the 4-layer stack 3.9e-6 (bound
  2e-5)."""
  from elsa import attention  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(11)
  keys, values = rng.normal(size=(3, 7, 2, 4)), rng.normal(size=(3, 7, 2, 5))
  want = np.einsum("bmck,bmcv->bckv", keys, values)
  for layout in ("multiply_sum", "dot", None):
    got = attention._small_token_contraction(
        jnp.asarray(keys, dtype), jnp.asarray(values, dtype), "highest",
        layout)
    assert got.dtype == dtype and rel_err(got, want) < bound, layout
  with pytest.raises(ValueError, match="unknown layout 'fold'"):
    attention._small_token_contraction(keys, values, None, "fold")
  L, C, m, n, k, scale = LAYER_SHAPES[0]
  assert m * k * n <= attention._SMALL_CONTRACTION
  rng, ps = _stack_case(L, C, m, n, k, scale, seed=6)
  h = rng.normal(size=(2, m, n))
  states = np_stack(ps, h)
  got = elsa.elsa_stack(jax.tree.map(lambda a: a.astype(dtype), ps),
                        jnp.asarray(h, dtype))
  assert got.dtype == dtype and rel_err(got, states[-1]) < 10 * bound


# --- key_mask: tokens that read but are not read ------------------------------


@pytest.mark.parametrize("batch,m,n,k,v", SHAPES)
def test_key_mask_drops_tokens_from_the_key_value_sum(batch, m, n, k, v,
                                                      variant):
  rng = np.random.default_rng(abs(hash(("mask", batch, m, n, k, v))) % 2**32)
  p = random_params(rng, m, n, k, v, jnp.float64)
  h = jnp.asarray(rng.normal(size=(*batch, m, n)))
  # One mask per item, and one mask broadcast over the items.
  for mask in (rng.random((*batch, m)) < 0.6, rng.random(m) < 0.6):
    # Reference: the dropped tokens' rows removed from K and V outright.
    keep = np.broadcast_to(mask, (*batch, m)).reshape(-1, m)
    hs = np.asarray(h).reshape(-1, m, n)
    want = []
    for item, kept in zip(hs, keep):
      q = item @ np.asarray(p.w3) + np.asarray(p.b3)
      kv = lambda w, b: (item @ np.asarray(w) + np.asarray(b))[kept]
      want.append(q @ (kv(p.w1, p.b1).T @ kv(p.w2, p.b2)))
    want = np.reshape(want, (*batch, m, v))
    got = variant(lambda p, h, mask: elsa.elsa(p, h, key_mask=mask))(
        p, h, jnp.asarray(mask))
    assert got.shape == (*batch, m, v)
    assert rel_err(got, want) < F64_RTOL
    no_bias = p._replace(b1=0 * p.b1, b2=0 * p.b2, b3=0 * p.b3)
    assert rel_err(elsa.lsa(p, h, key_mask=mask),
                   elsa.elsa(no_bias, h, key_mask=mask)) < F64_RTOL
  # A weighted mask weights the tokens: K^T diag(mask) V.
  weights = jnp.asarray(rng.normal(size=m))
  assert rel_err(elsa.elsa(p, h, key_mask=weights),
                 np_elsa(p, h, mask=weights)) < F64_RTOL


@pytest.mark.parametrize("L,C,m,n,k,scale", LAYER_SHAPES)
def test_key_mask_in_layers_stacks_and_the_residual_stack(L, C, m, n, k,
                                                          scale):
  rng, ps = _stack_case(L, C, m, n, k, scale, seed=7)
  h = jnp.asarray(rng.normal(size=(2, m, n)))
  mask = jnp.asarray(rng.random((2, m)) < 0.5)
  coeffs = jnp.asarray(rng.normal(size=(2, L, C, n)))
  states = np_stack(ps, h, coeffs, mask=mask)
  one = ElsaParams(*(a[0] for a in ps))
  assert rel_err(elsa.elsa_layer(one, h, coeffs=coeffs[:, 0], key_mask=mask),
                 states[1]) < F64_RTOL
  all_states = jax.jit(elsa.elsa_stack, static_argnames="return_all")(
      ps, h, return_all=True, coeffs=coeffs, key_mask=mask)
  for t in range(L + 1):
    assert rel_err(all_states[t], states[t]) < 1e-11
  # One mask [m] for items [2, m, n] that broadcast against it.
  assert rel_err(elsa.elsa_stack(ps, h, key_mask=mask[0]),
                 np_stack(ps, h, mask=mask[0])[-1]) < 1e-11
  # The residual stream: h_t = h_{t-1} + sum_c elsa(p_c, h_{t-1}; mask).
  want = np.asarray(h)
  for layer in range(L):
    want = want + sum(np_elsa(ElsaParams(*(a[layer, c] for a in ps)), want,
                              mask=mask) for c in range(C))
  assert rel_err(elsa.nn.residual_stack(ps, h, key_mask=mask), want) < 1e-11
  assert rel_err(elsa.nn.ElsaStack.from_params(ps, residual=True)(
      h, key_mask=mask), want) < 1e-11


@pytest.mark.parametrize("mask,error,pattern", [
    (np.ones(4, bool), ValueError, r"elsa: key_mask must have shape \[\.\.\., m\] with m=5"),
    (np.ones((3, 5), bool), ValueError, r"batch axes of key_mask \(3, 5\)"),
    (np.ones(5, np.float64), TypeError, r"key_mask must be bool or have the dtype of h \(float32\)"),
    (np.ones(5, np.int32), TypeError, r"key_mask must be bool .* got int32"),
    (np.ones((2, 5, 5), bool), ValueError,
     r"key_mask of shape \(2, 5, 5\) looks like a per-query \[m, m\] mask.*causal=True"),
])
def test_bad_key_mask_raises(mask, error, pattern):
  p, h = _good()
  h = jnp.broadcast_to(h, (2, *h.shape))
  with pytest.raises(error, match=pattern):
    elsa.elsa(p, h, key_mask=mask)


@pytest.mark.parametrize("fn", [elsa.elsa, elsa.lsa])
def test_a_causal_square_key_mask_is_refused_not_broadcast(fn):
  """A lower-triangular [m, m] mask on h [m, n] would otherwise be taken as
  m masks of the keys (an output [m, m, v]); it is refused, naming causal."""
  p, h = _good()
  with pytest.raises(ValueError, match=r"key_mask of shape \(5, 5\) looks "
                     r"like a per-query \[m, m\] mask .* pass causal=True"):
    fn(p, h, key_mask=np.tril(np.ones((5, 5), bool)))
  layer = ElsaParams(*(a[None] for a in p))
  with pytest.raises(ValueError, match=r"elsa_layer: key_mask of shape"):
    elsa.elsa_layer(layer, h, key_mask=np.tril(np.ones((5, 5), bool)))


# --- prune: the same stack without the work of its zeros ---------------------


def _sparse_stack(rng, L, C, m, n, k, dtype=jnp.float64):
  """A random stack with the zero patterns prune looks for: a skip (W1 = W2
  = 0, diagonal), a constant component, zero inner and value columns, a
  component that is zero in some layers, and a pattern change between
  layers (several segments)."""
  ps = jax.tree.map(lambda a: 0.3 * a,
                    random_params(rng, m, n, k, n, jnp.float64, lead=(L, C)))
  ps = jax.tree.map(np.array, ps)
  skip = elsa.constructions.pad_inner(elsa.constructions.identity(m, n), k)
  for name in ElsaParams._fields:
    getattr(ps, name)[:, 0] = np.asarray(getattr(skip, name))
  ps.w1[:, 1] = ps.w2[:, 1] = 0           # constant: keys, values from biases
  ps.w1[:, 2, :, 0] = ps.b1[:, 2, :, 0] = 0   # inner column 0 without a key
  ps.w2[:, 2, :, 1:3] = ps.b2[:, 2, :, 1:3] = 0   # value columns 1, 2 unwritten
  if C > 3:
    for name in ElsaParams._fields:       # component 3 only in layer 0
      getattr(ps, name)[1:, 3] = 0
  return ElsaParams(*(jnp.asarray(a, dtype) for a in ps))


@pytest.mark.parametrize("L,C,m,n,k", [(3, 3, 7, 5, 5), (5, 4, 9, 6, 7),
                                       (1, 4, 4, 8, 4)])
@pytest.mark.parametrize("coeff_width", [None, 1, "v"])
def test_pruned_stack_equals_elsa_stack(L, C, m, n, k, coeff_width, variant):
  rng = np.random.default_rng(L * 100 + C)
  ps = _sparse_stack(rng, L, C, m, n, k)
  pruned = elsa.prune(ps)
  assert pruned.depth == L and (pruned.m, pruned.n) == (m, n)
  # The zeros were found: the skip is an elementwise product (for m >= n;
  # for m < n identity reads h through W2), component 1 is folded, component
  # 2 lost a key column and two value columns, component 3 is gone after
  # layer 0.
  assert len(pruned.segments) == (2 if C > 3 and L > 1 else 1)
  for seg in pruned.segments:
    skip = [0] if m >= n else []
    assert list(seg.skips) == skip and list(seg.constant) == [1]
    dynamic = {c: (inner, value) for c, inner, value in seg.dynamic}
    assert sorted(dynamic) == sorted({0, 2, 3} - set(skip) - (
        {3} if C == 3 or seg.start > 0 else set()))
    inner, value = dynamic[2]
    assert 0 not in inner and {1, 2}.isdisjoint(value)
  h = jnp.asarray(rng.normal(size=(2, m, n)))
  coeffs = None
  if coeff_width is not None:
    width = n if coeff_width == "v" else 1
    coeffs = jnp.asarray(rng.normal(size=(2, L, C, width)))
  want = elsa.elsa_stack(ps, h, coeffs=coeffs, return_all=True)
  got = variant(lambda h, c: pruned(h, coeffs=c, return_all=True))(h, coeffs)
  assert got.shape == want.shape == (L + 1, 2, m, n)
  assert rel_err(got, want) < 1e-12
  assert rel_err(pruned(h, coeffs=coeffs), want[-1]) < 1e-12
  # scan keeps what f returns of every state.
  last, kept = pruned.scan(lambda s: s[..., 0, :], h, coeffs=coeffs)
  assert rel_err(kept, want[1:, :, 0, :]) < 1e-12
  assert rel_err(last, want[-1]) < 1e-12


def test_pruned_gd_bases_in_float32_and_their_structure():
  # The sweep's use: the GD bases of both forms, pruned against dense, float64
  # and float32 (worst float32 difference measured: 3.6e-8 over 3 draws).
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, 12, 4))
  y = rng.normal(size=(3, 12))
  xq = rng.normal(size=(3, 2, 4))
  for form in (elsa.forms.Designed(n_train=12, d=4, n_query=2),
               elsa.forms.Natural(n_train=12, d=4, n_query=2)):
    errs = []
    for dtype in (jnp.float64, jnp.float32):
      basis = form.gd_basis(depth=20, dtype=dtype)
      pruned = elsa.prune(basis)
      coeffs = jax.vmap(lambda lam, eta: form.gd_coefficients(
          lam=lam, eta=eta, depth=20, dtype=dtype))(
              jnp.asarray([0.0, 0.1, 1.0], dtype),
              jnp.asarray([0.05, 0.1, 0.02], dtype))
      h0 = form.encode(jnp.asarray(x, dtype), jnp.asarray(y, dtype),
                       x_query=jnp.asarray(xq, dtype))
      got = pruned(h0, coeffs=coeffs, return_all=True)
      errs.append(rel_err(got, elsa.elsa_stack(basis, h0, coeffs=coeffs,
                                               return_all=True)))
      # The last segment: a skip and one gradient head reading d columns
      # and writing one (the p column).
      last = pruned.segments[-1]
      assert list(last.skips) == [0] and not len(last.constant)
      assert [(c, len(inner), list(value)) for c, inner, value in last.dynamic
              ] == [(1, form.d, list(range(form.n)[form.p_cols]))]
    assert errs[0] < 1e-13 and errs[1] < 1e-6


def test_prune_refusals():
  ps = _sparse_stack(np.random.default_rng(0), 2, 3, 5, 4, 4)
  with pytest.raises(TypeError, match="prune: p must be concrete"):
    jax.jit(elsa.prune)(ps)
  with pytest.raises(ValueError, match="elsa_stack|prune"):
    elsa.prune(ps._replace(w2=ps.w2[..., :3], b2=ps.b2[..., :3]))
  pruned = elsa.prune(ps)
  with pytest.raises(ValueError, match=r"PrunedStack: h must have shape \[\.\.\., 5, 4\]"):
    pruned(jnp.ones((5, 3)))
  with pytest.raises(TypeError, match="PrunedStack: h has dtype float32"):
    pruned(jnp.ones((5, 4), jnp.float32))
  with pytest.raises(ValueError, match="PrunedStack: coeffs must have shape"):
    pruned(jnp.ones((5, 4)), coeffs=jnp.ones((2, 3, 2)))


# --- one refusal policy at the entries that build or take parameters ---------

_SIZES = dict(m=3, n=2, k=2)


@pytest.mark.parametrize("call, error, message", [
    (lambda: ElsaParams.init(jax.random.key(0), m=-1, n=2, k=2), ValueError,
     "ElsaParams.init: m must be an int >= 1, got -1"),
    (lambda: ElsaParams.zeros(m=-1, n=2, k=2), ValueError,
     "ElsaParams.zeros: m must be an int >= 1, got -1"),
    (lambda: ElsaParams.zeros(m=3, n=2, k=0), ValueError,
     "ElsaParams.zeros: k must be an int >= 1, got 0"),
    (lambda: ElsaParams.zeros(**_SIZES, v=0), ValueError,
     "ElsaParams.zeros: v must be an int >= 1, got 0"),
    (lambda: ElsaParams.zeros(m=3, n=2.0, k=2), TypeError,
     "ElsaParams.zeros: n must be an int >= 1, got 2.0"),
    (lambda: ElsaParams.init(jax.random.key(0), **_SIZES, v=True), TypeError,
     "ElsaParams.init: v must be an int >= 1, got True"),
    (lambda: ElsaParams.zeros(**_SIZES, lead=(2, 0)), ValueError,
     r"ElsaParams.zeros: lead\[1\] must be an int >= 1, got 0"),
    (lambda: ElsaParams.zeros(**_SIZES, lead=3), TypeError,
     "ElsaParams.zeros: lead must be a tuple of ints >= 1, got 3"),
    (lambda: ElsaParams.zeros(**_SIZES, dtype=jnp.int32), TypeError,
     "ElsaParams.zeros: dtype must be a floating dtype"),
    (lambda: ElsaParams.init(jax.random.key(0), **_SIZES, dtype="int8"),
     TypeError, "ElsaParams.init: dtype must be a floating dtype"),
    (lambda: ElsaParams.init(jax.random.key(0), **_SIZES, scale=np.nan),
     ValueError, "ElsaParams.init: scale must be >= 0, got nan; only finite"),
    (lambda: ElsaParams.init(jax.random.key(0), **_SIZES, bias_scale=-1.0),
     ValueError, "ElsaParams.init: bias_scale must be >= 0, got -1"),
    (lambda: elsa.prune((1, 2, 3)), TypeError,
     r"prune: p must be an ElsaParams with leaves \[L, C, \.\.\.\], got tuple"),
    (lambda: elsa.prune(ElsaParams.zeros(**_SIZES, lead=(1, 1))._replace(
        w2=jnp.zeros((1, 1, 2, 2), jnp.int32))), TypeError,
     "prune: p.w2 must have a floating dtype, got int32"),
    (lambda: elsa.prune(ElsaParams(*[jnp.ones(3)] * 6)), ValueError,
     r"prune: p.w1 must have rank 4 \[L, C, rows, cols\], got shape \(3,\)"),
    (lambda: elsa.prune(ElsaParams.zeros(**_SIZES, lead=(1, 1))._replace(
        b3=jnp.full((1, 1, 3, 2), jnp.inf))), ValueError,
     r"prune: p.b3 must be finite, got inf in p.b3\(1, 1, 3, 2\)"),
])
def test_refusal_policy(call, error, message):
  """The same refusals as every entry point (elsa._validate): sizes are ints
  >= 1, dtypes floating, scales finite and >= 0; prune names the leaf at
  fault (it said "h must have a floating dtype" of integer parameters, and
  raised AttributeError for a tuple)."""
  with pytest.raises(error, match=message):
    call()


@pytest.mark.parametrize("call, message", [
    (lambda: ElsaParams.zeros(m=100, n=10, k=10, lead=(10,)),
     r"ElsaParams.zeros: m=100, n=10, k=10, v=10, lead=\(10,\) need at least"),
    (lambda: ElsaParams.init(jax.random.key(0), m=100, n=10, k=10, v=3,
                             lead=(10,)),
     r"ElsaParams.init: m=100, n=10, k=10, v=3, lead=\(10,\) need at least"),
])
def test_parameters_that_cannot_fit_are_refused_before_allocation(
    monkeypatch, call, message):
  """Against a device memory of 64 KiB (monkeypatched): refused by name
  before anything is allocated, instead of an array that never
  materialises."""
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**16)
  with pytest.raises(ValueError, match=message):
    call()
  # With room, the same call passes (traced only: nothing to compile).
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**40)
  jax.eval_shape(call)
