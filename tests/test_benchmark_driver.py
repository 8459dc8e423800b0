"""End-to-end check of experiments/benchmark.py on its quick config.

Speed is measured by the benchmark, not asserted here: these tests check that
the driver runs, writes every field of results.json, and that the figures are
sane (positive times, finite ratios, FLOP counts that match the formula).
"""

import math
import os

import pytest

from experiments import benchmark
from experiments import common
from experiments.configs import benchmark as benchmark_config


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  config = benchmark_config.get_config("quick")
  workdir = str(tmp_path_factory.mktemp("benchmark"))
  return config, workdir, benchmark.run(config, workdir)


def _positive(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_results_file_matches_returned_results(quick_run):
  _, workdir, results = quick_run
  assert common.read_json(os.path.join(workdir, "results.json")) == results
  assert set(results) >= {"machine", "square_matmul", "primitive", "stack",
                          "sweep", "load_average_after"}
  assert results["machine"]["platform"] in ("cpu", "gpu", "tpu", "cuda", "rocm")
  assert _positive(results["square_matmul"]["gflops"])


def test_primitive_rows(quick_run):
  config, _, results = quick_run
  rows = results["primitive"]["rows"]
  assert [(r["n"], r["m"]) for r in rows] == [
      (n, m) for n in config.widths for m in config.tokens]
  for r in rows:
    m, n = r["m"], r["n"]
    assert r["flops"] == 2 * m * n * 3 * n + 4 * m * n * n + 3 * m * n
    assert r["flops"] == benchmark.elsa_flops(m, n, n, n)
    for part in ("elsa", "matmul"):
      assert _positive(r[part]["median_s"]) and r[part]["reps"] >= 1
      assert r[part]["min_s"] <= r[part]["median_s"]
      assert _positive(r[part]["gflops"])
    assert _positive(r["fraction_of_matmul_rate"])
    # The same-FLOP matmul really has at least the FLOPs of ELSA.
    _, _, width = r["matmul"]["shape"]
    assert 0 <= 2 * m * n * width - r["flops"] < 2 * m * n
    # The quadratic order needs at least its [m, m] matrix.
    assert r["quadratic"]["bytes"] >= 4 * m * m
    if "skipped" in r["quadratic"]:
      assert r["speedup_vs_quadratic"] is None
    else:
      assert _positive(r["quadratic"]["median_s"])
      assert _positive(r["speedup_vs_quadratic"])
    if r["elsa"]["bytes"] is not None:
      # Linear memory: Q, K, V, K^T V and the output, with slack for
      # alignment; at m = 256 this is well below the [m, m] matrix.
      linear = 4 * (3 * m * n + n * n + m * n)
      assert r["elsa"]["bytes"] <= 2 * linear + 4096
      if m >= 256:
        assert r["elsa"]["bytes"] < 4 * m * m
  # The quick budget (0.01 GiB) keeps m=64 and m=256 both running.
  assert any(r["speedup_vs_quadratic"] is not None for r in rows)
  for fit in results["primitive"]["time_exponent"].values():
    assert math.isfinite(fit["all_tokens"])


def test_stack_rows(quick_run):
  config, _, results = quick_run
  stack = results["stack"]
  assert [r["depth"] for r in stack["scan"]] == list(config.stack_depths)
  assert [r["depth"] for r in stack["unrolled"]] == list(config.unrolled_depths)
  for r in stack["scan"] + stack["unrolled"]:
    assert _positive(r["compile_s"]) and _positive(r["lower_s"])
    assert _positive(r["run"]["median_s"]) and _positive(r["layer_s"])
  assert _positive(stack["compile_ratio_deepest_to_shallowest"])


def test_sweep_rows(quick_run):
  config, _, results = quick_run
  sweep = results["sweep"]
  if sweep is None:
    pytest.skip("elsa.forms is not importable yet")
  assert [r["batch"] for r in sweep["rows"]] == list(config.sweep_batches)
  for r in sweep["rows"]:
    for kernel in ("attention", "gd"):
      assert _positive(r[kernel]["task_layers_per_s"])
    assert _positive(r["gd_over_attention_time"])
    # Both kernels compute the same iterate: the benchmark times real work.
    assert r["max_abs_w_difference"] <= 1e-4 * max(1.0, r["max_abs_w"])


def test_rerun_reuses_results_and_other_config_is_refused(quick_run):
  config, workdir, results = quick_run
  assert benchmark.run(config, workdir) == results  # no re-measurement
  other = benchmark_config.get_config("quick")
  other.reps = 3
  with pytest.raises(ValueError, match="different config"):
    benchmark.run(other, workdir)


def test_format_tables(quick_run):
  _, _, results = quick_run
  text = benchmark.format_tables(results)
  assert "GFLOP/s" in text and "compile" in text
