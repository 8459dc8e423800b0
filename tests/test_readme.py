"""The README opens with the two commands, and the test command is what CI runs.

Its code blocks run in tests/test_docs.py, each on its own, with the site's."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def test_opens_with_the_two_commands():
  lines = _readme().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
  assert lines[0].startswith("# run the main job")
  assert "python -m experiments.sweep" in lines[1]
  assert lines[2] == "# run the tests"
  assert "pip install -e" in lines[3] and "pytest" in lines[3]
  # The suite builds the documentation site (tests/test_docs.py): the test
  # command installs its tools.
  extras = re.search(r"pip install -e '\.\[([\w,]+)\]'", lines[3]).group(1)
  assert {"test", "docs"} <= set(extras.split(","))
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    assert "'^# run the tests' README.md" in f.read()
