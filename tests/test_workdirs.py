"""The workdir contract every driver shares (experiments/workdirs.py)."""

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from experiments import checks
from experiments import workdirs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**fields):
  return ml_collections.ConfigDict(dict(dict(depth=3, lam=0.1), **fields))


def _write(path, text="mine"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


def test_matching_config_is_claimed_again_and_keeps_results(tmp_path):
  workdir = str(tmp_path)
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("results.json", {"done": 1})
  with workdirs.claim_workdir(workdir, _config()) as wd:
    assert wd.read_json("results.json") == {"done": 1}


def test_overwrite_deletes_only_what_the_driver_wrote(tmp_path):
  """Manifest names (a checkpoint tree whole), config/results go; the user's
  look-alikes (results_analysis/, partial_derivatives.txt) stay."""
  workdir = str(tmp_path)
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("results.json", {})
    wd.write_json("partial_designed.json", {})
    wd.write_npz("partial_designed_items0-8.npz", {"a": np.zeros(3)})
    wd.save_figure(_figure(), "figures/a.png")
    wd.own("checkpoints", tree=True)  # filled by other code
    _write(wd.path("checkpoints/7/state"))
  mine = ["results_analysis/table.csv", "partial_derivatives.txt",
          "figures/mine.png", "config.json.bak", "notes.json"]
  for name in mine:
    _write(os.path.join(workdir, name))
  with pytest.raises(workdirs.WorkdirInUse, match=r"fields that differ: depth"):
    with workdirs.claim_workdir(workdir, _config(depth=4)):
      pass
  assert os.path.exists(os.path.join(workdir, "results.json"))
  with workdirs.claim_workdir(workdir, _config(depth=4), overwrite=True):
    pass
  left = sorted(os.path.relpath(os.path.join(folder, name), workdir)
                for folder, _, names in os.walk(workdir) for name in names)
  assert left == sorted(mine + ["config.json"])
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["depth"] == 4


def test_overwrite_of_the_same_config_starts_afresh(tmp_path):
  """One meaning of overwrite for every driver: nothing earlier is resumed."""
  workdir = str(tmp_path)
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("partial_kappa0.json", {"done": 1})
  with workdirs.claim_workdir(workdir, _config(), overwrite=True) as wd:
    assert wd.read_json("partial_kappa0.json") is None


def test_outputs_without_a_config_are_refused(tmp_path):
  with workdirs.claim_workdir(str(tmp_path), _config()) as wd:
    wd.own("checkpoints", tree=True)
  os.remove(tmp_path / "config.json")
  with pytest.raises(workdirs.WorkdirInUse, match="no config.json"):
    with workdirs.claim_workdir(str(tmp_path), _config()):
      pass
  # A folder of that name is nobody's until a driver records making it.
  os.remove(tmp_path / workdirs.MANIFEST)
  with workdirs.claim_workdir(str(tmp_path), _config()) as wd:
    with pytest.raises(workdirs.WorkdirInUse, match="checkpoints' is in the "
                       "way: this driver did not make it"):
      wd.own("checkpoints", tree=True)


_HOLDER = """
import sys
import ml_collections
from experiments import workdirs
config = ml_collections.ConfigDict(dict(depth=3, lam=0.1))
with workdirs.claim_workdir(sys.argv[1], config):
  print("held", flush=True)
  sys.stdin.read()
"""


def test_second_run_is_refused_while_the_first_holds_the_lock(tmp_path):
  """Two processes, one workdir: the second cannot interleave, even with
  overwrite; once the first ends, it may claim."""
  workdir = str(tmp_path)
  first = subprocess.Popen([sys.executable, "-c", _HOLDER, workdir], cwd=REPO,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
  try:
    assert first.stdout.readline() == "held\n"
    with pytest.raises(workdirs.WorkdirInUse,
                       match=f"in use by another run \\(pid {first.pid} on "
                       f"host {socket.gethostname()}"):
      with workdirs.claim_workdir(workdir, _config(depth=4), overwrite=True):
        pass
    assert workdirs.read_json(os.path.join(workdir, "config.json"))[
        "depth"] == 3
  finally:
    first.communicate("", timeout=60)
  assert first.returncode == 0
  assert not os.path.exists(os.path.join(workdir, workdirs.LOCK))
  with workdirs.claim_workdir(workdir, _config(depth=4), overwrite=True):
    pass


def test_a_lock_file_nobody_holds_is_free_and_one_process_claims_once(
    tmp_path):
  """The lock is the kernel's (``flock``), not the file's text: a lock file
  of a run that is gone (an older version's, naming a dead pid or another
  host) is free; a held one is refused, within one process too."""
  workdir = str(tmp_path)
  lock = os.path.join(workdir, workdirs.LOCK)
  _write(lock, json.dumps(dict(pid=2 ** 22 + 1, host="elsewhere")))
  with workdirs.claim_workdir(workdir, _config()):
    with open(lock, encoding="utf-8") as f:
      assert f.read().startswith(f"pid {os.getpid()} on host "
                                 f"{socket.gethostname()} since ")
    with pytest.raises(workdirs.WorkdirInUse, match=f"pid {os.getpid()}"):
      with workdirs.claim_workdir(workdir, _config()):
        pass
  assert not os.path.exists(lock)


def test_outputs_are_tied_to_their_config_and_content(tmp_path):
  workdir = str(tmp_path)
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("partial.json", {"x": [1.0, float("nan")]})
    wd.write_npz("chunk.npz", {"rel_err": np.arange(4.0)})
    assert wd.read_json("partial.json") == {"x": [1.0, None]}
    np.testing.assert_array_equal(wd.read_npz("chunk.npz")["rel_err"],
                                  np.arange(4.0))
  other = workdirs.Workdir(workdir, _config(depth=4))
  for read, name in ((other.read_json, "partial.json"),
                     (other.read_npz, "chunk.npz")):
    with pytest.raises(workdirs.CorruptOutput, match=f"{name}.*another config"):
      read(name)
  wd = workdirs.Workdir(workdir, _config())
  path = wd.path("partial.json")
  with open(path, encoding="utf-8") as f:
    stored = json.load(f)
  stored["x"][0] = 2.0
  workdirs.write_json(path, stored)
  with pytest.raises(workdirs.CorruptOutput, match="partial.json.*checksum"):
    wd.read_json("partial.json")
  # A file without the check (an older run, or hand-made) is not trusted.
  np.savez(wd.path("chunk.npz"), rel_err=np.arange(4.0))
  with pytest.raises(workdirs.CorruptOutput, match="chunk.npz.*no config hash"):
    wd.read_npz("chunk.npz")


@pytest.mark.parametrize("name, damage, message", [
    ("results.json", None, "results.json' is not valid JSON.*delete .*"
     "results.json.*--overwrite"),
    ("config.json", None, "config.json' is damaged.*nothing says which "
     "config.*--overwrite"),
    ("config.json", "[1, 2]", "config.json' is damaged"),
    (workdirs.MANIFEST, None, "outputs.json', the record of what the driver "
     "wrote.*damaged.*--overwrite"),
    (workdirs.MANIFEST, '["results.json", "../elsewhere"]', "is damaged"),
])
def test_damaged_json_names_the_file_and_the_way_out(tmp_path, name, damage,
                                                     message):
  """Truncated or wrong-shaped: refused by name; --overwrite clears it and
  nothing outside the workdir (a manifest entry '../elsewhere') is touched."""
  workdir = str(tmp_path / "run")
  elsewhere = tmp_path / "elsewhere"
  _write(str(elsewhere / "precious"))
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("results.json", {"a": 1})
  path = os.path.join(workdir, name)
  if damage is None:
    with open(path, "r+", encoding="utf-8") as f:
      f.truncate(5)
  else:
    _write(path, damage)
  with pytest.raises(workdirs.CorruptOutput, match=message):
    with workdirs.claim_workdir(workdir, _config()) as wd:
      wd.read_json("results.json")
  with workdirs.claim_workdir(workdir, _config(), overwrite=True) as wd:
    assert wd.read_json("results.json") is None
    wd.write_json("results.json", {"a": 2})
  with workdirs.claim_workdir(workdir, _config()) as wd:
    assert wd.read_json("results.json") == {"a": 2}
  assert os.path.exists(elsewhere / "precious")
  with workdirs.claim_workdir(workdir, _config()) as wd:
    with pytest.raises(ValueError, match="not a path inside the workdir"):
      wd.write_json("../elsewhere/x.json", {})


def test_claim_removes_leftover_temporary_files(tmp_path):
  """Only in the folders drivers write: the workdir, figures/ and the
  folders of the manifest's names."""
  workdir = str(tmp_path)
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("partials/a.json", {})
  leftovers = [".tmp-k2j4x9a_results.json", "figures/.tmp-0abc9xyzheat.png",
               "partials/.tmp-abcdefghb.json"]
  # Not ours: no mkstemp name, or in a folder the driver never wrote to.
  kept = [".tmp-notes.txt", "mine/.tmp-0abc9xyzheat.png"]
  for name in leftovers + kept:
    _write(os.path.join(workdir, name))
  with workdirs.claim_workdir(workdir, _config()):
    pass
  for name in leftovers:
    assert not os.path.exists(os.path.join(workdir, name))
  for name in kept:
    assert os.path.exists(os.path.join(workdir, name))


def test_numbers_are_compared_and_hashed_by_value(tmp_path):
  """``lams=(0, 0.1)`` and ``(0.0, 0.1)`` are one config: a run of one
  resumes the other's files (they were refused as "another config")."""
  as_int, as_float = _config(lams=(0, 0.1)), _config(lams=(0.0, 0.1))
  assert checks.config_hash(as_int) == checks.config_hash(as_float)
  assert checks.config_hash(_config(flag=True)) != checks.config_hash(
      _config(flag=1))
  assert checks.config_hash(as_int) != checks.config_hash(_config(lams=(0,
                                                                       0.2)))
  with workdirs.claim_workdir(str(tmp_path), as_int) as wd:
    wd.write_npz("chunk.npz", {"a": np.arange(3.0)})
  with workdirs.claim_workdir(str(tmp_path), as_float) as wd:
    np.testing.assert_array_equal(wd.read_npz("chunk.npz")["a"],
                                  np.arange(3.0))


def test_a_nan_in_a_config_is_the_same_config_on_rerun(tmp_path):
  nan = _config(tol=float("nan"), grid=(1.0, float("inf")))
  assert checks.config_hash(nan) == checks.config_hash(
      _config(tol=float("nan"), grid=[1.0, float("inf")]))
  assert checks.config_dict(nan)["tol"] == "nan"
  with workdirs.claim_workdir(str(tmp_path), nan) as wd:
    wd.write_json("results.json", {"a": 1})
  with workdirs.claim_workdir(str(tmp_path), _config(tol=float("nan"),
                                                     grid=(1.0, float("inf")))
                            ) as wd:
    assert wd.read_json("results.json") == {"a": 1}


def test_json_is_strict_and_files_are_not_private(tmp_path):
  path = str(tmp_path / "r.json")
  workdirs.write_json(path, {"a": float("nan"), "b": [1.0, float("inf")],
                             "c": np.float32("nan"), "d": np.float32(0.5)})
  with open(path, encoding="utf-8") as f:
    assert json.loads(f.read(), parse_constant=pytest.fail) == {
        "a": None, "b": [1.0, None], "c": None, "d": 0.5}
  umask = os.umask(0)
  os.umask(umask)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def _figure():
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure()
  fig.add_subplot().plot([0, 1])
  return fig


def _manifest(workdir, names):
  """A manifest as the driver writes it (with its checksum), recording
  ``names`` as files."""
  workdirs._write_manifest(workdir, {"files": set(names), "trees": set()})  # pylint: disable=protected-access


def test_overwrite_never_follows_a_symlink_out_of_the_workdir(tmp_path):
  """Manifest entries that pass through a link (``link_out -> elsewhere``):
  nothing outside is deleted; a ``..`` component makes the manifest damaged;
  a recorded name that became a link is removed as a link; a recorded file
  that became a folder is not the driver's and stays."""
  workdir, elsewhere = str(tmp_path / "run"), tmp_path / "elsewhere"
  outside = [elsewhere / "f.txt", tmp_path / "x", elsewhere / "a" / "g.txt",
             elsewhere / "a" / ".tmp-abcdefghg.txt", elsewhere / "precious"]
  for path in outside:
    _write(str(path))
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("results.json", {})
    wd.write_json("notes/a.json", {})
  os.symlink(elsewhere, os.path.join(workdir, "link_out"))
  os.remove(os.path.join(workdir, "results.json"))
  os.symlink(elsewhere / "precious", os.path.join(workdir, "results.json"))
  os.remove(os.path.join(workdir, "notes", "a.json"))
  _write(os.path.join(workdir, "notes", "a.json", "mine.txt"))
  # Names the driver recorded, each now behind a link.
  _manifest(workdir, ["results.json", "notes/a.json", "link_out/f.txt",
                      "link_out/a/g.txt"])
  with workdirs.claim_workdir(workdir, _config(), overwrite=True):
    pass
  _manifest(workdir, ["link_out/../x"])
  with pytest.raises(workdirs.CorruptOutput, match="outputs.json'.*damaged"):
    with workdirs.claim_workdir(workdir, _config()):
      pass
  with workdirs.claim_workdir(workdir, _config(), overwrite=True):
    pass
  for path in outside:
    assert path.exists(), path
  assert not os.path.lexists(os.path.join(workdir, "results.json"))
  assert os.path.islink(os.path.join(workdir, "link_out"))
  assert os.path.exists(os.path.join(workdir, "notes", "a.json", "mine.txt"))


def test_the_driver_never_writes_through_a_symlink(tmp_path):
  workdir, elsewhere = str(tmp_path / "run"), tmp_path / "elsewhere"
  os.makedirs(elsewhere)
  os.makedirs(workdir)
  os.symlink(elsewhere, os.path.join(workdir, "figures"))
  with workdirs.claim_workdir(workdir, _config()) as wd:
    with pytest.raises(workdirs.WorkdirInUse, match="figures.*symlink"):
      wd.write_json("figures/a.json", {})
  assert not os.listdir(elsewhere)


class _Stop(Exception):
  """Ends a driver run right after its claim of the workdir."""


def _claimed_then_stopped(real_claim):
  @contextlib.contextmanager
  def claim(*args, **kwargs):
    with real_claim(*args, **kwargs):
      raise _Stop
    yield  # never reached
  return claim


def _driver_runs():
  # pylint: disable=g-import-not-at-top
  from experiments import algorithms, newton, sweep, train
  from experiments.configs import algorithms as algorithms_config
  from experiments.configs import newton as newton_config
  from experiments.configs import sweep as sweep_config
  from experiments.configs import train as train_config
  return {
      "sweep": (sweep.run, sweep_config.get_config("tiny"),
                ["partial_designed_items_mybackup-old.npz",
                 "partial_natural_items0-8.npz/mine.txt",
                 "partial_designed.json.bak"]),
      "train": (train.run, train_config.get_config("tiny"),
                ["checkpoints/README_mine.txt",
                 "checkpoints/elsa_trained_L1_old/mine.txt"]),
      "algorithms": (algorithms.run, algorithms_config.get_config("tiny"),
                     ["partial_kappa_backup.json/mine.txt",
                      "partial_kappa7.json"]),
      "newton": (newton.run, newton_config.get_config("tiny"),
                 ["partial_kappa_backup.json/mine.txt",
                  "partial_kappa7.json"]),
  }


@pytest.mark.parametrize("driver", ["sweep", "train", "algorithms", "newton"])
def test_overwrite_keeps_user_files_that_look_like_a_drivers(
    tmp_path, monkeypatch, driver):
  """Ownership is by record: files and folders the driver never wrote stay,
  whatever their names."""
  run, config, mine = _driver_runs()[driver]
  monkeypatch.setattr(workdirs, "claim_workdir",
                      _claimed_then_stopped(workdirs.claim_workdir))
  workdir = str(tmp_path / "run")
  with pytest.raises(_Stop):
    run(config, workdir)
  for name in mine:
    _write(os.path.join(workdir, name))
  with pytest.raises(_Stop):
    run(config, workdir, overwrite=True)
  for name in mine:
    assert os.path.exists(os.path.join(workdir, name)), name


def test_a_lock_is_free_once_its_process_is_gone(tmp_path):
  """The kernel holds the lock (``flock``): a killed holder releases it, and
  a leftover lock temporary file of an older version is cleaned."""
  workdir = str(tmp_path)
  holder = subprocess.Popen([sys.executable, "-c", _HOLDER, workdir], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
  assert holder.stdout.readline() == "held\n"
  holder.kill()
  holder.wait(timeout=60)
  leftover = os.path.join(workdir, ".tmp-k2j4x9a_.elsa-lock")
  _write(leftover, "{}")
  with workdirs.claim_workdir(workdir, _config()):
    pass
  assert not os.path.exists(leftover)


def _unwritable_folder(tmp_path) -> str:
  """A folder no file can be created in: read-only, or (as root, who writes
  anywhere) sysfs."""
  folder = tmp_path / "read_only"
  folder.mkdir()
  folder.chmod(0o555)
  try:
    _write(str(folder / "probe"))
  except PermissionError:
    return str(folder)
  os.remove(folder / "probe")
  if not os.path.isdir("/sys"):
    pytest.skip("no folder this user cannot write to")
  return "/sys"


def test_an_unusable_workdir_is_reported_in_one_line(tmp_path):
  a_file = tmp_path / "a_file"
  _write(str(a_file))
  for workdir, message in (
      (str(a_file), "a_file' is not a folder"),
      (str(a_file / "run"), "a_file/run' cannot be created"),
      (_unwritable_folder(tmp_path), "cannot be written")):
    with pytest.raises(workdirs.UnusableWorkdir, match=message) as err:
      with workdirs.claim_workdir(workdir, _config()):
        pass
    assert "\n" not in str(err.value) and "--workdir" in str(err.value)


@pytest.mark.parametrize("tamper", ["edited", "symlink", "older_list"])
def test_overwrite_never_deletes_what_a_tampered_manifest_names(tmp_path,
                                                                tamper):
  """OW9b: the manifest carries a checksum and is not read through a link. An
  edited manifest (valid JSON naming a user's file and folder), one replaced
  by a symlink to such a list, or an unchecked list of names is refused by
  name; the way out it gives (--overwrite) deletes only config.json and
  results.json, and the next plain run resumes."""
  workdir = str(tmp_path / "run")
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("results.json", {"a": 1})
    wd.write_json("partial.json", {"b": 1})
  mine = [os.path.join(workdir, "notes.txt"),
          os.path.join(workdir, "data", "x.csv")]
  for path in mine:
    _write(path)
  names = {"files": ["notes.txt", "partial.json"], "trees": ["data"]}
  path = os.path.join(workdir, workdirs.MANIFEST)
  if tamper == "edited":
    with open(path, encoding="utf-8") as f:
      stored = json.load(f)
    workdirs.write_json(path, {**names, "_check": stored["_check"]})
    why = "fails its checksum"
  elif tamper == "symlink":
    target = tmp_path / "list.json"
    workdirs._write_manifest(  # pylint: disable=protected-access
        str(tmp_path), {k: set(v) for k, v in names.items()})
    os.replace(tmp_path / workdirs.MANIFEST, target)
    os.remove(path)
    os.symlink(target, path)
    why = "is a symlink"
  else:
    workdirs.write_json(path, names["files"])
    why = "fails its checksum"
  with pytest.raises(workdirs.CorruptOutput, match=(
      f"outputs.json', the record .* is damaged: it {why}.*Rerun with "
      "--overwrite")):
    with workdirs.claim_workdir(workdir, _config()):
      pass
  with workdirs.claim_workdir(workdir, _config(), overwrite=True) as wd:
    assert wd.read_json("results.json") is None
  for kept in [*mine, os.path.join(workdir, "partial.json")]:
    assert os.path.exists(kept), kept
  if tamper == "symlink":
    assert os.path.exists(target) and not os.path.lexists(path)
  with workdirs.claim_workdir(workdir, _config()) as wd:
    wd.write_json("results.json", {"a": 2})
  with workdirs.claim_workdir(workdir, _config()) as wd:
    assert wd.read_json("results.json") == {"a": 2}
