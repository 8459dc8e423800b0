"""experiments/train.py on the families of elsa.tasks: the driver end to end
on two families, the tasks variant, refusals of bad task configs."""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from elsa import tasks
from experiments import checks
from experiments import decompile_tasks
from experiments import tables
from experiments import train
from experiments import workdirs
from experiments.configs import train as train_config


def _config(tmp_runs: dict) -> ml_collections.ConfigDict:
  config = train_config.get_config("tiny")
  config.depths = (1,)
  config.steps = 40
  config.warmup_steps = 5
  config.log_every = 20
  config.checkpoint_every = 40
  config.learning_rates = (1e-2,)
  config.n_test = 64
  config.eval_chunk = 32
  config.eta_grid = 8
  config.lam = 0.0
  config.shifts = ml_collections.ConfigDict()
  config.task_runs = ml_collections.ConfigDict(tmp_runs)
  return config


def test_driver_trains_and_evaluates_families(tmp_path):
  config = _config({
      "nonzero_mean": {"task": "nonzero_mean", "models": ("elsa_masked",),
                       "task_options": {"mu_scale": 1.0}},
      "decision_tree": {"task": "decision_tree",
                        "models": ("lsa_residual_trained",)}})
  out = train.run(config, str(tmp_path))
  assert set(out) == {"nonzero_mean", "decision_tree"}
  res = out["nonzero_mean"]
  sub = train._task_run_config(config, "nonzero_mean")  # pylint: disable=protected-access
  assert workdirs.Workdir(str(tmp_path / "nonzero_mean"), sub).read_json(
      "results.json") == res
  assert res["task"] == "nonzero_mean" and res["best_reference"] == "bayes"
  assert res["task_options"]["mu_scale"] == 1.0
  losses, se = res["test_loss"], res["test_loss_se"]
  for name in ("elsa_masked", "gd_best_eta",
               "gd_from_mu", "gd_from_mu_compiled", "bayes", "least_squares",
               "ridge", "knn", "averaging", "zero"):
    assert len(losses[name]) == 1 and np.isfinite(losses[name][0]), name
  # The compiled stack is GD from mu (float32 rounding apart).
  np.testing.assert_allclose(losses["gd_from_mu_compiled"],
                             losses["gd_from_mu"], rtol=1e-4)
  # GD from the prior mean beats GD from zero; Bayes beats every model and
  # GD by more than noise can explain nowhere (paired differences).
  assert all(a < b for a, b in zip(losses["gd_from_mu"],
                                   losses["gd_best_eta"]))
  for name, diff in res["vs_best_reference"].items():
    assert all(m > -2 * s for m, s in zip(diff["mean"], diff["se"])), name
  assert se["bayes"][0] > 0
  # Medians and tails beside the means; every reference paired with Bayes;
  # a paired mean is the difference of the means (the same prompts).
  for field in ("test_loss_median", "test_loss_median_se",
                "test_loss_worst_share"):
    assert set(res[field]) == set(losses), field
  assert "least_squares" in res["vs_best_reference"]
  diff = res["paired"]["elsa_masked - gd_from_mu_compiled"]
  np.testing.assert_allclose(diff["mean"], np.subtract(
      losses["elsa_masked"], losses["gd_from_mu_compiled"]), rtol=1e-9)
  assert set(res["paired"]) == {"elsa_masked - gd_from_mu_compiled"}
  assert "| elsa_masked - gd_from_mu_compiled |" in tables.family_table(res)
  assert os.path.exists(tmp_path / "nonzero_mean" / "figures" /
                        "test_loss_vs_depth.png")
  tree = out["decision_tree"]
  assert "tree" in tree["references"] and "bayes" not in tree["references"]
  assert tree["best_reference"] in tree["references"]
  assert np.isnan(np.asarray(tree["test_loss"].get("gd_from_mu", [np.nan]),
                             float)).all()
  # A rerun finds the results and trains nothing.
  again = train.run(config, str(tmp_path))
  assert again == out
  # The decompiler reads the run's models back; on the compiled GD-from-mu
  # stack (GD from w0 = mu: x_q^T ((I - eta A)^L mu + g(A) b)) the start
  # term at A = 0 is mu itself.
  rows = decompile_tasks.decompile_run(str(tmp_path / "nonzero_mean"))
  assert [(r["name"], r["depth"]) for r in rows] == [
      ("elsa_masked", 1), ("gd_from_mu_compiled", 1)]
  control = rows[1]["spectral"]
  assert control.disagreement < 1e-12, control.disagreement
  np.testing.assert_allclose(rows[1]["start"][-1], np.ones(2), rtol=1e-8)
  assert 0 < rows[0]["spectral"].shares["start"][-1]
  line = decompile_tasks._describe(rows[1])  # pylint: disable=protected-access
  assert "S(0) = [1.000, 1.000] (cosine with mu 1.000" in line, line
  with pytest.raises(SystemExit, match="holds no config.json"):
    decompile_tasks.main([str(tmp_path), "no_such_run"])


@pytest.mark.parametrize("change,message", [
    ({"task": "cubic"}, r"config\.task must be one of \['ridge', 'linear', "),
    ({"task": "anisotropic", "task_options": {"kapa": 2.0}},
     "no option kapa"),
    ({"task": "anisotropic", "task_options": {"kappa": 0.5}},
     "kappa must be >= 1"),
    ({"task": "sparse_linear", "task_options": {"k": 9}},
     "k=9 nonzero coordinates need d >= k"),
    ({"task_options": {"kappa": 2.0}}, "task 'ridge' takes none"),
])
def test_bad_task_configs_are_refused_before_the_workdir(tmp_path, change,
                                                         message):
  config = _config({"bad": change})
  workdir = tmp_path / "w"
  with pytest.raises(checks.ConfigError, match=message):
    train.run(config, str(workdir))
  assert not workdir.exists()


def test_tasks_variant_runs_every_family():
  config = train_config.get_config("tasks")
  assert {run.task for run in config.task_runs.values()} == set(
      tasks.FAMILIES)
  for name in config.task_runs:
    train.validate(train._task_run_config(config, name))  # pylint: disable=protected-access
  # One run alone is the same run (the whole variant then skips it).
  one = train_config.get_config("tasks.mixed_noise")
  assert list(one.task_runs) == ["mixed_noise"]
  assert (train._task_run_config(one, "mixed_noise")  # pylint: disable=protected-access
          == train._task_run_config(config, "mixed_noise"))  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="unknown run 'cubic'"):
    train_config.get_config("tasks.cubic")
  # The default run is today's ridge task.
  default = train_config.get_config()
  assert default.task == "ridge" and not default.task_runs
