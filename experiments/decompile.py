r"""Which algorithm did each trained stack learn? ``elsa.decompile`` on a train run's models.

For every model of ``config.train.models`` at every depth of
``config.train.depths`` (the grid point the train run chose on its validation
tasks, restored from its last checkpoint) it runs
:func:`elsa.decompile.identify`: every family fitted on ``n_fit`` tasks of the
training distribution at every exposed layer, ranked on ``n_test`` others
(float64 families; the model in its own float32), with the ridge strength of
the tasks. Beside it, Fu et al.'s similarity map of the layers against GD
steps ``0..similarity_steps`` at the train run's chosen step size, and for LSA
models Ahn et al.'s weight structure, and the fit-free spectral description
(:func:`elsa.decompile.spectral`: each layer's filter, residual roots and
the explained-share ladder).

The train run: ``config.train_workdir`` where given, else a finished run of
``config.train`` at ``<workdir>/train`` or beside this workdir
(``runs/train`` for ``--workdir=runs/decompile``), reused and said so in one
line; with none, :func:`experiments.train.run` trains it at
``<workdir>/train`` first (or at ``config.train_workdir``) and says why; a
different train config there is refused.

Workdir (claimed as every driver claims it,
:func:`experiments.workdirs.claim_workdir`): ``config.json``,
``partial_<model>_L<depth>.json`` (each model and depth as soon as it is done;
a rerun resumes at the first missing one), ``results.json`` (written last:
``{"models": {model: [per depth: ranked fits with every metric, best, ties,
closest, similarity, spectral description, weight structure, seconds]}}``)
and ``figures/`` (``similarity_<model>.png``, ``filters_<model>.png``,
``schedules.png``, ``sensitivity.png``, ``ladder.png``). The task axis is
sharded over the local devices (a ``Mesh`` over them and a ``NamedSharding``
of every task array; parameters replicated).

Multi-host (``--distributed``, :mod:`experiments.distributed`): validation is
agreed by every process and process 0 alone claims the workdir and writes.
The stacks are split over the processes (the ``k``-th stack still to do on
process ``k mod P``, on its own devices), and each result is gathered on
every process through the coordination service's key-value store, so every
process returns the same results; process 0 writes each partial file as it
is done or arrives.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import logging
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import ml_collections
import numpy as np
from matplotlib.figure import Figure

from elsa import decompile, training
from experiments import checks
from experiments import cli
from experiments import distributed
from experiments import train
from experiments import workdirs


def validate(config: ml_collections.ConfigDict) -> None:
  """Every field in its range, before any workdir is touched.

  Raises:
    checks.ConfigError: naming the field and the allowed range.
  """
  checks.check_seed(config)
  train.validate(config.train)
  devices = jax.local_device_count()
  for field in ("n_fit", "n_test", "spectral_n_fit", "spectral_n_test"):
    if checks.check_int(config, field, low=2) % devices:
      raise checks.ConfigError(f"config.{field} must be a multiple of the "
                               f"local device count {devices}, got "
                               f"{config[field]}.")
  checks.check_items(config, "families", choices=tuple(decompile.FAMILIES),
                     allow_empty=True)
  checks.check_items(config, "models", choices=tuple(config.train.models),
                     allow_empty=True)
  checks.check_float(config, "tol", low=0, low_open=True)
  checks.check_items(config, "iterations", integer=True, low=1)
  for field in ("restarts", "similarity_steps"):
    checks.check_int(config, field)
  for field in ("adam_steps", "lm_steps"):
    checks.check_int(config, field, low=0)
  checks.check_int(config, "spectral_degree", low=0)
  checks.check_items(config, "spectral_extras", choices=decompile.EXTRAS,
                     allow_empty=True)


def sharded_tasks(config) -> list:
  """``[fit, test, spectral_fit, spectral_test]``: ``config.n_fit``,
  ``n_test``, ``spectral_n_fit`` and ``spectral_n_test`` tasks of the
  training distribution (float64), consecutive slices of one draw (one
  compilation, at XLA's quickest level: drawing is cheap, compiling is
  seconds), each sharded on the task axis."""
  sizes = (config.n_fit, config.n_test, config.spectral_n_fit,
           config.spectral_n_test)
  sharding = NamedSharding(Mesh(np.asarray(jax.local_devices()), ("tasks",)),
                           PartitionSpec("tasks"))

  def draw(key):
    tasks = training.sample_tasks(key, train.task_spec(config.train),
                                  batch=sum(sizes), dtype=np.float64)
    ends = np.cumsum(sizes)
    return [jax.tree.map(lambda a, lo=end - size, hi=end: a[lo:hi], tasks)
            for size, end in zip(sizes, ends)]
  return jax.jit(draw, out_shardings=sharding, compiler_options={
      "xla_backend_optimization_level": 0})(
          jax.random.fold_in(jax.random.key(config.seed), 1))


def _one(config, model, depth: int, eta: float, fit_tasks, test_tasks,
         spectral_tasks) -> dict:
  """Decompiles one trained stack: the report, the spectral description,
  similarity, weight structure."""
  spec = train.task_spec(config.train)
  predict = decompile.from_model(model, spec)
  tic = time.perf_counter()
  report = decompile.identify(
      predict, fit_tasks, test_tasks, families=list(config.families) or None,
      tol=config.tol, lam=spec.lam, iterations=tuple(config.iterations),
      key=jax.random.fold_in(jax.random.key(config.seed), depth),
      restarts=config.restarts, adam_steps=config.adam_steps,
      lm_steps=config.lm_steps, pad_layers=max(config.train.depths))
  seconds = time.perf_counter() - tic
  tic = time.perf_counter()
  described = decompile.spectral(predict, *spectral_tasks,
                                 degree=config.spectral_degree,
                                 extras=tuple(config.spectral_extras),
                                 lam=spec.lam)
  spectral_seconds = time.perf_counter() - tic
  heat, argmax = decompile.similarity(
      predict, lambda t: training.gd_step_predictions(
          t, lam=spec.lam, eta=eta, steps=config.similarity_steps),
      test_tasks)
  structure = (None if model.use_bias
               else decompile.weight_structure(model, spec))
  return {"depth": depth, **report.as_dict(), "identify_seconds": seconds,
          "spectral": described.as_dict(),
          "spectral_seconds": spectral_seconds,
          "similarity_to_gd": {"eta": eta, "map": heat.tolist(),
                               "argmax": argmax.tolist()},
          "weight_structure": structure}


# A process waits this long for a stack another process decompiles: its whole
# share may come first (a dead process ends the job through the heartbeats).
_SHARE_TIMEOUT_MS = 24 * 3600 * 1000


def _shared(job: str, owner: int, compute):
  """``compute()`` on process ``owner``, its JSON value on every process.

  The owner posts it in the coordination service's key-value store (every
  driver's channel between processes, :mod:`experiments.distributed`); the
  others wait for it there. One process: ``compute()``.
  """
  client = distributed._client()  # pylint: disable=protected-access
  if client is None:
    return compute()
  key = f"elsa/decompile/{job}"
  if jax.process_index() == owner:
    value = workdirs.finite_or_none(compute())
    client.key_value_set(key, json.dumps(value, allow_nan=False))
    return value
  return json.loads(client.blocking_key_value_get(key, _SHARE_TIMEOUT_MS))


def _decompile_all(config, wd: workdirs.Workdir, train_workdir: str,
                   train_results: dict) -> dict:
  """Every model at every depth: those without a partial file are split over
  the processes (the ``k``-th on process ``k mod P``), each result gathered
  on every process; process 0 writes the partial files (its own as soon as
  each is done, the others' as they arrive)."""
  fit_tasks, test_tasks, *spectral_tasks = sharded_tasks(config)
  names = list(config.models or config.train.models)
  depths = list(config.train.depths)
  jobs = [(name, i, depth) for name in names for i, depth in enumerate(depths)]
  done = {(name, depth): wd.read_json(f"partial_{name}_L{depth}.json")
          for name, _, depth in jobs}
  todo = [job for job in jobs if done[job[0], job[2]] is None]
  progress = cli.Progress(len(jobs), name="decompile", unit="stacks")
  progress.resumed(len(jobs) - len(todo))
  # Each process computes its own share first, then gathers the others'.
  me, processes = jax.process_index(), jax.process_count()
  order = sorted(range(len(todo)), key=lambda k: k % processes != me)
  for k in order:
    name, i, depth = todo[k]
    owner = k % processes

    def compute(name=name, i=i, depth=depth):
      logging.info("decompile: process %d decompiles %s L=%d", me, name,
                   depth)
      model = train.trained_model(config.train, train_workdir,
                                    train_results, name=name, depth=depth)
      return ({"depth": depth, "diverged": True} if model is None else
              _one(config, model, depth, train_results["gd_best_eta"][i],
                   fit_tasks, test_tasks, spectral_tasks))
    found = _shared(f"{name}_L{depth}", owner, compute)
    wd.write_json(f"partial_{name}_L{depth}.json", found)
    done[name, depth] = found
    progress.update()
  out = {name: [workdirs.finite_or_none(done[name, depth])
                for depth in depths] for name in names}
  return {"models": out, "depths": depths, "lam": config.train.lam,
          "gd_best_eta": train_results["gd_best_eta"],
          "train_test_loss": {n: train_results["test_loss"][n] for n in names}}


# --- figures ---------------------------------------------------------------------


def similarity_figure(per_depth: list[dict], name: str) -> Figure:
  """One heatmap per depth: layers against GD steps, the argmax marked."""
  shown = [r for r in per_depth if "similarity_to_gd" in r]
  fig = Figure(figsize=(3.2 * max(len(shown), 1), 3.0), layout="constrained")
  for k, r in enumerate(shown):
    ax = fig.add_subplot(1, len(shown), k + 1)
    heat = np.asarray(r["similarity_to_gd"]["map"], float)
    image = ax.imshow(heat, vmin=-1, vmax=1, cmap="RdBu_r", aspect="auto",
                      origin="lower")
    ax.plot(r["similarity_to_gd"]["argmax"], range(heat.shape[0]), "k*")
    ax.set(title=f"{name}, L = {r['depth']}", xlabel="GD step",
           ylabel="layer")
    fig.colorbar(image, ax=ax)
  return fig


def schedules_figure(results: dict) -> Figure:
  """The fitted GD schedule (step per iteration) of every model and depth."""
  fig = Figure(figsize=(5, 3.5), layout="constrained")
  ax = fig.add_subplot()
  for name, per_depth in results["models"].items():
    for r in per_depth:
      fits = {f["family"]: f for f in r.get("fits", [])}
      if "gd_schedule" in fits:
        eta = fits["gd_schedule"]["params"]["eta"]
        ax.plot(range(1, len(eta) + 1), eta, "o-",
                label=f"{name} L={r['depth']}")
  ax.set(xlabel="iteration", ylabel="fitted step size",
         title="gd_schedule fitted to each stack")
  if ax.lines:  # empty when gd_schedule was not among the families
    ax.legend(fontsize=6)
  return fig


def sensitivity_figure(results: dict) -> Figure:
  """Sensitivity cosine of the best family (and of GD) against depth."""
  fig = Figure(figsize=(5, 3.5), layout="constrained")
  ax = fig.add_subplot()
  for name, per_depth in results["models"].items():
    for family, style in (("gd", "--"), (None, "-")):
      xs, ys = [], []
      for r in per_depth:
        fits = {f["family"]: f for f in r.get("fits", [])}
        pick = family or r.get("best") or (r["fits"][0]["family"]
                                           if r.get("fits") else None)
        if pick in fits:
          xs.append(r["depth"])
          ys.append(fits[pick]["metrics"]["sensitivity_cosine"])
      ax.plot(xs, ys, style, marker="o",
              label=f"{name}: {'gd' if family else 'best'}")
  ax.set(xlabel="depth L", ylabel="cosine of d pred / d x_q",
         title="input sensitivities: stack vs family")
  ax.legend(fontsize=6)
  return fig


def filters_figure(per_depth: list[dict], name: str, lam: float) -> Figure:
  r"""One panel per depth: the spectral filter ``g_l`` of every layer on the
  fit spectrum's range, beside ridge's ``1 / (lambda + lam)`` and constant-step
  GD's ``(1 - (1 - eta (lambda + lam))^t) / (lambda + lam)`` at the ladder's
  fitted ``eta`` (dashed, one per layer)."""
  shown = [r for r in per_depth if "spectral" in r]
  fig = Figure(figsize=(3.4 * max(len(shown), 1), 3.0), layout="constrained")
  for k, r in enumerate(shown):
    s = r["spectral"]
    ax = fig.add_subplot(1, len(shown), k + 1)
    grid = np.linspace(s["lo"], s["hi"], 200)
    scaled = (2 * grid - (s["hi"] + s["lo"])) / (s["hi"] - s["lo"])
    gd = s["ladder"]["gd"]
    for layer, coef in enumerate(s["coefficients"]):
      line, = ax.plot(grid, np.polynomial.chebyshev.chebval(
          scaled, coef[:s["degree"] + 1]), label=f"layer {layer + 1}")
      steps = gd["steps"][layer]
      ax.plot(grid, (1 - (1 - gd["eta"][0] * (grid + lam)) ** steps)
              / (grid + lam), "--", color=line.get_color(), lw=0.8)
    ax.plot(grid, 1 / (grid + lam), "k:", label="ridge")
    ax.set(title=f"{name}, L = {r['depth']}", xlabel="eigenvalue of A",
           ylabel="filter g")
    ax.legend(fontsize=6)
  return fig


def ladder_figure(results: dict) -> Figure:
  """Held-out D of each rung of the explained-share ladder, per model and depth."""
  fig = Figure(figsize=(6, 3.5), layout="constrained")
  ax = fig.add_subplot()
  rungs = decompile.RUNGS
  for name, per_depth in results["models"].items():
    for r in per_depth:
      if "spectral" not in r:
        continue
      ladder = r["spectral"]["ladder"]
      ys = [ladder[k]["disagreement"] if k in ladder else None for k in rungs]
      ax.plot(range(len(rungs)), [np.nan if y is None else y for y in ys],
              "o-", label=f"{name} L={r['depth']}")
  ax.set(xticks=range(len(rungs)), yscale="log", ylabel="held-out D",
         title="explained-share ladder")
  ax.set_xticklabels(rungs, fontsize=7)
  ax.legend(fontsize=6)
  return fig


def _write_figures(results: dict, wd: workdirs.Workdir) -> None:
  for name, per_depth in results["models"].items():
    wd.save_figure(similarity_figure(per_depth, name),
                   f"figures/similarity_{name}.png")
    wd.save_figure(filters_figure(per_depth, name, results["lam"]),
                   f"figures/filters_{name}.png")
  wd.save_figure(ladder_figure(results), "figures/ladder.png")
  wd.save_figure(schedules_figure(results), "figures/schedules.png")
  wd.save_figure(sensitivity_figure(results), "figures/sensitivity.png")


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict:
  """Trains (if needed), decompiles, writes ``results.json`` and figures; resumes or skips.

  Raises:
    experiments.checks.ConfigError: the config cannot run (nothing written).
    experiments.workdirs.WorkdirInUse: ``workdir`` (or the train workdir) is
      held by another run, or holds another config and ``overwrite`` is off.
    experiments.workdirs.CorruptOutput: a saved file is damaged or altered.
  """
  validate(config)
  train_workdir, finished = _train_run(config, workdir)
  distributed.agree("validate", validate, config)
  # Before the claim: a refusal here writes nothing, so the command it asks
  # for (another train_workdir: another config) is not refused in turn.
  workdirs.check_other_workdir(
      train_workdir, config.train, remedy=(
          "pass another --config.train_workdir (or the train config it holds "
          f"as --config.train.FIELD), or delete {train_workdir!r} to train "
          "there afresh; nothing was written."))
  with distributed.claim_workdir(workdir, config, overwrite=overwrite) as wd:
    done = wd.read_json("results.json")
    if done is not None:
      logging.info("%s: results of this config exist; nothing to do.", workdir)
      return done
    if finished is None:
      logging.info("decompile: no finished train run of config.train at %r; "
                   "training it there first.", train_workdir)
      finished = train.run(config.train, train_workdir)
    else:
      logging.info("decompile: reusing the finished train run at %r.",
                   train_workdir)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
      results = workdirs.finite_or_none(_decompile_all(
          config, wd, train_workdir, finished))
    _write_figures(results, wd)
    wd.write_json("results.json", results)  # last: its presence means done
  for name, per_depth in results["models"].items():
    for r in per_depth:
      logging.info("%s L=%d: %s", name, r["depth"], summary(r))
  return results


def _train_run(config, workdir: str) -> tuple[str, dict | None]:
  """The train run to decompile and its results, if it has finished.

  ``config.train_workdir`` where given; otherwise the first of
  ``<workdir>/train`` and ``<workdir>/../train`` (the train driver's own
  workdir beside this one: ``runs/train`` for ``runs/decompile``) that holds
  a finished run of ``config.train``, else ``<workdir>/train``, where the
  driver trains it first.
  """
  if config.train_workdir:
    candidates = [config.train_workdir]
  else:
    own = os.path.join(workdir, "train")
    beside = os.path.join(os.path.dirname(os.path.abspath(workdir)), "train")
    candidates = [own, beside]
  wanted = checks.config_dict(config.train)
  for candidate in candidates:
    try:
      found, results = train.finished_run(candidate)
    except workdirs.CorruptOutput:
      continue
    if checks.config_dict(found) == wanted:
      return candidate, results
  return candidates[0], None


def _figure(value) -> str:
  """``value`` to 3 significant figures, for the log (the JSON keeps all)."""
  return "n/a" if value is None else f"{value:.3g}"


def summary(result: dict) -> str:
  """One model and depth's answer in words, rounded: the simplest family
  within tolerance (or none) and the closest, with how much nearer it is."""
  best = result.get("best")
  ties = result.get("ties") or []
  head = (f"computes {best}" + (f" (as simple: {', '.join(ties)})" if ties
                                else "")
          if best else "no family within tolerance")
  closest = result.get("closest") or {}
  if not closest.get("family"):
    return head
  than_gd = ("" if "gd" in (closest["family"], closest.get("runner_up")) else
             f", {_figure(closest.get('vs_gd'))}x nearer than gd")
  return (f"{head}; closest {closest['family']} (held-out D "
          f"{_figure(closest.get('disagreement'))}, "
          f"{_figure(closest.get('vs_runner_up'))}x nearer than "
          f"{closest.get('runner_up')}{than_gd})")


def main(argv) -> None:
  distributed.run_main(argv, "decompile", run)


if __name__ == "__main__":
  cli.define_flags("decompile")
  distributed.define_flags()
  app.run(main)
