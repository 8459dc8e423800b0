r"""The main job: L ELSA layers reproduce L ridge-GD steps, swept over depth x lambda x eta.

  python -m experiments.sweep --workdir=runs/sweep

For each input form (``designed``, ``natural``), each ridge strength ``lam``,
each step size ``eta`` and a batch of random tasks, ONE ELSA stack of the
maximum depth ``L`` (the form's GD layers) runs as one scan and every state
``h_t`` is decoded and compared with GD iterate ``t`` (:func:`elsa.ridge.gd`),
so "``t`` layers == ``t`` GD steps" is measured at every ``t = 1..L`` from one
scan. Both are also compared with the ridge solution (:func:`elsa.ridge.solve`).

Relative error, used for every number this driver reports, per task and depth:

.. math::
  \mathrm{rel}(a, b) = \frac{\|a - b\|_2}{\max(\|b\|_2,\ \mathrm{tiny})},
  \qquad \mathrm{tiny} = \texttt{finfo(dtype).tiny},

with ``a`` the ELSA iterate and ``b`` the GD iterate (``rel_err``), or ``a`` an
iterate and ``b`` the ridge solution (``elsa_to_ridge``, ``gd_to_ridge``).

Compilation: one ``jax.jit`` function per form (the two forms are different
programs); ``lam``, ``eta`` and the tasks are traced arrays under ``vmap``, the
depth is the scan length, so a whole sweep of one form traces exactly once
(``results['traces']`` records the count). The flat batch of (grid point, task)
items is sharded over ``jax.devices()`` along a 1-D mesh axis ``batch``
(``Mesh`` + ``NamedSharding``), padded to a multiple of the device count.

Resuming: each finished chunk of items is saved at once as
``partial_<form>_items<start>-<start + size>.npz`` (atomically), each finished
form as ``partial_<form>.json``, and ``results.json`` last; a rerun of the same
config loads what exists and computes only the rest. The chunk size depends on
the device count, and is part of the file name, so chunks saved under another
device count are recomputed, never misread. Every file carries the config's
hash and a checksum of its content, verified on resume
(:class:`experiments.workdirs.Workdir`); the run holds the workdir's lock.

The config is checked before the workdir is claimed (:func:`validate`):
``lams >= 0``, ``etas > 0``, positive sizes, finite numbers, no value listed
twice, and arrays that fit in memory. ``config.dtype = "float64"`` turns on ``jax_enable_x64`` for
the run and restores the previous setting after it.

Multi-host (``--distributed``, :mod:`experiments.distributed`): every process
validates the config and all agree on the outcome before anyone waits;
process 0 alone claims the workdir (which may delete an old run's files) and
writes; every process runs the same chunks, each item on one device of the
global mesh. The others wait for process 0's claim, and process 0's view of
what is finished is broadcast, so all agree on the work left. The workdir
must be on a filesystem every process sees: they read the chunk files
process 0 names (JSON outputs they get from process 0's reading).

A cell (form, lam, eta) is ``diverged`` when ``eta`` is at or past the GD
stability limit ``2 / (lambda_max(X^T X/N) + lam)`` of any of its tasks, or any
of its iterates is not finite. Diverged cells are kept in ``results.json``
(non-finite numbers as ``null``) and never enter ``max_rel_err`` or the error
figures.
"""

from __future__ import annotations

import functools
import time

from absl import app
from absl import logging
import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import jax.numpy as jnp
import ml_collections
import numpy as np

import elsa
from elsa import forms
from elsa import ridge
from experiments import checks
from experiments import cli
from experiments import distributed
from experiments import metrics
from experiments import plotting
from experiments import workdirs

Array = jax.Array

_FORM_CLASSES = {"designed": "Designed", "natural": "Natural"}
_METRICS = ("rel_err", "elsa_to_ridge", "gd_to_ridge")


# What measure_task reports: the one relative error every driver shares.
relative_error = metrics.relative_error


def make_form(name: str, config: ml_collections.ConfigDict):
  """The input form ``name`` (``designed`` or ``natural``) for the config's task shape."""
  if name not in _FORM_CLASSES:
    raise checks.ConfigError(f"config.forms: unknown form {name!r}; choose "
                             f"from {sorted(_FORM_CLASSES)}.")
  cls = getattr(forms, _FORM_CLASSES[name])
  return cls(n_train=config.n_train, d=config.d, n_query=config.n_query,
             n_out=1)


def measure_task(form, x: Array, y: Array, x_query: Array, lam: Array,
                 eta: Array, *, depth: int) -> dict[str, Array]:
  """ELSA stack vs GD vs ridge solution for one task, at every depth ``0..depth``.

  Args:
    form: an input form (``elsa.forms.Designed`` or ``Natural``).
    x: ``[N, d]``; y: ``[N]``; x_query: ``[Q, d]``.
    lam, eta: scalars (traced).
    depth: stack depth ``L`` (static).

  Returns:
    ``rel_err``, ``elsa_to_ridge``, ``gd_to_ridge``: each ``[L + 1]``.

  The stack is ``form.gd_basis`` with this item's ``form.gd_coefficients``
  (the same layers as ``form.gd_params``): the basis does not depend on
  ``lam`` or ``eta``, so under ``vmap`` every item shares it and the
  projections run as one matmul over all items, where a parameter stack per
  item used to be built. The basis is pruned (:func:`elsa.prune`, built from
  constants at trace time): the skip costs one elementwise product and the
  gradient head computes only the columns it reads and writes. The layers run
  in one ``lax.scan`` that decodes ``w`` from each state as it is made: the
  same states as ``elsa_stack(..., return_all=True)``, without writing all
  ``L + 1`` of them out (docs/guides/speed.md, "The sweep kernel").
  """
  with jax.ensure_compile_time_eval():  # a constant: prune reads its zeros
    stack = elsa.prune(form.gd_basis(depth=depth, dtype=x.dtype))
  h0 = form.encode(x, y, x_query=x_query)
  _, w_layers = stack.scan(form.decode_w, h0, coeffs=form.gd_coefficients(
      lam=lam, eta=eta, depth=depth))
  return compare_with_gd(form.decode_w(h0), w_layers, x, y, lam=lam, eta=eta,
                         depth=depth)


def compare_with_gd(w0: Array, w_layers: Array, x: Array, y: Array, *, lam,
                    eta, depth: int) -> dict[str, Array]:
  """The stack's ``w`` (``w0`` decoded from the input, ``w_layers [L, ...]``
  after each layer) against GD iterate ``t`` and the ridge solution: the
  dict of :func:`measure_task`."""
  w_gd = ridge.gd(x, y, lam=lam, eta=eta, steps=depth).reshape(depth + 1, -1)
  # decode_w may keep a trailing output axis of size n_out = 1.
  w_elsa = jnp.concatenate([w0[None], w_layers]).reshape(w_gd.shape)
  w_ridge = ridge.solve(x, y, lam=lam).reshape(-1)
  return dict(rel_err=relative_error(w_elsa, w_gd),
              elsa_to_ridge=relative_error(w_elsa, w_ridge),
              gd_to_ridge=relative_error(w_gd, w_ridge))


def build_measure(form, *, depth: int, mesh: Mesh, on_trace=None):
  """One jitted function measuring a flat, sharded batch of (task, lam, eta) items.

  Args:
    form: the input form.
    depth: stack depth ``L``.
    mesh: a 1-D mesh with axis ``batch``; inputs are split along it.
    on_trace: called each time the function is traced (tests count compiles).

  Returns:
    ``f(x [B, N, d], y [B, N], x_query [B, Q, d], lam [B], eta [B])`` ->
    dict of ``[B, L + 1]`` arrays, replicated on every device (so every host
    can read them); ``B`` must be a multiple of the mesh size.
  """
  split = NamedSharding(mesh, PartitionSpec("batch"))
  replicated = NamedSharding(mesh, PartitionSpec())

  def measure(x, y, x_query, lam, eta):
    if on_trace is not None:
      on_trace()
    one = functools.partial(measure_task, form, depth=depth)
    return jax.vmap(one)(x, y, x_query, lam, eta)

  return jax.jit(measure, in_shardings=(split,) * 5, out_shardings=replicated)


def _tasks_and_limits(config: ml_collections.ConfigDict, dtype):
  """The config's tasks and ``limit [n_lams, n_tasks]``, their GD stability limits."""
  shape = dict(batch=config.n_tasks, n_train=config.n_train, d=config.d,
               n_query=config.n_query)

  @jax.jit
  def sample(key, noise, lams):
    # One compile instead of a few dozen eager ops (each compiled on its own).
    tasks = ridge.sample_tasks(key, noise=noise, dtype=dtype, **shape)
    return tasks, ridge.stability_limit(tasks.x[None], lam=lams[:, None])

  return sample(jax.random.key(config.seed), jnp.asarray(config.noise, dtype),
                jnp.asarray(config.lams, dtype))


def grid_items(config: ml_collections.ConfigDict, dtype) -> dict[str, np.ndarray]:
  """The flat batch, ordered (lam, eta, task): inputs and the stability mask.

  Uses ``config.seed, noise, n_train, d, n_query, n_tasks, lams, etas,
  eta_mode`` (the benchmark times the kernel on these same items).

  Returns ``x [G, N, d]``, ``y [G, N]``, ``x_query [G, Q, d]``, ``lam [G]``,
  ``eta [G]`` (absolute step sizes) and ``unstable [G]`` (``eta`` at or past
  the task's stability limit), ``G = len(lams) * len(etas) * n_tasks``.
  """
  if config.eta_mode not in ("fraction", "absolute"):
    raise ValueError(f"config.eta_mode must be 'fraction' or 'absolute', got "
                     f"{config.eta_mode!r}.")
  tasks, limit = jax.tree.map(np.asarray, _tasks_and_limits(config, dtype))
  np_dtype = limit.dtype
  lams = np.asarray(config.lams, np_dtype)
  etas = np.asarray(config.etas, np_dtype)
  shape = (len(lams), len(etas), config.n_tasks)
  if config.eta_mode == "fraction":
    eta = etas[None, :, None] * limit[:, None, :]
  else:
    eta = np.broadcast_to(etas[None, :, None], shape)
  task_index = np.broadcast_to(np.arange(config.n_tasks), shape).reshape(-1)
  return dict(x=tasks.x[task_index], y=tasks.y[task_index],
              x_query=tasks.x_query[task_index],
              lam=np.broadcast_to(lams[:, None, None], shape).reshape(-1),
              eta=eta.reshape(-1).astype(np_dtype),
              unstable=(eta >= limit[:, None, :]).reshape(-1))


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, in one line naming the field.

  Raises:
    experiments.checks.ConfigError: a field outside its range, a NaN or inf,
      an empty grid, or arrays that would not fit in memory.
  """
  checks.check_seed(config)
  checks.check_items(config, "forms", choices=sorted(_FORM_CLASSES))
  for field in ("n_train", "d", "n_query", "n_tasks", "depth", "chunk_size"):
    checks.check_int(config, field)
  checks.check_float(config, "noise", low=0)
  checks.check_items(config, "lams", low=0)
  checks.check_choice(config, "eta_mode", ("fraction", "absolute"))
  checks.check_items(config, "etas", low=0, low_open=True)
  checks.check_choice(config, "dtype", ("float32", "float64"))
  checks.check_fits(bytes_needed(config),
                    fields="n_train, d, n_query, n_tasks, depth, chunk_size "
                           "and the grid")


def bytes_needed(config: ml_collections.ConfigDict) -> int:
  """About what a run of ``config`` holds at once: the flat batch of inputs,
  and one chunk's stack parameters, states and GD iterates at every depth (a
  few copies). The benchmark sizes its sweep part with it."""
  form_names = config.forms
  itemsize = 8 if config.dtype == "float64" else 4
  n_items = _n_items(config)
  chunk = min(config.chunk_size, n_items)
  inputs = config.n_train * (config.d + 1) + config.n_query * config.d
  shapes = [(form.m, form.n) for form in (make_form(name, config)
                                          for name in form_names)]
  state = max(m * n for m, n in shapes)
  # A layer's parameters: weights and biases of a few components.
  params = max((m + n) * n for m, n in shapes) * 6
  per_item = (config.depth + 1) * (state + params + config.d) + config.d ** 2
  return itemsize * (n_items * inputs + 3 * chunk * per_item)


def _n_items(config: ml_collections.ConfigDict) -> int:
  return len(config.lams) * len(config.etas) * config.n_tasks


def chunk_starts(config: ml_collections.ConfigDict, n_devices: int
                 ) -> tuple[int, list[int]]:
  """``(size, starts)``: the chunks of the flat batch, a function of the config and device count.

  ``size`` is ``config.chunk_size`` (at most the batch) rounded up to a
  multiple of ``n_devices``; the last chunk is padded to it.
  """
  n_items = _n_items(config)
  size = -(-min(config.chunk_size, n_items) // n_devices) * n_devices
  return size, list(range(0, n_items, size))


def _form_file(name: str) -> str:
  return f"partial_{name}.json"


def _chunk_file(name: str, start: int, size: int) -> str:
  return f"partial_{name}_items{start}-{start + size}.npz"


def _finished(wd: workdirs.Workdir, config: ml_collections.ConfigDict,
              size: int, starts: list[int]) -> dict[str, np.ndarray]:
  """What earlier runs finished, as process 0 sees it, the same on every process.

  Returns ``results`` (a bool), ``forms [n_forms]`` and
  ``chunks [n_forms, n_chunks]`` (bool arrays): which of ``results.json``,
  ``partial_<form>.json`` and the chunk files exist.
  """
  exists = wd.exists
  flags = dict(
      results=np.asarray(exists("results.json"), np.int32),
      forms=np.asarray([exists(_form_file(n)) for n in config.forms],
                       np.int32),
      chunks=np.asarray([[exists(_chunk_file(n, s, size)) for s in starts]
                         for n in config.forms], np.int32))
  if jax.process_count() > 1:
    # Process 0 may have just deleted an old run (--overwrite), and another
    # host may see the shared filesystem late: everyone takes its word.
    flags = multihost_utils.broadcast_one_to_all(flags)
  return {k: np.asarray(v).astype(bool) for k, v in flags.items()}


def _read_finished(wd: workdirs.Workdir, name: str, read):
  """``read(name)`` (a verified read of ``wd``) of a file process 0 reported
  as finished."""
  found = read(name)
  if found is None:
    raise FileNotFoundError(
        f"sweep: process 0 finished {wd.path(name)!r} but this process cannot "
        "see it; the workdir must be on a filesystem every process shares.")
  return found


def _run_form(name: str, config: ml_collections.ConfigDict, items: dict,
              mesh: Mesh, progress: cli.Progress, *, wd: workdirs.Workdir,
              chunks_done: np.ndarray) -> dict:
  """All chunks of one form through one compiled function; returns the records.

  Chunks flagged in ``chunks_done`` are loaded from their files; every other
  chunk is computed and saved as soon as it is done (by process 0: the
  workdir's writes, :class:`experiments.distributed.SharedWorkdir`).
  """
  form = make_form(name, config)
  traces = []
  measure = build_measure(form, depth=config.depth, mesh=mesh,
                          on_trace=lambda: traces.append(1))
  n_items = len(items["lam"])
  size, starts = chunk_starts(config, mesh.size)
  split = NamedSharding(mesh, PartitionSpec("batch"))
  inputs = ("x", "y", "x_query", "lam", "eta")
  outputs = {metric: [] for metric in _METRICS}
  with jax.default_matmul_precision("highest"):
    for start, done in zip(starts, chunks_done):
      chunk_file = _chunk_file(name, start, size)
      real = min(size, n_items - start)
      if done:
        out = _read_finished(wd, chunk_file, wd.read_npz)
        progress.resumed(real)
      else:
        # Every chunk has the same shape (the last is padded with item 0), so
        # the function compiles once.
        index = np.arange(start, start + size)
        index = np.where(index < n_items, index, 0)
        out = measure(*(distributed.put(items[k][index], split)
                          for k in inputs))
        out = {metric: np.asarray(out[metric])[:real] for metric in _METRICS}
        wd.write_npz(chunk_file, out)
        progress.update(real)
      for metric in _METRICS:
        outputs[metric].append(out[metric])
  outputs = {k: np.concatenate(v) for k, v in outputs.items()}
  return dict(records=_records(name, config, outputs, items["unstable"]),
              traces=len(traces))


def _records(name: str, config: ml_collections.ConfigDict,
             outputs: dict[str, np.ndarray], unstable: np.ndarray) -> list[dict]:
  """One record per (lam, eta, depth 1..L): task max/median of each metric."""
  grid = (len(config.lams), len(config.etas), config.n_tasks, config.depth + 1)
  outputs = {k: v.reshape(grid) for k, v in outputs.items()}
  unstable = unstable.reshape(grid[:3])
  records = []
  for i, lam in enumerate(config.lams):
    for j, eta in enumerate(config.etas):
      cell = {k: v[i, j] for k, v in outputs.items()}
      finite = all(np.isfinite(v).all() for v in cell.values())
      diverged = bool(unstable[i, j].any()) or not finite
      for depth in range(1, config.depth + 1):
        at = {k: v[:, depth] for k, v in cell.items()}
        records.append(dict(
            form=name, lam=float(lam), eta=float(eta), depth=depth,
            diverged=diverged, n_unstable_tasks=int(unstable[i, j].sum()),
            max_rel_err=workdirs.finite_or_none(np.max(at["rel_err"])),
            median_rel_err=workdirs.finite_or_none(np.median(at["rel_err"])),
            elsa_to_ridge=workdirs.finite_or_none(
                np.median(at["elsa_to_ridge"])),
            gd_to_ridge=workdirs.finite_or_none(np.median(at["gd_to_ridge"]))))
  return records


def _worst(records: list[dict]) -> float | None:
  stable = [r["max_rel_err"] for r in records if not r["diverged"]]
  return max(stable) if stable else None


def summary_table(results: dict) -> str:
  """Final-depth numbers per (form, lam, eta), as aligned text."""
  depth = max(r["depth"] for r in results["records"])
  head = (f"{'form':9} {'lam':>7} {'eta':>7} {'max_rel_err':>12} "
          f"{'elsa_to_ridge':>14} {'gd_to_ridge':>12}  status")
  lines = [f"ELSA stack vs GD at depth {depth} ({results['dtype']}, "
           f"eta {results['eta_mode']}):", head, "-" * len(head)]
  fmt = lambda v: "nan/inf" if v is None else f"{v:.3g}"
  for r in results["records"]:
    if r["depth"] == depth:
      lines.append(
          f"{r['form']:9} {r['lam']:7.3g} {r['eta']:7.3g} "
          f"{fmt(r['max_rel_err']):>12} {fmt(r['elsa_to_ridge']):>14} "
          f"{fmt(r['gd_to_ridge']):>12}  "
          f"{'DIVERGED' if r['diverged'] else 'ok'}")
  lines.append(f"max_rel_err over stable cells, all depths: "
               f"{fmt(results['max_rel_err'])}")
  return "\n".join(lines)


def _write_figures(results: dict, wd: workdirs.Workdir) -> None:
  records, form_names = results["records"], results["forms"]
  for name in form_names:
    wd.save_figure(plotting.error_vs_depth(records, form=name),
                   f"figures/error_vs_depth_{name}.png")
    wd.save_figure(plotting.convergence(records, form=name),
                   f"figures/convergence_{name}.png")
  wd.save_figure(plotting.final_error_heatmap(records, forms=form_names),
                 "figures/final_error_heatmap.png")


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict:
  """Runs (or resumes, or skips) the sweep of ``config`` into ``workdir``.

  Checks the config, claims the workdir (its lock held until the run ends;
  ``overwrite`` first deletes what an earlier sweep wrote there, of any
  config), then writes ``config.json``, a ``partial_<form>_items*.npz`` file
  after each chunk, ``partial_<form>.json`` after each form,
  ``figures/*.png`` and finally ``results.json`` (all atomically): a rerun
  with the same config returns the finished results, or computes only the
  chunks not saved yet. ``results['traces']`` counts, per form, the compiles
  of the run that finished it (0 when it only loaded saved chunks).

  Returns:
    The results dict (what ``results.json`` holds, less its ``_check``).

  Raises:
    experiments.checks.ConfigError: the config cannot run (nothing written).
    experiments.workdirs.WorkdirInUse: another run holds ``workdir``, or it
      holds a different config and ``overwrite`` is off.
    experiments.workdirs.CorruptOutput: a saved file is damaged, altered or of
      another config.
  """
  distributed.agree("validate", validate, config)
  with cli.float_dtype_enabled(config.dtype) as dtype, \
      distributed.claim_workdir(workdir, config, overwrite=overwrite) as wd:
    return _run(config, wd, dtype)


def _run(config: ml_collections.ConfigDict, wd: workdirs.Workdir, dtype
         ) -> dict:
  mesh = distributed.mesh()
  size, starts = chunk_starts(config, mesh.size)
  finished = _finished(wd, config, size, starts)
  if finished["results"]:
    logging.info("%s: results of this config exist; nothing to do.", wd.root)
    done = _read_finished(wd, "results.json", wd.read_json)
    print(summary_table(done))
    return done

  start = time.perf_counter()
  items = grid_items(config, dtype)
  n_items = len(items["lam"])
  partial = {}
  for name, done in zip(config.forms, finished["forms"]):
    if done:
      partial[name] = _read_finished(wd, _form_file(name), wd.read_json)
  todo = [name for name in config.forms if name not in partial]
  logging.info("sweep: %d forms to run (%s), %d items each in chunks of %d, "
               "on %d %s devices", len(todo), ", ".join(todo), n_items, size,
               mesh.size, jax.default_backend())
  progress = cli.Progress(len(config.forms) * n_items, name="sweep",
                          unit="tasks")
  progress.resumed(len(partial) * n_items)
  for name, chunks_done in zip(config.forms, finished["chunks"]):
    if name in partial:
      continue
    partial[name] = _run_form(name, config, items, mesh, progress, wd=wd,
                              chunks_done=chunks_done)
    wd.write_json(_form_file(name), partial[name])

  records = [r for name in config.forms for r in partial[name]["records"]]
  results = dict(
      max_rel_err=_worst(records),
      max_rel_err_by_form={name: _worst(partial[name]["records"])
                           for name in config.forms},
      forms=list(config.forms), dtype=jnp.dtype(dtype).name,
      eta_mode=config.eta_mode,
      relative_error="||a - b||_2 / max(||b||_2, finfo(dtype).tiny) per task "
                     "and depth; max/median over the cell's tasks",
      n_diverged_cells=len({(r["form"], r["lam"], r["eta"]) for r in records
                            if r["diverged"]}),
      traces={name: partial[name]["traces"] for name in config.forms},
      devices=mesh.size, backend=jax.default_backend(),
      seconds=time.perf_counter() - start, records=records)
  _write_figures(results, wd)
  # results.json last: its presence means the run is complete.
  wd.write_json("results.json", results)
  print(summary_table(results))
  return results


def main(argv) -> None:
  distributed.run_main(argv, "sweep", run)


if __name__ == "__main__":
  cli.define_flags("sweep")
  distributed.define_flags()
  app.run(main)
