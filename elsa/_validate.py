"""The library's default float dtype and the argument checks its public functions share.

One refusal policy for every public entry point, checked once there, at trace
time, with a message that names the function, the argument, what is allowed
and what came:

* wrong type or dtype (a float or a bool where an int belongs, an integer
  array or dtype where a floating one belongs, two arrays of different
  dtypes): ``TypeError``;
* wrong shape, rank, value or range: ``ValueError``. Sizes are ints ``>= 1``
  (a zero size is refused unless the function documents an empty axis);
  ridge strengths are ``>= 0`` and step sizes ``> 0``; every concrete scalar
  parameter (a strength, a step, a noise level, a scale) is finite;
* a request whose arrays cannot fit in the memory of this process's
  addressable devices together (:func:`fits_memory`): ``ValueError`` before
  anything is allocated, rather than an XLA abort of the whole process or an
  array that never materialises.

Values can be checked only when they are known: a traced argument (under
``jit``, ``vmap`` or ``grad``) is checked for its shape and dtype, not for its
values. Data arrays (``x``, ``y``, ``h``) are not scanned for NaN: a check
would read every element back to the host.
"""

from __future__ import annotations

import functools
import math
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np


def float_dtype(dtype=None):
  """``dtype`` itself, or JAX's default float when ``None``: float32, or
  float64 under ``jax_enable_x64``. The one place the library picks a default."""
  if dtype is None:
    return jax.dtypes.canonicalize_dtype(jnp.float64)
  return jnp.dtype(dtype)


def floating_dtype(fn: str, dtype, name: str = "dtype"):
  """:func:`float_dtype` of a ``dtype`` argument, ``TypeError`` unless it is a
  (real) floating dtype."""
  try:
    found = float_dtype(dtype)
  except TypeError:
    found = None
  if found is None or not jnp.issubdtype(found, jnp.floating):
    raise TypeError(f"{fn}: {name} must be a floating dtype (float32, "
                    f"float64, ...), got {dtype!r}.")
  return found


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


def _real(fn: str, name: str, value) -> np.ndarray | None:
  """A concrete ``value`` as a real numpy array (``None`` when traced);
  ``TypeError`` for anything that is not real numbers."""
  found = concrete(value)
  # Kinds float, int, uint; numpy does not count bfloat16 (ml_dtypes) as one.
  if found is not None and found.dtype.kind not in "fiu" and not (
      jnp.issubdtype(found.dtype, jnp.floating)):
    raise TypeError(f"{fn}: {name} must be a real number, got {value!r}.")
  return found


def _first(name: str, found: np.ndarray, bad: np.ndarray) -> str:
  """``'nan'`` or ``'nan in eta(3,)'``: the first bad entry, and where."""
  first = float(np.ravel(found[bad] if found.ndim else found)[0])
  return f"{first:g}" + ("" if found.ndim == 0 else f" in {name}{found.shape}")


def finite(fn: str, name: str, value) -> None:
  """``ValueError`` if a concrete ``value`` has a NaN or an infinite entry;
  traced values pass (see the module doc)."""
  found = _real(fn, name, value)
  if found is None:
    return
  bad = ~np.isfinite(found)
  if np.any(bad):
    raise ValueError(f"{fn}: {name} must be finite, got "
                     f"{_first(name, found, bad)}.")


def at_least(fn: str, name: str, value, *, low: float, strict: bool) -> None:
  """``ValueError`` if a concrete ``value`` has an entry below ``low`` (at or
  below it if ``strict``) or one that is not finite (NaN, +-inf); traced
  values pass (see the module doc)."""
  found = _real(fn, name, value)
  if found is None:
    return
  allowed = f"{fn}: {name} must be {'>' if strict else '>='} {low:g}, got "
  nonfinite = ~np.isfinite(found)
  if np.any(nonfinite):
    raise ValueError(allowed + _first(name, found, nonfinite)
                     + "; only finite values are allowed.")
  low_ok = found > low if strict else found >= low
  if not np.all(low_ok):
    raise ValueError(allowed + _first(name, found, ~low_ok) + ".")


def array_bytes(dtype, *shapes) -> int:
  """Bytes of arrays of ``dtype`` with these ``shapes`` (Python ints: exact
  for any size, no overflow)."""
  return jnp.dtype(dtype).itemsize * sum(math.prod(s) for s in shapes)


def _host_bytes() -> int | None:
  """Physical memory of this host, ``None`` where the OS does not say."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):
    return None


@functools.cache
def memory_bytes() -> int | None:
  """What this process's addressable devices hold together, in bytes.

  The sum of the ``bytes_limit`` every addressable accelerator reports; CPU
  devices (and devices that report no limit) share host RAM, counted once.
  Only addressable devices are asked: another process's devices cannot be
  queried in a multi-process run. ``None`` when nothing is known.
  """
  total, host = 0, False
  for device in jax.local_devices():
    stats = {}
    if device.platform != "cpu":
      try:
        stats = device.memory_stats() or {}
      except (NotImplementedError, RuntimeError):  # a backend without stats
        pass
    if stats.get("bytes_limit"):
      total += int(stats["bytes_limit"])
    else:
      host = True
  if host:
    ram = _host_bytes()
    if ram is None:
      return total or None
    total += ram
  return total


def fits_memory(fn: str, nbytes: int, fields: dict) -> None:
  """``ValueError`` if ``nbytes`` cannot fit in :func:`memory_bytes`.

  ``nbytes``: what the call must allocate at least (its outputs), e.g. from
  :func:`array_bytes`; ``fields``: the arguments that set it, named in the
  message (``{"batch": 10**6, "x.shape": (2, 3)}``). Called before anything
  is allocated: an array larger than the memory of every device together
  aborts the process inside XLA (or returns at once and never materialises)
  instead of raising. A request that fits all devices together but not one
  is left to XLA, which raises ``RESOURCE_EXHAUSTED``.
  """
  limit = memory_bytes()
  if limit is not None and nbytes > limit:
    named = ", ".join(f"{key}={value}" for key, value in fields.items())
    raise ValueError(f"{fn}: {named} need at least {nbytes / 2**30:.3g} GiB, "
                     f"more than the {limit / 2**30:.3g} GiB the devices of "
                     "this process hold together; make them smaller.")


def int_between(fn: str, name: str, value, *, low: int, high: int) -> int:
  """:func:`int_at_least` with an upper bound: ``ValueError`` above ``high``
  (a count that sets a loop's length or an array's size, where a typo such
  as ``1e12`` would run for days or allocate terabytes)."""
  value = int_at_least(fn, name, value, low=low)
  if value > high:
    raise ValueError(f"{fn}: {name} must be an int in [{low}, {high}], got "
                     f"{value}.")
  return value


def float32_or_64(fn: str, name: str, x) -> None:
  """``TypeError`` unless ``x`` is float32 or float64 (bfloat16 and float16
  lose the digits a numerical comparison needs)."""
  dtype = jnp.result_type(x)
  if dtype not in (jnp.float32, jnp.float64):
    raise TypeError(f"{fn}: {name} must be float32 or float64, got {dtype}.")
