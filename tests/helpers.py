"""What the test files share: the two relative errors they measure exactness
with, and a recorder for driver runs.

Pytrees are compared with :func:`chex.assert_trees_all_close`, compile counts
checked with :func:`chex.assert_max_traces`.
"""

import matplotlib
import numpy as np

from experiments import cli


def rel_err(got, want) -> float:
  """``max |got - want| / max |want|``, in float64; 0 for empty arrays.

  The worst entry against the scale of the reference: the error measure of
  the primitive, the constructions, the forms and the references.
  """
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  if want.size == 0:
    return 0.0
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def rel_norm(got, want) -> float:
  """``||got - want|| / ||want||`` (Frobenius), in float64; 0 when both are
  exactly equal (also both zero)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  err = np.linalg.norm(got - want)
  return float(err / np.linalg.norm(want)) if err else 0.0


def record_driver_run(monkeypatch, resumed: list) -> None:
  """Appends every ``cli.Progress.resumed`` count of a driver run to
  ``resumed``, and fails the run if it switches matplotlib's backend (a
  driver draws its figures without pyplot state)."""

  class Progress(cli.Progress):
    def resumed(self, count):
      resumed.append(count)
      super().resumed(count)

  def no_backend_switch(*args, **kwargs):
    raise AssertionError("the plot must not switch matplotlib's backend")

  monkeypatch.setattr(cli, "Progress", Progress)
  monkeypatch.setattr(matplotlib, "use", no_backend_switch)
