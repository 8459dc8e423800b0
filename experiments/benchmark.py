r"""Measured speed: the ELSA primitive, deep stacks, and the sweep kernel.

  python -m experiments.benchmark --config=experiments/configs/benchmark.py --workdir=runs/benchmark

Three parts, each a list of rows in ``results.json`` and a printed table:

1. ``primitive``: ``elsa(p, h)`` under ``jit`` for ``h [m, n]``, ``k = v = n``,
   against (a) a plain ``jnp.matmul`` ``[m, n] @ [n, F]`` with the same FLOP
   count, measured in the same run (the machine's own rate for this shape of
   work), and (b) the quadratic order ``(Q K^T) V`` of standard attention
   code. The FLOP count of one ELSA forward is

       flops(m, n, k, v) = 2 m n (2k + v)      projections h W1, h W2, h W3
                         + 2 m k v             K^T V
                         + 2 m k v             Q (K^T V)
                         + m (2k + v)          bias adds

   and ``F = ceil(flops / (2 m n))``. Memory is ``temp + output`` bytes of the
   compiled function (``compiled.memory_analysis()``): what the call
   allocates beyond its arguments.
2. ``stack``: ``elsa_stack`` compile (lower + XLA compile) and run time at
   several depths; ``lax.scan`` keeps compile time flat in depth.
3. ``sweep``: the sweep kernel, ``L`` layers of the GD stack of an input form
   over a (lambda, eta) grid and a batch of tasks, in grid x tasks x layers
   per second, against ``elsa.ridge.gd`` on the same grid.

Times are medians of several calls after warm-up, each call ended by
``block_until_ready``. The platform, device and CPU load are recorded.
"""

from __future__ import annotations

import importlib
import math
import os
import platform
import sys
import time
from typing import Any, Callable

from absl import app
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import elsa
from elsa import ridge
from experiments import common

_GIB = 2.0 ** 30


def elsa_flops(m: int, n: int, k: int, v: int) -> int:
  """FLOPs of one ELSA forward (see the module docstring)."""
  return 2 * m * n * (2 * k + v) + 4 * m * k * v + m * (2 * k + v)


def quadratic_flops(m: int, n: int, k: int, v: int) -> int:
  """FLOPs of ``(Q K^T) V``: the projections plus ``2 m^2 k + 2 m^2 v``."""
  return 2 * m * n * (2 * k + v) + 2 * m * m * (k + v) + m * (2 * k + v)


def quadratic_elsa(p: elsa.ElsaParams, h: jax.Array) -> jax.Array:
  """``elsa(p, h)`` in the order of standard attention code: ``(Q K^T) V``."""
  q, k, v = h @ p.w3 + p.b3, h @ p.w1 + p.b1, h @ p.w2 + p.b2
  return (q @ k.T) @ v


def time_call(fn: Callable[[], Any], *, config: ml_collections.ConfigDict
              ) -> dict[str, float]:
  """Median, min and count of timed calls of ``fn`` (after warm-up)."""
  for _ in range(config.warmup):
    jax.block_until_ready(fn())
  times, spent = [], 0.0
  while len(times) < config.reps:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
    spent += times[-1]
    if spent > config.max_case_s and len(times) >= config.min_reps:
      break
  return dict(median_s=float(np.median(times)), min_s=float(np.min(times)),
              reps=len(times))


def allocated_bytes(compiled) -> int | None:
  """``temp + output`` bytes of a compiled function, where the backend says."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None  # Not every backend implements it.
  if stats is None:
    return None
  return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


def fit_exponent(tokens, times) -> float | None:
  """Slope of ``log time`` against ``log m`` by least squares."""
  if len(tokens) < 2:
    return None
  slope, _ = np.polyfit(np.log(tokens), np.log(times), 1)
  return float(slope)


def machine() -> dict[str, Any]:
  """Where the numbers come from."""
  device = jax.devices()[0]
  cpu = platform.processor()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    cpu = names[0] if names else cpu
  return dict(platform=device.platform, device_kind=device.device_kind,
              device_count=jax.device_count(), cpu=cpu,
              cpu_count=os.cpu_count(), jax_version=jax.__version__,
              load_average=list(os.getloadavg()))


def square_matmul(config: ml_collections.ConfigDict) -> dict[str, float]:
  """GFLOP/s of a square ``[s, s] @ [s, s]`` matmul, for context.

  On the 2-core development CPU XLA runs this shape below the rate of the
  narrow ``[m, n] @ [n, F]`` matmuls, so it is not a ceiling there.
  """
  s, dtype = config.square_matmul_size, jnp.dtype(config.dtype)
  a = jax.random.normal(jax.random.key(config.seed), (s, s), dtype)
  matmul = jax.jit(jnp.matmul).lower(a, a).compile()
  timing = time_call(lambda: matmul(a, a), config=config)
  return dict(size=s, gflops=2 * s ** 3 / timing["median_s"] / 1e9, **timing)


def primitive_row(m: int, n: int, config: ml_collections.ConfigDict
                  ) -> dict[str, Any]:
  """ELSA, the same-FLOP matmul and the quadratic order at one ``(m, n)``."""
  k = v = n
  dtype = jnp.dtype(config.dtype)
  key_p, key_h, key_b = jax.random.split(jax.random.key(config.seed), 3)
  p = elsa.ElsaParams.init(key_p, m=m, n=n, k=k, v=v, dtype=dtype)
  h = jax.random.normal(key_h, (m, n), dtype)
  flops = elsa_flops(m, n, k, v)
  row = dict(m=m, n=n, k=k, v=v, flops=flops)

  fast = jax.jit(elsa.elsa).lower(p, h).compile()
  row["elsa"] = time_call(lambda: fast(p, h), config=config)
  row["elsa"]["bytes"] = allocated_bytes(fast)
  row["elsa"]["gflops"] = flops / row["elsa"]["median_s"] / 1e9

  width = math.ceil(flops / (2 * m * n))
  b = jax.random.normal(key_b, (n, width), dtype)
  matmul = jax.jit(jnp.matmul).lower(h, b).compile()
  row["matmul"] = time_call(lambda: matmul(h, b), config=config)
  row["matmul"].update(shape=[m, n, width],
                       gflops=2 * m * n * width / row["matmul"]["median_s"] / 1e9)
  row["fraction_of_matmul_rate"] = row["elsa"]["gflops"] / row["matmul"]["gflops"]

  slow = jax.jit(quadratic_elsa).lower(p, h).compile()
  needed = allocated_bytes(slow)
  if needed is None:  # No memory analysis: estimate the [m, m] matrix.
    needed = m * m * dtype.itemsize
  row["quadratic"] = dict(bytes=needed, flops=quadratic_flops(m, n, k, v))
  if needed > config.quadratic_budget_gib * _GIB:
    row["quadratic"]["skipped"] = (
        f"needs {needed / _GIB:.2f} GiB > budget "
        f"{config.quadratic_budget_gib} GiB")
    row["speedup_vs_quadratic"] = None
  else:
    row["quadratic"].update(time_call(lambda: slow(p, h), config=config))
    row["speedup_vs_quadratic"] = (row["quadratic"]["median_s"] /
                                   row["elsa"]["median_s"])
  return row


def run_primitive(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 1: rows for every (n, m), and the fitted exponent per width."""
  rows, exponents = [], {}
  progress = common.Progress(len(config.widths) * len(config.tokens),
                             name="primitive", unit="cases", every_s=0.0)
  for n in config.widths:
    for m in config.tokens:
      rows.append(primitive_row(m, n, config))
      progress.update()
    mine = [r for r in rows if r["n"] == n]
    big = [r for r in mine if r["m"] >= config.fit_min_tokens]
    exponents[str(n)] = dict(
        all_tokens=fit_exponent([r["m"] for r in mine],
                                [r["elsa"]["median_s"] for r in mine]),
        from_fit_min_tokens=fit_exponent([r["m"] for r in big],
                                         [r["elsa"]["median_s"] for r in big]))
  return dict(rows=rows, time_exponent=exponents)


def _stack_inputs(config: ml_collections.ConfigDict, depth: int):
  dtype = jnp.dtype(config.dtype)
  m, n, c = config.stack_tokens, config.stack_width, config.stack_components
  key_p, key_h = jax.random.split(jax.random.key(config.seed))
  # Small weights keep a deep cubic map from overflowing; speed is the point.
  p = elsa.ElsaParams.init(key_p, m=m, n=n, k=n, lead=(depth, c),
                           scale=0.1 / n, dtype=dtype)
  return p, jax.random.normal(key_h, (m, n), dtype)


def _unrolled_stack(p: elsa.ElsaParams, h: jax.Array) -> jax.Array:
  for layer in range(p.w1.shape[0]):
    h = elsa.elsa_layer(jax.tree.map(lambda leaf, i=layer: leaf[i], p), h)
  return h


def stack_row(depth: int, fn, config: ml_collections.ConfigDict
              ) -> dict[str, Any]:
  """Lower, compile (median of ``compile_reps``) and run ``fn`` at one depth.

  Compilation is timed on abstract inputs (shapes and dtypes only) before
  the concrete ones exist: drawing ``depth`` layers of random parameters is
  dispatched asynchronously and would otherwise run during, and be counted
  in, the compile time.
  """
  specs = jax.eval_shape(lambda: _stack_inputs(config, depth))
  lower_s, compile_s = [], []
  for _ in range(config.compile_reps):
    start = time.perf_counter()
    # A fresh function each time, so no trace or compile cache answers.
    lowered = jax.jit(lambda p, h: fn(p, h)).lower(*specs)  # pylint: disable=unnecessary-lambda
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    lower_s.append(lowered_at - start)
    compile_s.append(time.perf_counter() - lowered_at)
  p, h = jax.block_until_ready(_stack_inputs(config, depth))
  run = time_call(lambda: compiled(p, h), config=config)
  return dict(depth=depth, lower_s=float(np.median(lower_s)),
              compile_s=float(np.median(compile_s)), run=run,
              layer_s=run["median_s"] / depth)


def run_stack(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 2: compile and run time of ``elsa_stack`` (and an unrolled loop)."""
  scan = [stack_row(depth, elsa.elsa_stack, config)
          for depth in config.stack_depths]
  unrolled = [stack_row(depth, _unrolled_stack, config)
              for depth in config.unrolled_depths]
  first, last = scan[0], scan[-1]
  return dict(scan=scan, unrolled=unrolled,
              compile_ratio_deepest_to_shallowest=(
                  (last["lower_s"] + last["compile_s"]) /
                  (first["lower_s"] + first["compile_s"])))


def _import_forms(wait_s: float):
  """``elsa.forms`` with ``Designed`` and ``Natural``, waiting up to ``wait_s``
  seconds for it (it may be written while this runs); ``None`` if missing."""
  deadline = time.monotonic() + wait_s
  while True:
    try:
      forms = importlib.import_module("elsa.forms")
      if hasattr(forms, "Designed") and hasattr(forms, "Natural"):
        return forms
      problem = "it has no Designed / Natural"
    except ImportError as error:
      problem = str(error)
    if time.monotonic() > deadline:
      logging.warning("elsa.forms is not usable (%s): sweep skipped.", problem)
      return None
    logging.info("waiting for elsa.forms (%s)", problem)
    sys.modules.pop("elsa.forms", None)
    importlib.invalidate_caches()
    time.sleep(30)


def sweep_kernels(form, depth: int):
  """The two jitted kernels: final ``w`` of every (grid point, task).

  Both take ``x [B, N, d], y [B, N], x_query [B, Q, d]`` and ``lams, etas
  [G]`` and return ``[G, B, d]``.
  """

  def attention(x, y, x_query, lams, etas):
    h0 = form.encode(x, y, x_query=x_query)

    def one(lam, eta):
      params = form.gd_params(lam=lam, eta=eta, depth=depth)
      return form.decode_w(elsa.elsa_stack(params, h0)).reshape(x.shape[0], -1)

    return jax.vmap(one)(lams, etas)

  def gd(x, y, x_query, lams, etas):
    del x_query  # GD does not look at the queries.
    one = lambda lam, eta: ridge.gd(x, y, lam=lam, eta=eta, steps=depth)[-1]
    return jax.vmap(one)(lams, etas).reshape(lams.shape[0], x.shape[0], -1)

  return jax.jit(attention), jax.jit(gd)


def run_sweep(config: ml_collections.ConfigDict) -> dict[str, Any] | None:
  """Part 3: grid x tasks x layers per second, attention stack against GD."""
  forms = _import_forms(config.forms_wait_s)
  if forms is None:
    return None
  dtype = jnp.dtype(config.dtype)
  form_class = dict(designed=forms.Designed, natural=forms.Natural)[
      config.sweep_form]
  form = form_class(n_train=config.sweep_n_train, d=config.sweep_d,
                    n_query=config.sweep_n_query, n_out=1)
  attention, gd = sweep_kernels(form, config.sweep_depth)
  grid = config.sweep_grid
  lams = jnp.linspace(0.0, 0.5, grid, dtype=dtype)
  # Small steps keep every grid point convergent for unit-variance inputs.
  etas = jnp.linspace(0.05, 0.3, grid, dtype=dtype)
  rows = []
  for batch in config.sweep_batches:
    task = ridge.sample_tasks(
        jax.random.key(config.seed), batch=batch, n_train=config.sweep_n_train,
        d=config.sweep_d, n_query=config.sweep_n_query, noise=0.1, dtype=dtype)
    args = (task.x, task.y, task.x_query, lams, etas)
    work = grid * batch * config.sweep_depth
    row = dict(batch=batch, grid=grid, depth=config.sweep_depth, m=form.m,
               n=form.n)
    final_w = {}
    for name, kernel in (("attention", attention), ("gd", gd)):
      compiled = kernel.lower(*args).compile()
      row[name] = time_call(lambda c=compiled: c(*args), config=config)
      row[name]["task_layers_per_s"] = work / row[name]["median_s"]
      final_w[name] = compiled(*args)
    w_attention, w_gd = final_w["attention"], final_w["gd"]
    row["max_abs_w_difference"] = float(jnp.max(jnp.abs(w_attention - w_gd)))
    row["max_abs_w"] = float(jnp.max(jnp.abs(w_gd)))
    row["gd_over_attention_time"] = (row["attention"]["median_s"] /
                                     row["gd"]["median_s"])
    rows.append(row)
  return dict(form=config.sweep_form, rows=rows)


def format_tables(results: dict[str, Any]) -> str:
  """The results as plain-text tables."""
  lines = [f"machine: {results['machine']}"]
  square = results["square_matmul"]
  lines.append(f"square matmul {square['size']}^3: {square['gflops']:.1f} GFLOP/s")
  lines.append(f"{'n':>5} {'m':>7} {'elsa ms':>9} {'GFLOP/s':>8} "
               f"{'matmul GFLOP/s':>15} {'of matmul':>9} {'quad ms':>9} "
               f"{'speedup':>8} {'elsa MiB':>9} {'quad MiB':>9}")
  for r in results["primitive"]["rows"]:
    quad = r["quadratic"]
    quad_ms = ("skipped" if "skipped" in quad
               else f"{quad['median_s'] * 1e3:.3g}")
    speedup = (f"{r['speedup_vs_quadratic']:.3g}"
               if r["speedup_vs_quadratic"] else "-")
    elsa_mib = (f"{r['elsa']['bytes'] / 2**20:.3g}"
                if r["elsa"]["bytes"] is not None else "?")
    lines.append(
        f"{r['n']:>5} {r['m']:>7} {r['elsa']['median_s'] * 1e3:>9.3g} "
        f"{r['elsa']['gflops']:>8.1f} {r['matmul']['gflops']:>15.1f} "
        f"{r['fraction_of_matmul_rate']:>9.2f} {quad_ms:>9} {speedup:>8} "
        f"{elsa_mib:>9} {quad['bytes'] / 2**20:>9.4g}")
  lines.append(f"time exponent in m: {results['primitive']['time_exponent']}")
  lines.append(f"{'kind':>9} {'depth':>6} {'lower s':>8} {'compile s':>10} "
               f"{'run ms':>9} {'us/layer':>9}")
  stack = results["stack"]
  for kind in ("scan", "unrolled"):
    for r in stack[kind]:
      lines.append(f"{kind:>9} {r['depth']:>6} {r['lower_s']:>8.3f} "
                   f"{r['compile_s']:>10.3f} {r['run']['median_s'] * 1e3:>9.3g} "
                   f"{r['layer_s'] * 1e6:>9.3g}")
  lines.append("compile time, deepest / shallowest scan: "
               f"{stack['compile_ratio_deepest_to_shallowest']:.2f}")
  if results["sweep"] is None:
    lines.append("sweep: skipped (elsa.forms not importable)")
    return "\n".join(lines)
  lines.append(f"{'batch':>6} {'grid':>5} {'depth':>6} {'attn task-layers/s':>19} "
               f"{'gd task-layers/s':>17} {'attn/gd time':>13} {'max |dw|':>9}")
  for r in results["sweep"]["rows"]:
    lines.append(
        f"{r['batch']:>6} {r['grid']:>5} {r['depth']:>6} "
        f"{r['attention']['task_layers_per_s']:>19.4g} "
        f"{r['gd']['task_layers_per_s']:>17.4g} "
        f"{r['gd_over_attention_time']:>13.3g} {r['max_abs_w_difference']:>9.2g}")
  return "\n".join(lines)


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict[str, Any]:
  """Runs every part, writes ``results.json`` and returns the results.

  A workdir that already holds results of the same config is not re-measured:
  its results are returned (pass ``overwrite`` to measure again).
  """
  common.prepare_workdir(workdir, config, overwrite=overwrite)
  path = os.path.join(workdir, "results.json")
  found = common.read_json(path)
  if found is not None and not overwrite:
    logging.info("%s holds finished results; not re-measuring.", path)
    return found
  results = dict(machine=machine(), square_matmul=square_matmul(config))
  results["primitive"] = run_primitive(config)
  results["stack"] = run_stack(config)
  results["sweep"] = run_sweep(config)
  results["load_average_after"] = list(os.getloadavg())
  common.write_json(path, results)
  return results


def main(argv):
  print(format_tables(common.run_main(argv, "benchmark", run)))


if __name__ == "__main__":
  common.define_flags("benchmark")
  app.run(main)
