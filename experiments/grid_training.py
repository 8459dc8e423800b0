"""One model trained over the whole tuning grid on the device mesh,
checkpointed, and the grid point its validation loss chooses.

:func:`train_one` runs every grid point of one model at one depth as one
compiled program (``vmap`` over the grid, the batch split over the mesh's
``batch`` axis), resumes from its last checkpoint
(:mod:`experiments.checkpoints`) and logs every step's loss and learning rate;
:func:`select` picks the point of lowest validation MSE among those that did
not diverge.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from elsa import ridge
from elsa import training
from experiments import checkpoints
from experiments import cli
from experiments import distributed
from experiments import tracking
from experiments import train_setup
from experiments import workdirs


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "tx",
                                             "batch", "steps", "mesh"),
                   donate_argnames=("states",))
def _sharded_grid_steps(states, key_data, rest, *, graphdef, spec, tx,
                        batch: int, steps: int, mesh):
  """``training.train_grid_steps`` on a ``("grid", "batch")`` mesh.

  ``states`` is donated: the chunk's new states take its buffers (the caller
  holds only the result).

  ``states`` (replicated) has its grid axis split as ``[groups, G / groups,
  ...]``: the groups go to the mesh's ``grid`` axis, each group's points run
  one after another, and every step's batch is split over ``batch``. Returns
  the states and losses ``[groups, G / groups, steps]``, replicated (every
  process reads them; the parameters are small).
  """
  split = lambda tree: jax.lax.with_sharding_constraint(
      tree, NamedSharding(mesh, PartitionSpec("grid")))
  run = lambda state: training.train_grid_steps(
      state, jax.random.wrap_key_data(key_data), graphdef=graphdef,
      rest=rest, spec=spec, tx=tx, batch=batch, steps=steps,
      batch_sharding=NamedSharding(mesh, PartitionSpec("batch")))
  out = jax.vmap(run, spmd_axis_name="grid")(split(states))
  return jax.lax.with_sharding_constraint(
      out, NamedSharding(mesh, PartitionSpec()))


@functools.partial(jax.jit, static_argnames=("spec", "batch", "steps",
                                             "dtype"))
def _family_batches(key_data, start, *, spec: train_setup.FamilySpec,
                    batch: int, steps: int, dtype) -> ridge.Task:
  """The training batches of steps ``start .. start + steps - 1``, stacked:
  fields ``[steps, batch, ...]``; step ``s`` draws from ``fold_in(key, s)``
  (a resumed run sees the same batches).

  Drawn apart from the training step so that one compiled training program
  serves every family of the same sizes (``:tasks`` runs eleven families in
  one process; the training scan's compilation, not its steps, was most of
  each run's time)."""
  key = jax.random.wrap_key_data(key_data)
  return jax.vmap(lambda s: spec.sample(jax.random.fold_in(key, s),
                                        batch=batch, dtype=dtype))(
                                            start + jnp.arange(steps))


@functools.partial(jax.jit, static_argnames=("graphdef", "form", "tx", "mesh"),
                   donate_argnames=("states",))
def _sharded_family_steps(states, batches, rest, *, graphdef, form, tx, mesh):
  """:func:`_sharded_grid_steps` on given batches (:func:`_family_batches`):
  step ``s`` of the chunk takes ``batches[s]``, every grid point on the same
  batch, each batch split over the mesh's ``batch`` axis. Returns the states
  and losses ``[groups, G / groups, steps]``, replicated."""
  split = lambda tree: jax.lax.with_sharding_constraint(
      tree, NamedSharding(mesh, PartitionSpec("grid")))
  batch_sharding = NamedSharding(mesh, PartitionSpec("batch"))

  def run(states):
    def body(states, task):
      task = jax.lax.with_sharding_constraint(task, batch_sharding)
      return jax.lax.map(lambda state: training.train_step_on_batch(
          state, task, graphdef=graphdef, rest=rest, form=form, tx=tx),
                         states)
    states, losses = jax.lax.scan(body, states, batches)
    return states, losses.T

  out = jax.vmap(run, spmd_axis_name="grid")(split(states))
  return jax.lax.with_sharding_constraint(
      out, NamedSharding(mesh, PartitionSpec()))


def _learning_rate(config, peaks: np.ndarray, step: int) -> np.ndarray:
  """The rate of ``training.optimizer`` with each of the ``peaks`` at
  ``step`` (what that step's update was scaled by)."""
  shape = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=1.0, warmup_steps=config.warmup_steps,
      decay_steps=max(config.steps, config.warmup_steps + 1),
      end_value=config.end_fraction)
  return peaks * np.asarray(shape(step))


def point_tag(name: str, depth: int, lr: float, scale: float) -> str:
  # TensorBoard's tags have no "+" ("1e+30" is renamed, with a log line per
  # step): exponents as "1e30".
  return (f"{name}/L{depth}/lr_{lr:g}_init_scale_{scale:g}").replace("+", "")


def _track_steps(config, tracker: tracking.Tracker, tags: list[str],
                 peaks: np.ndarray, losses: np.ndarray, begin: int,
                 end: int) -> None:
  """Every grid point's loss and learning rate at steps ``begin..end-1``."""
  for i in range(begin, end):
    tracker.scalars(i, {f"train/{tag}/loss": loss
                        for tag, loss in zip(tags, losses[:, i])})
    tracker.scalars(i, {f"train/{tag}/learning_rate": rate for tag, rate in
                        zip(tags, _learning_rate(config, peaks, i))})


def train_one(config, *, name: str, depth: int, wd: workdirs.Workdir,
              progress: cli.Progress, mesh, tracker: tracking.Tracker):
  """Trains (or resumes, or loads) one model over the whole grid, on ``mesh``,
  checkpointed in ``checkpoints/<name>_L<depth>/`` of ``wd``.

  ``mesh``: axes ``("grid", "batch")`` over every device (:func:`layout`).
  Process 0 alone checkpoints (every ``checkpoint_every`` steps) and
  restores; the others take its restored state. Every step's loss and
  learning rate of every grid point go to ``tracker``'s sub-tracker
  ``<name>_L<depth>``, rewritten whole: the restored steps too.

  Returns:
    the split with parameters stacked over the ``G`` grid points, the losses
    ``[G, steps]`` and the seconds per step per grid point of the chunks
    after the first (which compiles); ``None`` if fewer than two chunks ran.
  """
  split, tx, state, losses = train_setup.untrained(config, name=name, depth=depth)
  points = train_setup.grid(config)
  relative = checkpoints.checkpoint_dir(name, depth)
  folder = wd.path(relative)
  manager, start = None, None
  if distributed.is_writer():
    wd.own(relative, tree=True)
    manager = ocp.CheckpointManager(
        os.path.abspath(folder), options=ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_checkpoints, create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes={0})))
    start, state, losses = checkpoints.restore(config, manager, wd, folder, state,
                                    losses, name=name, depth=depth)
  if start is not None:
    logging.info("%s: resumed at step %d", folder, start)
  if jax.process_count() > 1:
    start, state, losses = distributed.to_host(
        multihost_utils.broadcast_one_to_all(
            (-1 if start is None else start, state, losses)))
    start, losses = None if start < 0 else int(start), np.array(losses)
  if start is not None:
    progress.resumed(start * len(points))
  groups = mesh.shape["grid"]
  replicated = NamedSharding(mesh, PartitionSpec())
  on_mesh = lambda tree: jax.tree.map(
      lambda a: distributed.put(a, replicated), tree)
  grouped = on_mesh(jax.tree.map(
      lambda a: np.reshape(a, (groups, -1, *np.shape(a)[1:])), state))
  key = jax.random.fold_in(jax.random.key(config.seed), 10_000 + depth)
  key_data, rest = on_mesh((jax.random.key_data(key), split.rest))
  point_tracker = tracker.sub(f"{name}_L{depth}")
  track = functools.partial(
      _track_steps, config, point_tracker,
      [point_tag(name, depth, lr, scale) for lr, scale in points],
      np.asarray([lr for lr, _ in points]))
  track(losses, 0, start or 0)  # the restored steps: each step's events once
  step = start or 0
  timed_steps, timed_seconds = 0, 0.0
  while step < config.steps:
    chunk = min(config.checkpoint_every, config.steps - step)
    tic = time.perf_counter()
    if config.task == train_setup.DEFAULT_TASK:
      grouped, chunk_losses = _sharded_grid_steps(
          grouped, key_data, rest, graphdef=split.graphdef,
          spec=train_setup.task_spec(config), tx=tx, batch=config.batch, steps=chunk,
          mesh=mesh)
    else:
      grouped, chunk_losses = _sharded_family_steps(
          grouped, _family_batches(
              key_data, step, spec=train_setup.train_spec(config),
              batch=config.batch, steps=chunk,
              dtype=train_setup.dtype(config)), rest,
          graphdef=split.graphdef, form=train_setup.task_spec(config).model_tokens(), tx=tx,
          mesh=mesh)
    losses[:, step:step + chunk] = np.reshape(chunk_losses, (-1, chunk))
    if step > (start or 0):  # the first chunk of a process compiles
      timed_steps += chunk
      timed_seconds += time.perf_counter() - tic
    track(losses, step, step + chunk)
    step += chunk
    state = jax.tree.map(lambda a: np.reshape(a, (-1, *np.shape(a)[2:])),
                         distributed.to_host(grouped))
    if manager is not None:
      manager.save(step, args=ocp.args.StandardSave(checkpoints.checkpointed(
          wd, state, losses, checkpoints.checkpoint_identity(config, name=name, depth=depth,
                                       step=step))))
    progress.update(chunk * len(points))
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  point_tracker.close()
  for (lr, scale), point_losses in zip(points, losses):
    if not np.isfinite(point_losses).all():
      logging.warning("%s: lr=%g init_scale=%g DIVERGED (non-finite loss from "
                      "step %d); skipped in tuning.", folder, lr, scale,
                      int(np.argmin(np.isfinite(point_losses))))
  seconds = (timed_seconds / timed_steps / len(points) if timed_steps
             else None)
  return split._replace(params=state.params), losses, seconds


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _grid_val_loss(params, rest, task, *, graphdef, spec):
  return jnp.mean(training.grid_loss(params, task, graphdef=graphdef,
                                     rest=rest, form=spec.model_tokens()),
                  axis=-1)


def select(config, split: training.Split, losses: np.ndarray, task
            ) -> dict[str, Any]:
  """The grid point with the lowest validation MSE among those that did not diverge."""
  val = np.asarray(_grid_val_loss(split.params, split.rest, task,
                                  graphdef=split.graphdef,
                                  spec=train_setup.task_spec(config)), np.float64)
  diverged = ~np.isfinite(losses).all(axis=1) | ~np.isfinite(val)
  points = train_setup.grid(config)
  chosen = None
  if not diverged.all():
    chosen = int(np.argmin(np.where(diverged, np.inf, val)))
  return {"index": chosen,
          "learning_rate": None if chosen is None else points[chosen][0],
          "init_scale": None if chosen is None else points[chosen][1],
          "val_loss": val.tolist(),
          "diverged": [list(p) for p, d in zip(points, diverged) if d]}

