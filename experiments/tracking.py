"""TensorBoard event files of a run, beside its results: ``tensorboard --logdir=<workdir>``.

Written with ``tensorboardX`` (TensorBoard's event format without TensorFlow;
``clu.metric_writers`` needs TensorFlow for its summary writer), by process 0
only, under ``<workdir>/tensorboard/`` (recorded in the workdir's manifest, so
``--overwrite`` deletes it). Scalars are grouped by their tag's first part
(``train/...``, ``validation/...``, ``test/...``); the config goes in as
hyper-parameters (``hparams/``, TensorBoard's HParams tab) beside the final
metrics. Each model and depth writes its training steps in a folder of its
own (``tensorboard/<model>_L<depth>/``, a TensorBoard run), rewritten whole
when its training starts or resumes: the steps up to the restored checkpoint
from the checkpoint's losses, the rest as they are computed; the evaluation
events (``tensorboard/`` itself and ``hparams/``) are rewritten whole by each
run that evaluates. So after any kill and resume every step is there once
(``purge_step`` would hide the repeats from TensorBoard but leave them, and a
killed writer's truncated record, in the files).
"""

from __future__ import annotations

import json
import os

import ml_collections

from experiments import checks
from experiments import distributed
from experiments import workdirs

FOLDER = "tensorboard"


def hparams(config: ml_collections.ConfigDict) -> dict:
  """The config flattened to ``{"a.b": value}``: numbers, strings and bools
  as they are, anything else (tuples, ``None``, nested lists) as JSON text."""
  flat = {}

  def walk(prefix: str, obj):
    if isinstance(obj, dict):
      for key, value in obj.items():
        walk(f"{prefix}{key}.", value)
    elif isinstance(obj, (bool, int, float, str)):
      flat[prefix[:-1]] = obj
    else:
      flat[prefix[:-1]] = json.dumps(obj)

  walk("", checks.config_dict(config))
  return flat


class Tracker:
  """Writes scalars and hyper-parameters in ``tensorboard/<sub>``, replacing
  the events there (a fresh start of what it tracks); does nothing on
  processes other than 0."""

  def __init__(self, wd: workdirs.Workdir, sub: str = ""):
    self._writer, self._wd, self._subs = None, wd, []
    if distributed.is_writer():
      import tensorboardX  # pylint: disable=g-import-not-at-top
      wd.own(FOLDER, tree=True)
      folder = wd.path(os.path.join(FOLDER, sub))
      _clear(folder)
      _clear(os.path.join(folder, "hparams"))  # add_hparams writes there
      self._writer = tensorboardX.SummaryWriter(folder)

  def sub(self, name: str) -> "Tracker":
    """A tracker of its own in ``tensorboard/<name>`` (another TensorBoard
    run), its earlier events removed; closed with this one."""
    self._subs.append(Tracker(self._wd, name))
    return self._subs[-1]

  def scalars(self, step: int, values: dict[str, float]) -> None:
    """``values`` (tag -> number) at ``step``; non-finite numbers are kept
    (TensorBoard shows them), ``None`` is skipped."""
    if self._writer is None:
      return
    for tag, value in values.items():
      if value is not None:
        self._writer.add_scalar(tag, float(value), global_step=step)

  def hparams(self, config: ml_collections.ConfigDict,
              metrics: dict[str, float | None]) -> None:
    """The config as hyper-parameters, with the run's final ``metrics``."""
    if self._writer is None:
      return
    self._writer.add_hparams(
        hparams(config), {k: float(v) for k, v in metrics.items()
                          if v is not None}, name="hparams")

  def close(self) -> None:
    """Writes what is pending and closes, its sub-trackers too (once)."""
    for sub in self._subs:
      sub.close()
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def _clear(folder: str) -> None:
  """Removes the event files directly in ``folder`` (inside the tracker's
  own tree: only what a tracker wrote)."""
  if os.path.isdir(folder) and not os.path.islink(folder):
    for name in os.listdir(folder):
      if name.startswith("events.out.tfevents."):
        os.remove(os.path.join(folder, name))
