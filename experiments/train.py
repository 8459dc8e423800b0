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
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging as std_logging
import math
import os
import time
from typing import Any

from absl import app
from absl import logging
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from elsa import algorithms
from elsa import attention
from elsa import programs
from elsa import ridge
from elsa import tasks as task_families
from elsa import training
from experiments import checks
from experiments import cli
from experiments import distributed
from experiments import plotting
from experiments import tracking
from experiments import workdirs

# name -> switches of training.init_model.
MODELS = {"elsa_trained": dict(use_bias=True, residual=False,
                               context_only=False),
          "lsa_trained": dict(use_bias=False, residual=False,
                              context_only=False),
          "lsa_residual_trained": dict(use_bias=False, residual=True,
                                       context_only=True),
          "elsa_masked": dict(use_bias=True, residual=False,
                              context_only=True)}
BASELINES = ("bayes_optimal", "gd_best_eta", "elsa_constructed_gd", "ridge",
             "least_squares", "zero")
# Models, training batches and test tasks alike (also under jax_enable_x64).
DTYPE = jnp.float32
# config.task: today's ridge task (training.TaskSpec, with its shifts), or a
# family of elsa.tasks (with config.task_options).
DEFAULT_TASK = "ridge"


def task_spec(config, **shift) -> training.TaskSpec:
  """The config's ridge tasks (what the models read, on any family: its
  layout, ``lam`` and noise); a shift's ``x_scale`` multiplies the config's, its
  other fields replace the config's."""
  fields = {"x_dist": config.x_dist, **shift,
            "x_scale": config.x_scale * shift.get("x_scale", 1.0)}
  return training.TaskSpec(n_train=config.n_train, d=config.d,
                           n_query=config.n_query, lam=config.lam,
                           noise=config.noise, tokens=config.tokens, **fields)


# What a shift (``config.shifts.NAME``) may set: the tasks' distribution,
# never their shape.
SHIFT_FIELDS = ("x_scale", "w_scale", "x_skew", "x_dist", "noise_labels")


def validate(config: ml_collections.ConfigDict) -> None:
  """Every field in its range, shifts included, and a run that fits in
  memory, before the workdir is touched.

  Raises:
    checks.ConfigError: naming the field and what is allowed.
  """
  checks.check_seed(config)
  _check_task(config)
  checks.check_items(config, "models", choices=tuple(MODELS))
  checks.check_choice(config, "tokens", training.TOKENS)
  checks.check_choice(config, "x_dist", training.X_DISTRIBUTIONS)
  checks.check_items(config, "depths", integer=True, low=1)
  for field in ("n_train", "d", "components", "steps", "batch", "log_every",
                "checkpoint_every", "keep_checkpoints", "eta_grid"):
    checks.check_int(config, field)
  checks.check_int(config, "n_query", low=1)
  checks.check_int(config, "n_test", low=2)  # a standard error needs two
  if config.n_test % min(checks.check_int(config, "eval_chunk"), config.n_test):
    raise checks.ConfigError(
        f"config.eval_chunk must divide config.n_test ({config.n_test}) or "
        f"exceed it, got {config.eval_chunk}.")
  checks.check_int(config, "warmup_steps", low=0, high=config.steps)
  if config.inner is not None:
    checks.check_int(config, "inner")
  checks.check_float(config, "lam", low=0)
  checks.check_float(config, "noise", low=0)
  if config.clip_norm is not None:
    checks.check_float(config, "clip_norm", low=0, low_open=True)
  checks.check_float(config, "x_scale", low=0, low_open=True)
  checks.check_float(config, "end_fraction", low=0, high=1)
  checks.check_float(config, "eta_min", low=0, low_open=True)
  checks.check_float(config, "eta_max", low=config.eta_min, low_open=True)
  for field in ("learning_rates", "init_scales"):
    checks.check_items(config, field, low=0, low_open=True)
  if config.steps % config.log_every:
    raise checks.ConfigError(
        f"config.log_every must divide config.steps ({config.steps}), got "
        f"{config.log_every}.")
  for name, shift in config.shifts.items():
    _check_shift(name, shift)
  checks.check_fits(bytes_needed(config), fields=(
      "n_train, d, n_query, depths, components, inner, batch, n_test, "
      "eval_chunk, eta_grid, steps and the grid"))


def _check_shift(name: str, shift) -> None:
  if not isinstance(shift, (dict, ml_collections.ConfigDict)):
    raise checks.ConfigError(f"config.shifts.{name} must be a dict of shift "
                             f"fields ({', '.join(SHIFT_FIELDS)}), got "
                             f"{shift!r}.")
  for field, value in shift.items():
    where = f"shifts.{name}.{field}"
    one = {where: value}  # the checks read config[field] and name the field
    if field in ("x_scale", "w_scale"):
      checks.check_float(one, where, low=0, low_open=True)
    elif field == "x_skew":
      checks.check_float(one, where)
    elif field == "x_dist":
      checks.check_choice(one, where, training.X_DISTRIBUTIONS)
    elif field == "noise_labels" and not isinstance(value, bool):
      raise checks.ConfigError(f"config.{where} must be True or False, got "
                               f"{value!r}.")
    elif field not in SHIFT_FIELDS:
      raise checks.ConfigError(f"config.{where} is not a shift field; a shift "
                               f"sets {', '.join(SHIFT_FIELDS)}.")


def bytes_needed(config: ml_collections.ConfigDict) -> int:
  """About what a run holds at once, in float32 (within a few times): the
  test, validation and one shifted set of tasks; one grid point's training
  batch with every layer's state and projections (kept for the gradient);
  one evaluation chunk of every model with its input gradient; GD's
  step-size grid; the grid's parameters with Adam's moments; the losses."""
  form = task_spec(config).model_tokens()
  depth, k = max(config.depths), config.inner or form.n
  per_layer = config.components * (form.m * (form.n + 3 * k) + k * k)
  tasks = 3 * config.n_test * (config.n_train + config.n_query) * (config.d
                                                                   + 1)
  train_batch = 3 * config.batch * (depth + 1) * per_layer
  evaluation = (3 * len(config.models) * min(config.eval_chunk, config.n_test)
                * (depth + 1) * per_layer)
  eta_grid = config.eta_grid * config.n_test * (config.d + config.n_query)
  points = len(config.learning_rates) * len(config.init_scales)
  params = 3 * points * depth * config.components * (3 * k * (form.n + 1)
                                                     + form.m)
  losses = points * config.steps * len(config.models) * len(config.depths)
  return 4 * (tasks + train_batch + evaluation + eta_grid + params + losses)


def grid(config) -> list[tuple[float, float]]:
  """The tuning grid, ``(learning_rate, init_scale)`` pairs in a fixed order."""
  return list(itertools.product(config.learning_rates, config.init_scales))


def layout(config) -> tuple[int, int]:
  """``(groups, shards)``: every device, as ``groups`` of grid points times
  ``shards`` of each batch.

  The grid takes as many devices as divide it (its points share nothing: no
  communication), the batch the rest (data-parallel: the loss's mean, and so
  the gradients, reduced over them by XLA each step): ``groups = gcd(devices,
  grid points)``.

  Raises:
    checks.ConfigError: ``config.batch`` does not split over the shards.
  """
  devices = jax.device_count()
  groups = math.gcd(devices, len(grid(config)))
  shards = devices // groups
  if config.batch % shards:
    raise checks.ConfigError(
        f"config.batch must be a multiple of {shards} to split over the "
        f"{devices} devices ({groups} groups of the {len(grid(config))} grid "
        f"points, each batch over {shards}), got {config.batch}.")
  return groups, shards


def check_devices(config) -> tuple[int, int]:
  """:func:`validate` (whose memory estimate, the whole run on this
  process's smallest device, bounds any device's share), then the
  :func:`layout` of the devices, which it returns."""
  validate(config)
  return layout(config)


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


def _learning_rate(config, peaks: np.ndarray, step: int) -> np.ndarray:
  """The rate of ``training.optimizer`` with each of the ``peaks`` at
  ``step`` (what that step's update was scaled by)."""
  shape = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=1.0, warmup_steps=config.warmup_steps,
      decay_steps=max(config.steps, config.warmup_steps + 1),
      end_value=config.end_fraction)
  return peaks * np.asarray(shape(step))


def _point_tag(name: str, depth: int, lr: float, scale: float) -> str:
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


def _init(config, *, name: str, depth: int, init_scale: float, dtype):
  # One key per depth for every model and scale: the random part of the
  # weights is the same draw, only its scale differs.
  key = jax.random.fold_in(jax.random.key(config.seed), depth)
  switches = MODELS[name]
  return training.init_model(
      key, _train_spec(config), depth=depth,
      components=config.components,
      inner=config.inner, tied=config.tied, scale=init_scale,
      skip_init=switches["use_bias"] and config.skip_init, dtype=dtype,
      **switches)


def _init_grid(config, *, name: str, depth: int) -> training.Split:
  """The split of one model with its ``nnx.Param`` leaves stacked over the grid."""
  splits = [training.split(_init(config, name=name, depth=depth,
                                 init_scale=scale, dtype=DTYPE))
            for _, scale in grid(config)]
  params = jax.tree.map(lambda *leaves: jnp.stack(leaves),
                        *(s.params for s in splits))
  return splits[0]._replace(params=params)


@functools.lru_cache(maxsize=None)
def _optimizer(*, learning_rate: float, steps: int, warmup_steps: int,
               end_fraction: float, clip_norm: float | None):
  """``training.optimizer``, one object per setting.

  The optimizer is a static argument of the compiled train step: an equal
  object lets a later run in the same process (a notebook, the tests) reuse
  that compilation instead of repeating it. The grid's learning rates are
  traced values in its state, so one object serves the whole grid.
  """
  return training.optimizer(learning_rate=learning_rate, steps=steps,
                            warmup_steps=warmup_steps,
                            end_fraction=end_fraction, clip_norm=clip_norm)


def _identity(config, *, name: str, depth: int, step: int) -> dict:
  """What a checkpoint is: the model, its depth, the grid's points (in their
  order) and the step; sealed in with the config's hash."""
  return checks.canonical({"model": name, "depth": depth,
                           "grid": grid(config), "step": step})


def _checkpointed(wd: workdirs.Workdir, state, losses, identity: dict
                  ) -> dict[str, np.ndarray]:
  """What a checkpoint holds: the state's leaves, the losses and its
  ``identity`` (JSON as uint8), sealed like every output: the config's hash
  and a checksum of all of it (:meth:`experiments.workdirs.Workdir.seal`)."""
  leaves = jax.tree.leaves(state)
  return wd.seal({"losses": losses, "identity": np.frombuffer(
      json.dumps(identity, sort_keys=True).encode(), np.uint8),
                  **{f"state{i}": leaf for i, leaf in enumerate(leaves)}})


def _describe(identity: dict) -> str:
  return (f"{identity.get('model')} at depth {identity.get('depth')}, step "
          f"{identity.get('step')}, grid {identity.get('grid')}")


def _restore(config, manager, wd: workdirs.Workdir, folder: str, state, losses,
             *, name: str, depth: int, remedy: str | None = None):
  """``(step, state, losses)`` of the last checkpoint in ``folder``, verified
  as this config's ``name`` at ``depth`` and as the step it is filed under,
  or ``(None, state, losses)`` when there is none.

  Raises:
    workdirs.CorruptOutput: it cannot be read, is of another config, another
      model, depth, grid or step, was altered, or its arrays do not have
      this model's shapes; naming it and ending with ``remedy`` (default: delete
      ``folder``).
  """
  remedy = remedy or workdirs.way_out(folder)
  step = manager.latest_step()
  if step is None:
    return None, state, losses
  path = os.path.join(folder, str(step))
  try:
    # No target: the arrays as saved, checked below (with a target of other
    # shapes orbax would restore the saved shapes without a word).
    restored = manager.restore(step, args=ocp.args.StandardRestore())
    restored = {k: np.asarray(v) for k, v in restored.items()}
  except Exception as err:  # pylint: disable=broad-except
    # orbax, tensorstore and decompression errors alike, in one line.
    first_line = (str(err).strip().splitlines() or [""])[0][:200]
    raise workdirs.CorruptOutput(
        f"{path!r} is not a readable checkpoint ({type(err).__name__}: "
        f"{first_line}); " + remedy) from None
  restored = wd.unseal(path, restored, remedy=remedy)
  wanted = _identity(config, name=name, depth=depth, step=step)
  try:
    found = json.loads(bytes(restored.pop("identity")).decode())
  except (KeyError, ValueError, UnicodeDecodeError):
    found = None
  if found != wanted:
    what = ("no record of which model, depth and step it holds (an older "
            "version wrote it)" if not isinstance(found, dict) else
            f"{_describe(found)}")
    raise workdirs.CorruptOutput(
        f"{path!r} holds {what}, not {_describe(wanted)}: it was copied or "
        "renamed; " + remedy)
  leaves = jax.tree.leaves(state)
  like = lambda a, b: np.shape(a) == np.shape(b)
  if (set(restored) != {"losses", *(f"state{i}" for i in range(len(leaves)))}
      or not like(restored["losses"], losses)
      or not all(like(restored[f"state{i}"], leaf)
                 for i, leaf in enumerate(leaves))):
    raise workdirs.CorruptOutput(
        f"{path!r} does not hold the arrays of {_describe(wanted)} (other "
        "shapes); " + remedy)
  # In the dtypes of this process's state (with jax_enable_x64 on, as in
  # decompile, the grid's learning rates are float64; the run saved float32).
  leaves = [jnp.asarray(restored[f"state{i}"], np.asarray(leaf).dtype)
            for i, leaf in enumerate(leaves)]
  return (step, jax.tree.unflatten(jax.tree.structure(state), leaves),
          restored["losses"])


def _checkpoints(name: str, depth: int) -> str:
  return os.path.join("checkpoints", f"{name}_L{depth}")


def _untrained(config, *, name: str, depth: int):
  """``(split, tx, state, losses)`` before the first step: the grid's stacked
  initial parameters, the optimiser, its state, and losses ``[G, steps]`` of
  NaN."""
  split = _init_grid(config, name=name, depth=depth)
  tx = _optimizer(learning_rate=config.learning_rates[0], steps=config.steps,
                  warmup_steps=config.warmup_steps,
                  end_fraction=config.end_fraction, clip_norm=config.clip_norm)
  state = distributed.to_host(training.grid_init_state(
      split.params, tx,
      learning_rates=jnp.asarray([lr for lr, _ in grid(config)])))
  losses = np.full((len(grid(config)), config.steps), np.nan, DTYPE)
  return split, tx, state, losses


def load_trained(config, workdir: str, *, name: str, depth: int
                 ) -> training.Split:
  """``name`` at ``depth`` as a finished train run in ``workdir`` left it:
  the split with parameters stacked over the grid, from its last checkpoint,
  verified as this config's ``name`` at ``depth`` and step ``config.steps``.
  Reads only.

  Raises:
    workdirs.CorruptOutput: the checkpoint is missing, unfinished, damaged,
      of another config, or another model, depth or step. Its way out
      deletes the model's folder and the run's ``results.json``: the train
      command (decompile runs it first) then trains that model again, and
      only that one, and evaluates anew.
  """
  split, _, state, losses = _untrained(config, name=name, depth=depth)
  wd = workdirs.Workdir(workdir, config)
  folder = wd.path(_checkpoints(name, depth))
  remedy = (f"delete {folder!r} and {wd.path('results.json')!r}, then rerun: "
            f"train trains {name} at depth {depth} again (the other models "
            "are loaded from their checkpoints) and evaluates anew.")
  if not os.path.isdir(folder):
    raise workdirs.CorruptOutput(f"{folder!r} is missing: {workdir!r} holds no "
                               f"trained {name} at depth {depth}; " + remedy)
  with ocp.CheckpointManager(os.path.abspath(folder),
                             options=ocp.CheckpointManagerOptions(
                                 create=False, read_only=True)) as manager:
    step, state, _ = _restore(config, manager, wd, folder, state, losses,
                              name=name, depth=depth, remedy=remedy)
  if step != config.steps:
    raise workdirs.CorruptOutput(
        f"{folder!r} holds step {step}, not the run's last ({config.steps}); "
        + remedy)
  return split._replace(params=state.params)


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
  split, tx, state, losses = _untrained(config, name=name, depth=depth)
  points = grid(config)
  checkpoints = _checkpoints(name, depth)
  folder = wd.path(checkpoints)
  manager, start = None, None
  if distributed.is_writer():
    wd.own(checkpoints, tree=True)
    manager = ocp.CheckpointManager(
        os.path.abspath(folder), options=ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_checkpoints, create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes={0})))
    start, state, losses = _restore(config, manager, wd, folder, state,
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
      [_point_tag(name, depth, lr, scale) for lr, scale in points],
      np.asarray([lr for lr, _ in points]))
  track(losses, 0, start or 0)  # the restored steps: each step's events once
  step = start or 0
  timed_steps, timed_seconds = 0, 0.0
  while step < config.steps:
    chunk = min(config.checkpoint_every, config.steps - step)
    tic = time.perf_counter()
    if config.task == DEFAULT_TASK:
      grouped, chunk_losses = _sharded_grid_steps(
          grouped, key_data, rest, graphdef=split.graphdef,
          spec=task_spec(config), tx=tx, batch=config.batch, steps=chunk,
          mesh=mesh)
    else:
      grouped, chunk_losses = _sharded_family_steps(
          grouped, _family_batches(key_data, step, spec=_train_spec(config),
                                   batch=config.batch, steps=chunk), rest,
          graphdef=split.graphdef, form=task_spec(config).model_tokens(), tx=tx,
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
      manager.save(step, args=ocp.args.StandardSave(_checkpointed(
          wd, state, losses, _identity(config, name=name, depth=depth,
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


def _pick(split: training.Split, index: int) -> training.Split:
  return split._replace(params=jax.tree.map(lambda a: a[index], split.params))


def finished_run(workdir: str) -> tuple[ml_collections.ConfigDict, dict]:
  """``(config, results)`` of a finished run of this driver in ``workdir``:
  its ``config.json`` and its ``results.json``, verified as that config's.
  Reads only.

  Raises:
    workdirs.CorruptOutput: no finished run there (no config or no results),
      or its files are damaged or of another config.
  """
  found = workdirs.read_json(os.path.join(workdir, "config.json"))
  if not isinstance(found, dict):
    raise workdirs.CorruptOutput(
        f"{workdir!r} holds no config.json of a train run; run "
        f"python -m experiments.train --workdir={workdir} (with its config) "
        "first.")
  config = ml_collections.ConfigDict(found)
  results = workdirs.Workdir(workdir, config).read_json("results.json")
  if results is None:
    raise workdirs.CorruptOutput(
        f"{workdir!r} holds no results.json: its train run has not finished; "
        "rerun its train command there to resume it.")
  return config, results


def trained_model(config, workdir: str, results: dict, *, name: str,
                  depth: int):
  """The grid point chosen for ``name`` at ``depth`` in a finished run's
  ``results`` (its ``tuning``), as one model from its last checkpoint
  (:func:`load_trained`); ``None`` if its whole grid diverged."""
  choice = results["tuning"][name][list(config.depths).index(depth)]
  if choice["learning_rate"] is None:
    return None
  index = grid(config).index((choice["learning_rate"], choice["init_scale"]))
  split = load_trained(config, workdir, name=name, depth=depth)
  return training.merge(*_pick(split, index))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _grid_val_loss(params, rest, task, *, graphdef, spec):
  return jnp.mean(training.grid_loss(params, task, graphdef=graphdef,
                                     rest=rest, form=spec.model_tokens()),
                  axis=-1)


def _select(config, split: training.Split, losses: np.ndarray, task
            ) -> dict[str, Any]:
  """The grid point with the lowest validation MSE among those that did not diverge."""
  val = np.asarray(_grid_val_loss(split.params, split.rest, task,
                                  graphdef=split.graphdef,
                                  spec=task_spec(config)), np.float64)
  diverged = ~np.isfinite(losses).all(axis=1) | ~np.isfinite(val)
  points = grid(config)
  chosen = None
  if not diverged.all():
    chosen = int(np.argmin(np.where(diverged, np.inf, val)))
  return {"index": chosen,
          "learning_rate": None if chosen is None else points[chosen][0],
          "init_scale": None if chosen is None else points[chosen][1],
          "val_loss": val.tolist(),
          "diverged": [list(p) for p, d in zip(points, diverged) if d]}


def _stats(per_task) -> dict[str, float]:
  """Mean and standard error over test tasks."""
  per_task = np.asarray(per_task, np.float64)
  return {"mean": float(per_task.mean()),
          "se": float(per_task.std(ddof=1) / np.sqrt(per_task.size))}


def _depth_evaluator(config, trained: dict, eta: float, depth: int):
  """A jitted ``task -> (per-task MSE, agreement with GD, per-layer)`` for one depth.

  ``trained``: ``{name: module}`` of the chosen grid points (models whose
  whole grid diverged are absent). Built once per depth and reused for every
  shift: shifts change the tasks, not the token layout or the lambda; the
  Bayes predictor keeps the in-distribution prior.
  """
  spec = task_spec(config)
  form = spec.model_tokens()

  def evaluate(task):
    gd = lambda t: training.gd_predict(t, lam=spec.lam, eta=eta, steps=depth)
    preds = {"bayes_optimal": training.bayes_predict(task, spec),
             "gd_best_eta": gd(task),
             "elsa_constructed_gd": training.constructed_gd_predict(
                 task, spec, eta=DTYPE(eta), depth=depth),
             "ridge": training.ridge_predict(task, lam=spec.lam),
             "least_squares": training.least_squares_predict(task),
             "zero": jnp.zeros_like(task.y_query)}
    gd_sens = training.query_sensitivity(gd, task)
    gd_steps = training.gd_step_predictions(task, lam=spec.lam, eta=eta,
                                            steps=depth)
    to = lambda target: task._replace(y_query=target)
    agree, layers = {}, {}
    for name, model in trained.items():
      predict = lambda t, model=model: training.model_predict(model, form, t)
      preds[name] = predict(task)
      cos, rel = training.sensitivity_agreement(
          training.query_sensitivity(predict, task), gd_sens)
      agree[name] = {"pred_mse_to_gd": training.mse(preds[name],
                                                    to(preds["gd_best_eta"])),
                     "sensitivity_cosine": cos, "sensitivity_rel_l2": rel}
      per_layer = training.layer_predictions(model, form, task)
      layers[name] = {
          "test_loss": jax.vmap(lambda p: training.mse(p, task).mean())(
              per_layer),
          "mse_to_gd_step": jax.vmap(
              lambda p, g: training.mse(p, to(g)).mean())(per_layer, gd_steps),
          "mse_to_bayes": jax.vmap(lambda p: training.mse(
              p, to(preds["bayes_optimal"])).mean())(per_layer)}
    layers["gd_steps"] = {"test_loss": jax.vmap(
        lambda p: training.mse(p, task).mean())(gd_steps)}
    losses = {name: training.mse(pred, task) for name, pred in preds.items()}
    return losses, agree, layers

  return jax.jit(evaluate)


def _in_chunks(evaluate, task, size: int):
  """``evaluate(task)`` over chunks of ``size`` tasks: per-task arrays
  (losses, agreement) concatenated, per-layer means (equal chunks) averaged."""
  n = task.x.shape[0]
  parts = [evaluate(jax.tree.map(lambda a, i=i: a[i:i + size], task))
           for i in range(0, n, size)]
  losses, agree, layers = zip(*parts)
  join = lambda *xs: np.concatenate([np.asarray(x) for x in xs])
  mean = lambda *xs: np.mean([np.asarray(x) for x in xs], axis=0)
  return (jax.tree.map(join, *losses), jax.tree.map(join, *agree),
          jax.tree.map(mean, *layers))


def _evaluate(config, evaluators: list, task, *, layers: bool = False
              ) -> dict[str, Any]:
  """Per-depth test losses (mean, se) of every model and baseline on ``task``.

  A model whose grid diverged at a depth gets NaN there (``null`` in JSON).
  """
  size = min(config.eval_chunk, config.n_test)
  per_depth = [_in_chunks(evaluate, task, size) for evaluate in evaluators]
  names = [*config.models, *BASELINES]
  out = {"test_loss": {}, "test_loss_se": {}, "vs_bayes": {},
         "trained_vs_gd": {}}
  for name in names:
    stats = [_stats(res[0][name]) if name in res[0] else None
             for res in per_depth]
    out["test_loss"][name] = [s["mean"] if s else np.nan for s in stats]
    out["test_loss_se"][name] = [s["se"] if s else np.nan for s in stats]
  for name in config.models:
    diff = [_stats(res[0][name] - res[0]["bayes_optimal"]) if name in res[0]
            else {"mean": np.nan, "se": np.nan} for res in per_depth]
    out["vs_bayes"][name] = {"mean": [d["mean"] for d in diff],
                             "se": [d["se"] for d in diff]}
    agree = {}
    for key in ("pred_mse_to_gd", "sensitivity_cosine", "sensitivity_rel_l2"):
      agree[key] = [float(np.mean(np.asarray(res[1][name][key], np.float64)))
                    if name in res[1] else np.nan for res in per_depth]
    out["trained_vs_gd"][name] = agree
  if layers:
    out["layers"] = {
        name: [{k: np.asarray(v, np.float64).tolist()
                for k, v in res[2][name].items()} if name in res[2] else None
               for res in per_depth]
        for name in (*config.models, "gd_steps")}
  return out


def _best_etas(config, task) -> tuple[dict[int, float], dict[str, list]]:
  """GD's step size per depth: the lowest mean MSE on ``task`` (validation)."""
  etas = jnp.linspace(config.eta_min, config.eta_max, config.eta_grid,
                      dtype=DTYPE)
  best, curves = {}, {}
  for depth in config.depths:
    losses = training.gd_eta_grid_losses(task, lam=config.lam, etas=etas,
                                         steps=depth)
    best[depth] = float(etas[int(jnp.nanargmin(losses))])
    curves[str(depth)] = np.asarray(losses).tolist()
  return best, {"etas": np.asarray(etas).tolist(), "val_loss": curves}


def _write_figures(results: dict, wd: workdirs.Workdir) -> None:
  if "task" in results:  # a family of elsa.tasks
    wd.save_figure(plotting.train_loss(results), "figures/train_loss.png")
    wd.save_figure(_family_figure(results), "figures/test_loss_vs_depth.png")
    return
  for name, draw in (("train_loss", plotting.train_loss),
                     ("test_loss_vs_depth", plotting.test_loss_vs_depth),
                     ("trained_vs_gd", plotting.trained_vs_gd),
                     ("layer_predictions", plotting.layer_predictions),
                     ("shifted_test_loss", plotting.shifted_test_loss)):
    wd.save_figure(draw(results), f"figures/{name}.png")


def _tasks(config, salt: int, **shift):
  key = jax.random.fold_in(jax.random.key(config.seed), salt)
  if config.task != DEFAULT_TASK:
    return _train_spec(config).sample(key, batch=config.n_test, dtype=DTYPE)
  return training.sample_tasks(key, task_spec(config, **shift),
                               batch=config.n_test, dtype=DTYPE)


def _evaluate_all(config, trained: dict, etas: dict[int, float]
                  ) -> dict[str, Any]:
  """Every model and baseline on the test tasks, in distribution and shifted."""
  evaluators = [_depth_evaluator(
      config, {name: by_depth[depth] for name, by_depth in trained.items()
               if depth in by_depth}, etas[depth], depth)
                for depth in config.depths]
  out = _evaluate(config, evaluators, _tasks(config, 20_000), layers=True)
  out["shifted"] = {}
  for name, shift in config.shifts.items():
    shifted = _evaluate(config, evaluators, _tasks(config, 20_000, **shift))
    out["shifted"][name] = {k: shifted[k] for k in
                            ("test_loss", "test_loss_se", "trained_vs_gd")}
  return out


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict:
  """Trains, tunes, evaluates, writes ``results.json`` and figures; resumes or skips.

  Returns:
    The results dict (what ``results.json`` holds).
  """
  if config.get("task_runs"):
    return _run_task_runs(config, workdir, overwrite=overwrite)
  groups, shards = distributed.agree("validate", check_devices, config)
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
  points = grid(config)
  logging.info("train: %d grid points in %d groups, each batch over %d of "
               "%d %s devices", len(points), mesh.shape["grid"],
               mesh.shape["batch"], mesh.size, jax.default_backend())
  progress = cli.Progress(
      len(config.models) * len(config.depths) * config.steps * len(points),
      name="train", unit="steps")
  # Validation tasks: their own key (salt 30_000), never the test tasks'.
  val_task = _tasks(config, 30_000)
  trained, train_loss, tuning, ms_per_step = {}, {}, {}, {}
  for name in config.models:
    trained[name], train_loss[name], tuning[name] = {}, [], []
    ms_per_step[name] = []
    for depth in config.depths:
      split, losses, seconds = train_one(
          config, name=name, depth=depth, wd=wd, progress=progress,
          mesh=mesh, tracker=tracker)
      choice = _select(config, split, losses, val_task)
      index = choice.pop("index")
      if index is not None:
        trained[name][depth] = training.merge(*_pick(split, index))
      curve = losses[0 if index is None else index]
      train_loss[name].append(
          curve.reshape(-1, config.log_every).mean(axis=1).tolist()
          if config.steps % config.log_every == 0 else curve.tolist())
      tuning[name].append(choice)
      ms_per_step[name].append(None if seconds is None else 1e3 * seconds)
  train_seconds = time.perf_counter() - start

  etas, eta_curves = _best_etas(config, val_task)
  ridge_task = config.task == DEFAULT_TASK
  results = dict(depths=list(config.depths), models=list(config.models),
                 grid=[list(p) for p in points], tuning=tuning,
                 gd_best_eta=[etas[d] for d in config.depths],
                 gd_eta_grid=eta_curves,
                 bayes_lam=(training.bayes_lam(task_spec(config)) if ridge_task
                            else None),
                 train_loss=train_loss, train_seconds=train_seconds,
                 ms_per_step=ms_per_step)
  # Exact float32 products on GPU/TPU too (their default is bfloat16 passes):
  # the GD references and the constructed stack must agree to rounding.
  with jax.default_matmul_precision("highest"):
    results.update(_evaluate_all(config, trained, etas) if ridge_task else
                   _evaluate_family(config, trained, etas, val_task))
  results["diverged"] = {name: [t["learning_rate"] is None for t in tuning[name]]
                         for name in config.models}
  gd = results["test_loss"]["gd_best_eta"]
  results["ratio_to_gd"] = {name: [a / b for a, b in zip(
      results["test_loss"][name], gd)] for name in config.models}
  results["seconds"] = time.perf_counter() - start
  # What results.json will hold (non-finite numbers as None), returned too.
  results = workdirs.finite_or_none(results)
  _track_evaluation(config, results, tracker)
  _write_figures(results, wd)
  wd.write_json("results.json", results)
  if not ridge_task:
    logging.info("%s (mean / median (minus %s ± se)):\n%s", config.task,
                 results["best_reference"], family_table(results))
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
          f"validation/{_point_tag(name, depth, lr, scale)}/loss": loss
          for (lr, scale), loss in zip(grid(config), choice["val_loss"])})
  for name, by_depth in results["test_loss"].items():
    for depth, loss in zip(config.depths, by_depth):
      tracker.scalars(depth, {f"test/{name}/loss": loss})
  tracker.hparams(config, {f"test/{name}/loss_at_L{max(config.depths)}":
                           by_depth[-1] for name, by_depth in
                           results["test_loss"].items()})


# --- general tasks (elsa.tasks) ---------------------------------------------
#
# With ``config.task`` a family of ``elsa.tasks`` (options in
# ``config.task_options``), the same models train on that family's prompts
# and meet its references (``family.references``: Bayes where it has one,
# Garg et al.'s baselines), GD from zero at its validation-chosen step size
# (at ``config.lam``), and on ``nonzero_mean`` GD from the prior mean, as the
# reference ``ridge.gd(w0=mu)`` and as the compiled ELSA stack of
# ``elsa.algorithms.ridge_gd_from`` (the biases write ``mu``; ``L`` GD steps
# take ``L + 2`` layers: set-up, ``L`` steps, read-out). The ridge task's
# own fields (``noise``, ``x_scale``, ``x_dist``, ``shifts``) are not read.


# The paired model-to-model differences ``a - b`` of a family's results,
# where both ran: trained ELSA (with the key mask, and the paper's without)
# against the field's masked LSA with a residual and against each other,
# and every trained model against the compiled GD-from-mu stack
# (nonzero_mean).
FAMILY_PAIRS = (("elsa_masked", "lsa_residual_trained"),
                ("elsa_trained", "lsa_residual_trained"),
                ("elsa_masked", "elsa_trained"),
                ("elsa_masked", "gd_from_mu_compiled"),
                ("elsa_trained", "gd_from_mu_compiled"),
                ("lsa_residual_trained", "gd_from_mu_compiled"))


@dataclasses.dataclass(frozen=True)
class FamilySpec:
  """A family's prompts as the training code reads them: hashable (a static
  argument), with ``model_tokens()`` and ``n_train`` as
  :class:`elsa.training.TaskSpec` has them, and :meth:`sample`."""

  family: task_families.TaskFamily
  n_train: int
  d: int
  n_query: int
  tokens: str

  def model_tokens(self):
    return training.TaskSpec(n_train=self.n_train, d=self.d,
                             n_query=self.n_query,
                             tokens=self.tokens).model_tokens()

  def sample(self, key, *, batch: int, dtype):
    return self.family.sample(key, batch=batch, n_train=self.n_train,
                              d=self.d, n_query=self.n_query, dtype=dtype)


def _train_spec(config):
  """What the models train on: the ridge :func:`task_spec`, or a :class:`FamilySpec`."""
  if config.task == DEFAULT_TASK:
    return task_spec(config)
  return FamilySpec(task_families.get(config.task, **dict(config.task_options)),
                    n_train=config.n_train, d=config.d,
                    n_query=config.n_query, tokens=config.tokens)


def _check_task(config) -> None:
  """``config.task`` and ``config.task_options`` name a family that can
  sample prompts of the config's sizes (checked on shapes only)."""
  names = (DEFAULT_TASK, *task_families.FAMILIES)
  if config.task not in names:
    raise checks.ConfigError(f"config.task must be one of {', '.join(names)}, "
                             f"got {config.task!r}.")
  if config.task == DEFAULT_TASK:
    if config.task_options:
      raise checks.ConfigError(
          f"config.task_options are a family's options; task "
          f"{DEFAULT_TASK!r} takes none (its fields are the config's), got "
          f"{dict(config.task_options)}.")
    return
  try:
    spec = _train_spec(config)
    jax.eval_shape(lambda key: spec.sample(key, batch=1, dtype=DTYPE),
                   jax.random.key(0))
  except (TypeError, ValueError) as err:
    raise checks.ConfigError(f"config.task_options: {err}") from None


@functools.partial(jax.jit, static_argnames=("spec", "batch", "steps"))
def _family_batches(key_data, start, *, spec: FamilySpec, batch: int,
                    steps: int) -> ridge.Task:
  """The training batches of steps ``start .. start + steps - 1``, stacked:
  fields ``[steps, batch, ...]``; step ``s`` draws from ``fold_in(key, s)``
  (a resumed run sees the same batches).

  Drawn apart from the training step so that one compiled training program
  serves every family of the same sizes (``:tasks`` runs eleven families in
  one process; the training scan's compilation, not its steps, was most of
  each run's time)."""
  key = jax.random.wrap_key_data(key_data)
  return jax.vmap(lambda s: spec.sample(jax.random.fold_in(key, s),
                                        batch=batch, dtype=DTYPE))(
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


def gd_from_predict(task, *, w0, lam, eta, steps: int):
  """Predictions ``x_q^T w_steps`` of ridge GD from ``w0 [d]``: ``[B, Q]``."""
  start = jnp.broadcast_to(jnp.asarray(w0, task.x.dtype), task.w_true.shape)
  w = ridge.gd(task.x, task.y, lam=lam, eta=eta, steps=steps, w0=start)[-1]
  return jnp.einsum("bqd,bd->bq", task.x_query, w)


@functools.lru_cache(maxsize=None)
def compiled_gd_from(n_train: int, d: int, n_query: int, w0: tuple):
  """The compiled GD-from-``w0`` program (:func:`elsa.algorithms.ridge_gd_from`)."""
  return programs.compile(algorithms.ridge_gd_from(
      n_train=n_train, d=d, n_query=n_query, w0=np.asarray(w0)))


def compiled_gd_from_predict(task, *, w0, lam, eta, depth: int,
                             return_all: bool = False):
  """The compiled ELSA stack of ``depth`` GD steps from ``w0`` on ``task``:
  predictions ``[B, Q]``, or with ``return_all`` the ``w`` block after
  every layer, ``[depth + 3, B, d]`` (input, set-up, ``depth`` steps,
  read-out)."""
  _, n_train, d = task.x.shape
  compiled = compiled_gd_from(n_train, d, task.x_query.shape[1],
                               tuple(np.asarray(w0, np.float64).tolist()))
  h0 = compiled.encode(X=task.x, y=task.y[..., None], Xq=task.x_query)
  params = compiled.params(loops=depth, lam=jnp.asarray(lam, task.x.dtype),
                           eta=jnp.asarray(eta, task.x.dtype),
                           dtype=task.x.dtype)
  if return_all:
    hs = attention.elsa_stack(params, h0, return_all=True)
    return compiled.read(hs, "w")[..., 0]
  return compiled.read(attention.elsa_stack(params, h0), "p")[..., 0]


def _best_etas_from(config, task, w0) -> dict[int, float]:
  """GD-from-``w0``'s step size per depth, chosen on ``task`` (validation)."""
  etas = jnp.linspace(config.eta_min, config.eta_max, config.eta_grid,
                      dtype=DTYPE)
  best = {}
  for depth in config.depths:
    loss = jax.jit(lambda etas, depth=depth: jax.lax.map(
        lambda eta: jnp.mean(training.mse(gd_from_predict(
            task, w0=w0, lam=config.lam, eta=eta, steps=depth), task)), etas))
    best[depth] = float(etas[int(np.nanargmin(np.asarray(loss(etas))))])
  return best


def _evaluate_family(config, trained: dict, etas: dict[int, float], val_task
                     ) -> dict[str, Any]:
  """Every model, reference and GD on the family's test prompts.

  Per name and depth (:func:`loss_summary` of the per-prompt MSE):
  ``test_loss`` (mean), ``test_loss_se``, ``test_loss_median``,
  ``test_loss_median_se`` and ``test_loss_worst_share``, for each model,
  ``gd_best_eta`` (from zero), on ``nonzero_mean`` ``gd_from_mu`` and
  ``gd_from_mu_compiled`` (at their own validation-chosen step size), and
  every reference (the same value at every depth) and ``zero``. Paired per-prompt differences
  (:func:`paired_summary`: mean, se, median, median_se per depth):
  ``vs_best_reference[name]``, each name minus ``best_reference``
  (``bayes`` where the family has one, else the reference of lowest test
  MSE); ``paired["a - b"]`` for the pairs of :data:`FAMILY_PAIRS` that ran.
  """
  spec = _train_spec(config)
  family, form = spec.family, spec.model_tokens()
  task = _tasks(config, 20_000)
  size = min(config.eval_chunk, config.n_test)
  chunks = [jax.tree.map(lambda a, i=i: a[i:i + size], task)
            for i in range(0, config.n_test, size)]
  def per_task(predicts: dict, *, host: bool = False) -> dict:
    # One compiled function for all of ``predicts`` (host ones run eagerly).
    run = lambda c: {name: training.mse(predict(c), c)
                     for name, predict in predicts.items()}
    run = run if host else jax.jit(run)
    parts = [run(c) for c in chunks]
    return {name: np.concatenate([np.asarray(p[name], np.float64)
                                  for p in parts]) for name in predicts}
  references = family.references
  host = {n: p for n, p in references.items()
          if n in task_families.HOST_REFERENCES}
  refs = per_task({**{n: p for n, p in references.items() if n not in host},
                   "zero": lambda c: jnp.zeros_like(c.y_query)})
  refs.update(per_task(host, host=True))
  refs = {name: refs[name] for name in (*references, "zero")}
  losses = {}  # name -> {depth: per-task MSE}
  mu = (family.mu(config.d, DTYPE)
        if isinstance(family, task_families.NonzeroMean) else None)
  mu_etas = None if mu is None else _best_etas_from(config, val_task, mu)
  for depth in config.depths:
    preds = {name: functools.partial(training.model_predict,
                                     by_depth[depth], form)
             for name, by_depth in trained.items() if depth in by_depth}
    preds["gd_best_eta"] = functools.partial(
        training.gd_predict, lam=config.lam, eta=etas[depth], steps=depth)
    if mu is not None:
      preds["gd_from_mu"] = functools.partial(
          gd_from_predict, w0=mu, lam=config.lam, eta=mu_etas[depth],
          steps=depth)
      preds["gd_from_mu_compiled"] = functools.partial(
          compiled_gd_from_predict, w0=mu, lam=config.lam,
          eta=mu_etas[depth], depth=depth)
    for name, per in per_task(preds).items():
      losses.setdefault(name, {})[depth] = per
  if "bayes" in refs:
    best = "bayes"
  else:
    best = min((n for n in refs if n != "zero"), key=lambda n: refs[n].mean())
  for name, per in refs.items():  # a reference is the same at every depth
    losses[name] = {depth: per for depth in config.depths}
  for name in config.models:  # diverged at every depth: NaN (null in JSON)
    losses.setdefault(name, {})
  names = [*config.models, *(n for n in losses if n not in config.models)]
  out = {"task": config.task, "task_options": family.options(),
         "references": list(refs), "best_reference": best,
         "gd_from_mu_eta": (None if mu_etas is None else
                            [mu_etas[d] for d in config.depths])}
  by_depth = lambda stats: {key: [s[key] for s in stats] for key in stats[0]}
  missing = lambda keys: dict.fromkeys(keys, np.nan)
  summaries = {name: by_depth([
      loss_summary(losses[name][d]) if d in losses[name]
      else missing(("mean", "se", "median", "median_se", "worst_share"))
      for d in config.depths]) for name in names}
  for key, field in (("mean", "test_loss"), ("se", "test_loss_se"),
                     ("median", "test_loss_median"),
                     ("median_se", "test_loss_median_se"),
                     ("worst_share", "test_loss_worst_share")):
    out[field] = {name: summaries[name][key] for name in names}

  def paired(a: str, b: str) -> dict[str, list[float]]:
    return by_depth([
        paired_summary(losses[a][d], losses[b][d])
        if d in losses[a] and d in losses[b]
        else missing(("mean", "se", "median", "median_se"))
        for d in config.depths])
  out["vs_best_reference"] = {name: paired(name, best) for name in names
                              if name != best}
  out["paired"] = {f"{a} - {b}": paired(a, b) for a, b in FAMILY_PAIRS
                   if a in losses and b in losses}
  return out


def median_se(x, *, z: float = 1.96) -> float:
  """The standard error of the median of ``x [n]``, distribution-free: the
  spread of the sample quantiles ``1/2 -+ z / (2 sqrt(n))`` over ``2 z``,
  the density at the median estimated from the order statistics that bound
  its ``z``-interval (Bloch & Gastwirth 1968). For ``n`` normal draws of
  scale ``s``: ``sqrt(pi / 2) s / sqrt(n)``; no resampling, no seed."""
  x = np.asarray(x, np.float64)
  half = min(0.5, z / (2 * np.sqrt(x.size)))
  lo, hi = np.quantile(x, [0.5 - half, 0.5 + half])
  return float((hi - lo) / (2 * z))


def loss_summary(per_task, *, worst: float = 0.01) -> dict[str, float]:
  """What the mean of per-prompt losses hides: ``mean``, its standard error
  ``se``, the ``median`` and its ``median_se`` (:func:`median_se`), and
  ``worst_share``, the share of the total from the ``ceil(worst * n)``
  largest losses (at 1%: 0.08 for the squared error of a Gaussian
  prediction error, 1 when one prompt is the mean).

  Args:
    per_task: ``[n]`` losses, ``n >= 2``.
  """
  per_task = np.asarray(per_task, np.float64)
  top = np.sort(per_task)[-max(1, math.ceil(worst * per_task.size)):]
  total = per_task.sum()
  return {"mean": float(per_task.mean()),
          "se": float(per_task.std(ddof=1) / np.sqrt(per_task.size)),
          "median": float(np.median(per_task)),
          "median_se": median_se(per_task),
          "worst_share": float(top.sum() / total) if total > 0 else np.nan}


def paired_summary(a, b) -> dict[str, float]:
  """The paired per-prompt difference ``a - b`` of two predictors' losses
  on the same prompts (``[n]`` each): its ``mean``, standard error ``se``,
  ``median`` and ``median_se``. Pairing removes the prompts' shared
  difficulty: the ``se`` is that of the differences, usually far below
  either loss's."""
  diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  return {"mean": float(diff.mean()),
          "se": float(diff.std(ddof=1) / np.sqrt(diff.size)),
          "median": float(np.median(diff)), "median_se": median_se(diff)}


def family_table(results: dict, *, scale: float = 1.0) -> str:
  """A family run's ``results.json`` as Markdown: per model and GD and
  depth ``mean / median (mean paired difference to the best reference ±
  its se)``, with ``[worst 1%: S]`` where the worst 1% of prompts make
  more than half of the mean; the references (each at every depth) and
  the paired model-to-model differences ``mean ± se (median ± se)``. Every
  loss times ``scale`` (``1 / d``: Garg et al.'s normalisation)."""
  depths, best = results["depths"], results["best_reference"]
  num = lambda v, fmt: "—" if v is None or not np.isfinite(v) else format(
      v * scale, fmt)

  def cell(name: str, i: int) -> str:
    text = (f"{num(results['test_loss'][name][i], '.4g')} / "
            f"{num(results['test_loss_median'][name][i], '.3g')}")
    if name != best:
      diff = results["vs_best_reference"][name]
      text += (f" ({num(diff['mean'][i], '+.3g')} ± "
               f"{num(diff['se'][i], '.2g')})")
    share = results["test_loss_worst_share"][name][i]
    if share is not None and share > 0.5:
      text += f" [worst 1%: {share:.0%}]"
    return text

  head = "| | " + " | ".join(f"L = {d}" for d in depths) + " |"
  lines = [head, "|---" * (len(depths) + 1) + "|"]
  for name in results["test_loss"]:
    if name not in results["references"]:
      lines.append(f"| {name} | " + " | ".join(
          cell(name, i) for i in range(len(depths))) + " |")
  lines.append("")
  lines.append(f"References (mean / median, minus {best} ± se): " + "; ".join(
      f"{name} {cell(name, 0)}" for name in results["references"]) + ".")
  if results.get("paired"):
    lines += ["", "| paired difference | " + " | ".join(
        f"L = {d}" for d in depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for pair, diff in results["paired"].items():
      lines.append(f"| {pair} | " + " | ".join(
          f"{num(diff['mean'][i], '+.3g')} ± {num(diff['se'][i], '.2g')} "
          f"({num(diff['median'][i], '+.3g')} ± "
          f"{num(diff['median_se'][i], '.2g')})" for i in range(len(depths)))
                   + " |")
  return "\n".join(lines)


def _family_figure(results: dict):
  """Test MSE against depth: models and GD with 95% bars, every reference a
  horizontal line."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  depths = results["depths"]
  styles = iter([(c, ls) for ls in ("--", "-.", ":") for c in (
      "black", "grey", "tab:olive", "tab:cyan", "tab:brown", "tab:pink")])
  for name, loss in results["test_loss"].items():
    loss = np.asarray(loss, dtype=float)
    if name in results["references"]:
      color, linestyle = next(styles)
      ax.axhline(loss[0], linestyle=linestyle, linewidth=1, color=color,
                 label=name)
      continue
    ax.errorbar(depths, loss, yerr=1.96 * np.asarray(
        results["test_loss_se"][name], dtype=float), marker="o", capsize=3,
                label=name)
  ax.set(xlabel="depth L", ylabel="test MSE", yscale="log", xticks=depths,
         title=f"{results['task']}: test loss vs depth")
  ax.legend(fontsize=7)
  return fig


def _task_run_config(config, name: str) -> ml_collections.ConfigDict:
  """``config`` with the fields of ``config.task_runs[name]`` and no runs of its own."""
  sub = ml_collections.ConfigDict(config.to_dict())
  overrides = sub.task_runs[name].to_dict()
  sub.task_runs = ml_collections.ConfigDict()
  sub.update_from_flattened_dict(
      {k: v for k, v in overrides.items() if k != "task_options"})
  sub.task_options = ml_collections.ConfigDict(
      overrides.get("task_options", {}))
  return sub


def _run_task_runs(config, workdir: str, *, overwrite: bool) -> dict:
  """Each run of ``config.task_runs`` in ``workdir/<name>``, one after
  another (each resumes or skips like any run); every one is validated
  before the first starts. Returns ``{name: results}``."""
  subs = {name: _task_run_config(config, name) for name in config.task_runs}
  for name, sub in subs.items():
    try:
      validate(sub)
    except checks.ConfigError as err:
      raise checks.ConfigError(f"config.task_runs.{name}: {err}") from None
  return {name: run(sub, os.path.join(workdir, name), overwrite=overwrite)
          for name, sub in subs.items()}


def _quiet_orbax() -> None:
  """Orbax logs every checkpoint save at INFO; keep only its warnings."""
  logging.get_absl_handler().addFilter(
      lambda record: (record.levelno >= std_logging.WARNING
                      or "orbax" not in record.pathname))


def main(argv) -> None:
  _quiet_orbax()
  distributed.run_main(argv, "train", run)


if __name__ == "__main__":
  cli.define_flags("train")
  distributed.define_flags()
  app.run(main)
