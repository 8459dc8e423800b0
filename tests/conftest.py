"""Test-wide settings: float64 available everywhere (each test names its
dtype), property tests that draw the same examples on every run, the
``variant`` fixture, one persistent compilation cache per test run, XLA's
backend optimisations at level 0, and the slowest files first.

The cache: the suite compiles the same programs in several processes (the
xdist workers, the drivers' subprocesses, every process of a multi-process
job), so the first compilation is written to a directory the run creates and
every later one in any process is read back. The directory is handed to the
workers and subprocesses through ``JAX_COMPILATION_CACHE_DIR`` and removed at
the end of the run; every compilation is written, however short
(``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``: no cost measured on files
that share nothing). An entry another process is still writing reads as a
damaged entry: JAX warns and compiles afresh, never runs a wrong program.
"""

import os
import shutil
import tempfile

import jax
import pytest
from hypothesis import settings

# XLA's backend (LLVM) optimisations at level 0 in every process of the run:
# this one, the xdist workers and every subprocess inherit XLA_FLAGS (set
# here, before any backend starts; tests/multiprocess.py keeps it beside the
# device count). The suite compiles far more than it runs, and on CPU level 0
# roughly halves a compilation (elsa/decompile.py's fits already use it); the
# HLO passes (fusion, simplification) still run. Results differ from the
# default level by rounding only (a * b + c is not contracted into one FMA),
# what the tests' tolerances are for: no test compares against numbers
# computed at another level.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", "").split():
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, (os.environ.get("XLA_FLAGS"), _FAST_COMPILE)))

jax.config.update("jax_enable_x64", True)

settings.register_profile("elsa", derandomize=True, deadline=None)
settings.load_profile("elsa")

_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
_created = pytest.StashKey[str]()  # the directory this process made


def pytest_configure(config):
  # The controller (or the only process) creates the directory before xdist
  # starts the workers, which inherit the environment; an outer run's
  # directory (one given by the user) is used as it is and kept.
  if _CACHE_DIR not in os.environ:
    os.environ[_CACHE_DIR] = tempfile.mkdtemp(prefix="elsa-jax-cache-")
    config.stash[_created] = os.environ[_CACHE_DIR]
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_unconfigure(config):
  created = config.stash.get(_created, None)
  if created is not None:
    shutil.rmtree(created, ignore_errors=True)
    del os.environ[_CACHE_DIR]


# The files that take a minute or more (drivers run end to end, several
# processes, the decompiler's fits), longest first. Run first, they leave the
# short tests for the end, where xdist's scheduler (README: --dist worksteal)
# evens out the two workers; and they fall in the first worker's share, whole,
# so a file's compilations are not repeated in the other worker.
_SLOW_FIRST = ("test_distributed.py", "test_decompile.py",
               "test_train_driver.py", "test_sweep.py",
               "test_decompile_driver.py", "test_benchmark_driver.py",
               "test_docs.py", "test_notebooks.py", "test_algorithms_driver.py")


def pytest_collection_modifyitems(items):
  rank = lambda item: (_SLOW_FIRST.index(item.path.name)
                       if item.path.name in _SLOW_FIRST else len(_SLOW_FIRST))
  items.sort(key=rank)  # stable: each file's own order is kept


@pytest.fixture
def no_cache_writes():
  """Nothing compiled in the test is written to the persistent cache.

  For the files that build transformers (``pytestmark``): XLA:CPU (jax
  0.10.2) segfaulted serialising their executables into the cache, in
  ``compilation_cache.put_executable_and_time``, late in a long-lived xdist
  worker (never when the file ran alone); the write is skipped, not the
  read. ``jax_persistent_cache_min_compile_time_secs`` is read at every
  write, so raising it for the test is enough.
  """
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  yield
  jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


@pytest.fixture(params=["eager", "jit"])
def variant(request):
  """A test runs once calling the function directly and once under
  :func:`jax.jit` (what ``chex.variants`` gives an absltest case)."""
  return (lambda fn: fn) if request.param == "eager" else jax.jit
