"""What every driver shares: the workdir contract, atomic writes, progress lines.

A driver writes into ``--workdir``: ``config.json``, ``results.json`` and
``figures/*.png``. Every write goes to a temporary file in the same folder and
is renamed into place, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import ml_collections
import numpy as np


def _atomic_write(path: str, write) -> None:
  """Calls ``write(file)`` on a temporary file next to ``path``, then renames it."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    # mkstemp creates 0600; results are meant to be shared like any new file.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def finite_or_none(obj: Any) -> Any:
  """``obj`` with floats (numpy scalars too) as Python floats, non-finite ones
  as ``None`` (JSON has no NaN)."""
  if isinstance(obj, (float, np.floating)):
    return float(obj) if math.isfinite(obj) else None
  if isinstance(obj, dict):
    return {k: finite_or_none(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [finite_or_none(v) for v in obj]
  return obj


def write_json(path: str, obj: Any) -> None:
  """Writes ``obj`` as indented, strict JSON (NaN and inf become null), atomically."""
  data = json.dumps(finite_or_none(obj), indent=2, sort_keys=True,
                    allow_nan=False).encode()
  _atomic_write(path, lambda f: f.write(data))


def read_json(path: str) -> Any | None:
  """The JSON in ``path``, or ``None`` when there is no such file."""
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def save_figure(fig, path: str) -> None:
  """Saves a matplotlib figure as PNG, atomically, and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120,
                                            bbox_inches="tight"))
  plt.close(fig)


def config_dict(config: ml_collections.ConfigDict) -> dict:
  """The config as plain JSON types (what ``config.json`` holds)."""
  return json.loads(config.to_json_best_effort(sort_keys=True))


class WorkdirInUse(ValueError):
  """The workdir holds results of a different config."""


# What a driver writes into its workdir; --overwrite removes all of it.
OUTPUTS = ("config.json", "results", "partial", "figures", "checkpoints")


def _outputs(workdir: str) -> list[str]:
  return [name for name in os.listdir(workdir)
          if any(name.startswith(prefix) for prefix in OUTPUTS)]


def prepare_workdir(workdir: str, config: ml_collections.ConfigDict, *,
                    overwrite: bool = False) -> None:
  """Claims ``workdir`` for ``config``.

  A fresh or matching workdir is fine (a rerun resumes or skips finished
  work). A workdir that holds outputs of a different config, or outputs
  without a ``config.json`` to say whose they are, is refused unless
  ``overwrite``, which first deletes every output (results, partial results,
  figures, checkpoints) and only then writes the new ``config.json``: an
  interruption in between leaves a workdir that resumes nothing stale.

  Raises:
    WorkdirInUse: the workdir belongs to another config and ``overwrite`` is
      off.
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  wanted, found = config_dict(config), read_json(path)
  if found != wanted and (found is not None or _outputs(workdir)):
    if not overwrite:
      if found is None:
        why = "outputs but no config.json to say which config made them"
      else:
        changed = sorted(k for k in set(found) | set(wanted)
                         if found.get(k) != wanted.get(k))
        why = ("results of a different config (fields that differ: "
               f"{', '.join(changed)})")
      raise WorkdirInUse(
          f"workdir {workdir!r} holds {why}. Use another --workdir, or pass "
          "--overwrite to replace them.")
    for name in _outputs(workdir):
      target = os.path.join(workdir, name)
      if os.path.isdir(target):
        shutil.rmtree(target)
      else:
        os.remove(target)
  write_json(path, wanted)


class Progress:
  """Logs ``done/total``, rate and ETA at most every ``every_s`` seconds."""

  def __init__(self, total: int, *, name: str, unit: str = "items",
               every_s: float = 5.0):
    self.total, self.name, self.unit, self.every_s = total, name, unit, every_s
    self.done = self._resumed = 0
    self._start = self._last = time.perf_counter()

  def resumed(self, count: int) -> None:
    """Counts ``count`` items finished by an earlier run (not in the rate)."""
    self.done += count
    self._resumed += count

  def update(self, count: int = 1) -> None:
    self.done += count
    now = time.perf_counter()
    if now - self._last < self.every_s and self.done < self.total:
      return
    self._last = now
    rate = (self.done - self._resumed) / max(now - self._start, 1e-9)
    eta = (self.total - self.done) / rate if rate > 0 else float("inf")
    logging.info("%s: %d/%d %s, %.3g %s/s, ETA %.0f s", self.name, self.done,
                 self.total, self.unit, rate, self.unit, eta)


def config_path(config_name: str) -> str:
  """``experiments/configs/<config_name>.py``, found next to this file (any cwd)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                      f"{config_name}.py")


def define_flags(config_name: str) -> None:
  """The flags every driver takes; called only under ``__main__``.

  ``--config`` (default ``experiments/configs/<config_name>.py``, overridable
  field by field as ``--config.FIELD=VALUE``), ``--workdir`` (required) and
  ``--overwrite``. Defining them only when a driver runs as a program lets
  tests and notebooks import every driver into one process.
  """
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file("config", default=config_path(config_name),
                                  help_string="Config file (experiments/configs/*.py).")
  flags.DEFINE_string("workdir", None, "Where config.json, results and figures go.",
                      required=True)
  flags.DEFINE_bool("overwrite", False,
                    "Replace the results of a different config in --workdir.")


def run_main(argv, name: str, run, **kwargs):
  """Calls ``run(config, workdir, overwrite=..., **kwargs)`` from the flags.

  A workdir that belongs to another config is the user's call, not a bug: it
  ends the program with a one-line message instead of a traceback.
  """
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = flags.FLAGS.config
  try:
    return run(config, flags.FLAGS.workdir, overwrite=flags.FLAGS.overwrite,
               **kwargs)
  except WorkdirInUse as refusal:
    raise SystemExit(f"{name}: {refusal}") from None
