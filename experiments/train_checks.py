"""A train config checked whole, in one walk, before the workdir is claimed.

:func:`validate` walks :data:`FIELDS` (each field once, with its check of
:mod:`experiments.checks`), then what ties fields together (divisors, the
task and its options, the shifts, 64-bit mode) and the memory the run needs
(:func:`bytes_needed`). :func:`layout` splits the devices over the grid and
the batch. Every refusal is one :class:`experiments.checks.ConfigError` line
naming the field, what is allowed and what came.
"""

from __future__ import annotations

import math

import jax
import ml_collections

from elsa import tasks as task_families
from elsa import training
from experiments import checks
from experiments import train_setup


def _int(low: int = 1):
  return lambda config, field: checks.check_int(config, field, low=low)


def _optional(check):
  return lambda config, field: (None if config[field] is None
                                else check(config, field))


def _positive(config, field):
  return checks.check_float(config, field, low=0, low_open=True)


# field -> its check, in the order they are walked (a check that reads
# another field comes after it).
FIELDS = {
    "seed": checks.check_seed,
    "dtype": lambda c, f: checks.check_choice(c, f, train_setup.DTYPES),
    "task": lambda c, f: checks.check_choice(
        c, f, (train_setup.DEFAULT_TASK, *task_families.FAMILIES)),
    "models": lambda c, f: checks.check_items(
        c, f, choices=tuple(train_setup.MODELS)),
    "tokens": lambda c, f: checks.check_choice(c, f, training.TOKENS),
    "x_dist": lambda c, f: checks.check_choice(c, f,
                                               training.X_DISTRIBUTIONS),
    "depths": lambda c, f: checks.check_items(c, f, integer=True, low=1),
    **dict.fromkeys(("n_train", "d", "components", "steps", "batch",
                     "log_every", "checkpoint_every", "keep_checkpoints",
                     "eta_grid", "n_query", "eval_chunk"), _int()),
    "n_test": _int(low=2),  # a standard error needs two
    "warmup_steps": lambda c, f: checks.check_int(c, f, low=0, high=c.steps),
    "inner": _optional(_int()),
    "lam": lambda c, f: checks.check_float(c, f, low=0),
    "noise": lambda c, f: checks.check_float(c, f, low=0),
    "clip_norm": _optional(_positive),
    "x_scale": _positive,
    "end_fraction": lambda c, f: checks.check_float(c, f, low=0, high=1),
    "eta_min": _positive,
    "eta_max": lambda c, f: checks.check_float(c, f, low=c.eta_min,
                                               low_open=True),
    "learning_rates": lambda c, f: checks.check_items(c, f, low=0,
                                                      low_open=True),
    "init_scales": lambda c, f: checks.check_items(c, f, low=0,
                                                   low_open=True),
}


def validate(config: ml_collections.ConfigDict) -> None:
  """Every field in its range, shifts included, and a run that fits in
  memory, before the workdir is touched.

  Raises:
    checks.ConfigError: naming the field and what is allowed.
  """
  for field, check in FIELDS.items():
    check(config, field)
  if config.n_test % min(config.eval_chunk, config.n_test):
    raise checks.ConfigError(
        f"config.eval_chunk must divide config.n_test ({config.n_test}) or "
        f"exceed it, got {config.eval_chunk}.")
  if config.steps % config.log_every:
    raise checks.ConfigError(
        f"config.log_every must divide config.steps ({config.steps}), got "
        f"{config.log_every}.")
  if config.dtype == "float64" and not jax.config.jax_enable_x64:
    raise checks.ConfigError(
        "config.dtype float64 needs JAX's 64-bit mode, which is off (JAX "
        "would run float32): run with JAX_ENABLE_X64=1 in the environment "
        "(or jax.config.update('jax_enable_x64', True) first), or "
        "--config.dtype=float32.")
  _check_task(config)
  for name, shift in config.shifts.items():
    _check_shift(name, shift)
  checks.check_fits(bytes_needed(config), fields=(
      "n_train, d, n_query, depths, components, inner, batch, n_test, "
      "eval_chunk, eta_grid, steps and the grid"))


def _check_task(config) -> None:
  """``config.task_options`` are options of the family ``config.task`` that
  let it sample prompts of the config's sizes (checked on shapes only)."""
  options = train_setup.task_options(config)
  if config.task == train_setup.DEFAULT_TASK:
    if options:
      raise checks.ConfigError(
          f"config.task_options are a family's options; task "
          f"{train_setup.DEFAULT_TASK!r} takes none (its fields are the "
          f"config's), got {options}.")
    return
  try:
    spec = train_setup.train_spec(config)
    jax.eval_shape(lambda key: spec.sample(key, batch=1,
                                           dtype=train_setup.dtype(config)),
                   jax.random.key(0))
  except (TypeError, ValueError) as err:
    raise checks.ConfigError(f"config.task_options: {err}") from None


def _check_shift(name: str, shift) -> None:
  fields = train_setup.SHIFT_FIELDS
  if not isinstance(shift, (dict, ml_collections.ConfigDict)):
    raise checks.ConfigError(f"config.shifts.{name} must be a dict of shift "
                             f"fields ({', '.join(fields)}), got {shift!r}.")
  for field, value in shift.items():
    where = f"shifts.{name}.{field}"
    one = {where: value}  # the checks read config[field] and name the field
    if field in ("x_scale", "w_scale"):
      _positive(one, where)
    elif field == "x_skew":
      checks.check_float(one, where)
    elif field == "x_dist":
      checks.check_choice(one, where, training.X_DISTRIBUTIONS)
    elif field == "noise_labels" and not isinstance(value, bool):
      raise checks.ConfigError(f"config.{where} must be True or False, got "
                               f"{value!r}.")
    elif field not in fields:
      raise checks.ConfigError(f"config.{where} is not a shift field; a shift "
                               f"sets {', '.join(fields)}.")


def bytes_needed(config: ml_collections.ConfigDict) -> int:
  """About what a run holds at once (within a few times): the test,
  validation and one shifted set of tasks; one grid point's training batch
  with every layer's state and projections (kept for the gradient); one
  evaluation chunk of every model with its input gradient; GD's step-size
  grid; the grid's parameters with Adam's moments; the losses."""
  form = train_setup.task_spec(config).model_tokens()
  depth, k = max(config.depths), config.inner or form.n
  per_layer = config.components * (form.m * (form.n + 3 * k) + k * k)
  tasks = 3 * config.n_test * (config.n_train + config.n_query) * (config.d
                                                                   + 1)
  train_batch = 3 * config.batch * (depth + 1) * per_layer
  evaluation = (3 * len(config.models) * min(config.eval_chunk, config.n_test)
                * (depth + 1) * per_layer)
  eta_grid = config.eta_grid * config.n_test * (config.d + config.n_query)
  points = len(train_setup.grid(config))
  params = 3 * points * depth * config.components * (3 * k * (form.n + 1)
                                                     + form.m)
  losses = points * config.steps * len(config.models) * len(config.depths)
  return train_setup.dtype(config).itemsize * (
      tasks + train_batch + evaluation + eta_grid + params + losses)


def layout(config) -> tuple[int, int]:
  """``(groups, shards)``: every device, as ``groups`` of grid points times
  ``shards`` of each batch.

  The grid takes as many devices as divide it (its points share nothing: no
  communication), the batch the rest (data-parallel: the loss's mean, and so
  the gradients, reduced over them by XLA each step): ``groups = gcd(devices,
  grid points)``.

  Raises:
    checks.ConfigError: ``config.batch`` does not split over the shards.
  """
  devices = jax.device_count()
  points = len(train_setup.grid(config))
  groups = math.gcd(devices, points)
  shards = devices // groups
  if config.batch % shards:
    raise checks.ConfigError(
        f"config.batch must be a multiple of {shards} to split over the "
        f"{devices} devices ({groups} groups of the {points} grid points, "
        f"each batch over {shards}), got {config.batch}.")
  return groups, shards


def check_devices(config) -> tuple[int, int]:
  """:func:`validate` (whose memory estimate, the whole run on this
  process's smallest device, bounds any device's share), then the
  :func:`layout` of the devices, which it returns."""
  validate(config)
  return layout(config)
