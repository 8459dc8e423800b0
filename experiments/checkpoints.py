"""A train run's saved state: its checkpoints, restored and verified, and
the models of a finished run loaded back.

A checkpoint (``checkpoints/<model>_L<depth>/<step>/``, orbax) holds the
whole grid's training state and losses and its :func:`checkpoint_identity` (model,
depth, grid, step), sealed like every output of the workdir
(:meth:`experiments.workdirs.Workdir.seal`); :func:`restore` refuses by name
one of another config, model, depth, grid or step, damaged or of other
shapes. :func:`finished_run`, :func:`load_trained` and :func:`trained_model`
read only: what the decompile drivers build on.
"""

from __future__ import annotations

import contextlib
import json
import logging as std_logging
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from elsa import training
from experiments import checks
from experiments import train_setup
from experiments import workdirs


def checkpoint_identity(config, *, name: str, depth: int, step: int) -> dict:
  """What a checkpoint is: the model, its depth, the grid's points (in their
  order) and the step; sealed in with the config's hash."""
  return checks.canonical({"model": name, "depth": depth,
                           "grid": train_setup.grid(config), "step": step})


def checkpointed(wd: workdirs.Workdir, state, losses, identity: dict
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


def restore(config, manager, wd: workdirs.Workdir, folder: str, state, losses,
             *, name: str, depth: int, remedy: str | None = None):
  """``(step, state, losses)`` of the last checkpoint in ``folder``, verified
  as this config's ``name`` at ``depth`` and as the step it is filed under,
  or ``(None, state, losses)`` when there is none. ``state`` gives the
  shapes, dtypes and structure of what is restored: arrays, or their
  ``jax.ShapeDtypeStruct`` (``train_setup.untrained(abstract=True)``).

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
  wanted = checkpoint_identity(config, name=name, depth=depth, step=step)
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
  leaves = [jnp.asarray(restored[f"state{i}"], leaf.dtype)
            for i, leaf in enumerate(leaves)]
  return (step, jax.tree.unflatten(jax.tree.structure(state), leaves),
          restored["losses"])


def checkpoint_dir(name: str, depth: int) -> str:
  """The folder of ``name`` at ``depth``'s checkpoints, in the workdir."""
  return os.path.join("checkpoints", f"{name}_L{depth}")


@contextlib.contextmanager
def _read_only_manager(folder: str):
  """An orbax manager that only reads ``folder``. Opened read-only, orbax
  warns that the directory is read only, which is what was asked for: its
  warnings are held back while it opens (errors still show)."""
  # The absl logger's own level, restored as it was (often unset: inherited
  # from the root logger, which a caller such as pytest's caplog may lower).
  logger = logging.get_absl_logger()
  level = logger.level
  logger.setLevel(std_logging.ERROR)
  try:
    manager = ocp.CheckpointManager(
        os.path.abspath(folder), options=ocp.CheckpointManagerOptions(
            create=False, read_only=True, save_interval_steps=0))
  finally:
    logger.setLevel(level)
  with manager:
    yield manager


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
  # The shapes alone are the target: the restored arrays replace them all.
  split, _, state, losses = train_setup.untrained(config, name=name,
                                                  depth=depth, abstract=True)
  wd = workdirs.Workdir(workdir, config)
  folder = wd.path(checkpoint_dir(name, depth))
  remedy = (f"delete {folder!r} and {wd.path('results.json')!r}, then rerun: "
            f"train trains {name} at depth {depth} again (the other models "
            "are loaded from their checkpoints) and evaluates anew.")
  if not os.path.isdir(folder):
    raise workdirs.CorruptOutput(f"{folder!r} is missing: {workdir!r} holds no "
                               f"trained {name} at depth {depth}; " + remedy)
  with _read_only_manager(folder) as manager:
    step, state, _ = restore(config, manager, wd, folder, state, losses,
                              name=name, depth=depth, remedy=remedy)
  if step != config.steps:
    raise workdirs.CorruptOutput(
        f"{folder!r} holds step {step}, not the run's last ({config.steps}); "
        + remedy)
  return split._replace(params=state.params)


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
  index = train_setup.grid(config).index((choice["learning_rate"], choice["init_scale"]))
  split = load_trained(config, workdir, name=name, depth=depth)
  return training.merge(*train_setup.pick(split, index))

