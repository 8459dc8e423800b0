"""What every driver shares: config checks, the workdir contract, atomic writes, progress lines.

A driver validates its config (:class:`ConfigError`, before anything is
written), then claims ``--workdir`` with :func:`claim_workdir` and writes
through the :class:`Workdir` it gets. The workdir then guarantees:

* Atomic files. Every write goes to a temporary ``.tmp-*`` file in the same
  folder and is renamed into place, so a killed run never leaves a
  half-written file; leftover ``.tmp-*`` files are removed by the next claim.
* One run at a time. The claim holds ``.elsa-lock`` with ``flock`` until the
  run ends; a second claim is refused while it is held, and the kernel
  releases it when the holder's process ends, however it ends.
* One config. ``config.json`` holds the config in canonical form (NaN as
  ``"nan"``, so a NaN equals itself; numbers by value, ``0`` as ``0.0``); a
  different config is refused unless ``overwrite``. Every output written
  through the workdir (train's checkpoints too) carries the config's hash
  and a checksum of its content, verified when read: a file of another
  config, altered or truncated is reported, naming the file and the way
  out, and never used.
* Ownership by record. Every write is recorded first in the manifest
  ``.elsa-outputs.json``, and never passes through a symlink. ``overwrite``
  starts afresh: it deletes what the manifest records (and ``config.json``,
  ``results.json``), reached part by part without following a symlink (a
  link is removed as a link), a folder only if the driver made it; every
  other file stays, whatever its name. A damaged manifest (or
  ``config.json``) is refused by name, and ``overwrite`` clears it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import stat
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
  """What one run may hold: host RAM, or the first device's memory if smaller."""
  limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  stats = jax.devices()[0].memory_stats() or {}
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


def way_out(path: str) -> str:
  """The end of a :class:`CorruptOutput` message: how to get rid of ``path``."""
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
                        + way_out(path)) from None


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
# The names every driver writes: overwrite deletes them (regular files only)
# even when the manifest that records the rest is damaged.
_FIXED = ("config.json", "results.json")
# What the manifest records: files the driver wrote, folders other code
# fills for it (deleted whole), folders it made on the way (deleted if empty).
_KINDS = ("files", "trees", "folders")


class WorkdirInUse(ValueError):
  """Another run holds the workdir, it holds another config's results, or
  something the driver did not make is in the way of a write."""


class UnusableWorkdir(ValueError):
  """``--workdir`` is not a folder this process can create, write and lock."""


def _uint8(text: str) -> np.ndarray:
  return np.frombuffer(text.encode(), np.uint8)


def _text(array) -> str:
  """A hash stored by :meth:`Workdir.seal` (uint8), or by earlier versions
  (a numpy string)."""
  array = np.asarray(array)
  return bytes(array).decode() if array.dtype == np.uint8 else str(array)


class Workdir:
  """A driver's view of its workdir: every output tied to one config.

  JSON outputs are objects; they are stored with an extra key ``"_check"``
  (the config hash and a SHA-256 of the rest), ``.npz`` outputs (and train's
  checkpoints) with two extra arrays (:meth:`seal`), and read back verified,
  without them. Writes are atomic, recorded in the manifest before they
  happen, so ``overwrite`` can delete exactly them, and never pass through a
  symlink. Build one with :func:`claim_workdir` to write;
  ``Workdir(path, config)`` alone only reads (other processes of a
  multi-host run).
  """

  def __init__(self, root: str, config: ml_collections.ConfigDict):
    self.root = root
    self.config_hash = config_hash(config)

  def path(self, name: str) -> str:
    return os.path.join(self.root, name)

  def exists(self, name: str) -> bool:
    return os.path.exists(self.path(name))

  def own(self, name: str, *, tree: bool = False) -> None:
    """Records ``name`` as this driver's, for ``overwrite`` to delete, and
    makes the folders on its way (recorded too).

    ``tree``: ``name`` is a folder that other code fills (a checkpoint
    manager), made here and deleted whole by ``overwrite``; one that exists
    but is not recorded is not the driver's, and is refused.

    Raises:
      ValueError: ``name`` is not a relative path inside the workdir.
      WorkdirInUse: a symlink or a file is on its way, a folder is at the
        name of a file, or the tree exists and is not the driver's.
    """
    if not _inside(name):
      raise ValueError(f"Workdir.own: {name!r} is not a path inside the "
                       "workdir (relative, normalised, without '..').")
    recorded = _manifest(self.root)
    folder = name if tree else os.path.dirname(name)
    parts = folder.split(os.sep) if folder else []
    new = {os.sep.join(parts[:i]) for i in range(1, len(parts) + 1)}
    new = {n for n in new if not os.path.lexists(self.path(n))}
    if tree and name not in new | recorded["trees"]:
      raise WorkdirInUse(
          f"{self.path(name)!r} exists, but this driver did not make it (it "
          f"is not in {MANIFEST}); move it away, or use another --workdir.")
    if not tree and os.path.isdir(self.path(name)):
      raise WorkdirInUse(f"{self.path(name)!r} is a folder this driver did "
                         "not make, where it writes a file; move it away, or "
                         "use another --workdir.")
    wanted = {"files": recorded["files"] | ({name} - {folder}),
              "trees": recorded["trees"] | ({name} & {folder} if tree
                                            else set()),
              "folders": recorded["folders"] | (new - {name})}
    if wanted != recorded:  # recorded before it exists: a kill leaves no orphan
      write_json(self.path(MANIFEST), {k: sorted(wanted[k]) for k in _KINDS})
    try:
      os.close(_open_folder(self.root, folder, make=True))
    except OSError as err:
      raise WorkdirInUse(
          f"cannot write {name!r} in workdir {self.root!r}: a folder on its "
          f"way is a symlink or a file ({err.strerror}); the driver writes "
          "only into real folders inside the workdir. Move it away, or use "
          "another --workdir.") from None

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
                          "cannot be trusted; " + way_out(path))
    self._verify(path, check.get("config_hash"),
                 check.get("sha256") == _digest(obj), remedy=path)
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

  def seal(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """``arrays`` (as numpy) plus the config hash and a SHA-256 of their
    content, as two uint8 arrays (any array store keeps them)."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    return {**arrays, _NPZ_HASH: _uint8(self.config_hash),
            _NPZ_SUM: _uint8(_array_digest(arrays))}

  def unseal(self, path: str, arrays: dict[str, Any], *,
             remedy: str | None = None) -> dict[str, np.ndarray]:
    """What :meth:`seal` gave, read back from ``path``: verified, without the
    two extra arrays.

    Raises:
      CorruptOutput: they are missing, of another config, or the content
        differs; naming ``path`` and the way out (delete ``remedy``,
        default ``path``).
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    found_hash, found_sum = arrays.pop(_NPZ_HASH, None), arrays.pop(_NPZ_SUM,
                                                                    None)
    if found_hash is None or found_sum is None:
      raise CorruptOutput(f"{path!r} has no config hash and checksum, so it "
                          "cannot be trusted; " + way_out(remedy or path))
    self._verify(path, _text(found_hash),
                 _text(found_sum) == _array_digest(arrays),
                 remedy=remedy or path)
    return arrays

  def write_npz(self, name: str, arrays: dict[str, np.ndarray]) -> None:
    """Saves ``arrays`` as ``name`` (``.npz``), tied to the config."""
    sealed = self.seal(arrays)
    self.own(name)
    _atomic_write(self.path(name), lambda f: np.savez(f, **sealed))

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
                          + way_out(path)) from None
    return self.unseal(path, arrays)

  def save_figure(self, fig, name: str) -> None:
    """Saves a matplotlib figure as ``name`` (PNG), atomically."""
    self.own(name)
    save_figure(fig, self.path(name))

  def _verify(self, path: str, found_hash, content_ok: bool, *,
              remedy: str) -> None:
    if found_hash != self.config_hash:
      raise CorruptOutput(f"{path!r} was written by another config (hash "
                          f"{found_hash}, this config {self.config_hash}); "
                          + way_out(remedy))
    if not content_ok:
      raise CorruptOutput(f"{path!r} fails its checksum: it was altered or "
                          "damaged after it was written; " + way_out(remedy))


def _inside(name) -> bool:
  """Whether ``name`` is a relative, normalised path below the workdir
  without ``..`` (what a manifest may list): resolved part by part without
  following a symlink (:func:`_open_folder`), it stays inside."""
  if not isinstance(name, str) or not name or os.path.isabs(name):
    return False
  return (os.path.normpath(name) == name and name != "."
          and ".." not in name.split(os.sep))


def _open_folder(root: str, name: str, *, make: bool = False) -> int:
  """A descriptor of the folder ``root/name``, opened part by part without
  following a symlink, so it is the folder inside ``root`` whatever was
  linked or swapped in (a symlinked ``root`` itself is followed).

  Raises:
    OSError: a part is missing (``make``: it is made instead), a symlink or
      not a folder.
  """
  fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  try:
    for part in name.split(os.sep) if name else ():
      if make:
        with contextlib.suppress(FileExistsError):
          os.mkdir(part, dir_fd=fd)
      inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                      | os.O_CLOEXEC, dir_fd=fd)
      os.close(fd)
      fd = inner
    return fd
  except BaseException:
    os.close(fd)
    raise


def _delete(root: str, name: str, kind: str) -> bool:
  """Deletes ``root/name``, reached without following a symlink: a file or a
  symlink is unlinked (a link is never followed); a folder only as a
  ``trees`` entry (with its contents) or an empty ``folders`` one. Returns
  whether it deleted something."""
  try:
    fd = _open_folder(root, os.path.dirname(name))
  except OSError:
    return False  # a folder on the way is gone, a symlink or a file
  base = os.path.basename(name)
  try:
    is_dir = stat.S_ISDIR(os.stat(base, dir_fd=fd,
                                  follow_symlinks=False).st_mode)
    if kind == "folders":
      os.rmdir(base, dir_fd=fd)
    elif is_dir and kind == "trees":
      shutil.rmtree(base, dir_fd=fd)
    elif not is_dir:
      os.unlink(base, dir_fd=fd)
    else:
      return False  # a folder where the driver wrote a file: not its own
    return True
  except OSError:  # gone, or a folder not empty: the user's files stay
    return False
  finally:
    os.close(fd)


def _manifest(root: str) -> dict[str, set[str]]:
  """What the manifest records, ``{kind: names}`` for each of :data:`_KINDS`
  (a plain list, as earlier versions wrote, holds files).

  Raises:
    CorruptOutput: it is not valid JSON, or not names inside ``root``.
  """
  path = os.path.join(root, MANIFEST)
  try:
    found = read_json(path)
  except CorruptOutput:
    found = "damaged"
  if found is None or isinstance(found, list):
    found = {"files": found or []}
  if (isinstance(found, dict) and set(found) <= set(_KINDS)
      and all(isinstance(v, list) and all(_inside(n) for n in v)
              for v in found.values())):
    return {kind: set(found.get(kind, ())) for kind in _KINDS}
  raise CorruptOutput(
      f"{path!r}, the record of what the driver wrote in this workdir (what "
      "--overwrite deletes), is damaged. Rerun with --overwrite to start "
      f"afresh: it then deletes only {' and '.join(_FIXED)}, and keeps every "
      "other file (delete what you no longer want by hand); or use another "
      "--workdir.")


@contextlib.contextmanager
def _locked(root: str) -> Iterator[None]:
  """Holds ``root/LOCK`` with ``flock``: exclusive, released by the kernel
  when the process ends, however it ends (so a killed run leaves no stale
  lock). The file names the holder, for the refusal message, and is deleted
  while still held; a claimer that locked the deleted file retries on the
  new one."""
  path = os.path.join(root, LOCK)
  while True:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o644)
    except OSError as err:
      raise _unusable(root, err) from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.read(fd, 1000).decode(errors="replace") or "starting"
      os.close(fd)
      raise WorkdirInUse(
          f"workdir {root!r} is in use by another run ({holder}; lock file "
          f"{path!r}). Wait for it to finish, or use another --workdir.") from None
    except OSError as err:
      os.close(fd)
      raise _unusable(root, err) from None
    with contextlib.suppress(FileNotFoundError):
      if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
        break
    os.close(fd)
  try:
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    os.close(fd)


def _unusable(root: str, err: OSError) -> UnusableWorkdir:
  if os.path.exists(root) and not os.path.isdir(root):
    what = "is not a folder"
  elif not os.path.isdir(root):
    what = f"cannot be created ({err.strerror})"
  else:
    what = f"cannot be written or locked ({err.strerror})"
  return UnusableWorkdir(f"workdir {root!r} {what}; pass a folder this user "
                         "can write (on a filesystem with file locks) as "
                         "--workdir.")


def _remove_leftover_tmp(root: str, recorded: dict[str, set[str]]) -> None:
  """Deletes ``.tmp-*`` files of killed writes (the lock is held: none is
  live) in the folders drivers write to: ``root``, ``figures/`` and the
  folders the manifest records or writes files into (never through a
  symlink)."""
  folders = {"", "figures"} | recorded["folders"] | {
      os.path.dirname(name) for name in recorded["files"]}
  for folder in folders:
    try:
      fd = _open_folder(root, folder)
    except OSError:
      continue
    try:
      for name in os.listdir(fd):
        if _TMP_NAME.match(name) and stat.S_ISREG(
            os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
          os.unlink(name, dir_fd=fd)
    finally:
      os.close(fd)


def _delete_outputs(root: str, recorded: dict[str, set[str]]) -> list[str]:
  """Deletes what the manifest records (and :data:`_FIXED`), then the
  manifest, then the folders the driver made that are left empty; returns
  the names deleted."""
  deleted = [name for kind, names in (("files", recorded["files"]
                                       | set(_FIXED)),
                                      ("trees", recorded["trees"]))
             for name in sorted(names) if _delete(root, name, kind)]
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(root, MANIFEST))
  for name in sorted(recorded["folders"], key=len, reverse=True):  # inner first
    _delete(root, name, "folders")
  return deleted


def _check_config_json(root: str, wanted: dict, overwrite: bool,
                       recorded: dict[str, set[str]]) -> None:
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
  outputs = [n for n in recorded["files"] | recorded["trees"] | {_FIXED[1]}
             if n != "config.json" and os.path.lexists(os.path.join(root, n))]
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


def _check_manifest(root: str, overwrite: bool) -> dict[str, set[str]]:
  """The manifest's record; a damaged one is refused, or with ``overwrite``
  deleted (with a warning) and taken as empty."""
  try:
    return _manifest(root)
  except CorruptOutput:
    if not overwrite:
      raise
    os.remove(os.path.join(root, MANIFEST))
    logging.warning("--overwrite: %s was damaged and is deleted; files it "
                    "listed beyond %s stay in %s.", MANIFEST,
                    " and ".join(_FIXED), root)
    return _manifest(root)


@contextlib.contextmanager
def claim_workdir(workdir: str, config: ml_collections.ConfigDict, *,
                  overwrite: bool = False) -> Iterator[Workdir]:
  """Holds ``workdir`` for one run of ``config``; yields its :class:`Workdir`.

  In order: makes the folder, takes the lock (refused while another run
  holds it), checks the manifest, removes leftover ``.tmp-*`` files, refuses
  a different (or a damaged) config unless ``overwrite``, and with
  ``overwrite`` deletes what the driver wrote before (see the module
  docstring) and only then writes ``config.json``: an interruption in
  between leaves a workdir that resumes nothing stale. A matching config is
  left as it is: the run resumes or skips finished work. The lock is
  released when the block ends, also by an exception.

  Raises:
    UnusableWorkdir: ``workdir`` is a file, or cannot be made, written or
      locked.
    WorkdirInUse: another run holds the lock, or the workdir holds another
      config's outputs and ``overwrite`` is off.
    CorruptOutput: ``config.json`` or the manifest is damaged and
      ``overwrite`` is off.
  """
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as err:
    raise _unusable(workdir, err) from None
  with _locked(workdir):
    recorded = _check_manifest(workdir, overwrite)
    _remove_leftover_tmp(workdir, recorded)
    wanted = config_dict(config)
    _check_config_json(workdir, wanted, overwrite, recorded)
    if overwrite:
      deleted = _delete_outputs(workdir, recorded)
      if deleted:
        logging.info("--overwrite: deleted %s from %s", ", ".join(deleted),
                     workdir)
    write_json(os.path.join(workdir, "config.json"), wanted)
    yield Workdir(workdir, config)

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


def _no_such_field(err: LookupError | AttributeError, config_file: str
                   ) -> str:
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top
  fields = config_flags.ConfigFileFlagParser("config").parse(config_file)
  return (f"unknown config field {str(err).strip(chr(34))}; the config's "
          "fields are "
          f"{', '.join(sorted(fields))}.")


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
  # An unknown --config.FIELD raises AttributeError in ml_collections, here
  # (the default config file) or when absl parses --config=FILE; either way
  # it is reported in one line, without traceback.
  default = config_path(config_name)
  try:
    holder = config_flags.DEFINE_config_file(
        "config", default=default,
        help_string="Config file (experiments/configs/*.py).")
  except (AttributeError, KeyError) as err:
    raise SystemExit(f"{config_name}: {_no_such_field(err, default)}") from None
  flag = flags.FLAGS[holder.name]
  parse = flag._parse  # pylint: disable=protected-access

  def parse_naming_unknown_fields(argument):
    try:
      return parse(argument)
    except (AttributeError, KeyError) as err:  # absl reports it in one line
      raise flags.IllegalFlagValueError(_no_such_field(err, argument)) from None

  flag._parse = parse_naming_unknown_fields  # pylint: disable=protected-access
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
  except (ConfigError, WorkdirInUse, UnusableWorkdir, CorruptOutput) as refusal:
    raise SystemExit(f"{name}: {refusal}") from None
