"""End-to-end tests of experiments/sweep.py on the tiny config.

Bounds (measured on this machine, tiny config, see docs/guides/sweep.md):
float32 max_rel_err 1.5e-7 -> bound 2e-6; float64 ~1e-16 -> bound 1e-10.
"""

import functools
import importlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elsa import forms
from elsa import ridge
from experiments import checks
from experiments import cli
from experiments import sweep
from experiments import workdirs
from experiments.configs import sweep as sweep_config
from tests import multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32_BOUND = 2e-6
F64_BOUND = 1e-10
FIGURES = ("convergence_designed.png", "convergence_natural.png",
           "error_vs_depth_designed.png", "error_vs_depth_natural.png",
           "final_error_heatmap.png")


def _tiny(**overrides):
  config = sweep_config.get_config("tiny")
  config.update(overrides)
  return config


def _read(workdir, name):
  """A JSON output as the driver returns it: without its ``_check``."""
  with open(os.path.join(workdir, name), encoding="utf-8") as f:
    found = json.load(f)
  found.pop("_check", None)
  return found


def _check_files_and_records(workdir, results, config):
  assert _read(workdir, "results.json") == json.loads(json.dumps(results))
  assert _read(workdir, "config.json")["depth"] == config.depth
  assert sorted(os.listdir(os.path.join(workdir, "figures"))) == sorted(FIGURES)
  for name in FIGURES:
    with open(os.path.join(workdir, "figures", name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  records = results["records"]
  assert len(records) == (len(config.forms) * len(config.lams)
                          * len(config.etas) * config.depth)
  keys = {(r["form"], r["lam"], r["eta"], r["depth"]) for r in records}
  assert len(keys) == len(records)
  assert {r["depth"] for r in records} == set(range(1, config.depth + 1))


def _check_float32_accuracy_and_divergence(results, config):
  records = results["records"]
  # The tiny grid has eta fractions 0.5 (stable) and 1.1 (past the limit).
  for r in records:
    assert r["diverged"] == (r["eta"] > 1), r
  stable = [r for r in records if not r["diverged"]]
  worst = max(r["max_rel_err"] for r in stable)
  # Diverged cells stay out of max_rel_err even where their error is larger.
  assert results["max_rel_err"] == worst
  assert 0 < worst < F32_BOUND
  assert all(r["median_rel_err"] <= r["max_rel_err"] for r in stable)
  # Stable GD approaches the ridge solution, and the ELSA stack with it.
  for form in config.forms:
    first = [r for r in stable if r["form"] == form and r["depth"] == 1]
    last = [r for r in stable if r["form"] == form
            and r["depth"] == config.depth]
    for r1, rl in zip(first, last):
      assert rl["gd_to_ridge"] < r1["gd_to_ridge"]
      np.testing.assert_allclose(rl["elsa_to_ridge"], rl["gd_to_ridge"],
                                 rtol=1e-3, atol=1e-6)
  assert results["n_diverged_cells"] == 4
  assert results["dtype"] == "float32"


def _check_rerun_skips_and_other_config_is_refused(workdir, results,
                                                   monkeypatch):
  with monkeypatch.context() as patch:
    def fail(*args, **kwargs):
      raise AssertionError("a finished sweep must not run again")
    patch.setattr(sweep, "_run_form", fail)
    assert sweep.run(_tiny(), workdir) == json.loads(json.dumps(results))
  with pytest.raises(ValueError, match="different config.*--overwrite"):
    sweep.run(_tiny(depth=3), workdir)


class _Killed(Exception):
  """Stands for a kill signal in the middle of a run."""


def _spy(monkeypatch, *, kill_after=None):
  """Counts compiled-function calls, chunk files written and resumed items."""
  seen = dict(calls=[], written=[], resumed=[])
  real_build, real_write = sweep.build_measure, workdirs.Workdir.write_npz

  def build(form, **kwargs):
    measure = real_build(form, **kwargs)

    def counted(*args):
      if kill_after is not None and len(seen["calls"]) == kill_after:
        raise _Killed
      seen["calls"].append(type(form).__name__)
      return measure(*args)
    return counted

  class Progress(cli.Progress):
    def resumed(self, count):
      seen["resumed"].append(count)
      super().resumed(count)

  monkeypatch.setattr(sweep, "build_measure", build)
  monkeypatch.setattr(
      workdirs.Workdir, "write_npz", lambda self, name, arrays: (
          seen["written"].append(name), real_write(self, name, arrays)))
  monkeypatch.setattr(cli, "Progress", Progress)
  return seen


def _check_run_killed_mid_form_loses_no_finished_chunk(workdir, results,
                                                       monkeypatch):
  """Killed during the natural form's second chunk, the rerun does only that chunk."""
  config = _tiny()
  size, starts = sweep.chunk_starts(config, len(jax.devices()))
  assert len(starts) == 2
  natural = [f"partial_natural_items{s}-{s + size}.npz" for s in starts]
  assert set(natural) <= set(os.listdir(workdir))
  os.remove(os.path.join(workdir, "results.json"))
  os.remove(os.path.join(workdir, "partial_natural.json"))
  for name in natural:
    os.remove(os.path.join(workdir, name))
  with monkeypatch.context() as patch:
    seen = _spy(patch, kill_after=1)
    with pytest.raises(_Killed):
      sweep.run(config, workdir)
  assert seen["calls"] == ["Natural"] and seen["written"] == natural[:1]
  assert not os.path.exists(os.path.join(workdir, "partial_natural.json"))
  with monkeypatch.context() as patch:
    seen = _spy(patch)
    resumed = sweep.run(config, workdir)
  assert seen["calls"] == ["Natural"] and seen["written"] == natural[1:]
  items = len(config.lams) * len(config.etas) * config.n_tasks
  assert sum(seen["resumed"]) == items + size  # designed, natural chunk 0
  assert resumed["records"] == results["records"]
  assert resumed["traces"] == {"designed": 1, "natural": 1}


def test_tiny_float32_run(tmp_path, monkeypatch):
  """Files, accuracy, divergence, one trace per form, skip, refuse, resume, overwrite."""
  workdir, config = str(tmp_path), _tiny()
  results = sweep.run(config, workdir)
  _check_files_and_records(workdir, results, config)
  _check_float32_accuracy_and_divergence(results, config)
  items = len(config.lams) * len(config.etas) * config.n_tasks
  assert items > config.chunk_size  # several calls, the last one padded
  assert results["traces"] == {"designed": 1, "natural": 1}
  _check_rerun_skips_and_other_config_is_refused(workdir, results, monkeypatch)
  _check_run_killed_mid_form_loses_no_finished_chunk(workdir, results,
                                                     monkeypatch)
  # --overwrite hands a used workdir to another config, dropping old partials
  # and only what the sweep wrote: the user's own files stay.
  mine = ("results_analysis/table.csv", "partial_derivatives.txt",
          "figures/my_plot.png")
  for name in mine:
    os.makedirs(os.path.dirname(os.path.join(workdir, name)), exist_ok=True)
    with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
      f.write("mine")
  other = sweep.run(_tiny(depth=2, forms=("designed",)), workdir,
                    overwrite=True)
  assert {r["depth"] for r in other["records"]} == {1, 2}
  assert not [name for name in os.listdir(workdir)
              if name.startswith("partial_natural")]
  for name in mine:
    with open(os.path.join(workdir, name), encoding="utf-8") as f:
      assert f.read() == "mine"
  assert "error_vs_depth_natural.png" not in os.listdir(
      os.path.join(workdir, "figures"))


def test_tiny_run_refuses_what_it_cannot_trust(tmp_path):
  """A second run is locked out; altered or truncated chunks are refused by
  name; --overwrite clears them and leftover temporary files."""
  workdir, config = str(tmp_path), _tiny(forms=("designed",), depth=2)
  first = sweep.run(config, workdir)
  chunk = os.path.join(workdir, "partial_designed_items0-8.npz")
  assert os.path.exists(chunk)
  # While a run holds the workdir, another (another config, --overwrite) is
  # refused and changes nothing: no interleaved config.json and results.
  with workdirs.claim_workdir(workdir, config):
    with pytest.raises(workdirs.WorkdirInUse, match="in use by another run"):
      sweep.run(_tiny(forms=("designed",), depth=2, seed=1), workdir,
                overwrite=True)
  assert _read(workdir, "config.json")["seed"] == 0
  assert _read(workdir, "results.json")["records"] == json.loads(
      json.dumps(first["records"]))
  # Altered numbers in a valid chunk file are caught on resume.
  os.remove(os.path.join(workdir, "results.json"))
  os.remove(os.path.join(workdir, "partial_designed.json"))
  with np.load(chunk) as data:
    arrays = {k: data[k] for k in data.files}
  arrays["rel_err"] = arrays["rel_err"] * 0.5
  np.savez(chunk, **arrays)
  with pytest.raises(workdirs.CorruptOutput,
                     match="partial_designed_items0-8.npz.*checksum.*--overwrite"):
    sweep.run(config, workdir)
  # So is a truncated one.
  with open(chunk, "rb") as f:
    head = f.read(100)
  with open(chunk, "wb") as f:
    f.write(head)
  with pytest.raises(workdirs.CorruptOutput,
                     match="items0-8.npz.*not a readable"):
    sweep.run(config, workdir)
  leftover = os.path.join(workdir, ".tmp-abcd1234results.json")
  with open(leftover, "w", encoding="utf-8") as f:
    f.write("{")
  again = sweep.run(config, workdir, overwrite=True)
  assert again["records"] == first["records"]
  assert not os.path.exists(leftover)
  assert not os.path.exists(os.path.join(workdir, workdirs.LOCK))


def test_measure_task_detects_a_wrong_stack():
  """The comparison is not vacuous: a stack with a perturbed step is caught."""
  form = forms.Designed(n_train=6, d=3, n_query=2, n_out=1)
  tasks = ridge.sample_tasks(jax.random.key(1), batch=1, n_train=6, d=3,
                             n_query=2, dtype=jnp.float64)
  x, y, xq = tasks.x[0], tasks.y[0], tasks.x_query[0]
  lam, eta = jnp.float64(0.1), jnp.float64(0.3)
  measure = lambda f: jax.jit(functools.partial(sweep.measure_task, f,
                                                depth=4))(x, y, xq, lam, eta)
  good = measure(form)
  assert float(good["rel_err"].max()) < F64_BOUND

  class OffByOnePercent(forms.Designed):
    # The kernel scales the shared gd_basis by these per-item coefficients.
    def gd_coefficients(self, *, lam, eta, depth):
      return super().gd_coefficients(lam=lam, eta=1.01 * eta, depth=depth)

  wrong = OffByOnePercent(n_train=6, d=3, n_query=2, n_out=1)
  bad = measure(wrong)
  assert float(bad["rel_err"][1:].min()) > 1e-3


def test_cli_float64_sharded_on_four_devices_equals_one_device(tmp_path):
  """The command line, with overrides, on 4 forced host devices, in float64."""
  workdir = str(tmp_path / "sharded")
  env = multiprocess.environment(devices=4)
  cmd = [sys.executable, "-m", "experiments.sweep",
         "--config=experiments/configs/sweep.py:tiny", "--config.dtype=float64",
         "--config.depth=4", "--config.chunk_size=6", f"--workdir={workdir}"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "max_rel_err over stable cells" in proc.stdout  # the summary table
  assert "ETA" in proc.stderr  # progress lines
  sharded = _read(workdir, "results.json")
  refused = subprocess.run(cmd[:-1] + ["--config.depth=3", cmd[-1]], cwd=REPO,
                           env=env, capture_output=True, text=True,
                           timeout=120, check=False)
  assert refused.returncode != 0
  assert "different config (fields that differ: depth)" in refused.stderr
  assert "Traceback" not in refused.stderr
  assert sharded["devices"] == 4
  assert sharded["traces"] == {"designed": 1, "natural": 1}
  # On one device the chunks are 6 items, not 8: the 4-device chunk files
  # stay unread and every chunk is computed again.
  assert len(jax.devices()) == 1
  for name in ("results.json", "partial_designed.json", "partial_natural.json"):
    os.remove(os.path.join(workdir, name))
  single = sweep.run(_tiny(dtype="float64", depth=4, chunk_size=6), workdir)
  assert single["devices"] == 1
  assert single["traces"] == {"designed": 1, "natural": 1}
  chunk_files = sorted(n for n in os.listdir(workdir) if n.endswith(".npz"))
  assert chunk_files == sorted(f"partial_{form}_items{span}.npz"
                               for form in ("designed", "natural")
                               for span in ("0-8", "8-16", "0-6", "6-12"))
  for results in (sharded, single):
    assert results["dtype"] == "float64"
    assert 0 <= results["max_rel_err"] < F64_BOUND
  assert len(sharded["records"]) == len(single["records"])
  for rs, r1 in zip(sharded["records"], single["records"]):
    assert {k: v for k, v in rs.items() if "rel_err" not in k
            and "ridge" not in k} == {k: v for k, v in r1.items()
                                      if "rel_err" not in k
                                      and "ridge" not in k}
    for key in ("max_rel_err", "median_rel_err"):
      assert abs(rs[key] - r1[key]) < 1e-14
    for key in ("elsa_to_ridge", "gd_to_ridge"):
      np.testing.assert_allclose(rs[key], r1[key], rtol=1e-9)


def test_configs_name_their_command():
  """Every config file's docstring starts with the command that runs it."""
  for driver in ("sweep", "train", "newton", "benchmark"):
    assert cli.config_path(driver) == os.path.join(
        REPO, "experiments", "configs", f"{driver}.py")
    assert os.path.exists(cli.config_path(driver))
  folder = os.path.join(REPO, "experiments", "configs")
  names = sorted(f[:-3] for f in os.listdir(folder)
                 if f.endswith(".py") and f != "__init__.py")
  assert {"sweep", "newton", "benchmark"} <= set(names)
  for name in names:
    module = importlib.import_module(f"experiments.configs.{name}")
    first = (module.__doc__ or "").strip().splitlines()[0]
    assert first.startswith("python -m experiments."), (name, first)
    driver = first.split()[2].split(".")[1]
    if name == driver:
      module.get_config()  # builds
      continue
    # Not the driver's default config: its command names a config file and
    # variant that build (configs/prefix.py's variants are train.py's).
    flag = next(w for w in first.split() if w.startswith("--config="))
    path, _, variant = flag[len("--config="):].partition(":")
    with open(os.path.join(REPO, path), encoding="utf-8") as source:
      assert path == f"experiments/configs/{name}.py" or (
          f"from experiments.configs import {name}" in source.read()), (
              name, first)
    importlib.import_module(path[:-3].replace("/", ".")).get_config(
        variant or None)  # builds


def test_other_processes_take_process_0s_word_on_what_is_done(tmp_path,
                                                              monkeypatch):
  """Process 1 of 2 waits for process 0 and skips only what process 0 reports done.

  Process 0 (not run here) claims the workdir with --overwrite, deleting the
  old run there; process 1 may still see the old files, and must not take
  them for finished work of its own config.
  """
  workdir = str(tmp_path)
  workdirs.write_json(os.path.join(workdir, "config.json"), {"depth": 99})
  for name in ("results.json", "partial_designed.json"):
    workdirs.write_json(os.path.join(workdir, name), {"stale": True})
  before = sorted(os.listdir(workdir))
  claimed, broadcast = [], []

  def agree(step, check, *args):
    claimed.append(step)
    return check(*args)

  def from_process_0(flags):
    broadcast.append(jax.tree.map(np.copy, flags))
    assert claimed[-1] == "claim"  # after process 0's claim
    return jax.tree.map(np.zeros_like, flags)  # process 0: nothing done

  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(sweep.distributed, "agree", agree)
  monkeypatch.setattr(sweep.multihost_utils, "broadcast_one_to_all",
                      from_process_0)
  config = _tiny(forms=("designed",), depth=2)
  results = sweep.run(config, workdir, overwrite=True)
  assert claimed == ["validate", "claim"]
  assert len(broadcast) == 1 and broadcast[0]["results"]  # it saw the stale file
  assert {r["depth"] for r in results["records"]} == {1, 2}
  assert sorted(os.listdir(workdir)) == before  # only process 0 writes


@pytest.mark.parametrize("field, value, allowed", [
    ("eta_mode", "relative", r"one of \['fraction', 'absolute'\]"),
    ("depth", 0, "an int >= 1"),
    ("lams", (), "a non-empty tuple"),
    ("etas", (), "a non-empty tuple"),
    ("forms", ("designed", "spiral"), r"\[1\] must be one of"),
    ("n_tasks", 0, "an int >= 1"),
    ("chunk_size", 0, "an int >= 1"),
    ("noise", float("nan"), "a finite number >= 0"),
    ("lams", (0.1, -10.0), r"\[1\] must be a finite number >= 0"),
    ("etas", (0.5, -0.5), r"\[1\] must be a finite number > 0"),
    ("etas", (float("inf"),), "a finite number > 0"),
    ("dtype", "float16", "one of"),
    ("forms", ("designed", "designed"), r"\[1\] repeats config\.forms\[0\]"),
    ("lams", (0.1, 0.0, 0.1), r"\[2\] repeats config\.lams\[0\]"),
    ("seed", -1, r"an int in \[0, 9223372036854775807\]"),
    ("seed", 2 ** 63, r"an int in \[0, 9223372036854775807\]"),
])
def test_bad_config_is_refused_before_the_workdir_is_touched(
    tmp_path, field, value, allowed):
  workdir = str(tmp_path / "run")
  with pytest.raises(checks.ConfigError, match=f"config\\.{field}.*{allowed}"):
    sweep.run(_tiny(**{field: value}), workdir)
  assert not os.path.exists(workdir)


def test_sizes_that_cannot_fit_are_refused_in_one_line(tmp_path):
  with pytest.raises(checks.ConfigError, match=r"GiB.*make them smaller") as e:
    sweep.run(_tiny(d=100_000, n_train=100_000), str(tmp_path / "run"))
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "run")


def _list_fields(config):
  return sorted(k for k, v in config.items() if isinstance(v, tuple))


def test_config_variants_and_list_overrides_from_the_command_line():
  """``sweep.py:tiny`` is get_config("tiny"); every tuple field of every
  config is overridable (strings, floats, ints; newton's kappas); unknown
  variants are refused naming the known ones."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  checked = set()
  for driver, variant in (("sweep", None), ("sweep", "tiny"),
                          ("newton", None), ("newton", "tiny"),
                          ("benchmark", None), ("benchmark", "quick")):
    module = importlib.import_module(f"experiments.configs.{driver}")
    for field in _list_fields(module.get_config(variant)):
      value = module.get_config(variant)[field]
      value = value[::-1] if len(value) > 1 else value + value[:0]
      arg = cli.config_path(driver) + (f":{variant}" if variant else "")
      argv = ["prog", f"--config={arg}", f"--config.{field}={value!r}"]
      values = flags.FlagValues()
      config_flags.DEFINE_config_file("config", flag_values=values,
                                      sys_argv=argv)
      values(argv)
      expected = module.get_config(variant)
      expected[field] = value
      assert values.config[field] == value, (driver, field)
      assert checks.config_dict(values.config) == checks.config_dict(expected)
      checked.add((driver, field))
    with pytest.raises(ValueError, match=f"{driver} config: unknown "
                       "argument 'quik'; known: '"):
      module.get_config("quik")
  assert {("newton", "kappas"), ("sweep", "forms"), ("sweep", "lams"),
          ("benchmark", "dtypes"), ("benchmark", "parts")} <= checked
