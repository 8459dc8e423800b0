"""The train driver's evaluation (experiments/evaluation.py): the compiled
GD-from-mu stack against ridge GD from mu, and a reference that is not finite
refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elsa import algorithms, attention, programs, ridge, tasks
from experiments import checks
from experiments import evaluation
from experiments import train
from experiments.configs import train as train_config


@pytest.mark.parametrize("n_train,d,n_query,depth", [(5, 3, 2, 3), (3, 4, 1, 2)])
def test_compiled_gd_from_mu_is_ridge_gd_from_mu_at_every_layer(
    n_train, d, n_query, depth):
  family = tasks.get("nonzero_mean", mu_scale=0.8)
  task = family.sample(jax.random.key(d), batch=4, n_train=n_train, d=d,
                       n_query=n_query, dtype=jnp.float64)
  mu = family.mu(d, jnp.float64) * jnp.linspace(0.5, 1.5, d)  # not all equal
  lam, eta = 0.1, 0.4
  want = ridge.gd(task.x, task.y, lam=lam, eta=eta, steps=depth,
                  w0=jnp.broadcast_to(mu, (4, d)))
  ws = evaluation.compiled_gd_from_predict(task, w0=mu, lam=lam, eta=eta,
                                           depth=depth, return_all=True)
  # States: input, set-up (w = mu), depth steps, read-out (w unchanged).
  assert ws.shape == (depth + 3, 4, d)
  scale = np.abs(want).max()
  np.testing.assert_allclose(ws[1:depth + 2], want, rtol=0, atol=1e-10 * scale)
  np.testing.assert_allclose(ws[-1], want[-1], rtol=0, atol=1e-10 * scale)
  pred = evaluation.compiled_gd_from_predict(task, w0=mu, lam=lam, eta=eta,
                                             depth=depth)
  np.testing.assert_allclose(
      pred, np.einsum("bqd,bd->bq", task.x_query, want[-1]), rtol=0,
      atol=1e-10 * np.abs(pred).max())
  np.testing.assert_allclose(pred, evaluation.gd_from_predict(
      task, w0=mu, lam=lam, eta=eta, steps=depth), rtol=1e-10)
  # mu lives in the biases: without them the stack does not start at mu.
  compiled = programs.compile(algorithms.ridge_gd_from(
      n_train=n_train, d=d, n_query=n_query, w0=mu))
  params = compiled.params(loops=depth, lam=lam, eta=eta, dtype=jnp.float64)
  no_bias = params._replace(b1=0 * params.b1, b2=0 * params.b2,
                            b3=0 * params.b3)
  h0 = compiled.encode(X=task.x, y=task.y[..., None], Xq=task.x_query)
  hs = attention.elsa_stack(no_bias, h0, return_all=True)
  assert np.abs(compiled.read(hs, "w")[1, ..., 0] - mu).max() > 0.1
  with pytest.raises(ValueError, match="w0 must be a concrete array of d=3"):
    algorithms.ridge_gd_from(n_train=2, d=3, w0=np.ones(2))




def test_a_reference_that_is_not_finite_stops_the_run_before_training(
    tmp_path, monkeypatch):
  """A family's reference NaN on some test prompts (as Bayes was on
  mixed_noise in float32 at a small noise level): one line naming the
  family, the reference and how many prompts, before any training, never a
  table with an empty cell."""
  def broken(task):  # NaN on the first 3 prompts of each chunk of 16
    rows = jnp.arange(task.y_query.shape[0])[:, None] < 3
    return jnp.where(rows, jnp.nan, 0 * task.y_query)
  monkeypatch.setattr(tasks.TaskFamily, "references", property(
      lambda self: {"least_squares": tasks.least_squares, "broken": broken}))
  config = train_config.get_config("tiny")
  config.task, config.n_test, config.eval_chunk = "linear", 32, 16
  config.shifts = {}
  config.task_options.w_scale = 2.0
  message = (r"^task linear \({'w_scale': 2\.0}\): its reference 'broken' is "
             r"not finite \(NaN or inf\) on 6 of 32 test prompts in float32;")
  with pytest.raises(evaluation.NonFiniteReference, match=message):
    evaluation.reference_losses(config)
  assert issubclass(evaluation.NonFiniteReference, checks.ConfigError)
  workdir = tmp_path / "run"
  with pytest.raises(evaluation.NonFiniteReference, match=message):
    train.run(config, str(workdir))
  assert not (workdir / "checkpoints").exists()
  # Finite references pass, each per prompt, "zero" last.
  monkeypatch.setattr(tasks.TaskFamily, "references", property(
      lambda self: {"least_squares": tasks.least_squares}))
  losses = evaluation.reference_losses(config)
  assert list(losses) == ["least_squares", "zero"]
  assert all(v.shape == (32,) and np.isfinite(v).all()
             for v in losses.values())
