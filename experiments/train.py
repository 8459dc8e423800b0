r"""In-context training of ELSA, LSA and LSA-with-residual stacks on ridge regression, against the baselines.

For every depth ``L`` in ``config.depths`` it trains each model of
``config.models`` on the same natural tokens, widths and budget:

* ``elsa_trained``: ELSA (biases on), no residual; component 0 of every layer
  starts at the exact skip (``config.skip_init``);
* ``lsa_trained``: the same stack without biases (plain LSA);
* ``lsa_residual_trained``: the LSA the field studies (von Oswald et al.
  2023, Ahn et al. 2023, Zhang et al. 2023): the residual stream
  ``h <- h + sum_c lsa(p_c, h)`` (``elsa.nn``'s ``residual=True``) with only
  the example tokens in the key/value sums (``key_mask``: the queries read
  but are not read).
* ``elsa_masked``: ELSA (biases on, skip-initialised, no residual) with the
  key mask of ``lsa_residual_trained``: the two on the same footing.

Tuning is the same for every model: each trains at every point of one grid
``config.learning_rates x config.init_scales`` (the grid runs as one compiled
program, every point on the same batches), and the point with the lowest MSE
on VALIDATION tasks (drawn from their own key, never the test tasks) is the
model's; a point whose training or validation loss is not finite is skipped
and reported as diverged. GD's step size is chosen the same way, on the
validation tasks, from ``eta_grid`` points in ``[eta_min, eta_max]``.

On the test tasks every model meets: the Bayes-optimal posterior mean
(``training.bayes_predict``: ridge at ``noise^2 / (N w_scale^2)``), ridge at
the tasks' lambda, least squares, GD at its chosen step size, the constructed
ELSA-GD stack at that step size, and zero; per model, the paired per-task
difference to the Bayes predictor. Analysis (von Oswald et al.): the query
prediction decoded after every layer against GD step ``t`` and the Bayes
predictor, and the cosine similarity and relative L2 distance of
``d pred / d x_q`` to GD at each depth. The same models are evaluated under
distribution shifts (``config.shifts``) with GD's in-distribution step size.

Workdir (claimed as every driver claims it, :func:`experiments.workdirs.claim_workdir`:
held exclusively for the run, every output tied to the config's hash and a
checksum): ``config.json``, ``checkpoints/<model>_L<depth>/`` (orbax, the whole
grid every ``checkpoint_every`` steps, sealed like every output: an
interrupted run resumes from the last one and sees the same batches; one of
another config or damaged is refused by name), ``results.json`` (written
last) and ``figures/``. Every config field, the shifts' too, and the memory
the run needs are checked first (:func:`validate`).

This module is the run's order of work; each step has its module:
:mod:`experiments.train_setup` (models, tasks, grid, initial state),
:mod:`experiments.train_checks` (the config checked whole),
:mod:`experiments.grid_training` (one model over the grid, on the mesh),
:mod:`experiments.checkpoints` (saved state, and a finished run read back),
:mod:`experiments.evaluation` (models, baselines and references on the test
tasks), :mod:`experiments.loss_stats` (per-prompt summaries),
:mod:`experiments.tables` and :mod:`experiments.plotting` (what is shown).
"""

from __future__ import annotations

import os
import time

from absl import app
from absl import logging
import jax
import ml_collections

from elsa import training
from experiments import checks
from experiments import cli
from experiments import distributed
from experiments import evaluation
from experiments import grid_training
from experiments import plotting
from experiments import prefix_protocol
from experiments import tables
from experiments import tracking
from experiments import train_checks
from experiments import train_setup
from experiments import workdirs
# Read from here by the decompile drivers and the benchmark: a finished run
# and its models, the run's tasks and models, the compiled GD-from-mu stack.
from experiments.checkpoints import finished_run, load_trained, trained_model  # pylint: disable=unused-import
from experiments.evaluation import compiled_gd_from  # pylint: disable=unused-import
from experiments.train_setup import MODELS, task_spec  # pylint: disable=unused-import


def _task_run_config(config, name: str) -> ml_collections.ConfigDict:
  """``config`` with the fields of ``config.task_runs[name]`` and no runs of its own."""
  sub = ml_collections.ConfigDict(config.to_dict())
  overrides = sub.task_runs[name].to_dict()
  sub.task_runs = ml_collections.ConfigDict()
  sub.update_from_flattened_dict(
      {k: v for k, v in overrides.items() if k != "task_options"})
  # The run's options alone: every other option unset.
  sub.task_options = ml_collections.ConfigDict({
      **dict.fromkeys(sub.task_options), **overrides.get("task_options", {})})
  return sub


def _run_task_runs(config, workdir: str, *, overwrite: bool) -> dict:
  """Each run of ``config.task_runs`` in ``workdir/<name>``, one after
  another (each resumes or skips like any run); every one is validated
  before the first starts. Returns ``{name: results}``."""
  subs = {name: _task_run_config(config, name) for name in config.task_runs}
  for name, sub in subs.items():
    try:
      train_checks.validate(sub)
    except checks.ConfigError as err:
      raise checks.ConfigError(f"config.task_runs.{name}: {err}") from None
  return {name: run(sub, os.path.join(workdir, name), overwrite=overwrite)
          for name, sub in subs.items()}


def validate(config: ml_collections.ConfigDict) -> None:
  """The config checked whole before any work: the field's protocol
  (:func:`experiments.prefix_protocol.validate`) or the stacks' runs
  (:func:`experiments.train_checks.validate`)."""
  if config.get("protocol") == "prefix":
    prefix_protocol.validate(config)
  else:
    train_checks.validate(config)


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict:
  """Trains, tunes, evaluates, writes ``results.json`` and figures; resumes or skips.

  Returns:
    The results dict (what ``results.json`` holds).
  """
  if config.get("protocol") == "prefix":  # experiments/configs/prefix.py
    return prefix_protocol.run(config, workdir, overwrite=overwrite)
  if config.get("task_runs"):
    return _run_task_runs(config, workdir, overwrite=overwrite)
  groups, shards = distributed.agree("validate", train_checks.check_devices, config)
  with distributed.claim_workdir(workdir, config, overwrite=overwrite) as wd:
    done = wd.read_json("results.json")
    if done is not None:
      logging.info("%s: results of this config exist; nothing to do.", workdir)
      return done
    tracker = tracking.Tracker(wd)
    try:
      return _run(config, wd, distributed.mesh((groups, shards),
                                               ("grid", "batch")), tracker)
    finally:
      tracker.close()


def _run(config: ml_collections.ConfigDict, wd: workdirs.Workdir, mesh,
         tracker: tracking.Tracker) -> dict:
  start = time.perf_counter()
  points = train_setup.grid(config)
  logging.info("train: %d grid points in %d groups, each batch over %d of "
               "%d %s devices", len(points), mesh.shape["grid"],
               mesh.shape["batch"], mesh.size, jax.default_backend())
  progress = cli.Progress(
      len(config.models) * len(config.depths) * config.steps * len(points),
      name="train", unit="steps")
  # A family's references first: one that is not finite on the test
  # prompts stops the run before any training.
  refs = None
  if config.task != train_setup.DEFAULT_TASK:
    with jax.default_matmul_precision("highest"):
      refs = evaluation.reference_losses(config)
  # Validation tasks: their own key (salt 30_000), never the test tasks'.
  val_task = train_setup.sample_tasks(config, 30_000)
  trained, train_loss, tuning, ms_per_step = {}, {}, {}, {}
  for name in config.models:
    trained[name], train_loss[name], tuning[name] = {}, [], []
    ms_per_step[name] = []
    for depth in config.depths:
      split, losses, seconds = grid_training.train_one(
          config, name=name, depth=depth, wd=wd, progress=progress,
          mesh=mesh, tracker=tracker)
      choice = grid_training.select(config, split, losses, val_task)
      index = choice.pop("index")
      if index is not None:
        trained[name][depth] = training.merge(*train_setup.pick(split, index))
      curve = losses[0 if index is None else index]
      train_loss[name].append(
          curve.reshape(-1, config.log_every).mean(axis=1).tolist()
          if config.steps % config.log_every == 0 else curve.tolist())
      tuning[name].append(choice)
      ms_per_step[name].append(None if seconds is None else 1e3 * seconds)
  train_seconds = time.perf_counter() - start

  etas, eta_curves = evaluation.best_etas(config, val_task)
  ridge_task = config.task == train_setup.DEFAULT_TASK
  results = dict(depths=list(config.depths), models=list(config.models),
                 grid=[list(p) for p in points], tuning=tuning,
                 gd_best_eta=[etas[d] for d in config.depths],
                 gd_eta_grid=eta_curves,
                 bayes_lam=(training.bayes_lam(train_setup.task_spec(config)) if ridge_task
                            else None),
                 train_loss=train_loss, train_seconds=train_seconds,
                 ms_per_step=ms_per_step)
  # Exact float32 products on GPU/TPU too (their default is bfloat16 passes):
  # the GD references and the constructed stack must agree to rounding.
  with jax.default_matmul_precision("highest"):
    results.update(
        evaluation.evaluate_ridge(config, trained, etas) if ridge_task else
        evaluation.evaluate_family(config, trained, etas, val_task, refs))
  results["diverged"] = {name: [t["learning_rate"] is None for t in tuning[name]]
                         for name in config.models}
  gd = results["test_loss"]["gd_best_eta"]
  results["ratio_to_gd"] = {name: [a / b for a, b in zip(
      results["test_loss"][name], gd)] for name in config.models}
  results["seconds"] = time.perf_counter() - start
  # What results.json will hold (non-finite numbers as None), returned too.
  results = workdirs.finite_or_none(results)
  _track_evaluation(config, results, tracker)
  for name, figure in plotting.train_figures(results).items():
    wd.save_figure(figure, f"figures/{name}.png")
  wd.write_json("results.json", results)
  if not ridge_task:
    scale = train_setup.train_spec(config).family.error_scale(config.d)
    logging.info("%s, squared error / %.3g (mean / median (minus %s ± se)):"
                 "\n%s", config.task, scale, results["best_reference"],
                 tables.family_table(results, scale=1 / scale))
  for i, depth in enumerate(config.depths):
    # A model whose whole grid diverged has no test loss (None).
    logging.info("L=%d: %s", depth, ", ".join(
        f"{name} {'diverged' if losses[i] is None else f'{losses[i]:.4g}'}"
        for name, losses in results["test_loss"].items()))
  return results


def _track_evaluation(config, results: dict, tracker: tracking.Tracker
                      ) -> None:
  """Validation losses per grid point, test losses per model and baseline
  (TensorBoard step: the depth), and the config with the deepest test losses."""
  for name in config.models:
    for depth, choice in zip(config.depths, results["tuning"][name]):
      tracker.scalars(config.steps, {
          f"validation/{grid_training.point_tag(name, depth, lr, scale)}/loss": loss
          for (lr, scale), loss in zip(train_setup.grid(config), choice["val_loss"])})
  for name, by_depth in results["test_loss"].items():
    for depth, loss in zip(config.depths, by_depth):
      tracker.scalars(depth, {f"test/{name}/loss": loss})
  tracker.hparams(config, {f"test/{name}/loss_at_L{max(config.depths)}":
                           by_depth[-1] for name, by_depth in
                           results["test_loss"].items()})


def main(argv) -> None:
  distributed.run_main(argv, "train", run)



if __name__ == "__main__":
  cli.define_flags("train")
  distributed.define_flags()
  app.run(main)
