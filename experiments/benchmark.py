r"""Measured speed: the ELSA primitive, deep stacks, and the sweep kernel.

  python -m experiments.benchmark --workdir=runs/benchmark

Three parts, each a list of rows in ``results.json`` and a printed table:

1. ``primitive``: ``elsa(p, h)`` under ``jit`` for ``h [m, n]``, ``k = v = n``,
   against (a) a plain ``jnp.matmul`` ``[m, n] @ [n, F]`` with the same FLOP
   count (the machine's own rate for this shape of work), and (b) the
   quadratic order ``(Q K^T) V`` of standard attention code. The FLOP count
   of one ELSA forward is

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
   (a depth-``L`` GD stack of an input form, every state decoded and compared
   with GD iterate ``t`` and with the ridge solution), on the sweep's own
   flat (lambda, eta, task) batch (``experiments.sweep.grid_items``; step
   sizes are fractions of each task's stability limit), under
   ``jax.default_matmul_precision("highest")`` as the sweep runs it. It is
   timed against direct GD (``elsa.ridge.gd``, all ``L + 1`` iterates) under
   the same ``vmap`` and shardings on the same items, and against a square
   matmul (the machine's rate), at several task batches, in items x layers
   per second (an item is one (lambda, eta, task)) and as a fraction of the
   matmul's rate on the FLOPs of its ELSA layers (:func:`layer_flops`). The
   row's ``max_rel_err`` is the kernel's own ELSA-vs-GD error: the timed work
   is the real computation.

``config.parts`` names the parts that run (:data:`PARTS`); the ``ab`` variant
(``--config=experiments/configs/benchmark.py:ab``) runs three A/B parts
instead: ``sweep_ab`` (the sweep kernel with a parameter stack per item, as
before per-item coefficients, against the kernel now, on the same items),
``small_contraction_ab`` (the per-item ``K^T V`` of those layers as a batched
dot against a multiply-and-sum) and ``contraction_ab`` (``K^T V`` at ``m >=
fit_min_tokens`` as ``einsum``, ``dot_general``, transposed and in token
blocks, alone and inside ``elsa``).

Parts 1 and 3 (and the A/B parts) run in every dtype of ``config.dtypes``.
Every ratio ("fraction of X", "speedup over Y", "X / Y time") is the median of
per-round ratios, both sides timed in the same round (:func:`time_rounds`),
reported with its spread (min and max over the rounds): on a shared machine a
ratio of two separately timed medians moves with whatever else runs. Times
are medians of the rounds after warm-up, each call ended by
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


def time_rounds(fns: dict[str, Callable[[], Any]], *,
                config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """Seconds per call of each of ``fns``, called in turn, once per round.

  After ``config.warmup`` untimed rounds, ``config.reps`` rounds run (fewer,
  but at least ``config.min_reps``, once the rounds have taken
  ``config.max_case_s``). Every call ends with ``block_until_ready``. The
  two sides of every ratio are timed in the same round, so a busy moment of
  a shared machine slows both (:func:`per_round`).
  """
  for _ in range(config.warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  spent, rounds = 0.0, 0
  while rounds < config.reps:
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
      spent += times[name][-1]
    rounds += 1
    if spent > config.max_case_s and rounds >= config.min_reps:
      break
  return {name: np.asarray(t) for name, t in times.items()}


def timing(seconds: np.ndarray) -> dict[str, float]:
  """Median, min and count of one function's per-round times."""
  return dict(median_s=float(np.median(seconds)), min_s=float(np.min(seconds)),
              reps=len(seconds))


def per_round(ratios: np.ndarray) -> dict[str, float]:
  """A ratio of two functions timed in the same rounds: the median of the
  per-round ratios and their spread (min, max)."""
  return dict(median=float(np.median(ratios)), min=float(np.min(ratios)),
              max=float(np.max(ratios)), rounds=len(ratios))


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


def square_matmul(size: int, dtype, config: ml_collections.ConfigDict
                  ) -> tuple[Callable[[], Any], int]:
  """A compiled square ``[size, size] @ [size, size]`` call and its FLOPs."""
  a = normal(np.random.default_rng(config.seed), (size, size), dtype)
  matmul = jax.jit(jnp.matmul).lower(a, a).compile()
  return (lambda: matmul(a, a)), 2 * size ** 3


def square_matmul_rate(dtype, config: ml_collections.ConfigDict
                       ) -> dict[str, Any]:
  """GFLOP/s of the square matmul of ``config.square_matmul_size``, for context.

  On the 2-core development CPU XLA runs this shape below the rate of the
  narrow ``[m, n] @ [n, F]`` matmuls, so it is not a ceiling there.
  """
  call, flops = square_matmul(config.square_matmul_size, dtype, config)
  seconds = time_rounds(dict(matmul=call), config=config)["matmul"]
  return dict(size=config.square_matmul_size, dtype=jnp.dtype(dtype).name,
              gflops=flops / np.median(seconds) / 1e9, **timing(seconds))


def primitive_row(m: int, n: int, dtype, config: ml_collections.ConfigDict
                  ) -> dict[str, Any]:
  """ELSA, the same-FLOP matmul and the quadratic order at one ``(m, n)``,
  timed in the same rounds."""
  k = v = n
  dtype = jnp.dtype(dtype)
  rng = np.random.default_rng(config.seed)
  p = random_params(rng, m=m, n=n, k=k, scale=n ** -0.5, dtype=dtype)
  h = normal(rng, (m, n), dtype)
  flops = elsa_flops(m, n, k, v)
  width = math.ceil(flops / (2 * m * n))
  b = normal(rng, (n, width), dtype)
  row = dict(m=m, n=n, k=k, v=v, dtype=dtype.name, flops=flops)

  fast = jax.jit(elsa.elsa).lower(p, h).compile()
  matmul = jax.jit(jnp.matmul).lower(h, b).compile()
  calls = dict(elsa=lambda: fast(p, h), matmul=lambda: matmul(h, b))
  slow = jax.jit(quadratic_elsa).lower(p, h).compile()
  needed = allocated_bytes(slow)
  if needed is None:  # No memory analysis: estimate the [m, m] matrix.
    needed = m * m * dtype.itemsize
  row["quadratic"] = dict(bytes=needed, flops=quadratic_flops(m, n, k, v))
  if needed > config.quadratic_budget_gib * _GIB:
    row["quadratic"]["skipped"] = (
        f"needs {needed / _GIB:.2f} GiB > budget "
        f"{config.quadratic_budget_gib} GiB")
  else:
    calls["quadratic"] = lambda: slow(p, h)

  times = time_rounds(calls, config=config)
  row["elsa"] = dict(timing(times["elsa"]), bytes=allocated_bytes(fast),
                     gflops=flops / np.median(times["elsa"]) / 1e9)
  matmul_flops = 2 * m * n * width
  row["matmul"] = dict(timing(times["matmul"]), shape=[m, n, width],
                       gflops=matmul_flops / np.median(times["matmul"]) / 1e9)
  row["fraction_of_matmul_rate"] = per_round(
      (flops / times["elsa"]) / (matmul_flops / times["matmul"]))
  if "quadratic" in times:
    row["quadratic"].update(timing(times["quadratic"]))
    row["speedup_vs_quadratic"] = per_round(times["quadratic"] / times["elsa"])
  else:
    row["speedup_vs_quadratic"] = None
  return row


def run_primitive(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 1: rows for every (dtype, n, m), and the fitted exponent per dtype and width."""
  rows, exponents = [], {}
  progress = common.Progress(
      len(config.dtypes) * len(config.widths) * len(config.tokens),
      name="primitive", unit="cases", every_s=0.0)
  for dtype in config.dtypes:
    for n in config.widths:
      for m in config.tokens:
        rows.append(primitive_row(m, n, dtype, config))
        progress.update()
      mine = [r for r in rows if r["n"] == n and r["dtype"] == dtype]
      big = [r for r in mine if r["m"] >= config.fit_min_tokens]
      exponents[f"{dtype} n={n}"] = dict(
          all_tokens=fit_exponent([r["m"] for r in mine],
                                  [r["elsa"]["median_s"] for r in mine]),
          from_fit_min_tokens=fit_exponent(
              [r["m"] for r in big], [r["elsa"]["median_s"] for r in big]))
  return dict(rows=rows, time_exponent=exponents)


def _stack_inputs(config: ml_collections.ConfigDict, depth: int):
  dtype = jnp.dtype(config.dtypes[0])
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


def _compile(fn, depth: int, config: ml_collections.ConfigDict):
  """``(compiled, lower_s, compile_s)`` of ``fn`` on abstract stack inputs.

  Compilation is timed on shapes and dtypes only, before the ``depth``
  layers of random parameters are drawn (a draw still running would slow
  the compile).
  """
  specs = jax.eval_shape(lambda: _stack_inputs(config, depth))
  start = time.perf_counter()
  # A fresh function each time, so no trace or compile cache answers.
  lowered = jax.jit(lambda p, h: fn(p, h)).lower(*specs)  # pylint: disable=unnecessary-lambda
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  return compiled, lowered_at - start, time.perf_counter() - lowered_at


def stack_rows(fn, depths, config: ml_collections.ConfigDict
               ) -> tuple[list[dict[str, Any]], np.ndarray]:
  """Compile (``compile_reps`` rounds over all depths, in turn) and run ``fn``.

  Returns a row per depth and the per-round compile times ``[reps, depths]``
  (lower + compile).
  """
  lower_s = np.zeros((config.compile_reps, len(depths)))
  compile_s = np.zeros_like(lower_s)
  compiled = {}
  for rep in range(config.compile_reps):
    for i, depth in enumerate(depths):
      compiled[depth], lower_s[rep, i], compile_s[rep, i] = _compile(
          fn, depth, config)
  rows = []
  for i, depth in enumerate(depths):
    p, h = jax.block_until_ready(_stack_inputs(config, depth))
    seconds = time_rounds(dict(run=lambda c=compiled[depth]: c(p, h)),
                          config=config)["run"]
    rows.append(dict(depth=depth, lower_s=float(np.median(lower_s[:, i])),
                     compile_s=float(np.median(compile_s[:, i])),
                     run=timing(seconds),
                     layer_s=float(np.median(seconds)) / depth))
  return rows, lower_s + compile_s


def run_stack(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 2: compile and run time of ``elsa_stack`` (and an unrolled loop)."""
  scan, compile_times = stack_rows(elsa.elsa_stack, config.stack_depths,
                                   config)
  unrolled, _ = stack_rows(_unrolled_stack, config.unrolled_depths, config)
  return dict(scan=scan, unrolled=unrolled,
              compile_ratio_deepest_to_shallowest=per_round(
                  compile_times[:, -1] / compile_times[:, 0]))


def sweep_config(config: ml_collections.ConfigDict, *, batch: int
                 ) -> ml_collections.ConfigDict:
  """The sweep config whose items (:func:`experiments.sweep.grid_items`) are timed.

  ``batch`` tasks per (lambda, eta) grid point; each ``eta`` a fraction
  (< 1) of its task's GD stability limit ``2 / (lambda_max(X^T X / N) +
  lam)``, so every item converges and the timed work is that of a stable
  sweep cell.
  """
  return ml_collections.ConfigDict(dict(
      seed=config.seed, noise=config.sweep_noise, n_train=config.sweep_n_train,
      d=config.sweep_d, n_query=config.sweep_n_query, n_tasks=batch,
      lams=tuple(config.sweep_lams), etas=tuple(config.sweep_eta_fractions),
      eta_mode="fraction"))


def layer_flops(m: int, n: int, k: int, v: int, c: int) -> int:
  """FLOPs of one ``elsa_layer`` of ``c`` components on one ``[m, n]`` item.

  Per component: the projections and their biases ``2 m n (k + v) + m (k +
  v)``, ``S = K^T V`` ``2 m k v``, its coefficients ``k v``, ``W3 S`` ``2 n k
  v`` and ``B3 S`` ``2 m k v``; once: ``h (sum_c W3_c S_c)`` ``2 m n v`` and
  the final add ``m v``. Zero entries of the weights count: this is the
  arithmetic the machine does.
  """
  per_component = (2 * m * n * (k + v) + m * (k + v) + 4 * m * k * v
                   + k * v + 2 * n * k * v)
  return c * per_component + 2 * m * n * v + m * v


def pruned_layer_flops(stack: elsa.PrunedStack) -> float:
  """FLOPs of one layer of ``stack`` on one item, the mean over its layers.

  What :class:`elsa.PrunedStack` computes: for its skips, their per-column
  scale ``2 C_s n`` and the product with ``h`` ``m n``; for its folded
  constant components, ``G a`` and ``E a`` ``2 C_c (n + m) v`` and ``h G a
  + E a`` ``2 m n v + m v``; per kept component (inner ``k'``, value ``v'``)
  the projections ``2 m n (k' + v') + m (k' + v')``, ``S`` ``2 m k' v'`` and
  its coefficients ``k' v'``, ``W3 S`` ``2 n k' v'``, ``h W3 S`` ``2 m n
  v'``, ``B3 S`` ``2 m k' v'`` and the add into the state ``m v'``.
  """
  m, n = stack.m, stack.n
  total = 0.0
  for seg in stack.segments:
    layer = 0
    if len(seg.skips):
      layer += 2 * len(seg.skips) * n + m * n
    if len(seg.constant):
      layer += 2 * len(seg.constant) * (n + m) * n + 2 * m * n * n + m * n
    for _, inner, value in seg.dynamic:
      k, v = len(inner), len(value)
      layer += (2 * m * n * (k + v) + m * (k + v) + 4 * m * k * v + k * v
                + 2 * n * k * v + 2 * m * n * v + m * v)
    total += layer * (seg.stop - seg.start)
  return total / stack.depth


def dense_basis_task(form, x, y, x_query, lam, eta, *, depth: int
                     ) -> dict[str, jax.Array]:
  """:func:`experiments.sweep.measure_task` before :func:`elsa.prune`: the
  shared basis with per-item coefficients through :func:`elsa.elsa_layer`,
  every zero multiplied. The middle side of :func:`run_sweep_ab`."""
  def layer(h, params_and_coeffs):
    params, coeffs = params_and_coeffs
    h = elsa.elsa_layer(params, h, coeffs=coeffs)
    return h, form.decode_w(h)

  h0 = form.encode(x, y, x_query=x_query)
  _, w_layers = jax.lax.scan(layer, h0, (
      form.gd_basis(depth=depth, dtype=x.dtype),
      form.gd_coefficients(lam=lam, eta=eta, depth=depth)))
  return sweep.compare_with_gd(form.decode_w(h0), w_layers, x, y, lam=lam,
                               eta=eta, depth=depth)


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


def sweep_row(form, batch: int, dtype, mesh: Mesh,
              config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The sweep kernel, direct GD and a square matmul at one task batch,
  compiled and timed in the same rounds."""
  depth, dtype = config.sweep_depth, jnp.dtype(dtype)
  # The sweep pads its chunks to a multiple of the device count the same way.
  args, n_items, padded = _sweep_args(config, batch, dtype, mesh)
  kernels = dict(sweep_kernel=sweep.build_measure(form, depth=depth, mesh=mesh),
                 gd=_gd_kernel(depth=depth, mesh=mesh))
  row = dict(batch=batch, dtype=dtype.name, grid=n_items // batch,
             items=n_items, padded_items=padded, depth=depth, m=form.m,
             n=form.n)
  calls, compile_s = {}, {}
  for name, kernel in kernels.items():
    start = time.perf_counter()
    compiled = kernel.lower(*args).compile()
    compile_s[name] = time.perf_counter() - start
    calls[name] = lambda c=compiled: c(*args)
  calls["matmul"], matmul_flops = square_matmul(config.square_matmul_size,
                                                dtype, config)
  times = time_rounds(calls, config=config)
  for name in kernels:
    row[name] = dict(compile_s=compile_s[name], **timing(times[name]))
    row[name]["item_layers_per_s"] = n_items * depth / row[name]["median_s"]
  # The kernel's own arithmetic: that of the pruned layers.
  flops = padded * depth * pruned_layer_flops(
      elsa.prune(form.gd_basis(depth=depth, dtype=dtype)))
  row["sweep_kernel"].update(flops=flops,
                             gflops=flops / row["sweep_kernel"]["median_s"] / 1e9)
  row["matmul"] = dict(size=config.square_matmul_size,
                       gflops=matmul_flops / np.median(times["matmul"]) / 1e9,
                       **timing(times["matmul"]))
  row["fraction_of_matmul_rate"] = per_round(
      (flops / times["sweep_kernel"]) / (matmul_flops / times["matmul"]))
  row["sweep_kernel_over_gd_time"] = per_round(times["sweep_kernel"] /
                                               times["gd"])
  # The kernel checks itself: ELSA iterate t against GD iterate t.
  rel_err = np.asarray(calls["sweep_kernel"]()["rel_err"])[:n_items]
  row["max_rel_err"] = float(np.max(rel_err))
  return row


def run_sweep(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 3: the sweep kernel against direct GD, at every dtype and task batch."""
  form = sweep.make_form(config.sweep_form, sweep_config(config, batch=1))
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  progress = common.Progress(len(config.dtypes) * len(config.sweep_batches),
                             name="sweep", unit="cases", every_s=0.0)
  rows = []
  # The sweep's precision: exact float32 products on GPU/TPU as on CPU.
  with jax.default_matmul_precision("highest"):
    for dtype in config.dtypes:
      for batch in config.sweep_batches:
        rows.append(sweep_row(form, batch, dtype, mesh, config))
        progress.update()
  return dict(form=config.sweep_form, lams=list(config.sweep_lams),
              eta_fractions=list(config.sweep_eta_fractions),
              devices=mesh.size, rows=rows)


# --- A/B: the sweep kernel before and after the shared GD basis -------------


def _components_first_layer(p: elsa.ElsaParams, h: jax.Array) -> jax.Array:
  """``elsa_layer`` as it was before per-item coefficients (commit 3662322):
  components first, ``K^T V`` one dot per component, no ``coeffs``."""
  per_component = lambda b: b.reshape(b.shape[:1] + (1,) * (jnp.ndim(h) - 2)
                                      + b.shape[1:])
  keys = jnp.einsum("...mn,cnk->c...mk", h, p.w1) + per_component(p.b1)
  values = jnp.einsum("...mn,cnv->c...mv", h, p.w2) + per_component(p.b2)
  s = jnp.einsum("c...mk,c...mv->c...kv", keys, values)
  return (jnp.einsum("...mn,...nv->...mv", h,
                     jnp.einsum("cnk,c...kv->...nv", p.w3, s))
          + jnp.einsum("cmk,c...kv->...mv", p.b3, s))


def per_item_stack_task(form, x, y, x_query, lam, eta, *, depth: int
                        ) -> dict[str, jax.Array]:
  """:func:`experiments.sweep.measure_task` as it was before commit 3662322:
  a parameter stack per item (``form.gd_params``), every state kept
  (``return_all``) and then decoded. The A side of :func:`run_sweep_ab`."""
  params = form.gd_params(lam=lam, eta=eta, depth=depth)
  h0 = form.encode(x, y, x_query=x_query)
  _, states = jax.lax.scan(
      lambda h, p: (_components_first_layer(p, h),) * 2, h0, params)
  return sweep.compare_with_gd(form.decode_w(h0), form.decode_w(states), x, y,
                               lam=lam, eta=eta, depth=depth)


def _sweep_args(config, batch: int, dtype, mesh: Mesh):
  """The sweep's items for ``batch`` tasks per grid point, padded and sharded
  as the sweep does it; returns ``(args, n_items, padded)``."""
  items = sweep.grid_items(sweep_config(config, batch=batch), dtype)
  n_items = len(items["lam"])
  padded = -(-n_items // mesh.size) * mesh.size
  index = np.where(np.arange(padded) < n_items, np.arange(padded), 0)
  split = NamedSharding(mesh, PartitionSpec("batch"))
  return ([jax.device_put(items[k][index], split)
           for k in ("x", "y", "x_query", "lam", "eta")], n_items, padded)


def sweep_ab_row(form, batch: int, dtype, mesh: Mesh,
                 config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Per-item stacks (A), the shared basis multiplying its zeros (B) and the
  sweep's kernel, the pruned basis (C), with a square matmul, on the same
  items, timed in the same rounds."""
  depth, dtype = config.sweep_depth, jnp.dtype(dtype)
  args, n_items, padded = _sweep_args(config, batch, dtype, mesh)
  split = NamedSharding(mesh, PartitionSpec("batch"))
  vmapped = lambda task: jax.jit(
      jax.vmap(lambda *a: task(form, *a, depth=depth)),
      in_shardings=(split,) * 5,
      out_shardings=NamedSharding(mesh, PartitionSpec()))
  kernels = dict(per_item_stacks=vmapped(per_item_stack_task),
                 shared_basis=vmapped(dense_basis_task),
                 pruned_basis=sweep.build_measure(form, depth=depth,
                                                  mesh=mesh))
  calls = {name: (lambda c=kernel.lower(*args).compile(): c(*args))
           for name, kernel in kernels.items()}
  calls["matmul"], matmul_flops = square_matmul(config.square_matmul_size,
                                                dtype, config)
  times = time_rounds(calls, config=config)
  _, c, _, k = form.gd_basis(depth=1).w1.shape  # [L, C, n, k]
  flops = dict(
      shared_basis=padded * depth * layer_flops(form.m, form.n, k, form.n, c),
      pruned_basis=padded * depth * pruned_layer_flops(
          elsa.prune(form.gd_basis(depth=depth, dtype=dtype))))
  row = dict(batch=batch, dtype=dtype.name, items=n_items, depth=depth,
             flops=flops)
  for name in kernels:
    row[name] = dict(timing(times[name]),
                     item_layers_per_s=n_items * depth
                     / float(np.median(times[name])))
  row["speedup"] = per_round(times["per_item_stacks"] / times["pruned_basis"])
  row["pruned_over_shared_speedup"] = per_round(
      times["shared_basis"] / times["pruned_basis"])
  for name in flops:
    row[f"{name}_fraction_of_matmul_rate"] = per_round(
        (flops[name] / times[name]) / (matmul_flops / times["matmul"]))
  row["matmul_gflops"] = matmul_flops / float(np.median(times["matmul"])) / 1e9
  # All three compute the same numbers: the A and B sides are the old
  # kernels, not toys.
  errors = [np.asarray(calls[name]()["rel_err"])[:n_items] for name in kernels]
  row["max_rel_err"] = float(np.max(errors[-1]))
  row["max_rel_err_difference"] = float(max(
      np.max(np.abs(e - errors[-1])) for e in errors[:-1]))
  return row


def run_sweep_ab(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """A/B of the sweep kernel: per-item parameter stacks (before commit
  3662322) against the shared GD basis with per-item coefficients (now), at
  every dtype and task batch, interleaved."""
  form = sweep.make_form(config.sweep_form, sweep_config(config, batch=1))
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  rows = []
  with jax.default_matmul_precision("highest"):
    for dtype in config.dtypes:
      for batch in config.sweep_batches:
        rows.append(sweep_ab_row(form, batch, dtype, mesh, config))
  return dict(form=config.sweep_form, rows=rows)


def _sweep_layers(form, *, depth: int, small_layout: str):
  """The ELSA layers of the sweep kernel alone (no GD or ridge reference),
  with the per-item ``K^T V`` laid out as ``small_layout``: ``(x, y, x_query,
  lam, eta) -> w [B, depth, d]``."""
  from elsa import attention  # pylint: disable=g-import-not-at-top

  def one(x, y, x_query, lam, eta):
    def layer(h, params_and_coeffs):
      params, coeffs = params_and_coeffs
      h = attention._layer(params, h, None, coeffs, small_layout=small_layout)  # pylint: disable=protected-access
      return h, form.decode_w(h)
    basis = form.gd_basis(depth=depth, dtype=x.dtype)
    coeffs = form.gd_coefficients(lam=lam, eta=eta, depth=depth)
    return jax.lax.scan(layer, form.encode(x, y, x_query=x_query),
                        (basis, coeffs))[1]
  return jax.jit(jax.vmap(one))


def run_small_contraction_ab(config: ml_collections.ConfigDict
                             ) -> dict[str, Any]:
  """A/B of the per-item ``K^T V`` of small items (the sweep's): a batched
  dot against the multiply-and-sum, in the sweep kernel's layers on its
  items, at every dtype and task batch, interleaved."""
  form = sweep.make_form(config.sweep_form, sweep_config(config, batch=1))
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  layouts = ("multiply_sum", "dot")
  rows = []
  with jax.default_matmul_precision("highest"):
    for dtype in config.dtypes:
      for batch in config.sweep_batches:
        args, n_items, _ = _sweep_args(config, batch, jnp.dtype(dtype), mesh)
        calls = {
            layout: (lambda c=_sweep_layers(
                form, depth=config.sweep_depth,
                small_layout=layout).lower(*args).compile(): c(*args))
            for layout in layouts}
        outs = [np.asarray(calls[layout]()) for layout in layouts]
        times = time_rounds(calls, config=config)
        row = dict(batch=batch, dtype=jnp.dtype(dtype).name, items=n_items,
                   dot_speedup=per_round(times["multiply_sum"] / times["dot"]),
                   max_difference=float(np.max(np.abs(outs[0] - outs[1]))
                                        / np.max(np.abs(outs[0]))))
        for layout in layouts:
          row[layout] = dict(timing(times[layout]), item_layers_per_s=(
              n_items * config.sweep_depth / float(np.median(times[layout]))))
        rows.append(row)
  return dict(form=config.sweep_form, rows=rows)


# --- A/B: layouts of the token contraction K^T V -----------------------------


def _contract_tokens(layout: str, keys: jax.Array, values: jax.Array
                     ) -> jax.Array:
  """``K^T V``, ``[k, v]`` from ``keys [m, k]`` and ``values [m, v]``, laid out as ``layout``.

  ``einsum`` (the library's, a ``dot`` contracting axis 0 of both);
  ``dot_general`` (the same dimension numbers written out); ``transposed``
  (``K`` transposed first, then a plain ``[k, m] @ [m, v]``); ``block<b>``
  (tokens in blocks of ``b``: a batched ``[m/b]`` dot of ``[b, k]^T [b, v]``,
  then a sum over blocks; ``m`` must be a multiple of ``b``).
  """
  if layout == "einsum":
    return jnp.einsum("mk,mv->kv", keys, values)
  if layout == "dot_general":
    return jax.lax.dot_general(keys, values, (((0,), (0,)), ((), ())))
  if layout == "transposed":
    return jnp.matmul(jnp.transpose(keys), values)
  block = int(layout.removeprefix("block"))
  m = keys.shape[0]
  return jnp.einsum("cbk,cbv->ckv", keys.reshape(m // block, block, -1),
                    values.reshape(m // block, block, -1)).sum(0)


def _elsa_with(layout: str):
  """``elsa.elsa`` (the library's evaluation order) with ``K^T V`` as ``layout``."""
  def forward(p, h):
    kv = _contract_tokens(layout, h @ p.w1 + p.b1, h @ p.w2 + p.b2)
    return h @ (p.w3 @ kv) + p.b3 @ kv
  return forward


def contraction_layouts(m: int, config: ml_collections.ConfigDict
                        ) -> list[str]:
  """The layouts tried at ``m`` tokens: blocks only where they divide ``m``."""
  return ["einsum", "dot_general", "transposed"] + [
      f"block{b}" for b in config.contraction_blocks if m % b == 0 and b < m]


def contraction_ab_row(m: int, n: int, dtype, config: ml_collections.ConfigDict
                       ) -> dict[str, Any]:
  """Every layout of ``K^T V``, alone (against ``[m, n] @ [n, n]``, the same
  FLOPs) and inside ``elsa`` (against the same-FLOP matmul and against the
  library's ``elsa``), timed in the same rounds."""
  dtype = jnp.dtype(dtype)
  rng = np.random.default_rng(config.seed)
  p = random_params(rng, m=m, n=n, k=n, scale=n ** -0.5, dtype=dtype)
  h, keys, values = (normal(rng, (m, n), dtype) for _ in range(3))
  square = normal(rng, (n, n), dtype)
  flops = elsa_flops(m, n, n, n)
  width = math.ceil(flops / (2 * m * n))
  wide = normal(rng, (n, width), dtype)
  compile_ = lambda f, *a: (lambda c=jax.jit(f).lower(*a).compile(): c(*a))
  layouts = contraction_layouts(m, config)
  calls = dict(library=compile_(elsa.elsa, p, h),
               matmul=compile_(jnp.matmul, h, wide),
               matmul_square=compile_(jnp.matmul, keys, square))
  reference = np.asarray(elsa.elsa(p, h))
  for layout in layouts:
    calls[f"elsa_{layout}"] = compile_(_elsa_with(layout), p, h)
    calls[f"kv_{layout}"] = compile_(
        lambda a, b, layout=layout: _contract_tokens(layout, a, b), keys,
        values)
    got = np.asarray(calls[f"elsa_{layout}"]())
    error = np.max(np.abs(got - reference)) / np.max(np.abs(reference))
    if not error < (1e-4 if dtype == jnp.float32 else 1e-10):
      raise AssertionError(f"layout {layout}: relative difference {error}")
  times = time_rounds(calls, config=config)
  rate = lambda name, f: f / times[name]
  row = dict(m=m, n=n, dtype=dtype.name, layouts=layouts,
             library_fraction_of_matmul_rate=per_round(
                 rate("library", flops) / rate("matmul", 2 * m * n * width)))
  for layout in layouts:
    row[layout] = dict(
        kv_fraction_of_matmul_rate=per_round(
            times["matmul_square"] / times[f"kv_{layout}"]),
        elsa_fraction_of_matmul_rate=per_round(
            rate(f"elsa_{layout}", flops) / rate("matmul", 2 * m * n * width)),
        elsa_speedup_over_library=per_round(
            times["library"] / times[f"elsa_{layout}"]))
  return row


def run_contraction_ab(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """A/B of the layouts of ``K^T V`` at every dtype, width and ``m >=
  fit_min_tokens``, interleaved."""
  return dict(rows=[contraction_ab_row(m, n, dtype, config)
                    for dtype in config.dtypes for n in config.widths
                    for m in config.tokens if m >= config.fit_min_tokens])


def _spread(ratio: dict[str, float] | None) -> str:
  """``median [min-max]`` of a per-round ratio, or ``-``."""
  if ratio is None:
    return "-"
  return f"{ratio['median']:.3g} [{ratio['min']:.3g}-{ratio['max']:.3g}]"


def format_tables(results: dict[str, Any]) -> str:
  """The results as plain-text tables; ratios as ``median [min-max]`` over rounds."""
  lines = [f"machine: {results['machine']}"]
  for square in results["square_matmul"]:
    lines.append(f"square matmul {square['size']}^3 {square['dtype']}: "
                 f"{square['gflops']:.1f} GFLOP/s")
  tables = dict(primitive=_primitive_table, stack=_stack_table,
                sweep=_sweep_table, sweep_ab=_sweep_ab_table,
                small_contraction_ab=_small_contraction_ab_table,
                contraction_ab=_contraction_ab_table)
  for part, table in tables.items():
    if part in results:
      lines.extend(table(results[part]))
  return "\n".join(lines)


def _primitive_table(part: dict[str, Any]) -> list[str]:
  lines = []
  lines.append(f"{'dtype':>8} {'n':>5} {'m':>7} {'elsa ms':>9} {'GFLOP/s':>8} "
               f"{'matmul GFLOP/s':>15} {'of matmul rate':>20} {'quad ms':>9} "
               f"{'speedup':>20} {'elsa MiB':>9} {'quad MiB':>9}")
  for r in part["rows"]:
    quad = r["quadratic"]
    quad_ms = ("skipped" if "skipped" in quad
               else f"{quad['median_s'] * 1e3:.3g}")
    elsa_mib = (f"{r['elsa']['bytes'] / 2**20:.3g}"
                if r["elsa"]["bytes"] is not None else "?")
    lines.append(
        f"{r['dtype']:>8} {r['n']:>5} {r['m']:>7} "
        f"{r['elsa']['median_s'] * 1e3:>9.3g} "
        f"{r['elsa']['gflops']:>8.1f} {r['matmul']['gflops']:>15.1f} "
        f"{_spread(r['fraction_of_matmul_rate']):>20} {quad_ms:>9} "
        f"{_spread(r['speedup_vs_quadratic']):>20} "
        f"{elsa_mib:>9} {quad['bytes'] / 2**20:>9.4g}")
  lines.append(f"time exponent in m: {part['time_exponent']}")
  return lines


def _stack_table(stack: dict[str, Any]) -> list[str]:
  lines = []
  lines.append(f"{'kind':>9} {'depth':>6} {'lower s':>8} {'compile s':>10} "
               f"{'run ms':>9} {'us/layer':>9}")
  for kind in ("scan", "unrolled"):
    for r in stack[kind]:
      lines.append(f"{kind:>9} {r['depth']:>6} {r['lower_s']:>8.3f} "
                   f"{r['compile_s']:>10.3f} {r['run']['median_s'] * 1e3:>9.3g} "
                   f"{r['layer_s'] * 1e6:>9.3g}")
  lines.append("compile time, deepest / shallowest scan: "
               f"{_spread(stack['compile_ratio_deepest_to_shallowest'])}")
  return lines


def _sweep_table(part: dict[str, Any]) -> list[str]:
  lines = []
  lines.append(f"sweep kernel ({part['form']} form) vs direct GD:")
  lines.append(f"{'dtype':>8} {'batch':>6} {'grid':>5} {'depth':>6} "
               f"{'sweep item-layers/s':>20} {'GFLOP/s':>8} "
               f"{'of matmul rate':>20} {'gd item-layers/s':>17} "
               f"{'sweep/gd time':>20} {'max rel_err':>12}")
  for r in part["rows"]:
    lines.append(
        f"{r['dtype']:>8} {r['batch']:>6} {r['grid']:>5} {r['depth']:>6} "
        f"{r['sweep_kernel']['item_layers_per_s']:>20.4g} "
        f"{r['sweep_kernel']['gflops']:>8.1f} "
        f"{_spread(r['fraction_of_matmul_rate']):>20} "
        f"{r['gd']['item_layers_per_s']:>17.4g} "
        f"{_spread(r['sweep_kernel_over_gd_time']):>20} "
        f"{r['max_rel_err']:>12.2g}")
  return lines


def _sweep_ab_table(part: dict[str, Any]) -> list[str]:
  lines = [f"sweep kernel A/B ({part['form']} form): per-item parameter "
           "stacks (A), shared GD basis (B), pruned shared basis (C, the "
           "sweep's)",
           f"{'dtype':>8} {'batch':>6} {'A item-layers/s':>16} "
           f"{'B item-layers/s':>16} {'C item-layers/s':>16} "
           f"{'C over A':>22} {'C over B':>22} {'B of matmul rate':>22} "
           f"{'C of matmul rate':>22} {'max |diff| rel_err':>18}"]
  for r in part["rows"]:
    lines.append(
        f"{r['dtype']:>8} {r['batch']:>6} "
        f"{r['per_item_stacks']['item_layers_per_s']:>16.4g} "
        f"{r['shared_basis']['item_layers_per_s']:>16.4g} "
        f"{r['pruned_basis']['item_layers_per_s']:>16.4g} "
        f"{_spread(r['speedup']):>22} "
        f"{_spread(r['pruned_over_shared_speedup']):>22} "
        f"{_spread(r['shared_basis_fraction_of_matmul_rate']):>22} "
        f"{_spread(r['pruned_basis_fraction_of_matmul_rate']):>22} "
        f"{r['max_rel_err_difference']:>18.2g}")
  return lines


def _small_contraction_ab_table(part: dict[str, Any]) -> list[str]:
  lines = [f"per-item K^T V of the sweep's layers ({part['form']} form): "
           "batched dot vs multiply-and-sum",
           f"{'dtype':>8} {'batch':>6} {'multiply_sum item-layers/s':>27} "
           f"{'dot item-layers/s':>18} {'dot speedup':>22} {'difference':>11}"]
  for r in part["rows"]:
    lines.append(f"{r['dtype']:>8} {r['batch']:>6} "
                 f"{r['multiply_sum']['item_layers_per_s']:>27.4g} "
                 f"{r['dot']['item_layers_per_s']:>18.4g} "
                 f"{_spread(r['dot_speedup']):>22} "
                 f"{r['max_difference']:>11.2g}")
  return lines


def _contraction_ab_table(part: dict[str, Any]) -> list[str]:
  lines = ["K^T V layouts: fraction of the matmul rate, alone (kv) and in "
           "elsa; elsa speedup over the library's"]
  for r in part["rows"]:
    lines.append(f"{r['dtype']} n={r['n']} m={r['m']}: library elsa "
                 f"{_spread(r['library_fraction_of_matmul_rate'])}")
    for layout in r["layouts"]:
      got = r[layout]
      lines.append(
          f"  {layout:>12}: kv {_spread(got['kv_fraction_of_matmul_rate'])}, "
          f"elsa {_spread(got['elsa_fraction_of_matmul_rate'])}, speedup "
          f"{_spread(got['elsa_speedup_over_library'])}")
  return lines


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, in one line naming the field.

  Raises:
    experiments.common.ConfigError: a field outside its range, a NaN or inf,
      an empty list of sizes, or arrays that would not fit in memory.
  """
  common.check_seed(config)
  common.check_items(config, "parts", choices=tuple(PARTS))
  common.check_items(config, "dtypes", choices=("float32", "float64"))
  common.check_int(config, "warmup", low=0)
  common.check_int(config, "reps")
  common.check_int(config, "min_reps", high=config.reps)
  common.check_float(config, "max_case_s", low=0, low_open=True)
  for field in ("tokens", "widths", "stack_depths", "sweep_batches"):
    common.check_items(config, field, integer=True, low=1)
  common.check_items(config, "unrolled_depths", integer=True, low=1,
                     allow_empty=True)
  common.check_items(config, "contraction_blocks", integer=True, low=1)
  for field in ("fit_min_tokens", "square_matmul_size", "stack_tokens",
                "stack_width", "stack_components", "compile_reps",
                "sweep_n_train", "sweep_d", "sweep_n_query", "sweep_depth"):
    common.check_int(config, field)
  common.check_float(config, "quadratic_budget_gib", low=0)
  common.check_float(config, "sweep_noise", low=0)
  common.check_choice(config, "sweep_form", ("designed", "natural"))
  common.check_items(config, "sweep_lams", low=0)
  common.check_items(config, "sweep_eta_fractions", low=0, high=1,
                     low_open=True, high_open=True)
  itemsize = max(jnp.dtype(d).itemsize for d in config.dtypes)
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
  # Part 3 and its A/B: the sweep's own estimate for the largest batch, run
  # as one chunk.
  sweep_run = sweep_config(config, batch=max(config.sweep_batches))
  sweep_run.update(forms=(config.sweep_form,), depth=config.sweep_depth,
                   chunk_size=sweep._n_items(sweep_run),  # pylint: disable=protected-access
                   dtype=max(config.dtypes, key=lambda d: jnp.dtype(d).itemsize))
  common.check_fits(sweep.bytes_needed(sweep_run),
                    fields="sweep_batches, sweep_n_train, sweep_d, "
                           "sweep_n_query, sweep_depth and the sweep grid")


# What config.parts may name.
PARTS = dict(primitive=run_primitive, stack=run_stack, sweep=run_sweep,
             sweep_ab=run_sweep_ab,
             small_contraction_ab=run_small_contraction_ab,
             contraction_ab=run_contraction_ab)


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict[str, Any]:
  """Runs the parts of ``config.parts``, writes ``results.json`` and returns the results.

  A workdir that already holds results of the same config is not re-measured:
  its results are returned. ``overwrite`` (as for every driver) first deletes
  what an earlier benchmark wrote in ``workdir``, so everything is measured
  again. With float64 in ``config.dtypes``, ``jax_enable_x64`` is on inside
  the run and restored after it.

  Raises:
    experiments.common.ConfigError: the config cannot run (nothing written).
    experiments.common.WorkdirInUse: another run holds ``workdir``, or it
      holds a different config and ``overwrite`` is off.
  """
  validate(config)
  x64 = "float64" if "float64" in config.dtypes else "float32"
  with common.float_dtype_enabled(x64), common.claim_workdir(
      workdir, config, overwrite=overwrite) as wd:
    return wd.results(lambda: _measure(config), name="benchmark")


def _measure(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The results dict: the machine, its square-matmul rates, every part."""
  results = dict(machine=machine(), square_matmul=[
      square_matmul_rate(dtype, config) for dtype in config.dtypes])
  for part in config.parts:
    logging.info("benchmark: part %s", part)
    results[part] = PARTS[part](config)
  results["load_average_after"] = list(os.getloadavg())
  return results


def main(argv):
  print(format_tables(common.run_main(argv, "benchmark", run)))


if __name__ == "__main__":
  common.define_flags("benchmark")
  app.run(main)
