"""End-to-end check of experiments/benchmark.py on its tiny config.

Speed is measured by the benchmark, not asserted here: these tests check that
the driver runs, writes every field of results.json, and that the figures are
sane (positive times, finite ratios, FLOP counts that match the formula).
"""

import math
import os
import shutil

import numpy as np
import pytest

from elsa import ridge
from experiments import benchmark
from experiments import checks
from experiments import sweep
from experiments import workdirs
from experiments.configs import benchmark as benchmark_config


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  config = benchmark_config.get_config("tiny")
  workdir = str(tmp_path_factory.mktemp("benchmark"))
  return config, workdir, benchmark.run(config, workdir)


def _positive(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _per_round(ratio, config):
  """A ratio over rounds: positive median within its spread."""
  assert _positive(ratio["min"])
  assert ratio["min"] <= ratio["median"] <= ratio["max"]
  assert config.min_reps <= ratio["rounds"] <= config.reps


def test_results_file_matches_returned_results(tiny_run):
  config, workdir, results = tiny_run
  found = workdirs.read_json(os.path.join(workdir, "results.json"))
  assert found.pop("_check")["config_hash"] == checks.config_hash(
      benchmark_config.get_config("tiny"))
  assert found == results
  assert set(results) >= {"machine", "square_matmul", "primitive", "stack",
                          "sweep", "train", "causal", "transformer",
                          "load_average_after"}
  assert results["machine"]["platform"] in ("cpu", "gpu", "tpu", "cuda", "rocm")
  squares = results["square_matmul"]
  assert [s["dtype"] for s in squares] == list(config.dtypes)
  assert all(_positive(s["gflops"]) for s in squares)


def test_primitive_rows(tiny_run):
  config, _, results = tiny_run
  rows = results["primitive"]["rows"]
  assert config.dtypes == ("float32", "float64")
  assert [(r["dtype"], r["n"], r["m"]) for r in rows] == [
      (dtype, n, m) for dtype in config.dtypes for n in config.widths
      for m in config.tokens]
  for r in rows:
    m, n = r["m"], r["n"]
    assert r["flops"] == 2 * m * n * 3 * n + 4 * m * n * n + 3 * m * n
    assert r["flops"] == benchmark.elsa_flops(m, n, n, n)
    for part in ("elsa", "matmul"):
      assert _positive(r[part]["median_s"]) and r[part]["reps"] >= 1
      assert r[part]["min_s"] <= r[part]["median_s"]
      assert _positive(r[part]["gflops"])
    _per_round(r["fraction_of_matmul_rate"], config)
    # The same-FLOP matmul really has at least the FLOPs of ELSA.
    _, _, width = r["matmul"]["shape"]
    assert 0 <= 2 * m * n * width - r["flops"] < 2 * m * n
    size = np.dtype(r["dtype"]).itemsize
    # The quadratic order needs at least its [m, m] matrix.
    assert r["quadratic"]["bytes"] >= size * m * m
    if "skipped" in r["quadratic"]:
      assert r["speedup_vs_quadratic"] is None
    else:
      assert _positive(r["quadratic"]["median_s"])
      _per_round(r["speedup_vs_quadratic"], config)
    if r["elsa"]["bytes"] is not None:
      # Linear memory: Q, K, V, K^T V and the output, with slack for
      # alignment; at m = 256 this is well below the [m, m] matrix.
      linear = size * (3 * m * n + n * n + m * n)
      assert r["elsa"]["bytes"] <= 2 * linear + 4096
      if m >= 256:
        assert r["elsa"]["bytes"] < size * m * m
  # The quick budget (0.01 GiB) keeps m=64 and m=256 both running.
  assert any(r["speedup_vs_quadratic"] is not None for r in rows)
  for fit in results["primitive"]["time_exponent"].values():
    assert math.isfinite(fit["all_tokens"])


def test_stack_rows(tiny_run):
  config, _, results = tiny_run
  stack = results["stack"]
  assert [r["depth"] for r in stack["scan"]] == list(config.stack_depths)
  assert [r["depth"] for r in stack["unrolled"]] == list(config.unrolled_depths)
  for r in stack["scan"] + stack["unrolled"]:
    assert _positive(r["compile_s"]) and _positive(r["lower_s"])
    assert _positive(r["run"]["median_s"]) and _positive(r["layer_s"])
  ratio = stack["compile_ratio_deepest_to_shallowest"]
  assert _positive(ratio["min"]) and ratio["min"] <= ratio["median"] <= ratio["max"]
  assert ratio["rounds"] == config.compile_reps


def test_sweep_rows(tiny_run):
  config, _, results = tiny_run
  part = results["sweep"]
  assert part["form"] == config.sweep_form
  assert part["lams"] == list(config.sweep_lams)
  assert part["eta_fractions"] == list(config.sweep_eta_fractions)
  assert part["devices"] >= 1
  assert [(r["dtype"], r["batch"]) for r in part["rows"]] == [
      (dtype, batch) for dtype in config.dtypes
      for batch in config.sweep_batches]
  grid = len(config.sweep_lams) * len(config.sweep_eta_fractions)
  for r in part["rows"]:
    assert r["grid"] == grid and r["items"] == grid * r["batch"]
    assert r["padded_items"] >= r["items"]
    assert r["padded_items"] % part["devices"] == 0
    assert r["depth"] == config.sweep_depth
    # The Designed form's token layout for these task shapes.
    assert r["m"] > config.sweep_n_train and r["n"] > config.sweep_d
    for kernel in ("sweep_kernel", "gd"):
      timing = r[kernel]
      assert _positive(timing["compile_s"]) and _positive(timing["median_s"])
      assert timing["min_s"] <= timing["median_s"] and timing["reps"] >= 1
      assert timing["item_layers_per_s"] == pytest.approx(
          r["items"] * r["depth"] / timing["median_s"])
    # The pruned Designed basis: a skip (m n) and a head reading d columns
    # and writing one.
    m, n, d = r["m"], r["n"], config.sweep_d
    head = (2 * m * n * (d + 1) + m * (d + 1) + 4 * m * d + d + 2 * n * d
            + 2 * m * n + m)
    assert r["sweep_kernel"]["flops"] == r["padded_items"] * r["depth"] * (
        m * n + 2 * n + head)
    assert _positive(r["matmul"]["gflops"])
    _per_round(r["fraction_of_matmul_rate"], config)
    _per_round(r["sweep_kernel_over_gd_time"], config)
    # The timed kernel is the sweep's: its own ELSA-vs-GD error is rounding
    # (stable step sizes, depth 4), not a wrong computation.
    assert 0 <= r["max_rel_err"] < (1e-4 if r["dtype"] == "float32" else 1e-12)


def test_sweep_config_gives_the_sweeps_stable_items():
  """The benchmark times experiments.sweep.grid_items, all eta below the limit."""
  config = benchmark_config.get_config("tiny")
  config.sweep_lams = (0.0, 0.5)
  config.sweep_eta_fractions = (0.25, 0.5, 0.9)
  sweep_config = benchmark.sweep_config(config, batch=3)
  items = sweep.grid_items(sweep_config, np.float64)
  g = 2 * 3 * 3
  n, d, q = config.sweep_n_train, config.sweep_d, config.sweep_n_query
  assert items["x"].shape == (g, n, d) and items["y"].shape == (g, n)
  assert items["x_query"].shape == (g, q, d)
  assert not items["unstable"].any()
  # eta is the stated fraction of each task's stability limit.
  x = items["x"].reshape(2, 3, 3, n, d)
  lam = items["lam"].reshape(2, 3, 3)
  limit = np.asarray(ridge.stability_limit(x[:, 0], lam=lam[:, 0, :]))
  np.testing.assert_allclose(items["eta"].reshape(2, 3, 3),
                             np.array([0.25, 0.5, 0.9])[None, :, None]
                             * limit[:, None, :], rtol=1e-12)


def test_rerun_reuses_results_and_other_config_is_refused(tiny_run):
  config, workdir, results = tiny_run
  assert benchmark.run(config, workdir) == results  # no re-measurement
  other = benchmark_config.get_config("tiny")
  other.reps = 3
  with pytest.raises(ValueError, match="different config"):
    benchmark.run(other, workdir)


def test_unknown_config_argument_and_bad_fields_are_refused(tmp_path):
  with pytest.raises(ValueError,
                     match="unknown argument 'quik'; known: 'tiny', 'quick'"):
    benchmark_config.get_config("quik")
  for field, value, message in (
      ("reps", 0, "reps"), ("tokens", (), "tokens"),
      ("max_case_s", float("nan"), "max_case_s"),
      ("sweep_eta_fractions", (0.5, 1.0), "sweep_eta_fractions"),
      ("sweep_lams", (-0.1,), "sweep_lams"),
      ("tokens", (64, 64), r"tokens\[1\] repeats"),
      ("parts", ("sweep", "plots"), r"parts\[1\] must be one of"),
      ("parts", ("sweep_ab",), r"parts\[0\] must be one of"),
      ("train_lsa_depths", (0,), r"train_lsa_depths\[0\]"),
      ("train_elsa_batch", 0, "train_elsa_batch"),
      ("causal_chunks", (0,), r"causal_chunks\[0\]"),
      ("transformer_points", (), "transformer_points"),
      ("seed", 2 ** 63, "seed"),
      # The sweep part's items (2 x 10^7 here) must fit in memory too.
      ("sweep_batches", (10 ** 7,), "sweep_batches.*GiB.*make them smaller")):
    config = benchmark_config.get_config("tiny")
    config[field] = value
    with pytest.raises(checks.ConfigError, match=f"config[.:] ?{message}"):
      benchmark.run(config, str(tmp_path / "run"))
  # The quadratic order's budget is memory it may take: at m = 2^20 its
  # [m, m] scores need 8 TiB, so a budget that large cannot be met.
  config = benchmark_config.get_config("tiny")
  config.tokens, config.quadratic_budget_gib = (2 ** 20,), 2.0 ** 40
  with pytest.raises(checks.ConfigError,
                     match="config: quadratic_budget_gib need about .* GiB"):
    benchmark.run(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


def test_damaged_results_are_refused_by_name(tiny_run, tmp_path):
  _, workdir, _ = tiny_run
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  with open(os.path.join(copy, "results.json"), "r+", encoding="utf-8") as f:
    f.truncate(100)
  with pytest.raises(workdirs.CorruptOutput,
                     match="results.json' is not valid JSON.*--overwrite"):
    benchmark.run(benchmark_config.get_config("tiny"), copy)


def test_train_rows(tiny_run):
  """Our train step against the plain reference: the same loss and gradient
  (the reference is the same math), FLOPs from XLA, per-round ratios."""
  config, _, results = tiny_run
  rows = results["train"]["rows"]
  assert [(r["model"], r["depth"]) for r in rows] == [
      ("lsa_residual_trained", depth) for depth in config.train_lsa_depths
  ] + [("elsa_trained", config.train_elsa_depth)]
  for r in rows:
    lsa = r["model"] == "lsa_residual_trained"
    assert r["batch"] == (config.train_lsa_batch if lsa
                          else config.train_elsa_batch)
    assert (r["m"], r["n"], r["components"], r["tied"]) == (
        (11, 11, 1, True) if lsa else (21, 10, 3, False))
    # float32 against float32, both from the same parameters and batch.
    assert r["loss_relative_difference"] < 1e-5
    assert r["gradient_relative_difference"] < 1e-4
    for side in ("ours_update", "reference_update", "draw"):
      assert _positive(r[side]["median_s"])
      assert r[side]["flops"] is None or _positive(r[side]["flops"])
    _per_round(r["update_ratio"], config)
    ours, ref = r["ours_update"]["flops"], r["reference_update"]["flops"]
    if ours is not None and lsa:
      # Masked LSA with m = k = v: the linear and the attention order of
      # the same products cost the same (cost analysis counts every layer:
      # stacks of up to 4 layers are unrolled).
      assert ours == pytest.approx(ref, rel=0.01)


def test_format_tables(tiny_run):
  _, _, results = tiny_run
  text = benchmark.format_tables(results)
  assert "GFLOP/s" in text and "compile" in text and "sweep kernel" in text
  assert "train step on a drawn batch" in text


def test_the_older_name_quick_is_the_tiny_config():
  assert benchmark_config.get_config("quick") == benchmark_config.get_config(
      "tiny")


def test_causal_rows(tiny_run):
  """Causal by chunks against the masked quadratic order (the same output,
  float32) and non-causal ELSA at every m, then the chunk sweep."""
  config, _, results = tiny_run
  part = results["causal"]
  assert [r["m"] for r in part["rows"]] == list(config.causal_tokens)
  assert [r["chunk"] for r in part["chunks"]] == list(config.causal_chunks)
  for r in part["rows"]:
    # m = 100 is not a multiple of the default chunk (64): the padded tail
    # is exact too. Measured float32 worst: 2.2e-7.
    assert r["max_rel_err"] < 1e-5
    assert _positive(r["causal"]["median_s"])
    _per_round(r["speedup_vs_masked_quadratic"], config)
    _per_round(r["causal_over_non_causal"], config)
  assert all(r["m"] == config.causal_chunk_tokens
             and _positive(r["causal"]["median_s"]) for r in part["chunks"])


def test_transformer_rows(tiny_run):
  config, _, results = tiny_run
  rows = results["transformer"]["rows"]
  assert [r["tokens"] for r in rows] == [2 * n for n in
                                         config.transformer_points]
  for r in rows:
    for kind in ("elsa", "lsa", "softmax"):
      assert _positive(r[kind]["median_s"])
      assert r[kind]["flops"] is None or _positive(r[kind]["flops"])
    _per_round(r["elsa_over_softmax"], config)
    _per_round(r["lsa_over_softmax"], config)
  text = benchmark.format_tables(results)
  assert "causal elsa by chunks" in text and "transformer training step" in text
