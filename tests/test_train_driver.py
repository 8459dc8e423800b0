"""End-to-end test of experiments/train.py on a tiny config: results, tuning, resume, overwrite."""

import os
import re
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import checks
from experiments import cli
from experiments import decompile
from experiments import evaluation
from experiments import plotting
from experiments import train
from experiments import train_setup
from experiments import workdirs
from experiments.configs import decompile as decompile_config
from experiments.configs import train as train_config

MODELS = ("elsa_trained", "lsa_trained", "lsa_residual_trained", "elsa_masked")
BASELINES = ("bayes_optimal", "gd_best_eta", "ridge", "elsa_constructed_gd",
             "least_squares", "zero")


def _config():
  """Two checkpoints (steps 10, 20) of one depth; a 2-point grid of which one
  point (lr 1e6) diverges; seconds end to end."""
  config = train_config.get_config("tiny")
  config.depths = (1,)
  config.steps = 20
  config.warmup_steps = 5
  config.learning_rates = (1e-2, 1e6)
  config.log_every = 10
  config.checkpoint_every = 10
  config.keep_checkpoints = 3
  config.n_test = 32
  config.eta_grid = 5
  del config.shifts["x_laplace"]
  return config


def _checkpoints(workdir: str, model: str = "elsa_trained_L1") -> list[str]:
  return sorted(os.listdir(os.path.join(workdir, "checkpoints", model)),
                key=int)


def _check_results(config, workdir: str, results: dict) -> None:
  # Written through the workdir contract: tied to the config, checksummed.
  assert workdirs.Workdir(workdir, config).read_json("results.json") == results
  losses = results["test_loss"]
  assert set(losses) == {*MODELS, *BASELINES}
  for name in (*MODELS, *BASELINES):
    assert len(losses[name]) == 1 and len(results["test_loss_se"][name]) == 1
    assert np.isfinite(losses[name][0]) and losses[name][0] > 0
  # 20 steps of training already beat predicting zero.
  assert losses["elsa_trained"][0] < 0.9 * losses["zero"][0]
  # Training lowered the loss: the last logged mean is below the first.
  for curves in results["train_loss"].values():
    assert len(curves[0]) == config.steps // config.log_every
    assert curves[0][-1] < curves[0][0]
  # Tuning: the lr-1e6 point diverged in every model, was reported and
  # skipped; the chosen point is the other one, its validation loss finite.
  assert results["grid"] == [[1e-2, 0.03], [1e6, 0.03]]
  for name in MODELS:
    (tuned,) = results["tuning"][name]
    assert tuned["diverged"] == [[1e6, 0.03]]
    assert (tuned["learning_rate"], tuned["init_scale"]) == (1e-2, 0.03)
    assert np.isfinite(tuned["val_loss"][0]) and tuned["val_loss"][1] is None
  assert results["diverged"] == {name: [False] for name in MODELS}
  # No model beats the Bayes-optimal predictor by more than two standard
  # errors of the paired per-task difference (that would be a bug).
  for name in MODELS:
    diff = results["vs_bayes"][name]
    assert diff["mean"][0] > -2 * diff["se"][0], (name, diff)
  assert results["bayes_lam"] == pytest.approx(
      config.noise**2 / config.n_train)
  # The residual LSA is the field's: only the examples enter its key/value
  # sums; ELSA and the plain LSA read every token.
  for name in MODELS:
    model = train_setup.init_model(config, name=name, depth=1,
                                   init_scale=0.03, dtype=jnp.float32)
    mask = getattr(model, "key_mask", None)
    if name in ("lsa_residual_trained", "elsa_masked"):
      np.testing.assert_array_equal(
          np.asarray(mask[...]),
          np.arange(config.n_train + config.n_query + config.d)
          < config.n_train)
    else:
      assert mask is None, name
  # The constructed stack is GD (float32).
  assert losses["elsa_constructed_gd"][0] == pytest.approx(
      losses["gd_best_eta"][0], rel=1e-4)
  assert len(results["gd_eta_grid"]["etas"]) == config.eta_grid
  assert results["gd_best_eta"][0] in results["gd_eta_grid"]["etas"]
  # Analysis: per-layer predictions (L + 1 of them; layer 0 predicts 0) and
  # the agreement of input sensitivities with GD.
  for name in MODELS:
    (layers,) = results["layers"][name]
    assert len(layers["test_loss"]) == 2
    assert layers["test_loss"][0] == pytest.approx(losses["zero"][0])
    assert layers["test_loss"][1] == pytest.approx(losses[name][0], rel=1e-5)
    agree = results["trained_vs_gd"][name]
    assert -1 <= agree["sensitivity_cosine"][0] <= 1
    assert agree["sensitivity_rel_l2"][0] >= 0
    assert results["ms_per_step"][name][0] > 0
  assert results["layers"]["gd_steps"][0]["test_loss"][1] == pytest.approx(
      losses["gd_best_eta"][0], rel=1e-5)
  assert set(results["shifted"]) == {"x_scale_x2"}
  for name in ("train_loss.png", "test_loss_vs_depth.png", "trained_vs_gd.png",
               "layer_predictions.png", "shifted_test_loss.png"):
    assert os.path.getsize(os.path.join(workdir, "figures", name)) > 1000
  assert _checkpoints(workdir) == ["10", "20"]


# Two tests, each a whole story: under pytest-xdist a shared fixture would run
# once per worker anyway, and the compiled train step is reused within a test.


def test_results_rerun_and_resume(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  config = _config()
  results = train.run(config, workdir)
  _check_results(config, workdir, results)
  # A finished run is skipped.
  assert train.run(config, workdir) == results
  # Interrupt: drop the results and the last checkpoint of one model; the
  # rerun resumes at step 10 and, seeing the same batches, ends identically.
  resumed_at = []
  monkeypatch.setattr(cli.Progress, "resumed",
                      lambda self, count: resumed_at.append(count))
  os.remove(os.path.join(workdir, "results.json"))
  shutil.rmtree(os.path.join(workdir, "checkpoints", "elsa_trained_L1", "20"))
  resumed = train.run(config, workdir)
  # Progress counts grid-point steps: elsa from step 10, the others finished.
  assert resumed_at == [10 * 2, 20 * 2, 20 * 2, 20 * 2]
  assert resumed["test_loss"] == results["test_loss"]
  assert resumed["train_loss"] == results["train_loss"]
  assert _checkpoints(workdir) == ["10", "20"]
  # A different config is refused.
  config = _config()
  config.lam = 0.5
  with pytest.raises(ValueError, match="different config"):
    train.run(config, workdir)


def test_overwrite_does_not_resume_old_checkpoints(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  results = train.run(_config(), workdir)
  assert _checkpoints(workdir) == ["10", "20"]
  # Same model shapes and step count, so the old checkpoints (steps 10 and
  # 20) would restore: a resumed run would start at its last step and train
  # nothing. (Same checkpoint_every: the compiled train chunk is reused.)
  config = _config()
  config.seed = 1  # new initial weights and batches: new losses
  config.keep_checkpoints = 1
  resumed_at = []
  monkeypatch.setattr(cli.Progress, "resumed",
                      lambda self, count: resumed_at.append(count))
  mine = os.path.join(workdir, "checkpoints", "README_mine.txt")
  with open(mine, "w", encoding="utf-8") as f:
    f.write("mine")
  new = train.run(config, workdir, overwrite=True)
  assert os.path.exists(mine)  # beside the checkpoints, not the driver's
  assert resumed_at == []  # every model trained from step 0
  # Only the new run's last checkpoint: the old ones (10, 20) were deleted.
  assert _checkpoints(workdir) == ["20"]
  assert _checkpoints(workdir, "lsa_trained_L1") == ["20"]
  assert _checkpoints(workdir, "lsa_residual_trained_L1") == ["20"]
  assert workdirs.read_json(os.path.join(workdir, "config.json")) == (
      checks.config_dict(config))
  assert new["train_loss"] != results["train_loss"]


def test_config_variants():
  assert train_config.get_config().models == MODELS
  tiny = train_config.get_config("tiny")
  assert tiny.depths == (1, 2) and tiny.steps == 200
  grid = train_config.get_config("grid")
  assert len(train_setup.grid(grid)) == 9
  vo = train_config.get_config("vonoswald")
  assert (vo.d, vo.n_train, vo.n_query, vo.noise, vo.batch, vo.steps) == (
      10, 10, 1, 0.0, 2048, 5000)
  assert vo.tied and vo.models == ("lsa_residual_trained",)
  spec = train.task_spec(vo)
  assert (spec.x_dist, spec.x_scale) == ("uniform", pytest.approx(12**-0.5))
  with pytest.raises(ValueError, match="unknown argument 'huge'"):
    train_config.get_config("huge")


def test_bad_models_and_grids_are_refused(tmp_path):
  config = _config()
  config.models = ("elsa_trained", "transformer")
  with pytest.raises(checks.ConfigError, match="models"):
    train.run(config, str(tmp_path / "a"))
  config = _config()
  config.init_scales = ()
  with pytest.raises(checks.ConfigError, match="init_scales"):
    train.run(config, str(tmp_path / "b"))


@pytest.mark.parametrize("field,value,pattern", [
    ("steps", 0, r"config\.steps must be an int >= 1"),
    ("log_every", 0, r"config\.log_every must be an int >= 1"),
    ("log_every", 7, r"config\.log_every must divide config\.steps"),
    ("checkpoint_every", 0, r"config\.checkpoint_every must be an int >= 1"),
    ("n_test", 1, r"config\.n_test must be an int >= 2"),
    ("noise", float("nan"), r"config\.noise must be a finite number >= 0"),
    ("learning_rates", (1e-2, -1.0), r"config\.learning_rates\[1\] must be"),
    ("models", ("gpt",), r"config\.models\[0\] must be one of"),
    ("depths", (), r"config\.depths must be a non-empty tuple"),
])
def test_bad_config_is_refused_before_the_workdir_is_touched(
    tmp_path, field, value, pattern):
  config = _config()
  config[field] = value
  workdir = tmp_path / "run"
  with pytest.raises(checks.ConfigError, match=pattern):
    train.run(config, str(workdir))
  assert not workdir.exists()


def _checkpoint_config(seed: int):
  config = _config()
  config.seed = seed
  config.models = ("elsa_trained",)
  config.learning_rates = (1e-2,)
  return config


def _train_only(monkeypatch):
  """train.run without the evaluation and figures (the checkpoints are the
  point here)."""
  monkeypatch.setattr(evaluation, "evaluate_ridge",
                      lambda config, trained, etas: {
      "test_loss": {name: [1.0] * len(config.depths)
                    for name in (*config.models, "gd_best_eta")}})
  monkeypatch.setattr(plotting, "train_figures", lambda results: {})


def test_a_foreign_or_damaged_checkpoint_is_refused_by_name(tmp_path,
                                                            monkeypatch):
  """A checkpoint of another config (seed 1 copied into a seed-0 workdir) or
  with zeroed bytes is refused, naming it and the way out; the way out
  works."""
  _train_only(monkeypatch)
  mine, other = str(tmp_path / "seed0"), str(tmp_path / "seed1")
  train.run(_checkpoint_config(0), mine)
  train.run(_checkpoint_config(1), other)
  folder = os.path.join("checkpoints", "elsa_trained_L1")
  step = os.path.join(mine, folder, "20")
  shutil.rmtree(step)
  shutil.copytree(os.path.join(other, folder, "20"), step)
  os.remove(os.path.join(mine, "results.json"))
  with pytest.raises(workdirs.CorruptOutput,
                     match=f"elsa_trained_L1/20' was written by another "
                     f"config.*delete '.*{folder}'.*--overwrite") as err:
    train.run(_checkpoint_config(0), mine)
  assert "\n" not in str(err.value)
  # Zeroed bytes: every file of the last step.
  step = os.path.join(other, folder, "20")
  for parent, _, names in os.walk(step):
    for name in names:
      path = os.path.join(parent, name)
      with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))
  os.remove(os.path.join(other, "results.json"))
  with pytest.raises(workdirs.CorruptOutput,
                     match=f"elsa_trained_L1/20' .*not a readable checkpoint"
                     f".*delete '.*{folder}'") as err:
    train.run(_checkpoint_config(1), other)
  assert "\n" not in str(err.value)
  shutil.rmtree(os.path.join(other, folder))  # the way out
  train.run(_checkpoint_config(1), other)
  assert _checkpoints(other) == ["10", "20"]


def _follow_way_outs(run, expected: list[str]) -> dict:
  """Calls ``run()`` until it finishes; each refusal must match the next of
  ``expected`` and name a path to delete, which is deleted (what a user does)
  before the next call. Returns what the finished run returned."""
  for pattern in expected:
    with pytest.raises((workdirs.CorruptOutput, workdirs.WorkdirInUse),
                       match=pattern) as err:
      run()
    message = str(err.value)
    assert "\n" not in message
    for path in re.findall(r"delete '([^']+)'(?: and '([^']+)')?", message)[0]:
      if os.path.isdir(path):
        shutil.rmtree(path)
      elif path:
        os.remove(path)
  return run()


def test_a_checkpoint_under_another_name_is_refused_and_the_way_out_works(
    tmp_path, monkeypatch):
  """CK1-CK3: the seal binds the model, depth, grid and step. Another model's
  checkpoint under this name (CK2), a depth-1 one in the depth-2 folder
  (CK3, not a vmap error) and step 10's filed as step 20 (CK1) are each
  refused by name; deleting what the message names and rerunning the same
  command ends in the run a clean workdir gives."""
  _train_only(monkeypatch)
  config = _checkpoint_config(0)
  config.models = ("lsa_trained", "lsa_residual_trained")
  config.depths = (1, 2)
  workdir = str(tmp_path / "run")
  clean = train.run(config, workdir)
  os.remove(os.path.join(workdir, "results.json"))
  folder = lambda name: os.path.join(workdir, "checkpoints", name)
  step = lambda name, i: os.path.join(folder(name), str(i))

  def put(source: str, target: str) -> None:
    shutil.rmtree(target)
    shutil.copytree(source, target)

  shutil.copytree(step("lsa_trained_L1", 20), tmp_path / "depth1")
  put(step("lsa_residual_trained_L1", 20), step("lsa_trained_L1", 20))
  put(tmp_path / "depth1", step("lsa_trained_L2", 20))
  put(step("lsa_residual_trained_L2", 10), step("lsa_residual_trained_L2", 20))
  way_out = lambda name: (f"it was copied or renamed; delete "
                          f"'{re.escape(folder(name))}' \\(or rerun with "
                          "--overwrite")
  resumed = _follow_way_outs(lambda: train.run(config, workdir), [
      "lsa_trained_L1/20' holds lsa_residual_trained at depth 1, step 20, .*"
      "not lsa_trained at depth 1, step 20.*" + way_out("lsa_trained_L1"),
      "lsa_trained_L2/20' holds lsa_trained at depth 1, step 20.*not "
      "lsa_trained at depth 2, step 20.*" + way_out("lsa_trained_L2"),
      "lsa_residual_trained_L2/20' holds lsa_residual_trained at depth 2, "
      "step 10.*not lsa_residual_trained at depth 2, step 20.*"
      + way_out("lsa_residual_trained_L2")])
  assert resumed["train_loss"] == clean["train_loss"]
  assert resumed["tuning"] == clean["tuning"]


@pytest.mark.parametrize("field,value,pattern", [
    ("x_dist", "gaussian", r"config\.x_dist must be one of \['normal', "),
    ("shifts", {"x_laplace": {"x_dist": "laplce"}},
     r"config\.shifts\.x_laplace\.x_dist must be one of \['normal', "),
    ("shifts", {"wide": {"x_scael": 2.0}},
     r"config\.shifts\.wide\.x_scael is not a shift field; a shift sets "),
    ("shifts", {"wide": {"x_scale": -2.0}},
     r"config\.shifts\.wide\.x_scale must be a finite number > 0"),
    ("shifts", {"noisy": {"noise_labels": "yes"}},
     r"config\.shifts\.noisy\.noise_labels must be True or False"),
    ("tokens", "mixed", r"config\.tokens must be one of"),
    ("n_train", 10**7, r"config: .*n_train.* need about .* GiB"),
    ("batch", 10**8, r"config: .*batch.* need about .* GiB"),
    ("n_test", 10**8, r"config: .*n_test.* need about .* GiB"),
    ("depths", (1, 10**6), r"config: .*depths.* need about .* GiB"),
])
def test_every_field_is_checked_before_the_workdir_is_claimed(
    tmp_path, field, value, pattern):
  config = _config()
  config[field] = value
  if field == "n_test":
    config.eval_chunk = value
  with pytest.raises(checks.ConfigError, match=pattern) as err:
    train.validate(config)
  assert "\n" not in str(err.value)


def _decompile_config(seed: int = 0):
  """decompile's tiny config around :func:`_checkpoint_config`'s training."""
  config = decompile_config.get_config("tiny")
  config.train = _checkpoint_config(seed)
  config.models = ()  # every model of that training
  return config


def _load_only(monkeypatch):
  """decompile.run with the training of :func:`_train_only` and, in place of
  the fits, a sum of the loaded model's parameters (the checkpoint is the
  point here)."""
  _train_only(monkeypatch)
  monkeypatch.setattr(decompile, "_one", lambda config, model, depth, *_: {
      "depth": depth, "weights": float(sum(
          np.sum(np.asarray(leaf, np.float64))
          for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))))})
  monkeypatch.setattr(decompile, "_write_figures", lambda results, wd: None)


def test_decompile_way_outs_lead_to_a_finished_run(tmp_path, monkeypatch):
  """DC7b: a damaged checkpoint of a finished train run is refused by
  decompile with a way out (delete the model's folder and the train run's
  results.json) that, followed, retrains the model and finishes, not a
  circle of "is missing". DC4: a train_workdir of another config is refused
  before decompile's workdir is claimed (no config.json left behind), and
  the commands it names (another train_workdir; or deleting it) finish."""
  _load_only(monkeypatch)
  workdir = str(tmp_path / "run")
  config = _decompile_config()
  results = decompile.run(config, workdir)
  (first,) = results["models"]["elsa_trained"]
  assert first["weights"] != 0
  step = os.path.join(workdir, "train", "checkpoints", "elsa_trained_L1", "20")
  for parent, _, names in os.walk(step):
    for name in names:
      with open(os.path.join(parent, name), "r+b") as f:
        f.write(bytes(os.path.getsize(os.path.join(parent, name))))
  for name in ("results.json", "partial_elsa_trained_L1.json"):
    os.remove(os.path.join(workdir, name))
  resumed = _follow_way_outs(lambda: decompile.run(config, workdir), [
      "elsa_trained_L1/20' is not a readable checkpoint.*delete '.*"
      "elsa_trained_L1' and '.*train/results.json', then rerun: train trains "
      "elsa_trained at depth 1 again"])
  assert resumed["models"] == results["models"]  # the same model, retrained

  # DC4: the train workdir holds seed 1's run.
  other = str(tmp_path / "seed1")
  decompile.run(_decompile_config(1), str(tmp_path / "by_seed1"))
  os.rename(str(tmp_path / "by_seed1" / "train"), other)
  config = _decompile_config()
  config.train_workdir = other
  fresh = str(tmp_path / "fresh")
  with pytest.raises(workdirs.WorkdirInUse, match=(
      f"workdir '{other}' holds results of a different config \\(fields that "
      "differ: seed\\); pass another --config.train_workdir .* or delete "
      f"'{other}' to train there afresh; nothing was written.")):
    decompile.run(config, fresh)
  assert not os.path.exists(os.path.join(fresh, "config.json"))
  config.train_workdir = str(tmp_path / "train0")  # the first way out
  assert decompile.run(config, fresh)["models"] == results["models"]
  config.train_workdir = other
  again = str(tmp_path / "again")
  _follow_way_outs(lambda: decompile.run(config, again), [
      "holds results of a different config"])  # the second: delete it


def test_a_run_whose_every_grid_point_diverged_is_summarised(
    tmp_path, monkeypatch, caplog):
  """CK8: learning rate 1e30: every point diverges; the run finishes and its
  summary line says so (it was a logging TypeError on None)."""
  _train_only(monkeypatch)
  monkeypatch.setattr(evaluation, "evaluate_ridge",
                      lambda config, trained, etas: {
      "test_loss": {**{name: [1.0 if depth in trained[name] else np.nan
                              for depth in config.depths]
                       for name in config.models},
                    "gd_best_eta": [0.5] * len(config.depths)}})
  config = _checkpoint_config(0)
  config.learning_rates = (1e30,)
  with caplog.at_level("INFO"):
    results = train.run(config, str(tmp_path / "run"))
  assert results["diverged"] == {"elsa_trained": [True]}
  assert results["test_loss"]["elsa_trained"] == [None]
  assert "L=1: elsa_trained diverged, gd_best_eta 0.5" in [
      record.getMessage() for record in caplog.records]
