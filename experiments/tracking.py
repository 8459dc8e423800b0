"""TensorBoard event files of a run, beside its results: ``tensorboard --logdir=<workdir>``.

Written with ``tensorboardX`` (TensorBoard's event format without TensorFlow;
``clu.metric_writers`` needs TensorFlow for its summary writer), by process 0
only, under ``<workdir>/tensorboard/`` (recorded in the workdir's manifest, so
``--overwrite`` deletes it). Scalars are grouped by their tag's first part
(``train/...``, ``validation/...``, ``test/...``); the config goes in as
hyper-parameters (``hparams/``, TensorBoard's HParams tab) beside the final
metrics. A resumed run appends a new event file with the steps it computes.
"""

from __future__ import annotations

import json

import ml_collections

from experiments import common
from experiments import distributed

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

  walk("", common.config_dict(config))
  return flat


class Tracker:
  """Writes scalars and hyper-parameters; does nothing on processes other than 0."""

  def __init__(self, wd: common.Workdir):
    self._writer = None
    if distributed.is_writer():
      import tensorboardX  # pylint: disable=g-import-not-at-top
      wd.own(FOLDER, tree=True)
      self._writer = tensorboardX.SummaryWriter(wd.path(FOLDER))

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
    if self._writer is not None:
      self._writer.close()
