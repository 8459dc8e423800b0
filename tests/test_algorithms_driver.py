"""experiments/algorithms.py end to end on the tiny config, in tmp_path; its runner against elsa_stack."""

import json
import os

import jax
import jax.numpy as jnp
from matplotlib.figure import Figure
import matplotlib.pyplot as plt
import numpy as np
import pytest

import elsa
from elsa import algorithms as algorithms_lib
from elsa import programs
from experiments import algorithms as driver
from experiments import checks
from experiments import metrics
import helpers
from experiments.configs import algorithms as algorithms_config

SAVED = ("layers_to_tol", "layers_to_tol_float32", "interpreter_layers_to_tol",
         "interpreter_layers_to_tol_float32", "floor", "floor_float32")


def _read(workdir, name):
  """A JSON output as the driver returns it: without its ``_check``."""
  with open(os.path.join(workdir, name), encoding="utf-8") as f:
    found = json.load(f)
  found.pop("_check", None)
  return found


def _spy(monkeypatch):
  """Records the kappas computed, traces of the jitted runners, the matmul
  precision and resumed counts."""
  seen = dict(kappas=[], traces=0, precision=[], resumed=[])
  real_result, real_runners = driver._kappa_result, driver.make_runners

  def kappa_result(config, kappa, rng, runners):
    seen["kappas"].append(kappa)
    seen["precision"].append(jax.config.jax_default_matmul_precision)
    return real_result(config, kappa, rng, runners)

  def make_runners(config, on_trace=None):
    return real_runners(config, on_trace=lambda: seen.__setitem__(
        "traces", seen["traces"] + 1))

  monkeypatch.setattr(driver, "_kappa_result", kappa_result)
  monkeypatch.setattr(driver, "make_runners", make_runners)
  helpers.record_driver_run(monkeypatch, seen["resumed"])
  return seen


def _check_schema_and_counts(results, config):
  keys = [driver.kappa_key(k) for k in config.kappas]
  assert results["config"] == checks.config_dict(config)
  for field in SAVED:
    assert set(results[field]) == set(config.algorithms)
    for name in config.algorithms:
      assert list(results[field][name]) == keys
  for name in config.algorithms:
    size = results["sizes"][name]
    assert {"m", "n", "C", "setup_layers"} <= set(size)
    assert all(isinstance(size[f], int) and size[f] > 0
               for f in ("m", "n", "C"))
    for dtype in driver.DTYPES:
      assert results["seconds_per_layer"][name][dtype] > 0
    for k in keys:
      for tail in ("", "_float32"):
        count = results["layers_to_tol" + tail][name][k]
        interp = results["interpreter_layers_to_tol" + tail][name][k]
        assert count is None or (isinstance(count, int)
                                 and count > size["setup_layers"])
        # The stack and the interpreter agree within one layer.
        if count is not None and interp is not None:
          assert abs(count - interp) <= 1, (name, k, tail, count, interp)
  counts = results["layers_to_tol"]
  # Chebyshev needs ~sqrt(kappa) log(1/tol) layers: past the tiny budget at
  # kappa 100 (null), Newton-Schulz log-many.
  assert counts["chebyshev"]["100"] is None
  assert counts["chebyshev"]["10"] > counts["newton_schulz"]["10"]
  assert counts["newton_schulz"]["100"] > counts["newton_schulz"]["10"]
  assert results["layers_to_tol_float32"]["chebyshev"]["100"] is not None
  assert results["floor"]["newton_schulz"]["100"] < 1e-12
  assert "| chebyshev | 1 | " in driver.markdown_table(results)


def test_driver_writes_results_figure_and_resumes(tmp_path, monkeypatch):
  """Files, schema, one compile per runner, per-kappa resume, skip, refuse, overwrite."""
  config = algorithms_config.get_config("tiny")
  workdir = str(tmp_path / "run")
  figures = len(plt.get_fignums())
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    results = driver.run(config, workdir)
  assert seen["kappas"] == list(config.kappas) and seen["resumed"] == [0]
  assert set(seen["precision"]) == {"highest"}
  # One trace per algorithm, dtype and runner (stack, interpreter): the
  # second kappa reuses every compile.
  assert seen["traces"] == len(config.algorithms) * len(driver.DTYPES) * 2
  assert len(plt.get_fignums()) == figures  # no pyplot figure left behind
  for name in ("config.json", "results.json", "figures/algorithm_layers.png",
               "partial_kappa0.json", "partial_kappa1.json"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert _read(workdir, "results.json") == results
  _check_schema_and_counts(results, config)

  # Killed after the first kappa: the rerun computes only the second, with
  # the same tasks (each kappa has its own generator), so the same counts.
  os.remove(os.path.join(workdir, "results.json"))
  os.remove(os.path.join(workdir, "partial_kappa1.json"))
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    resumed = driver.run(config, workdir)
  assert seen["kappas"] == list(config.kappas[1:]) and seen["resumed"] == [1]
  assert resumed["per_kappa"][0] == results["per_kappa"][0]
  for field in SAVED:
    assert resumed[field] == results[field]

  # A rerun with the same config skips; a different config is refused.
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    assert driver.run(config, workdir) == resumed
  assert not seen["kappas"] and not seen["traces"]
  config.algorithms = config.algorithms[1:]
  with pytest.raises(ValueError, match="different config"):
    driver.run(config, workdir)
  fresh = driver.run(config, workdir, overwrite=True)
  assert list(fresh["layers_to_tol"]) == list(config.algorithms)
  # The old partial files were deleted, not resumed from.
  assert set(_read(workdir, "partial_kappa1.json")["algorithms"]) == set(
      config.algorithms)


@pytest.mark.parametrize("name,build", [
    ("heavy_ball", None), ("chebyshev", None),
    # Its first iteration is a layer of its own (it also moves the queries).
    ("gd", algorithms_lib.ridge_gd_natural)])
def test_runner_is_the_compiled_stack_layer_by_layer(name, build):
  """``stack_errors`` (the loop layers in a while_loop) equals ``elsa_stack``
  of ``Compiled.params(loops=L)``, and stops at the first layer below tol."""
  N, d, Q, loops = 8, 3, 2, 30
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(2, N, d)), rng.normal(size=(2, N, 1))
  xq = rng.normal(size=(2, Q, d))
  with jax.enable_x64(True):
    lam = 0.1
    w_star = np.linalg.solve(
        np.swapaxes(x, 1, 2) @ x / N + lam * np.eye(d),
        np.swapaxes(x, 1, 2) @ y / N)
    mu, L = (np.asarray(v) for v in algorithms_lib.eigen_bounds(
        jnp.asarray(x), lam=lam))
    scalars, schedules = driver.step_scalars(name, mu, mu + (L - mu) * 1.5,
                                             lam=lam, loops=loops)
    prog = (build or algorithms_lib.ALGORITHMS[name])(n_train=N, d=d,
                                                      n_query=Q)
    compiled = programs.compile(prog)
    budget = compiled.setup_layers + loops
    run = driver.stack_errors(compiled, budget=budget, dtype=jnp.float64)
    args = (x, y, xq, w_star, scalars, schedules)
    never = np.asarray(run(*args, jnp.float64(0.0)))  # tol 0: runs to budget
    for i in range(2):
      task_scalars = {k: v[i] for k, v in scalars.items()}
      task_scalars |= {k: v[i] for k, v in schedules.items()}
      hs = jax.jit(lambda x, y, xq, s: elsa.elsa_stack(
          compiled.params(loops=loops, **s), compiled.encode(X=x, y=y, Xq=xq),
          return_all=True))(x[i], y[i], xq[i], task_scalars)
      w = np.asarray(compiled.read(hs, "w"))[:budget + 1].reshape(budget + 1,
                                                                  -1)
      want = metrics.relative_error(w, w_star[i].reshape(1, -1))
      np.testing.assert_allclose(never[i], want, rtol=1e-9, atol=1e-15)
    tol = float(np.median(never[:, -1])) * 10
    stopped = np.asarray(run(*args, jnp.float64(tol)))
    first = driver.first_below(never, tol)
    # The while_loop runs until every task is below tol; a finished task's
    # errors stop where it finished.
    last = max(first)
    assert np.all(np.isnan(stopped[:, last + 1:]))
    for i in range(2):
      np.testing.assert_array_equal(stopped[i, :first[i] + 1],
                                    never[i, :first[i] + 1])
    assert driver.first_below(stopped, tol) == first


def test_config_rejects_unknown_variant():
  with pytest.raises(ValueError,
                     match="unknown argument 'huge'; known: 'tiny'"):
    algorithms_config.get_config("huge")


@pytest.mark.parametrize("field, value, allowed", [
    ("algorithms", ("adam",), r"\[0\] must be one of"),
    ("algorithms", (), "a non-empty tuple"),
    ("kappas", (10.0, 0.5), r"\[1\] must be a finite number >= 1"),
    ("layer_budget", 2, r"an int in \[3, 1073741824\]"),
    ("layer_budget_float32", 1, r"an int in \[3, "),
    ("depth", 0, r"an int in \[1, "),
    ("interpreter_loops", 0, r"an int in \[1, "),
    ("tol", float("nan"), r"a finite number in \(0, 1\)"),
    ("tol_float32", 1.0, r"a finite number in \(0, 1\)"),
    ("lam", 0.5, r"in \[0, 0.01\)"),
    ("n_train", 2, "an int >= 3"),
])
def test_bad_config_is_refused_before_the_workdir_is_touched(
    tmp_path, field, value, allowed):
  config = algorithms_config.get_config("tiny")
  config[field] = value
  with pytest.raises(checks.ConfigError, match=f"config\\.{field}.*{allowed}"):
    driver.run(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


def test_x64_is_restored_after_the_run(tmp_path, monkeypatch):
  """The driver turns float64 on for itself only."""
  seen = []
  monkeypatch.setattr(driver, "_per_kappa", lambda config, wd, runners:
                      seen.append(jax.config.jax_enable_x64) or [])
  monkeypatch.setattr(driver, "make_runners", lambda config: {
      name: {"size": {}} for name in config.algorithms})
  monkeypatch.setattr(driver, "summary", lambda *args: {})
  monkeypatch.setattr(driver.plotting, "algorithm_layers",
                      lambda *args: Figure())
  monkeypatch.setattr(driver, "markdown_table", lambda results: "")
  with jax.enable_x64(False):
    driver.run(algorithms_config.get_config("tiny"), str(tmp_path))
    assert not jax.config.jax_enable_x64
  assert seen == [True]


@pytest.mark.parametrize("field, value, allowed", [
    ("depth", 10**10, r"config\.depth must be an int in \[1, 1073741824\]"),
    ("layer_budget", 2**40, r"config\.layer_budget must be an int in "),
    ("interpreter_loops", 2**31, r"config\.interpreter_loops must be an int "),
    ("seed", 10**23, r"config\.seed must be an int in \[0, "
     r"9223372036854775807\]"),
    ("depth", 10**9, r"config: .*depth.* need about .* GiB"),
    ("tasks_per_kappa", 10**9, r"config: .*tasks_per_kappa.* need about"),
])
def test_sizes_and_indices_are_bounded_before_the_workdir_is_touched(
    field, value, allowed):
  config = algorithms_config.get_config("tiny")
  config[field] = value
  with pytest.raises(checks.ConfigError, match=allowed) as err:
    driver.validate(config)
  assert "\n" not in str(err.value)
