"""Tests of elsa.training: tasks, one step lowers the loss, a short run beats zero, baselines."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import elsa
from elsa import _validate, ridge, training

SPEC = training.TaskSpec(n_train=8, d=2, n_query=2, lam=0.05, noise=0.1)


def test_tasks_are_deterministic_and_shifted():
  key = jax.random.key(0)
  a = training.sample_tasks(key, SPEC, batch=4)
  b = training.sample_tasks(key, SPEC, batch=4)
  np.testing.assert_array_equal(np.asarray(a.x), np.asarray(b.x))
  assert a.x.shape == (4, 8, 2) and a.y.shape == (4, 8)
  assert a.x_query.shape == (4, 2, 2) and a.y_query.shape == (4, 2)
  big = training.sample_tasks(jax.random.key(1), SPEC, batch=2000)
  for dist, mean in (("laplace", 0.0), ("exponential", 1.0)):
    t = training.sample_tasks(jax.random.key(1), training.TaskSpec(
        n_train=8, d=2, x_dist=dist), batch=2000)
    assert abs(float(t.x.mean()) - mean) < 0.05
    assert abs(float(t.x.var()) - 1.0) < 0.1
    np.testing.assert_allclose(  # noiseless labels are x^T w_true
        np.asarray(t.y), np.einsum("bnd,bd->bn", t.x, t.w_true), rtol=1e-5,
        atol=1e-5)
  skew = training.sample_tasks(jax.random.key(1), training.TaskSpec(
      n_train=8, d=2, x_skew=2.0), batch=2000)
  var = np.asarray(skew.x).reshape(-1, 2).var(axis=0)
  np.testing.assert_allclose(var, [1.6, 0.4], rtol=0.1)  # c ~ (1, 1/4), trace 2
  noisy = training.sample_tasks(jax.random.key(1), training.TaskSpec(
      n_train=8, d=2, noise_labels=True), batch=2000)
  corr = np.corrcoef(np.asarray(noisy.y).ravel(), np.einsum(
      "bnd,bd->bn", noisy.x, noisy.w_true).ravel())[0, 1]
  assert abs(corr) < 0.05 and abs(float(big.x.var()) - 1) < 0.1
  with pytest.raises(ValueError, match="x_dist"):
    training.TaskSpec(n_train=8, d=2, x_dist="cauchy")


def test_baselines_match_references():
  task = training.sample_tasks(jax.random.key(2), SPEC, batch=3,
                               dtype=jnp.float64)
  w = ridge.gd(task.x, task.y, lam=SPEC.lam, eta=0.3, steps=3)[-1]
  np.testing.assert_allclose(
      np.asarray(training.gd_predict(task, lam=SPEC.lam, eta=0.3, steps=3)),
      np.einsum("bqd,bd->bq", task.x_query, w), rtol=1e-12)
  # The constructed stack computes GD exactly (float64).
  np.testing.assert_allclose(
      np.asarray(training.constructed_gd_predict(task, SPEC, eta=0.3,
                                                 depth=3)),
      np.asarray(training.gd_predict(task, lam=SPEC.lam, eta=0.3, steps=3)),
      rtol=1e-10, atol=1e-12)
  x, y = np.asarray(task.x), np.asarray(task.y)
  w_ls = np.stack([np.linalg.lstsq(x[b], y[b], rcond=None)[0] for b in range(3)])
  np.testing.assert_allclose(
      np.asarray(training.least_squares_predict(task)),
      np.einsum("bqd,bd->bq", task.x_query, w_ls), rtol=1e-9)
  # GD's sensitivity to its query is its weight vector.
  sens = training.query_sensitivity(
      lambda t: training.gd_predict(t, lam=SPEC.lam, eta=0.3, steps=3), task)
  np.testing.assert_allclose(np.asarray(sens),
                             np.broadcast_to(np.asarray(w)[:, None], (3, 2, 2)),
                             rtol=1e-12)


def test_skip_init_starts_at_identity():
  model = training.init_model(jax.random.key(3), SPEC, depth=3, scale=0.0,
                              dtype=jnp.float64)
  h = jax.random.normal(jax.random.key(4), (2, SPEC.form().m, SPEC.form().n),
                        jnp.float64)
  np.testing.assert_allclose(np.asarray(model(h)), np.asarray(h), rtol=1e-12)
  with pytest.raises(ValueError, match="skip_init"):
    training.init_model(jax.random.key(3), SPEC, depth=1, use_bias=False)


def _setup(depth, *, lr=3e-3, steps=300, use_bias=True):
  # float32, the default these runs were measured with before the default
  # became JAX's default float (float64 under the tests' x64).
  model = training.init_model(jax.random.key(5), SPEC, depth=depth,
                              use_bias=use_bias, skip_init=use_bias,
                              scale=0.03 if use_bias else 0.3,
                              dtype=jnp.float32)
  split = training.split(model)
  tx = training.optimizer(learning_rate=lr, steps=steps, warmup_steps=10)
  return split, tx, training.init_state(split.params, tx)


def test_one_step_lowers_the_loss_on_a_fixed_batch():
  split, _, state = _setup(1)
  # No warmup: the schedule's first rate is the peak, not 0.
  tx = training.optimizer(learning_rate=1e-3, steps=300, warmup_steps=0)
  state = training.init_state(state.params, tx)
  key = jax.random.key(7)
  # The batch train_step draws at step 0, held fixed to compare before/after.
  task = training.sample_tasks(jax.random.fold_in(key, 0), SPEC, batch=64,
                               dtype=jnp.float32)
  loss = lambda p: float(training.loss(p, task, graphdef=split.graphdef,
                                       rest=split.rest, form=SPEC.form()))
  before = loss(state.params)
  new, value = training.train_step(state, key, graphdef=split.graphdef,
                                   rest=split.rest, spec=SPEC, tx=tx, batch=64)
  assert int(new.step) == 1
  assert float(value) == pytest.approx(before, rel=1e-6)  # same batch
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)))
  assert moved > 0
  assert loss(new.params) < before


def test_short_run_beats_the_zero_predictor():
  split, tx, state = _setup(1, steps=300)
  state, losses = training.train_steps(
      state, jax.random.key(8), graphdef=split.graphdef, rest=split.rest,
      spec=SPEC, tx=tx, batch=64, steps=300)
  test = training.sample_tasks(jax.random.key(9), SPEC, batch=1024,
                               dtype=jnp.float32)
  model = training.merge(split.graphdef, state.params, split.rest)
  trained = float(training.mse(training.model_predict(model, SPEC.form(),
                                                      test), test).mean())
  zero = float(jnp.mean(test.y_query**2))
  gd1 = float(training.gd_eta_grid_losses(
      test, lam=SPEC.lam, etas=jnp.linspace(0.1, 1.5, 15), steps=1).min())
  # Measured: trained ~0.35 of zero; GD(1 step, best eta) ~0.37 of zero.
  assert trained < 0.5 * zero, (trained, zero, gd1)
  assert float(losses[-50:].mean()) < float(losses[:10].mean())


def test_same_key_same_run():
  split, tx, state = _setup(1, steps=20)
  run = lambda: training.train_steps(
      state, jax.random.key(10), graphdef=split.graphdef, rest=split.rest,
      spec=SPEC, tx=tx, batch=16, steps=20)[1]
  np.testing.assert_array_equal(np.asarray(run()), np.asarray(run()))


def test_noise_labels_match_the_clean_labels_second_moment():
  # Measured over seeds 0-2 (batch 4000): noise/clean second moment within
  # 4.5%, noise/formula within 1.5%, for every x_dist; exponential inputs
  # (E[z^2] = 2) used to get half the clean labels' second moment.
  for dist, moment in (("normal", 1.0), ("exponential", 2.0)):
    kw = dict(n_train=8, d=2, x_dist=dist, noise=0.5, x_scale=1.5,
              w_scale=0.7, x_skew=1.0)
    sample = lambda **more: training.sample_tasks(
        jax.random.key(0), training.TaskSpec(**kw, **more), batch=4000,
        dtype=jnp.float64)
    clean = float(jnp.mean(sample().y ** 2))
    noise = float(jnp.mean(sample(noise_labels=True).y ** 2))
    formula = 0.7**2 * 1.5**2 * moment * 2 + 0.5**2  # trace of cov is d = 2
    assert abs(noise / clean - 1) < 0.1, (dist, noise, clean)
    assert abs(noise / formula - 1) < 0.05, (dist, noise, formula)


def test_defaults_are_jax_default_float_and_wide_skip_is_identity():
  default = elsa.attention.float_dtype()  # float64 under the tests' x64
  assert SPEC.x_cov_diag().dtype == default
  assert training.sample_tasks(jax.random.key(0), SPEC, batch=2).x.dtype == (
      default)
  model = training.init_model(jax.random.key(3), SPEC, depth=2, scale=0.0,
                              inner=SPEC.form().n + 3)
  params = model.to_params()
  assert params.w1.dtype == default and params.k == SPEC.form().n + 3
  h = jax.random.normal(jax.random.key(4), (2, SPEC.form().m, SPEC.form().n),
                        default)
  np.testing.assert_allclose(np.asarray(model(h)), np.asarray(h), rtol=1e-12)


@pytest.mark.parametrize("n_train,d,n_query,noise,w_scale", [
    (8, 3, 2, 0.3, 1.0), (4, 6, 1, 0.5, 2.0), (12, 2, 3, 0.1, 0.5)])
def test_bayes_predict_is_the_posterior_mean(n_train, d, n_query, noise,
                                             w_scale):
  spec = training.TaskSpec(n_train=n_train, d=d, n_query=n_query, lam=0.05,
                           noise=noise, w_scale=w_scale)
  task = training.sample_tasks(jax.random.key(11), spec, batch=3,
                               dtype=jnp.float64)
  # Gaussian conditioning of w ~ N(0, s^2 I) on y = X w + sigma eps, in the
  # kernel form (no ridge, no N): E[w | y] = s^2 X^T (s^2 X X^T + sigma^2 I)^-1 y.
  x, y = np.asarray(task.x), np.asarray(task.y)
  w_post = np.stack([w_scale**2 * x[b].T @ np.linalg.solve(
      w_scale**2 * x[b] @ x[b].T + noise**2 * np.eye(n_train), y[b])
                     for b in range(3)])
  want = np.einsum("bqd,bd->bq", np.asarray(task.x_query), w_post)
  np.testing.assert_allclose(np.asarray(training.bayes_predict(task, spec)),
                             want, rtol=1e-10, atol=1e-12)
  assert training.bayes_lam(spec) == pytest.approx(
      noise**2 / (n_train * w_scale**2))


def test_bayes_beats_ridge_at_other_lambdas():
  # On many tasks of its prior, the posterior mean has the lowest MSE of the
  # ridge family (paired differences, seed 12: every gap > 4 s.e.).
  spec = training.TaskSpec(n_train=6, d=4, noise=0.5, lam=0.05)
  task = training.sample_tasks(jax.random.key(12), spec, batch=20000,
                               dtype=jnp.float64)
  bayes = np.asarray(training.mse(training.bayes_predict(task, spec), task))
  for lam in (0.0, 0.1 * training.bayes_lam(spec),
              10 * training.bayes_lam(spec)):
    other = np.asarray(training.mse(training.ridge_predict(task, lam=lam),
                                    task))
    gap = other - bayes
    assert gap.mean() > 4 * gap.std(ddof=1) / np.sqrt(gap.size), lam


def test_uniform_inputs():
  spec = training.TaskSpec(n_train=8, d=3, x_dist="uniform", x_scale=12**-0.5)
  t = training.sample_tasks(jax.random.key(13), spec, batch=2000,
                            dtype=jnp.float64)
  x = np.asarray(t.x)
  assert x.min() >= -0.5 and x.max() <= 0.5 and x.min() < -0.49
  assert abs(x.var() - 1 / 12) < 0.003
  np.testing.assert_allclose(np.asarray(t.y),
                             np.einsum("bnd,bd->bn", x, t.w_true), rtol=1e-12)


def test_layer_predictions_of_the_constructed_stack_are_gd_steps():
  # Exact (float64): layer t of the ELSA-GD stack predicts what GD step t does.
  task = training.sample_tasks(jax.random.key(14), SPEC, batch=3,
                               dtype=jnp.float64)
  params = SPEC.form().gd_params(lam=SPEC.lam, eta=0.4, depth=4)
  got = training.layer_predictions(elsa.nn.ElsaStack.from_params(params),
                                   SPEC.form(), task)
  want = training.gd_step_predictions(task, lam=SPEC.lam, eta=0.4, steps=4)
  assert got.shape == want.shape == (5, 3, SPEC.n_query)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10,
                             atol=1e-12)
  x, y, xq = (np.asarray(a) for a in (task.x, task.y, task.x_query))
  w = np.zeros((3, SPEC.d))
  for t in range(1, 5):  # numpy GD, the independent reference
    grad = np.einsum("bnd,bn->bd", x, np.einsum("bnd,bd->bn", x, w) - y)
    w = (1 - 0.4 * SPEC.lam) * w - 0.4 / SPEC.n_train * grad
    np.testing.assert_allclose(np.asarray(want[t]),
                               np.einsum("bqd,bd->bq", xq, w), rtol=1e-10)


def test_sensitivity_agreement():
  a = jax.random.normal(jax.random.key(15), (4, 2, 3), jnp.float64)
  b = jax.random.normal(jax.random.key(16), (4, 2, 3), jnp.float64)
  cos, rel = training.sensitivity_agreement(a, b)
  fa, fb = np.asarray(a).reshape(4, -1), np.asarray(b).reshape(4, -1)
  np.testing.assert_allclose(np.asarray(cos), np.sum(fa * fb, 1) / (
      np.linalg.norm(fa, axis=1) * np.linalg.norm(fb, axis=1)), rtol=1e-12)
  np.testing.assert_allclose(np.asarray(rel), np.linalg.norm(
      fa - fb, axis=1) / np.linalg.norm(fb, axis=1), rtol=1e-12)
  cos, rel = training.sensitivity_agreement(-2 * a, a)
  np.testing.assert_allclose(np.asarray(cos), -1.0, rtol=1e-12)
  np.testing.assert_allclose(np.asarray(rel), 3.0, rtol=1e-12)


def test_grid_training_is_each_point_trained_alone():
  # Two grid points (learning rate x init scale) in one program: each
  # equals its own train_steps run (same batches), to float32 rounding.
  points = [(3e-3, 0.03), (1e-2, 0.1)]
  models = [training.init_model(jax.random.key(17), SPEC, depth=2, scale=s,
                                residual=True, use_bias=False,
                                skip_init=False, dtype=jnp.float32)
            for _, s in points]
  splits = [training.split(m) for m in models]
  tx = training.optimizer(learning_rate=1.0, steps=30, warmup_steps=5)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *(s.params for s in splits))
  states = training.grid_init_state(stacked, tx,
                                    learning_rates=[lr for lr, _ in points])
  kw = dict(graphdef=splits[0].graphdef, rest=splits[0].rest, spec=SPEC,
            batch=16, steps=30)
  grid, grid_losses = training.train_grid_steps(states, jax.random.key(18),
                                                tx=tx, **kw)
  assert grid_losses.shape == (2, 30)
  for g, ((lr, _), split) in enumerate(zip(points, splits)):
    alone_tx = training.optimizer(learning_rate=lr, steps=30, warmup_steps=5)
    alone, losses = training.train_steps(
        training.init_state(split.params, alone_tx), jax.random.key(18),
        tx=alone_tx, **kw)
    np.testing.assert_allclose(np.asarray(grid_losses[g]), np.asarray(losses),
                               rtol=1e-5)
    for a, b in zip(jax.tree.leaves(alone.params), jax.tree.leaves(grid.params)):
      np.testing.assert_allclose(np.asarray(b[g]), np.asarray(a), rtol=1e-4,
                                 atol=1e-6)
  with pytest.raises(ValueError, match="learning_rates"):
    training.grid_init_state(stacked, tx, learning_rates=[1e-3])


def test_frozen_and_masked_blocks_stay_so_in_training():
  # The switches in a real training run: b3 frozen (not a trainable Param,
  # not in the optimiser), the first layer's w1 masked to zero.
  model = training.init_model(jax.random.key(19), SPEC, depth=2,
                              dtype=jnp.float32)
  params = model.to_params()
  w1_mask = jnp.ones_like(params.w1).at[0].set(0.0)
  model = elsa.nn.ElsaStack.from_params(
      params, frozen=("b3",),
      mask=elsa.ElsaParams(w1=w1_mask, w2=None, w3=None, b1=None, b2=None,
                           b3=None))
  split = training.split(model)
  assert "b3" not in split.params and "b3" in split.rest
  tx = training.optimizer(learning_rate=1e-2, steps=20)
  state, losses = training.train_steps(
      training.init_state(split.params, tx), jax.random.key(20),
      graphdef=split.graphdef, rest=split.rest, spec=SPEC, tx=tx, batch=16,
      steps=20)
  assert np.isfinite(np.asarray(losses)).all()
  after = training.merge(split.graphdef, state.params, split.rest).to_params()
  np.testing.assert_array_equal(np.asarray(after.b3), np.asarray(params.b3))
  assert not np.asarray(after.w1[0]).any()
  assert not np.allclose(np.asarray(after.w1[1]), np.asarray(params.w1[1]))


def test_optimizer_is_adamw_with_the_warmup_cosine_schedule():
  # The traced-learning-rate chain against optax's own adamw (clip off).
  params = {"w": jnp.ones((3, 2), jnp.float64)}
  grads = [{"w": jax.random.normal(jax.random.key(30 + i), (3, 2),
                                   jnp.float64)} for i in range(6)]
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=0.01, warmup_steps=2, decay_steps=6,
      end_value=0.01 * 0.1)
  reference = optax.adamw(schedule, weight_decay=0.1)
  ours = training.optimizer(learning_rate=0.01, steps=6, warmup_steps=2,
                            end_fraction=0.1, clip_norm=None, weight_decay=0.1)
  state_ref, state = reference.init(params), ours.init(params)
  for g in grads:
    want, state_ref = reference.update(g, state_ref, params)
    got, state = ours.update(g, state, params)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]),
                               rtol=1e-6, atol=1e-12)


def test_query_sensitivity_matches_reverse_mode_for_interacting_queries():
  # A random ELSA stack lets the two queries interact: the sensitivity is
  # d (sum_q' pred_q') / d x_q, here against jax.grad of that sum.
  model = training.init_model(jax.random.key(21), SPEC, depth=2, scale=0.3,
                              dtype=jnp.float64)
  task = training.sample_tasks(jax.random.key(22), SPEC, batch=3,
                               dtype=jnp.float64)
  predict = lambda t: training.model_predict(model, SPEC.form(), t)
  want = jax.grad(lambda xq: jnp.sum(predict(task._replace(x_query=xq))))(
      task.x_query)
  got = training.query_sensitivity(predict, task)
  assert got.shape == (3, SPEC.n_query, SPEC.d)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10,
                             atol=1e-12)


@pytest.mark.parametrize("n_train,d,n_query,depth", [(8, 3, 1, 1), (6, 4, 3, 5),
                                                     (3, 5, 2, 4)])
def test_masked_residual_lsa_on_concatenated_tokens_is_gd(n_train, d, n_query,
                                                          depth):
  # Von Oswald et al.'s Proposition 1, exact: with queries and keys reading x
  # and the value writing -eta/N y into the y column, each masked residual
  # LSA layer is one GD step on the unregularised loss (the y entries hold
  # the residuals y_i - x_i^T w_t, the query's -x_q^T w_t).
  spec = training.TaskSpec(n_train=n_train, d=d, n_query=n_query, lam=0.0,
                           tokens="concatenated")
  tokens = spec.model_tokens()
  assert (tokens.m, tokens.n) == (n_train + n_query, d + 1)
  task = training.sample_tasks(jax.random.key(20), spec, batch=3,
                               dtype=jnp.float64)
  eta = 0.3
  x_part = np.diag(np.r_[np.ones(d), 0.0])
  value = np.zeros((d + 1, d + 1))
  value[d, d] = -eta / n_train
  one = elsa.ElsaParams.zeros(m=tokens.m, n=tokens.n, k=tokens.n,
                              lead=(depth, 1), dtype=jnp.float64)
  params = one._replace(w1=one.w1 + x_part, w3=one.w3 + x_part,
                        w2=one.w2 + value)
  model = training.init_model(jax.random.key(0), spec, depth=depth,
                              components=1, use_bias=False, residual=True,
                              context_only=True, skip_init=False,
                              dtype=jnp.float64)
  np.testing.assert_array_equal(np.asarray(model.key_mask[...]),
                                np.arange(tokens.m) < n_train)
  masked = elsa.nn.ElsaStack.from_params(params, use_bias=False, residual=True,
                                         key_mask=model.key_mask[...])
  got = training.layer_predictions(masked, tokens, task)
  want = training.gd_step_predictions(task, lam=0.0, eta=eta, steps=depth)
  assert got.shape == want.shape == (depth + 1, 3, n_query)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10,
                             atol=1e-12)
  # Without the mask the queries' y entries enter the sum from layer 2 on.
  unmasked = elsa.nn.ElsaStack.from_params(params, use_bias=False,
                                           residual=True)
  off = np.abs(np.asarray(training.layer_predictions(unmasked, tokens, task))
               - np.asarray(want)).max()
  assert (off > 1e-3) == (depth > 1)


# --- one refusal policy (elsa._validate) -------------------------------------

_SPEC = dict(n_train=3, d=2)


@pytest.mark.parametrize("spec, kwargs, error, message", [
    (dict(_SPEC), dict(batch=0), ValueError,
     "sample_tasks: batch must be an int >= 1, got 0"),
    (dict(_SPEC), dict(batch=2.0), TypeError,
     "sample_tasks: batch must be an int >= 1, got 2.0"),
    (dict(_SPEC), dict(batch=2, dtype=jnp.int32), TypeError,
     "sample_tasks: dtype must be a floating dtype"),
    (dict(n_train=0, d=2), dict(batch=2), ValueError,
     "sample_tasks: spec.n_train must be an int >= 1, got 0"),
    (dict(n_train=3, d=-1), dict(batch=2), ValueError,
     "sample_tasks: spec.d must be an int >= 1, got -1"),
    (dict(n_train=3, d=2, n_query=-1), dict(batch=2), ValueError,
     "sample_tasks: spec.n_query must be an int >= 0, got -1"),
    (dict(_SPEC, noise=-1.0), dict(batch=2), ValueError,
     "sample_tasks: spec.noise must be >= 0, got -1"),
    (dict(_SPEC, noise=np.nan, x_dist="laplace"), dict(batch=2), ValueError,
     "sample_tasks: spec.noise must be >= 0, got nan; only finite"),
    (dict(_SPEC, x_skew=np.nan), dict(batch=2), ValueError,
     "sample_tasks: spec.x_skew must be finite, got nan"),
    (dict(_SPEC, x_scale=np.inf, x_dist="uniform"), dict(batch=2), ValueError,
     "sample_tasks: spec.x_scale must be finite, got inf"),
    (dict(_SPEC, w_scale=-np.inf), dict(batch=2), ValueError,
     "sample_tasks: spec.w_scale must be finite, got -inf"),
])
def test_sample_tasks_refusal_policy(spec, kwargs, error, message):
  """Refused up front by name, as ridge.sample_tasks refuses its arguments:
  n_train = 0, a negative or NaN noise gave tasks (NaN labels) before."""
  with pytest.raises(error, match=message):
    training.sample_tasks(jax.random.key(0), training.TaskSpec(**spec),
                          **kwargs)


def test_sample_tasks_refuses_a_spec_of_another_type():
  with pytest.raises(TypeError, match="sample_tasks: spec must be a TaskSpec, "
                     "got dict"):
    training.sample_tasks(jax.random.key(0), dict(_SPEC), batch=2)


@pytest.mark.parametrize("spec, batch, message", [
    (dict(n_train=100, d=10), 100, "sample_tasks: batch=100, spec.n_train=100, "
     "spec.d=10, spec.n_query=1 need at least"),
    # The [d, d] covariance of skewed inputs, built before the tasks.
    (dict(n_train=1, d=100, x_skew=1.0), 1, "sample_tasks: batch=1, "
     "spec.n_train=1, spec.d=100, spec.n_query=1 need at least"),
])
def test_sample_tasks_that_cannot_fit_are_refused_before_allocation(
    monkeypatch, spec, batch, message):
  """Against a device memory of 64 KiB (monkeypatched)."""
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**16)
  with pytest.raises(ValueError, match=message):
    training.sample_tasks(jax.random.key(0), training.TaskSpec(**spec),
                          batch=batch)
  # With room, the same call passes (traced only: nothing to compile).
  monkeypatch.setattr(_validate, "memory_bytes", lambda: 2**40)
  jax.eval_shape(lambda: training.sample_tasks(
      jax.random.key(0), training.TaskSpec(**spec), batch=batch))
