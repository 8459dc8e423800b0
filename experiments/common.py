"""What every driver shares: config checks, the workdir contract, atomic writes, progress lines.

A driver validates its config (:class:`ConfigError`, before anything is
written), then claims ``--workdir`` with :func:`claim_workdir` and writes
through the :class:`Workdir` it gets. The workdir then guarantees:

* Atomic files. Every write goes to a temporary ``.tmp-*`` file in the same
  folder and is renamed into place, so a killed run never leaves a
  half-written file; leftover ``.tmp-*`` files are removed by the next claim.
* One run at a time. The claim holds ``.elsa-lock`` (the holder's pid and
  host) until the run ends; a second claim is refused while the holder is
  alive, and takes the lock over when its process is gone (same host).
* One config. ``config.json`` holds the config in canonical form (NaN as
  ``"nan"``, so a NaN equals itself; numbers by value, ``0`` as ``0.0``); a
  different config is refused unless ``overwrite``. Every output written
  through the workdir carries the config's hash and a checksum of its
  content, verified when read: a file of another config, altered or
  truncated is reported, naming the file and the way out, and never used.
* ``overwrite`` starts afresh: it deletes what this driver wrote (the names in
  the manifest ``.elsa-outputs.json``, plus ``config.json``, ``results.json``
  and the exact names the driver declares ``owned``) and nothing else. The
  manifest lists only paths inside the workdir; a damaged one (or a damaged
  ``config.json``) is refused by name, and ``overwrite`` clears it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from typing import Any, Iterator, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np


# --- relative error ----------------------------------------------------------


def relative_error(a, b):
  r"""``||a - b||_2 / max(||b||_2, tiny)`` over the last axis: ``[...]`` from ``[..., d]``.

  ``tiny = finfo(dtype of b).tiny`` keeps ``b = 0`` finite. numpy in, numpy
  out (in the inputs' precision); JAX arrays (also traced ones) in, JAX out.
  The one definition every driver reports.
  """
  xp = jnp if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np
  a, b = xp.asarray(a), xp.asarray(b)
  tiny = xp.finfo(b.dtype).tiny
  return (xp.linalg.norm(a - b, axis=-1)
          / xp.maximum(xp.linalg.norm(b, axis=-1), tiny))


# --- config checks -----------------------------------------------------------


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
  ``integer``) in the range given as ``low``/``high``/``low_open``/
  ``high_open``, as :func:`check_float`. An item given twice is refused: a
  grid axis lists each value once (a repeat would repeat its results under
  one key).
  """
  items = config[field]
  if not isinstance(items, (tuple, list)) or (not items and not allow_empty):
    raise ConfigError(f"config.{field} must be a non-empty tuple, got "
                      f"{items!r}.")
  for i, item in enumerate(items):
    if choices is not None:
      if item not in choices:
        raise ConfigError(f"config.{field}[{i}] must be one of "
                          f"{list(choices)}, got {item!r}.")
    else:
      _check_number(f"{field}[{i}]", item, integer=integer, **number_range)
    if item in items[:i]:
      raise ConfigError(f"config.{field}[{i}] repeats config.{field}"
                        f"[{list(items).index(item)}] ({item!r}); list each "
                        "value once.")
  return tuple(items)


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
  """Refuses a config whose arrays (``nbytes``, estimated) exceed :func:`memory_bytes`.

  Fails here, in one line, rather than inside XLA mid-run.
  """
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


def _digest(obj: Any) -> str:
  text = json.dumps(obj, sort_keys=True, separators=(",", ":"),
                    allow_nan=False)
  return hashlib.sha256(text.encode()).hexdigest()


def _numbers_alike(obj: Any) -> Any:
  """``obj`` with ints as floats where that is exact (bools stay bools): what
  the hash sees, so that ``0`` and ``0.0``, equal in the comparison of
  ``config.json``, also hash alike (``--config.lams='(0, 0.1)'`` then resumes
  a run of ``(0.0, 0.1)``)."""
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
  return _digest(_numbers_alike(config_dict(config)))[:16]


# --- files -------------------------------------------------------------------

_TMP_PREFIX = ".tmp-"
# What tempfile.mkstemp(prefix=_TMP_PREFIX) names: 8 random characters, then
# the final name; nothing else in a workdir is removed as a leftover.
_TMP_NAME = re.compile(re.escape(_TMP_PREFIX) + r"[a-z0-9_]{8}.")


def _atomic_write(path: str, write) -> None:
  """Calls ``write(file)`` on a temporary file next to ``path``, then renames it."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TMP_PREFIX,
                             suffix=os.path.basename(path))
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


class CorruptOutput(ValueError):
  """A file in the workdir is unreadable, altered, or of another config."""


def _way_out(path: str) -> str:
  return (f"delete {path!r} (or rerun with --overwrite to start afresh) and "
          "that part is computed again.")


def write_json(path: str, obj: Any) -> None:
  """Writes ``obj`` as indented, strict JSON (NaN and inf become null), atomically."""
  data = json.dumps(finite_or_none(obj), indent=2, sort_keys=True,
                    allow_nan=False).encode()
  _atomic_write(path, lambda f: f.write(data))


def read_json(path: str) -> Any | None:
  """The JSON in ``path``, or ``None`` when there is no such file.

  Raises:
    CorruptOutput: the file is not valid JSON (truncated or damaged).
  """
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as err:
    raise CorruptOutput(f"{path!r} is not valid JSON ({err}); "
                        + _way_out(path)) from None


def save_figure(fig, path: str) -> None:
  """Saves a matplotlib figure as PNG, atomically, and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120,
                                            bbox_inches="tight"))
  plt.close(fig)


def _array_digest(arrays: dict[str, np.ndarray]) -> str:
  sha = hashlib.sha256()
  for name in sorted(arrays):
    array = np.ascontiguousarray(arrays[name])
    sha.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
    sha.update(array.tobytes())
  return sha.hexdigest()


# --- the workdir -------------------------------------------------------------

LOCK = ".elsa-lock"
MANIFEST = ".elsa-outputs.json"
_CHECK = "_check"  # key of the config hash and checksum in a JSON output
_NPZ_HASH, _NPZ_SUM = "__config_hash__", "__sha256__"


class WorkdirInUse(ValueError):
  """The workdir holds another config's results, or another run holds it."""


class Workdir:
  """A driver's view of its workdir: every output tied to one config.

  JSON outputs are objects; they are stored with an extra key ``"_check"``
  (the config hash and a SHA-256 of the rest), ``.npz`` outputs with two
  extra arrays, and read back verified, without them. Writes are atomic and
  recorded in the manifest, so ``overwrite`` can delete exactly them. Build
  one with :func:`claim_workdir` to write; ``Workdir(path, config)`` alone
  only reads (other processes of a multi-host run).
  """

  def __init__(self, root: str, config: ml_collections.ConfigDict):
    self.root = root
    self.config_hash = config_hash(config)

  def path(self, name: str) -> str:
    return os.path.join(self.root, name)

  def exists(self, name: str) -> bool:
    return os.path.exists(self.path(name))

  def own(self, name: str) -> None:
    """Records ``name`` (a file or folder written by other code) as this
    driver's, for ``overwrite`` to delete.

    Raises:
      ValueError: ``name`` is not a relative path inside the workdir.
    """
    if not _inside(name):
      raise ValueError(f"Workdir.own: {name!r} is not a path inside the "
                       "workdir (relative, without '..').")
    names = _manifest(self.root)
    if name not in names:
      write_json(self.path(MANIFEST), sorted(names | {name}))

  def write_json(self, name: str, obj: dict) -> None:
    """Writes the JSON object ``obj`` as ``name``, tied to the config."""
    if not isinstance(obj, dict) or _CHECK in obj:
      raise TypeError(f"Workdir.write_json: {name}: needs a dict without a "
                      f"{_CHECK!r} key.")
    obj = finite_or_none(obj)
    self.own(name)
    write_json(self.path(name), {**obj, _CHECK: dict(
        config_hash=self.config_hash, sha256=_digest(obj))})

  def read_json(self, name: str) -> dict | None:
    """What :meth:`write_json` wrote as ``name``, verified; ``None`` if absent.

    Raises:
      CorruptOutput: not valid JSON, altered, or of another config.
    """
    path = self.path(name)
    obj = read_json(path)
    if obj is None:
      return None
    check = obj.pop(_CHECK, None) if isinstance(obj, dict) else None
    if not isinstance(check, dict):
      raise CorruptOutput(f"{path!r} has no config hash and checksum, so it "
                          "cannot be trusted; " + _way_out(path))
    self._verify(path, check.get("config_hash"),
                 check.get("sha256") == _digest(obj))
    return obj

  def results(self, compute, *, name: str) -> dict:
    """``results.json`` of a finished run, else ``compute()`` written as it.

    ``results.json`` is written last, so its presence means the run is
    complete; the returned dict has JSON nulls for non-finite numbers either
    way (:func:`finite_or_none`). ``name``: the driver, for the log line.
    """
    found = self.read_json("results.json")
    if found is not None:
      logging.info("%s: %s holds finished results; nothing to compute.", name,
                   self.path("results.json"))
      return found
    results = finite_or_none(compute())
    self.write_json("results.json", results)
    return results

  def write_npz(self, name: str, arrays: dict[str, np.ndarray]) -> None:
    """Saves ``arrays`` as ``name`` (``.npz``), tied to the config."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    self.own(name)
    _atomic_write(self.path(name), lambda f: np.savez(
        f, **arrays, **{_NPZ_HASH: np.asarray(self.config_hash),
                        _NPZ_SUM: np.asarray(_array_digest(arrays))}))

  def read_npz(self, name: str) -> dict[str, np.ndarray] | None:
    """What :meth:`write_npz` saved as ``name``, verified; ``None`` if absent."""
    path = self.path(name)
    if not os.path.exists(path):
      return None
    try:
      with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    except Exception as err:  # pylint: disable=broad-except
      # zipfile, numpy and OS errors alike: the file cannot be read whole.
      raise CorruptOutput(f"{path!r} is not a readable .npz file ({err}); "
                          + _way_out(path)) from None
    found_hash, found_sum = arrays.pop(_NPZ_HASH, None), arrays.pop(_NPZ_SUM,
                                                                    None)
    if found_hash is None or found_sum is None:
      raise CorruptOutput(f"{path!r} has no config hash and checksum, so it "
                          "cannot be trusted; " + _way_out(path))
    self._verify(path, str(found_hash),
                 str(found_sum) == _array_digest(arrays))
    return arrays

  def save_figure(self, fig, name: str) -> None:
    """Saves a matplotlib figure as ``name`` (PNG), atomically."""
    self.own(name)
    save_figure(fig, self.path(name))

  def _verify(self, path: str, found_hash, content_ok: bool) -> None:
    if found_hash != self.config_hash:
      raise CorruptOutput(f"{path!r} was written by another config (hash "
                          f"{found_hash}, this config {self.config_hash}); "
                          + _way_out(path))
    if not content_ok:
      raise CorruptOutput(f"{path!r} fails its checksum: it was altered or "
                          "damaged after it was written; " + _way_out(path))


def _inside(name) -> bool:
  """Whether ``name`` is a relative path below the workdir (not the workdir
  itself): what a manifest may list, so ``overwrite`` never deletes outside."""
  if not isinstance(name, str) or not name or os.path.isabs(name):
    return False
  parts = os.path.normpath(name).split(os.sep)
  return ".." not in parts and parts != ["."] and "" not in parts


def _manifest(root: str) -> set[str]:
  """The names the manifest lists.

  Raises:
    CorruptOutput: it is not valid JSON, or not a list of names inside
      ``root``.
  """
  path = os.path.join(root, MANIFEST)
  try:
    names = read_json(path)
  except CorruptOutput:
    names = "damaged"
  if names is None:
    return set()
  if not isinstance(names, list) or not all(_inside(n) for n in names):
    raise CorruptOutput(
        f"{path!r}, the list of what the driver wrote in this workdir (what "
        "--overwrite deletes), is damaged. Rerun with --overwrite to start "
        "afresh: it then deletes only config.json, results.json and the "
        "driver's own partial files, and keeps every other file (delete "
        "figures you no longer want by hand); or use another --workdir.")
  return set(names)


def _lock_text() -> str:
  return json.dumps(dict(pid=os.getpid(), host=socket.gethostname(),
                         since=time.strftime("%Y-%m-%d %H:%M:%S")))


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # someone else's process
  return True


def _acquire_lock(root: str) -> str:
  """Creates ``root/LOCK`` holding this process's pid and host; returns its text.

  The file is written whole, then linked into place (``os.link`` fails if the
  name exists), so a lock is never seen half-written. A lock whose process is
  gone (same host) is stale: it is moved aside and this process takes over.
  """
  path, text = os.path.join(root, LOCK), _lock_text()
  fd, tmp = tempfile.mkstemp(dir=root, prefix=_TMP_PREFIX, suffix=LOCK)
  with os.fdopen(fd, "w") as f:
    f.write(text)
  try:
    for _ in range(3):
      try:
        os.link(tmp, path)
        return text
      except FileExistsError:
        pass
      try:
        with open(path, encoding="utf-8") as f:
          held = f.read()
      except FileNotFoundError:
        continue  # released meanwhile: try again
      try:
        holder = json.loads(held)
        pid, host = int(holder["pid"]), str(holder["host"])
      except (ValueError, KeyError, TypeError):
        pid, host = None, socket.gethostname()  # unreadable: nobody's
      if host != socket.gethostname() or (pid is not None and _alive(pid)):
        raise WorkdirInUse(
            f"workdir {root!r} is in use by another run (pid {pid} on host "
            f"{host}, lock file {path!r}). Wait for it to finish, or use "
            "another --workdir; if no such run is alive, delete the lock file.")
      _take_over(path, held)
    raise WorkdirInUse(f"workdir {root!r}: could not take over the stale lock "
                       f"{path!r}; another run is claiming it.")
  finally:
    os.remove(tmp)


def _take_over(path: str, held: str) -> None:
  """Removes the stale lock ``path`` if it still holds ``held``."""
  aside = f"{path}.stale-{os.getpid()}"
  try:
    os.rename(path, aside)  # atomic: of two takers, one moves it
  except FileNotFoundError:
    return
  with open(aside, encoding="utf-8") as f:
    moved = f.read()
  if moved != held:  # a new holder's lock, taken meanwhile: put it back
    with contextlib.suppress(FileExistsError):
      os.link(aside, path)
  os.remove(aside)
  logging.warning("took over the stale lock %s (%s)", path, held)


def _release_lock(root: str, text: str) -> None:
  path = os.path.join(root, LOCK)
  with contextlib.suppress(FileNotFoundError):
    with open(path, encoding="utf-8") as f:
      mine = f.read() == text
    if mine:
      os.remove(path)


def _remove_leftover_tmp(root: str) -> None:
  """Deletes ``.tmp-*`` files of killed writes (the lock is held: none is live)
  in the folders drivers write to: ``root``, ``figures/`` (where a driver
  without a manifest, ``train``, saves its figures) and the folders of the
  manifest's names."""
  folders = {root, os.path.join(root, "figures")} | {
      os.path.dirname(os.path.join(root, name)) for name in _manifest(root)}
  for folder in folders:
    if not os.path.isdir(folder) or os.path.islink(folder):
      continue
    for name in os.listdir(folder):
      path = os.path.join(folder, name)
      if (_TMP_NAME.match(name) and not name.endswith(LOCK)
          and os.path.isfile(path)):
        os.remove(path)


def _outputs(root: str, owned: Sequence[str]) -> list[str]:
  """What the driver wrote that exists: manifest names, ``config.json``,
  ``results.json`` and ``owned`` (exact names, ``*`` matching within a
  top-level name)."""
  names = _manifest(root) | {"config.json", "results.json"}
  patterns = [re.compile(re.escape(p).replace(r"\*", "[^/]*") + r"\Z")
              for p in owned]
  names |= {n for n in os.listdir(root) if any(p.match(n) for p in patterns)}
  return sorted(n for n in names if os.path.lexists(os.path.join(root, n)))


def _delete_outputs(root: str, owned: Sequence[str]) -> list[str]:
  """Deletes :func:`_outputs`, then the manifest and the folders that the
  deletions left empty; returns the names deleted."""
  deleted = _outputs(root, owned)
  for name in deleted:
    target = os.path.join(root, name)
    if os.path.isdir(target) and not os.path.islink(target):
      shutil.rmtree(target)
    else:
      os.remove(target)
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(root, MANIFEST))
  for name in deleted:
    folder = os.path.dirname(os.path.join(root, name))
    while os.path.normpath(folder) != os.path.normpath(root):
      with contextlib.suppress(OSError):  # not empty: the user's files stay
        os.rmdir(folder)
      folder = os.path.dirname(folder)
  return deleted


def _check_config_json(root: str, wanted: dict, overwrite: bool,
                       owned: Sequence[str]) -> None:
  """Refuses a workdir of another config, or with outputs but no config."""
  path = os.path.join(root, "config.json")
  try:
    found = read_json(path)
    damaged = found is not None and not isinstance(found, dict)
  except CorruptOutput:
    damaged = True
  if damaged:
    if overwrite:
      return
    raise CorruptOutput(
        f"{path!r} is damaged (not a JSON object), so nothing says which "
        "config made this workdir's outputs. Rerun with --overwrite to start "
        "afresh (it deletes only what the driver wrote), or use another "
        "--workdir.")
  if found is not None:
    found = canonical(found)
  outputs = [n for n in _outputs(root, owned) if n != "config.json"]
  if overwrite or found == wanted or (found is None and not outputs):
    return
  if found is None:
    why = "outputs but no config.json to say which config made them"
  else:
    changed = sorted(k for k in set(found) | set(wanted)
                     if found.get(k) != wanted.get(k))
    why = ("results of a different config (fields that differ: "
           f"{', '.join(changed)})")
  raise WorkdirInUse(f"workdir {root!r} holds {why}. Use another --workdir, "
                     "or pass --overwrite to replace them.")


def _check_manifest(root: str, overwrite: bool) -> None:
  """Refuses a damaged manifest; ``overwrite`` deletes it (with a warning)."""
  try:
    _manifest(root)
  except CorruptOutput:
    if not overwrite:
      raise
    os.remove(os.path.join(root, MANIFEST))
    logging.warning("--overwrite: %s was damaged and is deleted; files it "
                    "listed beyond the driver's fixed names stay in %s.",
                    MANIFEST, root)


@contextlib.contextmanager
def claim_workdir(workdir: str, config: ml_collections.ConfigDict, *,
                  overwrite: bool = False, owned: Sequence[str] = ()
                  ) -> Iterator[Workdir]:
  """Holds ``workdir`` for one run of ``config``; yields its :class:`Workdir`.

  In order: takes the lock (refused while another live run holds it), checks
  the manifest, removes leftover ``.tmp-*`` files, refuses a different (or a
  damaged) config unless ``overwrite``,
  and with ``overwrite`` deletes what the driver wrote before (see the module
  docstring) and only then writes ``config.json``: an interruption in between
  leaves a workdir that resumes nothing stale. A matching config is left as
  it is: the run resumes or skips finished work. The lock is released when
  the block ends, also by an exception.

  Args:
    owned: names the driver writes other than through the :class:`Workdir`
      (say a checkpoint folder), or did before the manifest existed; ``*``
      matches within a name. ``overwrite`` deletes them too.

  Raises:
    WorkdirInUse: another run holds the lock, or the workdir holds another
      config's outputs and ``overwrite`` is off.
    CorruptOutput: ``config.json`` or the manifest is damaged and
      ``overwrite`` is off.
  """
  os.makedirs(workdir, exist_ok=True)
  lock = _acquire_lock(workdir)
  try:
    _check_manifest(workdir, overwrite)
    _remove_leftover_tmp(workdir)
    wanted = config_dict(config)
    _check_config_json(workdir, wanted, overwrite, owned)
    if overwrite:
      deleted = _delete_outputs(workdir, owned)
      if deleted:
        logging.info("--overwrite: deleted %s from %s", ", ".join(deleted),
                     workdir)
    write_json(os.path.join(workdir, "config.json"), wanted)
    yield Workdir(workdir, config)
  finally:
    _release_lock(workdir, lock)


def per_kappa(config, wd: "Workdir", compute, *, name: str) -> list[dict]:
  """``compute(kappa, rng)`` for every ``config.kappas``, each saved as
  ``partial_kappa<i>.json`` the moment it is done and loaded instead on a
  rerun (tied to the config like every output); numbers non-finite as
  ``None``. ``rng`` is ``np.random.default_rng([config.seed, i])``, so a
  resumed kappa draws what an uninterrupted run would. Runs at the highest
  matmul precision."""
  names = [f"partial_kappa{i}.json" for i in range(len(config.kappas))]
  results = [wd.read_json(n) for n in names]
  progress = Progress(len(names), name=name, unit="kappas")
  progress.resumed(sum(r is not None for r in results))
  with jax.default_matmul_precision("highest"):
    for i, kappa in enumerate(config.kappas):
      if results[i] is None:
        rng = np.random.default_rng([config.seed, i])
        results[i] = finite_or_none(compute(float(kappa), rng))
        wd.write_json(names[i], results[i])
        progress.update()
  return results


# --- progress and the command line -------------------------------------------


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
  ``jax_enable_x64`` on inside the block for float64 and the previous setting
  restored after it."""
  if dtype == "float64":
    with jax.enable_x64(True):
      yield jnp.dtype(jnp.float64)
  else:
    yield jnp.dtype(dtype)


def variant(driver: str, arg: str | None, known: Sequence[str]) -> str | None:
  """``arg`` of ``get_config(arg)`` (``None`` or ``""``: the default), checked."""
  if arg in (None, ""):
    return None
  if arg not in known:
    raise ValueError(f"{driver} config: unknown argument {arg!r}; known: "
                     f"{', '.join(repr(k) for k in known)} (or none for the "
                     "default).")
  return arg


def config_path(config_name: str) -> str:
  """``experiments/configs/<config_name>.py``, found next to this file (any cwd)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                      f"{config_name}.py")


def define_flags(config_name: str) -> None:
  """The flags every driver takes; called only under ``__main__``.

  ``--config`` (default ``experiments/configs/<config_name>.py``; a variant
  as ``--config=experiments/configs/<config_name>.py:tiny``; any field as
  ``--config.FIELD=VALUE``, tuples as ``--config.FIELD='(1, 2)'``),
  ``--workdir`` (required) and ``--overwrite``. Defining them only when a
  driver runs as a program lets tests and notebooks import every driver into
  one process.
  """
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file("config", default=config_path(config_name),
                                  help_string="Config file (experiments/configs/*.py).")
  flags.DEFINE_string("workdir", None, "Where config.json, results and figures go.",
                      required=True)
  flags.DEFINE_bool("overwrite", False,
                    "Start afresh: delete what this driver wrote in --workdir "
                    "(of any config) before running; other files stay.")


def run_main(argv, name: str, run, **kwargs):
  """Calls ``run(config, workdir, overwrite=..., **kwargs)`` from the flags.

  A bad config, a workdir in use or of another config, or a damaged output is
  the user's call, not a bug: it ends the program with a one-line message
  instead of a traceback.
  """
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = flags.FLAGS.config
  try:
    return run(config, flags.FLAGS.workdir, overwrite=flags.FLAGS.overwrite,
               **kwargs)
  except (ConfigError, WorkdirInUse, CorruptOutput) as refusal:
    raise SystemExit(f"{name}: {refusal}") from None
