r"""Measured speed: the ELSA primitive, deep stacks, and the sweep kernel.

  python -m experiments.benchmark --workdir=runs/benchmark

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
3. ``sweep``: the sweep's own kernel, ``experiments.sweep.build_measure``
   (a depth-``L`` GD stack of an input form run with ``return_all``, every
   state decoded and compared with GD iterate ``t`` and with the ridge
   solution), on a flat (lambda, eta, task) batch laid out as the sweep's
   (``experiments.sweep._grid_items``: step sizes are fractions of each
   task's stability limit), under
   ``jax.default_matmul_precision("highest")`` as the sweep runs it. It is
   timed against direct GD (``elsa.ridge.gd``, all ``L + 1`` iterates) under
   the same ``vmap`` and shardings on the same items, at several task batches,
   in items x layers per second (an item is one (lambda, eta, task)). The row's ``max_rel_err`` is the kernel's
   own ELSA-vs-GD error: the timed work is the real computation.

Times are medians of several calls after warm-up (if any), each call ended by
``block_until_ready``. The platform, device and CPU load are recorded.
"""

from __future__ import annotations

import math
import os
import platform
import time
from typing import Any, Callable

from absl import app
from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import ml_collections
import numpy as np

import elsa
from elsa import ridge
from experiments import common
from experiments import sweep

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


def normal(rng: np.random.Generator, shape, dtype, *, scale: float = 1.0
           ) -> jax.Array:
  """``scale`` times standard normal ``shape``, drawn by numpy.

  ``jax.random`` would compile a sampling kernel for every new shape: seconds
  on a loaded CPU, for numbers whose values do not matter to a timing.
  """
  return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def random_params(rng: np.random.Generator, *, m: int, n: int, k: int,
                  lead: tuple[int, ...] = (), scale: float, dtype
                  ) -> elsa.ElsaParams:
  """Normal ``ElsaParams`` (``v = n``) with leaves ``[*lead, ...]``, std ``scale``."""
  shapes = jax.eval_shape(lambda: elsa.ElsaParams.zeros(
      m=m, n=n, k=k, v=n, lead=lead, dtype=dtype))
  return elsa.ElsaParams(*(normal(rng, leaf.shape, dtype, scale=scale)
                           for leaf in shapes))


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
  a = normal(np.random.default_rng(config.seed), (s, s), dtype)
  matmul = jax.jit(jnp.matmul).lower(a, a).compile()
  timing = time_call(lambda: matmul(a, a), config=config)
  return dict(size=s, gflops=2 * s ** 3 / timing["median_s"] / 1e9, **timing)


def primitive_row(m: int, n: int, config: ml_collections.ConfigDict
                  ) -> dict[str, Any]:
  """ELSA, the same-FLOP matmul and the quadratic order at one ``(m, n)``."""
  k = v = n
  dtype = jnp.dtype(config.dtype)
  rng = np.random.default_rng(config.seed)
  p = random_params(rng, m=m, n=n, k=k, scale=n ** -0.5, dtype=dtype)
  h = normal(rng, (m, n), dtype)
  flops = elsa_flops(m, n, k, v)
  row = dict(m=m, n=n, k=k, v=v, flops=flops)

  fast = jax.jit(elsa.elsa).lower(p, h).compile()
  row["elsa"] = time_call(lambda: fast(p, h), config=config)
  row["elsa"]["bytes"] = allocated_bytes(fast)
  row["elsa"]["gflops"] = flops / row["elsa"]["median_s"] / 1e9

  width = math.ceil(flops / (2 * m * n))
  b = normal(rng, (n, width), dtype)
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
  rng = np.random.default_rng(config.seed)
  # Small weights keep a deep cubic map from overflowing; speed is the point.
  p = random_params(rng, m=m, n=n, k=n, lead=(depth, c), scale=0.1 / n,
                    dtype=dtype)
  return p, normal(rng, (m, n), dtype)


def _unrolled_stack(p: elsa.ElsaParams, h: jax.Array) -> jax.Array:
  for layer in range(p.w1.shape[0]):
    h = elsa.elsa_layer(jax.tree.map(lambda leaf, i=layer: leaf[i], p), h)
  return h


def stack_row(depth: int, fn, config: ml_collections.ConfigDict
              ) -> dict[str, Any]:
  """Lower, compile (median of ``compile_reps``) and run ``fn`` at one depth.

  Compilation is timed on abstract inputs (shapes and dtypes only), before
  the ``depth`` layers of random parameters are drawn.
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
  progress = common.Progress(
      len(config.stack_depths) + len(config.unrolled_depths), name="stack",
      unit="depths", every_s=0.0)
  rows = dict(scan=[], unrolled=[])
  for kind, fn, depths in (("scan", elsa.elsa_stack, config.stack_depths),
                           ("unrolled", _unrolled_stack,
                            config.unrolled_depths)):
    for depth in depths:
      rows[kind].append(stack_row(depth, fn, config))
      progress.update()
  first, last = rows["scan"][0], rows["scan"][-1]
  return dict(**rows, compile_ratio_deepest_to_shallowest=(
                  (last["lower_s"] + last["compile_s"]) /
                  (first["lower_s"] + first["compile_s"])))


def sweep_items(config: ml_collections.ConfigDict, *, batch: int, dtype
                ) -> dict[str, np.ndarray]:
  """The flat (lam, eta, task) batch of ``experiments.sweep`` for ``batch`` tasks.

  The layout of the sweep's own items: ``x [G, N, d]``, ``y [G, N]``,
  ``x_query [G, Q, d]``, ``lam [G]``, ``eta [G]`` with ``G = len(lams) *
  len(eta_fractions) * batch``; each ``eta`` is a fraction (< 1) of its
  task's GD stability limit ``2 / (lambda_max(X^T X / N) + lam)``, so every
  item converges and the timed work is the work of a stable sweep cell.
  """
  rng = np.random.default_rng(config.seed)
  n, d, q = config.sweep_n_train, config.sweep_d, config.sweep_n_query
  # Random linear tasks y = x w + 0.1 eps (as ridge.sample_tasks draws them).
  x = rng.standard_normal((batch, n, d))
  y = np.einsum("bnd,bd->bn", x, rng.standard_normal((batch, d)))
  y += 0.1 * rng.standard_normal((batch, n))
  x_query = rng.standard_normal((batch, q, d))
  lams = np.asarray(config.sweep_lams, np.float64)
  fractions = np.asarray(config.sweep_eta_fractions, np.float64)
  top = np.linalg.eigvalsh(np.swapaxes(x, 1, 2) @ x / n)[:, -1]  # [batch]
  limit = 2 / (top[None, :] + lams[:, None])  # [lams, batch]
  shape = (len(lams), len(fractions), batch)
  task_index = np.broadcast_to(np.arange(batch), shape).reshape(-1)
  items = dict(x=x[task_index], y=y[task_index], x_query=x_query[task_index],
               lam=np.broadcast_to(lams[:, None, None], shape).reshape(-1),
               eta=(fractions[None, :, None] * limit[:, None, :]).reshape(-1))
  return {k: v.astype(dtype) for k, v in items.items()}


def _gd_kernel(*, depth: int, mesh: Mesh):
  """Direct GD on the sweep's items: ``ridge.gd`` under the sweep's vmap and
  shardings; ``(x, y, x_query, lam, eta) -> [B, depth + 1, d]`` iterates."""
  split = NamedSharding(mesh, PartitionSpec("batch"))

  def gd(x, y, x_query, lam, eta):
    del x_query  # GD does not look at the queries.
    one = lambda x, y, lam, eta: ridge.gd(x, y, lam=lam, eta=eta, steps=depth)
    return jax.vmap(one)(x, y, lam, eta)

  return jax.jit(gd, in_shardings=(split,) * 5,
                 out_shardings=NamedSharding(mesh, PartitionSpec()))


def sweep_row(form, batch: int, mesh: Mesh, config: ml_collections.ConfigDict
              ) -> dict[str, Any]:
  """The sweep kernel and direct GD at one task batch, compiled and timed."""
  depth = config.sweep_depth
  items = sweep_items(config, batch=batch, dtype=jnp.dtype(config.dtype))
  n_items = len(items["lam"])
  # The sweep pads its chunks to a multiple of the device count the same way.
  padded = -(-n_items // mesh.size) * mesh.size
  index = np.where(np.arange(padded) < n_items, np.arange(padded), 0)
  split = NamedSharding(mesh, PartitionSpec("batch"))
  args = [jax.device_put(items[k][index], split)
          for k in ("x", "y", "x_query", "lam", "eta")]
  kernels = dict(sweep_kernel=sweep.build_measure(form, depth=depth, mesh=mesh),
                 gd=_gd_kernel(depth=depth, mesh=mesh))
  row = dict(batch=batch, grid=n_items // batch, items=n_items,
             padded_items=padded, depth=depth, m=form.m, n=form.n)
  for name, kernel in kernels.items():
    start = time.perf_counter()
    compiled = kernel.lower(*args).compile()
    row[name] = dict(compile_s=time.perf_counter() - start,
                     **time_call(lambda c=compiled: c(*args), config=config))
    row[name]["item_layers_per_s"] = (n_items * depth /
                                      row[name]["median_s"])
    if name == "sweep_kernel":
      # The kernel checks itself: ELSA iterate t against GD iterate t.
      rel_err = np.asarray(compiled(*args)["rel_err"])[:n_items]
      row["max_rel_err"] = float(np.max(rel_err))
  row["sweep_kernel_over_gd_time"] = (row["sweep_kernel"]["median_s"] /
                                      row["gd"]["median_s"])
  return row


def run_sweep(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 3: the sweep kernel against direct GD, at every task batch."""
  form = sweep.make_form(config.sweep_form, ml_collections.ConfigDict(dict(
      n_train=config.sweep_n_train, d=config.sweep_d,
      n_query=config.sweep_n_query)))
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  progress = common.Progress(len(config.sweep_batches), name="sweep",
                             unit="cases", every_s=0.0)
  rows = []
  # The sweep's precision: exact float32 products on GPU/TPU as on CPU.
  with jax.default_matmul_precision("highest"):
    for batch in config.sweep_batches:
      rows.append(sweep_row(form, batch, mesh, config))
      progress.update()
  return dict(form=config.sweep_form, lams=list(config.sweep_lams),
              eta_fractions=list(config.sweep_eta_fractions),
              devices=mesh.size, rows=rows)


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
  lines.append(f"sweep kernel ({results['sweep']['form']} form) vs direct GD:")
  lines.append(f"{'batch':>6} {'grid':>5} {'depth':>6} "
               f"{'sweep item-layers/s':>20} {'gd item-layers/s':>17} "
               f"{'sweep/gd time':>14} {'max rel_err':>12}")
  for r in results["sweep"]["rows"]:
    lines.append(
        f"{r['batch']:>6} {r['grid']:>5} {r['depth']:>6} "
        f"{r['sweep_kernel']['item_layers_per_s']:>20.4g} "
        f"{r['gd']['item_layers_per_s']:>17.4g} "
        f"{r['sweep_kernel_over_gd_time']:>14.3g} {r['max_rel_err']:>12.2g}")
  return "\n".join(lines)


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, in one line naming the field.

  Raises:
    experiments.common.ConfigError: a field outside its range, a NaN or inf,
      an empty list of sizes, or arrays that would not fit in memory.
  """
  common.check_int(config, "seed", low=0)
  common.check_choice(config, "dtype", ("float32", "float64"))
  common.check_int(config, "warmup", low=0)
  common.check_int(config, "reps")
  common.check_int(config, "min_reps", high=config.reps)
  common.check_float(config, "max_case_s", low=0, low_open=True)
  for field in ("tokens", "widths", "stack_depths", "sweep_batches"):
    common.check_items(config, field, integer=True, low=1)
  common.check_items(config, "unrolled_depths", integer=True, low=1,
                     allow_empty=True)
  for field in ("fit_min_tokens", "square_matmul_size", "stack_tokens",
                "stack_width", "stack_components", "compile_reps",
                "sweep_n_train", "sweep_d", "sweep_n_query", "sweep_depth"):
    common.check_int(config, field)
  common.check_float(config, "quadratic_budget_gib", low=0)
  common.check_choice(config, "sweep_form", ("designed", "natural"))
  common.check_items(config, "sweep_lams", low=0)
  common.check_items(config, "sweep_eta_fractions", low=0, high=1,
                     low_open=True, high_open=True)
  itemsize = jnp.dtype(config.dtype).itemsize
  m, n = max(config.tokens), max(config.widths)
  stack = max(config.stack_depths + config.unrolled_depths)
  # Part 1: h, the outputs and the weights; part 2: the stack's parameters;
  # the square matmul; a few copies each.
  common.check_fits(
      3 * itemsize * (4 * m * n + 4 * n * n
                      + stack * config.stack_components * 6
                      * (config.stack_tokens + config.stack_width)
                      * config.stack_width
                      + 3 * config.square_matmul_size ** 2),
      fields="tokens, widths, stack_* and square_matmul_size")


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict[str, Any]:
  """Runs every part, writes ``results.json`` and returns the results.

  A workdir that already holds results of the same config is not re-measured:
  its results are returned. ``overwrite`` (as for every driver) first deletes
  what an earlier benchmark wrote in ``workdir``, so everything is measured
  again. ``config.dtype = "float64"`` turns on ``jax_enable_x64`` inside.

  Raises:
    experiments.common.ConfigError: the config cannot run (nothing written).
    experiments.common.WorkdirInUse: another run holds ``workdir``, or it
      holds a different config and ``overwrite`` is off.
  """
  validate(config)
  with common.float_dtype_enabled(config.dtype), common.claim_workdir(
      workdir, config, overwrite=overwrite) as wd:
    found = wd.read_json("results.json")
    if found is not None:
      logging.info("%s holds finished results; not re-measuring.",
                   wd.path("results.json"))
      return found
    results = dict(machine=machine(), square_matmul=square_matmul(config))
    results["primitive"] = run_primitive(config)
    results["stack"] = run_stack(config)
    results["sweep"] = run_sweep(config)
    results["load_average_after"] = list(os.getloadavg())
    wd.write_json("results.json", results)
  return results


def main(argv):
  print(format_tables(common.run_main(argv, "benchmark", run)))


if __name__ == "__main__":
  common.define_flags("benchmark")
  app.run(main)
