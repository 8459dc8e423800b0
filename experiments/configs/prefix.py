r"""python -m experiments.train --config=experiments/configs/train.py:prefix_cpu --workdir=runs/prefix

The field's protocol (``config.protocol = "prefix"``): the variants of
``experiments/configs/train.py`` that run it.

Every family of ``elsa.tasks``; for each, the same transformer
(``elsa.nn.Transformer``) with each attention kind (``elsa``, ``lsa``,
``softmax``), trained on Garg et al.'s interleaved prompts with the
prefix-averaged loss, its learning rate tuned per kind on a validation draw,
several seeds; error against the number of in-context examples for every
model and every reference of the family, and Garg et al.'s shifts on
``linear`` (:mod:`experiments.prefix_protocol`).

Variants (``--config=experiments/configs/train.py:NAME``):

* ``prefix_cpu``: the answer on 2 CPU cores. ``d = 5`` and ``N = 11``
  points (the start of Garg et al.'s curriculum, no curriculum), width 32, 2
  blocks of 2 heads, batch 32, 1500 Adam steps at each of 4 learning rates x
  3 seeds (the 12 trained as one program), 512 test prompts (64 for the
  references that fit one prompt at a time on the host). The steps are what
  fits: the 12 models train at 12.4 steps/s on 2 cores, so 10 families x 3
  kinds x 1500 steps is about 60 minutes of training; with evaluation the
  whole variant took 70 minutes (BUILD_NOTES, "The field's protocol").
* ``prefix_tiny``: the same at about a minute a family on 2 cores (tests
  and a first look).
* ``field``: Garg et al.'s sizes for an accelerator: ``d = 20``, ``N = 41``
  reached by their curriculum (5 -> 20 dimensions, 11 -> 41 points, every
  2000 steps), GPT-2's 12 blocks of 8 heads at width 256 with learned
  positions, batch 64, 500k steps, 4 learning rates x 3 seeds, 1280 test
  prompts. Its cost, from the FLOP count (6 x 9.5-10.3M parameters x 64 x 82
  tokens a step, 12 models, 500k steps: 1.9e18 per family and kind): about
  10 hours per family and kind on one GPU sustaining 50 TFLOP/s in float32,
  30 for the three kinds of one family (``--config.families='("linear",)'``;
  fewer learning rates or seeds divide it).
* ``field.tiny``: its structure (curriculum, positions, shifts) at tiny
  sizes on ``linear`` and ``sparse_linear``, what the tests run.

Override any field, e.g. ``--config.families='("linear",)'
--config.steps=3000``.
"""

import ml_collections

from elsa import nn
from elsa import shifts
from elsa import tasks as task_families

VARIANTS = ("prefix_tiny", "prefix_cpu", "field", "field.tiny")


def _schedule(start: int, end: int, inc: int, interval: int
              ) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(start=start, end=end, inc=inc,
                                        interval=interval))


def get_config(arg: str) -> ml_collections.ConfigDict:
  """The protocol's config for the variant ``arg`` (:data:`VARIANTS`)."""
  config = ml_collections.ConfigDict()
  config.protocol = "prefix"
  config.seed = 0
  config.dtype = "float32"
  # Every family of elsa.tasks, each at its own defaults.
  config.families = tuple(task_families.FAMILIES)
  # Prompts of n_points (x, y) pairs in d dimensions: errors at 0..n_points-1
  # examples in context. Under the curriculum these are its end values.
  config.d = 5
  config.n_points = 11
  # Garg et al.'s curriculum (their names): off, or dims/points schedules
  # ending at d and n_points.
  config.curriculum = False
  config.dims = _schedule(5, 20, 1, 2000)
  config.points = _schedule(11, 41, 2, 2000)
  # The model: elsa.nn.Transformer, the same for every attention kind.
  config.attention = nn.ATTENTION
  config.width = 32
  config.depth = 2
  config.heads = 2
  config.positions = False
  # Training: Adam with a linear warmup, global-norm clipping; every
  # (learning rate, seed) pair trained at once. The learning rate of each
  # kind is the one of lowest mean validation loss over its seeds.
  config.learning_rates = (3e-4, 1e-3, 3e-3, 1e-2)
  config.seeds = 3
  config.steps = 1500
  config.warmup_steps = 100
  config.clip_norm = 1.0
  config.batch = 32
  config.log_every = 100
  # The training state is saved every checkpoint_every steps (a multiple of
  # log_every dividing steps): an interrupted run resumes there.
  config.checkpoint_every = 500
  # Evaluation: validation and test prompts (separate draws); the
  # references that fit one prompt at a time on the host (Lasso, trees, the
  # L-BFGS network) on the first host_prompts test prompts.
  config.n_val = 256
  config.n_test = 512
  config.host_prompts = 64
  # Garg et al.'s evaluation shifts (elsa.shifts), on these families.
  config.shifts = tuple(name for name in shifts.SHIFTS if name != "standard")
  config.shift_families = ("linear",)
  if arg == "prefix_tiny":
    config.families = ("linear", "decision_tree")
    config.d, config.n_points = 3, 6
    config.width, config.depth, config.heads = 8, 1, 2
    config.learning_rates = (1e-3, 1e-2)
    config.seeds = 2
    config.steps, config.warmup_steps, config.log_every = 40, 5, 20
    config.checkpoint_every = 20
    config.batch = 16
    config.n_val, config.n_test, config.host_prompts = 32, 32, 4
    config.shifts = ("scale-x=2", "orthogonal_train_test")
  elif arg in ("field", "field.tiny"):
    config.curriculum = True
    config.d, config.n_points = 20, 41
    config.width, config.depth, config.heads = 256, 12, 8
    config.positions = True
    config.learning_rates = (3e-5, 1e-4, 3e-4, 1e-3)
    config.steps, config.warmup_steps, config.log_every = 500_000, 1000, 1000
    config.checkpoint_every = 10_000
    config.batch = 64
    config.n_val, config.n_test, config.host_prompts = 1280, 1280, 256
    if arg == "field.tiny":
      config.families = ("linear", "sparse_linear")
      config.d, config.n_points = 4, 7
      config.dims = _schedule(2, 4, 1, 10)
      config.points = _schedule(3, 7, 2, 10)
      config.width, config.depth, config.heads = 8, 2, 2
      config.learning_rates = (1e-3, 1e-2)
      config.seeds = 2
      config.steps, config.warmup_steps, config.log_every = 40, 5, 20
      config.checkpoint_every = 20
      config.batch = 16
      config.n_val, config.n_test, config.host_prompts = 32, 32, 4
      config.shifts = ("half_subspace", "noisyLR")
  return config
