"""The distribution: one version, a wheel that installs into a fresh
environment and imports from outside the repository."""

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import elsa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISTRIBUTION = "elsa-attention"


def _run(command, **kwargs):
  """Runs ``command``; its output is the failure's message."""
  run = subprocess.run(command, capture_output=True, text=True, timeout=300,
                       check=False, **kwargs)
  assert run.returncode == 0, f"{command}:\n{run.stdout}{run.stderr}"
  return run.stdout


def test_the_version_is_written_once():
  assert re.fullmatch(r"\d+\.\d+\.\d+", elsa.__version__)
  with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
    setup_py = f.read()
  assert f'name="{DISTRIBUTION}"' in setup_py
  assert "version=_version()" in setup_py and elsa.__version__ not in setup_py
  with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
    changelog = f.read()
  # Keep a Changelog: an Unreleased section, then this version, dated.
  assert "## [Unreleased]" in changelog
  assert re.search(rf"^## \[{re.escape(elsa.__version__)}\] - \d{{4}}-\d\d-\d\d$",
                   changelog, re.M)


def test_wheel_installs_into_a_fresh_environment(tmp_path):
  # The wheel is built from a copy of what it packs, so the build leaves no
  # build/ or egg-info in the checkout; offline: setuptools as installed.
  src = tmp_path / "src"
  shutil.copytree(os.path.join(ROOT, "elsa"), src / "elsa",
                  ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(os.path.join(ROOT, name), src / name)
  dist = tmp_path / "dist"
  _run([sys.executable, "-m", "pip", "wheel", "--no-deps",
        "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(src)])
  wheel, = dist.glob("*.whl")
  assert wheel.name.startswith(f"elsa_attention-{elsa.__version__}-")
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
  assert "elsa/programs/compiler.py" in names and "elsa/forms/newton.py" in names
  assert not [n for n in names if n.startswith(("tests/", "experiments/"))]

  # A fresh environment; its dependencies (jax, flax, ...) are this one's,
  # seen through a path file, so nothing is downloaded. This environment's own
  # elsa (an editable install) is not on that path: path files are not read
  # from a folder a path file adds.
  env_dir = tmp_path / "venv"
  venv.create(env_dir, with_pip=False)
  python = env_dir / "bin" / "python"
  site_packages = _run([str(python), "-c", "import sysconfig; "
                        "print(sysconfig.get_path('purelib'))"]).strip()
  deps = [p for p in sys.path if p.endswith("site-packages")]
  with open(os.path.join(site_packages, "deps.pth"), "w", encoding="utf-8") as f:
    f.write("\n".join(deps) + "\n")
  _run([sys.executable, "-m", "pip", "--python", str(python), "install",
        "--no-deps", "--no-index", "-q", str(wheel)])

  outside = tmp_path / "elsewhere"
  outside.mkdir()
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  out = _run([str(python), "-c", "import elsa; print(elsa.__version__); "
              "print(elsa.__file__); import importlib.metadata as m; "
              f"print(m.version({DISTRIBUTION!r}))"], cwd=outside, env=env)
  version, location, installed = out.split()
  assert version == installed == elsa.__version__
  assert location.startswith(site_packages), location
