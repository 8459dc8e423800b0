"""elsa.decompile in float64: the families against independent references, and
the controls that make an identification trustworthy: compiled stacks of the
library's algorithms at random known parameters are identified (parameters
recovered), with noisy weights still identified, and a random stack is not."""

import functools

from hypothesis import Phase, given, settings, strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import elsa
from elsa import algorithms, nn, programs, ridge, training
from elsa import decompile
from elsa.attention import ElsaParams
import helpers

N, D, Q, LOOPS, LAM = 6, 2, 2, 3, 0.1
F64 = jnp.float64


def _tasks(seed, batch=24, **kwargs):
  return ridge.sample_tasks(jax.random.key(seed), batch=batch, n_train=N, d=D,
                            n_query=Q, dtype=F64, **kwargs)


def _mu(task):
  """Mean smallest and largest eigenvalue of ``A`` over the tasks."""
  lo, hi = algorithms.eigen_bounds(task.x, lam=LAM)
  return float(jnp.mean(lo)), float(jnp.mean(hi))


def _gd_iterates(task, eta, steps):
  """Plain GD (elsa.ridge.gd) predictions after every step ``[steps + 1, B, Q]``."""
  return training.gd_step_predictions(task, lam=LAM, eta=eta, steps=steps)


# --- the families compute what they say ---------------------------------------


def test_gd_and_schedule_are_plain_gd():
  task = _tasks(0)
  eta = 0.7 / _mu(task)[1]
  want = _gd_iterates(task, eta, 4)
  got = decompile.FAMILIES["gd"].predict({"eta": jnp.asarray(eta)}, task,
                                         loops=4, lam=LAM)
  assert helpers.rel_err(got, want) < 1e-12
  sched = jnp.asarray([0.3, 0.9, 0.5, 0.7]) / _mu(task)[1]
  got = decompile.FAMILIES["gd_schedule"].predict({"eta": sched}, task, loops=4,
                                                  lam=LAM)
  w = jnp.zeros((task.x.shape[0], D), F64)
  for t in range(4):  # numpy-free GD with a schedule, step by step
    grad = jnp.einsum("bnd,bn->bd", task.x, jnp.einsum("bnd,bd->bn", task.x, w)
                      - task.y) / N + LAM * w
    w = w - sched[t] * grad
  assert helpers.rel_err(got[-1], jnp.einsum("bqd,bd->bq", task.x_query, w)
                         ) < 1e-12


def test_preconditioned_families_match_the_library_program():
  task = _tasks(1)
  rng = np.random.default_rng(0)
  root = rng.normal(size=(D, D))
  P = 0.3 * (root @ root.T + np.eye(D)) / _mu(task)[1]
  lib = algorithms.preconditioned_gd(n_train=N, d=D, n_query=Q,
                                     preconditioner=P)
  out = programs.run(lib, loops=LOOPS, X=task.x, y=task.y[..., None],
                     Xq=task.x_query, lam=LAM, eta=1.0)
  want = jnp.einsum("bqd,tbd->tbq", task.x_query, out["w"][-(LOOPS + 2):-1,
                                                          ..., 0])
  got = decompile.FAMILIES["preconditioned_gd"].predict(
      {"P": jnp.asarray(P)}, task, loops=LOOPS, lam=LAM)
  assert helpers.rel_err(got, want) < 1e-12
  diag = jnp.asarray(np.diag(P))
  got = decompile.FAMILIES["preconditioned_gd_diag"].predict(
      {"p": diag}, task, loops=LOOPS, lam=LAM)
  out = programs.run(algorithms.preconditioned_gd(
      n_train=N, d=D, n_query=Q, preconditioner=np.diag(np.diag(P))),
                     loops=LOOPS, X=task.x, y=task.y[..., None],
                     Xq=task.x_query, lam=LAM, eta=1.0)
  assert helpers.rel_err(got[-1], jnp.einsum(
      "bqd,bd->bq", task.x_query, out["w"][-2, ..., 0])) < 1e-12


def test_gd_plus_plus_is_its_token_dynamics_and_compiles():
  task = _tasks(2)
  eta, gamma = 0.6 / _mu(task)[1], 0.2 / _mu(task)[1]
  fam = decompile.FAMILIES["gd_plus_plus"]
  got = fam.predict({"eta": jnp.asarray(eta), "gamma": jnp.asarray(gamma)},
                    task, loops=LOOPS, lam=LAM)
  # von Oswald et al.'s layer on numpy arrays, one task at a time.
  x, y, xq = (np.asarray(a) for a in (task.x, task.y, task.x_query))
  for b in range(x.shape[0]):
    X, Xq, r, p = x[b], xq[b], y[b].copy(), np.zeros(Q)
    for t in range(LOOPS):
      G = X.T @ X / N
      r, p, X, Xq = ((1 - eta * LAM) * r + eta * LAM * y[b] - eta * X @ (
          X.T @ r) / N, (1 - eta * LAM) * p + eta * Xq @ (X.T @ r) / N,
                     X - gamma * X @ G, Xq - gamma * Xq @ G)
      np.testing.assert_allclose(got[t + 1, b], p, rtol=1e-11, atol=1e-13)
  # gamma = 0 is GD; the program is one exact ELSA stack.
  zero = fam.predict({"eta": jnp.asarray(eta), "gamma": jnp.asarray(0.0)},
                     task, loops=LOOPS, lam=LAM)
  assert helpers.rel_err(zero, _gd_iterates(task, eta, LOOPS)) < 1e-12
  compiled = programs.compile(decompile.gd_plus_plus_program(n_train=N, d=D,
                                                             n_query=Q))
  stack = decompile.from_compiled(compiled, loops=LOOPS, lam=LAM, eta=eta,
                                  gamma=gamma)
  assert helpers.rel_err(stack(task), got) < 1e-11


@pytest.mark.parametrize("name,steps", [
    ("newton_schulz", lambda t: 2 ** t),
    ("third_order", lambda t: (3 ** t + 1) // 2),
    ("third_order_residual", lambda t: 3 ** t - 1)])
def test_higher_order_iterates_are_gd_steps_as_equivalent_says(name, steps):
  task = _tasks(3)
  alpha = 0.6 / _mu(task)[1]
  got = decompile.FAMILIES[name].predict({"alpha": jnp.asarray(alpha)}, task,
                                         loops=2, lam=LAM)
  gd = _gd_iterates(task, alpha, steps(2))
  for t in range(3):
    if name == "third_order_residual" and t == 0:
      continue  # its iterate 0 is w = 0, GD step 0 ... = 3^0 - 1
    assert helpers.rel_err(got[t], gd[steps(t)]) < 1e-10, t
  claimed = decompile.FAMILIES[name].equivalent({"alpha": alpha}, (1, 2))
  assert claimed[0]["gd_steps"] == [steps(1), steps(2)]


def test_chebyshev_is_heavy_ball_at_its_schedule():
  task = _tasks(4)
  lo, hi = _mu(task)
  values = {"mu_min": jnp.asarray(lo), "mu_gap": jnp.asarray(hi - lo)}
  got = decompile.FAMILIES["chebyshev"].predict(values, task, loops=LOOPS,
                                                lam=LAM)
  eta, beta = algorithms.chebyshev_schedule(lo, hi, LOOPS)
  want = decompile.FAMILIES["heavy_ball"].predict({"eta": eta, "beta": beta},
                                                  task, loops=LOOPS, lam=LAM)
  assert helpers.rel_err(got, want) < 1e-12
  assert decompile.FAMILIES["gd"].n_params(d=D, loops=LOOPS) == 1
  assert decompile.FAMILIES["gd_schedule"].n_params(d=D, loops=LOOPS) == LOOPS
  assert decompile.FAMILIES["preconditioned_gd"].n_params(d=D, loops=1) == 3


# --- controls: compiled stacks at known parameters ----------------------------

LIBRARY = ("gd", "heavy_ball", "nesterov", "chebyshev", "newton_schulz",
           "third_order", "third_order_residual", "preconditioned_gd")


@functools.lru_cache(maxsize=None)
def _compiled(name, P=None):
  if name == "preconditioned_gd":
    prog = algorithms.preconditioned_gd(n_train=N, d=D, n_query=Q,
                                        preconditioner=np.asarray(P))
  else:
    prog = algorithms.ALGORITHMS[name](n_train=N, d=D, n_query=Q)
  return programs.compile(prog)


def _known(name, draw, mu_lo, mu_hi):
  """A library algorithm's compiled stack at drawn parameters: ``(compiled,
  scalars, {fitted parameter: its true value})``."""
  frac = draw(st.floats(0.2, 0.9))
  if name == "gd":
    eta = frac / mu_hi
    return _compiled(name), {"eta": eta}, {"eta": eta}
  if name in ("heavy_ball", "nesterov"):
    # beta >= 0.3: a weaker momentum is within the noise test's tol of GD.
    eta, beta = frac / mu_hi, draw(st.floats(0.3, 0.6))
    return _compiled(name), {"eta": eta, "beta": beta}, {"eta": eta,
                                                         "beta": beta}
  if name == "chebyshev":
    lo, hi = frac * mu_lo + 0.01, (1 + frac) * mu_hi
    eta, beta = algorithms.chebyshev_schedule(lo, hi, LOOPS)
    return _compiled(name), {"eta": eta, "beta": beta}, {"mu_min": lo,
                                                         "mu_max": hi}
  if name == "preconditioned_gd":
    # |b| >= 0.1: a diagonal P is preconditioned_gd_diag, the simpler answer.
    a, b = draw(st.floats(0.3, 1.0)), draw(st.sampled_from((-1, 1))) * draw(
        st.floats(0.1, 0.3))
    P = ((a, b), (b, 1.0))
    eta = frac / (mu_hi * (1 + abs(b)))
    truth = {"P": eta * np.asarray(P)}
    return _compiled(name, P), {"eta": eta}, truth
  alpha = frac / mu_hi
  return _compiled(name), {"alpha": alpha}, {"alpha": alpha}


FIT_TASKS, TEST_TASKS = _tasks(10), _tasks(11)


def _check_recovered(fit, truth):
  for key, want in truth.items():
    assert helpers.rel_err(fit.params[key], want) < 1e-4, (key, fit.params)


def _check_ranked(report):
  """By disagreement; ties (exact, or within TIE) simplest first."""
  d = [f.disagreement for f in report.fits]
  assert all(b >= a / (1 + decompile.TIE) or b <= decompile.EXACT
             for a, b in zip(d, d[1:])), d
  assert report.closest.family == report.fits[0].family


# One draw each, not shrunk: an identify call takes seconds.
ONCE = dict(max_examples=1, phases=(Phase.explicit, Phase.generate))


@pytest.mark.parametrize("name", LIBRARY)
@settings(**ONCE)
@given(data=st.data())
def test_compiled_algorithms_are_identified_with_their_parameters(name, data):
  mu_lo, mu_hi = _mu(FIT_TASKS)
  compiled, scalars, truth = _known(name, data.draw, mu_lo, mu_hi)
  model = decompile.from_compiled(compiled, loops=LOOPS, lam=LAM, **scalars)
  # An exact stack is judged at an exact tolerance: at the default 1e-3 a
  # weak momentum (beta = 0.125) is within tol of GD (D = 9.6e-4), and GD,
  # simpler, is the answer there.
  report = decompile.identify(model, FIT_TASKS, TEST_TASKS, lam=LAM, tol=1e-8)
  best = report.best
  assert best is not None and best.family == name, [
      (f.family, f.disagreement) for f in report.fits]
  assert best.disagreement <= 1e-8 and best.iterations == (1,) * LOOPS
  _check_recovered(best, truth)
  assert best.metrics["sensitivity_cosine"] > 1 - 1e-8
  # The ranking is by held-out disagreement, and it separates: the random
  # stack's counterpart below is far above tol for every family.
  _check_ranked(report)
  if name == "newton_schulz":
    assert best.equivalent[0]["gd_steps"] == [2, 4, 8]
  if name == "gd":  # the families that contain GD fit it too: a tie is named
    assert {"heavy_ball", "nesterov"} <= {
        f.family for f in report.fits if f.disagreement <= 1e-8}


@pytest.mark.parametrize("name", ("gd", "heavy_ball", "newton_schulz"))
@settings(**ONCE)
@given(data=st.data())
def test_noisy_compiled_weights_are_still_identified(name, data):
  mu_lo, mu_hi = _mu(FIT_TASKS)
  compiled, scalars, _ = _known(name, data.draw, mu_lo, mu_hi)
  clean = compiled.params(loops=LOOPS, lam=LAM, **scalars)
  keys = jax.random.split(jax.random.key(data.draw(st.integers(0, 99))), 6)
  noisy = ElsaParams(*(leaf + 1e-3 * jnp.sqrt(jnp.mean(leaf ** 2)) *
                       jax.random.normal(k, leaf.shape, leaf.dtype)
                       for leaf, k in zip(clean, keys)))
  model = decompile.from_compiled(compiled, loops=LOOPS, params=noisy,
                                  lam=LAM, **scalars)
  report = decompile.identify(model, FIT_TASKS, TEST_TASKS, lam=LAM, tol=1e-3)
  # The true family fits within tol and as well as any (a family containing
  # it may fit the noise a little better), and it is the answer or tied with
  # it (a family as simple that the noise lets within tol).
  true = next(f for f in report.fits if f.family == name)
  assert 1e-12 < true.disagreement < 1e-3
  assert true.disagreement <= 2 * report.fits[0].disagreement
  assert report.best.family == name or name in report.ties


def test_random_stack_is_no_family():
  compiled = _compiled("gd")
  clean = compiled.params(loops=LOOPS, lam=LAM, eta=0.1)
  keys = jax.random.split(jax.random.key(5), 6)
  random = ElsaParams(*(jnp.sqrt(jnp.mean(leaf ** 2)) *
                        jax.random.normal(k, leaf.shape, leaf.dtype)
                        for leaf, k in zip(clean, keys)))
  model = decompile.from_compiled(compiled, loops=LOOPS, params=random,
                                  lam=LAM, eta=0.1)
  report = decompile.identify(model, FIT_TASKS, TEST_TASKS, lam=LAM)
  assert report.best is None and report.ties == ()
  assert min(f.disagreement for f in report.fits) > 1e-2
  assert report.as_dict()["best"] is None
  # The nearest family is still named, with how much nearer it is.
  closest = report.closest
  assert closest.family == report.fits[0].family
  assert closest.runner_up == report.fits[1].family
  assert closest.vs_runner_up == pytest.approx(
      report.fits[1].disagreement / report.fits[0].disagreement)
  assert closest.vs_gd >= 1
  assert report.as_dict()["closest"]["family"] == closest.family


def _noisy_heavy_ball(loops):
  """A compiled heavy-ball stack of ``loops`` layers with 1% noise on its
  weights: every family's fit is near, none exact."""
  compiled = _compiled("heavy_ball")
  clean = compiled.params(loops=loops, lam=LAM, eta=0.5 / _mu(FIT_TASKS)[1],
                          beta=0.4)
  keys = jax.random.split(jax.random.key(loops), 6)
  noisy = ElsaParams(*(leaf + 1e-2 * jnp.sqrt(jnp.mean(leaf ** 2)) *
                       jax.random.normal(k, leaf.shape, leaf.dtype)
                       for leaf, k in zip(clean, keys)))
  return decompile.from_compiled(compiled, loops=loops, params=noisy, lam=LAM,
                                 eta=0.1, beta=0.4)


def test_padded_fits_compile_once_for_all_depths_and_fit_as_unpadded():
  # Noisy stacks of 2 and 3 layers padded to 3: one compilation a family
  # for both (restarts=3, a static count no other test uses, keeps the count
  # clean), and each fit, its candidate and every metric as without padding
  # (the padding rows are masked out; the sensitivities are read at the last
  # compared layer, not the last padded one).
  families = ("gd", "heavy_ball")
  run = lambda model, **kw: decompile.identify(
      model, FIT_TASKS, TEST_TASKS, lam=LAM, families=families, restarts=3,
      lm_steps=10, **kw)
  compiled = decompile._fitting._fit_and_judge  # pylint: disable=protected-access
  before = compiled._cache_size()  # pylint: disable=protected-access
  padded = {L: run(_noisy_heavy_ball(L), pad_layers=3) for L in (2, 3)}
  assert compiled._cache_size() - before == len(families)  # pylint: disable=protected-access
  for L, report in padded.items():
    plain = {f.family: f for f in run(_noisy_heavy_ball(L)).fits}
    for fit in report.fits:
      want = plain[fit.family]
      assert fit.iterations == want.iterations and len(fit.iterations) == L
      assert 1e-6 < fit.disagreement < 0.1  # near, not exact
      assert fit.disagreement == pytest.approx(want.disagreement, rel=1e-6)
      for key, value in want.metrics.items():
        if isinstance(value, float):
          assert fit.metrics[key] == pytest.approx(value, rel=1e-6), key
      for key, value in want.params.items():
        np.testing.assert_allclose(fit.params[key], value, rtol=1e-6)
  with pytest.raises(ValueError, match="pad_layers=2 is fewer than the 3 "
                     "layers the model's predictions compare"):
    run(_noisy_heavy_ball(3), pad_layers=2)
  with pytest.raises(TypeError, match="pad_layers must be an int"):
    run(_noisy_heavy_ball(3), pad_layers=3.0)


@settings(**ONCE)
@given(frac=st.floats(0.3, 0.8), lam=st.floats(0.3, 1.0))
def test_gd_at_another_lam_is_described_as_that_lam(frac, lam):
  # GD run at a ridge strength other than the tasks' (LAM) is neither GD
  # nor GD++: gd_lam fits it exactly, at its lam.
  eta = frac / (_mu(FIT_TASKS)[1] + lam)
  model = decompile.from_compiled(_compiled("gd"), loops=LOOPS, lam=lam,
                                  eta=eta)
  report = decompile.identify(model, FIT_TASKS, TEST_TASKS, lam=LAM, tol=1e-8,
                              families=("gd", "gd_lam", "gd_plus_plus"))
  assert report.best.family == "gd_lam" and report.closest.family == "gd_lam"
  _check_recovered(report.best, {"eta": eta, "lam": lam})
  assert report.closest.vs_gd > 1e6
  gd_plus_plus = next(f for f in report.fits if f.family == "gd_plus_plus")
  assert gd_plus_plus.disagreement > 1e3 * report.best.disagreement


def test_fits_on_threads_see_the_callers_jax_settings():
  # JAX's configuration contexts are per thread: the driver's 64-bit mode
  # (jax.enable_x64(True) around a 32-bit process) must reach the fits.
  from elsa.decompile import _fitting
  seen = lambda _: (jax.config.jax_enable_x64,
                    jax.config.jax_default_matmul_precision,
                    jnp.zeros(1).dtype)
  for x64, dtype in ((False, jnp.float32), (True, jnp.float64)):
    with jax.enable_x64(x64), jax.default_matmul_precision("bfloat16"):
      assert _fitting._in_threads(seen, range(4)) == [
          (x64, "bfloat16", dtype)] * 4


def _fake_fit(family, disagreement, n_params):
  return decompile.Fit(family, (1,), {}, disagreement, (),
                       {"n_params": n_params}, LAM)


def test_exact_ties_go_to_the_simpler_family():
  from elsa.decompile import _fitting
  fits = [_fake_fit("third_order_residual", 1e-31, 1),
          _fake_fit("newton_schulz", 3e-30, 1), _fake_fit("chebyshev", 1e-32, 2),
          _fake_fit("heavy_ball", 1e-9, 2), _fake_fit("gd_lam", 1e-4, 2),
          _fake_fit("gd", 1e-4 * (1 + 1e-12), 1)]
  ranked = _fitting._rank(fits)
  assert [f.family for f in ranked] == [
      "newton_schulz", "third_order_residual", "chebyshev", "heavy_ball",
      "gd", "gd_lam"]
  closest = _fitting._closest(ranked)
  assert (closest.family, closest.runner_up) == ("newton_schulz",
                                                 "third_order_residual")
  assert closest.vs_gd == pytest.approx(1e-4 / 3e-30)
  # A near tie (a parameter the model does not use) goes to the simpler too.
  assert _fitting._closest(_fitting._rank(fits[-2:])).family == "gd"


# --- trained-stack adapter, similarity, weight structure ----------------------


def test_from_model_reads_every_layer_on_both_layouts():
  for tokens in ("natural", "concatenated"):
    spec = training.TaskSpec(n_train=N, d=D, n_query=Q, tokens=tokens)
    model = training.init_model(jax.random.key(0), spec, depth=2,
                                use_bias=False, residual=True,
                                context_only=True, skip_init=False, dtype=F64)
    task = _tasks(6)
    rows = decompile.from_model(model, spec)(task)
    assert rows.shape == (3, 24, Q)
    np.testing.assert_array_equal(rows[0], 0.0)
    assert helpers.rel_err(rows[-1], training.model_predict(
        model, spec.model_tokens(), task)) == 0.0
  with pytest.raises(ValueError, match="from_model"):
    decompile.from_model(model, training.TaskSpec(n_train=N + 1, d=D,
                                                  n_query=Q))


def test_similarity_finds_the_gd_step_of_each_layer():
  task = _tasks(7)
  eta = 0.5 / _mu(task)[1]
  steps = _gd_iterates(task, eta, 6)
  layers = steps[jnp.asarray([0, 2, 4])]  # a "model" two GD steps per layer
  heat, argmax = decompile.similarity(layers, steps, task)
  assert heat.shape == (3, 7)
  np.testing.assert_array_equal(argmax, [0, 2, 4])
  np.testing.assert_allclose(heat[[0, 1, 2], [0, 2, 4]], 1.0, rtol=1e-12)
  assert heat[1, 1] < 1 - 1e-6
  with pytest.raises(ValueError, match="similarity"):
    decompile.similarity(layers[0], steps, task)


def test_weight_structure_of_a_gd_like_lsa_layer():
  spec = training.TaskSpec(n_train=N, d=D, n_query=Q, tokens="concatenated")
  n = D + 1
  w1 = jnp.eye(n, dtype=F64)
  w3 = jnp.diag(jnp.asarray([0.5] * D + [0.0], F64))      # W_KQ = 0.5 I on x
  w2 = jnp.zeros((n, n), F64).at[D, D].set(-0.2)          # y -> y only
  lead = lambda a: a[None, None]
  m = N + Q
  params = ElsaParams(lead(w1), lead(w2), lead(w3),
                      *(jnp.zeros((1, 1, m, n), F64),) * 3)
  out = decompile.weight_structure(nn.ElsaStack(params, use_bias=False), spec)
  layer = out[0][0]
  assert layer["kq_scale"] == pytest.approx(0.5)
  assert layer["kq_identity_distance"] == pytest.approx(0.0, abs=1e-15)
  assert layer["pv_y_to_out"] == pytest.approx(-0.2)
  assert layer["pv_x_to_out_norm"] == 0.0
  # A non-identity block is measured as such.
  skew = params._replace(w3=lead(jnp.diag(jnp.asarray([0.5, 1.5, 0.0], F64))))
  far = decompile.weight_structure(skew, spec)[0][0]
  assert far["kq_scale"] == pytest.approx(1.0)
  assert far["kq_identity_distance"] == pytest.approx(
      np.sqrt(0.5) / np.sqrt(0.25 + 2.25))
  with pytest.raises(ValueError, match="biases"):
    decompile.weight_structure(nn.ElsaStack(params, use_bias=True), spec)


def test_bad_arguments_are_refused():
  model = decompile.from_compiled(_compiled("gd"), loops=2, lam=LAM, eta=0.1)
  with pytest.raises(ValueError, match="families"):
    decompile.identify(model, FIT_TASKS, TEST_TASKS, families=["sgd"])
  with pytest.raises(ValueError, match="iterations"):
    decompile.fit(model, decompile.FAMILIES["gd"], FIT_TASKS,
                  iterations=(1, 2, 3))
  with pytest.raises(TypeError, match="Family"):
    decompile.fit(model, "gd", FIT_TASKS)
  with pytest.raises(ValueError, match="x_query"):
    decompile.fit(model, decompile.FAMILIES["gd"],
                  FIT_TASKS._replace(y=FIT_TASKS.y[..., None]))
  with pytest.raises(ValueError, match="predictions"):
    decompile.fit(lambda t: t.x, decompile.FAMILIES["gd"], FIT_TASKS)


def _nan_on(tasks):
  """A model whose predictions are NaN on those tasks (of a batch of 24)."""
  mask = np.zeros((24, 1))
  mask[list(tasks)] = np.nan
  return lambda t: jnp.zeros(t.x_query.shape[:2], t.x.dtype) + mask


def _nan_where(tasks, b):
  """A model that is NaN on task ``b`` of ``tasks`` only (found by its x)."""
  marker = tasks.x[b, 0, 0]
  return lambda t: jnp.where((t.x[:, 0, 0] == marker)[:, None], jnp.nan,
                             t.x_query[..., 0])


_as = lambda task, dtype: ridge.Task(*(a.astype(dtype) for a in task))
_BAD = [
    (dict(lam=-0.1), ValueError, r"identify: lam must be >= 0, got -0.1"),
    (dict(lam=float("nan")), ValueError, "lam must be >= 0, got nan"),
    (dict(tol=0.0), ValueError, "tol must be > 0"),
    (dict(restarts=0), ValueError, "restarts must be an int >= 1, got 0"),
    (dict(restarts=2.5), TypeError, "restarts must be an int"),
    (dict(restarts=1e9), TypeError, "restarts must be an int"),
    (dict(restarts=10**12), ValueError, "restarts=1000000000000, .* need at least"),
    (dict(lm_steps=10**12), ValueError, r"lm_steps must be an int in \[0, "),
    (dict(lm_steps=1e12), TypeError, "lm_steps must be an int"),
    (dict(adam_steps=-1), ValueError, "adam_steps must be an int >= 0"),
    (dict(iterations="2"), TypeError, "iterations must be an int or"),
    (dict(iterations=[2.0]), TypeError, "iterations must be an int or"),
    (dict(model=lambda t: jnp.zeros(t.x_query.shape[:2], jnp.int32)),
     TypeError, "the model returns int32 predictions on float64 tasks"),
    (dict(model=lambda t: jnp.zeros(t.x_query.shape[:2], jnp.float32)),
     TypeError, "the model returns float32 predictions on float64 tasks"),
    (dict(fit_tasks=FIT_TASKS._replace(y=FIT_TASKS.y.astype(jnp.float32))),
     TypeError, "fit_tasks.y has dtype float32 but fit_tasks.x has dtype"),
    (dict(test_tasks=_as(TEST_TASKS, jnp.float32)), TypeError,
     "test_tasks.x has dtype float32 but fit_tasks.x has dtype float64"),
    (dict(fit_tasks=_as(FIT_TASKS, jnp.bfloat16),
          test_tasks=_as(TEST_TASKS, jnp.bfloat16)), TypeError,
     "fit_tasks.x must be float32 or float64, got bfloat16"),
    (dict(test_tasks=ridge.sample_tasks(jax.random.key(1), batch=24,
                                        n_train=N, d=D + 1, n_query=Q,
                                        dtype=F64)),
     ValueError, "test_tasks have d = 3 inputs but fit_tasks d = 2"),
    (dict(model=_nan_on((3, 17))), ValueError,
     r"predictions on fit_tasks are not finite \(NaN or inf\) on 2 of 24 "
     r"tasks \(indices 3, 17\)"),
]


@pytest.mark.parametrize("change, error, message", _BAD)
def test_identify_and_fit_refuse_bad_arguments(change, error, message):
  args = dict(model=decompile.from_compiled(_compiled("gd"), loops=2, lam=LAM,
                                            eta=0.1),
              fit_tasks=FIT_TASKS, test_tasks=TEST_TASKS, lam=LAM)
  args.update(change)
  with pytest.raises(error, match=message):
    decompile.identify(**args)
  if not {"tol", "iterations"} & set(change):  # fit says the same
    family = decompile.FAMILIES["gd"]
    with pytest.raises(error, match=message.replace("identify", "fit")):
      decompile.fit(args.pop("model"), family, args.pop("fit_tasks"), **args)


def test_tasks_that_hold_nothing_out_are_warned_about():
  nan_on_all = _nan_on(range(24))  # stops right after the checks
  with pytest.warns(UserWarning, match="nothing is held out"), pytest.raises(
      ValueError, match="not finite"):
    decompile.identify(nan_on_all, FIT_TASKS, FIT_TASKS)
  other_n = ridge.sample_tasks(jax.random.key(2), batch=24, n_train=N + 2,
                               d=D, n_query=Q, dtype=F64)
  with pytest.warns(UserWarning, match="another context length"), (
      pytest.raises(ValueError, match="not finite")):
    decompile.identify(nan_on_all, FIT_TASKS, other_n)
  # Non-finite predictions on the held-out tasks are named too.
  with pytest.raises(ValueError, match=r"on test_tasks are not finite .* "
                                       r"\(indices 5\)"):
    decompile.identify(_nan_where(TEST_TASKS, 5), FIT_TASKS, TEST_TASKS)


# --- the spectral description --------------------------------------------------


def _nodes(a, b, t):
  """The roots of the degree-t Chebyshev polynomial on [a, b]."""
  j = np.arange(1, t + 1)
  return np.sort((a + b) / 2 + (b - a) / 2 * np.cos((2 * j - 1) * np.pi /
                                                    (2 * t)))


@settings(**ONCE)
@given(base=st.floats(0.1, 0.3), order=st.permutations(range(LOOPS)),
       alpha=st.floats(0.3, 0.9), other_lam=st.floats(0.3, 1.0))
def test_spectral_controls_name_the_truth(base, order, alpha, other_lam):
  mu_lo, mu_hi = _mu(FIT_TASKS)
  # GD at a schedule: the residual's roots are the steps, as a set.
  etas = (base + 0.25 * np.asarray(order)) / mu_hi
  model = decompile.from_compiled(_compiled("gd"), loops=LOOPS, lam=LAM,
                                  eta=etas)
  spec = decompile.spectral(model, FIT_TASKS, TEST_TASKS, degree=LOOPS + 1,
                            extras=(), lam=LAM)
  assert spec.coefficients.shape == (LOOPS, LOOPS + 2)
  assert spec.disagreement < 1e-20
  for layer, schedule in enumerate(spec.schedules):
    np.testing.assert_allclose(schedule, np.sort(etas[:layer + 1])[::-1],
                               rtol=1e-8)
  assert spec.ladder["gd_schedule"]["disagreement"] < 1e-16
  assert spec.ladder["gd"]["disagreement"] > 1e-6
  grid = np.linspace(spec.lo, spec.hi, 9)
  want = (1 - np.cumprod(1 - etas[:, None] * (grid + LAM), axis=0)) / (
      grid + LAM)
  assert helpers.rel_err(spec.filter(grid), want) < 1e-8
  # Newton-Schulz: r_t = (1 - alpha (lambda + lam))^(2^t).
  alpha = alpha / mu_hi
  model = decompile.from_compiled(_compiled("newton_schulz"), loops=LOOPS,
                                  lam=LAM, alpha=alpha)
  spec = decompile.spectral(model, FIT_TASKS, TEST_TASKS, degree=2 ** LOOPS - 1,
                            extras=(), lam=LAM)
  want = np.stack([(1 - alpha * (grid + LAM)) ** 2 ** t
                   for t in range(1, LOOPS + 1)])
  assert np.max(np.abs(spec.residual(grid) - want)) < 1e-8
  # Its layer t is GD 2^t steps at alpha: a root of multiplicity 2^t, read
  # as that schedule although rounding splits it into a complex cluster.
  for t, schedule in enumerate(spec.schedules, start=1):
    np.testing.assert_allclose(schedule, np.full(2 ** t, alpha), rtol=1e-6)
  # The ladder's doubling rung is that GD (2^t steps after layer t); one or
  # two steps per layer are not.
  doubling = spec.ladder["gd_doubling"]
  assert doubling["disagreement"] < 1e-20 and doubling["steps"] == [2, 4, 8]
  assert helpers.rel_err(doubling["eta"][0], alpha) < 1e-8
  assert spec.ladder["gd"]["disagreement"] > 1e-6
  # Chebyshev: the roots of layer t are the degree-t nodes of [lo, hi].
  lo, hi = 0.5 * mu_lo, 1.2 * mu_hi
  eta, beta = algorithms.chebyshev_schedule(lo, hi, LOOPS)
  model = decompile.from_compiled(_compiled("heavy_ball"), loops=LOOPS,
                                  lam=LAM, eta=eta, beta=beta)
  spec = decompile.spectral(model, FIT_TASKS, TEST_TASKS, degree=LOOPS,
                            extras=(), lam=LAM)
  for t, roots in enumerate(spec.roots, start=1):
    assert np.max(np.abs(roots.imag)) < 1e-8
    np.testing.assert_allclose(np.sort(roots.real) + LAM, _nodes(lo, hi, t),
                               rtol=1e-8)
  # Its max |r| on [lo, hi] is the optimum of its degree, 1 / T_t(sigma).
  on = np.max(np.abs(spec.residual(np.linspace(lo, hi, 33) - LAM)), axis=1)
  optimum = 1 / np.cosh(np.arange(1, LOOPS + 1) * np.arccosh(
      (hi + lo) / (hi - lo)))
  np.testing.assert_allclose(on, optimum, rtol=1e-8)
  assert spec.max_residual.shape == spec.chebyshev_optimum.shape == (LOOPS,)
  # GD at another lam: described as GD at that lam, exactly.
  eta = 0.5 / (mu_hi + other_lam)
  model = decompile.from_compiled(_compiled("gd"), loops=LOOPS, lam=other_lam,
                                  eta=eta)
  spec = decompile.spectral(model, FIT_TASKS, TEST_TASKS, degree=LOOPS,
                            extras=(), lam=LAM)
  rung = spec.ladder["gd_lam"]
  assert rung["disagreement"] < 1e-20 and spec.ladder["gd"][
      "disagreement"] > 1e-6
  assert helpers.rel_err(rung["lam"], other_lam) < 1e-8
  assert helpers.rel_err(rung["eta"][0], eta) < 1e-8
  assert rung["per_layer_steps"] == 1 and rung["steps"] == [1, 2, 3]
  assert rung["lam_identified"]
  # Far above the spectrum lam is still found where the data show it (an
  # upper bound would cut it off); after one step it does not enter GD at
  # all, and the rung says so.
  far = 100 * spec.hi
  model = decompile.from_compiled(_compiled("gd"), loops=LOOPS, lam=far,
                                  eta=0.5 / far)
  spec = decompile.spectral(model, FIT_TASKS, TEST_TASKS, degree=LOOPS,
                            extras=(), lam=LAM)
  rung = spec.ladder["gd_lam"]
  assert rung["disagreement"] < 1e-20 and rung["lam_identified"]
  assert helpers.rel_err(rung["lam"], far) < 1e-6
  model = decompile.from_compiled(_compiled("gd"), loops=1, lam=other_lam,
                                  eta=eta)
  spec = decompile.spectral(model, FIT_TASKS, TEST_TASKS, degree=1,
                            extras=(), lam=LAM)
  assert not spec.ladder["gd_lam"]["lam_identified"]


def test_spectral_extras_are_fitted_and_shared_out():
  # GD's predictions scaled by y^T y / N: the y_energy term alone, which
  # the polynomial cannot express.
  eta = 0.5 / _mu(FIT_TASKS)[1]
  gd = decompile.from_compiled(_compiled("gd"), loops=LOOPS, lam=LAM, eta=eta)
  model = lambda t: gd(t) * jnp.mean(t.y ** 2, axis=1)[:, None]
  spec = decompile.spectral(model, FIT_TASKS, TEST_TASKS, degree=LOOPS,
                            extras=("y_energy", "start", "query_key"),
                            lam=LAM)
  assert spec.ladder["polynomial+extras"]["disagreement"] < 1e-20
  assert spec.ladder["polynomial"]["disagreement"] > 1e-3
  assert min(spec.shares["y_energy"]) > 1 - 1e-8
  assert max(spec.shares["start"] + spec.shares["query_key"]) < 1e-16
  found = spec.as_dict()
  assert found["extras"] == ["y_energy", "start", "query_key"]
  assert len(found["roots"]) == LOOPS
  for bad, error in ((dict(extras=("noise",)), ValueError),
                     (dict(degree=-1), ValueError),
                     (dict(degree=2.0), TypeError),
                     (dict(lam=-1.0), ValueError)):
    with pytest.raises(error, match="decompile.spectral"):
      decompile.spectral(model, FIT_TASKS, TEST_TASKS, **bad)


# --- reliability: step sizes far from 1 / mu, degenerate and foreign models ---


@pytest.mark.parametrize("scale", [1e-8, 1e-4, None])
def test_exact_gd_is_identified_at_any_step_size(scale):
  # Exact GD at a step far below the random starts' range (0.05 / mu ..
  # 1.5 / mu) must be found exactly, not approached to D ~ 1e-14, where
  # preconditioned_gd (P = eta I, also exact) would be nearer.
  eta = 0.5 / _mu(FIT_TASKS)[1] if scale is None else scale
  model = lambda t: _gd_iterates(t, eta, LOOPS)
  report = decompile.identify(model, FIT_TASKS, TEST_TASKS, lam=LAM)
  assert report.best.family == "gd" and report.closest.family == "gd", [
      (f.family, f.disagreement) for f in report.fits]
  assert report.best.disagreement <= decompile.EXACT
  assert helpers.rel_err(report.best.params["eta"], eta) < 1e-6


def test_a_model_that_predicts_zero_is_refused_in_one_line():
  zero = lambda t: jnp.zeros((LOOPS + 1,) + t.x_query.shape[:2], t.x.dtype)
  message = (r"the model's predictions on fit_tasks are all zero \(every "
             r"compared layer\)")
  with pytest.raises(ValueError, match="decompile.identify: " + message):
    decompile.identify(zero, FIT_TASKS, TEST_TASKS, lam=LAM)
  with pytest.raises(ValueError, match="decompile.fit: " + message):
    decompile.fit(zero, decompile.FAMILIES["gd"], FIT_TASKS, lam=LAM)
  with pytest.raises(ValueError, match="decompile.spectral: " + message):
    decompile.spectral(zero, FIT_TASKS, TEST_TASKS, lam=LAM)
  # Zero on the held-out tasks only is named as such.
  held = lambda t: jnp.where(t.x[:, :1, 0] == FIT_TASKS.x[:, :1, 0],
                             _gd_iterates(t, 0.1, LOOPS), 0.0)
  with pytest.raises(ValueError, match="on test_tasks are all zero"):
    decompile.identify(held, FIT_TASKS, TEST_TASKS, lam=LAM, families=("gd",))


def test_array_like_predictions_are_accepted_and_others_refused():
  eta = 0.5 / _mu(FIT_TASKS)[1]
  rows = lambda t: [r for r in _gd_iterates(t, eta, LOOPS)]  # a list of [B, Q]
  report = decompile.identify(rows, FIT_TASKS, TEST_TASKS, lam=LAM,
                              families=("gd",))
  assert report.best.disagreement <= decompile.EXACT
  assert helpers.rel_err(report.best.params["eta"], eta) < 1e-6
  with pytest.raises(TypeError, match=r"decompile.fit: the model must return "
                     r"predictions \[B, Q\] or \[S, B, Q\] \(an array or "
                     r"array-like\), got dict"):
    decompile.fit(lambda t: {"p": t.y}, decompile.FAMILIES["gd"], FIT_TASKS)


def test_from_model_takes_any_callable_on_the_tokens():
  # A plain function of the tokens (here elsa.elsa_stack itself) reads
  # exactly as the nn.ElsaStack of the same parameters.
  spec = training.TaskSpec(n_train=N, d=D, n_query=Q, tokens="natural")
  form = spec.model_tokens()
  params = ElsaParams.init(jax.random.key(0), m=form.m, n=form.n, k=form.n,
                           lead=(2, 1), dtype=F64)
  task = _tasks(6)
  want = decompile.from_model(nn.ElsaStack(params), spec)(task)
  every = lambda h: elsa.elsa_stack(params, h, return_all=True)
  np.testing.assert_array_equal(decompile.from_model(every, spec)(task), want)
  # A callable returning the last state only is a final-only model.
  final = lambda h: elsa.elsa_stack(params, h)
  np.testing.assert_array_equal(decompile.from_model(final, spec)(task),
                                want[-1])
  with pytest.raises(ValueError, match=r"from_model: the model returned "
                     r"states of shape \(24, 10, 2\); on the natural "
                     r"layout's tokens \(24, 10, 6\)"):
    decompile.from_model(lambda h: h[..., :2], spec)(task)
  with pytest.raises(TypeError, match="from_model: model must be an "
                     "nn.ElsaStack or a callable"):
    decompile.from_model("stack", spec)
