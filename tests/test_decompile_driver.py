"""experiments/decompile.py end to end on the tiny config (one model, two
depths, a short training), in tmp_path: files, results, resume, skip."""

import ast
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from elsa import decompile as decompile_lib
from experiments import checks
from experiments import decompile
from experiments import decompile_trained
from experiments.configs import decompile as decompile_config
import helpers
from tests import multiprocess


# The tiny config, shorter: one model, a short training.
_SHORTER = {"models": ("lsa_residual_trained",),
            "train.models": ("lsa_residual_trained",), "train.steps": 40,
            "train.warmup_steps": 4, "train.log_every": 10,
            "train.checkpoint_every": 20, "train.n_test": 64,
            "train.eval_chunk": 64}


def _config():
  config = decompile_config.get_config("tiny")
  for field, value in _SHORTER.items():
    *group, name = field.split(".")
    (config[group[0]] if group else config)[name] = value
  return config


def _as_a_user(env: dict) -> dict:
  """``env`` with none of the suite's settings that change what runs:
  conftest enables 64-bit jax globally, which once hid a gather index traced
  at 32 bits by training and again at 64 by the decompiler in one process;
  nor its compilation cache or forced device count. Only XLA's backend level
  0 is kept (it halves compile times, and lowering, where that bug failed,
  happens before it)."""
  env = {k: v for k, v in env.items() if not k.startswith(("JAX_", "XLA_"))}
  env.update(JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_backend_optimization_level=0")
  return env


_COMMAND = ["--config=experiments/configs/decompile.py:tiny",
            *(f"--config.{k}={v!r}" for k, v in _SHORTER.items())]


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
  """The documented command, in a fresh process as a user runs it: its
  workdir and results (read before any test changes them)."""
  workdir = str(tmp_path_factory.mktemp("decompile") / "run")
  env = _as_a_user(os.environ)
  env.update(PYTHONPATH=os.getcwd())
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.decompile", *_COMMAND,
       f"--workdir={workdir}"],
      env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  results.pop("_check")
  with open(_log_path(workdir), "w", encoding="utf-8") as f:
    f.write(proc.stderr)
  return workdir, results


def _log_path(workdir: str) -> str:
  return os.path.join(os.path.dirname(workdir), "stderr.txt")


def test_tiny_run_says_it_trains_and_logs_a_page(user_run):
  with open(_log_path(user_run[0]), encoding="utf-8") as f:
    log = f.read()
  assert "no finished train run of config.train" in log, log[-2000:]
  assert len(log.splitlines()) <= 60, log[-3000:]
  assert "xla_bridge" not in log and "Unable to initialize backend" not in log
  summary = [line for line in log.splitlines() if "L=1: " in line][-1]
  # Rounded for a reader (the JSON keeps every digit).
  assert all(len(n.replace(".", "").lstrip("0")) <= 3
             for n in re.findall(r"\d+\.\d+", summary.split("L=1: ")[1])), summary


def test_a_finished_train_run_is_reused_not_retrained(user_run):
  workdir, results = user_run
  config = _config()
  # Its own <workdir>/train, and the train run beside a decompile workdir.
  for decompile_dir in (workdir, os.path.join(workdir, "decompile")):
    found, train_results = decompile._train_run(config, decompile_dir)
    assert found == os.path.join(workdir, "train")
    assert train_results is not None
  # Another train config there is not this run's: trained afresh elsewhere.
  config.train.steps += 1
  found, train_results = decompile._train_run(
      config, os.path.join(workdir, "decompile"))
  assert train_results is None
  assert found == os.path.join(workdir, "decompile", "train")


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


def test_tiny_run_writes_results_figures_resumes_and_skips(user_run,
                                                           monkeypatch):
  config = _config()
  workdir, results = user_run
  for name in ("config.json", "results.json", "train/results.json",
               "partial_lsa_residual_trained_L1.json",
               "partial_lsa_residual_trained_L2.json",
               "figures/similarity_lsa_residual_trained.png",
               "figures/filters_lsa_residual_trained.png",
               "figures/ladder.png", "figures/schedules.png",
               "figures/sensitivity.png"):
    assert os.path.exists(os.path.join(workdir, name)), name
  per_depth = results["models"]["lsa_residual_trained"]
  assert [r["depth"] for r in per_depth] == [1, 2]
  for r in per_depth:
    families = [f["family"] for f in r["fits"]]
    assert sorted(families) == sorted(config.families)
    assert r["best"] is None or r["best"] in families
    assert r["closest"]["family"] == families[0]
    gd = next(f for f in r["fits"] if f["family"] == "gd")
    assert gd["params"]["eta"] > 0 and len(gd["iterations"]) == r["depth"]
    for key in ("spd", "ilwd", "sensitivity_cosine", "sensitivity_l2",
                "disagreement_se", "fit_disagreement"):
      assert key in gd["metrics"], key
    heat = r["similarity_to_gd"]["map"]
    assert len(heat) == r["depth"] + 1 and len(heat[0]) == (
        config.similarity_steps + 1)
    assert len(r["weight_structure"]) == r["depth"]  # LSA: identifiable
    spectral = r["spectral"]
    assert len(spectral["coefficients"]) == r["depth"]
    assert tuple(spectral["ladder"]) == decompile_lib.RUNGS
    assert len(spectral["roots"]) == r["depth"]

  # Interrupted after depth 1: the rerun (here, in the suite's process)
  # decompiles only depth 2, and reads depth 1 as it was written.
  os.remove(os.path.join(workdir, "results.json"))
  os.remove(os.path.join(workdir, "partial_lsa_residual_trained_L2.json"))
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    resumed = decompile.run(config, workdir)
  assert seen["identify"] == 1 and 1 in seen["resumed"]
  again = resumed["models"]["lsa_residual_trained"]
  assert again[0] == per_depth[0]
  assert [f["family"] for f in again[1]["fits"]] != [] and sorted(
      f["family"] for f in again[1]["fits"]) == sorted(config.families)
  results = resumed
  # Finished: a rerun computes nothing.
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    assert decompile.run(config, workdir) == results
  assert seen["identify"] == 0


@pytest.mark.parametrize("field, value, message", [
    ("families", ("gd", "sgd"), r"families\[1\] must be one of"),
    ("tol", 0.0, "tol"),
    ("iterations", (), "non-empty"),
    ("n_fit", 1, "n_fit"),
    ("restarts", 0, "restarts"),
    ("spectral_degree", -1, "spectral_degree"),
    ("spectral_extras", ("noise",), r"spectral_extras\[0\] must be one of"),
])
def test_bad_configs_are_refused_before_the_workdir(tmp_path, field, value,
                                                    message):
  config = _config()
  config[field] = value
  workdir = str(tmp_path / "run")
  with pytest.raises(checks.ConfigError, match=message):
    decompile.run(config, workdir)
  assert not os.path.exists(workdir)


def test_variants():
  assert decompile_config.get_config("vonoswald").train.tokens == (
      "concatenated")
  assert decompile_config.get_config().train.models[-1] == "elsa_masked"
  with pytest.raises(ValueError, match="unknown argument 'huge'"):
    decompile_config.get_config("huge")


def test_decompile_trained_reads_the_runs_stacks_as_the_driver(user_run,
                                                                capsys):
  """experiments/decompile_trained.py on the user run's train workdir (its
  models and depths from the run's config.json): the same ladder as the
  driver's spectral description of each stack (same tasks, same fit)."""
  workdir, results = user_run
  decompile_trained.main(os.path.join(workdir, "train"), "tiny")
  printed = re.findall(r"## (\w+) L=(\d) +ladder (\{.*?\})",
                       capsys.readouterr().out)
  assert [(name, int(depth)) for name, depth, _ in printed] == [
      ("lsa_residual_trained", 1), ("lsa_residual_trained", 2)]
  for (_, _, ladder), want in zip(
      printed, results["models"]["lsa_residual_trained"]):
    ladder = ast.literal_eval(ladder)
    assert tuple(ladder) == decompile_lib.RUNGS
    for rung, found in ladder.items():
      np.testing.assert_allclose(
          float(found), want["spectral"]["ladder"][rung]["disagreement"],
          rtol=1e-2)
  with pytest.raises(SystemExit, match="holds no config.json of a train run"):
    decompile_trained.main(workdir + "/train/checkpoints", "tiny")


def _without_seconds(tree):
  if isinstance(tree, dict):
    return {k: _without_seconds(v) for k, v in tree.items()
            if "seconds" not in k}
  if isinstance(tree, list):
    return [_without_seconds(v) for v in tree]
  return tree


def test_two_processes_split_the_stacks_and_equal_one(user_run, tmp_path,
                                                      monkeypatch):
  """--distributed on 2 processes of one device each, as a user runs it, on
  the user run's trained models: process 0 decompiles depth 1, process 1
  depth 2 (each its share, not both), and process 0 writes results equal to
  the one-process run's (timings aside)."""
  workdir, want = user_run
  multi = str(tmp_path / "multi")
  environment = multiprocess.environment
  monkeypatch.setattr(multiprocess, "environment", lambda devices: _as_a_user(
      environment(devices)))
  finished = multiprocess.launch(
      "decompile", [*_COMMAND, f"--workdir={multi}",
                    f"--config.train_workdir={workdir}/train"],
      devices=1, timeout=300)
  assert all(f.returncode == 0 for f in finished), multiprocess.report(
      finished)
  for pid, (mine, other) in enumerate(((1, 2), (2, 1))):
    log = finished[pid].stderr
    assert f"process {pid} decompiles lsa_residual_trained L={mine}" in log
    assert f"decompiles lsa_residual_trained L={other}" not in log
  with open(os.path.join(multi, "results.json"), encoding="utf-8") as f:
    got = json.load(f)
  got.pop("_check")
  assert _without_seconds(got) == _without_seconds(want)
  assert sorted(os.listdir(multi)) == sorted(
      n for n in os.listdir(workdir) if n != "train")
