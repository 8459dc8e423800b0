"""The library's default float dtype and the argument checks its public functions share.

One policy for every public entry point, checked once there, at trace time,
with a message that names the function, the argument, what was expected and
what came:

* wrong type or dtype (a float where an int belongs, an integer array where
  a floating one belongs, two arrays of different dtypes): ``TypeError``;
* wrong shape, rank, value or range (a size below its minimum, a negative
  ridge strength, a step size ``<= 0``): ``ValueError``.

Values can be checked only when they are known: a traced argument (under
``jit``, ``vmap`` or ``grad``) is checked for its shape and dtype, not for its
values.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np


def float_dtype(dtype=None):
  """``dtype`` itself, or JAX's default float when ``None``: float32, or
  float64 under ``jax_enable_x64``. The one place the library picks a default."""
  if dtype is None:
    return jax.dtypes.canonicalize_dtype(jnp.float64)
  return jnp.dtype(dtype)


def int_at_least(fn: str, name: str, value, *, low: int) -> int:
  """``value`` as a Python int ``>= low`` (numpy integers accepted).

  Raises:
    TypeError: ``value`` is not an integer (a bool is not one).
    ValueError: ``value < low``.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{fn}: {name} must be an int >= {low}, got {value!r}.")
  try:
    value = operator.index(value)
  except TypeError:
    raise TypeError(f"{fn}: {name} must be an int >= {low}, got {value!r} of "
                    f"type {type(value).__name__}.") from None
  if value < low:
    raise ValueError(f"{fn}: {name} must be an int >= {low}, got {value}.")
  return value


def floating(fn: str, name: str, x) -> None:
  """``TypeError`` unless ``x`` has a (real) floating dtype."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{fn}: {name} must have a floating dtype, got {dtype}.")


def same_dtype(fn: str, name: str, value, ref_name: str, ref) -> None:
  """``TypeError`` unless ``value`` has the dtype of ``ref``."""
  if jnp.result_type(value) != jnp.result_type(ref):
    raise TypeError(f"{fn}: {name} has dtype {jnp.result_type(value)} but "
                    f"{ref_name} has dtype {jnp.result_type(ref)}; cast one "
                    "of them explicitly.")


def concrete(value) -> np.ndarray | None:
  """``value`` as a numpy array, or ``None`` when it is traced (unknown yet)."""
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value)):
    return None
  return np.asarray(value)


def at_least(fn: str, name: str, value, *, low: float, strict: bool) -> None:
  """``ValueError`` if a concrete ``value`` has an entry below ``low`` (at or
  below it if ``strict``), or a NaN; traced values pass (see the module doc)."""
  found = concrete(value)
  if found is None:
    return
  ok = found > low if strict else found >= low
  if not np.all(ok):
    bad = found[~ok] if found.ndim else found
    raise ValueError(f"{fn}: {name} must be {'>' if strict else '>='} {low:g}, "
                     f"got {float(np.ravel(bad)[0]):g}"
                     + ("" if found.ndim == 0 else f" in {name}{found.shape}")
                     + ".")
