"""Drivers as two processes of one ``jax.distributed`` job (2 CPU devices each)
against one process on as many devices, through :mod:`tests.multiprocess`.

Each job compiles in every process: a few tens of seconds on 2 cores.
"""

import json
import os

import numpy as np

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
  float32 bound, BUILD_NOTES "The sweep": 1e-5 relative to GD)."""
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


def test_sweep_slurm_launch_equals_one_process(tmp_path):
  """srun-style: two processes find each other from SLURM_* alone; process 0
  writes every file once; the results equal one process on 4 devices."""
  multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
  finished = multiprocess.launch("sweep", [*SWEEP, f"--workdir={multi}"],
                                 slurm=True)
  _assert_ok(finished)
  one = multiprocess.run_single("sweep", [*SWEEP, f"--workdir={single}"],
                                devices=4)
  _assert_ok([one])
  got, want = _read(multi), _read(single)
  assert got["devices"] == want["devices"] == 4
  _sweep_records_close(got, want)
  assert sorted(os.listdir(multi)) == sorted(os.listdir(single))
