"""Tests for elsa.constructions: each construction against a numpy reference.

Every construction is checked on fresh random inputs of several shapes:
float64 to 1e-12 relative (max-abs error over max-abs reference), float32 to
the bound F32_TOL measured by ``python tests/test_constructions.py`` (see
docs/guides/constructions.md), and products are checked to be EXACTLY zero
outside the block they name. The LSA contrast shows the bias-free baseline
cannot fit the identity map on pairs {h, 2h}.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import elsa
from elsa import _validate, constructions as C
from helpers import rel_err

F64_TOL = 1e-12
# Largest float32 relative error measured on CPU (`python
# tests/test_constructions.py`): 3.1e-7 (product3, m = 40); ~6x margin.
F32_TOL = 2e-6
# Compiled once per shape: faster than op-by-op dispatch, and what users run.
ELSA = jax.jit(elsa.elsa)
LSA = jax.jit(elsa.lsa)
TOL = {np.float64: F64_TOL, np.float32: F32_TOL}
DTYPES = [np.float64, np.float32]


def assert_close(out, ref, dtype):
  assert np.asarray(out).dtype == dtype
  err = rel_err(out, ref)
  assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:.0e}"


def normal(rng, shape, dtype):
  return rng.standard_normal(shape).astype(dtype)


def zero_outside(h, rows, cols):
  """Zeroes h[t, cols] for rows t not in ``rows`` (None: all rows allowed)."""
  if rows is not None:
    outside = [t for t in range(h.shape[0]) if t not in rows]
    h[np.ix_(outside, list(cols))] = 0
  return h


# ---------------------------------------------------------------- constant

CONSTANT_SHAPES = [(1, 1, 1), (3, 5, 2), (5, 2, 4), (4, 4, 4), (2, 7, 9),
                   (6, 3, 1)]  # (m, n, v): m < n, m >= n, v > m, v < m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,v", CONSTANT_SHAPES)
def test_constant(m, n, v, dtype):
  rng = np.random.default_rng(0)
  c = normal(rng, (m, v), dtype)
  p = C.constant(c, n)
  for h in [normal(rng, (m, n), dtype) for _ in range(3)] + [
      np.zeros((m, n), dtype)]:
    assert_close(ELSA(p, h), c, dtype)


def test_constant_is_traceable():
  h = np.ones((3, 2))
  f = jax.jit(lambda c: ELSA(C.constant(c, 2), h))
  c = np.arange(12.0).reshape(3, 4)
  np.testing.assert_array_equal(f(c), c)


# -------------------------------------------------------- identity, linear

SHAPES = [(1, 1), (2, 5), (5, 2), (4, 4), (7, 3), (3, 8)]  # (m, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", SHAPES)
def test_identity(m, n, dtype):
  rng = np.random.default_rng(1)
  p = C.identity(m, n, dtype=dtype)
  assert p.k == min(m, n)
  for _ in range(3):
    h = normal(rng, (m, n), dtype)
    assert_close(ELSA(p, h), h, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,v", [(1, 1, 1), (2, 5, 4), (5, 2, 1), (4, 4, 6),
                                   (3, 8, 3)])
def test_linear(m, n, v, dtype):
  rng = np.random.default_rng(2)
  P, Q = normal(rng, (m, m), dtype), normal(rng, (n, v), dtype)
  p_general, p_right = C.linear(P, Q), C.linear(None, Q, m=m)
  assert p_general.k == m  # default k = m: any P
  for _ in range(3):
    h = normal(rng, (m, n), dtype)
    h64 = h.astype(np.float64)
    assert_close(ELSA(p_general, h), P.astype(np.float64) @ h64 @ Q, dtype)
    assert_close(ELSA(p_right, h), h64 @ Q.astype(np.float64), dtype)


@pytest.mark.parametrize("m,rank", [(5, 1), (6, 3), (4, 4)])
def test_linear_low_rank_factors_use_k_equal_rank(m, rank):
  """P = U V^T of rank r is reached with inner width k = r."""
  rng = np.random.default_rng(3)
  U, V, Q = (rng.standard_normal(s) for s in [(m, rank), (m, rank), (3, 2)])
  p = C.linear((U, V), Q)
  assert p.k == rank
  h = rng.standard_normal((m, 3))
  assert_close(ELSA(p, h), U @ V.T @ h @ Q, np.float64)


def test_linear_nested_tuple_matrix_is_a_matrix_not_factors():
  P = ((1.0, 2.0), (3.0, 4.0))
  p = C.linear(P, np.eye(3))
  h = np.random.default_rng(4).standard_normal((2, 3))
  assert_close(ELSA(p, h), np.asarray(P) @ h, np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_linear(dtype):
  rng = np.random.default_rng(5)
  m, n, rows = 6, 4, [4, 1, 2]
  Q = normal(rng, (n, n), dtype)
  h = normal(rng, (m, n), dtype)
  ref = np.zeros((m, n))
  ref[rows] = h[rows].astype(np.float64) @ Q
  out = ELSA(C.rows_linear(rows, Q, m=m), h)
  assert_close(out, ref, dtype)
  assert np.all(np.asarray(out)[[0, 3, 5]] == 0)


def test_linear_traced_q_under_vmap():
  """A sweep passes traced step sizes inside Q."""
  h = np.random.default_rng(6).standard_normal((4, 3))
  etas = np.array([0.1, 0.5, 2.0])
  out = jax.vmap(lambda e: ELSA(C.linear(None, e * jnp.eye(3), m=4), h))(
      etas)
  assert_close(out, etas[:, None, None] * h, np.float64)


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 6), n=st.integers(1, 6), v=st.integers(1, 6),
       seed=st.integers(0, 2**31 - 1))
def test_property_constant_identity_linear(m, n, v, seed):
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((m, n))
  c, P, Q = (rng.standard_normal(s) for s in [(m, v), (m, m), (n, v)])
  assert_close(ELSA(C.constant(c, n), h), c, np.float64)
  assert_close(ELSA(C.identity(m, n, dtype=np.float64), h), h, np.float64)
  assert_close(ELSA(C.linear(P, Q), h), P @ h @ Q, np.float64)
  assert_close(ELSA(C.linear(None, Q, m=m), h), h @ Q, np.float64)


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 5), n=st.integers(1, 5), c=st.floats(-4, 4),
       seed=st.integers(0, 2**31 - 1))
def test_property_identity_commutes_with_scaling(m, n, c, seed):
  """ELSA's skip is linear in h; LSA scales as c^3 (see the contrast below)."""
  h = np.random.default_rng(seed).standard_normal((m, n))
  p = C.identity(m, n, dtype=np.float64)
  np.testing.assert_allclose(ELSA(p, c * h), c * h, rtol=0, atol=1e-12)


# ------------------------------------------------------------- products

# (m, n, v, a_rows, a_cols, b_rows, b_cols, out_cols)
PRODUCT2_LAYOUTS = [
    (6, 5, None, [0, 1, 2], [0, 1], [3, 4], [2, 3, 4], [0, 1, 2]),
    (7, 6, None, [5, 1, 3], [4, 0], [0, 6], [1, 2], [5, 3]),
    (4, 4, None, None, [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3],
     [0, 1, 2, 3]),                                        # h @ h
    (5, 6, 3, [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]),  # A @ A
    (2, 5, 7, [0, 1], [0, 1], [0, 1], [2, 3, 4], [6, 0, 3]),  # m < n, v > n
]


def product2_case(rng, layout, dtype):
  m, n, v, a_rows, a_cols, b_rows, b_cols, out_cols = layout
  h = zero_outside(normal(rng, (m, n), dtype), a_rows, a_cols)
  rows = list(range(m)) if a_rows is None else a_rows
  h64 = h.astype(np.float64)
  ref = np.zeros((m, n if v is None else v))
  ref[np.ix_(rows, out_cols)] = (h64[np.ix_(rows, a_cols)]
                                 @ h64[np.ix_(b_rows, b_cols)])
  return h, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", PRODUCT2_LAYOUTS)
def test_product2(layout, dtype):
  m, n, v, a_rows, a_cols, b_rows, b_cols, out_cols = layout
  p = C.product2(m=m, n=n, v=v, a_rows=a_rows, a_cols=a_cols, b_rows=b_rows,
                 b_cols=b_cols, out_cols=out_cols, dtype=dtype)
  rng = np.random.default_rng(7)
  for _ in range(3):
    h, ref = product2_case(rng, layout, dtype)
    if a_rows is not None:
      C.check_layout(h, rows=a_rows, cols=a_cols)
    out = ELSA(p, h)
    assert_close(out, ref, dtype)
    assert np.all(np.asarray(out)[ref == 0] == 0), "nonzero outside the block"


# (m, n, v, b_cols, c_cols, out_rows, out_cols)
GRAM_LAYOUTS = [
    (6, 4, None, [0, 1], [0, 1], [4, 5], [2, 3]),         # X^T X
    (5, 3, 6, [2], [0, 1, 2], [0], [5, 4, 3]),
    (3, 6, None, [0, 1, 2], [3, 4, 5], [2, 0, 1], [0, 1, 2]),  # m < n
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", GRAM_LAYOUTS)
def test_gram(layout, dtype):
  m, n, v, b_cols, c_cols, out_rows, out_cols = layout
  p = C.gram(m=m, n=n, v=v, b_cols=b_cols, c_cols=c_cols, out_rows=out_rows,
             out_cols=out_cols, dtype=dtype)
  rng = np.random.default_rng(8)
  for _ in range(3):
    h = normal(rng, (m, n), dtype)
    h64 = h.astype(np.float64)
    ref = np.zeros((m, n if v is None else v))
    ref[np.ix_(out_rows, out_cols)] = h64[:, b_cols].T @ h64[:, c_cols]
    out = ELSA(p, h)
    assert_close(out, ref, dtype)
    assert np.all(np.asarray(out)[ref == 0] == 0), "nonzero outside the block"


def test_gram_of_data_rows_is_the_block_product():
  """X^T y of data tokens, with other tokens holding data in other columns."""
  rng = np.random.default_rng(9)
  x, y = rng.standard_normal((5, 2)), rng.standard_normal((5, 1))
  h = np.zeros((8, 5))
  h[:5, :2], h[:5, 2:3] = x, y
  h[5:, 3:] = rng.standard_normal((3, 2))   # e.g. queries, state
  p = C.gram(m=8, n=5, b_cols=[0, 1], c_cols=[2], out_rows=[6, 7],
             out_cols=[4], scale=0.2, dtype=np.float64)
  out = np.array(ELSA(p, h))
  assert_close(out[6:8, 4:5], 0.2 * x.T @ y, np.float64)
  out[6:8, 4:5] = 0
  assert np.all(out == 0)


# (m, n, v, a_rows, a_cols, bc_rows, b_cols, c_cols, out_cols)
PRODUCT3_LAYOUTS = [
    # Newton-Schulz shaped: M in rows 0-1, A and a second M in rows 2-3.
    (4, 6, None, [0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [2, 3]),
    (5, 3, None, None, [0, 1, 2], None, [0, 1, 2], [0, 1, 2],
     [0, 1, 2]),                                          # X X^T X
    (6, 5, 7, [1, 3], [0, 1], [1, 3], [1, 2], [0, 4], [6, 2]),  # shared rows
    (7, 4, None, [6, 0], [3], [1, 2, 4], [0], [1, 2], [3, 0]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", PRODUCT3_LAYOUTS)
def test_product3(layout, dtype):
  m, n, v, a_rows, a_cols, bc_rows, b_cols, c_cols, out_cols = layout
  p = C.product3(m=m, n=n, v=v, a_rows=a_rows, a_cols=a_cols,
                 bc_rows=bc_rows, b_cols=b_cols, c_cols=c_cols,
                 out_cols=out_cols, dtype=dtype)
  rows = list(range(m)) if a_rows is None else a_rows
  brows = list(range(m)) if bc_rows is None else bc_rows
  rng = np.random.default_rng(10)
  for _ in range(3):
    h = normal(rng, (m, n), dtype)
    zero_outside(h, bc_rows, sorted(set(b_cols) | set(c_cols)))
    zero_outside(h, a_rows, a_cols)
    C.check_layout(h, rows=rows, cols=a_cols)
    C.check_layout(h, rows=brows, cols=b_cols)
    h64 = h.astype(np.float64)
    A, B, Cm = (h64[np.ix_(r, c)] for r, c in
                [(rows, a_cols), (brows, b_cols), (brows, c_cols)])
    ref = np.zeros((m, n if v is None else v))
    ref[np.ix_(rows, out_cols)] = A @ B.T @ Cm
    out = ELSA(p, h)
    assert_close(out, ref, dtype)
    assert np.all(np.asarray(out)[ref == 0] == 0), "nonzero outside the block"


def test_products_take_traced_scale():
  rng = np.random.default_rng(11)
  h = rng.standard_normal((4, 4))
  builders = {
      "product2": lambda s: C.product2(m=4, n=4, a_cols=[0, 1], b_rows=[2, 3],
                                       b_cols=[3], out_cols=[2], scale=s,
                                       dtype=np.float64),
      "gram": lambda s: C.gram(m=4, n=4, b_cols=[0], c_cols=[1], out_rows=[3],
                               out_cols=[0], scale=s, dtype=np.float64),
      "product3": lambda s: C.product3(m=4, n=4, a_cols=[0], b_cols=[1],
                                       c_cols=[2], out_cols=[3], scale=s,
                                       dtype=np.float64),
  }
  for name, build in builders.items():
    unit = np.asarray(ELSA(build(1.0), h))
    assert np.abs(unit).max() > 0, name
    scaled = jax.jit(lambda s: ELSA(build(s), h))(-0.7)
    assert_close(scaled, -0.7 * unit, np.float64)
    grad = jax.grad(lambda s: ELSA(build(s), h).sum())(0.3)
    np.testing.assert_allclose(grad, unit.sum(), rtol=1e-12)


# --------------------------------------------------------- invalid layouts

INVALID = [
    (C.product2, dict(m=4, n=4, a_cols=[0, 1], b_rows=[2], b_cols=[3],
                      out_cols=[3]), "a_cols and b_rows must have the same"),
    (C.product2, dict(m=4, n=4, a_cols=[0], b_rows=[2], b_cols=[2, 3],
                      out_cols=[3]), "b_cols and out_cols must have the same"),
    (C.product2, dict(m=4, n=4, a_cols=[0], b_rows=[2], b_cols=[3],
                      out_cols=[4]), r"out_cols=\[4\] has indices \[4\] outside"),
    (C.product2, dict(m=4, n=4, v=2, a_cols=[0], b_rows=[2], b_cols=[3],
                      out_cols=[2]), "outside the 2 output columns"),
    (C.product2, dict(m=4, n=4, a_cols=[4], b_rows=[2], b_cols=[3],
                      out_cols=[3]), "a_cols"),
    (C.product2, dict(m=4, n=4, a_cols=[0], b_rows=[-1], b_cols=[3],
                      out_cols=[3]), r"b_rows=\[-1\] has indices"),
    (C.product2, dict(m=4, n=4, a_cols=[0, 1], b_rows=[2, 2], b_cols=[3],
                      out_cols=[3]), r"b_rows=\[2, 2\] repeats \[2\]"),
    (C.product2, dict(m=4, n=4, a_cols=[], b_rows=[], b_cols=[3],
                      out_cols=[3]), "a_cols is empty"),
    (C.product2, dict(m=4, n=4, a_rows=[0, 1], a_cols=[0, 1], b_rows=[2, 3],
                      b_cols=[1, 2], out_cols=[1, 2]),
     r"block B has cells in rows \[2, 3\] and columns \[1\]"),
    (C.product2, dict(m=4, n=4, a_cols=[0], b_rows=[2], b_cols=[3],
                      out_cols=[3], scale=np.ones(2)), "scale must be a scalar"),
    (C.product2, dict(m=0, n=4, a_cols=[0], b_rows=[2], b_cols=[3],
                      out_cols=[3]), "m must be an int >= 1"),
    (C.gram, dict(m=4, n=4, b_cols=[0, 1], c_cols=[2], out_rows=[0],
                  out_cols=[0]), "b_cols and out_rows must have the same"),
    (C.gram, dict(m=4, n=4, b_cols=[0], c_cols=[2, 3], out_rows=[0],
                  out_cols=[0]), "c_cols and out_cols must have the same"),
    (C.gram, dict(m=4, n=4, b_cols=[0], c_cols=[2], out_rows=[4],
                  out_cols=[0]), "out_rows"),
    (C.product3, dict(m=4, n=4, a_cols=[0, 1], b_cols=[2], c_cols=[3],
                      out_cols=[0]), "a_cols and b_cols must have the same"),
    (C.product3, dict(m=4, n=4, a_cols=[0], b_cols=[2], c_cols=[3],
                      out_cols=[0, 1]), "c_cols and out_cols must have the same"),
    (C.product3, dict(m=4, n=6, a_rows=[0, 1], a_cols=[0, 1], bc_rows=[2, 3],
                      b_cols=[2, 3], c_cols=[0, 1], out_cols=[4, 5]),
     r"block C has cells in rows \[2, 3\]"),
    (C.product3, dict(m=4, n=6, a_rows=[0, 1], a_cols=[0, 1], b_cols=[1, 2],
                      c_cols=[3], out_cols=[4]), "block B has cells"),
    (C.product3, dict(m=4, n=4, a_cols=[0], b_cols=[1], c_cols=[2],
                      bc_rows=[1, 1], out_cols=[3]), "bc_rows=.* repeats"),
    (C.rows_linear, dict(rows=[0, 0], Q=np.eye(2), m=3), "repeats"),
    (C.rows_linear, dict(rows=[3], Q=np.eye(2), m=3), "outside the 3 rows"),
    (C.linear, dict(P=np.ones((2, 3)), Q=np.eye(2)), r"P must have shape \[m, m\]"),
    (C.linear, dict(P=(np.ones((3, 2)), np.ones((3, 1))), Q=np.eye(2)),
     "factors"),
    (C.linear, dict(P=np.eye(3), Q=np.eye(2), m=4), "P has 3 rows but m=4"),
    (C.linear, dict(P=None, Q=np.eye(2)), "pass m"),
    (C.constant, dict(c=np.ones(3), n=2), r"c must have shape \[m, v\]"),
]


@pytest.mark.parametrize("fn,kwargs,match", INVALID,
                         ids=[f"{f.__name__}-{i}" for i, (f, _, _)
                              in enumerate(INVALID)])
def test_invalid_layout_raises(fn, kwargs, match):
  with pytest.raises(ValueError, match=match):
    fn(**kwargs)


def test_non_integer_indices_raise_type_error():
  with pytest.raises(TypeError, match="a_cols must be a 1-d sequence of ints"):
    C.product2(m=4, n=4, a_cols=[0.5], b_rows=[2], b_cols=[3], out_cols=[3])
  with pytest.raises(TypeError, match="must be static"):
    jax.jit(lambda r: C.rows_linear(r, np.eye(2), m=3))(jnp.array([0]))


def test_check_layout():
  h = np.zeros((4, 3))
  h[:2, :2] = 1.0
  h[2:, 2] = 5.0
  C.check_layout(h, rows=[0, 1], cols=[0, 1])
  C.check_layout(h[None].repeat(2, 0), rows=[0, 1], cols=[0, 1])  # batched
  h[3, 1] = 0.5
  with pytest.raises(ValueError, match=r"rows \[3\] are nonzero"):
    C.check_layout(h, rows=[0, 1], cols=[0, 1])


# --------------------------------------------------------- layers, stacks

def test_layer_sums_components_of_different_widths():
  """Skip + product2 + constant in one layer: h + A@B (in its block) + c."""
  rng = np.random.default_rng(12)
  m, n = 5, 4
  c = rng.standard_normal((m, n))
  prod = C.product2(m=m, n=n, a_rows=[0, 1], a_cols=[0], b_rows=[4],
                    b_cols=[2, 3], out_cols=[2, 3], dtype=np.float64)
  parts = [C.identity(m, n, dtype=np.float64), prod, C.constant(c, n)]
  assert sorted({q.k for q in parts}) == [1, 4]
  lay = C.layer(*parts)
  assert lay.w1.shape == (3, n, 4)
  h = zero_outside(rng.standard_normal((m, n)), [0, 1], [0])
  ref = h + c
  ref[:2, 2:] += h[:2, [0]] @ h[[4], 2:]
  assert_close(elsa.elsa_layer(lay, h), ref, np.float64)


def test_stack_mixes_components_layers_and_stacks():
  rng = np.random.default_rng(13)
  m, n = 4, 3
  Q = rng.standard_normal((n, n))
  skip = C.identity(m, n, dtype=np.float64)
  one = C.layer(skip, C.linear(None, Q, m=m))                  # h (I + Q)
  two = C.stack(C.rows_linear([1, 2], Q, m=m), one)            # [2, 2, ...]
  full = C.stack(one, C.gram(m=m, n=n, b_cols=[0], c_cols=[1, 2], out_rows=[3],
                             out_cols=[1, 2], dtype=np.float64), two)
  assert full.w1.shape[:2] == (4, 2)
  h = rng.standard_normal((m, n))
  state = h @ (np.eye(n) + Q)
  g = np.zeros((m, n))
  g[3, 1:] = state[:, 0] @ state[:, 1:]
  state = g
  r = np.zeros((m, n))
  r[[1, 2]] = state[[1, 2]] @ Q
  state = r @ (np.eye(n) + Q)
  assert_close(elsa.elsa_stack(full, h), state, np.float64)


def test_layer_and_stack_refuse_mismatched_parts():
  with pytest.raises(ValueError, match="share"):
    C.layer(C.identity(3, 2), C.identity(4, 2))
  with pytest.raises(TypeError, match="dtype"):
    C.layer(C.identity(3, 2, dtype=np.float32),
            C.identity(3, 2, dtype=np.float64))
  with pytest.raises(ValueError, match="share"):
    C.stack(C.identity(3, 2), C.identity(3, 3))
  with pytest.raises(ValueError, match="at least one"):
    C.layer()


# ---------------------------------------------------------- LSA contrast

# min over y of ||y - h||^2 + ||8y - 2h||^2 is at y = 17/65 h and equals
# (2340/4225) ||h||^2; over the target energy 5 ||h||^2 that is 36/325.
LSA_FLOOR = 36 / 325


def test_lsa_is_a_homogeneous_cubic():
  rng = np.random.default_rng(14)
  p = elsa.ElsaParams.init(jax.random.key(0), m=5, n=3, k=4, dtype=jnp.float64)
  h = rng.standard_normal((5, 3))
  for c in [2.0, -0.5, 3.0]:
    assert_close(LSA(p, c * h), c**3 * LSA(p, h), np.float64)
  assert np.all(np.asarray(LSA(p, np.zeros((5, 3)))) == 0)
  # ELSA with a constant component is nonzero at h = 0, which LSA never is.
  c = rng.standard_normal((5, 3))
  assert_close(ELSA(C.constant(c, 3), np.zeros((5, 3))), c, np.float64)


def _fit_lsa_to_identity(hs, *, k, steps, seed):
  """Adam on random LSA params for the identity on {h, 2h}; returns (p, losses)."""
  m, n = hs.shape[-2:]
  targets = jnp.concatenate([hs, 2 * hs])
  energy = jnp.sum(targets**2)

  def loss(p):
    return jnp.sum((LSA(p, targets) - targets)**2) / energy

  p = elsa.ElsaParams.init(jax.random.key(seed), m=m, n=n, k=k,
                           dtype=jnp.float64)
  opt = optax.adam(1e-2)
  state = opt.init(p)

  @jax.jit
  def step(p, state):
    value, grad = jax.value_and_grad(loss)(p)
    updates, state = opt.update(grad, state)
    return optax.apply_updates(p, updates), state, value

  losses = []
  for _ in range(steps):
    p, state, value = step(p, state)
    losses.append(float(value))
  return p, np.array(losses + [float(loss(p))])


def test_lsa_cannot_fit_identity_but_elsa_is_exact():
  rng = np.random.default_rng(15)
  m, n = 4, 3
  hs = rng.standard_normal((16, m, n))
  p, losses = _fit_lsa_to_identity(jnp.asarray(hs), k=6, steps=400, seed=1)
  # Adam did its job: the loss fell a long way from the random start ...
  assert losses[-1] < 0.5 * losses[0]
  # ... yet stays above the floor for every pair, as the cubic scaling forces.
  assert losses[-1] >= LSA_FLOOR * (1 - 1e-9)
  for h in hs:
    err = (np.sum((LSA(p, h) - h)**2)
           + np.sum((LSA(p, 2 * h) - 2 * h)**2))
    assert err >= LSA_FLOOR * 5 * np.sum(h**2) * (1 - 1e-9)
  # One ELSA component is the identity to rounding on the same pairs.
  skip = C.identity(m, n, dtype=np.float64)
  both = np.concatenate([hs, 2 * hs])
  assert rel_err(ELSA(skip, both), both) <= F64_TOL


# ------------------------------------------- error bounds (measured, CPU)

def _max_errors(dtype, draws: int = 200) -> dict[str, float]:
  """Worst relative error of each construction over random draws, in ``dtype``."""
  rng = np.random.default_rng(2024)
  worst = dict.fromkeys(["constant", "identity", "linear", "linear_P=I",
                         "product2", "gram", "product3"], 0.0)
  for _ in range(draws):
    m, n, v = (int(x) for x in rng.integers(1, 9, size=3))
    h = normal(rng, (m, n), dtype)
    h64 = h.astype(np.float64)
    c, P, Q = (normal(rng, s, dtype) for s in [(m, v), (m, m), (n, v)])
    checks = {
        "constant": (C.constant(c, n), c),
        "identity": (C.identity(m, n, dtype=dtype), h),
        "linear": (C.linear(P, Q), P.astype(np.float64) @ h64 @ Q),
        "linear_P=I": (C.linear(None, Q, m=m), h64 @ Q.astype(np.float64)),
    }
    for name, (p, ref) in checks.items():
      worst[name] = max(worst[name], rel_err(ELSA(p, h), ref))
  for layout in PRODUCT2_LAYOUTS:
    m, n, v, a_rows, a_cols, b_rows, b_cols, out_cols = layout
    p = C.product2(m=m, n=n, v=v, a_rows=a_rows, a_cols=a_cols, b_rows=b_rows,
                   b_cols=b_cols, out_cols=out_cols, dtype=dtype)
    for _ in range(draws // 5):
      h, ref = product2_case(rng, layout, dtype)
      worst["product2"] = max(worst["product2"], rel_err(ELSA(p, h), ref))
  for m, n, v, b_cols, c_cols, out_rows, out_cols in GRAM_LAYOUTS:
    p = C.gram(m=m, n=n, v=v, b_cols=b_cols, c_cols=c_cols, out_rows=out_rows,
               out_cols=out_cols, dtype=dtype)
    for _ in range(draws // 5):
      h = normal(rng, (m, n), dtype)
      h64 = h.astype(np.float64)
      ref = np.zeros((m, n if v is None else v))
      ref[np.ix_(out_rows, out_cols)] = h64[:, b_cols].T @ h64[:, c_cols]
      worst["gram"] = max(worst["gram"], rel_err(ELSA(p, h), ref))
  p = C.product3(m=40, n=12, a_cols=range(4), b_cols=range(4, 8),
                 c_cols=range(8, 12), out_cols=range(4), dtype=dtype)
  for _ in range(draws // 5):
    h = normal(rng, (40, 12), dtype)
    h64 = h.astype(np.float64)
    ref = np.zeros((40, 12))
    ref[:, :4] = h64[:, :4] @ h64[:, 4:8].T @ h64[:, 8:]
    worst["product3"] = max(worst["product3"], rel_err(ELSA(p, h), ref))
  return worst


if __name__ == "__main__":
  jax.config.update("jax_enable_x64", True)
  print(f"backend: {jax.default_backend()}")
  for dtype in DTYPES:
    for name, err in _max_errors(dtype).items():
      print(f"{np.dtype(dtype).name:8s} {name:12s} max relative error {err:.2e}")


def test_selector_and_placement_pick_and_move():
  h = np.arange(20.0).reshape(5, 4)
  s = C.selector(5, [3, 0], dtype=jnp.float64)
  np.testing.assert_array_equal(np.asarray(s).T @ h, h[[3, 0]])
  c = C.selector(4, [2], dtype=jnp.float64)
  np.testing.assert_array_equal(h @ np.asarray(c), h[:, [2]])
  move = C.placement([0, 3], [2, 0], shape=(4, 3),
                                 dtype=jnp.float64)
  moved = h @ np.asarray(move)
  np.testing.assert_array_equal(moved[:, 2], h[:, 0])
  np.testing.assert_array_equal(moved[:, 0], h[:, 3])
  np.testing.assert_array_equal(moved[:, 1], 0)


@pytest.mark.parametrize("call,pattern", [
    (lambda: C.selector(3, [3]), "idx"),
    (lambda: C.selector(3, [1, 1]), "idx"),
    (lambda: C.placement([0, 1], [0], shape=(2, 2)), "src.*dst"),
    (lambda: C.placement([0], [2], shape=(2, 2)), "dst"),
    (lambda: C.placement([0], [0], shape=(2,)), "shape"),
])
def test_selector_and_placement_refuse_bad_indices(call, pattern):
  with pytest.raises(ValueError, match=pattern):
    call()


# ------------------------------------------- defaults, exact assembly, padding

_DEFAULT_BUILDERS = {
    "placement": lambda: C.placement([0, 2], [1, 0], shape=(3, 2)),
    "selector": lambda: C.selector(4, [3, 1]),
    "identity": lambda: C.identity(3, 2),
    "product2": lambda: C.product2(m=4, n=4, a_rows=[0, 1], a_cols=[0, 1],
                                   b_rows=[2, 3], b_cols=[2, 3],
                                   out_cols=[2, 3]),
    "gram": lambda: C.gram(m=4, n=3, b_cols=[0], c_cols=[1], out_rows=[2],
                           out_cols=[2]),
    "product3": lambda: C.product3(m=4, n=4, a_cols=[0], b_cols=[1],
                                   c_cols=[2], out_cols=[3]),
}


@pytest.mark.parametrize("name", sorted(_DEFAULT_BUILDERS))
def test_default_dtype_is_jax_default_float(name):
  """float64 under jax_enable_x64 (the test session), float32 without it."""
  leaves = lambda: jax.tree.leaves(_DEFAULT_BUILDERS[name]())
  assert {a.dtype for a in leaves()} == {jnp.dtype(jnp.float64)}
  with jax.enable_x64(False):
    assert {a.dtype for a in leaves()} == {jnp.dtype(jnp.float32)}


def _dot_count(fn, *args) -> int:
  """How many matmuls (dot_general) building the parameters traces."""
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_parameters_are_placed_not_multiplied():
  """No matmul builds a parameter: at default precision a float32 matmul
  runs in bf16/TF32 on TPUs and Ampere+ GPUs and would round the entries."""
  rng = np.random.default_rng(40)
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  U, Q_tall = f32(5, 2), f32(3, 4)
  builders = [
      (lambda Q: C.linear(None, Q, m=5), Q_tall),       # m >= n: B2 = [Q; 0]
      (lambda Q: C.linear(None, Q, m=2), Q_tall),       # m < n
      (lambda P: C.linear(P, Q_tall), f32(5, 5)),
      (lambda U: C.linear((U, U), Q_tall), U),
      (lambda Q: C.rows_linear([1, 3], Q, m=5), Q_tall),
      (lambda c: C.constant(c, 3), f32(5, 4)),
      (lambda s: C.product2(m=4, n=4, a_rows=[0, 1], a_cols=[0, 1],
                            b_rows=[2, 3], b_cols=[2, 3], out_cols=[2, 3],
                            scale=s, dtype=jnp.float32), jnp.float32(0.3)),
      (lambda s: C.gram(m=4, n=3, b_cols=[0, 1], c_cols=[2], out_rows=[2, 3],
                        out_cols=[0], scale=s, dtype=jnp.float32),
       jnp.float32(0.3)),
      (lambda s: C.product3(m=4, n=4, a_cols=[0], b_cols=[1], c_cols=[2],
                            out_cols=[3], scale=s, dtype=jnp.float32),
       jnp.float32(0.3)),
  ]
  for i, (build, arg) in enumerate(builders):
    assert _dot_count(build, arg) == 0, i
  assert _dot_count(lambda: C.identity(5, 3, dtype=jnp.float32)) == 0
  # And the placed B2 is Q itself, bit for bit, over zero rows.
  p = C.linear(None, Q_tall, m=5)
  np.testing.assert_array_equal(p.b2[:3], Q_tall)
  np.testing.assert_array_equal(p.b2[3:], 0)


@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
def test_pad_inner_is_exact(lead):
  rng = np.random.default_rng(41)
  m, n, k = 5, 4, 2
  p = elsa.ElsaParams.init(jax.random.key(len(lead)), m=m, n=n, k=k,
                           lead=lead, dtype=jnp.float64)
  wide = C.pad_inner(p, 5)
  assert wide.w1.shape == (*lead, n, 5) and wide.b3.shape == (*lead, m, 5)
  assert wide.w2.shape == p.w2.shape and wide.b2.shape == p.b2.shape
  for name in ("w1", "w3", "b1", "b3"):
    np.testing.assert_array_equal(getattr(wide, name)[..., :k],
                                  getattr(p, name))
    np.testing.assert_array_equal(getattr(wide, name)[..., k:], 0)
  h = rng.standard_normal((3, m, n))
  apply = {(): elsa.elsa, (2,): elsa.elsa_layer, (2, 3): elsa.elsa_stack}[lead]
  # The extra products are exact zeros; only the summation order may differ.
  assert rel_err(apply(wide, h), apply(p, h)) <= F64_TOL
  assert C.pad_inner(p, k).w1.shape == p.w1.shape
  with pytest.raises(ValueError, match=r"k=1 is smaller than .*p.k=2"):
    C.pad_inner(p, 1)
  with pytest.raises(TypeError, match="ElsaParams"):
    C.pad_inner(tuple(p), 3)


# --- one refusal policy (elsa._validate) -------------------------------------

_PRODUCT = dict(m=4, n=4, a_cols=[0], b_rows=[1], b_cols=[2], out_cols=[3])
_GRAM = dict(m=4, n=4, b_cols=[0], c_cols=[1], out_rows=[2], out_cols=[3])
_NAN_2x2 = jnp.asarray([[1.0, np.nan], [0.0, 1.0]])


@pytest.mark.parametrize("call, error, message", [
    (lambda: C.identity(0, 2), ValueError,
     "identity: m must be an int >= 1, got 0"),
    (lambda: C.identity(3, 2, dtype=jnp.int32), TypeError,
     "identity: dtype must be a floating dtype"),
    (lambda: C.selector(3, [0], dtype=jnp.int32), TypeError,
     "selector: dtype must be a floating dtype"),
    (lambda: C.placement([0], [0], shape=(2, 2), dtype="int8"), TypeError,
     "placement: dtype must be a floating dtype"),
    (lambda: C.product2(**_PRODUCT, dtype=jnp.int32), TypeError,
     "product2: dtype must be a floating dtype"),
    (lambda: C.product2(**_PRODUCT, scale=np.nan), ValueError,
     "product2: scale must be finite, got nan"),
    (lambda: C.gram(**_GRAM, scale=jnp.inf), ValueError,
     "gram: scale must be finite, got inf"),
    (lambda: C.product3(m=4, n=4, a_cols=[0], b_cols=[1], c_cols=[2],
                        out_cols=[3], scale=-np.inf), ValueError,
     "product3: scale must be finite, got -inf"),
    (lambda: C.constant(_NAN_2x2, 3), ValueError,
     r"constant: c must be finite, got nan in c\(2, 2\)"),
    (lambda: C.linear(None, _NAN_2x2, m=3), ValueError,
     r"linear: Q must be finite, got nan in Q\(2, 2\)"),
    (lambda: C.linear(jnp.full((3, 3), jnp.inf), jnp.eye(2)), ValueError,
     r"linear: P must be finite, got inf in P\(3, 3\)"),
    (lambda: C.linear((jnp.eye(3, 1), jnp.full((3, 1), np.nan)), jnp.eye(2)),
     ValueError, r"linear: P\[1\] must be finite, got nan"),
    (lambda: C.rows_linear([0], _NAN_2x2, m=3), ValueError,
     "rows_linear: Q must be finite, got nan"),
    (lambda: C.constant(jnp.ones((2, 2)), 0), ValueError,
     "constant: n must be an int >= 1, got 0"),
    (lambda: C.gram(**{**_GRAM, "m": True}), TypeError,
     "gram: m must be an int >= 1, got True"),
])
def test_refusal_policy(call, error, message):
  """The constructions are exact only for finite values (a NaN times one of
  their zeros spreads), so concrete non-finite arrays and scales are refused
  like every entry point refuses them; dtypes must be floating (an integer
  dtype gave integer parameters, or was silently replaced); identity names
  itself, not the linear it calls."""
  with pytest.raises(error, match=message):
    call()
  # A traced value cannot be checked; it passes (see elsa._validate).
  jax.jit(lambda s: C.product2(**_PRODUCT, scale=s).w2)(np.nan)


@pytest.mark.parametrize("call, message", [
    (lambda: C.placement([0], [0], shape=(100, 100)),
     r"placement: shape=\(100, 100\) need at least"),
    (lambda: C.selector(10**4, [0]), r"placement: shape=\(10000, 1\) need"),
    (lambda: C.identity(3, 100), "identity: m=3, n=100, v=100 need at least"),
    (lambda: C.pad_inner(C.identity(3, 2), 10**4),
     r"pad_inner: k=10000, p.w1.shape=\(2, 2\), p.b1.shape=\(3, 2\) need"),
    (lambda: C.gram(**{**_GRAM, "m": 10**4}),
     "gram: m=10000, n=4, v=4 need at least"),
])
def test_sizes_that_cannot_fit_are_refused_before_allocation(monkeypatch, call,
                                                              message):
  """Against a device memory of 64 KiB (monkeypatched, so that a regression
  fails here instead of allocating)."""
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**16)
  with pytest.raises(ValueError, match=message):
    call()
  # With room, the same call passes (traced only: nothing to compile).
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**40)
  jax.eval_shape(call)
