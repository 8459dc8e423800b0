"""What a train config sets up: its models, its tasks, its tuning grid and
the grid's initial state.

Every other module of the train driver reads the config through these
(:mod:`experiments.train_checks`, :mod:`experiments.grid_training`,
:mod:`experiments.checkpoints`, :mod:`experiments.evaluation`); this one
imports none of them. ``config.task`` is the ridge task (:func:`task_spec`,
:class:`elsa.training.TaskSpec`, with its shifts) or a family of
:mod:`elsa.tasks` (:class:`FamilySpec`, options in ``config.task_options``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from elsa import tasks as task_families
from elsa import training
from experiments import distributed

# name -> switches of training.init_model.
MODELS = {"elsa_trained": dict(use_bias=True, residual=False,
                               context_only=False),
          "lsa_trained": dict(use_bias=False, residual=False,
                              context_only=False),
          "lsa_residual_trained": dict(use_bias=False, residual=True,
                                       context_only=True),
          "elsa_masked": dict(use_bias=True, residual=False,
                              context_only=True)}
BASELINES = ("bayes_optimal", "gd_best_eta", "elsa_constructed_gd", "ridge",
             "least_squares", "zero")
# config.dtype's choices: the models, training batches and test tasks alike.
DTYPES = ("float32", "float64")
# config.task: today's ridge task (training.TaskSpec, with its shifts), or a
# family of elsa.tasks (with config.task_options).
DEFAULT_TASK = "ridge"
# What a shift (``config.shifts.NAME``) may set: the tasks' distribution,
# never their shape.
SHIFT_FIELDS = ("x_scale", "w_scale", "x_skew", "x_dist", "noise_labels")


def dtype(config) -> jnp.dtype:
  """The run's float dtype, ``config.dtype`` (float32 when a config written
  before the field existed has none)."""
  return jnp.dtype(config.get("dtype", "float32"))


def task_spec(config, **shift) -> training.TaskSpec:
  """The config's ridge tasks (what the models read, on any family: its
  layout, ``lam`` and noise); a shift's ``x_scale`` multiplies the config's, its
  other fields replace the config's."""
  fields = {"x_dist": config.x_dist, **shift,
            "x_scale": config.x_scale * shift.get("x_scale", 1.0)}
  return training.TaskSpec(n_train=config.n_train, d=config.d,
                           n_query=config.n_query, lam=config.lam,
                           noise=config.noise, tokens=config.tokens, **fields)


@dataclasses.dataclass(frozen=True)
class FamilySpec:
  """A family's prompts as the training code reads them: hashable (a static
  argument), with ``model_tokens()`` and ``n_train`` as
  :class:`elsa.training.TaskSpec` has them, and :meth:`sample`."""

  family: task_families.TaskFamily
  n_train: int
  d: int
  n_query: int
  tokens: str

  def model_tokens(self):
    return training.TaskSpec(n_train=self.n_train, d=self.d,
                             n_query=self.n_query,
                             tokens=self.tokens).model_tokens()

  def sample(self, key, *, batch: int, dtype):
    return self.family.sample(key, batch=batch, n_train=self.n_train,
                              d=self.d, n_query=self.n_query, dtype=dtype)


def task_options(config) -> dict:
  """The family options ``config.task_options`` sets: every one not ``None``
  (the config file lists every family's options, unset, so that
  ``--config.task_options.NAME=VALUE`` overrides one)."""
  return {name: value for name, value in config.task_options.items()
          if value is not None}


def train_spec(config):
  """What the models train on: the ridge :func:`task_spec`, or a :class:`FamilySpec`."""
  if config.task == DEFAULT_TASK:
    return task_spec(config)
  return FamilySpec(task_families.get(config.task, **task_options(config)),
                    n_train=config.n_train, d=config.d,
                    n_query=config.n_query, tokens=config.tokens)


def sample_tasks(config, salt: int, **shift):
  """``config.n_test`` tasks from ``fold_in(key(seed), salt)``: the family's
  prompts, or the ridge tasks under ``shift``."""
  key = jax.random.fold_in(jax.random.key(config.seed), salt)
  if config.task != DEFAULT_TASK:
    return train_spec(config).sample(key, batch=config.n_test,
                                     dtype=dtype(config))
  return training.sample_tasks(key, task_spec(config, **shift),
                               batch=config.n_test, dtype=dtype(config))


def grid(config) -> list[tuple[float, float]]:
  """The tuning grid, ``(learning_rate, init_scale)`` pairs in a fixed order."""
  return list(itertools.product(config.learning_rates, config.init_scales))


def init_model(config, *, name: str, depth: int, init_scale: float, dtype):
  """Model ``name`` of ``depth`` layers at one ``init_scale``."""
  # One key per depth for every model and scale: the random part of the
  # weights is the same draw, only its scale differs.
  key = jax.random.fold_in(jax.random.key(config.seed), depth)
  switches = MODELS[name]
  return training.init_model(
      key, train_spec(config), depth=depth,
      components=config.components,
      inner=config.inner, tied=config.tied, scale=init_scale,
      skip_init=switches["use_bias"] and config.skip_init, dtype=dtype,
      **switches)


def init_grid(config, *, name: str, depth: int) -> training.Split:
  """The split of one model with its ``nnx.Param`` leaves stacked over the grid."""
  # One initialisation per distinct scale: grid points of one scale differ
  # in their learning rate only (eager init is seconds a model at tiny sizes).
  by_scale = {scale: training.split(init_model(
      config, name=name, depth=depth, init_scale=scale, dtype=dtype(config)))
              for scale in dict.fromkeys(config.init_scales)}
  splits = [by_scale[scale] for _, scale in grid(config)]
  params = jax.tree.map(lambda *leaves: jnp.stack(leaves),
                        *(s.params for s in splits))
  return splits[0]._replace(params=params)


@functools.lru_cache(maxsize=None)
def optimizer(*, learning_rate: float, steps: int, warmup_steps: int,
              end_fraction: float, clip_norm: float | None):
  """``training.optimizer``, one object per setting.

  The optimizer is a static argument of the compiled train step: an equal
  object lets a later run in the same process (a notebook, the tests) reuse
  that compilation instead of repeating it. The grid's learning rates are
  traced values in its state, so one object serves the whole grid.
  """
  return training.optimizer(learning_rate=learning_rate, steps=steps,
                            warmup_steps=warmup_steps,
                            end_fraction=end_fraction, clip_norm=clip_norm)


def untrained(config, *, name: str, depth: int, abstract: bool = False):
  """``(split, tx, state, losses)`` before the first step: the grid's stacked
  initial parameters, the optimiser, its state (on the host), and losses
  ``[G, steps]`` of NaN.

  ``abstract``: the split's parameters and the state as
  ``jax.ShapeDtypeStruct`` leaves, nothing drawn (``jax.eval_shape``): the
  target a checkpoint is checked against and restored into. The model's
  other state (a key mask), which no checkpoint holds, is still built, in
  one compilation. Eager initialisation compiles each random draw of each
  new shape, seconds a depth on CPU.
  """
  tx = optimizer(learning_rate=config.learning_rates[0], steps=config.steps,
                 warmup_steps=config.warmup_steps,
                 end_fraction=config.end_fraction, clip_norm=config.clip_norm)

  def init():
    split = init_grid(config, name=name, depth=depth)
    return split, training.grid_init_state(
        split.params, tx,
        learning_rates=jnp.asarray([lr for lr, _ in grid(config)]))
  if abstract:
    split, state = jax.eval_shape(init)
    if jax.tree.leaves(split.rest):
      split = split._replace(rest=jax.jit(lambda: init()[0].rest)())
  else:
    split, state = init()
    state = distributed.to_host(state)
  losses = np.full((len(grid(config)), config.steps), np.nan, dtype(config))
  return split, tx, state, losses


def pick(split: training.Split, index: int) -> training.Split:
  """Grid point ``index`` of a split stacked over the grid."""
  return split._replace(params=jax.tree.map(lambda a: a[index], split.params))
