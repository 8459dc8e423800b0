"""The command line every driver shares (experiments/cli.py)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flag, named, listed", [
    ("--config.bogus_field=1", "bogus_field", "kappas"),  # the fields there are
    ("--config=experiments/configs/newton.py:nosuchvariant", "'nosuchvariant'",
     "known: 'tiny' (or none for the default)")])
def test_an_unknown_config_field_is_reported_in_one_line(tmp_path, flag,
                                                         named, listed):
  """An unknown field, or an unknown variant of the config file."""
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.newton", flag,
       f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
      text=True, timeout=120, check=False)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  (line,) = [l for l in proc.stderr.splitlines() if named in l]
  assert listed in line
  assert not os.path.exists(tmp_path / "run")
