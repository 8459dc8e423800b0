"""The error every driver reports (experiments/metrics.py)."""

import jax.numpy as jnp
import numpy as np

from experiments import metrics


def test_relative_error_numpy_and_jax():
  # b = 0 with a = b: 0, not NaN (the tiny floor).
  a, b = np.array([[0.0, 0.0], [1.0, 0.0]]), np.array([[0.0, 0.0], [2.0, 0.0]])
  got = metrics.relative_error(a, b)
  assert isinstance(got, np.ndarray) and got.dtype == np.float64
  np.testing.assert_array_equal(got, [0.0, 0.5])
  got = metrics.relative_error(jnp.asarray(a, jnp.float32),
                               jnp.asarray(b, jnp.float32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got[1], 0.5)
