r"""In-context training of ELSA and LSA stacks on ridge regression, against GD, ridge, least squares.

For every depth ``L`` in ``config.depths`` it trains an ELSA stack (biases on)
and an LSA stack (biases off) on the same natural tokens, then evaluates on
the same held-out tasks against: GD at ``L`` steps with the best step size of
a grid (chosen on the test tasks themselves: an oracle, the strictest
baseline), the constructed ELSA-GD stack (``Natural.gd_params`` at that step
size), ``ridge.solve`` at the tasks' lambda, least squares and the zero
predictor. The same models are evaluated under distribution shifts
(``config.shifts``), with GD's step size kept at its in-distribution value.

Workdir: ``config.json``, ``checkpoints/<model>_L<depth>/`` (orbax, every
``checkpoint_every`` steps: an interrupted run resumes from the last one and
sees the same batches), ``results.json`` (written last) and ``figures/``.
"""

from __future__ import annotations

import logging as std_logging
import os
import time
from typing import Any

from absl import app
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from elsa import training
from experiments import common

MODELS = {"elsa_trained": True, "lsa_trained": False}  # name -> use_bias


def _spec(config, **shift) -> training.TaskSpec:
  return training.TaskSpec(n_train=config.n_train, d=config.d,
                           n_query=config.n_query, lam=config.lam,
                           noise=config.noise, **shift)


def _init(config, *, depth: int, use_bias: bool, dtype):
  key = jax.random.fold_in(jax.random.key(config.seed), depth)
  return training.init_model(
      key, _spec(config), depth=depth, components=config.components,
      inner=config.inner, use_bias=use_bias, tied=config.tied,
      scale=config.init_scale,
      skip_init=use_bias and config.skip_init, dtype=dtype)


def _checkpointed(state, losses):
  return {"state": jax.tree.leaves(state), "losses": losses}


def train_one(config, *, depth: int, use_bias: bool, folder: str,
              progress: common.Progress):
  """Trains (or resumes, or loads) one stack; returns the split and losses ``[steps]``."""
  dtype = jnp.float32
  split = training.split(_init(config, depth=depth, use_bias=use_bias,
                               dtype=dtype))
  tx = training.optimizer(learning_rate=config.learning_rate,
                          steps=config.steps,
                          warmup_steps=config.warmup_steps,
                          clip_norm=config.clip_norm)
  state = training.init_state(split.params, tx)
  losses = np.full(config.steps, np.nan, np.float32)
  manager = ocp.CheckpointManager(
      os.path.abspath(folder),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints))
  start = manager.latest_step()
  if start is not None:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          _checkpointed(state, losses))
    restored = manager.restore(start, args=ocp.args.StandardRestore(target))
    state = jax.tree.unflatten(jax.tree.structure(state), restored["state"])
    losses = np.asarray(restored["losses"])
    logging.info("%s: resumed at step %d", folder, start)
    progress.resumed(start)
  key = jax.random.fold_in(jax.random.key(config.seed), 10_000 + depth)
  step = int(state.step)
  while step < config.steps:
    chunk = min(config.checkpoint_every, config.steps - step)
    state, chunk_losses = training.train_steps(
        state, key, graphdef=split.graphdef, rest=split.rest,
        spec=_spec(config), tx=tx, batch=config.batch, steps=chunk)
    losses[step:step + chunk] = np.asarray(chunk_losses)
    step += chunk
    manager.save(step, args=ocp.args.StandardSave(_checkpointed(state,
                                                                losses)))
    progress.update(chunk)
  manager.wait_until_finished()
  manager.close()
  if not np.isfinite(losses).all():
    logging.warning("%s: training DIVERGED (non-finite loss from step %d); its "
                    "results are reported as diverged.", folder,
                    int(np.argmin(np.isfinite(losses))))
  return split._replace(params=state.params), losses


def _stats(per_task) -> dict[str, float]:
  """Mean and standard error over test tasks."""
  per_task = np.asarray(per_task, np.float64)
  return {"mean": float(per_task.mean()),
          "se": float(per_task.std(ddof=1) / np.sqrt(per_task.size))}


def _depth_evaluator(config, models: dict, eta: float, depth: int):
  """A jitted ``task -> (per-task MSE per model, distances to GD)`` for one depth.

  Built once per depth and reused for every shift: shifts change the tasks,
  not the token layout (``spec.form()``) or the lambda.
  """
  spec = _spec(config)
  trained = {name: training.merge(*runs[depth]) for name, runs in
             models.items()}

  def evaluate(task):
    gd = lambda t: training.gd_predict(t, lam=spec.lam, eta=eta, steps=depth)
    elsa_predict = lambda t: training.model_predict(trained["elsa_trained"],
                                                    spec.form(), t)
    preds = {"gd_best_eta": gd(task),
             "elsa_constructed_gd": training.constructed_gd_predict(
                 task, spec, eta=jnp.float32(eta), depth=depth),
             "ridge": training.ridge_predict(task, lam=spec.lam),
             "least_squares": training.least_squares_predict(task),
             "zero": jnp.zeros_like(task.y_query)}
    for name, model in trained.items():
      preds[name] = training.model_predict(model, spec.form(), task)
    losses = {name: training.mse(pred, task) for name, pred in preds.items()}
    gap = (training.query_sensitivity(elsa_predict, task)
           - training.query_sensitivity(gd, task))
    dist = {"pred_mse_to_gd": training.mse(
                preds["elsa_trained"], task._replace(y_query=preds["gd_best_eta"])),
            "sensitivity_mse_to_gd": jnp.mean(gap**2, axis=(1, 2))}
    return losses, dist

  return jax.jit(evaluate)


def _evaluate(evaluators: list, task) -> dict[str, Any]:
  """Per-depth test losses (mean, se) of every model and baseline on ``task``."""
  per_depth = [evaluate(task) for evaluate in evaluators]
  out = {}
  for part, name in ((0, "test_loss"), (1, "elsa_trained_vs_gd")):
    stats = {key: [_stats(res[part][key]) for res in per_depth]
             for key in per_depth[0][part]}
    out[name] = {k: [s["mean"] for s in v] for k, v in stats.items()}
    out[f"{name}_se"] = {k: [s["se"] for s in v] for k, v in stats.items()}
  return out


def _best_etas(config, task) -> tuple[dict[int, float], dict[str, list]]:
  etas = jnp.linspace(config.eta_min, config.eta_max, config.eta_grid,
                      dtype=jnp.float32)
  best, curves = {}, {}
  for depth in config.depths:
    losses = training.gd_eta_grid_losses(task, lam=config.lam, etas=etas,
                                         steps=depth)
    best[depth] = float(etas[int(jnp.nanargmin(losses))])
    curves[str(depth)] = np.asarray(losses).tolist()
  return best, {"etas": np.asarray(etas).tolist(), "test_loss": curves}


def _write_figures(results: dict, workdir: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  folder = os.path.join(workdir, "figures")
  depths = results["depths"]

  fig, ax = plt.subplots(figsize=(6, 4))
  for name, curves in results["train_loss"].items():
    for depth, curve in zip(depths, curves):
      ax.plot(curve, label=f"{name} L={depth}",
              ls="-" if name.startswith("elsa") else "--")
  ax.set(xlabel="step (mean over chunks)", ylabel="train MSE", yscale="log",
         title="Training loss")
  ax.legend(fontsize=7)
  common.save_figure(fig, os.path.join(folder, "train_loss.png"))

  fig, ax = plt.subplots(figsize=(6, 4))
  for name, losses in results["test_loss"].items():
    ax.errorbar(depths, losses, yerr=1.96 * np.asarray(
        results["test_loss_se"][name]), marker="o", capsize=3, label=name)
  ax.set(xlabel="depth L (layers = GD steps)", ylabel="test MSE",
         yscale="log", title="Test loss vs depth (in distribution)")
  ax.legend(fontsize=7)
  common.save_figure(fig, os.path.join(folder, "test_loss_vs_depth.png"))

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, key in zip(axes, ("pred_mse_to_gd", "sensitivity_mse_to_gd")):
    ax.plot(depths, results["elsa_trained_vs_gd"][key], "o-",
            label="in distribution")
    for shift, res in results["shifted"].items():
      ax.plot(depths, res["elsa_trained_vs_gd"][key], ".:", label=shift)
    ax.set(xlabel="depth L", ylabel=key, yscale="log",
           title=f"trained ELSA vs GD(best eta): {key}")
  axes[1].legend(fontsize=6)
  common.save_figure(fig, os.path.join(folder, "trained_vs_gd.png"))

  names = list(results["shifted"])
  fig, axes = plt.subplots(1, len(depths), figsize=(4 * len(depths), 4),
                           squeeze=False)
  for ax, i in zip(axes[0], range(len(depths))):
    for model in ("elsa_trained", "lsa_trained", "gd_best_eta", "ridge"):
      ax.plot(names, [results["shifted"][s]["test_loss"][model][i]
                      for s in names], "o-", label=model)
    ax.set(yscale="log", title=f"L={depths[i]}: test MSE under shift")
    ax.tick_params(axis="x", rotation=70, labelsize=6)
  axes[0][0].legend(fontsize=7)
  common.save_figure(fig, os.path.join(folder, "shifted_test_loss.png"))


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict:
  """Trains, evaluates, writes ``results.json`` and figures; resumes or skips.

  Returns:
    The results dict (what ``results.json`` holds).
  """
  common.prepare_workdir(workdir, config, overwrite=overwrite)
  done = common.read_json(os.path.join(workdir, "results.json"))
  if done is not None:
    logging.info("%s: results of this config exist; nothing to do.", workdir)
    return done
  start = time.perf_counter()
  progress = common.Progress(len(MODELS) * len(config.depths) * config.steps,
                             name="train", unit="steps")
  models, train_loss = {}, {}
  for name, use_bias in MODELS.items():
    models[name], train_loss[name] = [], []
    for depth in config.depths:
      split, losses = train_one(
          config, depth=depth, use_bias=use_bias, progress=progress,
          folder=os.path.join(workdir, "checkpoints", f"{name}_L{depth}"))
      models[name].append(split)
      train_loss[name].append(
          losses.reshape(-1, config.log_every).mean(axis=1).tolist()
          if config.steps % config.log_every == 0 else losses.tolist())
  train_seconds = time.perf_counter() - start

  test_key = jax.random.fold_in(jax.random.key(config.seed), 20_000)
  task = training.sample_tasks(test_key, _spec(config), batch=config.n_test)
  etas, eta_curves = _best_etas(config, task)
  by_depth = {name: dict(zip(config.depths, runs)) for name, runs in
              models.items()}
  evaluators = [_depth_evaluator(config, by_depth, etas[depth], depth)
                for depth in config.depths]
  results = dict(depths=list(config.depths),
                 gd_best_eta=[etas[depth] for depth in config.depths],
                 gd_eta_grid=eta_curves, train_loss=train_loss,
                 train_seconds=train_seconds,
                 **_evaluate(evaluators, task))
  results["diverged"] = {
      name: [not np.isfinite(loss).all() for loss in train_loss[name]]
      for name in MODELS}
  results["ratio_elsa_to_gd"] = [
      a / b for a, b in zip(results["test_loss"]["elsa_trained"],
                            results["test_loss"]["gd_best_eta"])]
  results["shifted"] = {}
  for name, shift in config.shifts.items():
    spec = _spec(config, **shift)
    shifted = training.sample_tasks(test_key, spec, batch=config.n_test)
    results["shifted"][name] = _evaluate(evaluators, shifted)
  results["seconds"] = time.perf_counter() - start
  _write_figures(results, workdir)
  common.write_json(os.path.join(workdir, "results.json"), results)
  for i, depth in enumerate(config.depths):
    logging.info("L=%d: " + ", ".join(f"{k} %.4g" for k in results["test_loss"]),
                 depth, *(v[i] for v in results["test_loss"].values()))
  return results


def _quiet_orbax() -> None:
  """Orbax logs every checkpoint save at INFO; keep only its warnings."""
  logging.get_absl_handler().addFilter(
      lambda record: (record.levelno >= std_logging.WARNING
                      or "orbax" not in record.pathname))


def main(argv) -> None:
  _quiet_orbax()
  common.run_main(argv, "train", run)


if __name__ == "__main__":
  common.define_flags("train")
  app.run(main)
