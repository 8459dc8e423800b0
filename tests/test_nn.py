"""Tests of elsa.nn: exact round trip with the pure functions, and the switches."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import elsa
from elsa import nn


def _params(seed, *, m, n, k, lead, dtype=jnp.float64, scale=0.3):
  return elsa.ElsaParams.init(jax.random.key(seed), m=m, n=n, k=k, lead=lead,
                              scale=scale, dtype=dtype)


def _h(seed, *shape, dtype=jnp.float64):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _assert_params_equal(a, b):
  for name, x, y in zip(elsa.ElsaParams._fields, a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("m,n,k,lead,batch", [
    (5, 3, 2, (), (7,)), (4, 2, 3, (), (2, 3))])
def test_elsa_round_trip(m, n, k, lead, batch):
  p = _params(0, m=m, n=n, k=k, lead=lead)
  h = _h(1, *batch, m, n)
  model = nn.Elsa.from_params(p)
  np.testing.assert_array_equal(np.asarray(jax.jit(model)(h)),
                                np.asarray(elsa.elsa(p, h)))
  _assert_params_equal(model.to_params(), p)


@pytest.mark.parametrize("m,n,k,c", [(5, 3, 2, 1), (6, 4, 5, 3)])
def test_layer_round_trip(m, n, k, c):
  p = _params(2, m=m, n=n, k=k, lead=(c,))
  h = _h(3, 4, m, n)
  model = nn.ElsaLayer.from_params(p)
  np.testing.assert_array_equal(np.asarray(model(h)),
                                np.asarray(elsa.elsa_layer(p, h)))
  _assert_params_equal(model.to_params(), p)


@pytest.mark.parametrize("m,n,k,depth,c,dtype", [
    (5, 3, 2, 1, 1, jnp.float64), (6, 4, 5, 4, 3, jnp.float64),
    (7, 5, 3, 3, 2, jnp.float32)])
def test_stack_round_trip(m, n, k, depth, c, dtype):
  p = _params(4, m=m, n=n, k=k, lead=(depth, c), dtype=dtype)
  h = _h(5, 3, m, n, dtype=dtype)
  model = nn.ElsaStack.from_params(p)
  out = model(h, return_all=True)
  assert out.dtype == dtype
  np.testing.assert_array_equal(
      np.asarray(out), np.asarray(elsa.elsa_stack(p, h, return_all=True)))
  _assert_params_equal(model.to_params(), p)
  # The constructed identity stack: a known map, not only self-consistency.
  ident = elsa.ElsaParams(*(jnp.broadcast_to(a, (depth, 1, *a.shape)) for a in
                            elsa.constructions.identity(m, n)))
  ident = jax.tree.map(lambda a: a.astype(dtype), ident)
  np.testing.assert_allclose(np.asarray(nn.ElsaStack.from_params(ident)(h)),
                             np.asarray(h), rtol=1e-5, atol=1e-5)


def test_functional_split_merge_matches_pure():
  p = _params(6, m=5, n=3, k=2, lead=(3, 2))
  h = _h(7, 2, 5, 3)
  graphdef, state = nnx.split(nn.ElsaStack.from_params(p))
  apply = jax.jit(lambda s, h: nnx.merge(graphdef, s)(h))
  np.testing.assert_array_equal(np.asarray(apply(state, h)),
                                np.asarray(elsa.elsa_stack(p, h)))


def test_no_bias_is_lsa():
  p = _params(8, m=5, n=3, k=4, lead=())
  h = _h(9, 3, 5, 3)
  model = nn.Elsa.from_params(p, use_bias=False)
  np.testing.assert_allclose(np.asarray(model(h)), np.asarray(elsa.lsa(p, h)),
                             rtol=1e-13)
  assert not any(hasattr(model, b) for b in ("b1", "b2", "b3"))
  exported = model.to_params()
  for b in (exported.b1, exported.b2, exported.b3):
    assert not np.asarray(b).any()
  # LSA is a homogeneous cubic; ELSA with these biases is not.
  np.testing.assert_allclose(np.asarray(model(2 * h)), 8 * np.asarray(model(h)),
                             rtol=1e-12)
  stack = nn.ElsaStack.from_params(_params(8, m=5, n=3, k=4, lead=(2, 2)),
                                   use_bias=False)
  np.testing.assert_allclose(np.asarray(stack(2 * h)),
                             2**9 * np.asarray(stack(h)), rtol=1e-11)


def test_tied_layers_share_parameters():
  layer = _params(10, m=5, n=3, k=2, lead=(1, 2))
  h = _h(11, 5, 3)
  model = nn.ElsaStack.from_params(layer, tied=True, depth=4)
  repeated = jax.tree.map(lambda a: jnp.repeat(a, 4, axis=0), layer)
  np.testing.assert_array_equal(np.asarray(model(h)),
                                np.asarray(elsa.elsa_stack(repeated, h)))
  assert nnx.state(model, nnx.Param)["w1"][...].shape == (1, 2, 3, 2)
  _assert_params_equal(model.to_params(), repeated)
  # Equal layers given at full depth are accepted; unequal ones are refused.
  nn.ElsaStack.from_params(repeated, tied=True)
  with pytest.raises(ValueError, match="differs across"):
    nn.ElsaStack.from_params(_params(12, m=5, n=3, k=2, lead=(3, 2)), tied=True)
  random = nn.ElsaStack.random(nnx.Rngs(0), m=5, n=3, k=2, components=2,
                               depth=6, tied=True, dtype=jnp.float64)
  assert random.to_params().w1.shape == (6, 2, 3, 2)


def _grads(model, h):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(h) ** 2)
  return jax.grad(loss)(params)


def test_frozen_blocks_are_not_params_and_stay_fixed():
  p = _params(13, m=5, n=3, k=2, lead=(2, 1))
  h = _h(14, 4, 5, 3)
  model = nn.ElsaStack.from_params(p, frozen=("w1", "b3"))
  trainable = nnx.state(model, nnx.Param)
  assert set(trainable.keys()) == {"w2", "w3", "b1", "b2"}
  optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
  optimizer.update(model, _grads(model, h))
  after = model.to_params()
  np.testing.assert_array_equal(np.asarray(after.w1), np.asarray(p.w1))
  np.testing.assert_array_equal(np.asarray(after.b3), np.asarray(p.b3))
  assert not np.allclose(np.asarray(after.w2), np.asarray(p.w2))
  with pytest.raises(ValueError, match="not leaves"):
    nn.ElsaStack.from_params(p, frozen=("w4",))


def test_mask_zeroes_blocks_and_their_gradients():
  p = _params(15, m=5, n=3, k=2, lead=(2, 1))
  h = _h(16, 4, 5, 3)
  w3_mask = jnp.zeros((3, 2)).at[0].set(1.0)
  mask = elsa.ElsaParams(w1=None, w2=None, w3=w3_mask, b1=0.0, b2=None,
                         b3=None)
  model = nn.ElsaStack.from_params(p, mask=mask)
  masked = p._replace(w3=p.w3 * w3_mask, b1=jnp.zeros_like(p.b1))
  np.testing.assert_array_equal(np.asarray(model(h)),
                                np.asarray(elsa.elsa_stack(masked, h)))
  _assert_params_equal(model.to_params(), masked)
  grads = _grads(model, h)
  assert not np.asarray(grads["b1"][...]).any()
  assert not np.asarray(grads["w3"][...][..., 1:, :]).any()
  assert np.asarray(grads["w3"][...][..., 0, :]).any()
  with pytest.raises(ValueError, match="does not broadcast"):
    nn.ElsaStack.from_params(p, mask=mask._replace(w2=jnp.ones((4, 4))))


def test_bad_params_raise():
  with pytest.raises(ValueError, match="rank 4"):
    nn.ElsaStack.from_params(_params(0, m=5, n=3, k=2, lead=(2,)))
  with pytest.raises(TypeError, match="ElsaParams"):
    nn.Elsa.from_params({"w1": jnp.ones((3, 2))})
  with pytest.raises(ValueError, match="depth"):
    nn.ElsaStack.from_params(_params(0, m=5, n=3, k=2, lead=(2, 1)), depth=3)


def test_random_defaults_to_jax_default_float():
  # float64 here (x64 is on in tests); an explicit dtype is kept.
  default = elsa.attention.float_dtype()
  assert default == jnp.float64
  modules = [nn.Elsa.random(nnx.Rngs(0), m=5, n=3, k=2),
             nn.ElsaLayer.random(nnx.Rngs(0), m=5, n=3, k=2, components=2),
             nn.ElsaStack.random(nnx.Rngs(0), m=5, n=3, k=2, components=2,
                                 depth=2)]
  for module in modules:
    assert all(leaf.dtype == default for leaf in module.to_params())
  f32 = nn.ElsaStack.random(nnx.Rngs(0), m=5, n=3, k=2, components=2, depth=2,
                            dtype=jnp.float32)
  assert all(leaf.dtype == jnp.float32 for leaf in f32.to_params())


def _np_residual_stack(p, h):
  """h <- h + sum_c (h W3 + B3)(h W1 + B1)^T (h W2 + B2), in numpy."""
  p = [np.asarray(a) for a in p]
  h = np.asarray(h)
  for t in range(p[0].shape[0]):
    out = 0
    for c in range(p[0].shape[1]):
      w1, w2, w3, b1, b2, b3 = (a[t, c] for a in p)
      q, k, v = h @ w3 + b3, h @ w1 + b1, h @ w2 + b2
      out = out + q @ np.swapaxes(k, -1, -2) @ v
    h = h + out
  return h


@pytest.mark.parametrize("m,n,k,depth,c,batch", [
    (5, 3, 2, 1, 1, (4,)), (6, 4, 5, 3, 2, (2, 3)), (7, 5, 3, 2, 3, ())])
def test_residual_stack_matches_numpy(m, n, k, depth, c, batch):
  p = _params(17, m=m, n=n, k=k, lead=(depth, c))
  h = _h(18, *batch, m, n)
  want = _np_residual_stack(p, h)
  got = nn.residual_stack(p, h, return_all=True)
  assert got.shape == (depth + 1, *batch, m, n)
  np.testing.assert_allclose(np.asarray(got[-1]), want, rtol=1e-10, atol=1e-12)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(h))
  model = nn.ElsaStack.from_params(p, residual=True)
  np.testing.assert_array_equal(np.asarray(model(h)),
                                np.asarray(nn.residual_stack(p, h)))
  _assert_params_equal(model.to_params(), p)
  # Without biases: LSA with the residual stream (von Oswald et al.).
  lsa = nn.ElsaStack.from_params(p, residual=True, use_bias=False)
  zero_bias = p._replace(b1=0 * p.b1, b2=0 * p.b2, b3=0 * p.b3)
  np.testing.assert_allclose(np.asarray(lsa(h)),
                             _np_residual_stack(zero_bias, h), rtol=1e-10,
                             atol=1e-12)
  # Zero weights: the residual stack is the identity (elsa_stack gives 0).
  zero = jax.tree.map(jnp.zeros_like, p)
  np.testing.assert_array_equal(np.asarray(nn.residual_stack(zero, h)),
                                np.asarray(h))


def _jnp_residual_stack(p, h, key_mask):
  """The residual stack in the order of attention code, ``(Q K^T) V``, in jnp."""
  for t in range(p.w1.shape[0]):
    out = 0
    for c in range(p.w1.shape[1]):
      w1, w2, w3, b1, b2, b3 = (a[t, c] for a in p)
      q, k, v = h @ w3 + b3, (h @ w1 + b1) * key_mask[:, None], h @ w2 + b2
      out = out + (q @ jnp.swapaxes(k, -1, -2)) @ v
    h = h + out
  return h


@pytest.mark.parametrize("depth,use_bias", [(2, True), (2, False),
                                            (6, True)])
def test_residual_stack_gradient_matches_plain_autodiff(depth, use_bias):
  # With reverse_only the per-item products have their own gradient
  # (nn._item_matmul): it must be jax.grad of the plain formula, in the
  # parameters and the input, unrolled (depth <= 4) and rolled, with and
  # without biases, under vmap. The default keeps forward mode: its jvp
  # agrees with the same gradient.
  p = _params(31, m=6, n=4, k=3, lead=(depth, 2))
  if not use_bias:
    p = p._replace(b1=0 * p.b1, b2=0 * p.b2, b3=0 * p.b3)
  h = _h(32, 3, 6, 4)
  key_mask = jnp.asarray([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
  cotangent = _h(33, 3, 6, 4)
  ours = lambda p, h: jnp.sum(cotangent * nn.residual_stack(
      p, h, key_mask=key_mask, use_bias=use_bias, reverse_only=True))
  plain = lambda p, h: jnp.sum(cotangent * _jnp_residual_stack(p, h,
                                                               key_mask))
  got = jax.grad(ours, argnums=(0, 1))(p, h)
  want = jax.grad(plain, argnums=(0, 1))(p, h)
  names = elsa.ElsaParams._fields if use_bias else ("w1", "w2", "w3")
  for name in names:
    np.testing.assert_allclose(np.asarray(getattr(got[0], name)),
                               np.asarray(getattr(want[0], name)),
                               rtol=1e-10, atol=1e-12, err_msg=name)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]),
                             rtol=1e-10, atol=1e-12)
  one = lambda h, g: jnp.sum(g * nn.residual_stack(
      p, h, key_mask=key_mask, use_bias=use_bias, reverse_only=True))
  per_item = jax.vmap(jax.grad(one))(h, cotangent)
  np.testing.assert_allclose(np.asarray(per_item), np.asarray(got[1]),
                             rtol=1e-10, atol=1e-12)
  direction = _h(34, 3, 6, 4)
  _, tangent = jax.jvp(lambda h: nn.residual_stack(
      p, h, key_mask=key_mask, use_bias=use_bias), (h,), (direction,))
  np.testing.assert_allclose(float(jnp.sum(cotangent * tangent)),
                             float(jnp.sum(got[1] * direction)), rtol=1e-10)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda h: nn.residual_stack(p, h, reverse_only=True), (h,),
            (direction,))


def test_residual_tied_float32_and_bad_input():
  layer = _params(19, m=5, n=3, k=2, lead=(1, 2), dtype=jnp.float32)
  h = _h(20, 4, 5, 3, dtype=jnp.float32)
  model = nn.ElsaStack.from_params(layer, tied=True, depth=3, residual=True)
  repeated = jax.tree.map(lambda a: jnp.repeat(a, 3, axis=0), layer)
  out = model(h)
  assert out.dtype == jnp.float32
  # float32 against the float64 reference: measured 2e-7 relative here.
  np.testing.assert_allclose(
      np.asarray(out), _np_residual_stack(
          jax.tree.map(lambda a: np.asarray(a, np.float64), repeated),
          np.asarray(h, np.float64)), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="p.w2 must have shape"):
    nn.residual_stack(layer._replace(w2=jnp.ones((1, 2, 4, 3), jnp.float32)),
                      h)
  with pytest.raises(TypeError):
    nn.residual_stack(layer, h.astype(jnp.float64))


def test_from_params_checks_leaves_when_built():
  p = _params(21, m=5, n=3, k=2, lead=(2, 1))
  # Rank right, shape wrong: refused at construction, not at the first call.
  with pytest.raises(ValueError, match=r"p.b2 must have shape \(2, 1, 5, 3\)"):
    nn.ElsaStack.from_params(p._replace(b2=p.b2[..., :2]))
  with pytest.raises(ValueError, match="p.w3 must have shape"):
    nn.ElsaStack.from_params(p._replace(w3=jnp.ones((2, 1, 3, 4))),
                             residual=True)
  with pytest.raises(TypeError):
    nn.ElsaStack.from_params(p._replace(w1=p.w1.astype(jnp.float32)))
  with pytest.raises(ValueError, match="elsa_layer: p.w3 must have shape"):
    nn.ElsaLayer.from_params(_params(21, m=5, n=3, k=2, lead=(2,))._replace(
        w1=jnp.ones((2, 3, 4))))
  with pytest.raises(ValueError, match="p.b3 must have shape"):
    nn.Elsa.from_params(_params(21, m=5, n=3, k=2, lead=())._replace(
        b3=jnp.ones((4, 2))))
  # LSA ignores the biases (elsa.lsa's rule): their shapes are not checked.
  nn.Elsa.from_params(_params(21, m=5, n=3, k=2, lead=())._replace(
      b3=jnp.ones((4, 2))), use_bias=False)
  # A stack whose v != n cannot be a stack.
  with pytest.raises(ValueError, match="p.w2"):
    nn.ElsaStack.from_params(_params(21, m=5, n=3, k=2, lead=(1, 1))._replace(
        w2=jnp.ones((1, 1, 3, 2)), b2=jnp.ones((1, 1, 5, 2))))
