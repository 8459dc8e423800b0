"""experiments/train.py on the families of elsa.tasks: the compiled GD-from-mu
stack, the driver end to end on two families, refusals of bad task configs."""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from elsa import algorithms, programs, ridge, tasks
from experiments import checks
from experiments import decompile_tasks
from experiments import evaluation
from experiments import loss_stats
from experiments import tables
from experiments import train
from experiments import workdirs
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
  import elsa  # pylint: disable=import-outside-toplevel
  hs = elsa.elsa_stack(no_bias, h0, return_all=True)
  assert np.abs(compiled.read(hs, "w")[1, ..., 0] - mu).max() > 0.1
  with pytest.raises(ValueError, match="w0 must be a concrete array of d=3"):
    algorithms.ridge_gd_from(n_train=2, d=3, w0=np.ones(2))


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


@pytest.mark.parametrize("draw,want", [
    # sqrt(pi / 2) s / sqrt(n) for normal draws; 1 / (2 f(m) sqrt(n)) with
    # f(m) = 1 for uniform ones, and for exponential ones f(ln 2) = 1/2.
    (lambda rng, n: 3.0 * rng.standard_normal(n), 3.0 * np.sqrt(np.pi / 2)),
    (lambda rng, n: rng.uniform(size=n), 0.5),
    (lambda rng, n: rng.exponential(size=n), 1.0),
])
def test_median_se_is_the_sampling_spread_of_the_median(draw, want):
  # The estimate, from one sample of n: its own noise is about
  # 1 / sqrt(2 z sqrt(n)) = 5% here, so a wrong factor (2, z) cannot pass.
  n = 40_000
  rng = np.random.default_rng(7)
  assert loss_stats.median_se(draw(rng, n)) == pytest.approx(want / np.sqrt(n),
                                                        rel=0.15)
  # What the medians of 400 samples of 2000 spread by, against the mean
  # estimate over those samples.
  samples = [draw(rng, 2000) for _ in range(400)]
  assert np.std([np.median(x) for x in samples], ddof=1) == pytest.approx(
      np.mean([loss_stats.median_se(x) for x in samples]), rel=0.1)


def test_loss_and_paired_summaries_known_answers():
  # Mean, its standard error, median and the worst 1%'s share of the total.
  s = loss_stats.loss_summary([1.0, 2.0, 3.0, 4.0, 100.0])
  assert s == pytest.approx({"mean": 22.0, "se": np.sqrt(7610 / 4 / 5),
                             "median": 3.0, "median_se": s["median_se"],
                             "worst_share": 100 / 110}, rel=1e-12)
  # n = 3: the median's z-interval (quantiles 1/2 -+ 1.96 / (2 sqrt(3)),
  # clipped) is the whole sample, so the se is its range over 2 z.
  assert loss_stats.median_se([2.0, 1.0, 30.0]) == pytest.approx(29 / 3.92,
                                                            rel=1e-12)
  # 1% of 200 prompts is the two worst: half of this mean.
  s = loss_stats.loss_summary([1.0] * 198 + [99.0, 101.0])
  assert s["worst_share"] == pytest.approx(200 / 398, rel=1e-12)
  assert s["median"] == 1.0
  # Paired: the statistics of a - b, prompt by prompt.
  s = loss_stats.paired_summary([1.0, 2.0, 3.0, 10.0], [0.0, 0.0, 6.0, 10.0])
  assert s == pytest.approx({"mean": 0.0, "se": np.sqrt(14 / 3 / 4),
                             "median": 0.5,
                             "median_se": loss_stats.median_se([1, 2, -3, 0])},
                            abs=1e-12)
  # Pairing removes the prompts' shared difficulty.
  base = np.arange(1.0, 101.0) ** 2
  s = loss_stats.paired_summary(base + 0.1 * (-1.0) ** np.arange(100), base)
  assert s["mean"] == pytest.approx(0.0, abs=1e-12)
  assert s["se"] == pytest.approx(0.1 / np.sqrt(100) * np.sqrt(100 / 99),
                                  rel=1e-9)
