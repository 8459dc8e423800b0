"""elsa.shifts: Garg et al.'s evaluation shifts on known answers, against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elsa import shifts, tasks

LINEAR = tasks.get("linear")


def _sample(name, family=LINEAR, seed=0, **kw):
  kw = {"batch": 64, "n_train": 3, "d": 6, "dtype": jnp.float64, **kw}
  return shifts.sample(family, name, jax.random.key(seed), **kw)


def _ls_error(task):
  """Minimum-norm least squares' squared error per query, numpy float64."""
  x, y, xq, yq = (np.asarray(a, np.float64) for a in task[:4])
  w = np.stack([np.linalg.pinv(x[b]) @ y[b] for b in range(len(x))])
  return (np.einsum("bqd,bd->bq", xq, w) - yq) ** 2


def test_names_and_refusals():
  assert list(shifts.SHIFTS)[:6] == [
      "standard", "random_quadrants", "orthogonal_train_test",
      "overlapping_train_test", "half_subspace", "skewed"]
  assert {"scale-x=0.333", "scale-x=3", "scale-y=0.5", "noisyLR"} <= set(
      shifts.SHIFTS)
  with pytest.raises(ValueError, match="name must be one of standard, "
                     "random_quadrants.*noisyLR"):
    _sample("rotated")
  with pytest.raises(ValueError, match="skewed applies to the families with "
                     "labels x\\^T w \\+ noise.*got quadratic"):
    _sample("skewed", family=tasks.get("quadratic"))
  with pytest.raises(TypeError, match="no option scale; the options of skewed"
                     " are basis_key"):
    _sample("skewed", scale=2)
  with pytest.raises(TypeError, match="no option basis_key; standard takes "
                     "none"):
    _sample("standard", basis_key=jax.random.key(1))
  with pytest.raises(ValueError, match="needs n_train < d"):
    _sample("orthogonal_train_test", n_train=6)
  with pytest.raises(TypeError, match="leave n_query out"):
    _sample("standard", prefix=True, n_query=2)
  with pytest.raises(ValueError, match="scale must be > 0"):
    shifts.Shift("scale-x=0", "scale-x", 0.0)
  # standard applies to every family, in both layouts
  task = _sample("standard", family=tasks.get("decision_tree"), prefix=True)
  np.testing.assert_array_equal(task.x_query[:, :3], task.x)


def test_same_key_same_batch_and_dtypes():
  for name in shifts.SHIFTS:
    a, b = _sample(name, dtype=jnp.float32), _sample(name, dtype=jnp.float32)
    for u, v in zip(a, b):
      assert u.dtype == jnp.float32, name
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert not np.allclose(a.y, _sample(name, seed=1, dtype=jnp.float32).y)


def test_unchanging_shifts_leave_the_batch():
  for family in (LINEAR, tasks.get("mixed_noise")):
    std = family.sample(jax.random.key(0), batch=64, n_train=3, d=6,
                        dtype=jnp.float64)
    for shift in ("standard", shifts.Shift("scale-x=1", "scale-x", 1),
                  shifts.Shift("scale-y=1", "scale-y", 1)):
      for a, b in zip(_sample(shift, family=family), std):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("c", [0.5, 3.0])
def test_scale_shifts_scale_least_squares_error(c):
  base = _ls_error(_sample("standard", n_query=4))
  for name in (f"scale-x={c:g}", f"scale-y={c:g}"):
    shift = shifts.SHIFTS[name]
    # Paired draw: LS predicts x_q^T P w (P the projector on the context's
    # rows, unchanged by x -> c x), so both shifts give c^2 times the error.
    np.testing.assert_allclose(_ls_error(_sample(shift, n_query=4)),
                               c ** 2 * base, rtol=1e-9, atol=1e-12)
    # N >= d: noiseless least squares is exact, and stays so.
    assert _ls_error(_sample(shift, n_train=8)).max() < 1e-18
  # The expected error: E (x_q^T (I - P) w)^2 = c^2 (d - N), Monte Carlo.
  err = _ls_error(_sample(f"scale-x={c:g}", batch=4000, n_query=4))
  se = err.std() / np.sqrt(err.size)
  assert abs(err.mean() - c ** 2 * 3) < 5 * se


def test_orthogonal_queries():
  task = _sample("orthogonal_train_test", n_query=5)
  x, xq = np.asarray(task.x), np.asarray(task.x_query)
  std = _sample("standard", n_query=5)
  np.testing.assert_array_equal(x, std.x)
  proj = np.einsum("bnd,bqd->bnq", x, xq)
  assert np.abs(proj).max() < 1e-12 * np.abs(x).max() * np.abs(xq).max()
  np.testing.assert_allclose(np.linalg.norm(xq, axis=-1),
                             np.linalg.norm(std.x_query, axis=-1), rtol=1e-12)
  np.testing.assert_allclose(task.y_query, np.einsum(
      "bqd,bd->bq", xq, task.w_true), atol=1e-12)
  # Garg et al.'s prompt: query i against the first i examples; zero at i >= d
  pre = _sample("orthogonal_train_test", prefix=True, n_train=8, d=5)
  x, xq = np.asarray(pre.x), np.asarray(pre.x_query)
  for i in range(9):
    dots = np.einsum("bnd,bd->bn", x[:, :i], xq[:, i])
    assert np.abs(dots).max(initial=0) < 1e-12 * 10, i
    assert (np.abs(xq[:, i]).max() == 0) == (i >= 5), i


def test_overlapping_and_quadrants():
  task = _sample("overlapping_train_test", n_query=7)
  x, xq = np.asarray(task.x), np.asarray(task.x_query)
  hits = (np.abs(xq[:, :, None] - x[:, None]).max(-1) == 0)   # [B, Q, N]
  assert (hits.sum(-1) == 1).all()
  np.testing.assert_allclose(np.bincount(hits.argmax(-1).ravel()) / hits[
      ..., 0].size, 1 / 3, atol=0.06)   # uniform over the 3 examples
  std = _sample("standard", n_query=7)
  for name, sign in (("random_quadrants", None), ("opposite_quadrants", -1)):
    task = _sample(name, n_query=7)
    s = np.sign(np.asarray(task.x))
    assert (s == s[:, :1]).all()                 # one orthant per prompt
    np.testing.assert_array_equal(np.abs(task.x), np.abs(std.x))
    want = std.x_query if sign is None else -np.abs(std.x_query) * s[:, :1]
    np.testing.assert_array_equal(task.x_query, want)
    np.testing.assert_allclose(task.y, np.einsum("bnd,bd->bn", task.x,
                                                 task.w_true), atol=1e-12)


def test_subspace_and_skewed_covariance():
  key = jax.random.key(7)
  d = 6
  half = _sample("half_subspace", basis_key=key, n_train=10)
  pts = np.concatenate([half.x, half.x_query], 1).reshape(-1, d)
  sv = np.linalg.svd(pts, compute_uv=False)
  assert sv[d // 2 - 1] > 1 and sv[d // 2:].max() < 1e-12 * sv[0]
  t = np.asarray(shifts.skewed_factor(key, d, dtype=jnp.float64))
  lam = 1 / np.arange(1, d + 1) ** 2
  want = np.sort(lam * d / lam.sum())
  np.testing.assert_allclose(np.linalg.eigvalsh(t.T @ t), want, rtol=1e-10)
  skew = _sample("skewed", basis_key=key, batch=4000, n_train=30)
  std = _sample("standard", batch=4000, n_train=30)
  np.testing.assert_allclose(skew.x, np.asarray(std.x) @ t, atol=1e-12)
  pts = np.asarray(skew.x).reshape(-1, d)
  cov = pts.T @ pts / len(pts)
  # 120,000 samples: entries of the empirical covariance within ~1%.
  np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(cov)), want,
                             rtol=0.03, atol=0.005)


def test_noisy_lr_renormalises_as_theirs():
  task = _sample("noisyLR", n_query=2)
  std = _sample("standard", n_query=2)
  y = np.concatenate([task.y, task.y_query], 1)
  np.testing.assert_allclose(y.std(ddof=1), np.sqrt(6), rtol=1e-12)
  c = np.asarray(task.w_true) / np.asarray(std.w_true)
  np.testing.assert_allclose(c, c.flat[0], rtol=1e-12)
  eps = y / c.flat[0] - np.concatenate([std.y, std.y_query], 1)
  assert abs(eps.std() - 1) < 0.1 and abs(eps.mean()) < 0.1


def test_prefix_layout():
  task = _sample("scale-x=2", prefix=True, n_train=4)
  np.testing.assert_array_equal(task.x_query[:, :4], task.x)
  np.testing.assert_array_equal(task.y_query[:, :4], task.y)
  one = shifts.at_prefix(task, 2)
  assert one.x.shape == (64, 2, 6) and one.x_query.shape == (64, 1, 6)
  np.testing.assert_array_equal(one.x_query[:, 0], task.x[:, 2])
