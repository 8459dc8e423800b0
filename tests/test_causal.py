"""Causal ELSA by chunks against a masked quadratic reference (numpy, [m, m])."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elsa
from elsa import ElsaParams
from helpers import rel_err

F64_RTOL = 1e-10
# float32 bound: the worst relative error (max abs error / max abs value)
# measured over the CASES below (5 seeds each, elsa and lsa, with and
# without a key mask) was 4.5e-7; asserted with a margin.
F32_RTOL = 1e-5


def np_causal(p, h, *, bias=True, mask=None):
  """Row ``i`` of ``(h W3 + B3) (h W1 + B1)^T (h W2 + B2)`` summed over the
  keys ``j <= i`` (and ``mask[j]``): the ``[m, m]`` attention matrix times a
  lower-triangular mask, in float64."""
  w1, w2, w3, b1, b2, b3 = (np.asarray(a, np.float64) for a in p)
  if not bias:
    b1, b2, b3 = 0.0, 0.0, 0.0
  h = np.asarray(h, np.float64)
  m = h.shape[-2]
  attention = (h @ w3 + b3) @ np.swapaxes(h @ w1 + b1, -1, -2)
  attention = attention * np.tril(np.ones((m, m)))
  if mask is not None:
    attention = attention * np.asarray(mask, np.float64)[..., None, :]
  return attention @ (h @ w2 + b2)


def random_params(rng, m, n, k, v, dtype, lead=()):
  shapes = dict(w1=(n, k), w2=(n, v), w3=(n, k), b1=(m, k), b2=(m, v),
                b3=(m, k))
  return ElsaParams(**{name: jnp.asarray(rng.normal(size=(*lead, *s)), dtype)
                       for name, s in shapes.items()})


# (m, chunk): m a multiple of the chunk, not a multiple, a chunk above m.
CASES = [(1, None), (7, 1), (7, 16), (64, 16), (64, 64), (1000, 16),
         (1000, 64), (1000, None)]


@pytest.mark.parametrize("dtype,rtol", [(jnp.float64, F64_RTOL),
                                        (jnp.float32, F32_RTOL)])
@pytest.mark.parametrize("m,chunk", CASES)
def test_causal_matches_masked_quadratic(m, chunk, dtype, rtol):
  rng = np.random.default_rng(m + (chunk or 0))
  n, k, v = 3, 2, 4
  p = random_params(rng, m, n, k, v, dtype)
  h = jnp.asarray(rng.normal(size=(2, m, n)), dtype)
  mask = rng.random((2, m)) < 0.7
  f = jax.jit(lambda p, h, mask: (
      elsa.elsa(p, h, causal=True, chunk=chunk),
      elsa.elsa(p, h, key_mask=mask, causal=True, chunk=chunk),
      elsa.lsa(p, h, key_mask=mask, causal=True, chunk=chunk)))
  plain, masked, linear = f(p, h, mask)
  assert plain.shape == (2, m, v) and plain.dtype == dtype
  assert rel_err(plain, np_causal(p, h)) < rtol
  assert rel_err(masked, np_causal(p, h, mask=mask)) < rtol
  assert rel_err(linear, np_causal(p, h, bias=False, mask=mask)) < rtol


def test_causal_batch_axes_vmap_and_key_mask_broadcast():
  rng = np.random.default_rng(1)
  m, n, k, v = 9, 3, 2, 3
  p = random_params(rng, m, n, k, v, jnp.float64)
  h = jnp.asarray(rng.normal(size=(2, 3, m, n)))
  mask = rng.random((3, m)) < 0.5  # broadcast over the first batch axis
  got = elsa.elsa(p, h, key_mask=mask, causal=True, chunk=4)
  assert rel_err(got, np_causal(p, h, mask=mask)) < F64_RTOL
  vmapped = jax.vmap(lambda x: elsa.elsa(p, x, key_mask=mask, causal=True,
                                         chunk=4))(h)
  assert rel_err(vmapped, got) < F64_RTOL


def test_causal_gradient_matches_quadratic_reference():
  rng = np.random.default_rng(2)
  m, n, k, v = 11, 3, 2, 3
  p = random_params(rng, m, n, k, v, jnp.float64)
  h = jnp.asarray(rng.normal(size=(2, m, n)))
  mask = jnp.asarray(rng.random((2, m)) < 0.7)
  weight = jnp.asarray(rng.normal(size=(2, m, v)))

  def reference(p, h):  # the [m, m] form in jnp
    attention = (h @ p.w3 + p.b3) @ jnp.swapaxes(h @ p.w1 + p.b1, -1, -2)
    attention = attention * jnp.tril(jnp.ones((m, m))) * mask[..., None, :]
    return jnp.sum(weight * (attention @ (h @ p.w2 + p.b2)))

  chunked = lambda p, h: jnp.sum(
      weight * elsa.elsa(p, h, key_mask=mask, causal=True, chunk=4))
  got = jax.jit(jax.grad(chunked, argnums=(0, 1)))(p, h)
  want = jax.grad(reference, argnums=(0, 1))(p, h)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(g, w) < F64_RTOL


def np_layer(p, h, coeffs=None, mask=None):
  """A layer as the sum of its causal components (columns scaled by coeffs)."""
  out = 0.0
  for c in range(p.w1.shape[0]):
    a = 1.0 if coeffs is None else np.asarray(coeffs)[..., c, None, :]
    out = out + np_causal(ElsaParams(*(x[c] for x in p)), h, mask=mask) * a
  return out


def test_causal_layer_and_stack():
  rng = np.random.default_rng(3)
  L, C, m, n, k = 3, 2, 10, 3, 2
  p = random_params(rng, m, n, k, n, jnp.float64, lead=(L, C))
  # Scaled down so that three cubic layers stay of order one.
  p = jax.tree.map(lambda a: 0.3 * a, p)
  h = jnp.asarray(rng.normal(size=(2, m, n)))
  coeffs = jnp.asarray(rng.normal(size=(2, L, C, n)))
  mask = rng.random((2, m)) < 0.7
  layer = elsa.elsa_layer(jax.tree.map(lambda a: a[0], p), h,
                          coeffs=coeffs[:, 0], key_mask=mask, causal=True,
                          chunk=3)
  want = np_layer(jax.tree.map(lambda a: a[0], p), h, coeffs[:, 0], mask)
  assert rel_err(layer, want) < F64_RTOL
  states = elsa.elsa_stack(p, h, coeffs=coeffs, key_mask=mask, causal=True,
                           chunk=4, return_all=True)
  state = np.asarray(h)
  for t in range(L):
    state = np_layer(jax.tree.map(lambda a: a[t], p), state, coeffs[:, t],
                     mask)
    assert rel_err(states[t + 1], state) < F64_RTOL


def test_non_causal_is_unchanged_by_chunk():
  rng = np.random.default_rng(4)
  p = random_params(rng, 6, 3, 2, 3, jnp.float64)
  h = jnp.asarray(rng.normal(size=(6, 3)))
  assert rel_err(elsa.elsa(p, h, chunk=2), elsa.elsa(p, h)) == 0


@pytest.mark.parametrize("prefix", [1, 5, 9, 10])
def test_a_causal_stack_on_a_prefix_is_the_prefix_of_its_output(prefix):
  """Laid out for m = 10 tokens, run on the first m' tokens with the first m'
  bias rows: a causal stack's rows are exactly the first m' rows of its
  output at m (row i never reads a later token); the non-causal component
  at m' is ELSA with the biases cut to m' rows."""
  rng = np.random.default_rng(5)
  L, C, m, n, k = 2, 2, 10, 3, 2
  p = jax.tree.map(lambda a: 0.3 * a,
                   random_params(rng, m, n, k, n, jnp.float64, lead=(L, C)))
  h = jnp.asarray(rng.normal(size=(2, m, n)))
  mask = rng.random((2, m)) < 0.7
  full = elsa.elsa_stack(p, h, key_mask=mask, causal=True, chunk=4)
  short = jax.jit(lambda p, h, mask: elsa.elsa_stack(
      p, h, key_mask=mask, causal=True, chunk=4))(p, h[:, :prefix],
                                                  mask[:, :prefix])
  assert short.shape == (2, prefix, n)
  assert rel_err(short, full[:, :prefix]) < F64_RTOL
  one = jax.tree.map(lambda a: a[0, 0], p)
  cut = one._replace(**{name: getattr(one, name)[:prefix]
                        for name in ("b1", "b2", "b3")})
  assert rel_err(elsa.elsa(one, h[:, :prefix]),
                 elsa.elsa(cut, h[:, :prefix])) == 0
  assert rel_err(elsa.elsa(one, h[:, :prefix], causal=True),
                 np_causal(cut, h[:, :prefix])) < F64_RTOL


@pytest.mark.parametrize("call,pattern", [
    (lambda p, h: elsa.elsa(p, h, causal=True, chunk=0),
     r"elsa: chunk must be an int >= 1, got 0"),
    (lambda p, h: elsa.lsa(p, h, causal=True, chunk=-3),
     r"lsa: chunk must be an int >= 1, got -3"),
    (lambda p, h: elsa.elsa(p, jnp.concatenate([h, h]), causal=True),
     r"elsa: p is laid out for m=6 tokens .* has 12; a stack runs on "
     r"prefixes of m <= 6 tokens only"),
    (lambda p, h: elsa.elsa(p, h, causal=True,
                            key_mask=np.tril(np.ones((6, 6), bool))),
     r"elsa: key_mask of shape \(6, 6\) looks like a per-query"),
])
def test_bad_causal_input_is_one_clear_line(call, pattern):
  rng = np.random.default_rng(6)
  p = random_params(rng, 6, 3, 2, 3, jnp.float64)
  h = jnp.asarray(rng.normal(size=(6, 3)))
  with pytest.raises(ValueError, match=pattern) as error:
    call(p, h)
  assert "\n" not in str(error.value)
