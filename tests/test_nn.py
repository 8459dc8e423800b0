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
