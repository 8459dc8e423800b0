"""The error every driver reports: :func:`relative_error`, one definition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def relative_error(a, b):
  r"""``||a - b||_2 / max(||b||_2, tiny)`` over the last axis: ``[...]`` from ``[..., d]``.

  ``tiny = finfo(dtype of b).tiny`` keeps ``b = 0`` finite. numpy in, numpy
  out (in the inputs' precision); JAX arrays (also traced ones) in, JAX out.
  The one definition every driver reports.
  """
  xp = jnp if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np
  a, b = xp.asarray(a), xp.asarray(b)
  tiny = xp.finfo(b.dtype).tiny
  return (xp.linalg.norm(a - b, axis=-1)
          / xp.maximum(xp.linalg.norm(b, axis=-1), tiny))
