r"""python -m experiments.train --workdir=runs/train

In-context training of ELSA, LSA and LSA-with-residual stacks (depths 1, 2, 4)
on ridge regression from the natural tokens, each tuned on validation tasks
over one shared (learning rate x init scale) grid, against the Bayes-optimal
predictor, GD at its validation-chosen step size, the constructed ELSA-GD
stack, ridge and least squares, in distribution and under shifts. A few
minutes on 2 CPU cores (see docs/guides/training.md).

Variants (``--config=experiments/configs/train.py:NAME``):

* ``tiny``: seconds (tests and Colab): depths 1 and 2, 200 steps, two shifts.
* ``grid``: the default with a 3 x 3 grid and 2000 steps (about 5x the
  default's time).
* ``vonoswald``: von Oswald et al. (2023)'s default task as their code draws
  it (d = 10, N = 10, one query, x ~ U(-1/2, 1/2)^d, w ~ N(0, I), no noise;
  their tokens (x_i, y_i) and (x_q, 0); batch 2048, 5000 constant-rate Adam
  steps at 1e-3, weights tied across layers), LSA with the residual only,
  depths 1, 2, 3. Their loss is
  0.5 x MSE; results.json holds MSE (halve it to compare).
* ``tasks``: every family of ``elsa.tasks`` (docs/guides/tasks.md), one
  run per family in ``WORKDIR/<run>`` (``config.task_runs``),
  d = 4, N = 8, 1000 steps x batch 64 at one grid point, every model:
  ``nonzero_mean``, ``mixed_noise``, ``anisotropic`` (kappa 10 and 100,
  fixed basis and re-rotated per prompt) and the field's set (Garg et al.).
  ``python -m experiments.train --config=experiments/configs/train.py:tasks
  --workdir=runs/tasks``; one of its runs alone (the same run, so the
  whole variant then skips it): ``:tasks.nonzero_mean``. Any family on any
  other variant: ``--config.task=NAME``, its options as
  ``--config.task_options.NAME=VALUE`` (e.g. ``--config.task=anisotropic
  --config.task_options.kappa=100``; unset options keep the family's
  defaults).
* ``tasks.tiny``: every run of ``tasks`` at a tiny size (d = 3, N = 6,
  depth 1, 20 steps, 32 test prompts): seconds a family, a minute or so in
  all (tests and a first look).

* ``prefix_cpu``, ``prefix_tiny``, ``field``, ``field.tiny``: the field's
  protocol, a transformer with each attention kind against every family's
  baselines at every prompt length (``experiments/configs/prefix.py``).

``--config.dtype=float64`` runs in float64; it needs JAX's 64-bit mode
(``JAX_ENABLE_X64=1 python -m experiments.train ...``).

Override any field, e.g. ``--config.depths='(1, 2, 4, 8)' --config.steps=4000``.
"""

import dataclasses

import ml_collections

from elsa import tasks as task_families
from experiments import checks
from experiments.configs import prefix


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The default training run, or the variant ``arg`` (``tiny``, ``grid``,
  ``vonoswald``, ``tasks``, ``tasks.tiny``, ``tasks.RUN``: one run of
  ``tasks``, or a protocol variant of :mod:`experiments.configs.prefix`)."""
  if arg in prefix.VARIANTS:
    return prefix.get_config(arg)
  only = None
  if arg and arg.startswith("tasks."):  # one run, or the tiny form, of tasks
    arg, only = "tasks", arg[len("tasks."):]
  arg = checks.variant("train", arg, ("tiny", "grid", "vonoswald", "tasks",
                                      *prefix.VARIANTS))
  config = ml_collections.ConfigDict()
  config.seed = 0
  # The task: "ridge" (the fields below, with shifts) or a family of
  # elsa.tasks (elsa.tasks.FAMILIES) with its options in task_options (the
  # ridge fields noise, x_scale, x_dist and the shifts are then not read;
  # lam is the GD references' ridge strength).
  config.task = "ridge"
  # Every family's options, unset (None: the family's default), so that
  # --config.task_options.kappa=100 sets one.
  config.task_options = task_options()
  # The models, training batches and test tasks: "float32", or "float64"
  # (needs JAX's 64-bit mode: JAX_ENABLE_X64=1).
  config.dtype = "float32"
  # Several runs, one per entry (name -> fields to set, task_options among
  # them), each in WORKDIR/<name>; empty: this config is the one run.
  config.task_runs = ml_collections.ConfigDict()
  # Tasks: y = x^T w + noise, x ~ x_scale * x_dist (unit variance), w ~ N(0, I_d).
  config.n_train = 16
  config.d = 4
  config.n_query = 1
  config.lam = 0.05
  config.noise = 0.3
  config.x_scale = 1.0
  config.x_dist = "normal"
  # The trained models' tokens: "natural" (elsa.forms.Natural, as the
  # constructed ELSA-GD stack) or "concatenated" (von Oswald et al.'s).
  config.tokens = "natural"
  # Models (names of experiments.train.MODELS), each trained at every depth.
  config.models = ("elsa_trained", "lsa_trained", "lsa_residual_trained",
                   "elsa_masked")
  config.depths = (1, 2, 4)
  # Leaves [L, C, ...], inner width k (None: n, as the GD construction).
  config.components = 3
  config.inner = ml_collections.config_dict.placeholder(int)
  config.tied = False
  # ELSA: component 0 of every layer starts at the exact skip h -> h.
  config.skip_init = True
  # Tuning grid, shared by every model: peak learning rate x standard
  # deviation of the random weights and biases. Chosen per model and depth
  # on validation tasks; diverged points are skipped.
  config.learning_rates = (3e-3, 1e-2)
  config.init_scales = (0.03,)
  # Optimiser: Adam, global-norm clipping (None: off), warmup + cosine decay
  # to end_fraction of the peak (1.0 and no warmup: constant).
  config.clip_norm = 1.0
  config.steps = 1000
  config.warmup_steps = 100
  config.end_fraction = 0.01
  config.batch = 128
  config.log_every = 50
  config.checkpoint_every = 250
  config.keep_checkpoints = 2
  # Evaluation: n_test test tasks and as many validation tasks (another key);
  # GD step-size grid, chosen on the validation tasks.
  config.n_test = 4096
  # Tasks per evaluation call (a divisor of n_test): the evaluation runs in
  # chunks, which bounds its memory (the input sensitivities differentiate
  # every model) and keeps XLA:CPU off a deadlock seen on 4096 tasks at once.
  config.eval_chunk = 512
  config.eta_min = 0.02
  config.eta_max = 2.0
  config.eta_grid = 100
  config.shifts = ml_collections.ConfigDict({
      "x_scale_x0_5": {"x_scale": 0.5},
      "x_scale_x2": {"x_scale": 2.0},
      "w_scale_x0_5": {"w_scale": 0.5},
      "w_scale_x2": {"w_scale": 2.0},
      "w_scale_x5": {"w_scale": 5.0},
      "x_skew_1": {"x_skew": 1.0},
      "x_laplace": {"x_dist": "laplace"},
      "x_exponential": {"x_dist": "exponential"},
      "noise_labels": {"noise_labels": True},
  })
  if arg == "tiny":
    config.n_train = 8
    config.d = 2
    config.depths = (1, 2)
    config.steps = 200
    config.warmup_steps = 20
    config.batch = 64
    config.log_every = 20
    config.checkpoint_every = 100
    config.n_test = 256
    config.eta_grid = 20
    config.shifts = ml_collections.ConfigDict({
        "x_scale_x2": {"x_scale": 2.0},
        "x_laplace": {"x_dist": "laplace"},
    })
  elif arg == "grid":
    config.learning_rates = (1e-3, 3e-3, 1e-2)
    config.init_scales = (0.01, 0.03, 0.1)
    config.steps = 2000
  elif arg == "vonoswald":
    config.n_train = 10
    config.d = 10
    config.n_query = 1
    config.lam = 0.0  # their GD is on the unregularised least-squares loss
    config.noise = 0.0
    config.x_scale = 12 ** -0.5  # unit-variance uniform -> U(-1/2, 1/2)
    config.x_dist = "uniform"
    config.tokens = "concatenated"
    config.models = ("lsa_residual_trained",)
    config.depths = (1, 2, 3)
    config.components = 1  # one head
    config.tied = True
    config.learning_rates = (1e-3,)
    # Their init: haiku VarianceScaling(0.002), a truncated normal of
    # standard deviation sqrt(0.002 / 11) / 0.88 = 0.015 (at 0.02 the L = 3
    # stack converges more slowly and is still improving at step 5000).
    config.init_scales = (0.015,)
    config.clip_norm = None
    config.steps = 5000
    config.warmup_steps = 0
    config.end_fraction = 1.0
    config.batch = 2048
    config.log_every = 100
    config.checkpoint_every = 500
    config.n_test = 8192
    config.eta_min = 0.1
    config.eta_max = 8.0
    config.eta_grid = 160
    config.shifts = ml_collections.ConfigDict()
  elif arg == "tasks":
    _tasks_variant(config, only)
  return config


def task_options(**options) -> ml_collections.ConfigDict:
  """Every option of every family of elsa.tasks, ``None`` (the family's
  default) where ``options`` does not set it, each typed as its field."""
  types = {"float": float, "int": int, "bool": bool, "tuple": tuple}
  fields = {field.name: types[str(field.type).split()[0]]
            for family in task_families.FAMILIES.values()
            for field in dataclasses.fields(family)}
  out = ml_collections.ConfigDict({
      name: ml_collections.config_dict.placeholder(kind)
      for name, kind in sorted(fields.items())})
  out.update(options)
  return out


def _tasks_variant(config: ml_collections.ConfigDict, only: str | None
                   ) -> None:
  """Every family of elsa.tasks at a budget of minutes each (see the doc),
  or the run ``only`` alone (the same config, so the whole variant skips
  it once done)."""
  config.n_train = 8
  config.d = 4
  config.lam = 0.0  # GD references on the least-squares loss
  config.steps = 1000
  config.warmup_steps = 100
  config.batch = 64
  config.log_every = 50
  config.checkpoint_every = 500
  # One grid point: 1e-2 diverged at depth 4 (anisotropic, masked ELSA).
  config.learning_rates = (5e-3,)
  config.init_scales = (0.03,)
  config.n_test = 1024
  config.eval_chunk = 512
  config.eta_grid = 40
  config.eta_max = 1.5
  config.shifts = ml_collections.ConfigDict()
  every = ("elsa_trained", "elsa_masked", "lsa_trained",
           "lsa_residual_trained")
  runs = {
      "nonzero_mean": {"task": "nonzero_mean", "models": every},
      "mixed_noise": {"task": "mixed_noise", "models": every},
      "anisotropic_k10": {"task": "anisotropic", "models": every,
                          "task_options": {"kappa": 10.0}},
      "anisotropic_k100": {"task": "anisotropic", "models": every,
                           "task_options": {"kappa": 100.0}},
      # A fresh basis per prompt: no fixed preconditioner can be learned.
      "anisotropic_rotated_k10": {
          "task": "anisotropic", "models": every,
          "task_options": {"kappa": 10.0, "rotate": True}},
      "anisotropic_rotated_k100": {
          "task": "anisotropic", "models": every,
          "task_options": {"kappa": 100.0, "rotate": True}},
  }
  for name in ("linear", "sparse_linear", "noisy_linear",
               "linear_classification", "quadratic", "relu_2nn",
               "decision_tree"):
    runs[name] = {"task": name, "models": every}
  # The scikit-learn networks take ~0.2 s a prompt: fewer test prompts.
  for name in ("quadratic", "relu_2nn"):
    runs[name]["n_test"] = 512
  if only == "tiny":
    _tiny_tasks(config)
    for run in runs.values():
      run.pop("n_test", None)
  elif only is not None:
    if only not in runs:
      raise checks.UnknownVariant(
          f"train config: unknown run {only!r} of 'tasks'; known: "
          f"{', '.join(runs)}, or 'tiny' (every run at a tiny size).")
    runs = {only: runs[only]}
  config.task_runs = ml_collections.ConfigDict(runs)


def _tiny_tasks(config: ml_collections.ConfigDict) -> None:
  """The tasks variant in seconds a family (tests and a first look): d = 3
  (Garg et al.'s sparse k = 3 needs d >= 3), N = 6, depth 1, 20 steps, 32
  test prompts."""
  config.n_train = 6
  config.d = 3
  config.depths = (1,)
  config.steps = 20
  config.warmup_steps = 2
  config.batch = 16
  config.log_every = 10
  config.checkpoint_every = 20
  config.n_test = 32
  config.eval_chunk = 32
  config.eta_grid = 5
