"""Drivers as two processes of one ``jax.distributed`` job (2 CPU devices each)
against one process (on one device, or as many as the job), through
:mod:`tests.multiprocess`; and the agreement of processes on a refusal.

Each job compiles in every process, so each test takes tens of seconds to a
few minutes on 2 cores (tiny configs).
"""

import json
import os

import jax
import numpy as np
import pytest

from experiments import checks
from experiments import distributed
from experiments import workdirs
from tests import multiprocess

SWEEP = ["--config=experiments/configs/sweep.py:tiny", "--config.depth=3",
         "--config.chunk_size=4"]


def _read(workdir: str, name: str = "results.json") -> dict:
  with open(os.path.join(workdir, name), encoding="utf-8") as f:
    results = json.load(f)
  results.pop("_check")
  return results


def _assert_ok(finished):
  assert all(f.returncode == 0 for f in finished), multiprocess.report(finished)


def _sweep_records_close(got: dict, want: dict) -> None:
  """The same records; errors to float32 rounding (the sweep's documented
  float32 bound, docs/guides/sweep.md: 1e-5 relative to GD)."""
  assert len(got["records"]) == len(want["records"])
  for a, b in zip(got["records"], want["records"]):
    exact = lambda r: {k: v for k, v in r.items()
                       if "rel_err" not in k and "ridge" not in k}
    assert exact(a) == exact(b)
    for key in ("max_rel_err", "median_rel_err", "elsa_to_ridge",
                "gd_to_ridge"):
      if b[key] is None:
        assert a[key] is None
      else:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_sweep_refused_config_ends_every_process_with_one_line(tmp_path):
  """A config every process refuses: each exits at once with the same
  message, no traceback, no timeout, and the workdir is never created."""
  workdir = str(tmp_path / "never")
  finished = multiprocess.launch(
      "sweep", [*SWEEP, "--config.n_tasks=0", f"--workdir={workdir}"],
      timeout=90)
  for f in finished:
    assert f.returncode == 1, multiprocess.report(finished)
    assert ("sweep: process 0: config.n_tasks must be an int >= 1, got 0."
            in f.stderr), multiprocess.report(finished)
    assert "Traceback" not in f.stderr and "DEADLINE" not in f.stderr
  assert not os.path.exists(workdir)


def test_sweep_killed_process_stops_the_job_and_the_same_command_resumes(
    tmp_path):
  """Process 1 killed after the first chunk file: process 0 stops after
  --heartbeat_timeout with the driver's line, the workdir
  holds only whole files and resumes with the same command, every file
  written once. A process that fails (here: it cannot see process 0's files)
  stops the others at once with its reason. The resuming job is launched
  srun-style (its two processes find each other from SLURM_* alone); its
  results and files equal one process on 4 devices."""
  workdir = str(tmp_path / "run")
  args = [*SWEEP, f"--workdir={workdir}"]
  chunks = lambda: sorted(n for n in os.listdir(workdir)
                          if n.endswith(".npz")) if os.path.isdir(workdir) else []
  finished = multiprocess.launch("sweep", [*args, "--heartbeat_timeout=6"],
                                 timeout=150,
                                 kill_when=(1, lambda: bool(chunks())))
  assert finished[1].returncode is None, multiprocess.report(finished)
  # MP4: process 0 ends by itself once process 1's heartbeats stop.
  assert finished[0].returncode == 1, multiprocess.report(finished)
  assert finished[0].stderr.strip().splitlines()[-1].startswith(
      "sweep: stopped: process 0 lost the job: another process died or sent "
      "no heartbeat for --heartbeat_timeout=6 s"), multiprocess.report(finished)
  assert not os.path.exists(os.path.join(workdir, "results.json"))
  done = {n: os.stat(os.path.join(workdir, n)).st_mtime_ns for n in chunks()}
  assert done and not any(n.startswith(".tmp-") for n in os.listdir(workdir))

  # Process 1 on a workdir it does not share. The JSON it reads is process
  # 0's reading, but a chunk file it must read itself: with no form file
  # (a form finished before the kill is redone from its chunks) it fails on
  # the first chunk process 0 reports done, and process 0 stops at once,
  # saying why.
  for name in os.listdir(workdir):
    if name.startswith("partial_") and name.endswith(".json"):
      os.remove(os.path.join(workdir, name))
  # The same command (--workdir=run) run from other folders: process 1's
  # "run" is not process 0's, as on a host without the shared filesystem.
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  failed = multiprocess.launch(
      "sweep", [f"--config={multiprocess.REPO}/experiments/configs/sweep.py:"
                "tiny", *SWEEP[1:], "--workdir=run"], timeout=150,
      cwd=lambda pid: str(elsewhere if pid else tmp_path))
  assert [f.returncode for f in failed] == [1, 1], multiprocess.report(failed)
  assert "cannot see it" in failed[1].stderr
  assert ("sweep: stopped: process 1 failed: FileNotFoundError"
          in failed[0].stderr), multiprocess.report(failed)

  resumed = multiprocess.launch("sweep", args, timeout=150, slurm=True)
  _assert_ok(resumed)
  results = _read(workdir)
  assert results["devices"] == 4
  assert len(results["records"]) == 2 * 2 * 2 * 3  # forms, lams, etas, depths
  for name, mtime in done.items():  # loaded, not computed again
    assert os.stat(os.path.join(workdir, name)).st_mtime_ns == mtime
  single = str(tmp_path / "single")
  _assert_ok([multiprocess.run_single("sweep", [*SWEEP, f"--workdir={single}"],
                                      devices=4)])
  want = _read(single)
  assert want["devices"] == 4
  _sweep_records_close(results, want)
  assert sorted(os.listdir(workdir)) == sorted(os.listdir(single))


TRAIN = ["--config=experiments/configs/train.py:tiny",
         "--config.models=('lsa_trained',)", "--config.depths=(2,)",
         "--config.steps=40", "--config.warmup_steps=4",
         "--config.log_every=10", "--config.checkpoint_every=20",
         "--config.n_test=64", "--config.eval_chunk=64", "--config.eta_grid=5"]


def test_train_two_processes_equal_one_device(tmp_path):
  """Data-parallel training over 2 x 2 devices (the 2-point grid in two
  groups, each batch over two devices) gives one device's loss curve, tuning
  and test losses to float32 rounding; process 0 writes every file once."""
  multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
  finished = multiprocess.launch("train", [*TRAIN, f"--workdir={multi}"],
                                 timeout=400)
  _assert_ok(finished)
  assert "2 grid points in 2 groups, each batch over 2 of 4" in (
      finished[0].stderr)
  _assert_ok([multiprocess.run_single("train", [*TRAIN,
                                                f"--workdir={single}"])])
  got, want = _read(multi), _read(single)
  # Float32 sums over the batch in another order: a few ulps per step.
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5)
  close(got["train_loss"]["lsa_trained"], want["train_loss"]["lsa_trained"])
  close(got["tuning"]["lsa_trained"][0]["val_loss"],
        want["tuning"]["lsa_trained"][0]["val_loss"])
  for name, losses in want["test_loss"].items():
    close(got["test_loss"][name], losses)
  assert got["grid"] == want["grid"] and got["tuning"] == {
      k: [dict(t, val_loss=got["tuning"][k][0]["val_loss"]) for t in v]
      for k, v in want["tuning"].items()}
  listing = lambda root: sorted(os.path.relpath(os.path.join(d, f), root)
                                for d, _, files in os.walk(root)
                                # orbax and TensorBoard name some by hash
                                # and time
                                for f in files if "tfevents" not in f
                                and not d.endswith("/d"))
  assert listing(multi) == listing(single)
  # The evaluation events, hparams/ and the one model-depth run.
  assert sorted(n for n in os.listdir(os.path.join(multi, "tensorboard"))
                if "tfevents" not in n) == ["hparams", "lsa_trained_L2"]


def _assert_close_tree(got, want, *, rtol: float, atol: float,
                       path: str = "") -> None:
  """Equal JSON trees: numbers to ``rtol`` and ``atol`` (ints and counts
  exactly), timings (keys with "seconds") skipped."""
  if isinstance(want, dict):
    assert sorted(got) == sorted(want), path
    for key in want:
      if "seconds" not in key:
        _assert_close_tree(got[key], want[key], rtol=rtol, atol=atol,
                           path=f"{path}.{key}")
  elif isinstance(want, list):
    assert len(got) == len(want), path
    for i, (a, b) in enumerate(zip(got, want)):
      _assert_close_tree(a, b, rtol=rtol, atol=atol, path=f"{path}[{i}]")
  elif isinstance(want, float) and not isinstance(got, bool):
    assert isinstance(got, float), path
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=path)
  else:
    assert got == want, path


ALGORITHMS = ["--config=experiments/configs/algorithms.py:tiny",
              "--config.tasks_per_kappa=3"]


def test_algorithms_two_processes_equal_one_device(tmp_path):
  """The race with each kappa's 3 tasks split over 2 x 2 devices (padded to
  4) equals one process on 4 devices: every count, every error to 1e-6.

  (Against one device the float32 floors differ at their rounding level,
  kappa x eps: another program per device, another rounding.)"""
  multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
  _assert_ok(multiprocess.launch("algorithms",
                                 [*ALGORITHMS, f"--workdir={multi}"],
                                 timeout=300))
  _assert_ok([multiprocess.run_single("algorithms", [
      *ALGORITHMS, f"--workdir={single}"], devices=4)])
  _assert_close_tree(_read(multi), _read(single), rtol=1e-5, atol=1e-6)
  assert sorted(os.listdir(multi)) == sorted(os.listdir(single))


def test_newton_two_processes_equal_one_device(tmp_path):
  """Newton-Schulz in layers with each kappa's 3 tasks split over 2 x 2
  devices equals one process on 4: every count, every error to 1e-6 (against
  one device the float32 floors differ by up to kappa x eps: 1.5e-5 measured
  at kappa 1e3)."""
  args = ["--config=experiments/configs/newton.py:tiny",
          "--config.tasks_per_kappa=3"]
  multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
  _assert_ok(multiprocess.launch("newton", [*args, f"--workdir={multi}"],
                                 timeout=300))
  _assert_ok([multiprocess.run_single("newton", [*args, f"--workdir={single}"],
                                      devices=4)])
  _assert_close_tree(_read(multi), _read(single), rtol=1e-5, atol=1e-6)
  assert sorted(os.listdir(multi)) == sorted(os.listdir(single))


@pytest.mark.parametrize("driver, other, named", [
    ("sweep", "--config.seed=1", "config.seed (0 on process 0, 1 on process "
     "1)"),
    ("train", "--config.n_test=4", "config.n_test (256 on process 0, 4 on "
     "process 1)"),
    ("decompile", "--config.seed=1", "config.seed (0 on process 0, 1 on "
     "process 1)")], ids=["sweep", "train", "decompile"])
def test_processes_given_different_jobs_stop_before_the_claim(
    tmp_path, driver, other, named):
  """MP1: process 1 given another config field and another workdir: both
  stop with the same one line naming the fields and both values, before
  anything is written (they end before anything compiles)."""
  workdirs = [str(tmp_path / "one"), str(tmp_path / "two")]
  finished = multiprocess.launch(driver, lambda pid: [
      f"--config=experiments/configs/{driver}.py:tiny",
      f"--workdir={workdirs[pid]}", *([other] if pid else [])], timeout=60)
  line = (f"{driver}: the processes were given different jobs: process 1 "
          f"differs from process 0 in {named}; workdir ({workdirs[0]!r} on "
          f"process 0, {workdirs[1]!r} on process 1). Give every process the "
          "same command (only --process_id differs); nothing was written.")
  for f in finished:
    assert f.returncode == 1, multiprocess.report(finished)
    assert f.stderr.strip().splitlines()[-1] == line, (
        multiprocess.report(finished))
    assert "Traceback" not in f.stderr
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("driver, started", [("algorithms", 0),
                                             ("newton", 1)])
def test_a_process_that_never_joins_is_reported_in_bounded_time(
    tmp_path, driver, started):
  """MP4: one process of two is never started (the coordinator's, or the
  other): the one started ends after --join_timeout with the driver's line
  saying what happened and how to resume, not after JAX's 5 minutes."""
  workdir = str(tmp_path / "never")
  finished = multiprocess.launch(driver, [
      f"--config=experiments/configs/{driver}.py:tiny", f"--workdir={workdir}",
      "--join_timeout=5"], start=[started], timeout=60)
  (f,) = finished
  assert f.returncode == 1, multiprocess.report(finished)
  assert f.stderr.strip().splitlines()[-1] == (
      f"{driver}: stopped: not every process joined the job within "
      "--join_timeout=5 s. Start all 2 processes with the same "
      "--coordinator_address and --num_processes, each with its own "
      "--process_id (or through the scheduler); the same command then "
      "resumes the run from the files in --workdir."), (
          multiprocess.report(finished))
  assert not os.path.exists(workdir)


def test_process_0_killed_is_reported_by_the_others(tmp_path):
  """MP5: process 0 (which runs the coordination service) killed once the
  workdir is claimed: process 1 ends at once with the driver's line."""
  workdir = str(tmp_path / "run")
  finished = multiprocess.launch(
      "train", [*TRAIN, f"--workdir={workdir}", "--heartbeat_timeout=5"],
      timeout=60, kill_when=(0, lambda: os.path.exists(
          os.path.join(workdir, "config.json"))))
  assert finished[0].returncode is None, multiprocess.report(finished)
  assert finished[1].returncode == 1, multiprocess.report(finished)
  assert finished[1].stderr.strip().splitlines()[-1].startswith(
      "train: stopped: process 1 lost the job: another process died or sent "
      "no heartbeat for --heartbeat_timeout=5 s, or process 0, which runs the "
      "coordination service, is gone"), multiprocess.report(finished)


class _FakeStore:
  """The coordination service's key-value store, as seen by one process."""

  def __init__(self, posted: dict):
    self.posted = posted

  def key_value_set(self, key, value):
    assert key not in self.posted  # every key is set once
    self.posted[key] = value

  def blocking_key_value_get(self, key, timeout_in_ms):
    del timeout_in_ms
    return self.posted[key]


def test_a_refusal_on_one_process_is_every_process_refusal(monkeypatch):
  """Process 1 passes validation, process 0 (say with less memory) refused:
  process 1 raises process 0's refusal, as the same type, at once; what it
  reads is process 0's reading."""
  posted = {}
  monkeypatch.setattr(distributed, "_client", lambda: _FakeStore(posted))
  monkeypatch.setattr(distributed, "_steps", iter(range(100)))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  posted["elsa/agree/0-validate/0"] = json.dumps(  # what process 0 posted
      ["ConfigError", "config: n_tasks need about 9 GiB, more than ..."])
  checked = []
  with pytest.raises(checks.ConfigError,
                     match=r"^process 0: config: n_tasks need about 9 GiB"):
    distributed.agree("validate", lambda: checked.append(1))
  assert checked == [1] and posted["elsa/agree/0-validate/1"] == "null"
  posted["elsa/from0/1-read results.json"] = '["value", {"done": 1}]'
  assert distributed.from_process_0("read results.json",
                                    lambda: None) == {"done": 1}
  posted["elsa/from0/2-read partial.json"] = json.dumps(
      ["CorruptOutput", "'partial.json' fails its checksum"])
  with pytest.raises(workdirs.CorruptOutput,
                     match="^process 0: 'partial.json'"):
    distributed.from_process_0("read partial.json", lambda: None)
