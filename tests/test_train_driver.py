"""End-to-end test of experiments/train.py on a tiny config, including resume."""

import os
import shutil

import pytest

from experiments import train
from experiments.configs import train_tiny


def _config():
  config = train_tiny.get_config()
  config.depths = (1,)
  config.steps = 100
  config.checkpoint_every = 50
  config.keep_checkpoints = 3
  config.n_test = 128
  config.eta_grid = 10
  del config.shifts["x_laplace"]
  return config


def test_driver_end_to_end_and_resume(tmp_path):
  workdir = str(tmp_path / "run")
  config = _config()
  results = train.run(config, workdir)
  losses = results["test_loss"]
  for name in ("elsa_trained", "lsa_trained", "gd_best_eta", "ridge",
               "elsa_constructed_gd", "least_squares", "zero"):
    assert len(losses[name]) == 1 and len(results["test_loss_se"][name]) == 1
  assert losses["elsa_trained"][0] < 0.7 * losses["zero"][0]
  # The constructed stack is GD (float32).
  assert losses["elsa_constructed_gd"][0] == pytest.approx(
      losses["gd_best_eta"][0], rel=1e-4)
  assert set(results["shifted"]) == {"x_scale_x2"}
  for name in ("train_loss.png", "test_loss_vs_depth.png", "trained_vs_gd.png",
               "shifted_test_loss.png"):
    assert os.path.exists(os.path.join(workdir, "figures", name))
  # A finished run is skipped.
  assert train.run(config, workdir) == results
  # Interrupt: drop the results and the last checkpoint of one model; the
  # rerun resumes at step 50 and, seeing the same batches, ends identically.
  os.remove(os.path.join(workdir, "results.json"))
  folder = os.path.join(workdir, "checkpoints", "elsa_trained_L1")
  assert sorted(os.listdir(folder)) == ["100", "50"]
  shutil.rmtree(os.path.join(folder, "100"))
  resumed = train.run(config, workdir)
  assert resumed["test_loss"] == losses
  assert resumed["train_loss"] == results["train_loss"]
  # A different config is refused.
  config.lam = 0.5
  with pytest.raises(ValueError, match="different config"):
    train.run(config, workdir)
