"""What every driver shares: config checks, the workdir contract, atomic writes, progress lines.

A driver validates its config (:class:`ConfigError`, before anything is
written), then claims ``--workdir`` with :func:`claim_workdir` and writes
through the :class:`Workdir` it gets. The workdir then guarantees:

* Atomic files: each is written to a ``.tmp-*`` file and renamed into place;
  leftover ``.tmp-*`` files of a killed run are removed by the next claim.
* One run at a time: the claim holds ``.elsa-lock`` (``flock``, which the
  kernel releases when the process ends, however it ends).
* One config: ``config.json`` holds it in canonical form (NaN as ``"nan"``,
  numbers by value); another config is refused unless ``overwrite``. Every
  output (train's checkpoints too) carries the config's hash and a checksum
  of its content, verified when read: one of another config, altered or
  truncated is refused, naming the file and the way out.
* Ownership by record: each write is first recorded in the manifest
  ``.elsa-outputs.json`` and never passes through a symlink. ``overwrite``
  deletes what the manifest records (and ``config.json``, ``results.json``),
  reached without following a symlink (a link is removed as a link), a
  folder only if the driver made it for other code to fill; every other
  file stays, whatever its name. The manifest carries a checksum and is
  read without following a symlink: an edited, damaged or linked manifest
  (or a damaged ``config.json``) is refused by name, and ``overwrite``
  clears it without deleting anything it names.
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
  ``integer``) in the range ``low``/``high``/``low_open``/``high_open`` of
  :func:`check_float`. A repeat is refused: a grid axis lists each value once.
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


def _digest(obj: Any) -> str:
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
# Every driver writes these: overwrite deletes them even without a manifest.
_FIXED = ("config.json", "results.json")


class WorkdirInUse(ValueError):
  """Another run holds the workdir, or other files are in the way."""


class UnusableWorkdir(ValueError):
  """``--workdir`` is not a folder this process can make, write and lock."""


class Workdir:
  """A driver's view of its workdir: every output tied to one config.

  JSON outputs (objects) get an extra key ``"_check"``, the config hash and
  a SHA-256 of the rest; ``.npz`` outputs and checkpoints two extra arrays
  (:meth:`seal`); reads verify and drop them. Build one with
  :func:`claim_workdir` to write; ``Workdir(path, config)`` alone only reads
  (other processes of a multi-host run).
  """

  def __init__(self, root: str, config: ml_collections.ConfigDict):
    self.root = root
    self.config_hash = config_hash(config)

  def path(self, name: str) -> str:
    return os.path.join(self.root, name)

  def exists(self, name: str) -> bool:
    return os.path.exists(self.path(name))

  def own(self, name: str, *, tree: bool = False) -> None:
    """Records the file ``name`` as this driver's (for ``overwrite`` to
    delete) and makes the folders on its way; ``tree``: a folder that other
    code fills (a checkpoint manager), made here, deleted whole.

    Raises:
      ValueError: ``name`` is not a relative path inside the workdir.
      WorkdirInUse: a symlink or a file on its way; a folder the driver did
        not make at ``name``.
    """
    if not _inside(name):
      raise ValueError(f"Workdir.own: {name!r} is not a path inside the "
                       "workdir (relative, normalised, without '..').")
    recorded, kind = _manifest(self.root), "trees" if tree else "files"
    if name not in recorded[kind]:
      if (os.path.lexists if tree else os.path.isdir)(self.path(name)):
        raise WorkdirInUse(f"{self.path(name)!r} is in the way: this driver "
                           "did not make it. Move it away, or use another "
                           "--workdir.")
      recorded[kind].add(name)  # before it exists: a kill leaves no orphan
      _write_manifest(self.root, recorded)
    try:
      with _folder(self.root, name if tree else os.path.dirname(name),
                   make=True):
        pass
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
    """What :meth:`write_json` wrote as ``name``, verified (else
    :class:`CorruptOutput`); ``None`` if absent."""
    path = self.path(name)
    obj = read_json(path)
    if obj is None:
      return None
    check = obj.pop(_CHECK, None) if isinstance(obj, dict) else None
    check = check if isinstance(check, dict) else {}
    self._verify(path, check.get("config_hash"),
                 check.get("sha256") == _digest(obj))
    return obj

  def results(self, compute, *, name: str) -> dict:
    """``results.json`` of a finished run (written last: its presence means
    complete), else ``compute()`` written as it; non-finite numbers as JSON
    nulls either way. ``name``: the driver, for the log line."""
    found = self.read_json("results.json")
    if found is not None:
      logging.info("%s: %s holds finished results; nothing to compute.", name,
                   self.path("results.json"))
      return found
    results = finite_or_none(compute())
    self.write_json("results.json", results)
    return results

  def seal(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """``arrays`` (numpy) and, as uint8 arrays, the config hash and a SHA-256
    of their content."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    as_bytes = lambda text: np.frombuffer(text.encode(), np.uint8)
    return {**arrays, _NPZ_HASH: as_bytes(self.config_hash),
            _NPZ_SUM: as_bytes(_array_digest(arrays))}

  def unseal(self, path: str, arrays: dict[str, Any], *,
             remedy: str | None = None) -> dict[str, np.ndarray]:
    """What :meth:`seal` returned, read back from ``path``: verified, else
    :class:`CorruptOutput` names ``path`` and the way out: ``remedy``, the
    sentence that ends the message (default :func:`way_out` of ``path``)."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    # uint8, or a numpy string as earlier versions stored it.
    text = lambda a: bytes(a).decode() if a.dtype == np.uint8 else str(a)
    found = [arrays.pop(k, None) for k in (_NPZ_HASH, _NPZ_SUM)]
    found_hash, found_sum = (None, None) if any(
        f is None for f in found) else map(text, found)
    self._verify(path, found_hash, found_sum == _array_digest(arrays),
                 remedy=remedy)
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
              remedy: str | None = None) -> None:
    remedy = remedy or way_out(path)
    if not found_hash:
      raise CorruptOutput(f"{path!r} has no config hash and checksum, so it "
                          "cannot be trusted; " + remedy)
    if found_hash != self.config_hash:
      raise CorruptOutput(f"{path!r} was written by another config (hash "
                          f"{found_hash}, this config {self.config_hash}); "
                          + remedy)
    if not content_ok:
      raise CorruptOutput(f"{path!r} fails its checksum: it was altered or "
                          "damaged after it was written; " + remedy)


def _inside(name) -> bool:
  """Whether ``name`` (in a manifest) is relative, normalised, without ``..``."""
  return (isinstance(name, str) and bool(name) and not os.path.isabs(name)
          and os.path.normpath(name) == name and name != "."
          and ".." not in name.split(os.sep))


@contextlib.contextmanager
def _folder(root: str, name: str, *, make: bool = False) -> Iterator[int]:
  """The folder ``root/name`` (a descriptor), opened part by part without
  following a symlink: inside ``root``, whatever is linked or swapped in.
  OSError if a part is missing (``make``: made), a symlink or not a folder."""
  fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  try:
    for part in name.split(os.sep) if name else ():
      if make:
        with contextlib.suppress(FileExistsError):
          os.mkdir(part, dir_fd=fd)
      fd, outer = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                          | os.O_CLOEXEC, dir_fd=fd), fd
      os.close(outer)
    yield fd
  finally:
    os.close(fd)


def _delete(root: str, name: str, *, tree: bool = False) -> bool:
  """Deletes ``root/name`` (reached by :func:`_folder`): a file or a link (the
  link itself); a folder only if ``tree``. Whether it did."""
  base = os.path.basename(name)
  try:
    with _folder(root, os.path.dirname(name)) as fd:
      if not stat.S_ISDIR(os.stat(base, dir_fd=fd,
                                  follow_symlinks=False).st_mode):
        os.unlink(base, dir_fd=fd)
      elif tree:
        shutil.rmtree(base, dir_fd=fd)
      else:
        return False  # a folder where the driver wrote a file: not its own
      return True
  except OSError:  # gone, or a folder on the way is a symlink or a file
    return False


def _write_manifest(root: str, recorded: dict[str, set[str]]) -> None:
  """Writes the manifest: ``files`` and ``trees``, sorted, with a SHA-256 of
  them under ``"_check"`` (an edited manifest must not steer ``overwrite``)."""
  listed = {kind: sorted(names) for kind, names in recorded.items()}
  write_json(os.path.join(root, MANIFEST),
             {**listed, _CHECK: {"sha256": _digest(listed)}})


def _read_manifest(path: str) -> dict[str, set[str]] | None:
  """The manifest's ``files`` and ``trees``; ``None`` if there is none.

  Raises:
    CorruptOutput: saying why it cannot be trusted (a symlink, not JSON, no
      or a wrong checksum, a name not inside the workdir).
  """
  if not os.path.lexists(path):
    return None
  if os.path.islink(path):
    raise CorruptOutput("is a symlink, not the file the driver wrote")
  try:
    found = read_json(path)
  except CorruptOutput:
    raise CorruptOutput("is not valid JSON") from None
  check = found.pop(_CHECK, None) if isinstance(found, dict) else None
  if not isinstance(check, dict) or check.get("sha256") != _digest(found):
    raise CorruptOutput("fails its checksum (altered, or written by an older "
                        "version)")
  if set(found) <= {"files", "trees"} and all(
      isinstance(v, list) and all(map(_inside, v)) for v in found.values()):
    return {kind: set(found.get(kind, ())) for kind in ("files", "trees")}
  raise CorruptOutput("names a path outside the workdir")


def _manifest(root: str, *, overwrite: bool = False) -> dict[str, set[str]]:
  """What the manifest records: ``files`` and ``trees``, verified. A damaged
  one is refused, or with ``overwrite`` deleted (a link as a link, with a
  warning) and taken as empty: what it names is never deleted."""
  path = os.path.join(root, MANIFEST)
  try:
    recorded = _read_manifest(path)
  except CorruptOutput as why:
    if not overwrite:
      raise CorruptOutput(
          f"{path!r}, the record of what the driver wrote in this workdir "
          f"(what --overwrite deletes), is damaged: it {why}. Rerun with "
          f"--overwrite to start afresh: it then deletes only "
          f"{' and '.join(_FIXED)}, and keeps every other file (delete what "
          "you no longer want by hand); or use another --workdir.") from None
    os.remove(path)
    logging.warning("--overwrite: deleted the damaged %s (it %s); what it "
                    "listed stays in %s.", MANIFEST, why, root)
    recorded = None
  return recorded or {"files": set(), "trees": set()}


@contextlib.contextmanager
def _locked(root: str) -> Iterator[None]:
  """Holds ``root/LOCK`` with ``flock`` (the kernel releases it when the
  process ends). The file names the holder; it is deleted while held, and a
  claimer that locked a deleted file tries again on the new one."""
  path = os.path.join(root, LOCK)
  while True:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o644)
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
      if not isinstance(err, BlockingIOError):
        raise _unusable(root, err) from None
      holder = os.read(fd, 1000).decode(errors="replace") or "starting"
      os.close(fd)
      raise WorkdirInUse(
          f"workdir {root!r} is in use by another run ({holder}; lock file "
          f"{path!r}). Wait for it to finish, or use another --workdir."
          ) from None
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
  what = "written or locked" if os.path.isdir(root) else "created"
  what = ("is not a folder" if os.path.exists(root) and not os.path.isdir(root)
          else f"cannot be {what} ({err.strerror})")
  return UnusableWorkdir(f"workdir {root!r} {what}; pass as --workdir a "
                         "folder this user can write and lock.")


def _remove_leftover_tmp(root: str, recorded: dict[str, set[str]]) -> None:
  """Deletes ``.tmp-*`` files of killed writes (the lock is held: none is
  live) in ``root``, ``figures/`` and the folders of the manifest's files."""
  for folder in {"", "figures"} | set(map(os.path.dirname, recorded["files"])):
    with contextlib.suppress(OSError), _folder(root, folder) as fd:
      for name in os.listdir(fd):
        if _TMP_NAME.match(name) and stat.S_ISREG(
            os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
          os.unlink(name, dir_fd=fd)


def _delete_outputs(root: str, recorded: dict[str, set[str]]) -> list[str]:
  """Deletes what the manifest records and :data:`_FIXED`, then the manifest;
  returns the names deleted. Folders stay: the driver writes into them."""
  deleted = [name for name in sorted(recorded["files"] | set(_FIXED))
             if _delete(root, name)]
  deleted += [name for name in sorted(recorded["trees"])
              if _delete(root, name, tree=True)]
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(root, MANIFEST))
  return deleted


def _changed(found: dict, wanted: dict) -> list[str]:
  """The fields of two canonical configs that differ, sorted."""
  return sorted(k for k in set(found) | set(wanted)
                if found.get(k) != wanted.get(k))


def check_other_workdir(root: str, config: ml_collections.ConfigDict, *,
                        remedy: str) -> None:
  """Refuses, before a driver claims its own workdir, a workdir another step
  of it will claim (decompile's train workdir) that holds another config:
  the refusal then leaves nothing behind, so ``remedy`` (the sentence that
  ends the message, naming what to change) leads to a run.

  Raises:
    WorkdirInUse: ``root/config.json`` is of another config.
  """
  try:
    found = read_json(os.path.join(root, "config.json"))
  except CorruptOutput:
    return  # the claim there refuses it, by name
  if isinstance(found, dict) and canonical(found) != config_dict(config):
    raise WorkdirInUse(
        f"workdir {root!r} holds results of a different config (fields that "
        f"differ: {', '.join(_changed(canonical(found), config_dict(config)))}"
        f"); {remedy}")


def _check_config_json(root: str, wanted: dict, overwrite: bool,
                       recorded: dict[str, set[str]]) -> None:
  """Refuses a workdir of another config, or with outputs but no config."""
  path = os.path.join(root, "config.json")
  try:
    found = read_json(path)
  except CorruptOutput:
    found = "damaged"
  if not isinstance(found, (dict, type(None))):
    if overwrite:
      return
    raise CorruptOutput(
        f"{path!r} is damaged (not a JSON object), so nothing says which "
        "config made this workdir's outputs. Rerun with --overwrite to start "
        "afresh, or use another --workdir.")
  found = canonical(found)
  outputs = [n for n in recorded["files"] | recorded["trees"] | {_FIXED[1]}
             if n != _FIXED[0] and os.path.lexists(os.path.join(root, n))]
  if overwrite or found == wanted or (found is None and not outputs):
    return
  if found is None:
    why = "outputs but no config.json to say which config made them"
  else:
    why = ("results of a different config (fields that differ: "
           f"{', '.join(_changed(found, wanted))})")
  raise WorkdirInUse(f"workdir {root!r} holds {why}. Use another --workdir, "
                     "or pass --overwrite to replace them.")


@contextlib.contextmanager
def claim_workdir(workdir: str, config: ml_collections.ConfigDict, *,
                  overwrite: bool = False) -> Iterator[Workdir]:
  """Holds ``workdir`` for one run of ``config``; yields its :class:`Workdir`.

  In order: makes the folder, takes the lock, checks the manifest, removes
  leftover ``.tmp-*`` files, refuses a different (or a damaged) config unless
  ``overwrite``, which deletes what the driver wrote (module docstring), and
  only then writes ``config.json``: an interruption in between leaves a
  workdir that resumes nothing stale. A matching config resumes or skips
  finished work. The lock is released when the block ends, however it ends.

  Raises:
    UnusableWorkdir: it is a file, or cannot be made, written or locked.
    WorkdirInUse: another run holds it, or (not ``overwrite``) it holds
      another config's outputs.
    CorruptOutput: (not ``overwrite``) ``config.json`` or the manifest is
      damaged.
  """
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as err:
    raise _unusable(workdir, err) from None
  with _locked(workdir):
    recorded = _manifest(workdir, overwrite=overwrite)
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
  """``compute(kappa, rng)`` for every ``config.kappas`` at the highest matmul
  precision, each saved as ``partial_kappa<i>.json`` when done and loaded on
  a rerun; non-finite numbers as ``None``. ``rng`` is
  ``np.random.default_rng([config.seed, i])``: a resumed kappa draws the
  same."""
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
  ``jax_enable_x64`` on inside the block for float64 (restored after)."""
  if dtype == "float64":
    with jax.enable_x64(True):
      yield jnp.dtype(jnp.float64)
  else:
    yield jnp.dtype(dtype)


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


def config_path(config_name: str) -> str:
  """``experiments/configs/<config_name>.py``, found next to this file (any cwd)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                      f"{config_name}.py")


def _no_such_field(err: Exception, config_file: str) -> str:
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top
  fields = config_flags.ConfigFileFlagParser("config").parse(config_file)
  return (f"unknown config field {str(err).strip(chr(34))}; the config's "
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
      marker = f"{UnknownVariant.__module__}.{UnknownVariant.__name__}: "
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


def run_main(argv, name: str, run, **kwargs):
  """Calls ``run(config, workdir, overwrite=..., **kwargs)`` from the flags.

  A refused config, workdir or output is the user's call, not a bug: it ends
  the program with a one-line message, without traceback.
  """
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = flags.FLAGS.config
  try:
    return run(config, flags.FLAGS.workdir, overwrite=flags.FLAGS.overwrite,
               **kwargs)
  except (ConfigError, WorkdirInUse, UnusableWorkdir, CorruptOutput) as refusal:
    raise SystemExit(f"{name}: {refusal}") from None
