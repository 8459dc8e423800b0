r"""Measured speed: the ELSA primitive, deep stacks, the sweep kernel, the training step, causal ELSA, the transformer.

  python -m experiments.benchmark --workdir=runs/benchmark

Six parts, each a list of rows in ``results.json`` and a printed table:

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
   matmul's rate on the FLOPs of its pruned ELSA layers
   (:func:`pruned_layer_flops`). The row's ``max_rel_err`` is the kernel's
   own ELSA-vs-GD error: the timed work is the real computation.
4. ``train``: the training step of the train driver
   (:func:`elsa.training.train_step_on_batch`) against a plain reference of
   the same model written here with ``jnp.einsum`` (:func:`reference_forward`,
   in the ``(Q K^T) V`` order of attention code), the same loss,
   ``jax.value_and_grad`` and the same optax chain, float32, on the same
   drawn batch: both sides take parameters, optimiser state and batch, and
   neither draws (``update_ratio``). The draw of one batch
   (:func:`elsa.training.sample_tasks`, which the driver does once per step
   for all grid points) is timed beside them. Cases: von Oswald et al.'s
   task and model (``configs/train.py:vonoswald``) at several depths, and
   the default train config's ELSA stack. FLOPs per call are XLA's cost
   analysis of each compiled function; each row checks that both sides give
   the same loss and gradient.
5. ``causal``: ``elsa(p, h, causal=True)`` (by chunks, ``O(m)`` memory)
   against the masked quadratic order of attention code,
   ``(tril * Q K^T) V`` (run only where it fits ``quadratic_budget_gib``),
   and against the non-causal ``elsa(p, h)``, at several ``m`` with the
   default chunk; then the chunk swept at one ``m``. Each row checks the
   causal output against the masked quadratic one (``max_rel_err``).
6. ``transformer``: one training step (forward, backward, Adam) of
   :class:`elsa.nn.Transformer` on Garg et al.'s interleaved prompts with
   the prefix-averaged loss (:func:`elsa.training.prefix_loss`), for each
   attention kind (``elsa``, ``lsa``, ``softmax``; nothing else differs),
   timed in the same rounds, at several prompt lengths; the ratios are to
   the softmax step.

``config.parts`` names the parts that run (:data:`PARTS`). Parts 1 and 3 run
in every dtype of ``config.dtypes``, part 2 in the first, parts 4-6 in
float32.
Every ratio ("fraction of X", "speedup over Y", "X / Y time") is the median of
per-round ratios, both sides timed in the same round (:func:`time_rounds`),
reported with its spread (min and max over the rounds): on a shared machine a
ratio of two separately timed medians moves with whatever else runs. Times
are medians of the rounds after warm-up, each call ended by
``block_until_ready``. The platform, device and CPU load are recorded.
"""

from __future__ import annotations

import functools
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
import optax

from flax import nnx

import elsa
from elsa import nn
from elsa import ridge
from elsa import training
from experiments import checks
from experiments import cli
from experiments import sweep
from experiments import train
from experiments import workdirs
from experiments.configs import train as train_configs

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


def quadratic_memory(compiled, estimate: int,
                     config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``{"bytes": ...}`` a compiled quadratic-order call allocates
  (:func:`allocated_bytes`, else ``estimate``), with ``"skipped"`` saying
  why where that exceeds ``config.quadratic_budget_gib`` (it is not run)."""
  needed = allocated_bytes(compiled)
  needed = estimate if needed is None else needed
  out = dict(bytes=needed)
  if needed > config.quadratic_budget_gib * _GIB:
    out["skipped"] = (f"needs {needed / _GIB:.2f} GiB > budget "
                      f"{config.quadratic_budget_gib} GiB")
  return out


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
  # Without a memory analysis: the [m, m] matrix.
  row["quadratic"] = dict(quadratic_memory(slow, m * m * dtype.itemsize,
                                           config),
                          flops=quadratic_flops(m, n, k, v))
  if "skipped" not in row["quadratic"]:
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
  progress = cli.Progress(
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
  progress = cli.Progress(len(config.dtypes) * len(config.sweep_batches),
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


# --- Part 4: the training step against a plain reference ---------------------


def train_cases(config: ml_collections.ConfigDict
                ) -> list[tuple[str, int, ml_collections.ConfigDict]]:
  """``(model, depth, train config)`` of every case of part 4.

  Von Oswald et al.'s task (``configs/train.py:vonoswald``: masked LSA with
  the residual, one head, weights tied) at every depth of
  ``config.train_lsa_depths``, and the default config's ELSA stack at
  ``config.train_elsa_depth``; each at its own batch from ``config``.
  """
  vonoswald = train_configs.get_config("vonoswald")
  vonoswald.batch = config.train_lsa_batch
  default = train_configs.get_config()
  default.batch = config.train_elsa_batch
  return ([("lsa_residual_trained", depth, vonoswald)
           for depth in config.train_lsa_depths]
          + [("elsa_trained", config.train_elsa_depth, default)])


def _train_spec(c) -> training.TaskSpec:
  """The tasks of train config ``c`` (as the train driver draws them)."""
  return training.TaskSpec(n_train=c.n_train, d=c.d, n_query=c.n_query,
                           lam=c.lam, noise=c.noise, x_scale=c.x_scale,
                           x_dist=c.x_dist, tokens=c.tokens)


def _train_setup(name: str, depth: int, train_config):
  """The model, task spec and optimiser the train driver builds for the first
  point of its grid (first learning rate and init scale)."""
  c = train_config
  spec = _train_spec(c)
  switches = train.MODELS[name]
  model = training.init_model(
      jax.random.fold_in(jax.random.key(c.seed), depth), spec, depth=depth, components=c.components,
      inner=c.inner, tied=c.tied, scale=c.init_scales[0],
      skip_init=switches["use_bias"] and c.skip_init, dtype=jnp.float32,
      **switches)
  tx = training.optimizer(learning_rate=c.learning_rates[0], steps=c.steps,
                          warmup_steps=c.warmup_steps,
                          end_fraction=c.end_fraction, clip_norm=c.clip_norm)
  return model, spec, tx


def reference_forward(params: dict[str, jax.Array], h: jax.Array, *,
                      depth: int, residual: bool, key_mask) -> jax.Array:
  """The stack written out with ``jnp.einsum``, in the order of attention code.

  ``params``: leaves ``[L, C, ...]`` (``[1, C, ...]`` for tied weights,
  looped ``depth`` times), ``b1, b2, b3`` absent for LSA; ``h [B, m, n]``;
  ``key_mask [m]`` or ``None``. Layer ``t``: ``out = sum_c (Q_c K_c^T) V_c``
  with ``Q = h W3 + B3``, ``K = diag(mask) (h W1 + B1)``, ``V = h W2 + B2``,
  then ``h <- h + out`` (residual) or ``h <- out``.
  """
  ein = jnp.einsum
  for t in range(depth):
    layer = {name: leaf[min(t, leaf.shape[0] - 1)]
             for name, leaf in params.items()}
    out = 0
    for c in range(layer["w1"].shape[0]):
      part = lambda w, b: ein("bmn,nk->bmk", h, layer[w][c]) + (
          layer[b][c] if b in layer else 0)
      q, k, v = part("w3", "b3"), part("w1", "b1"), part("w2", "b2")
      if key_mask is not None:
        k = k * key_mask[:, None]
      out = out + ein("bqt,btv->bqv", ein("bqk,btk->bqt", q, k), v)
    h = h + out if residual else out
  return h


def _reference_loss(form, *, depth: int, residual: bool, key_mask):
  """The plain reference's loss: MSE of the query predictions."""
  def loss(params, task):
    h = form.encode(task.x, task.y, x_query=task.x_query)
    pred = form.decode_pred(reference_forward(
        params, h, depth=depth, residual=residual, key_mask=key_mask))
    return jnp.mean((pred - task.y_query) ** 2)
  return loss


def _reference_step(loss, tx):
  """The plain reference's train step on a batch: ``jax.value_and_grad`` of
  ``loss`` and the same optax chain."""
  def step(params, opt_state, task):
    value, grads = jax.value_and_grad(loss)(params, task)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def step_flops(compiled) -> float | None:
  """FLOPs of one call of ``compiled`` by XLA's cost analysis (``None`` if
  the backend gives none)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None  # Not every backend implements it.
  cost = cost[0] if isinstance(cost, list) else cost
  return None if not cost or "flops" not in cost else float(cost["flops"])


def train_row(name: str, depth: int, train_config,
              config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Our train step against the plain reference on the same batch, timed in
  the same rounds, and the draw of one batch.

  Both update sides take the parameters, the optimiser state and a drawn
  batch and do the same work: the loss (forward), its gradient
  (``jax.value_and_grad``) and the optax update. Ours is
  :func:`elsa.training.train_step_on_batch`, the step the train driver takes
  for every grid point (:func:`elsa.training.train_grid_steps`); neither side
  draws. ``draw`` is :func:`elsa.training.sample_tasks` of one batch, what
  the driver adds once per step for all grid points.
  """
  model, spec, tx = _train_setup(name, depth, train_config)
  form, batch = spec.model_tokens(), train_config.batch
  split = training.split(model)
  state = training.init_state(split.params, tx)
  # The same values as plain arrays: the reference's parameters.
  params = {key: leaf[...] for key, leaf in split.params.items()}
  key = jax.random.fold_in(jax.random.key(config.seed), 0)
  switches = train.MODELS[name]
  mask = ((jnp.arange(form.m) < spec.n_train).astype(jnp.float32)
          if switches["context_only"] else None)
  reference_loss = _reference_loss(form, depth=depth,
                                   residual=switches["residual"], key_mask=mask)
  reference = _reference_step(reference_loss, tx)
  ref_opt_state = tx.init(params)
  draw = jax.jit(functools.partial(training.sample_tasks, spec=spec,
                                   batch=batch, dtype=jnp.float32)
                 ).lower(key).compile()
  task = draw(key)
  compiled = dict(
      ours_update=jax.jit(functools.partial(
          training.train_step_on_batch, form=form, graphdef=split.graphdef,
          rest=split.rest, tx=tx)).lower(state, task).compile(),
      reference_update=jax.jit(reference).lower(
          params, ref_opt_state, task).compile(),
      draw=draw)
  calls = dict(ours_update=lambda: compiled["ours_update"](state, task),
               reference_update=lambda: compiled["reference_update"](
                   params, ref_opt_state, task),
               draw=lambda: draw(key))
  # The reference is the same math: the same loss and gradient (up to
  # float32 rounding) at the same parameters and batch.
  ours_loss, ours_grads = jax.jit(jax.value_and_grad(functools.partial(
      training.loss, graphdef=split.graphdef, form=form)))(
          state.params, task, rest=split.rest)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference_loss))(params,
                                                                    task)
  difference = max(float(jnp.max(jnp.abs(ours_grads[k][...] - ref_grads[k]))
                         / jnp.max(jnp.abs(ref_grads[k]))) for k in ref_grads)
  times = time_rounds(calls, config=config)
  row = dict(model=name, depth=depth, batch=batch, m=form.m, n=form.n,
             components=train_config.components, tied=train_config.tied,
             loss_relative_difference=float(abs(ours_loss - ref_loss)
                                            / abs(ref_loss)),
             gradient_relative_difference=difference)
  for side in calls:
    row[side] = dict(timing(times[side]), flops=step_flops(compiled[side]))
  row["update_ratio"] = per_round(times["ours_update"]
                                  / times["reference_update"])
  return row


def run_train(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 4: our train step against the plain reference at every case of
  :func:`train_cases` (float32, as the train driver runs)."""
  cases = train_cases(config)
  progress = cli.Progress(len(cases), name="train", unit="cases",
                          every_s=0.0)
  rows = []
  for name, depth, train_config in cases:
    rows.append(train_row(name, depth, train_config, config))
    progress.update()
  return dict(rows=rows)


# --- part 5: causal ELSA by chunks -------------------------------------------


def masked_quadratic_elsa(p: elsa.ElsaParams, h: jax.Array) -> jax.Array:
  """Causal ``elsa(p, h)`` in the order of attention code: ``(tril * Q K^T) V``."""
  q, k, v = h @ p.w3 + p.b3, h @ p.w1 + p.b1, h @ p.w2 + p.b2
  m = h.shape[-2]
  return jnp.where(jnp.tril(jnp.ones((m, m), bool)), q @ k.T, 0) @ v


def causal_row(m: int, n: int, chunk: int | None,
               config: ml_collections.ConfigDict, *, compare: bool = True
               ) -> dict[str, Any]:
  """Causal ELSA by chunks against the masked quadratic order and the
  non-causal primitive at one ``(m, n, chunk)``, float32, timed in the same
  rounds (``compare=False``: the causal form alone, for the chunk sweep)."""
  k = v = n
  dtype = jnp.dtype(jnp.float32)
  rng = np.random.default_rng(config.seed)
  p = random_params(rng, m=m, n=n, k=k, scale=n ** -0.5, dtype=dtype)
  h = normal(rng, (m, n), dtype)
  causal = jax.jit(functools.partial(elsa.elsa, causal=True, chunk=chunk)
                   ).lower(p, h).compile()
  calls = dict(causal=lambda: causal(p, h))
  row = dict(m=m, n=n, k=k, v=v, chunk=chunk or elsa.attention.DEFAULT_CHUNK,
             dtype=dtype.name)
  if compare:
    full = jax.jit(elsa.elsa).lower(p, h).compile()
    calls["non_causal"] = lambda: full(p, h)
    slow = jax.jit(masked_quadratic_elsa).lower(p, h).compile()
    # Without a memory analysis: the [m, m] scores and mask.
    row["masked_quadratic"] = quadratic_memory(
        slow, 2 * m * m * dtype.itemsize, config)
    if "skipped" not in row["masked_quadratic"]:
      calls["masked_quadratic"] = lambda: slow(p, h)
      want = slow(p, h)
      row["max_rel_err"] = float(jnp.max(jnp.abs(causal(p, h) - want))
                                 / jnp.max(jnp.abs(want)))
  times = time_rounds(calls, config=config)
  row["causal"] = dict(timing(times["causal"]), bytes=allocated_bytes(causal))
  if compare:
    row["non_causal"] = timing(times["non_causal"])
    row["causal_over_non_causal"] = per_round(times["causal"]
                                              / times["non_causal"])
    if "masked_quadratic" in times:
      row["masked_quadratic"].update(timing(times["masked_quadratic"]))
      row["speedup_vs_masked_quadratic"] = per_round(
          times["masked_quadratic"] / times["causal"])
    else:
      row["speedup_vs_masked_quadratic"] = None
  return row


def run_causal(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 5: rows at every ``m`` of ``causal_tokens`` (the default chunk),
  then the chunk sweep at ``causal_chunk_tokens``."""
  n = config.causal_width
  progress = cli.Progress(len(config.causal_tokens) + len(config.causal_chunks),
                          name="causal", unit="cases", every_s=0.0)
  rows, chunks = [], []
  for m in config.causal_tokens:
    rows.append(causal_row(m, n, None, config))
    progress.update()
  for chunk in config.causal_chunks:
    chunks.append(causal_row(config.causal_chunk_tokens, n, chunk, config,
                             compare=False))
    progress.update()
  return dict(rows=rows, chunks=chunks)


# --- part 6: the transformer's training step per attention kind -------------


def transformer_step(kind: str, n_points: int,
                     config: ml_collections.ConfigDict):
  """The compiled training step of a :class:`elsa.nn.Transformer` with
  attention ``kind`` on ``n_points`` interleaved (x, y) pairs, and its
  arguments: ``(compiled, args)``, ``compiled(*args) -> (params, opt_state,
  loss)``."""
  d = config.transformer_d
  model = nn.Transformer(d + 1, 1, width=config.transformer_width,
                         depth=config.transformer_depth,
                         heads=config.transformer_heads,
                         max_len=2 * n_points, attention=kind,
                         rngs=nnx.Rngs(config.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(1e-3)

  def step(params, opt_state, x, y):
    loss = lambda params: training.prefix_loss(
        nnx.merge(graphdef, params, rest), x, y)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  rng = np.random.default_rng(config.seed)
  x = normal(rng, (config.transformer_batch, n_points, d), jnp.float32)
  y = normal(rng, (config.transformer_batch, n_points), jnp.float32)
  args = (params, tx.init(params), x, y)
  return jax.jit(step).lower(*args).compile(), args


def transformer_row(n_points: int, config: ml_collections.ConfigDict
                    ) -> dict[str, Any]:
  """The three attention kinds' training steps at one prompt length, timed
  in the same rounds; ratios to softmax."""
  steps = {kind: transformer_step(kind, n_points, config)
           for kind in nn.ATTENTION}
  calls = {kind: functools.partial(compiled, *args)
           for kind, (compiled, args) in steps.items()}
  times = time_rounds(calls, config=config)
  row = dict(n_points=n_points, tokens=2 * n_points,
             batch=config.transformer_batch, width=config.transformer_width,
             depth=config.transformer_depth, heads=config.transformer_heads)
  for kind, (compiled, _) in steps.items():
    row[kind] = dict(timing(times[kind]), flops=step_flops(compiled),
                     bytes=allocated_bytes(compiled))
  for kind in ("elsa", "lsa"):
    row[f"{kind}_over_softmax"] = per_round(times[kind] / times["softmax"])
  return row


def run_transformer(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Part 6: a row per prompt length of ``transformer_points`` (float32)."""
  progress = cli.Progress(len(config.transformer_points), name="transformer",
                          unit="cases", every_s=0.0)
  rows = []
  for n_points in config.transformer_points:
    rows.append(transformer_row(n_points, config))
    progress.update()
  return dict(rows=rows)


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
                sweep=_sweep_table, train=_train_table,
                causal=_causal_table, transformer=_transformer_table)
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


def _train_table(part: dict[str, Any]) -> list[str]:
  lines = ["train step on a drawn batch (forward, backward, optax update), "
           "ours / plain reference (float32); the draw of one batch; FLOPs "
           "per call",
           f"{'model':>21} {'L':>3} {'batch':>6} {'ours ms':>8} {'ref ms':>8} "
           f"{'ours / ref':>20} {'draw ms':>8} {'ours GFLOP':>11} "
           f"{'ref GFLOP':>10} {'draw GFLOP':>11}"]
  gflop = lambda f: "?" if f is None else f"{f / 1e9:.3g}"
  for r in part["rows"]:
    lines.append(
        f"{r['model']:>21} {r['depth']:>3} {r['batch']:>6} "
        f"{r['ours_update']['median_s'] * 1e3:>8.3g} "
        f"{r['reference_update']['median_s'] * 1e3:>8.3g} "
        f"{_spread(r['update_ratio']):>20} "
        f"{r['draw']['median_s'] * 1e3:>8.3g} "
        f"{gflop(r['ours_update']['flops']):>11} "
        f"{gflop(r['reference_update']['flops']):>10} "
        f"{gflop(r['draw']['flops']):>11}")
  return lines


def _causal_table(part: dict[str, Any]) -> list[str]:
  lines = ["causal elsa by chunks vs the masked quadratic (tril * Q K^T) V "
           "and non-causal elsa (float32)",
           f"{'n':>5} {'m':>7} {'chunk':>6} {'causal ms':>10} {'quad ms':>9} "
           f"{'speedup vs quad':>22} {'non-causal ms':>14} "
           f"{'causal / non-causal':>22} {'causal MiB':>11} {'max rel_err':>12}"]
  for r in part["rows"]:
    quad = r["masked_quadratic"]
    quad_ms = ("skipped" if "skipped" in quad
               else f"{quad['median_s'] * 1e3:.3g}")
    mib = ("?" if r["causal"]["bytes"] is None
           else f"{r['causal']['bytes'] / 2**20:.3g}")
    err = f"{r['max_rel_err']:.2g}" if "max_rel_err" in r else "-"
    lines.append(
        f"{r['n']:>5} {r['m']:>7} {r['chunk']:>6} "
        f"{r['causal']['median_s'] * 1e3:>10.3g} {quad_ms:>9} "
        f"{_spread(r['speedup_vs_masked_quadratic']):>22} "
        f"{r['non_causal']['median_s'] * 1e3:>14.3g} "
        f"{_spread(r['causal_over_non_causal']):>22} {mib:>11} {err:>12}")
  lines.append("chunk sweep: " + ", ".join(
      f"chunk {r['chunk']} {r['causal']['median_s'] * 1e3:.3g} ms"
      for r in part["chunks"]) + (f" (m={part['chunks'][0]['m']})"
                                  if part["chunks"] else ""))
  return lines


def _transformer_table(part: dict[str, Any]) -> list[str]:
  lines = ["transformer training step (prefix loss, backward, Adam) per "
           "attention kind (float32); ratios to softmax",
           f"{'tokens':>7} {'batch':>6} {'elsa ms':>8} {'lsa ms':>8} "
           f"{'softmax ms':>11} {'elsa / softmax':>20} {'lsa / softmax':>20}"]
  for r in part["rows"]:
    lines.append(
        f"{r['tokens']:>7} {r['batch']:>6} "
        f"{r['elsa']['median_s'] * 1e3:>8.3g} "
        f"{r['lsa']['median_s'] * 1e3:>8.3g} "
        f"{r['softmax']['median_s'] * 1e3:>11.3g} "
        f"{_spread(r['elsa_over_softmax']):>20} "
        f"{_spread(r['lsa_over_softmax']):>20}")
  return lines


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, in one line naming the field.

  Raises:
    experiments.checks.ConfigError: a field outside its range, a NaN or inf,
      an empty list of sizes, or arrays that would not fit in memory.
  """
  checks.check_seed(config)
  checks.check_items(config, "parts", choices=tuple(PARTS))
  checks.check_items(config, "dtypes", choices=("float32", "float64"))
  checks.check_int(config, "warmup", low=0)
  checks.check_int(config, "reps")
  checks.check_int(config, "min_reps", high=config.reps)
  checks.check_float(config, "max_case_s", low=0, low_open=True)
  for field in ("tokens", "widths", "stack_depths", "sweep_batches"):
    checks.check_items(config, field, integer=True, low=1)
  checks.check_items(config, "unrolled_depths", integer=True, low=1,
                     allow_empty=True)
  checks.check_items(config, "train_lsa_depths", integer=True, low=1)
  for field in ("causal_tokens", "causal_chunks", "transformer_points"):
    checks.check_items(config, field, integer=True, low=1,
                       allow_empty=field == "causal_chunks")
  for field in ("causal_width", "causal_chunk_tokens", "transformer_d",
                "transformer_width", "transformer_depth", "transformer_heads",
                "transformer_batch"):
    checks.check_int(config, field)
  for field in ("fit_min_tokens", "square_matmul_size", "stack_tokens",
                "stack_width", "stack_components", "compile_reps",
                "sweep_n_train", "sweep_d", "sweep_n_query", "sweep_depth",
                "train_lsa_batch", "train_elsa_depth", "train_elsa_batch"):
    checks.check_int(config, field)
  checks.check_float(config, "quadratic_budget_gib", low=0)
  checks.check_float(config, "sweep_noise", low=0)
  checks.check_choice(config, "sweep_form", ("designed", "natural"))
  checks.check_items(config, "sweep_lams", low=0)
  checks.check_items(config, "sweep_eta_fractions", low=0, high=1,
                     low_open=True, high_open=True)
  itemsize = max(jnp.dtype(d).itemsize for d in config.dtypes)
  m, n = max(config.tokens), max(config.widths)
  stack = max(config.stack_depths + config.unrolled_depths)
  # Part 1: h, the outputs and the weights; part 2: the stack's parameters;
  # the square matmul; a few copies each.
  checks.check_fits(
      3 * itemsize * (4 * m * n + 4 * n * n
                      + stack * config.stack_components * 6
                      * (config.stack_tokens + config.stack_width)
                      * config.stack_width
                      + 3 * config.square_matmul_size ** 2),
      fields="tokens, widths, stack_* and square_matmul_size")
  # Part 1's quadratic order runs up to its budget, or at most what it needs
  # at the largest m ([m, m] scores and their copy).
  if "primitive" in config.parts:
    checks.check_fits(min(config.quadratic_budget_gib * _GIB,
                          2 * itemsize * m * m),
                      fields="quadratic_budget_gib")
  # Part 5: h, its projections and output, the causal state; the masked
  # quadratic order up to its budget ([m, m] scores and the mask).
  if "causal" in config.parts:
    m = max(config.causal_tokens + (config.causal_chunk_tokens,))
    checks.check_fits(16 * 4 * m * config.causal_width
                      + min(config.quadratic_budget_gib * _GIB, 8 * m * m),
                      fields="causal_tokens, causal_chunk_tokens, "
                             "causal_width and quadratic_budget_gib")
  # Part 6: per block, kept for the backward pass (float32; one kind's step
  # runs at a time): 8 activations of the width and 4 copies of the softmax
  # scores [heads, m, m] (scores, probabilities and their gradients).
  if "transformer" in config.parts:
    m = 2 * max(config.transformer_points)
    checks.check_fits(
        4 * config.transformer_depth * config.transformer_batch * m
        * (8 * config.transformer_width + 4 * config.transformer_heads * m),
        fields="transformer_points, transformer_batch, transformer_width, "
               "transformer_depth and transformer_heads")
  # Part 4: per layer and component the state, Q, K, V and the [m, m]
  # scores of the reference, kept for the backward pass, a few copies.
  def train_bytes(depth, train_config):
    form = _train_spec(train_config).model_tokens()
    return (16 * depth * train_config.components * train_config.batch
            * form.m * (4 * form.n + form.m))
  checks.check_fits(max(train_bytes(depth, train_config)
                        for _, depth, train_config in train_cases(config)),
                    fields="train_lsa_batch, train_lsa_depths, "
                           "train_elsa_batch and train_elsa_depth")
  # Part 3: the sweep's own estimate for the largest batch, run as one chunk.
  sweep_run = sweep_config(config, batch=max(config.sweep_batches))
  sweep_run.update(forms=(config.sweep_form,), depth=config.sweep_depth,
                   chunk_size=sweep._n_items(sweep_run),  # pylint: disable=protected-access
                   dtype=max(config.dtypes, key=lambda d: jnp.dtype(d).itemsize))
  checks.check_fits(sweep.bytes_needed(sweep_run),
                    fields="sweep_batches, sweep_n_train, sweep_d, "
                           "sweep_n_query, sweep_depth and the sweep grid")


# What config.parts may name.
PARTS = dict(primitive=run_primitive, stack=run_stack, sweep=run_sweep,
             train=run_train, causal=run_causal, transformer=run_transformer)


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict[str, Any]:
  """Runs the parts of ``config.parts``, writes ``results.json`` and returns the results.

  A workdir that already holds results of the same config is not re-measured:
  its results are returned. ``overwrite`` (as for every driver) first deletes
  what an earlier benchmark wrote in ``workdir``, so everything is measured
  again. With float64 in ``config.dtypes``, ``jax_enable_x64`` is on inside
  the run and restored after it.

  Raises:
    experiments.checks.ConfigError: the config cannot run (nothing written).
    experiments.workdirs.WorkdirInUse: another run holds ``workdir``, or it
      holds a different config and ``overwrite`` is off.
  """
  validate(config)
  x64 = "float64" if "float64" in config.dtypes else "float32"
  with cli.float_dtype_enabled(x64), workdirs.claim_workdir(
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
  print(format_tables(cli.run_main(argv, "benchmark", run)))


if __name__ == "__main__":
  cli.define_flags("benchmark")
  app.run(main)
