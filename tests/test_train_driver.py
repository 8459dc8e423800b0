"""End-to-end test of experiments/train.py on a tiny config: results, resume, overwrite."""

import os
import shutil

import numpy as np
import pytest

from experiments import common
from experiments import train
from experiments.configs import train_tiny


def _config():
  """Two checkpoints (steps 10, 20) of one depth; seconds end to end."""
  config = train_tiny.get_config()
  config.depths = (1,)
  config.steps = 20
  config.warmup_steps = 5
  config.learning_rate = 1e-2
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
  assert common.read_json(os.path.join(workdir, "results.json")) == results
  losses = results["test_loss"]
  for name in ("elsa_trained", "lsa_trained", "gd_best_eta", "ridge",
               "elsa_constructed_gd", "least_squares", "zero"):
    assert len(losses[name]) == 1 and len(results["test_loss_se"][name]) == 1
    assert np.isfinite(losses[name][0]) and losses[name][0] > 0
  # 20 steps of training already beat predicting zero.
  assert losses["elsa_trained"][0] < 0.9 * losses["zero"][0]
  # Training lowered the loss: the last logged mean is below the first.
  for curves in results["train_loss"].values():
    assert len(curves[0]) == config.steps // config.log_every
    assert curves[0][-1] < curves[0][0]
  assert results["diverged"] == {"elsa_trained": [False], "lsa_trained": [False]}
  # The constructed stack is GD (float32).
  assert losses["elsa_constructed_gd"][0] == pytest.approx(
      losses["gd_best_eta"][0], rel=1e-4)
  assert len(results["gd_eta_grid"]["etas"]) == config.eta_grid
  assert results["gd_best_eta"][0] in results["gd_eta_grid"]["etas"]
  assert set(results["shifted"]) == {"x_scale_x2"}
  for name in ("train_loss.png", "test_loss_vs_depth.png", "trained_vs_gd.png",
               "shifted_test_loss.png"):
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
  monkeypatch.setattr(common.Progress, "resumed",
                      lambda self, count: resumed_at.append(count))
  os.remove(os.path.join(workdir, "results.json"))
  shutil.rmtree(os.path.join(workdir, "checkpoints", "elsa_trained_L1", "20"))
  resumed = train.run(config, workdir)
  assert resumed_at == [10, 20]  # elsa from step 10; lsa was finished
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
  monkeypatch.setattr(common.Progress, "resumed",
                      lambda self, count: resumed_at.append(count))
  new = train.run(config, workdir, overwrite=True)
  assert resumed_at == []  # every model trained from step 0
  # Only the new run's last checkpoint: the old ones (10, 20) were deleted.
  assert _checkpoints(workdir) == ["20"]
  assert _checkpoints(workdir, "lsa_trained_L1") == ["20"]
  assert common.read_json(os.path.join(workdir, "config.json")) == (
      common.config_dict(config))
  assert new["train_loss"] != results["train_loss"]
