r"""python -m experiments.benchmark --workdir=runs/benchmark

Speed of the ELSA primitive, of deep stacks, of the sweep's own kernel
(``experiments.sweep.build_measure``) against direct GD, of the training
step against a plain ``jnp.einsum`` reference, of causal ELSA by chunks
against the masked quadratic order, and of the transformer's training step
per attention kind.

``--config=experiments/configs/benchmark.py:tiny`` (or its older name
``quick``) shrinks every part to seconds (what
tests/test_benchmark_driver.py runs). Override any field, e.g.
``--config.tokens='(1024, 4096)' --config.reps=11`` or
``--config.parts='("train",)'``. The default takes a few minutes on 2 quiet
CPU cores (float32 and float64); the same command runs unchanged on a GPU or
TPU. With float64 in ``dtypes`` the run turns on
``jax_enable_x64`` and restores the previous setting after it.
"""

import ml_collections

from experiments import checks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The full benchmark; ``arg == 'tiny'`` (or ``'quick'``) gives tiny sizes
  and few repetitions."""
  arg = checks.variant("benchmark", arg, ("tiny", "quick"))
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Which parts run, in order (experiments.benchmark.PARTS).
  config.parts = ("primitive", "stack", "sweep", "train", "causal",
                  "transformer")
  # Parts 1 and 3 run in each dtype; part 2 (compile time) in the first;
  # parts 4-6 in float32.
  config.dtypes = ("float32", "float64")
  # Timing: `warmup` untimed rounds, then `reps` timed rounds, fewer (but at
  # least `min_reps`) once one case has run `max_case_s`. A round calls each
  # function of a case once, in turn: ratios are medians of per-round ratios.
  config.warmup = 2
  config.reps = 7
  config.min_reps = 3
  config.max_case_s = 10.0

  # Part 1, the primitive: elsa(p, h) for h [m, n] with k = v = n.
  config.tokens = (256, 1024, 4096, 16384, 65536)
  config.widths = (64, 256)
  # The exponent of time against m is fitted on m >= this (smaller m measure
  # call overhead, which flatters the exponent) and on all m.
  config.fit_min_tokens = 4096
  # The quadratic order (Q K^T) V is run only where its compiled temporaries
  # and output fit in this budget; elsewhere it is reported as skipped.
  config.quadratic_budget_gib = 4.0
  # A square matmul of this size: a second, shape-independent rate for context.
  config.square_matmul_size = 2048

  # Part 2, deep stacks: elsa_stack compile and run time against depth.
  config.stack_depths = (10, 100, 1000)
  config.stack_tokens = 256
  config.stack_width = 64
  config.stack_components = 2
  # The same layers as an unrolled Python loop, for contrast (compile time
  # grows with depth there); empty to skip.
  config.unrolled_depths = (10, 40)
  # Compile time is the median of this many compilations.
  config.compile_reps = 3

  # Part 3, the sweep kernel (experiments.sweep.build_measure) on the sweep's
  # flat (lambda, eta, task) batch (experiments.sweep.grid_items), against
  # elsa.ridge.gd on the same items and a square matmul of
  # square_matmul_size. Task shape and depth are the default sweep's
  # (configs/sweep.py).
  config.sweep_form = "designed"
  config.sweep_n_train = 20
  config.sweep_d = 5
  config.sweep_n_query = 4
  config.sweep_noise = 0.1
  config.sweep_depth = 50
  config.sweep_lams = (0.0, 0.1)
  # Step sizes as fractions of each task's stability limit (all < 1: stable).
  config.sweep_eta_fractions = (0.5, 0.9)
  config.sweep_batches = (1, 16, 256)  # tasks per grid point

  # Part 4, the training step on a drawn batch
  # (elsa.training.train_step_on_batch, float32) against a plain jnp.einsum
  # reference of the same model, loss and optax chain, and the draw: von
  # Oswald et al.'s task and model (configs/train.py:vonoswald: masked LSA
  # with the residual, one head, tied weights) at these depths and batch,
  # and the default train config's ELSA stack at its depth and batch.
  config.train_lsa_depths = (1, 2, 3)
  config.train_lsa_batch = 2048
  config.train_elsa_depth = 4
  config.train_elsa_batch = 128

  # Part 5, causal ELSA (float32, k = v = n): by chunks at the default chunk
  # against the masked quadratic order (under quadratic_budget_gib) and
  # non-causal ELSA at each m; then each chunk at causal_chunk_tokens.
  config.causal_tokens = (256, 1024, 4096, 16384)
  config.causal_width = 64
  config.causal_chunk_tokens = 4096
  config.causal_chunks = (16, 32, 64, 128, 256, 512)

  # Part 6, the transformer's training step per attention kind: the
  # prefix_cpu protocol's model (configs/prefix.py: d = 5, width 32, 2
  # blocks of 2 heads, batch 32) on prompts of these many (x, y) pairs
  # (11: that run's; the longer ones show each kind's cost in m).
  config.transformer_points = (11, 128, 1024)
  config.transformer_d = 5
  config.transformer_width = 32
  config.transformer_depth = 2
  config.transformer_heads = 2
  config.transformer_batch = 32

  if arg in ("tiny", "quick"):
    config.warmup = 0
    config.reps = 1
    config.min_reps = 1
    config.max_case_s = 2.0
    config.tokens = (64, 256)
    config.widths = (8,)
    config.fit_min_tokens = 64
    config.quadratic_budget_gib = 0.01
    config.square_matmul_size = 128
    config.stack_depths = (2, 8)
    config.stack_tokens = 16
    config.stack_width = 8
    config.unrolled_depths = (1,)
    config.compile_reps = 1
    config.sweep_n_train = 6
    config.sweep_d = 3
    config.sweep_n_query = 2
    config.sweep_depth = 4
    config.sweep_lams = (0.1,)
    config.sweep_batches = (4,)
    config.train_lsa_depths = (1,)
    config.train_lsa_batch = 32
    config.train_elsa_depth = 1
    config.train_elsa_batch = 16
    config.causal_tokens = (64, 100)
    config.causal_width = 8
    config.causal_chunk_tokens = 100
    config.causal_chunks = (16, 64)
    config.transformer_points = (4,)
    config.transformer_width = 8
    config.transformer_depth = 1
    config.transformer_batch = 4
  return config
