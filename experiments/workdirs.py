"""The workdir contract: how a driver writes, and what ``--overwrite`` deletes.

A driver checks its config (:mod:`experiments.checks`, before anything is
written), then claims ``--workdir`` with :func:`claim_workdir` and writes
through the :class:`Workdir` it gets. The workdir then guarantees:

* Atomic files: each is written to a ``.tmp-*`` file and renamed into place;
  leftover ``.tmp-*`` files of a killed run are removed by the next claim.
  JSON is strict: NaN and inf are written as ``null``.
* One run at a time: the claim holds ``.elsa-lock`` (``flock``, which the
  kernel releases when the process ends, however it ends).
* One config: ``config.json`` holds it in canonical form (NaN as ``"nan"``,
  numbers by value); another config is refused unless ``overwrite``. Every
  output (train's checkpoints too) carries the config's hash and a checksum
  of its content, verified when read: one of another config, altered or
  truncated is refused, naming the file and the way out.
* Ownership by record: each write is first recorded in the manifest
  ``.elsa-outputs.json`` and never passes through a symlink. The manifest
  carries a checksum and is read without following a symlink: an edited,
  damaged or linked manifest (or a damaged ``config.json``) is refused by
  name.

What ``overwrite`` deletes: the files the manifest records, the folders it
records as made for other code to fill (whole), ``config.json`` and
``results.json``, and then the manifest; each reached without following a
symlink (a link is removed as a link). What it never deletes: any other
file, whatever its name; anything outside the workdir or behind a symlink;
a folder where the driver recorded a file; anything a damaged manifest
names (it then clears the manifest and deletes only ``config.json`` and
``results.json``).
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
from typing import Any, Iterator

from absl import logging
import ml_collections
import numpy as np

from experiments import checks


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
    self.config_hash = checks.config_hash(config)

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
        config_hash=self.config_hash, sha256=checks.digest(obj))})

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
                 check.get("sha256") == checks.digest(obj))
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

  def remove(self, name: str) -> None:
    """Deletes the file ``name`` the driver wrote, if it is there (state
    that a finished output has made useless)."""
    _delete(self.root, name)

  def write_text(self, name: str, text: str) -> None:
    """Writes ``text`` (UTF-8) as ``name``, atomically (a table: for reading,
    never read back)."""
    self.own(name)
    _atomic_write(self.path(name), lambda f: f.write(text.encode()))

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
             {**listed, _CHECK: {"sha256": checks.digest(listed)}})


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
  if not isinstance(check, dict) or check.get("sha256") != checks.digest(found):
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
  wanted = checks.config_dict(config)
  if isinstance(found, dict) and checks.canonical(found) != wanted:
    changed = _changed(checks.canonical(found), wanted)
    raise WorkdirInUse(
        f"workdir {root!r} holds results of a different config (fields that "
        f"differ: {', '.join(changed)}); {remedy}")


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
  found = checks.canonical(found)
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
    wanted = checks.config_dict(config)
    _check_config_json(workdir, wanted, overwrite, recorded)
    if overwrite:
      deleted = _delete_outputs(workdir, recorded)
      if deleted:
        logging.info("--overwrite: deleted %s from %s", ", ".join(deleted),
                     workdir)
    write_json(os.path.join(workdir, "config.json"), wanted)
    yield Workdir(workdir, config)

