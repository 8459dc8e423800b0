"""The field's protocol (experiments/prefix_protocol.py): its tiny variant
end to end as a user runs it, the predictions at every prefix against a
direct computation, tuning on known numbers, resuming an interrupted
training exactly, and the refusals before any work."""

import json
import os
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elsa import nn
from elsa import tasks
from elsa import training
from experiments import checks
from experiments import cli
from experiments import prefix_protocol as pp
from experiments import workdirs
from experiments.configs import train as train_configs
from test_decompile_driver import _as_a_user

# conftest.no_cache_writes: XLA:CPU segfaulted writing transformer programs
# to the persistent cache in a long-lived worker.
pytestmark = pytest.mark.usefixtures("no_cache_writes")


def _config(variant="prefix_tiny", **overrides):
  config = train_configs.get_config(variant)
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
  """``prefix_tiny`` from a fresh workdir in a fresh process without the
  suite's 64-bit mode: its workdir, results and log."""
  workdir = str(tmp_path_factory.mktemp("prefix") / "run")
  return (workdir, *_train_as_a_user("prefix_tiny", workdir))


def _train_as_a_user(variant: str, workdir: str):
  """``experiments.train`` of ``train.py:variant`` in a fresh process, a
  user's environment: ``(results, stderr, env)``."""
  env = {**_as_a_user(os.environ), "PYTHONPATH": os.getcwd()}
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train",
       f"--config=experiments/configs/train.py:{variant}",
       f"--workdir={workdir}"],
      env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    return json.load(f), proc.stderr, env


def test_tiny_run_writes_every_curve_table_and_figure(user_run):
  workdir, results, log, _ = user_run
  config = _config()
  n = config.n_points
  assert results["examples"] == list(range(n))
  for family in config.families:
    got = results["families"][family]
    assert set(got["models"]) == set(nn.ATTENTION)
    for kind, model in got["models"].items():
      assert model["learning_rate"] in config.learning_rates, kind
      assert np.shape(model["val_loss"]) == (len(config.learning_rates),
                                             config.seeds)
      curve = model["test"]["error"]
      assert len(curve["curve"]) == len(curve["se"]) == n
      assert curve["n_seeds"] == config.seeds - sum(
          model["diverged"][config.learning_rates.index(
              model["learning_rate"])])
      # The mean over seeds is what the curve says it is.
      np.testing.assert_allclose(np.mean(curve["seeds"], axis=0),
                                 curve["curve"], rtol=1e-12)
    for name, ref in got["references"].items():
      assert len(ref["error"]["curve"]) == n, name
      assert all(np.isfinite(ref["error"]["curve"])), name
    assert os.path.exists(os.path.join(workdir, "figures", f"{family}.png"))
    with open(os.path.join(workdir, "tables", f"{family}.md"),
              encoding="utf-8") as f:
      table = f.read()
    assert all(kind in table for kind in nn.ATTENTION)
    # A finished cell keeps no training state.
    assert not os.path.exists(os.path.join(workdir, "cells", family,
                                           "elsa.npz"))
  for shift in config.shifts:
    assert set(results["families"]["linear"]["shifts"][shift]["models"]) == \
        set(nn.ATTENTION)
    assert os.path.exists(os.path.join(workdir, "figures", "shifts",
                                       f"linear_{shift}.png"))
  assert "Unable to initialize backend" not in log


def test_references_at_a_known_answer(user_run):
  """Noiseless linear regression in d = 3: least squares is exact from d
  examples on; at 0 examples every predictor says 0, an error of
  E[y^2] / d = 1 up to sampling."""
  _, results, _, _ = user_run
  d = _config().d
  refs = results["families"]["linear"]["references"]
  ls = np.asarray(refs["least_squares"]["error"]["curve"])
  assert (ls[d:] < 1e-6).all() and (ls[:d] > 1e-2).all(), ls
  at_zero = {name: r["error"]["curve"][0] for name, r in refs.items()}
  assert len(set(at_zero.values())) == 1, at_zero
  assert 0.5 < at_zero["least_squares"] < 2


def test_bayes_with_no_examples_is_the_prior_mean():
  """On nonzero_mean the posterior mean given no examples is x_q^T mu, not
  the baselines' 0; with examples it is the family's own bayes on the
  prefix."""
  config = _config()
  family = tasks.get("nonzero_mean")
  task = pp.test_prompts(config, "nonzero_mean", batch=4)
  preds = pp.reference_predictions(family, task, host_prompts=2)
  mu = np.asarray(family.mu(config.d))
  np.testing.assert_allclose(preds["bayes"][:, 0],
                             np.asarray(task.x_query[:, 0]) @ mu, rtol=1e-6)
  assert np.all(preds["least_squares"][:, 0] == 0)
  assert np.all(np.abs(preds["bayes"][:, 0]) > 0)
  from elsa import shifts
  np.testing.assert_allclose(preds["bayes"][:, 3], np.asarray(
      family.bayes(shifts.at_prefix(task, 3)))[:, 0], rtol=1e-6)


def test_the_same_command_again_computes_nothing(user_run):
  workdir, results, _, env = user_run
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train",
       "--config=experiments/configs/train.py:prefix_tiny",
       f"--workdir={workdir}"],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "nothing to compute" in proc.stderr
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    assert json.load(f) == results


def test_predictions_at_every_prefix_match_one_pass_per_prefix():
  """Both forms of :func:`pp.model_predictions` against the model run on
  each prefix of the prompt by itself (a causal model's prediction at x_i
  sees examples < i only)."""
  config = _config()
  task = pp.test_prompts(config, "linear", batch=3)
  assert pp.queries_on_prompt(task)
  model = nn.Transformer(config.d + 1, 1, width=8, depth=2, heads=2,
                         max_len=2 * config.n_points, rngs=nnx.Rngs(0))
  x, y = pp._points(task)  # pylint: disable=protected-access
  want = np.stack([np.asarray(training.prefix_predictions(
      model, x[:, :i + 1], y[:, :i + 1]))[:, i]
                   for i in range(config.n_points)], axis=1)
  for on_prompt in (True, False):
    got = pp.model_predictions(model, task, queries_on_prompt=on_prompt)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_queries_off_the_prompt_are_read_where_they_stand():
  """A shift whose queries are not the prompt's points: query i at point i,
  after the first i examples."""
  config = _config()
  task = pp.test_prompts(config, "linear", "orthogonal_train_test", batch=3)
  assert not pp.queries_on_prompt(task)
  model = nn.Transformer(config.d + 1, 1, width=8, depth=1, heads=2,
                         max_len=2 * config.n_points, rngs=nnx.Rngs(1))
  got = pp.model_predictions(model, task, queries_on_prompt=False)
  for i in range(config.n_points):
    x = jnp.concatenate([task.x[:, :i], task.x_query[:, i:i + 1]], axis=1)
    y = jnp.concatenate([task.y[:, :i], task.y_query[:, i:i + 1]], axis=1)
    np.testing.assert_allclose(
        got[:, i], training.prefix_predictions(model, x, y)[:, i],
        rtol=2e-5, atol=2e-6)


def test_choose_takes_the_best_mean_among_the_fewest_diverged():
  config = _config(learning_rates=(1e-3, 1e-2, 1e-1), seeds=2)
  val = np.array([[0.5, 0.7], [0.2, np.nan], [0.3, 0.3]])
  diverged = np.array([[False, False], [False, True], [False, False]])
  assert pp.choose(config, val, diverged) == 2  # 0.3 < 0.6; 0.2 lost a seed
  assert pp.choose(config, val, np.ones_like(diverged)) is None
  every_one_lost = np.array([[True, False], [False, True], [True, True]])
  assert pp.choose(config, val, every_one_lost) == 1  # 0.2 beats 0.7


def test_an_interrupted_training_resumes_to_the_same_models(tmp_path):
  """Killed after its first checkpoint, the rerun loads it and ends with the
  parameters of an uninterrupted run, bit for bit."""
  config = _config(attention=("elsa",), steps=40, log_every=10,
                   checkpoint_every=20)
  progress = lambda: cli.Progress(config.steps, name="train", unit="steps")
  with workdirs.claim_workdir(str(tmp_path / "whole"), config) as wd:
    *_, whole, losses, _ = pp.train(config, "linear", "elsa", wd, progress())

  calls = []
  real = pp.make_train_chunk

  def dies_after_two(*args, **kwargs):
    chunk = real(*args, **kwargs)
    def counted(*a):
      calls.append(1)
      if len(calls) > 2:
        raise KeyboardInterrupt
      return chunk(*a)
    return counted

  workdir = str(tmp_path / "cut")
  pp.make_train_chunk = dies_after_two
  try:
    with pytest.raises(KeyboardInterrupt):
      with workdirs.claim_workdir(workdir, config) as wd:
        pp.train(config, "linear", "elsa", wd, progress())
  finally:
    pp.make_train_chunk = real
  with workdirs.claim_workdir(workdir, config) as wd:
    assert int(wd.read_npz("cells/linear/elsa.npz")["step"]) == 20
    *_, resumed, resumed_losses, _ = pp.train(config, "linear", "elsa", wd,
                                              progress())
  np.testing.assert_array_equal(resumed_losses, losses)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(a, b)


def test_the_field_variant_runs_at_tiny_size_as_a_user_runs_it(tmp_path):
  """``field.tiny``: Garg et al.'s structure (curriculum over d and N,
  learned positions, shifts) at tiny sizes, in a fresh process."""
  workdir = str(tmp_path / "field")
  results, _, _ = _train_as_a_user("field.tiny", workdir)
  config = _config("field.tiny")
  assert set(results["families"]) == set(config.families)
  for family in config.families:
    for kind, model in results["families"][family]["models"].items():
      assert len(model["test"]["error"]["curve"]) == config.n_points, kind
      assert np.shape(model["train_loss"]) == (
          len(config.learning_rates) * config.seeds,
          config.steps // config.log_every)
  assert set(results["families"]["linear"]["shifts"]) == set(config.shifts)


def test_the_field_variant_is_garg_et_al_and_its_tiny_form_validates():
  field = _config("field")
  assert (field.d, field.n_points, field.depth, field.heads, field.width) == (
      20, 41, 12, 8, 256)
  assert pp.curriculum(field).final == (20, 41)
  assert pp.curriculum(field).at(0) == (5, 11)
  tiny = _config("field.tiny")
  pp.validate(tiny)
  cur = pp.curriculum(tiny)
  assert cur.at(0) == (2, 3) and cur.at(tiny.steps) == (4, 7)


@pytest.mark.parametrize("overrides, message", [
    (dict(attention=("elsa", "linear")), "config.attention"),
    (dict(checkpoint_every=15), "config.checkpoint_every must divide"),
    (dict(seeds=1), "config.seeds"),
    (dict(learning_rates=(1e-3, -1.0)), "config.learning_rates"),
    (dict(shift_families=("decision_tree",)), "config.shift_families"),
    (dict(families=("linear", "sparse_linear"), d=2), "sparse_linear"),
    (dict(width=1 << 16, batch=1 << 14), "GiB, more than the"),
])
def test_bad_configs_are_refused_before_any_work(overrides, message):
  with pytest.raises(checks.ConfigError, match=message):
    pp.validate(_config(**overrides))


def test_a_curriculum_that_does_not_end_at_d_and_n_points_is_refused():
  config = _config("field.tiny")
  config.points.end = 9
  with pytest.raises(checks.ConfigError, match="must end at config.d"):
    pp.validate(config)


def test_a_non_finite_reference_stops_the_run(monkeypatch):
  config = _config(families=("linear",))
  family = tasks.get("linear")
  broken = {**family.references,
            "least_squares": lambda t: jnp.full(t.y_query.shape, jnp.nan)}
  monkeypatch.setattr(type(family), "references",
                      property(lambda self: broken))
  with pytest.raises(checks.ConfigError, match="'least_squares' is not finite"):
    pp.references(config, "linear")
