r"""The field's protocol: error against the number of in-context examples, a transformer with each attention kind, tuned, several seeds.

``python -m experiments.train --config=experiments/configs/train.py:prefix_cpu``
runs it (``config.protocol == "prefix"``; the variants are in
``experiments/configs/prefix.py``). For every family of ``config.families``:

1. **References** on the test prompts: every predictor of
   ``family.references`` (the Bayes posterior mean where it exists and Garg
   et al.'s baselines), fitted at each prefix on the first ``i`` examples
   (:func:`elsa.shifts.at_prefix`); at ``i = 0`` every reference predicts 0.
   Those that fit one prompt at a time on the host (Lasso, trees, the L-BFGS
   network: :data:`elsa.tasks.HOST_REFERENCES`) run on the first
   ``host_prompts`` prompts. A reference that is not finite stops the run
   before any training, naming it.
2. **Models**: for each kind of ``config.attention``, one
   :class:`elsa.nn.Transformer` (the same read-in, blocks, MLP and read-out;
   only the attention differs) per (learning rate, seed) of
   ``config.learning_rates x range(config.seeds)``, all trained as one
   compiled program (``vmap`` over the grid, ``lax.scan`` over the steps).
   The loss is Garg et al.'s: at every prefix of interleaved prompts
   (:func:`elsa.training.prefix_predictions`) the squared error divided by
   the family's ``error_scale`` (the cross-entropy where the labels are
   +-1, :func:`training_errors`), averaged over the prompts and the
   positions the curriculum has reached
   (:meth:`elsa.curriculum.Curriculum.mean`). A seed draws its own
   initialisation and its own batches; the learning rates of one seed see
   the same batches.
3. **Tuning**: a (learning rate, seed) whose training or validation loss is
   not finite has **diverged**: counted, reported, never averaged in. The
   kind's learning rate is the one of lowest mean validation loss (the
   training loss on ``n_val`` prompts from their own key) among those where
   no seed diverged (if every one lost a seed: among those that lost the
   fewest).
4. **Test curves**: normalised squared error ``(pred_i - y_i)^2 /
   error_scale`` at ``i = 0..N-1`` examples in context, on ``n_test``
   prompts drawn once and shared by every model and reference (paired). A
   model's curve is the mean over its non-diverged seeds of each seed's mean
   over the prompts, with the standard error over the seeds; a reference's
   curve has the standard error over the prompts. Families with labels +-1
   also get accuracy (``sign(pred) == y``).
5. **Shifts** (Garg et al.'s ``eval.py``, :mod:`elsa.shifts`): on the
   families of ``config.shift_families``, the same trained models and the
   references on prompts from each shifted distribution, curves as above.

Workdir (claimed as every driver claims it): ``config.json``;
``cells/<family>/references.json``; ``cells/<family>/<kind>.json`` (a
trained kind: tuning, test and shifted curves) with its training state in
``cells/<family>/<kind>.npz`` every ``checkpoint_every`` steps, so an
interrupted run resumes at the last checkpoint and recomputes nothing
finished; ``tables/<family>.md``, ``figures/<family>.png`` and
``figures/shifts/<family>_<shift>.png``; ``results.json`` last.
"""

from __future__ import annotations

import functools
import math
import time

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from elsa import curriculum as curricula
from elsa import nn
from elsa import shifts as shift_lib
from elsa import tasks as task_families
from elsa import training
from experiments import checks
from experiments import cli
from experiments import distributed
from experiments import plotting
from experiments import tables
from experiments import workdirs

# Keys of the prompt draws: salts folded into the config's seed.
_INIT, _TRAIN, _VAL, _TEST, _SHIFT = 1, 2, 3, 4, 5


# --- the config --------------------------------------------------------------


def curriculum(config) -> curricula.Curriculum:
  """Garg et al.'s schedules from ``config.dims``/``config.points``, or fixed
  ``d`` and ``n_points`` when ``config.curriculum`` is off."""
  if not config.curriculum:
    return curricula.Curriculum.fixed(d=config.d, n_points=config.n_points)
  return curricula.Curriculum(
      dims=curricula.Schedule(**config.dims.to_dict()),
      points=curricula.Schedule(**config.points.to_dict()))


def _int(low=1):
  return lambda c, f: checks.check_int(c, f, low=low)


FIELDS = {
    "seed": checks.check_seed,
    "dtype": lambda c, f: checks.check_choice(c, f, ("float32",)),
    "families": lambda c, f: checks.check_items(
        c, f, choices=tuple(task_families.FAMILIES)),
    "attention": lambda c, f: checks.check_items(c, f, choices=nn.ATTENTION),
    "d": _int(),
    "n_points": _int(low=2),  # the last point's query needs one example
    "curriculum": lambda c, f: checks.check_choice(c, f, (True, False)),
    **dict.fromkeys(("width", "depth", "heads", "steps", "batch",
                     "log_every", "checkpoint_every", "n_val",
                     "host_prompts"), _int()),
    "seeds": _int(low=2),  # a standard error over seeds needs two
    "n_test": _int(low=2),
    "positions": lambda c, f: checks.check_choice(c, f, (True, False)),
    "learning_rates": lambda c, f: checks.check_items(c, f, low=0,
                                                      low_open=True),
    "warmup_steps": lambda c, f: checks.check_int(c, f, low=0, high=c.steps),
    "clip_norm": lambda c, f: None if c[f] is None else checks.check_float(
        c, f, low=0, low_open=True),
    "shifts": lambda c, f: checks.check_items(
        c, f, choices=tuple(shift_lib.SHIFTS), allow_empty=True),
    "shift_families": lambda c, f: checks.check_items(
        c, f, choices=tuple(n for n in shift_lib.LINEAR_FAMILIES
                            if n in c.families), allow_empty=True),
}


def validate(config: ml_collections.ConfigDict) -> None:
  """Every field in its range, the curriculum consistent with ``d`` and
  ``n_points``, every family able to draw its prompts, and training that
  fits in memory, before the workdir is touched.

  Raises:
    checks.ConfigError: naming the field and what is allowed.
  """
  for field, check in FIELDS.items():
    check(config, field)
  for every in ("log_every", "checkpoint_every"):
    if config.steps % config[every]:
      raise checks.ConfigError(f"config.{every} must divide config.steps "
                               f"({config.steps}), got {config[every]}.")
  if config.checkpoint_every % config.log_every:
    raise checks.ConfigError(
        f"config.log_every must divide config.checkpoint_every "
        f"({config.checkpoint_every}), got {config.log_every}.")
  if jax.process_count() > 1:
    raise checks.ConfigError(
        "the prefix protocol runs in one process (every local device); "
        f"this job has {jax.process_count()}: run it without "
        "--coordinator_address.")
  if config.batch % jax.local_device_count():
    raise checks.ConfigError(
        f"config.batch ({config.batch}) must be a multiple of the "
        f"{jax.local_device_count()} devices it is split over.")
  if config.curriculum:
    try:
      cur = curriculum(config)
    except (TypeError, ValueError) as err:
      raise checks.ConfigError(f"config.dims / config.points: {err}") from None
    if cur.final != (config.d, config.n_points):
      raise checks.ConfigError(
          f"the curriculum must end at config.d and config.n_points "
          f"({config.d}, {config.n_points}), got dims.end, points.end = "
          f"{cur.final}.")
  for name in config.families:
    family = task_families.get(name)
    try:  # the family's own size and memory checks, nothing drawn
      for batch in (config.batch, config.n_test, config.n_val):
        jax.eval_shape(functools.partial(
            family.sample, batch=batch, n_train=config.n_points - 1,
            d=config.d), jax.random.key(0))
    except (TypeError, ValueError) as err:
      raise checks.ConfigError(f"config.families: {name}: {err}") from None
  checks.check_fits(_training_bytes(config), fields=(
      "learning_rates x seeds, batch, n_points, width, depth and heads"))


def _training_bytes(config) -> float:
  """An estimate of one training step's memory, every grid point at once:
  the activations each block keeps for the backward pass (about 16 x width
  per token, the softmax kind's heads x tokens scores besides) and the
  parameters with Adam's two moments."""
  points = len(config.learning_rates) * config.seeds
  tokens = 2 * config.n_points
  per_token = 16 * config.width + config.heads * tokens
  params = 12 * config.width ** 2 + 2 * tokens * config.width
  return 4 * points * config.depth * (
      config.batch * tokens * per_token + 3 * params)


# --- prompts and predictions -------------------------------------------------


def _key(config, *salts) -> jax.Array:
  key = jax.random.key(config.seed)
  for salt in salts:
    key = jax.random.fold_in(key, salt)
  return key


def test_prompts(config, family_name: str, shift: str = "standard", *,
                 batch: int | None = None, salt: int = _TEST):
  """Garg et al.'s prompts of ``n_points`` points for the prefix curves
  (:func:`elsa.shifts.sample` with ``prefix=True``): ``x [B, N-1, d]``,
  ``x_query [B, N, d]``, query ``i`` against the first ``i`` examples. Every
  shift of one family is drawn from the same key (paired inputs); the
  rotation of the covariance shifts is one per evaluation."""
  key = _key(config, salt, sorted(task_families.FAMILIES).index(family_name))
  options = {}
  if shift_lib.SHIFTS[shift].kind in ("half_subspace", "skewed"):
    options["basis_key"] = jax.random.fold_in(key, _SHIFT)
  return shift_lib.sample(family_name, shift, key, prefix=True,
                          batch=config.n_test if batch is None else batch,
                          n_train=config.n_points - 1, d=config.d, **options)


def _points(task) -> tuple[jax.Array, jax.Array]:
  """The ``N`` points of a prefix prompt: its examples and its last query."""
  return (jnp.concatenate([task.x, task.x_query[:, -1:]], axis=1),
          jnp.concatenate([task.y, task.y_query[:, -1:]], axis=1))


def model_predictions(model, task, *, queries_on_prompt: bool) -> jax.Array:
  """``[B, N]``: the model's prediction of query ``i`` from the first ``i``
  examples, for every ``i``. Where every query ``i < N - 1`` is example
  ``i`` itself (``queries_on_prompt``), one causal pass over the prompt reads
  them all; otherwise pass ``i`` puts query ``i`` at point ``i`` (a causal
  model's output there sees only the points before it), one pass per ``i``
  in sequence (``lax.map``: the memory of one)."""
  x, y = _points(task)
  if queries_on_prompt:
    return training.prefix_predictions(model, x, y)
  def at(i):
    xi = jax.lax.dynamic_update_slice_in_dim(
        x, jax.lax.dynamic_slice_in_dim(task.x_query, i, 1, axis=1), i, axis=1)
    return jax.lax.dynamic_index_in_dim(
        training.prefix_predictions(model, xi, y), i, axis=1, keepdims=False)
  return jax.lax.map(at, jnp.arange(x.shape[1])).T


def queries_on_prompt(task) -> bool:
  """Whether query ``i`` is example ``i`` for every ``i < N - 1`` (on the
  host)."""
  n = task.x.shape[1]
  return bool(np.array_equal(np.asarray(task.x_query[:, :n]),
                             np.asarray(task.x)))


def reference_predictions(family, task, *, host_prompts: int
                          ) -> dict[str, np.ndarray]:
  """``{name: [B', N]}``: each reference of ``family`` at every prefix,
  fitted on the first ``i`` examples; host references on the first
  ``host_prompts`` prompts (``B' = host_prompts``). At ``i = 0`` every
  baseline predicts 0, as Garg et al.'s do, but ``bayes`` is the posterior
  mean given no examples: the prior's (``x_q^T mu`` on ``nonzero_mean``)."""
  refs = family.references
  host = {n: f for n, f in refs.items() if n in task_families.HOST_REFERENCES}
  device = jax.jit(lambda t: {n: f(t)[:, 0] for n, f in refs.items()
                              if n not in host})
  small = task._replace(**{k: v[:host_prompts]
                           for k, v in task._asdict().items()})
  n_points = task.x_query.shape[1]
  out = {n: [np.zeros(task.x.shape[0] if n not in host else host_prompts,
                      np.float32)] for n in refs}
  with jax.default_matmul_precision("highest"):
    if "bayes" in refs:
      out["bayes"] = [np.asarray(refs["bayes"](shift_lib.at_prefix(task, 0))
                                 [:, 0])]
    for i in range(1, n_points):
      for n, pred in device(shift_lib.at_prefix(task, i)).items():
        out[n].append(np.asarray(pred))
      for n, f in host.items():
        out[n].append(np.asarray(f(shift_lib.at_prefix(small, i))[:, 0]))
  return {n: np.stack(cols, axis=1) for n, cols in out.items()}


def _curve(errors: np.ndarray) -> dict[str, list]:
  """The mean over the first axis of ``errors [n, N]`` and its standard
  error (NaN for one row)."""
  errors = np.asarray(errors, np.float64)
  n = len(errors)
  se = (errors.std(axis=0, ddof=1) / math.sqrt(n) if n > 1 else
        np.full(errors.shape[1:], np.nan))
  return {"curve": errors.mean(axis=0).tolist(), "se": se.tolist()}


def _scored(family, pred: np.ndarray, task, d: int) -> dict[str, np.ndarray]:
  """Per prompt and prefix: normalised squared error (and accuracy where the
  labels are +-1) of ``pred [..., B', N]`` against the first ``B'`` prompts'
  queries."""
  y = np.asarray(task.y_query[:pred.shape[-2]], np.float64)
  out = {"error": (pred - y) ** 2 / family.error_scale(d)}
  if family.reports_accuracy:
    out["accuracy"] = (np.sign(pred) == y).astype(np.float64)
  return out


def references(config, family_name: str, shift: str = "standard") -> dict:
  """Every reference's curves on the test prompts of ``shift``.

  Raises:
    checks.ConfigError: a reference that is not finite at some prefix.
  """
  family = task_families.get(family_name)
  task = test_prompts(config, family_name, shift)
  out = {}
  for name, pred in reference_predictions(
      family, task, host_prompts=min(config.host_prompts, config.n_test)
  ).items():
    bad = ~np.isfinite(pred).all(axis=0)
    if bad.any():
      raise checks.ConfigError(
          f"{family_name} ({shift}): the reference {name!r} is not finite at "
          f"{int(np.argmax(bad))} examples in context: its figures would "
          "mean nothing. Change the family's options (task_options) or "
          "leave the family out of config.families.")
    out[name] = {metric: {"prompts": len(pred), **_curve(values)}
                 for metric, values in _scored(family, pred, task,
                                               config.d).items()}
  return out


# --- training ----------------------------------------------------------------


def _make_model(config, kind: str):
  return lambda key: nn.Transformer(
      config.d + 1, 1, width=config.width, depth=config.depth,
      heads=config.heads, max_len=2 * config.n_points, attention=kind,
      positions=config.positions, rngs=nnx.Rngs(key))


def grid(config) -> list[tuple[float, int]]:
  """The trained points, ``(learning rate, seed)``, learning-rate major."""
  return [(lr, s) for lr in config.learning_rates for s in range(config.seeds)]


def _optimizer(config) -> optax.GradientTransformation:
  """Adam's direction, clipped; the step (learning rate x warmup) is applied
  per grid point by :func:`_train_chunk`."""
  clip = ([] if config.clip_norm is None else
          [optax.clip_by_global_norm(config.clip_norm)])
  return optax.chain(*clip, optax.scale_by_adam())


def init_state(config, kind: str):
  """``(graphdef, rest, params, opt_state)``: the grid's models, stacked on a
  leading axis (``len(grid(config))``), each seed's own initialisation."""
  make = _make_model(config, kind)
  graphdef, _, rest = nnx.split(make(jax.random.key(0)), nnx.Param, ...)
  seeds = jnp.array([s for _, s in grid(config)])
  keys = jax.vmap(lambda s: jax.random.fold_in(_key(config, _INIT), s))(seeds)
  params = jax.jit(jax.vmap(
      lambda k: nnx.split(make(k), nnx.Param, ...)[1]))(keys)
  return graphdef, rest, params, jax.vmap(_optimizer(config).init)(params)


def training_errors(family, pred, y, d: int):
  """Garg et al.'s training loss at each position, ``[..., N]``: the
  squared error over ``family.error_scale(d)``, or, where the labels are
  +-1, the cross-entropy of ``sigmoid(pred)`` against ``(y + 1) / 2``
  (``log(1 + exp(-y pred))``)."""
  if family.reports_accuracy:
    return jax.nn.softplus(-y * pred)
  return (pred - y) ** 2 / family.error_scale(d)


def _loss(params, x, y, step, *, graphdef, rest, cur, family, d):
  model = nnx.merge(graphdef, params, rest)
  pred = training.prefix_predictions(model, x, y)
  return cur.mean(training_errors(family, pred, y, d), step)


def _train_batch(config, family, cur, key, step):
  """One seed's batch at ``step``: ``N`` points at the final sizes, the
  coordinates the curriculum has not reached zeroed before labelling."""
  d, n = cur.final
  task = family.sample(jax.random.fold_in(key, step), batch=config.batch,
                       n_train=n - 1, d=d, input_mask=cur.input_mask(step))
  return _points(task)


def make_train_chunk(config, family, *, graphdef, rest):
  """The compiled program of ``log_every`` steps for every grid point:
  ``(params, opt_state, step0) -> (params, opt_state, losses [log_every,
  G])``."""
  cur = curriculum(config)
  tx = _optimizer(config)
  loss = functools.partial(_loss, graphdef=graphdef, rest=rest, cur=cur,
                           family=family, d=config.d)
  lrs = jnp.array([lr for lr, _ in grid(config)], jnp.float32)
  seeds = jnp.array([s for _, s in grid(config)])
  data = _key(config, _TRAIN)
  sharding = distributed.batch_sharding()

  def one(params, opt_state, lr, seed, step):
    x, y = _train_batch(config, family, cur, jax.random.fold_in(data, seed),
                        step)
    x, y = sharding(x), sharding(y)
    value, grads = jax.value_and_grad(loss)(params, x, y, step)
    updates, opt_state = tx.update(grads, opt_state, params)
    warm = jnp.minimum(1.0, (step + 1) / max(config.warmup_steps, 1))
    params = optax.apply_updates(
        params, jax.tree.map(lambda u: -lr * warm * u, updates))
    return params, opt_state, value

  @jax.jit
  def chunk(params, opt_state, step0):
    def body(carry, step):
      params, opt_state, value = jax.vmap(one, in_axes=(0, 0, 0, 0, None))(
          *carry, lrs, seeds, step)
      return (params, opt_state), value
    (params, opt_state), losses = jax.lax.scan(
        body, (params, opt_state), step0 + jnp.arange(config.log_every))
    return params, opt_state, losses

  return chunk


def _checkpoint_name(family: str, kind: str) -> str:
  return f"cells/{family}/{kind}.npz"


def train(config, family_name: str, kind: str, wd: workdirs.Workdir,
          progress: cli.Progress):
  """Trains every grid point of ``kind`` on ``family_name``, resuming from
  its checkpoint. Returns ``(graphdef, rest, params, losses [steps, G],
  seconds)``."""
  family = task_families.get(family_name)
  graphdef, rest, params, opt_state = init_state(config, kind)
  leaves, treedef = jax.tree.flatten((params, opt_state))
  name = _checkpoint_name(family_name, kind)
  step, losses = 0, np.zeros((0, len(grid(config))), np.float32)
  saved = wd.read_npz(name)
  if saved is not None:
    stored = [saved.get(f"leaf{i}") for i in range(len(leaves))]
    if any(s is None or s.shape != np.shape(l) for s, l in zip(stored, leaves)):
      raise workdirs.CorruptOutput(
          f"{wd.path(name)!r} does not hold this config's {kind} models; "
          + workdirs.way_out(wd.path(name)))
    params, opt_state = jax.tree.unflatten(
        treedef, [jnp.asarray(s) for s in stored])
    step, losses = int(saved["step"]), saved["losses"]
    progress.resumed(step)
    logging.info("%s/%s: resumed at step %d of %d.", family_name, kind, step,
                 config.steps)
  chunk = make_train_chunk(config, family, graphdef=graphdef, rest=rest)
  start, timed = time.perf_counter(), step
  while step < config.steps:
    params, opt_state, new = chunk(params, opt_state, jnp.int32(step))
    losses = np.concatenate([losses, np.asarray(new)])
    step += config.log_every
    progress.update(config.log_every)
    if step % config.checkpoint_every == 0 and step < config.steps:
      wd.write_npz(name, {"step": np.int64(step), "losses": losses, **{
          f"leaf{i}": np.asarray(l) for i, l in enumerate(
              jax.tree.leaves((params, opt_state)))}})
  seconds = (time.perf_counter() - start) if step > timed else None
  return graphdef, rest, params, losses, seconds


# --- one trained kind: tuning, test and shifted curves -----------------------


def _predict_fn(graphdef, rest, *, on_prompt: bool):
  """``(params [G, ...], task) -> [G, B, N]`` for every grid point."""
  def predict(params, task):
    model = nnx.merge(graphdef, params, rest)
    return model_predictions(model, task, queries_on_prompt=on_prompt)
  return jax.jit(jax.vmap(predict, in_axes=(0, None)))


def choose(config, val_loss: np.ndarray, diverged: np.ndarray) -> int | None:
  """The index into ``config.learning_rates`` of lowest mean validation
  loss over its non-diverged seeds, among the learning rates that lost the
  fewest seeds; ``None`` when every point diverged. ``val_loss`` and
  ``diverged``: ``[learning rates, seeds]``."""
  lost = diverged.sum(axis=1)
  if lost.min() == config.seeds:
    return None
  kept = ~diverged
  means = np.where(kept, val_loss, 0.0).sum(axis=1) / np.maximum(
      kept.sum(axis=1), 1)
  means = np.where(lost == lost.min(), means, np.inf)
  return int(np.argmin(means))


def _model_curves(config, family, predict, params, task, keep: np.ndarray
                  ) -> dict:
  """Curves of the kept seeds (``keep [S]``): the mean over seeds of each
  seed's mean over the prompts, with the standard error over the seeds."""
  pred = np.asarray(predict(params, task), np.float64)[keep]  # [S, B, N]
  out = {}
  for metric, values in _scored(family, pred, task, config.d).items():
    per_seed = values.mean(axis=1)  # [S, N]
    out[metric] = {"seeds": per_seed.tolist(), "n_seeds": len(per_seed),
                   **_curve(per_seed)}
  return out


def evaluate_kind(config, family_name: str, kind: str, graphdef, rest, params,
                  losses: np.ndarray, seconds) -> dict:
  """Tuning, test curves and shifted curves of one trained kind."""
  family = task_families.get(family_name)
  n_lr, n_seeds = len(config.learning_rates), config.seeds
  val = test_prompts(config, family_name, batch=config.n_val, salt=_VAL)
  on = _predict_fn(graphdef, rest, on_prompt=True)
  val_pred = np.asarray(on(params, val), np.float64)
  val_loss = np.asarray(training_errors(
      family, val_pred, np.asarray(val.y_query, np.float64), config.d)).mean(
          axis=(1, 2))
  diverged = ~(np.isfinite(val_loss) & np.isfinite(losses).all(axis=0))
  val_loss, diverged = (a.reshape(n_lr, n_seeds) for a in (val_loss, diverged))
  index = choose(config, val_loss, diverged)
  log = losses.reshape(-1, config.log_every, losses.shape[1]).mean(axis=1)
  result = {"learning_rate": None if index is None else
            config.learning_rates[index],
            "val_loss": val_loss.tolist(), "diverged": diverged.tolist(),
            "n_diverged": int(diverged.sum()), "train_loss": log.T.tolist(),
            "ms_per_step": None if seconds is None else
            1e3 * seconds / config.steps}
  if index is None:
    return result
  keep = ~diverged[index]
  chosen = jax.tree.map(lambda a: a[index * n_seeds:(index + 1) * n_seeds],
                        params)
  shifted = {}
  for shift in ("standard", *(config.shifts if family_name in
                              config.shift_families else ())):
    task = test_prompts(config, family_name, shift)
    predict = _predict_fn(graphdef, rest, on_prompt=queries_on_prompt(task))
    shifted[shift] = _model_curves(config, family, predict, chosen, task, keep)
  result["test"] = shifted.pop("standard")
  result["shifts"] = shifted
  return result


# --- the run -----------------------------------------------------------------


def run(config: ml_collections.ConfigDict, workdir: str, *,
        overwrite: bool = False) -> dict:
  """Runs the protocol (module doc); resumes or skips. Returns
  ``results.json``'s dict."""
  distributed.agree("validate", validate, config)
  with distributed.claim_workdir(workdir, config, overwrite=overwrite) as wd:
    return wd.results(lambda: _run(config, wd), name="train")


def _run(config, wd: workdirs.Workdir) -> dict:
  start = time.perf_counter()
  logging.info("train (prefix protocol): %d families x %d attention kinds, "
               "%d (learning rate, seed) points each, on %d %s device(s)",
               len(config.families), len(config.attention), len(grid(config)),
               jax.local_device_count(), jax.default_backend())
  # Every family's references first: one that is not finite stops the run
  # before any training.
  refs = {}
  for family in config.families:
    shifts = ("standard", *(config.shifts if family in config.shift_families
                            else ()))
    refs[family] = _cached(
        wd, f"cells/{family}/references.json",
        lambda f=family, shifts=shifts: {s: references(config, f, s)
                                         for s in shifts})
  progress = cli.Progress(len(config.families) * len(config.attention)
                          * config.steps, name="train", unit="steps")
  families = {}
  for family in config.families:
    models = {}
    for kind in config.attention:
      def cell(family=family, kind=kind):
        *trained, losses, seconds = train(config, family, kind, wd, progress)
        return evaluate_kind(config, family, kind, *trained, losses, seconds)
      models[kind] = _cached(wd, f"cells/{family}/{kind}.json", cell,
                             progress=progress, steps=config.steps)
      wd.remove(_checkpoint_name(family, kind))  # the cell is done
    scale = task_families.get(family).error_scale(config.d)
    families[family] = {"error_scale": scale, "models": models,
                        "references": refs[family]["standard"],
                        "shifts": {s: {"references": r, "models": {
                            k: m["shifts"][s] for k, m in models.items()
                            if "shifts" in m}}
                                   for s, r in refs[family].items()
                                   if s != "standard"}}
    _report(config, wd, family, families[family])
  return {"protocol": "prefix", "examples": list(range(config.n_points)),
          "grid": [list(p) for p in grid(config)], "families": families,
          "seconds": time.perf_counter() - start}


def _cached(wd: workdirs.Workdir, name: str, compute, *, progress=None,
            steps: int = 0) -> dict:
  """``name``'s JSON if a finished earlier run wrote it, else ``compute()``
  written there."""
  found = wd.read_json(name)
  if found is not None:
    if progress is not None:
      progress.resumed(steps)
    return found
  value = workdirs.finite_or_none(compute())
  wd.write_json(name, value)
  return value


def _report(config, wd: workdirs.Workdir, family: str, result: dict) -> None:
  """The family's tables (logged and in ``tables/<family>.md``) and figures."""
  tuning = {k: {"learning_rate": m["learning_rate"],
                "n_diverged": m["n_diverged"], "points": len(grid(config))}
            for k, m in result["models"].items()}
  sections = {"": ({k: m.get("test", {}) for k, m in result["models"].items()},
                   result["references"])}
  for shift, shifted in result["shifts"].items():
    sections[shift] = (shifted["models"], shifted["references"])
  metrics = ("error", "accuracy") if task_families.get(
      family).reports_accuracy else ("error",)
  parts = []
  for shift, (models, refs) in sections.items():
    for metric in metrics:
      parts.append(f"### {family}{', ' + shift if shift else ''}: {metric} "
                   "against the number of in-context examples\n\n"
                   + tables.prefix_table(models, refs, n_points=config.n_points,
                                         d=config.d, metric=metric,
                                         tuning=tuning))
    name = (f"figures/shifts/{family}_{shift}.png" if shift else
            f"figures/{family}.png")
    wd.save_figure(plotting.error_vs_examples(
        f"{family}{', ' + shift if shift else ''} (d = {config.d})", models,
        refs), name)
  text = "\n\n".join(parts)
  wd.write_text(f"tables/{family}.md", text + "\n")
  logging.info("%s", parts[0])
