"""The documentation site builds with warnings as errors, documents every public
name, and every code block of its pages and of the README runs on its own."""

import glob
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every public module and its page of the API reference (docs/api/).
MODULES = ("attention", "constructions", "ridge", "tasks", "shifts", "curriculum", "forms",
           "programs",
           "algorithms", "nn", "training", "decompile")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """The site as `python -m sphinx -W -b html docs OUT` builds it (README,
  docs/conf.py), without executing the notebooks (tests/test_notebooks.py does)."""
  out = tmp_path_factory.mktemp("site")
  build = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
       "html", "-d", str(out / ".doctrees"), "docs", str(out / "html")],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert build.returncode == 0, build.stdout + build.stderr
  return out / "html"


def _public_names(module):
  """The names a module offers: its ``__all__``, else the functions and
  classes it defines whose names do not start with an underscore."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return [name for name, obj in vars(module).items()
          if not name.startswith("_")
          and (inspect.isfunction(obj) or inspect.isclass(obj))
          and obj.__module__ == module.__name__]


def test_site_builds_and_documents_every_public_name(site):
  for page in ("index", "getting_started", "results", "changelog",
               "guides/index", "notebooks/colab", "notebooks/programs",
               "api/index", "api/elsa"):
    assert (site / f"{page}.html").is_file(), page
  for name in ("colab", "programs"):
    html = (site / "notebooks" / f"{name}.html").read_text(encoding="utf-8")
    assert "colab.research.google.com/github/" in html
    assert f"/experiments/{name}.ipynb" in html
  for name in MODULES:
    module = importlib.import_module(f"elsa.{name}")
    html = (site / "api" / f"{name}.html").read_text(encoding="utf-8")
    documented = set(re.findall(r'id="(elsa\.[\w.]+)"', html))
    missing = [n for n in _public_names(module)
               if f"elsa.{name}.{n}" not in documented]
    assert not missing, f"docs/api/{name}.md: no entry for {missing}"


def _code_blocks():
  """(where, source) of every python block of the README and the site's
  markdown pages."""
  pages = [os.path.join(ROOT, "README.md")] + sorted(
      glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
  blocks = []
  for page in pages:
    with open(page, encoding="utf-8") as f:
      text = f.read()
    for i, block in enumerate(re.findall(r"^```python\n(.*?)^```", text,
                                         flags=re.S | re.M)):
      blocks.append((f"{os.path.relpath(page, ROOT)}, block {i + 1}", block))
  return blocks


# Runs each block in a process of its own, from a fresh namespace, so a block
# that leans on a name or an import of another fails. The blocks' processes
# are forked from one that has imported jax and elsa but started no backend
# and changed no setting (a block sees JAX's defaults: float32 unless it asks
# for float64), which saves an interpreter start and the imports per block.
_RUNNER = textwrap.dedent("""
    import json, os, sys, traceback
    import jax, flax, optax  # imported once; no backend is started here
    import elsa
    from elsa import algorithms, decompile, programs
    blocks = json.load(sys.stdin)
    failures = []
    for where, source in blocks:
      sys.stdout.flush(); sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        try:
          exec(compile(source, where, "exec"), {"__name__": "__main__"})
        except BaseException:
          traceback.print_exc()
          sys.stderr.flush()
          os._exit(1)
        sys.stdout.flush()
        os._exit(0)
      _, status = os.waitpid(pid, 0)
      if status != 0:
        failures.append(where)
    print("FAILED:", json.dumps(failures))
    """)


def test_every_code_block_runs_on_its_own():
  import json
  blocks = _code_blocks()
  where = [w for w, _ in blocks]
  assert any(w.startswith("README.md") for w in where), "README lost its tour"
  assert sum(w.startswith("docs/api/index.md") for w in where) >= 8
  run = subprocess.run([sys.executable, "-c", _RUNNER], cwd=ROOT,
                       input=json.dumps(blocks), capture_output=True,
                       text=True, timeout=600, check=False)
  assert run.returncode == 0, run.stdout + run.stderr
  failed = json.loads(run.stdout.rsplit("FAILED:", 1)[1])
  assert not failed, f"blocks that fail on their own: {failed}\n{run.stderr}"
