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

import functools
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
from experiments import plotting

MODELS = {"elsa_trained": True, "lsa_trained": False}  # name -> use_bias
# Models, training batches and test tasks alike (also under jax_enable_x64).
DTYPE = jnp.float32


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


@functools.lru_cache(maxsize=None)
def _optimizer(*, learning_rate: float, steps: int, warmup_steps: int,
               clip_norm: float | None):
  """``training.optimizer``, one object per setting.

  The optimizer is a static argument of the compiled train step: an equal
  object lets a later run in the same process (a notebook, the tests) reuse
  that compilation instead of repeating it.
  """
  return training.optimizer(learning_rate=learning_rate, steps=steps,
                            warmup_steps=warmup_steps, clip_norm=clip_norm)


def _checkpointed(state, losses):
  return {"state": jax.tree.leaves(state), "losses": losses}


def train_one(config, *, depth: int, use_bias: bool, folder: str,
              progress: common.Progress):
  """Trains (or resumes, or loads) one stack; returns the split and losses ``[steps]``."""
  split = training.split(_init(config, depth=depth, use_bias=use_bias,
                               dtype=DTYPE))
  tx = _optimizer(learning_rate=config.learning_rate, steps=config.steps,
                  warmup_steps=config.warmup_steps, clip_norm=config.clip_norm)
  state = training.init_state(split.params, tx)
  losses = np.full(config.steps, np.nan, DTYPE)
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
                 task, spec, eta=DTYPE(eta), depth=depth),
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
                      dtype=DTYPE)
  best, curves = {}, {}
  for depth in config.depths:
    losses = training.gd_eta_grid_losses(task, lam=config.lam, etas=etas,
                                         steps=depth)
    best[depth] = float(etas[int(jnp.nanargmin(losses))])
    curves[str(depth)] = np.asarray(losses).tolist()
  return best, {"etas": np.asarray(etas).tolist(), "test_loss": curves}


def _write_figures(results: dict, workdir: str) -> None:
  folder = os.path.join(workdir, "figures")
  for name, draw in (("train_loss", plotting.train_loss),
                     ("test_loss_vs_depth", plotting.test_loss_vs_depth),
                     ("trained_vs_gd", plotting.trained_vs_gd),
                     ("shifted_test_loss", plotting.shifted_test_loss)):
    common.save_figure(draw(results), os.path.join(folder, f"{name}.png"))


def _evaluate_all(config, models: dict) -> dict[str, Any]:
  """Best GD step sizes, then every model and baseline in distribution and shifted."""
  test_key = jax.random.fold_in(jax.random.key(config.seed), 20_000)
  task = training.sample_tasks(test_key, _spec(config), batch=config.n_test,
                               dtype=DTYPE)
  etas, eta_curves = _best_etas(config, task)
  by_depth = {name: dict(zip(config.depths, runs)) for name, runs in
              models.items()}
  evaluators = [_depth_evaluator(config, by_depth, etas[depth], depth)
                for depth in config.depths]
  out = dict(gd_best_eta=[etas[depth] for depth in config.depths],
             gd_eta_grid=eta_curves, **_evaluate(evaluators, task))
  out["shifted"] = {}
  for name, shift in config.shifts.items():
    shifted = training.sample_tasks(test_key, _spec(config, **shift),
                                    batch=config.n_test, dtype=DTYPE)
    out["shifted"][name] = _evaluate(evaluators, shifted)
  return out


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

  results = dict(depths=list(config.depths), train_loss=train_loss,
                 train_seconds=train_seconds)
  # Exact float32 products on GPU/TPU too (their default is bfloat16 passes):
  # the GD references and the constructed stack must agree to rounding.
  with jax.default_matmul_precision("highest"):
    results.update(_evaluate_all(config, models))
  results["diverged"] = {
      name: [not np.isfinite(loss).all() for loss in train_loss[name]]
      for name in MODELS}
  results["ratio_elsa_to_gd"] = [
      a / b for a, b in zip(results["test_loss"]["elsa_trained"],
                            results["test_loss"]["gd_best_eta"])]
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
