"""experiments/decompile.py end to end on the tiny config (one model, two
depths, a short training), in tmp_path: files, results, resume, skip."""

import json
import os
import subprocess
import sys

import pytest

from elsa import decompile as decompile_lib
from experiments import common
from experiments import decompile
from experiments.configs import decompile as decompile_config
import helpers


def _config():
  config = decompile_config.get_config("tiny")
  config.train.models = ("lsa_residual_trained",)
  config.train.steps = 40
  config.train.warmup_steps = 4
  config.train.log_every = 10
  config.train.checkpoint_every = 20
  config.train.n_test = 64
  config.train.eval_chunk = 64
  config.train.shifts = {}
  return config


def _spy(monkeypatch):
  """Counts identify calls; records resumed counts."""
  seen = {"identify": 0, "resumed": []}
  real = decompile_lib.identify

  def identify(*args, **kwargs):
    seen["identify"] += 1
    return real(*args, **kwargs)
  monkeypatch.setattr(decompile_lib, "identify", identify)
  helpers.record_driver_run(monkeypatch, seen["resumed"])
  return seen


def test_tiny_run_writes_results_figures_resumes_and_skips(tmp_path,
                                                           monkeypatch):
  config = _config()
  workdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    results = decompile.run(config, workdir)
  assert seen["identify"] == 2
  for name in ("config.json", "results.json", "train/results.json",
               "partial_lsa_residual_trained_L1.json",
               "figures/similarity_lsa_residual_trained.png",
               "figures/schedules.png", "figures/sensitivity.png"):
    assert os.path.exists(os.path.join(workdir, name)), name
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    found = json.load(f)
  found.pop("_check")
  assert found == results
  per_depth = results["models"]["lsa_residual_trained"]
  assert [r["depth"] for r in per_depth] == [1, 2]
  for r in per_depth:
    families = [f["family"] for f in r["fits"]]
    assert sorted(families) == sorted(config.families)
    ranked = [f["disagreement"] for f in r["fits"]]
    assert ranked == sorted(ranked)
    assert r["best"] is None or r["best"] in families
    gd = next(f for f in r["fits"] if f["family"] == "gd")
    assert gd["params"]["eta"] > 0 and len(gd["iterations"]) == r["depth"]
    for key in ("spd", "ilwd", "sensitivity_cosine", "sensitivity_l2",
                "disagreement_se", "fit_disagreement"):
      assert key in gd["metrics"], key
    heat = r["similarity_to_gd"]["map"]
    assert len(heat) == r["depth"] + 1 and len(heat[0]) == (
        config.similarity_steps + 1)
    assert len(r["weight_structure"]) == r["depth"]  # LSA: identifiable

  # Interrupted after depth 1: the rerun decompiles only depth 2.
  os.remove(os.path.join(workdir, "results.json"))
  os.remove(os.path.join(workdir, "partial_lsa_residual_trained_L2.json"))
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    resumed = decompile.run(config, workdir)
  assert seen["identify"] == 1 and 1 in seen["resumed"]
  untimed = lambda r: [{k: v for k, v in x.items() if k != "identify_seconds"}
                       for x in r["models"]["lsa_residual_trained"]]
  assert untimed(resumed) == untimed(results)  # the same tasks and fits
  results = resumed
  # Finished: a rerun computes nothing.
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    assert decompile.run(config, workdir) == results
  assert seen["identify"] == 0


def test_the_documented_command_runs_from_a_fresh_workdir(tmp_path):
  # As a user runs it: a fresh process and workdir, with none of the suite's
  # settings (conftest enables 64-bit jax globally, which hid a gather index
  # traced at 32 bits by training and again at 64 by the decompiler, in one
  # process), nor its XLA flags or compilation cache.
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_", "XLA_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
  workdir = tmp_path / "run"
  overrides = {"train.models": "('lsa_residual_trained',)",
               "train.depths": "(1,)", "train.steps": 40,
               "train.warmup_steps": 4, "train.log_every": 10,
               "train.checkpoint_every": 20, "train.n_test": 64,
               "train.eval_chunk": 64, "families": "('gd',)",
               "restarts": 1, "adam_steps": 10, "lm_steps": 2}
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.decompile",
       "--config=experiments/configs/decompile.py:tiny",
       f"--workdir={workdir}",
       *(f"--config.{k}={v}" for k, v in overrides.items())],
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(workdir / "results.json", encoding="utf-8") as f:
    results = json.load(f)
  [one] = results["models"]["lsa_residual_trained"]
  assert one["depth"] == 1 and one["fits"][0]["family"] == "gd"


@pytest.mark.parametrize("field, value, message", [
    ("families", ("gd", "sgd"), r"families\[1\] must be one of"),
    ("tol", 0.0, "tol"),
    ("iterations", (), "non-empty"),
    ("n_fit", 1, "n_fit"),
    ("restarts", 0, "restarts"),
])
def test_bad_configs_are_refused_before_the_workdir(tmp_path, field, value,
                                                    message):
  config = _config()
  config[field] = value
  workdir = str(tmp_path / "run")
  with pytest.raises(common.ConfigError, match=message):
    decompile.run(config, workdir)
  assert not os.path.exists(workdir)


def test_variants():
  assert decompile_config.get_config("vonoswald").train.tokens == (
      "concatenated")
  assert decompile_config.get_config().train.models[-1] == "elsa_masked"
  with pytest.raises(ValueError, match="unknown argument 'huge'"):
    decompile_config.get_config("huge")
