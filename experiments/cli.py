"""The command line every driver shares: flags, the run skeleton, progress.

A driver's ``__main__`` calls :func:`define_flags`, then ``app.run(main)``;
its ``main`` calls :func:`run_main` (directly or through
:func:`experiments.distributed.run_main`), which calls the driver's
importable ``run(config, workdir, overwrite=...)``. This module guarantees:

* ``--config``, ``--workdir`` and ``--overwrite`` are defined only by
  :func:`define_flags`, under ``__main__`` (``--distributed`` and its flags
  by :func:`experiments.distributed.define_flags`): tests and notebooks
  import every driver, and no flag is read below ``main``.
* ``--config`` defaults to ``experiments/configs/<driver>.py``, found from
  any working folder; an unknown ``--config.FIELD`` is one line naming the
  config's fields, an unknown variant (``...py:NAME``) one line naming the
  known ones.
* A refused config, workdir or output (:class:`~experiments.checks.ConfigError`,
  :class:`~experiments.workdirs.WorkdirInUse`,
  :class:`~experiments.workdirs.UnusableWorkdir`,
  :class:`~experiments.workdirs.CorruptOutput`) ends the program with one line
  ``<driver>: <why>``, without traceback; anything else keeps its traceback.
* At the default verbosity the log holds the drivers' own lines: other
  libraries' INFO (JAX's backend probe, orbax's checkpoint saves, optax's
  notes) is left out; ``--verbosity=1`` shows it, warnings always show.
* :class:`Progress` logs ``done/total``, rate and ETA at most every
  ``every_s`` seconds; work resumed from an earlier run counts as done, not
  in the rate.
"""

from __future__ import annotations

import ast
import contextlib
import logging as std_logging
import os
import time
from typing import Any, Iterator

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp

from experiments import checks
from experiments import workdirs


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


@contextlib.contextmanager
def float_dtype_enabled(dtype: str) -> Iterator[Any]:
  """Yields ``jnp.dtype(dtype)`` (``"float32"`` or ``"float64"``), with
  ``jax_enable_x64`` on inside the block for float64 (restored after)."""
  if dtype == "float64":
    with jax.enable_x64(True):
      yield jnp.dtype(jnp.float64)
  else:
    yield jnp.dtype(dtype)


def config_path(config_name: str) -> str:
  """``experiments/configs/<config_name>.py``, found next to this file (any cwd)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                      f"{config_name}.py")


def _no_such_field(err: Exception, config_file: str) -> str:
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top
  fields = config_flags.ConfigFileFlagParser("config").parse(config_file)
  # str() of a KeyError is the repr of its message (escaped quotes, a literal
  # \n before ml_collections' "Did you mean"): the message itself, one line.
  # ml_collections may hand on such a repr as an AttributeError's message, so
  # the quoted form is unquoted until it is text.
  message = str(err.args[0] if err.args else err).strip()
  while len(message) > 1 and message[0] == message[-1] and message[0] in "'\"":
    try:
      message = str(ast.literal_eval(message)).strip()
    except (ValueError, SyntaxError):
      break
  message = "; ".join(message.splitlines())
  return (f"unknown config field {message}; the config's "
          f"fields are {', '.join(sorted(fields))}.")


def define_flags(config_name: str) -> None:
  """``--config`` (default ``experiments/configs/<config_name>.py``, a variant
  as ``...py:tiny``, fields as ``--config.FIELD=VALUE``, tuples as
  ``--config.FIELD='(1, 2)'``), ``--workdir`` and ``--overwrite``. Called
  only under ``__main__``, so tests and notebooks import every driver."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  # An unknown --config.FIELD fails in ml_collections, here (the default
  # file) or when absl parses --config=FILE: reported in one line either way.
  default = config_path(config_name)
  try:
    holder = config_flags.DEFINE_config_file(
        "config", default=default,
        help_string="Config file (experiments/configs/*.py).")
  except (AttributeError, KeyError) as err:
    raise SystemExit(f"{config_name}: {_no_such_field(err, default)}") from None
  parse = flags.FLAGS[holder.name]._parse  # pylint: disable=protected-access

  def parse_naming_unknown_fields(argument):
    try:
      return parse(argument)
    except (AttributeError, KeyError) as err:  # absl reports it in one line
      raise flags.IllegalFlagValueError(_no_such_field(err, argument)) from None
    except flags.IllegalFlagValueError as err:
      # An unknown variant: ml_collections puts the traceback in the message
      # (absl recasts it); its last line ends in ours.
      marker = (f"{checks.UnknownVariant.__module__}."
                f"{checks.UnknownVariant.__name__}: ")
      if marker not in str(err):
        raise
      raise flags.IllegalFlagValueError(
          str(err).rsplit(marker, 1)[1].strip()) from None

  flags.FLAGS[holder.name]._parse = parse_naming_unknown_fields  # pylint: disable=protected-access
  flags.DEFINE_string("workdir", None, "Where config.json, results and figures go.",
                      required=True)
  flags.DEFINE_bool("overwrite", False,
                    "Start afresh: delete what this driver wrote in --workdir "
                    "(of any config) before running; other files stay.")


_OWN_CODE = tuple(os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), package) + os.sep
                  for package in ("experiments", "elsa"))


def _own_or_loud(record) -> bool:
  """A log record worth the default log: ours, a warning, or asked for."""
  return (record.levelno > std_logging.INFO
          or record.pathname.startswith(_OWN_CODE)
          or logging.get_verbosity() > logging.INFO)


def quiet_libraries() -> None:
  """Keeps other libraries' INFO out of the default log (idempotent)."""
  handler = logging.get_absl_handler()
  if _own_or_loud not in handler.filters:
    handler.addFilter(_own_or_loud)


def run_main(argv, name: str, run, **kwargs):
  """Calls ``run(config, workdir, overwrite=..., **kwargs)`` from the flags.

  A refused config, workdir or output is the user's call, not a bug: it ends
  the program with a one-line message, without traceback.
  """
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  quiet_libraries()
  config = flags.FLAGS.config
  try:
    return run(config, flags.FLAGS.workdir, overwrite=flags.FLAGS.overwrite,
               **kwargs)
  except (checks.ConfigError, workdirs.WorkdirInUse, workdirs.UnusableWorkdir,
          workdirs.CorruptOutput) as refusal:
    raise SystemExit(f"{name}: {refusal}") from None
