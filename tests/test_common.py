"""The workdir contract every driver shares (experiments/common.py)."""

import json
import os
import stat

import ml_collections
import numpy as np
import pytest

from experiments import common


def _config(**fields):
  return ml_collections.ConfigDict(dict(dict(depth=3, lam=0.1), **fields))


def test_matching_config_is_claimed_again_and_keeps_results(tmp_path):
  workdir = str(tmp_path)
  common.prepare_workdir(workdir, _config())
  common.write_json(os.path.join(workdir, "results.json"), {"done": 1})
  common.prepare_workdir(workdir, _config())
  assert common.read_json(os.path.join(workdir, "results.json")) == {"done": 1}


def test_other_config_is_refused_then_overwrite_removes_every_output(tmp_path):
  workdir = str(tmp_path)
  common.prepare_workdir(workdir, _config())
  for name in ("results.json", "partial_designed.json", "figures/a.png",
               "checkpoints/7/state"):
    common.write_json(os.path.join(workdir, name), {})
  common.write_json(os.path.join(workdir, "notes.json"), {"mine": True})
  with pytest.raises(common.WorkdirInUse, match=r"fields that differ: depth"):
    common.prepare_workdir(workdir, _config(depth=4))
  assert os.path.exists(os.path.join(workdir, "results.json"))
  common.prepare_workdir(workdir, _config(depth=4), overwrite=True)
  assert sorted(os.listdir(workdir)) == ["config.json", "notes.json"]
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["depth"] == 4


def test_outputs_without_a_config_are_refused(tmp_path):
  os.makedirs(tmp_path / "checkpoints")
  with pytest.raises(common.WorkdirInUse, match="no config.json"):
    common.prepare_workdir(str(tmp_path), _config())


def test_json_is_strict_and_files_are_not_private(tmp_path):
  path = str(tmp_path / "r.json")
  common.write_json(path, {"a": float("nan"), "b": [1.0, float("inf")],
                           "c": np.float32("nan"), "d": np.float32(0.5)})
  with open(path, encoding="utf-8") as f:
    assert json.loads(f.read(), parse_constant=pytest.fail) == {
        "a": None, "b": [1.0, None], "c": None, "d": 0.5}
  umask = os.umask(0)
  os.umask(umask)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
