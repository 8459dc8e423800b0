"""elsa.tasks: the registry and its refusals, the samplers, the Bayes predictors
against independent numpy references and Monte Carlo, the baselines on known answers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elsa import ridge, tasks

NAMES = ("linear", "sparse_linear", "noisy_linear", "linear_classification",
         "quadratic", "relu_2nn", "decision_tree", "nonzero_mean",
         "mixed_noise", "anisotropic")


def _sample(family, seed=0, **sizes):
  sizes = {"batch": 6, "n_train": 5, "d": 3, "n_query": 2, **sizes}
  return family.sample(jax.random.key(seed), dtype=jnp.float64, **sizes)


def test_registry_and_refusals():
  assert tuple(tasks.FAMILIES) == NAMES
  with pytest.raises(ValueError, match="linear, sparse_linear.*anisotropic"):
    tasks.get("cubic")
  with pytest.raises(TypeError, match="no option kapa.*kappa"):
    tasks.get("anisotropic", kapa=3.0)
  with pytest.raises(ValueError, match="kappa must be >= 1, got 0.5"):
    tasks.get("anisotropic", kappa=0.5)
  with pytest.raises(ValueError, match="noise must be >= 0"):
    tasks.get("noisy_linear", noise=-1.0)
  with pytest.raises(ValueError, match="noise_levels must be > 0"):
    tasks.get("mixed_noise", noise_levels=(0.0, 1.0))
  with pytest.raises(ValueError, match="sum to 1"):
    tasks.get("mixed_noise", noise_levels=(0.1, 1.0), noise_probs=(0.5, 0.6))
  with pytest.raises(TypeError, match="rotate must be True or False"):
    tasks.get("anisotropic", rotate=1)
  with pytest.raises(TypeError, match="k must be an int"):
    tasks.get("sparse_linear", k=1.5)
  family = tasks.get("sparse_linear", k=4)
  with pytest.raises(ValueError, match="k=4 nonzero coordinates need d >= k, "
                     "got d=3"):
    _sample(family)
  with pytest.raises(ValueError, match="n_train must be an int >= 1, got 0"):
    _sample(tasks.FAMILIES["linear"], n_train=0)
  with pytest.raises(TypeError, match="batch must be an int"):
    _sample(tasks.FAMILIES["linear"], batch=2.0)
  with pytest.raises(TypeError, match="dtype must be a floating dtype"):
    tasks.FAMILIES["linear"].sample(jax.random.key(0), batch=2, n_train=2,
                                    d=2, dtype=jnp.int32)
  with pytest.raises(AttributeError):
    tasks.FAMILIES["quadratic"].bayes  # pylint: disable=pointless-statement
  assert "bayes" not in tasks.FAMILIES["quadratic"].references
  assert {"lasso_1", "lasso_0.1", "lasso_0.01", "lasso_0.001",
          "lasso_0.0001"} <= set(tasks.FAMILIES["sparse_linear"].references)
  assert {"tree", "tree_unbounded", "boosted_trees", "mlp_adam"} <= set(
      tasks.FAMILIES["decision_tree"].references)
  assert {"knn", "knn_distance"} <= set(tasks.FAMILIES["linear"].references)
  for name, family in tasks.FAMILIES.items():  # the names the host runs
    assert set(family.references) & set(tasks.HOST_REFERENCES) == {
        n for n in family.references if n.startswith(("lasso", "tree",
                                                      "boosted", "mlp_lbfgs"))
    }, name
  with pytest.raises(ValueError, match="depth must be an int in \\[1, 30\\], "
                     "got 31"):
    tasks.get("decision_tree", depth=31)
  with pytest.raises(TypeError, match="renormalize must be True or False"):
    tasks.get("noisy_linear", renormalize=1)


def test_error_scale_is_garg_et_al_normalisation():
  """The zero predictor's mean squared error over the error scale is about 1
  on every family of Garg et al. (their divisor: d, k for sparse, 1 for
  trees; 1 for +-1 labels), measured on 20,000 prompts."""
  want = {"linear": 7, "sparse_linear": 3, "noisy_linear": 7,
          "linear_classification": 1, "quadratic": 7, "relu_2nn": 7,
          "decision_tree": 1}
  for name, scale in want.items():
    family = tasks.FAMILIES[name]
    assert family.error_scale(7) == scale, name
    task = family.sample(jax.random.key(1), batch=20_000, n_train=1, d=7,
                         dtype=jnp.float32)
    zero = float(np.mean(np.asarray(task.y_query, np.float64) ** 2)) / scale
    assert abs(zero - 1) < 0.06, (name, zero)
  with pytest.raises(ValueError, match="d must be an int >= 1, got 0"):
    tasks.FAMILIES["linear"].error_scale(0)
  assert tasks.FAMILIES["linear_classification"].reports_accuracy
  assert not tasks.FAMILIES["linear"].reports_accuracy


def test_accuracy_is_the_share_of_right_signs():
  y = jnp.asarray([[1.0, -1.0, 1.0, -1.0]])
  task = ridge.Task(x=None, y=None, x_query=None, y_query=y, w_true=None)
  pred = jnp.asarray([[0.3, -2.0, -0.1, 0.0]])  # right, right, wrong, 0
  np.testing.assert_array_equal(tasks.accuracy(pred, task), [0.5])


@pytest.mark.parametrize("name", NAMES)
def test_samplers(name):
  family = tasks.FAMILIES[name]
  task = _sample(family)
  again = _sample(family)
  other = _sample(family, seed=1)
  for a, b in zip(task, again):  # same key, same batch
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(task.y, other.y)
  assert task.x.shape == (6, 5, 3) and task.y.shape == (6, 5)
  assert task.x_query.shape == (6, 2, 3) and task.y_query.shape == (6, 2)
  assert task.w_true.shape == (6, 3)
  assert all(a.dtype == jnp.float64 for a in task)
  assert isinstance(task, ridge.Task)
  x = np.concatenate([task.x, task.x_query], 1)
  y = np.concatenate([task.y, task.y_query], 1)
  w = np.asarray(task.w_true)
  if not family.has_w:
    assert np.isnan(w).all()
  elif name == "linear_classification":
    np.testing.assert_array_equal(y, np.sign(np.einsum("bmd,bd->bm", x, w)))
  elif name in ("linear", "sparse_linear"):
    np.testing.assert_allclose(y, np.einsum("bmd,bd->bm", x, w), atol=1e-12)
  if name == "sparse_linear":
    assert ((w != 0).sum(-1) == family.k).all()
  if name == "decision_tree":  # leaf values only: at most 2^depth per prompt
    assert max(len(np.unique(row)) for row in y) <= 2 ** family.depth


def _joint_gaussian_prediction(x, y, xq, mu, s2, sigma):
  """E[y_q | y] of the joint Gaussian (y, y_q) given the inputs (function
  space, numpy float64), and log N(y; X mu, s2 X X^T + sigma^2 I)."""
  a = np.concatenate([x, xq])
  mean = a @ mu
  cov = s2 * a @ a.T + sigma**2 * np.eye(len(a))
  n = len(x)
  c_yy, c_qy = cov[:n, :n], cov[n:, :n]
  pred = mean[n:] + c_qy @ np.linalg.pinv(c_yy) @ (y - mean[:n])
  sign, logdet = np.linalg.slogdet(c_yy)
  r = y - mean[:n]
  return pred, -0.5 * (r @ np.linalg.solve(c_yy, r) + logdet) if sign > 0 \
      else None


@pytest.mark.parametrize("name,options,n_train", [
    ("linear", {}, 2),                    # noiseless, N < d: min-norm limit
    ("noisy_linear", {}, 5),
    ("nonzero_mean", {"mu_scale": 0.7, "w_scale": 0.5}, 5),
    ("anisotropic", {"kappa": 100.0, "rotate": True}, 5),
    ("mixed_noise", {"noise_levels": (0.1, 0.6, 2.0),
                     "noise_probs": (0.2, 0.3, 0.5)}, 5),
])
def test_bayes_equals_joint_gaussian_reference(name, options, n_train):
  family = tasks.get(name, **options)
  task = _sample(family, n_train=n_train)
  got = np.asarray(jax.jit(family.bayes)(task))  # jit: one compilation
  d = task.x.shape[-1]
  s2 = getattr(family, "w_scale", 1.0) ** 2
  mu = np.full(d, getattr(family, "mu_scale", 0.0))
  for b in range(task.x.shape[0]):
    x, y, xq = (np.asarray(a[b]) for a in (task.x, task.y, task.x_query))
    if name == "mixed_noise":
      preds, logs = zip(*(_joint_gaussian_prediction(x, y, xq, mu, s2, s)
                          for s in family.noise_levels))
      logs = np.log(family.noise_probs) + np.array(logs)
      post = np.exp(logs - logs.max())
      want = (post / post.sum()) @ np.array(preds)
    else:
      want, _ = _joint_gaussian_prediction(x, y, xq, mu, s2, family.noise)
    np.testing.assert_allclose(got[b], want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name,options", [
    ("nonzero_mean", {"mu_scale": 2.0}),
    ("mixed_noise", {}),
    ("anisotropic", {"kappa": 10.0, "rotate": True}),
])
def test_bayes_risk_matches_monte_carlo(name, options):
  """The sampler draws what the Bayes predictor assumes: its mean squared
  error on sampled prompts equals the posterior predictive variance the
  model implies (4 standard errors), and no baseline does better."""
  family = tasks.get(name, **options)
  task = family.sample(jax.random.key(7), batch=4000, n_train=4, d=3,
                       n_query=1, dtype=jnp.float64)
  err = np.asarray((jax.jit(family.bayes)(task) - task.y_query)[:, 0] ** 2)
  levels = getattr(family, "noise_levels", None) or (family.noise,)
  x, xq = np.asarray(task.x), np.asarray(task.x_query)[:, 0]
  ratio = [(s / family.w_scale) ** 2 for s in levels]
  # Posterior of w at level s: covariance s^2 (X^T X + ratio I)^{-1}.
  var = np.stack([s**2 * (1 + np.einsum("bd,bde,be->b", xq, np.linalg.inv(
      np.einsum("bnd,bne->bde", x, x) + r * np.eye(3)), xq))
                  for s, r in zip(levels, ratio)], -1)
  if len(levels) > 1:
    post = np.asarray(jax.jit(family.level_posterior)(task))
    means = np.stack([np.asarray(tasks._predict(task, tasks.posterior_mean_w(  # pylint: disable=protected-access
        task, mu=0.0, noise=s, w_scale=family.w_scale)))[:, 0]
                      for s in levels], -1)
    expected = np.sum(post * (var + means**2), -1) - np.sum(
        post * means, -1) ** 2
  else:
    expected = var[:, 0]
  diff = err - expected
  assert abs(diff.mean()) < 4 * diff.std() / np.sqrt(diff.size), (
      err.mean(), expected.mean())
  for ref in ("least_squares", "ridge"):
    other = np.asarray((jax.jit(family.references[ref])(task)
                        - task.y_query)[:, 0]
                       ** 2)
    assert (other - err).mean() > 0, ref


def _orthogonal_task(n_train=8, d=3, seed=0):
  """Columns of X orthogonal with X^T X / N = I, scalar targets, one query."""
  rng = np.random.default_rng(seed)
  q, _ = np.linalg.qr(rng.normal(size=(n_train, d)))
  x = np.sqrt(n_train) * q
  w = rng.normal(size=d)
  y = x @ w + 0.1 * rng.normal(size=n_train)
  xq = rng.normal(size=(2, d))
  arr = lambda a: jnp.asarray(a[None], jnp.float64)
  return ridge.Task(x=arr(x), y=arr(y), x_query=arr(xq),
                    y_query=arr(xq @ w), w_true=arr(w)), x, y, xq


def test_linear_baselines_known_answers():
  task, x, y, xq = _orthogonal_task()
  n = len(x)
  # X^T X / N = I: least squares, ridge and averaging are X^T y / N shrunk.
  b = x.T @ y / n
  np.testing.assert_allclose(tasks.least_squares(task)[0], xq @ b, rtol=1e-10)
  np.testing.assert_allclose(
      tasks.ridge_predictor(task, lam=0.5)[0], xq @ b / 1.5, rtol=1e-10)
  np.testing.assert_allclose(tasks.averaging(task)[0], xq @ b, rtol=1e-10)
  # Lasso: soft thresholding of X^T y / N.
  alpha = 0.3
  soft = np.sign(b) * np.maximum(np.abs(b) - alpha, 0)
  np.testing.assert_allclose(tasks.lasso(task, alpha=alpha)[0], xq @ soft,
                             rtol=1e-6, atol=1e-8)


def test_lasso_is_the_minimiser_where_coordinate_descent_stops_short():
  # One example in d = 5 at alpha = 1e-4: coordinate descent stops at
  # max_iter with weight on several coordinates. The minimiser puts it all on
  # j = argmax |x_j| (the KKT conditions: x_j r = alpha sign(w_j), |x_i r| <=
  # alpha elsewhere), leaving the residual r = alpha sign(y) / |x_j|.
  import warnings
  from sklearn.exceptions import ConvergenceWarning
  from sklearn.linear_model import Lasso
  rng = np.random.default_rng(0)
  alpha, d, misses = 1e-4, 5, 0
  for _ in range(32):
    # Prompts of sparse_linear: y = x w, w with 3 of 5 coordinates nonzero.
    w = np.zeros(d)
    w[rng.choice(d, 3, replace=False)] = rng.normal(size=3)
    x, xq = rng.normal(size=(1, d)), rng.normal(size=d)
    y = x @ w
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      Lasso(alpha=alpha, fit_intercept=False, max_iter=100_000,
            tol=1e-8).fit(x, y)
    misses += any(w.category is ConvergenceWarning for w in caught)
    j = np.argmax(np.abs(x[0]))
    w_j = (y[0] - np.sign(y[0]) * alpha / abs(x[0, j])) / x[0, j]
    task = ridge.Task(x=jnp.asarray(x[None]), y=jnp.asarray(y[None]),
                      x_query=jnp.asarray(xq[None, None]),
                      y_query=jnp.zeros((1, 1)), w_true=jnp.zeros((1, d)))
    with warnings.catch_warnings():
      warnings.simplefilter("error", ConvergenceWarning)
      got = tasks.lasso(task, alpha=alpha)
    np.testing.assert_allclose(got[0, 0], xq[j] * w_j, rtol=1e-10)
  assert misses > 0  # the case the fallback is for occurred


def test_knn_distance_equals_scikit_learn_and_copies_an_exact_match():
  from sklearn.neighbors import KNeighborsRegressor
  task = _sample(tasks.FAMILIES["noisy_linear"], n_train=7, n_query=3)
  got = np.asarray(jax.jit(tasks.knn_distance)(task))
  for b in range(task.x.shape[0]):
    model = KNeighborsRegressor(n_neighbors=3, weights="distance").fit(
        np.asarray(task.x[b]), np.asarray(task.y[b]))
    np.testing.assert_allclose(got[b], model.predict(
        np.asarray(task.x_query[b])), rtol=1e-10)
  on_example = task._replace(x_query=task.x[:, 2:3])
  np.testing.assert_allclose(jax.jit(tasks.knn_distance)(on_example)[:, 0],
                             task.y[:, 2])


def test_tree_and_mlp_fit_known_targets():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 40, 2))
  # Queries away from the splits at 0 (a fitted threshold lies between
  # two examples, not at 0 itself).
  xq = rng.choice([-1.0, 1.0], size=(2, 5, 2))
  # A depth-2 tree is recovered exactly from 40 points.
  target = lambda a: np.where(a[..., 0] > 0, np.where(a[..., 1] > 0, 2.0, -1.0),
                              0.5)
  arr = lambda a: jnp.asarray(a, jnp.float64)
  task = ridge.Task(arr(x), arr(target(x)), arr(xq), arr(target(xq)),
                    arr(np.zeros((2, 2))))
  np.testing.assert_allclose(tasks.tree(task, max_depth=2), target(xq))
  # A ReLU network fits relu(x1) - 2 relu(-x2) closely.
  target = lambda a: np.maximum(a[..., 0], 0) - 2 * np.maximum(-a[..., 1], 0)
  task = task._replace(y=arr(target(x)), y_query=arr(target(xq)))
  np.testing.assert_allclose(tasks.mlp_lbfgs(task), target(xq), atol=0.1)


# --- least squares in float32 -------------------------------------------------


def _pinv_prediction(task) -> np.ndarray:
  """``x_q^T X^+ y`` in float64 numpy from the task's own (float32) numbers."""
  x, y, xq = (np.asarray(a, np.float64) for a in (task.x, task.y,
                                                   task.x_query))
  return np.einsum("bqd,bd->bq", xq, np.einsum("bdn,bn->bd",
                                                np.linalg.pinv(x), y))


@pytest.mark.parametrize("n_train", [4, 5, 6])  # d - 1, d, d + 1
def test_least_squares_float32_matches_float64_pinv_around_n_equals_d(n_train):
  """Noiseless prompts with condition number <= 30 (well conditioned), d = 5.
  Measured max |float32 - float64| / max(1, |pred|): 6.0e-6 at N = 4, 5.5e-6
  at N = 5, 4.5e-6 at N = 6 (the old X^T X path: 7.6e-3 at N = d); bound
  1e-4."""
  task = tasks.FAMILIES["linear"].sample(jax.random.key(3), batch=400,
                                         n_train=n_train, d=5, n_query=2,
                                         dtype=jnp.float32)
  s = np.linalg.svd(np.asarray(task.x, np.float64), compute_uv=False)
  good = s[:, 0] / s[:, -1] < 30
  assert good.sum() > 50
  got = np.asarray(jax.jit(tasks.least_squares)(task), np.float64)
  want = _pinv_prediction(task)
  err = np.abs(got - want) / np.maximum(1, np.abs(want))
  assert err[good].max() < 1e-4, err[good].max()
  if n_train < 5:  # N < d: the minimum-norm solution, not just a fit
    assert np.abs(got - want).max() < 1e-3
  ridge_got = np.asarray(tasks.ridge_predictor(task, lam=0.1), np.float64)
  x, y, xq = (np.asarray(a, np.float64) for a in (task.x, task.y,
                                                   task.x_query))
  w = np.linalg.solve(np.einsum("bnd,bne->bde", x, x) / n_train + 0.1 * np.eye(
      5), np.einsum("bnd,bn->bd", x, y)[..., None] / n_train)[..., 0]
  np.testing.assert_allclose(ridge_got, np.einsum("bqd,bd->bq", xq, w),
                             rtol=1e-4, atol=1e-5)


def test_double_descent_peak_in_float32():
  """Noisy least squares at N = d = 5 over 1,000 prompts: the mean error in
  float32 against the float64 pinv on the same prompts. Measured: 2034.13
  against 2034.30, 0.008% apart (the X^T X path: 83.5 against 50,190 on
  other prompts); bound 20%."""
  task = tasks.FAMILIES["noisy_linear"].sample(
      jax.random.key(0), batch=1000, n_train=5, d=5, dtype=jnp.float32)
  y_q = np.asarray(task.y_query, np.float64)
  got = np.mean((np.asarray(jax.jit(tasks.least_squares)(task)) - y_q) ** 2)
  want = np.mean((_pinv_prediction(task) - y_q) ** 2)
  assert want > 50  # the peak: far above the zero predictor's d = 5
  assert abs(got / want - 1) < 0.2, (got, want)


# --- reliability ------------------------------------------------------------------


def test_bayes_is_finite_and_right_at_small_noise_in_float32():
  """mixed_noise with a level of 1e-3 (the N x N Cholesky failed: NaN): the
  float32 prediction against the float64 joint-Gaussian one on the same
  numbers. Measured max |diff| / max(1, |pred|) 1.7e-6; bound 1e-4."""
  family = tasks.get("mixed_noise", noise_levels=(1e-3, 0.5))
  task = family.sample(jax.random.key(0), batch=64, n_train=20, d=5,
                       dtype=jnp.float32)
  got = np.asarray(jax.jit(family.bayes)(task), np.float64)
  assert np.isfinite(got).all()
  post = np.asarray(family.level_posterior(task))
  assert np.isfinite(post).all()
  for b in range(16):
    x, y, xq = (np.asarray(a[b], np.float64) for a in (task.x, task.y,
                                                       task.x_query))
    preds, logs = zip(*(_joint_gaussian_prediction(x, y, xq, np.zeros(5), 1.0,
                                                   s)
                        for s in family.noise_levels))
    logs = np.log(family.probs()) + np.array(logs)
    weights = np.exp(logs - logs.max())
    want = (weights / weights.sum()) @ np.array(preds)
    np.testing.assert_allclose(got[b], want, rtol=0,
                               atol=1e-4 * max(1, np.abs(want).max()))


def test_bayes_is_finite_at_extreme_weight_scales_in_float32():
  """linear with w_scale = 1e-30 (noise 0.1): (noise / w_scale)^2 = 1e58
  overflowed float32 to NaN. The posterior mean is then the prior mean to
  every digit float32 has (the exact one is ~1e-58); and w_scale = 1e30
  is the least-squares limit."""
  for w_scale, limit in ((1e-30, None), (1e30, tasks.least_squares)):
    family = tasks.get("linear", w_scale=w_scale, noise=0.1)
    task = family.sample(jax.random.key(0), batch=32, n_train=10, d=4,
                         dtype=jnp.float32)
    got = np.asarray(family.bayes(task))
    assert np.isfinite(got).all(), w_scale
    if limit is None:
      assert np.abs(got).max() < 1e-37
    else:
      np.testing.assert_allclose(got, limit(task), rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_tasks_are_referenced_in_float32(dtype):
  """Sampled in float16 / bfloat16 (the references raised a JAX traceback):
  every jnp reference runs, in float32, on the upcast prompts."""
  for name in ("linear", "mixed_noise", "anisotropic"):
    family = tasks.get(name, **({"rotate": True} if name == "anisotropic"
                                else {}))
    task = family.sample(jax.random.key(0), batch=4, n_train=6, d=3,
                         dtype=dtype)
    assert task.x.dtype == dtype
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), task)
    for ref, predict in family.references.items():
      got = predict(task)
      assert got.dtype == jnp.float32, (name, ref)
      np.testing.assert_array_equal(got, predict(wide), err_msg=ref)
  family = tasks.FAMILIES["decision_tree"]
  task = family.sample(jax.random.key(0), batch=2, n_train=6, d=3,
                       dtype=dtype)
  assert tasks.tree(task).dtype == jnp.float32


def test_sizes_that_cannot_fit_are_refused_before_allocation():
  """decision_tree depth >= 31 raised OverflowError and a wide relu_2nn
  tried to allocate terabytes: one line with the estimate and the limit."""
  with pytest.raises(ValueError, match="depth=30.* need at least .* GiB, more "
                     "than the .* GiB"):
    tasks.get("decision_tree", depth=30).sample(
        jax.random.key(0), batch=64, n_train=10, d=5, dtype=jnp.float32)
  with pytest.raises(ValueError, match="hidden=1000000000.* need at least "
                     ".* GiB"):
    tasks.get("relu_2nn", hidden=10**9).sample(
        jax.random.key(0), batch=64, n_train=10, d=20, dtype=jnp.float32)
  task = tasks.FAMILIES["linear"].sample(jax.random.key(0), batch=64,
                                         n_train=10, d=20)
  with pytest.raises(ValueError, match="tasks.mlp_adam: hidden=1000000000.* "
                     "need at least"):
    tasks.mlp_adam(task, hidden=10**9)


@pytest.mark.parametrize("name", ["linear", "relu_2nn", "decision_tree"])
def test_an_input_mask_gives_the_task_of_fewer_dimensions(name):
  """Garg et al.'s curriculum at width d: the coordinates beyond d' are 0
  and the labels are those of the first d' coordinates alone (the same
  draw otherwise, so under jit with a traced mask too)."""
  family, d, d_small = tasks.get(name), 5, 2
  mask = jnp.arange(d) < d_small
  key = jax.random.key(3)
  full = family.sample(key, batch=4, n_train=6, d=d, dtype=jnp.float64)
  masked = jax.jit(lambda m: family.sample(
      key, batch=4, n_train=6, d=d, dtype=jnp.float64, input_mask=m))(
          mask.astype(jnp.float64))
  np.testing.assert_array_equal(masked.x[..., d_small:], 0)
  np.testing.assert_array_equal(masked.x[..., :d_small],
                                full.x[..., :d_small])
  if name == "linear":  # y = x w: the masked prompt uses w's first d' rows
    want = np.einsum("bmd,bd->bm", np.asarray(full.x)[..., :d_small],
                     np.asarray(full.w_true)[:, :d_small])
    np.testing.assert_allclose(masked.y, want[:, :6], rtol=1e-12)
  # The labels change with the masked coordinates of the full prompt only.
  assert not np.allclose(masked.y, full.y)
  with pytest.raises(ValueError, match=r"input_mask must be \[d\] = \[5\]"):
    family.sample(key, batch=4, n_train=6, d=d, input_mask=jnp.ones(4))
  with pytest.raises(TypeError, match="input_mask"):
    family.sample(key, batch=4, n_train=6, d=d, input_mask=jnp.ones(5, int))
