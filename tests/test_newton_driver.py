"""experiments/newton.py end to end on the tiny config, in tmp_path."""

import json
import os

import pytest

from experiments import newton
from experiments.configs import newton as newton_config


def test_driver_writes_results_figure_and_resumes(tmp_path):
  config = newton_config.get_config("tiny")
  workdir = str(tmp_path / "run")
  results = newton.run(config, workdir)
  for name in ("config.json", "results.json", "figures/newton_layers.png"):
    assert os.path.exists(os.path.join(workdir, name)), name
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    assert json.load(f) == results
  rows = newton.summary_rows(results)
  assert [r["kappa"] for r in rows] == config.kappas
  for r, raw in zip(rows, results["per_kappa"]):
    # The ELSA stack (float64) needs exactly the layers the theory predicts,
    # and log-many where GD needs kappa-many.
    assert raw["newton_float64_safe"] == raw["newton_theory_safe"]
    assert r["newton_f64_safe"] < r["elsa_gd_best"] < r["gd_plain"]
    assert r["floor_f64"] < 1e-12
  assert results["per_kappa"][0]["gd_check"] is True
  assert "| kappa |" in newton.markdown_table(results)
  # A rerun with the same config skips; a different config is refused.
  assert newton.run(config, workdir) == results
  config.tol = 1e-4
  with pytest.raises(ValueError, match="different config"):
    newton.run(config, workdir)
  assert newton.run(config, workdir, overwrite=True)["config"]["tol"] == 1e-4


def test_tiny_config_rejects_unknown_variant():
  with pytest.raises(ValueError, match="unknown variant"):
    newton_config.get_config("huge")
