"""What a set of per-prompt losses says, and what its mean hides: standard
errors of the mean and of the median, the share of the worst prompts, and
paired differences of two predictors on the same prompts.

Plain numpy in float64, distribution-free, no resampling and no seed.
"""

from __future__ import annotations

import math

import numpy as np


def mean_se(per_task) -> dict[str, float]:
  """``mean`` and its standard error ``se`` over ``per_task [n]``, ``n >= 2``."""
  per_task = np.asarray(per_task, np.float64)
  return {"mean": float(per_task.mean()),
          "se": float(per_task.std(ddof=1) / np.sqrt(per_task.size))}


def median_se(x, *, z: float = 1.96) -> float:
  """The standard error of the median of ``x [n]``, distribution-free: the
  spread of the sample quantiles ``1/2 -+ z / (2 sqrt(n))`` over ``2 z``,
  the density at the median estimated from the order statistics that bound
  its ``z``-interval (Bloch & Gastwirth 1968). For ``n`` normal draws of
  scale ``s``: ``sqrt(pi / 2) s / sqrt(n)``; no resampling, no seed."""
  x = np.asarray(x, np.float64)
  half = min(0.5, z / (2 * np.sqrt(x.size)))
  lo, hi = np.quantile(x, [0.5 - half, 0.5 + half])
  return float((hi - lo) / (2 * z))


def loss_summary(per_task, *, worst: float = 0.01) -> dict[str, float]:
  """What the mean of per-prompt losses hides: ``mean``, its standard error
  ``se``, the ``median`` and its ``median_se`` (:func:`median_se`), and
  ``worst_share``, the share of the total from the ``ceil(worst * n)``
  largest losses (at 1%: 0.08 for the squared error of a Gaussian
  prediction error, 1 when one prompt is the mean).

  Args:
    per_task: ``[n]`` losses, ``n >= 2``.
  """
  per_task = np.asarray(per_task, np.float64)
  top = np.sort(per_task)[-max(1, math.ceil(worst * per_task.size)):]
  total = per_task.sum()
  return {**mean_se(per_task),
          "median": float(np.median(per_task)),
          "median_se": median_se(per_task),
          "worst_share": float(top.sum() / total) if total > 0 else np.nan}


def paired_summary(a, b) -> dict[str, float]:
  """The paired per-prompt difference ``a - b`` of two predictors' losses
  on the same prompts (``[n]`` each): its ``mean``, standard error ``se``,
  ``median`` and ``median_se``. Pairing removes the prompts' shared
  difficulty: the ``se`` is that of the differences, usually far below
  either loss's."""
  diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  return {**mean_se(diff),
          "median": float(np.median(diff)), "median_se": median_se(diff)}


