"""experiments/newton.py end to end on the tiny config, in tmp_path."""

import json
import os

import jax
from matplotlib.figure import Figure
import matplotlib.pyplot as plt
import pytest

from experiments import checks
from experiments import workdirs
import helpers
from experiments import newton
from experiments.configs import newton as newton_config


def _read(workdir, name):
  """A JSON output as the driver returns it: without its ``_check``."""
  with open(os.path.join(workdir, name), encoding="utf-8") as f:
    found = json.load(f)
  found.pop("_check", None)
  return found


def _spy(monkeypatch, *, nan_at=None):
  """Records the kappas computed, the matmul precision and resumed counts.

  ``nan_at``: the kappa whose first float32 floor is made NaN (as a
  diverged run would give).
  """
  seen = dict(kappas=[], precision=[], resumed=[])
  real_result, real_decoder = newton._kappa_result, newton.newton_decoder

  def kappa_result(config, kappa, rng, decoder):
    seen["kappas"].append(kappa)
    out = real_result(config, kappa, rng, decoder)
    if kappa == nan_at:
      out["newton_float32_safe_floor"][0] = float("nan")
    return out

  def decoder(*args, **kwargs):
    decode = real_decoder(*args, **kwargs)

    def recorded(*arrays):
      seen["precision"].append(jax.config.jax_default_matmul_precision)
      return decode(*arrays)
    return recorded

  monkeypatch.setattr(newton, "_kappa_result", kappa_result)
  monkeypatch.setattr(newton, "newton_decoder", decoder)
  helpers.record_driver_run(monkeypatch, seen["resumed"])
  return seen


def _check_counts(results, config):
  rows = newton.summary_rows(results)
  assert [r["kappa"] for r in rows] == list(config.kappas)
  for r, raw in zip(rows, results["per_kappa"]):
    # The ELSA stack (float64) needs exactly the layers the theory predicts,
    # and log-many where GD needs kappa-many.
    assert raw["newton_float64_safe"] == raw["newton_theory_safe"]
    assert r["newton_f64_safe"] < r["elsa_gd_best"] < r["gd_plain"]
    assert r["floor_f64"] < 1e-12
  assert results["per_kappa"][0]["gd_check"] is True
  assert "| kappa |" in newton.markdown_table(results)


def test_driver_writes_results_figure_and_resumes(tmp_path, monkeypatch):
  """Files, counts, NaN as null, per-kappa resume, skip, refuse, overwrite."""
  config = newton_config.get_config("tiny")
  workdir = str(tmp_path / "run")
  figures = len(plt.get_fignums())
  with monkeypatch.context() as patch:
    seen = _spy(patch, nan_at=config.kappas[0])
    results = newton.run(config, workdir)
  assert seen["kappas"] == list(config.kappas) and seen["resumed"] == [0]
  assert seen["precision"] and set(seen["precision"]) == {"highest"}
  assert len(plt.get_fignums()) == figures  # no pyplot figure left behind
  for name in ("config.json", "results.json", "figures/newton_layers.png",
               "partial_kappa0.json", "partial_kappa1.json"):
    assert os.path.exists(os.path.join(workdir, name)), name
  # The NaN is None in what run returns, as in the JSON, and the worst
  # floor is over the finite ones.
  assert _read(workdir, "results.json") == results
  floors = results["per_kappa"][0]["newton_float32_safe_floor"]
  assert floors[0] is None and None not in floors[1:]
  assert newton.summary_rows(results)[0]["floor_f32"] == max(floors[1:])
  _check_counts(results, config)

  # Killed after the first kappa: the rerun computes only the second, with
  # the same tasks (each kappa has its own generator).
  os.remove(os.path.join(workdir, "results.json"))
  os.remove(os.path.join(workdir, "partial_kappa1.json"))
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    assert newton.run(config, workdir) == results
  assert seen["kappas"] == list(config.kappas[1:]) and seen["resumed"] == [1]

  # A rerun with the same config skips; a different config is refused.
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    assert newton.run(config, workdir) == results
  assert not seen["kappas"]
  # Altered numbers in a saved kappa are refused by name on resume.
  os.remove(os.path.join(workdir, "results.json"))
  path = os.path.join(workdir, "partial_kappa0.json")
  altered = workdirs.read_json(path)  # with its _check
  altered["gd_plain"][0] += 1
  workdirs.write_json(path, altered)
  with pytest.raises(workdirs.CorruptOutput,
                     match="partial_kappa0.json' fails its checksum.*"
                     "--overwrite"):
    newton.run(config, workdir)
  config.tol = 1e-4
  with pytest.raises(ValueError, match="different config"):
    newton.run(config, workdir)
  # --overwrite clears it: every kappa computed again.
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    again = newton.run(config, workdir, overwrite=True)
  assert again["config"]["tol"] == 1e-4
  assert seen["kappas"] == list(config.kappas)


def test_tiny_config_rejects_unknown_variant():
  with pytest.raises(ValueError, match="unknown argument 'huge'; known: 'tiny'"):
    newton_config.get_config("huge")


@pytest.mark.parametrize("field, value, allowed", [
    ("kappas", (), "a non-empty tuple"),
    ("kappas", (10.0, 0.5), r"\[1\] must be a finite number >= 1"),
    ("depth", 0, "an int >= 1"),
    ("tol", float("nan"), r"a finite number in \(0, 1\)"),
    ("noise", float("nan"), "a finite number >= 0"),
    ("lam", -1e-3, r"in \[0, 0.001\)"),
    ("n_train", 2, r"an int >= config\.d \(3\)"),
    ("kappas", (10.0, 1e3, 10.0), r"\[2\] repeats config\.kappas\[0\]"),
    ("seed", -1, r"an int in \[0, 9223372036854775807\]"),
    ("tasks_per_kappa", 0, "an int >= 1"),
    ("d", 40, r"\(40\), got 6"),  # config.n_train must be >= config.d
])
def test_bad_config_is_refused_before_the_workdir_is_touched(
    tmp_path, field, value, allowed):
  config = newton_config.get_config("tiny")
  config[field] = value
  with pytest.raises(checks.ConfigError, match=f"config\\.{field}.*{allowed}"):
    newton.run(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


def test_x64_is_restored_after_the_run(tmp_path, monkeypatch):
  """The driver turns float64 on for itself only."""
  seen = []
  monkeypatch.setattr(newton, "_per_kappa", lambda config, wd: seen.append(
      jax.config.jax_enable_x64) or [])
  monkeypatch.setattr(newton.plotting, "newton_layers",
                      lambda *args: Figure())
  with jax.enable_x64(False):
    newton.run(newton_config.get_config("tiny"), str(tmp_path))
    assert not jax.config.jax_enable_x64
  assert seen == [True]
