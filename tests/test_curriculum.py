"""elsa.curriculum: Garg et al.'s schedule against a hand-written step table and their update rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elsa import curriculum


def _their_update(start, end, inc, interval, steps):
  """Garg et al.'s Curriculum.update, re-stated: the value used at each step."""
  var, out = start, []
  for count in range(steps):
    out.append(var)
    if (count + 1) % interval == 0:
      var += inc
    var = min(var, end)
  return out


def test_garg_defaults_step_table():
  cur = curriculum.Curriculum.garg()
  table = {0: (5, 11), 1999: (5, 11), 2000: (6, 13), 3999: (6, 13),
           4000: (7, 15), 29_999: (19, 39), 30_000: (20, 41),
           500_000: (20, 41)}
  for step, want in table.items():
    assert cur.at(step) == want, step
  assert cur.final == (20, 41)
  dims = _their_update(5, 20, 1, 2000, 34_000)
  points = _their_update(11, 41, 2, 2000, 34_000)
  steps = np.arange(0, 34_000, 7)
  got_d, got_n = jax.jit(cur.at)(jnp.asarray(steps))
  np.testing.assert_array_equal(got_d, np.asarray(dims)[steps])
  np.testing.assert_array_equal(got_n, np.asarray(points)[steps])


def test_one_compile_masks_and_mean():
  cur = curriculum.Curriculum(
      dims=curriculum.Schedule(start=2, end=4, inc=1, interval=3),
      points=curriculum.Schedule(start=3, end=7, inc=2, interval=3))
  traces = []

  @jax.jit
  def step_fn(x, losses, step):
    traces.append(1)
    return cur.truncate(x, step), cur.mean(losses, step)

  x = jax.random.normal(jax.random.key(0), (2, 7, 4), jnp.float64)
  losses = jax.random.uniform(jax.random.key(1), (2, 7), jnp.float64)
  for step, (d, n) in {0: (2, 3), 3: (3, 5), 6: (4, 7), 99: (4, 7)}.items():
    xt, mean = step_fn(x, losses, jnp.asarray(step))
    want = np.asarray(x).copy()
    want[..., d:] = 0
    np.testing.assert_array_equal(xt, want)
    np.testing.assert_allclose(mean, np.asarray(losses)[:, :n].mean(),
                               rtol=1e-14)
    np.testing.assert_array_equal(cur.point_mask(step), np.arange(7) < n)
  assert len(traces) == 1
  assert cur.truncate(x.astype(jnp.float32), 0).dtype == jnp.float32


def test_refusals():
  with pytest.raises(ValueError, match="end must be >= start=5, got 4"):
    curriculum.Schedule(start=5, end=4, inc=1, interval=10)
  with pytest.raises(ValueError, match="interval must be an int >= 1, got 0"):
    curriculum.Schedule(start=1, end=4, inc=1, interval=0)
  with pytest.raises(TypeError, match="inc must be an int"):
    curriculum.Schedule(start=1, end=4, inc=0.5, interval=2)
  cur = curriculum.Curriculum.fixed(d=3, n_points=5)
  assert cur.at(10**9) == (3, 5)
  with pytest.raises(ValueError, match="x must have 3 \\(dims.end\\) features"):
    cur.truncate(jnp.zeros((2, 4)), 0)
  with pytest.raises(ValueError, match="losses must have 5"):
    cur.mean(jnp.zeros((2, 4)), 0)
  with pytest.raises(ValueError, match="step must be an int >= 0"):
    cur.at(-1)
  with pytest.raises(TypeError, match="dims must be a curriculum.Schedule"):
    curriculum.Curriculum(dims=(5, 20), points=cur.points)
