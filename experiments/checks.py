"""Config checks, and the canonical form and hash of a config.

A driver checks its whole config with these before it claims ``--workdir``
(:mod:`experiments.workdirs`), so a refused config leaves nothing behind.
What this module guarantees:

* Every check returns the value it checked, or raises :class:`ConfigError`
  (a ``ValueError``) in one line naming the field, what is allowed and what
  came: ``config.etas[1] must be a finite number > 0, got -1.0.`` No number
  check passes NaN, inf or a bool; a tuple field lists each value once.
* :func:`check_fits` refuses, before anything compiles, a config whose
  estimated arrays exceed this process's memory (:func:`memory_bytes`).
* :func:`config_dict` is the config as ``config.json`` holds it
  (:func:`canonical`: tuples as lists, non-finite floats as ``"nan"``,
  ``"inf"``, ``"-inf"``, numpy scalars as Python numbers); :func:`config_hash`
  is equal for equal canonical configs, numbers compared by value (``0`` and
  ``0.0`` alike), and is what every output in a workdir is tied to.
* :func:`variant` checks the argument of a config file's ``get_config(arg)``
  (:class:`UnknownVariant`).

Nothing here reads a flag or touches the disk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np


class ConfigError(ValueError):
  """A config field outside its allowed range; one line naming the field."""


def _range_text(low, high, low_open: bool, high_open: bool) -> str:
  num = lambda x: str(x) if isinstance(x, int) else f"{x:g}"
  if low is not None and high is not None:
    return (f"in {'(' if low_open else '['}{num(low)}, {num(high)}"
            f"{')' if high_open else ']'}")
  if low is not None:
    return f"{'>' if low_open else '>='} {num(low)}"
  if high is not None:
    return f"{'<' if high_open else '<='} {num(high)}"
  return "finite"


def _check_number(name: str, value, *, integer: bool, low=None, high=None,
                  low_open: bool = False, high_open: bool = False):
  kind = "an int" if integer else "a finite number"
  want = f"{kind} {_range_text(low, high, low_open, high_open)}"
  numbers = (int, np.integer) if integer else (int, float, np.integer,
                                               np.floating)
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers):
    raise ConfigError(f"config.{name} must be {want}, got {value!r}.")
  ok = math.isfinite(value)
  ok = ok and (low is None or (value > low if low_open else value >= low))
  ok = ok and (high is None or (value < high if high_open else value <= high))
  if not ok:
    raise ConfigError(f"config.{name} must be {want}, got {value!r}.")
  return value


def check_int(config, field: str, *, low: int = 1, high: int | None = None
              ) -> int:
  """``config[field]``, an int in ``[low, high]``, else :class:`ConfigError`."""
  return _check_number(field, config[field], integer=True, low=low, high=high)


def check_float(config, field: str, *, low=None, high=None,
                low_open: bool = False, high_open: bool = False) -> float:
  """``config[field]``, a finite number in the range (NaN and inf refused)."""
  return _check_number(field, config[field], integer=False, low=low,
                       high=high, low_open=low_open, high_open=high_open)


def check_choice(config, field: str, choices: Sequence[str]) -> str:
  """``config[field]``, one of ``choices``."""
  value = config[field]
  if value not in choices:
    raise ConfigError(f"config.{field} must be one of {list(choices)}, got "
                      f"{value!r}.")
  return value


def check_items(config, field: str, *, integer: bool = False,
                choices: Sequence[str] | None = None, allow_empty: bool = False,
                **number_range) -> tuple:
  """``config[field]``, a tuple (or list) of distinct items that each pass the check.

  Items are strings from ``choices`` if given, else numbers (ints if
  ``integer``) in the range ``low``/``high``/``low_open``/``high_open`` of
  :func:`check_float`. A repeat is refused: a grid axis lists each value once.
  """
  items = config[field]
  forms = _tuple_forms(field, integer=integer, choices=choices)
  if not isinstance(items, (tuple, list)) or (not items and not allow_empty):
    raise ConfigError(f"config.{field} must be a non-empty tuple ({forms}), "
                      f"got {items!r}.")
  for i, item in enumerate(items):
    if choices is not None:
      if item not in choices:
        raise ConfigError(f"config.{field}[{i}] must be one of "
                          f"{list(choices)}, got {item!r}.")
    elif isinstance(item, (str, bytes, bool, np.bool_, type(None))):
      raise ConfigError(f"config.{field}[{i}] must be a number, got {item!r} "
                        f"(a tuple of numbers: {forms}).")
    else:
      _check_number(f"{field}[{i}]", item, integer=integer, **number_range)
    if item in items[:i]:
      raise ConfigError(f"config.{field}[{i}] repeats config.{field}"
                        f"[{list(items).index(item)}] ({item!r}); list each "
                        "value once.")
  return tuple(items)


def _tuple_forms(field: str, *, integer: bool,
                 choices: Sequence[str] | None) -> str:
  """How a tuple field is written on the command line, one item or several:
  ``--config.lams=0.1 or --config.lams='(0.1, 0.2)'``."""
  if choices:
    one, two = repr(choices[0]), repr(choices[min(1, len(choices) - 1)])
  else:
    one, two = ("1", "2") if integer else ("0.1", "0.2")
  return (f"--config.{field}={one.strip(chr(39))} or "
          f"--config.{field}=\"({one}, {two})\"" if choices else
          f"--config.{field}={one} or --config.{field}='({one}, {two})'")


# jax.random.key and numpy's generators take seeds up to this.
_MAX_SEED = 2 ** 63 - 1


def check_seed(config, field: str = "seed") -> int:
  """``config[field]``, an int in ``[0, 2**63 - 1]`` (what ``jax.random.key`` takes)."""
  return check_int(config, field, low=0, high=_MAX_SEED)


def memory_bytes() -> int:
  """What one process may hold: host RAM, or its smallest device's memory if
  smaller (this process's devices only: another host's cannot be asked)."""
  limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for device in jax.local_devices():
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
      limit = min(limit, int(stats["bytes_limit"]))
  return limit


def check_fits(nbytes: float, *, fields: str) -> None:
  """Refuses, in one line rather than inside XLA mid-run, a config whose
  arrays (``nbytes``, estimated) exceed :func:`memory_bytes`."""
  limit = memory_bytes()
  if nbytes > limit:
    raise ConfigError(f"config: {fields} need about {nbytes / 2**30:.3g} GiB, "
                      f"more than the {limit / 2**30:.3g} GiB this machine "
                      "has; make them smaller.")


def canonical(obj: Any) -> Any:
  """``obj`` as plain JSON types: tuples as lists, non-finite floats as the
  strings ``"nan"``, ``"inf"``, ``"-inf"`` (so NaN equals NaN), numpy scalars
  as Python numbers. Configs are compared and hashed in this form."""
  if isinstance(obj, (bool, np.bool_)):
    return bool(obj)
  if isinstance(obj, (float, np.floating)):
    return float(obj) if math.isfinite(obj) else str(float(obj))
  if isinstance(obj, np.integer):
    return int(obj)
  if isinstance(obj, dict):
    return {str(k): canonical(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [canonical(v) for v in obj]
  return obj


def config_dict(config: ml_collections.ConfigDict) -> dict:
  """The config in canonical form (what ``config.json`` holds)."""
  return canonical(json.loads(config.to_json_best_effort(sort_keys=True)))


def digest(obj: Any) -> str:
  """SHA-256 (hex) of ``obj`` as sorted, compact, strict JSON: the config's
  hash, and the checksum of every output in a workdir."""
  text = json.dumps(obj, sort_keys=True, separators=(",", ":"),
                    allow_nan=False)
  return hashlib.sha256(text.encode()).hexdigest()


def _numbers_alike(obj: Any) -> Any:
  """``obj`` with ints as floats where exact (bools stay bools), as the hash
  sees it: ``--config.lams='(0, 0.1)'`` resumes a run of ``(0.0, 0.1)``."""
  if isinstance(obj, bool):
    return obj
  if isinstance(obj, int):
    return float(obj) if abs(obj) <= 2 ** 53 else obj
  if isinstance(obj, dict):
    return {k: _numbers_alike(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_numbers_alike(v) for v in obj]
  return obj


def config_hash(config: ml_collections.ConfigDict) -> str:
  """A hash of the canonical config; equal configs, equal hashes (numbers by
  value: ``0`` and ``0.0`` alike, as ``==`` has them)."""
  return digest(_numbers_alike(config_dict(config)))[:16]


class UnknownVariant(ValueError):
  """A config file's ``get_config(arg)`` got an ``arg`` it does not know."""


def variant(driver: str, arg: str | None, known: Sequence[str]) -> str | None:
  """``arg`` of ``get_config(arg)`` (``None`` or ``""``: the default), checked.

  Raises:
    UnknownVariant: naming ``arg`` and the ``known`` ones.
  """
  if arg in (None, ""):
    return None
  if arg not in known:
    raise UnknownVariant(f"{driver} config: unknown argument {arg!r}; "
                         f"known: {', '.join(repr(k) for k in known)} (or "
                         "none for the default).")
  return arg
