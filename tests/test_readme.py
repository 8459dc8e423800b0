"""The README's tour runs as written, and its commands are what CI runs."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def test_tour_runs():
  blocks = re.findall(r"```python\n(.*?)```", _readme(), flags=re.S)
  assert blocks, "README.md lost its python tour"
  for block in blocks:
    # A fresh interpreter: the tour runs in JAX's defaults (float32), not in
    # the float64 the test session enables.
    subprocess.run([sys.executable, "-c", block], check=True, cwd=ROOT,
                   timeout=300)


def test_opens_with_the_two_commands():
  lines = _readme().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
  assert lines[0].startswith("# run the main job")
  assert "python -m experiments.sweep" in lines[1]
  assert lines[2] == "# run the tests"
  assert "pip install -e" in lines[3] and "pytest" in lines[3]
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    assert "'^# run the tests' README.md" in f.read()
