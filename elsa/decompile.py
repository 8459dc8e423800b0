r"""Which algorithm did a stack compute? The inverse of :func:`elsa.programs.compile`.

A *model* is a jax-traceable callable ``task -> predictions`` on a batch of
ridge tasks (:class:`elsa.ridge.Task`: ``x [B, N, d]``, ``y [B, N]``,
``x_query [B, Q, d]``), returning the final query predictions ``[B, Q]`` or
the prediction after every layer ``[S, B, Q]`` (row 0 the state before the
first layer, never compared: a trained stack's is its input, a compiled one's
its set-up). :func:`from_model` and :func:`from_compiled` make models of what
the library builds.

A *family* (:data:`FAMILIES`) is a parameterised algorithm: a matrix program
(those of :mod:`elsa.algorithms`, and two written here with a block input or a
data transform) with free parameters (step sizes, momentum, a schedule, a
preconditioner, GD++'s data transform), each with its transform (``exp`` for
the positive ones). Its predictions are those of the reference interpreter
:func:`elsa.programs.run`, so fitting differentiates through the program
itself. With ``k`` iterations per layer, model layer ``l`` (row ``l``) is held
against the family's iterate ``k l`` (or the cumulative counts of a per-layer
tuple).

:func:`fit` finds the family's parameters that make its predictions match the
model's at every exposed layer: the pooled relative squared error

.. math::
  D(\theta) = \frac{\sum_{l, b, q} (f_{lbq}(\theta) - g_{lbq})^2}
                   {\sum_{l, b, q} g_{lbq}^2},

``f`` the family's, ``g`` the model's predictions, minimised by Adam (optax)
from ``restarts`` random starts at once (``vmap``), then Levenberg–Marquardt on
the residuals, jit-compiled once per family and iteration count.
:func:`identify` fits every family and ranks them on HELD-OUT tasks by
``D``, reporting for each the squared prediction difference (SPD), the
implicit linear weight difference (ILWD: ``w`` least-squares fitted to the
predictions on probe queries, Akyürek et al. 2023), the cosine and relative L2
distance of the input sensitivities ``d pred / d x_q`` (von Oswald et al.
2023), each with its standard error over tasks; ``best`` is the simplest family
(fewest free parameters) within ``tol``, ties and exact equivalences reported.
:func:`similarity` is Fu et al. (2023)'s layer x iteration cosine map;
:func:`weight_structure` Ahn et al. (2023)'s distance of the trained blocks
from a scaled identity.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax

from elsa import _validate, algorithms, nn, programs, ridge, training
from elsa.attention import Array, ElsaParams, elsa_stack

Model = Callable[[ridge.Task], Array]

# --- families -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parameter:
  """A free parameter of a family.

  Attributes:
    name: its name in :attr:`Fit.params`.
    kind: ``"scalar"`` ``[]``, ``"schedule"`` ``[loops]`` (one per iteration),
      ``"vector"`` ``[d]``, ``"symmetric"`` ``[d, d]`` (``d (d + 1) / 2``
      free entries).
    positive: ``value = exp(u)`` (else ``u``), times ``unit``.
    unit: ``"step"`` (``1 / mu``), ``"eigen"`` (``mu``) or ``"one"``, with
      ``mu`` the mean largest eigenvalue of ``A`` on the fit tasks: the
      optimiser's variable ``u`` is O(1) whatever the data scale.
    init: ``(low, high)`` of the random start of ``value / unit``
      (log-uniform if positive).
  """

  name: str
  kind: str = "scalar"
  positive: bool = True
  unit: str = "step"
  init: tuple[float, float] = (0.05, 1.5)

  def size(self, d: int, loops: int) -> int:
    return {"scalar": 1, "schedule": loops, "vector": d,
            "symmetric": d * (d + 1) // 2}[self.kind]

  def _shape(self, d: int, loops: int) -> tuple[int, ...]:
    return () if self.kind == "scalar" else (self.size(d, loops),)

  def _scale(self, mu: Array) -> Array:
    return {"step": 1 / mu, "eigen": mu, "one": jnp.ones_like(mu)}[self.unit]

  def start(self, key: Array, mu: Array, d: int, loops: int) -> Array:
    """A random unconstrained start ``u``."""
    low, high = self.init
    shape = self._shape(d, loops)
    k_level, k_jitter = jax.random.split(key)
    if self.positive:
      level = jax.random.uniform(k_level, (), mu.dtype, math.log(low),
                                 math.log(high))
      u = level + 0.1 * jax.random.normal(k_jitter, shape, mu.dtype)
    else:
      u = jax.random.uniform(k_level, (), mu.dtype, low, high) + (
          0.01 * jax.random.normal(k_jitter, shape, mu.dtype))
    if self.kind == "symmetric":  # start at a multiple of I: off-diagonal ~0
      u = jnp.where(_diagonal_of_triangle(d), u, 0.01 * u)
    return jnp.broadcast_to(u, shape)

  def value(self, u: Array, mu: Array, d: int) -> Array:
    v = (jnp.exp(u) if self.positive else u) * self._scale(mu)
    return _symmetric(v, d) if self.kind == "symmetric" else v


def _diagonal_of_triangle(d: int) -> np.ndarray:
  rows, cols = np.triu_indices(d)
  return rows == cols


def _symmetric(v: Array, d: int) -> Array:
  """The symmetric ``[d, d]`` matrix of its upper triangle ``v [d (d + 1) / 2]``."""
  rows, cols = np.triu_indices(d)
  upper = jnp.zeros((d, d), v.dtype).at[rows, cols].set(v)
  return upper + upper.T - jnp.diag(jnp.diag(upper))


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
  """A parameterised algorithm, evaluated through :func:`elsa.programs.run`.

  Attributes:
    name: its key in :data:`FAMILIES`.
    summary: one line of math.
    parameters: the free parameters.
    program: ``(n_train, d, n_query) -> Program`` on the natural tokens
      (inputs ``X``, ``y``, ``Xq``, scalar ``lam``).
    run_args: ``(values, loops) -> {scalar or block: value}`` for ``run``,
      ``values`` the parameters' values by name.
    read: ``"w"`` (predictions ``Xq w`` of the state ``w`` after every
      iteration) or ``"p"`` (the state ``p`` itself).
    derived: ``(values, loops) -> {name: value}`` reported beside the
      parameters (``None``: nothing).
    equivalent: ``(values, steps) -> [description]``: exactly equal
      descriptions, ``steps`` the family's iterate at each compared layer.
  """

  name: str
  summary: str
  parameters: tuple[Parameter, ...]
  program: Callable[[int, int, int], programs.Program]
  run_args: Callable[[dict, int], dict]
  read: str = "w"
  derived: Callable[[dict, int], dict] | None = None
  equivalent: Callable[[dict, Sequence[int]], list] | None = None

  def n_params(self, *, d: int, loops: int) -> int:
    """Free parameters at input dimension ``d`` over ``loops`` iterations."""
    return sum(p.size(d, loops) for p in self.parameters)

  def values(self, u: dict, mu: Array, d: int) -> dict:
    """The parameters' values from the unconstrained ``u`` (by name)."""
    return {p.name: p.value(u[p.name], mu, d) for p in self.parameters}

  def predict(self, values: dict, task: ridge.Task, *, loops: int, lam
              ) -> Array:
    """The family's query predictions after iterations ``0..loops``: ``[loops + 1, B, Q]``.

    ``values``: the parameters by name (a schedule ``[loops]``); ``lam``: the
    ridge strength of ``A = X^T X / N + lam I``.
    """
    n_train, d = task.x.shape[-2:]
    lam = jnp.asarray(lam, task.x.dtype)
    prog = _program(self, n_train, d, task.x_query.shape[-2])
    out = programs.run(prog, loops=loops, X=task.x, y=task.y[..., None],
                       Xq=task.x_query, lam=lam, **self.run_args(values, loops))
    if self.read == "p":
      return out["p"][-(loops + 1):, ..., 0]
    # The last layer is the read-out, which leaves w as it is.
    w = out["w"][-(loops + 2):-1, ..., 0]
    return jnp.einsum("...qd,t...d->t...q", task.x_query, w,
                      precision="highest")


@functools.lru_cache(maxsize=None)
def _program(family: Family, n_train: int, d: int, n_query: int
             ) -> programs.Program:
  return family.program(n_train=n_train, d=d, n_query=n_query)


def preconditioned_gd_program(*, n_train: int, d: int, n_query: int = 1
                              ) -> programs.Program:
  r""":func:`elsa.algorithms.preconditioned_gd` with ``P`` an input block, not a constant.

  ``w' = w - P (A w - b)`` (the step size folded into ``P``), so that ``P``
  can be traced and differentiated; the same terms as the library program
  (``XP = X P`` a set-up state). Scalars: ``lam``; inputs ``X``, ``y``,
  ``Xq``, ``P [d, d]``.
  """
  prog = programs.Program()
  X = prog.input("X", (n_train, d), at=(range(n_train), range(d)))
  y = prog.input("y", (n_train, 1), at=(range(n_train), range(d, d + 1)))
  Xq = prog.input("Xq", (n_query, d),
                  at=(range(n_train, n_train + n_query), range(d)))
  P = prog.input("P", (d, d))
  w = prog.state("w", (d, 1))
  r = prog.state("r", (n_train, 1), init=y)
  XP = prog.state("XP", (n_train, d), init=X @ P)
  lam = prog.scalar("lam")
  prog.loop({w: w - lam * (P @ w) + (1 / n_train) * (P @ X.T @ r),
             r: r + lam * (XP @ w) - (1 / n_train) * (XP @ X.T @ r)})
  p = prog.state("p", (n_query, 1))
  prog.layer({p: Xq @ w})
  return prog


def gd_plus_plus_program(*, n_train: int, d: int, n_query: int = 1
                         ) -> programs.Program:
  r"""GD++ (von Oswald et al. 2023): a GD step on the labels and a curvature step on the inputs.

  Every layer, from the old values (``X_0 = X``, ``r_0 = y``, ``p_0 = 0``):

  .. math::
    r' = (1 - \eta\lambda) r + \eta\lambda y - \tfrac{\eta}{N} X_t X_t^\top r,
    \qquad p' = (1 - \eta\lambda) p + \tfrac{\eta}{N} X_{q,t} X_t^\top r,

  .. math::
    X_{t+1} = X_t (I - \tfrac{\gamma}{N} X_t^\top X_t), \qquad
    X_{q,t+1} = X_{q,t} (I - \tfrac{\gamma}{N} X_t^\top X_t).

  With ``gamma = 0`` it is :func:`elsa.algorithms.ridge_gd` exactly (``p =
  Xq w``). Every term is one ELSA component (``programs.compile`` accepts it).
  Scalars: ``lam``, ``eta``, ``gamma``.
  """
  prog = programs.Program()
  X = prog.input("X", (n_train, d), at=(range(n_train), range(d)))
  y = prog.input("y", (n_train, 1), at=(range(n_train), range(d, d + 1)))
  Xq = prog.input("Xq", (n_query, d),
                  at=(range(n_train, n_train + n_query), range(d)))
  Xt = prog.state("Xt", (n_train, d), init=X)
  Xqt = prog.state("Xqt", (n_query, d), init=Xq)
  r = prog.state("r", (n_train, 1), init=y)
  p = prog.state("p", (n_query, 1))
  lam, eta, gamma = (prog.scalar(s) for s in ("lam", "eta", "gamma"))
  prog.loop({
      r: (1 - eta * lam) * r + (eta * lam) * y - (eta / n_train) * (
          Xt @ Xt.T @ r),
      p: (1 - eta * lam) * p + (eta / n_train) * (Xqt @ Xt.T @ r),
      Xt: Xt - (gamma / n_train) * (Xt @ Xt.T @ Xt),
      Xqt: Xqt - (gamma / n_train) * (Xqt @ Xt.T @ Xt)})
  return prog


def _gd_steps(power: Callable[[int], int]):
  """``equivalent`` of a family whose iterate ``t`` is GD step ``power(t)`` at ``eta = alpha``."""
  def equivalent(values, steps):
    return [{"family": "gd", "params": {"eta": values["alpha"]},
             "gd_steps": [power(int(t)) for t in steps]}]
  return equivalent


def _gd_nestings(values, steps):
  eta = values["eta"]
  return [{"family": "gd_schedule", "params": {"eta": "constant"}},
          {"family": "heavy_ball", "params": {"eta": eta, "beta": 0.0}},
          {"family": "nesterov", "params": {"eta": eta, "beta": 0.0}},
          {"family": "gd_plus_plus", "params": {"eta": eta, "gamma": 0.0}},
          {"family": "preconditioned_gd", "params": {"P": "eta I"}}]


def _chebyshev_schedule(values, loops):
  eta, beta = algorithms.chebyshev_schedule(values["mu_min"],
                                            values["mu_min"] + values["mu_gap"],
                                            loops)
  return {"eta": eta, "beta": beta}


def _families() -> dict[str, Family]:
  step = Parameter("eta")
  momentum = Parameter("beta", positive=False, unit="one", init=(0.0, 0.9))
  alpha = Parameter("alpha")
  gd_args = lambda v, loops: {"eta": v["eta"]}
  momentum_args = lambda v, loops: {"eta": v["eta"], "beta": v["beta"]}
  alpha_args = lambda v, loops: {"alpha": v["alpha"]}
  third_residual = functools.partial(algorithms.third_order,
                                     w_update="residual")
  families = [
      Family("gd", "w' = w - eta (A w - b)", (step,), algorithms.ridge_gd,
             gd_args, equivalent=_gd_nestings),
      Family("gd_schedule", "w' = w - eta_t (A w - b)",
             (Parameter("eta", kind="schedule"),), algorithms.ridge_gd,
             gd_args),
      Family("preconditioned_gd_diag", "w' = w - diag(p) (A w - b)",
             (Parameter("p", kind="vector"),), preconditioned_gd_program,
             lambda v, loops: {"P": jnp.diag(v["p"])}),
      Family("preconditioned_gd", "w' = w - P (A w - b), P symmetric",
             (Parameter("P", kind="symmetric", positive=False),),
             preconditioned_gd_program, lambda v, loops: {"P": v["P"]}),
      Family("gd_plus_plus", "GD on y, X <- X (I - gamma X^T X / N)",
             (step, Parameter("gamma", positive=False, init=(-0.3, 0.3))),
             gd_plus_plus_program,
             lambda v, loops: {"eta": v["eta"], "gamma": v["gamma"]},
             read="p"),
      Family("heavy_ball", "v' = beta v - eta (A w - b), w' = w + v'",
             (step, momentum), algorithms.heavy_ball, momentum_args),
      Family("nesterov", "heavy ball with the gradient at w + beta v",
             (step, momentum), algorithms.nesterov, momentum_args),
      Family("chebyshev", "heavy ball at Chebyshev schedules of [mu_min, "
             "mu_max]",
             (Parameter("mu_min", unit="eigen", init=(0.01, 0.5)),
              Parameter("mu_gap", unit="eigen", init=(0.5, 2.0))),
             algorithms.heavy_ball, _chebyshev_schedule,
             derived=lambda v, loops: {"mu_max": v["mu_min"] + v["mu_gap"]},
             equivalent=lambda v, steps: [{
                 "family": "heavy_ball",
                 "params": _chebyshev_schedule(v, max(int(steps[-1]), 1))}]),
      Family("newton_schulz", "M' = 2M - M A M, w' = w + M (b - A w)",
             (alpha,), algorithms.newton_schulz, alpha_args,
             equivalent=_gd_steps(lambda t: 2 ** t)),
      Family("third_order", "M' = M + M R + M R^2, R' = R^3 (w refined)",
             (alpha,), algorithms.third_order, alpha_args,
             equivalent=_gd_steps(lambda t: (3 ** t + 1) // 2)),
      Family("third_order_residual", "third order, s' = R^2 s (w from s)",
             (alpha,), third_residual, alpha_args,
             equivalent=_gd_steps(lambda t: 3 ** t - 1)),
  ]
  return {f.name: f for f in families}


FAMILIES: dict[str, Family] = _families()

# --- models ---------------------------------------------------------------------


def from_model(model: nn.ElsaStack, spec: training.TaskSpec) -> Model:
  """A trained stack on the tokens of ``spec`` as a model: ``task -> [L + 1, B, Q]``.

  Row ``l`` is the prediction slot decoded after layer ``l``
  (:func:`elsa.training.layer_predictions`; row 0 the input, 0). The tasks are
  cast to the stack's dtype and the predictions back to the tasks'.

  Raises:
    ValueError: the stack's token shape is not ``spec``'s layout's.
  """
  if not isinstance(model, nn.ElsaStack):
    raise TypeError(f"decompile.from_model: model must be an nn.ElsaStack, "
                    f"got {type(model).__name__}.")
  form = spec.model_tokens()
  params = model.to_params()
  if (params.m, params.n) != (form.m, form.n):
    raise ValueError(f"decompile.from_model: the stack reads [m, n] = "
                     f"{[params.m, params.n]} tokens but the {spec.tokens} "
                     f"layout of spec has {[form.m, form.n]}.")
  dtype = params.w1.dtype

  def predict(task: ridge.Task) -> Array:
    cast = task._replace(x=task.x.astype(dtype), y=task.y.astype(dtype),
                         x_query=task.x_query.astype(dtype))
    return training.layer_predictions(model, form, cast).astype(task.x.dtype)
  return predict


def from_compiled(compiled: programs.Compiled, *, loops: int,
                  params: ElsaParams | None = None, **scalars) -> Model:
  """A compiled program's stack as a model: ``task -> [loops + 1, B, Q]``.

  Row ``t`` is ``Xq w`` of the stack's state ``w`` after the set-up and ``t``
  iterations (the state ``p`` itself for programs without ``w``); the last
  row is the stack's own read-out ``p``. For the natural-token programs of
  :mod:`elsa.algorithms` (inputs ``X``, ``y``, ``Xq``).

  Args:
    compiled: from :func:`elsa.programs.compile`.
    loops: iterations (static int >= 1).
    params: the stack's parameters; default ``compiled.params(loops=loops,
      **scalars)`` (pass perturbed ones for a control).
    **scalars: the program's runtime scalars.
  """
  fn = "decompile.from_compiled"
  loops = _validate.int_at_least(fn, "loops", loops, low=1)
  blocks = compiled.program.blocks
  missing = sorted({"X", "y", "Xq", "p"} - set(blocks))
  if missing:
    raise ValueError(f"{fn}: the program lacks the blocks {missing} of the "
                     "natural-token programs (elsa.algorithms).")
  stack = compiled.params(loops=loops, **scalars) if params is None else params
  first = compiled.setup_layers

  def predict(task: ridge.Task) -> Array:
    h0 = compiled.encode(X=task.x, y=task.y[..., None], Xq=task.x_query,
                         dtype=task.x.dtype)
    hs = elsa_stack(stack, h0, return_all=True, precision="highest")
    out = compiled.read(hs[-1], "p")[..., 0]
    iterates = hs[first:first + loops + 1]
    if "w" in blocks:
      rows = jnp.einsum("...qd,t...d->t...q", task.x_query,
                        compiled.read(iterates, "w")[..., 0],
                        precision="highest")
    else:
      rows = compiled.read(iterates, "p")[..., 0]
    return rows.at[-1].set(out)
  return predict


# --- fitting --------------------------------------------------------------------


def _check_task(fn: str, name: str, task) -> None:
  if not isinstance(task, ridge.Task):
    raise TypeError(f"{fn}: {name} must be an elsa.ridge.Task, got "
                    f"{type(task).__name__}.")
  x, y, xq = task.x, task.y, task.x_query
  if (jnp.ndim(x) != 3 or jnp.shape(y) != jnp.shape(x)[:2] or jnp.ndim(xq) != 3
      or jnp.shape(xq)[::2] != jnp.shape(x)[::2]):
    raise ValueError(f"{fn}: {name} must have x [B, N, d], y [B, N], x_query "
                     f"[B, Q, d] (scalar targets); got x {jnp.shape(x)}, y "
                     f"{jnp.shape(y)}, x_query {jnp.shape(xq)}.")
  _validate.floating(fn, f"{name}.x", x)


def _model_rows(fn: str, model: Model, task: ridge.Task) -> Array:
  """The model's compared predictions ``[S, B, Q]`` (layers 1.., or the final only)."""
  B, Q = task.x_query.shape[:2]
  shape = jax.eval_shape(model, task).shape
  if shape == (B, Q):
    return model(task)[None]
  if len(shape) == 3 and shape[1:] == (B, Q) and shape[0] >= 2:
    return model(task)[1:]
  raise ValueError(f"{fn}: the model must return [B, Q] = {[B, Q]} or [S >= 2, "
                   f"B, Q] predictions, got shape {shape}.")


def _steps(fn: str, iterations, layers: int) -> tuple[int, ...]:
  """The family's iterate held against each compared layer (cumulative counts)."""
  if isinstance(iterations, (int, np.integer)) and not isinstance(
      iterations, bool):
    per_layer = (_validate.int_at_least(fn, "iterations", iterations, low=1),
                 ) * layers
  else:
    per_layer = tuple(_validate.int_at_least(fn, "iterations[i]", k, low=1)
                      for k in iterations)
    if len(per_layer) != layers:
      raise ValueError(f"{fn}: iterations must be an int or one int per "
                       f"compared layer ({layers}), got {iterations!r}.")
  return tuple(int(s) for s in np.cumsum(per_layer))


def _mean_top_eigenvalue(task: ridge.Task, lam) -> Array:
  return jnp.mean(algorithms.eigen_bounds(task.x, lam=lam)[1])


# XLA's backend optimisations at level 0: on CPU they halve the compile time
# of a family's fit (3.2 s against 6.2 s) and double its run time (0.9 s
# against 0.4 s), one measurement on 2 shared cores; compiling dominates.
@functools.partial(jax.jit, static_argnames=("family", "loops", "restarts",
                                             "adam_steps", "lm_steps"),
                   compiler_options={"xla_backend_optimization_level": 0})
def _fit_and_judge(family: Family, task: ridge.Task, target: Array,
                   rows: Array, key: Array, lam, test_task: ridge.Task,
                   probes: Array, *, loops: int, restarts: int,
                   adam_steps: int, lm_steps: int):
  """Fits ``family`` from ``restarts`` random starts at each candidate
  alignment, and evaluates the best fit on the test tasks: one compilation.

  ``target [S, B, Q]``: the model's predictions at the compared layers;
  ``rows [C, S]`` (traced ints): per candidate, the family's iterate held
  against each layer, all ``<= loops``. The candidate with the lowest loss
  (the first within a relative 1e-6 of it) is the fit. Returns ``(values,
  candidate, losses [C], outputs)``, ``outputs`` from :func:`_outputs` on
  ``test_task``.

  Iterates past a candidate's last row may overflow (Newton–Schulz squares
  its residual); the Jacobians are forward-mode, whose tangents of a row
  depend on earlier iterates only, and Adam's NaN gradients are zeroed.
  """
  d = task.x.shape[-1]
  mu = _mean_top_eigenvalue(task, lam)
  scale = jnp.sqrt(jnp.sum(target ** 2))

  def residual(u, rows):
    f = family.predict(family.values(u, mu, d), task, loops=loops, lam=lam)
    return ((f[rows] - target) / scale).ravel()

  def loss(u, rows):
    value = jnp.sum(residual(u, rows) ** 2)
    return jnp.where(jnp.isfinite(value), value, jnp.inf)

  def start(k):
    keys = jax.random.split(k, len(family.parameters))
    return {p.name: p.start(kp, mu, d, loops)
            for p, kp in zip(family.parameters, keys)}

  tx = optax.chain(optax.zero_nans(), optax.clip_by_global_norm(1.0),
                   optax.adam(0.05))

  def adam(u, rows):
    def step(carry, _):
      u, state = carry
      updates, state = tx.update(jax.grad(loss)(u, rows), state, u)
      return (optax.apply_updates(u, updates), state), None
    return jax.lax.scan(step, (u, tx.init(u)), None, length=adam_steps)[0][0]

  def levenberg_marquardt(u, rows):
    # Each step evaluates the residual and its Jacobian at the trial point
    # only (one trace of the program): the trial is accepted if it lowers
    # the loss, and the next trial is proposed from the best point so far.
    flat, unravel = ravel_pytree(u)
    both = lambda v: (residual(unravel(v), rows),) * 2
    linearise = lambda v: jax.jacfwd(both, has_aux=True)(v)[::-1]

    def propose(v, r, jac, damping):
      gram = jac.T @ jac
      lhs = gram + damping * (jnp.diag(jnp.diag(gram)) + 1e-12 * jnp.eye(
          v.size, dtype=v.dtype))
      return v - jnp.linalg.solve(lhs, jac.T @ r)

    def step(carry, _):
      best, r_best, jac_best, damping, trial = carry
      r, jac = linearise(trial)
      current, new = jnp.sum(r_best ** 2), jnp.sum(r ** 2)
      better = jnp.isfinite(new) & (new < current)
      pick = lambda a, b: jnp.where(better, a, b)
      best, r_best, jac_best = (pick(trial, best), pick(r, r_best),
                                pick(jac, jac_best))
      damping = pick(damping / 3, damping * 4)
      return (best, r_best, jac_best, damping,
              propose(best, r_best, jac_best, damping)), None
    size = math.prod(target.shape)
    # The start is the first trial: an infinite "best" accepts it.
    carry = (flat, jnp.full((size,), jnp.inf, flat.dtype),
             jnp.zeros((size, flat.size), flat.dtype),
             jnp.asarray(3e-3, flat.dtype), flat)
    return unravel(jax.lax.scan(step, carry, None, length=lm_steps)[0][0])

  def one(k, rows):
    u = levenberg_marquardt(adam(start(k), rows), rows)
    return u, loss(u, rows)

  keys = jax.random.split(key, restarts)
  per_candidate = lambda rows: jax.vmap(lambda k: one(k, rows))(keys)
  u, losses = jax.vmap(per_candidate)(rows)
  restart = jnp.argmin(losses, axis=1)
  per_candidate = jnp.min(losses, axis=1)
  candidate = jnp.argmax(per_candidate <= jnp.min(per_candidate) * (1 + 1e-6))
  u = jax.tree.map(lambda a: a[candidate, restart[candidate]], u)
  values = family.values(u, mu, d)
  return (values, candidate, per_candidate,
          _outputs(family, values, test_task, probes, rows[candidate], lam,
                   loops=loops))


def _outputs(family: Family, values: dict, task: ridge.Task, probes: Array,
             rows: Array, lam, *, loops: int):
  """The family's predictions at ``rows`` ``[S, B, Q]``, the sensitivity of
  its last row ``[B, Q, d]`` (forward-mode, per task) and that row's
  predictions on the probe queries ``[K, B, Q]``."""
  final = lambda t: family.predict(values, t, loops=loops, lam=lam)[rows[-1]]
  one_task = lambda t: jax.jacfwd(
      lambda xq: jnp.sum(final(t._replace(x_query=xq))))(t.x_query)
  return (family.predict(values, task, loops=loops, lam=lam)[rows],
          jax.vmap(one_task)(task),
          jax.vmap(lambda xq: final(task._replace(x_query=xq)))(probes))


@dataclasses.dataclass(frozen=True)
class Fit:
  """A family fitted to a model.

  Attributes:
    family: the family's name.
    iterations: the family's iterations per compared layer of the model.
    params: ``{name: numpy array}``, the fitted values (and derived ones).
    disagreement: ``D`` on the evaluation tasks (held-out in
      :func:`identify`): pooled relative squared prediction error over the
      compared layers.
    equivalent: exactly equal descriptions (other families, parameters, GD
      steps); empty if none.
    metrics: ``disagreement_se``, ``disagreement_per_layer``,
      ``final_disagreement``, ``fit_disagreement`` (on the fit tasks),
      ``spd``, ``ilwd``, ``sensitivity_cosine``, ``sensitivity_l2`` (each
      with ``_se``, the standard error over tasks), ``n_params``.
    lam: the ridge strength the family ran at.
  """

  family: str
  iterations: tuple[int, ...]
  params: dict[str, np.ndarray]
  disagreement: float
  equivalent: tuple[dict, ...]
  metrics: dict[str, Any]
  lam: float

  @property
  def n_params(self) -> int:
    return self.metrics["n_params"]

  def predict(self, task: ridge.Task, *, loops: int | None = None) -> Array:
    """The fitted family's iterates ``[loops + 1, B, Q]`` on ``task``
    (default: as many as the fit compared; a schedule is only that long)."""
    loops = int(np.sum(self.iterations)) if loops is None else loops
    family = FAMILIES[self.family]
    values = {p.name: jnp.asarray(self.params[p.name], task.x.dtype)
              for p in family.parameters}
    return family.predict(values, task, loops=loops, lam=self.lam)

  def as_dict(self) -> dict:
    """JSON-ready (arrays as lists)."""
    return _plain(dataclasses.asdict(self))


def _plain(obj):
  if isinstance(obj, dict):
    return {str(k): _plain(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_plain(v) for v in obj]
  if isinstance(obj, (np.ndarray, jax.Array, np.generic)):
    return np.asarray(obj).tolist()
  return obj


def _probes(key: Array, task: ridge.Task) -> Array:
  """Probe queries ``[K, B, Q, d]``, ``K Q >= 2 d``, with the inputs' RMS scale."""
  B, Q, d = task.x_query.shape
  count = -(-2 * d // Q)
  rms = jnp.sqrt(jnp.mean(task.x ** 2))
  return rms * jax.random.normal(key, (count, B, Q, d), task.x.dtype)


def _implicit_weights(probes: Array, preds: Array) -> np.ndarray:
  """Least-squares ``w [B, d]`` with ``probe^T w ~ pred`` (probes ``[K, B, Q, d]``)."""
  K, B, Q, d = probes.shape
  a = np.moveaxis(np.asarray(probes, np.float64), 0, 1).reshape(B, K * Q, d)
  b = np.moveaxis(np.asarray(preds, np.float64), 0, 1).reshape(B, K * Q)
  return np.stack([np.linalg.lstsq(ai, bi, rcond=None)[0]
                   for ai, bi in zip(a, b)])


@dataclasses.dataclass(frozen=True)
class _Reference:
  """What the model does on the evaluation tasks (computed once per call)."""

  task: ridge.Task
  rows: np.ndarray         # [S, B, Q]
  sensitivity: np.ndarray  # [B, Q, d]
  probes: Array            # [K, B, Q, d]
  weights: np.ndarray      # [B, d]


def _reference(fn: str, model: Model, task: ridge.Task, key: Array
               ) -> _Reference:
  probes = _probes(key, task)

  def outputs(task, probes):
    final = lambda t: _model_rows(fn, model, t)[-1]
    return (_model_rows(fn, model, task),
            training.query_sensitivity(final, task),
            jax.vmap(lambda xq: final(task._replace(x_query=xq)))(probes))
  rows, sens, probe_preds = jax.jit(outputs)(task, probes)
  return _Reference(task, np.asarray(rows, np.float64),
                    np.asarray(sens, np.float64), probes,
                    _implicit_weights(probes, probe_preds))


def _stat(per_task: np.ndarray) -> tuple[float, float]:
  return (float(per_task.mean()),
          float(per_task.std(ddof=1) / np.sqrt(per_task.size))
          if per_task.size > 1 else float("nan"))


def _judge(outputs, ref: _Reference) -> dict:
  """Every metric of a fitted family's ``outputs`` against the model on ``ref``'s tasks."""
  f, sens, probe_preds = (np.asarray(a, np.float64) for a in outputs)
  g = ref.rows
  per_task = np.mean((f - g) ** 2, axis=(0, 2)) / np.mean(g ** 2)
  out = {}
  out["disagreement"], out["disagreement_se"] = _stat(per_task)
  out["disagreement_per_layer"] = (np.mean((f - g) ** 2, axis=(1, 2)) /
                                   np.mean(g ** 2, axis=(1, 2))).tolist()
  out["final_disagreement"] = out["disagreement_per_layer"][-1]
  out["spd"], out["spd_se"] = _stat(np.mean((f[-1] - g[-1]) ** 2, axis=-1))
  w = _implicit_weights(ref.probes, probe_preds)
  out["ilwd"], out["ilwd_se"] = _stat(np.sum((w - ref.weights) ** 2, axis=-1))
  cos, rel = training.sensitivity_agreement(sens, ref.sensitivity)
  out["sensitivity_cosine"], out["sensitivity_cosine_se"] = _stat(
      np.asarray(cos))
  out["sensitivity_l2"], out["sensitivity_l2_se"] = _stat(np.asarray(rel))
  return out


def _fit_family(family: Family, model_rows: Array, fit_task: ridge.Task,
                candidates: list[tuple[int, ...]], ref: _Reference, *, lam,
                key, restarts: int, adam_steps: int, lm_steps: int) -> Fit:
  """``family`` fitted at every candidate alignment, judged on ``ref``."""
  loops, d = max(c[-1] for c in candidates), fit_task.x.shape[-1]
  dtype = fit_task.x.dtype
  values, pick, losses, outputs = _fit_and_judge(
      family, fit_task, model_rows, jnp.asarray(candidates), key,
      jnp.asarray(lam, dtype), ref.task._replace(
          x=ref.task.x.astype(dtype), y=ref.task.y.astype(dtype),
          x_query=ref.task.x_query.astype(dtype)),
      ref.probes.astype(dtype), loops=loops, restarts=restarts,
      adam_steps=adam_steps, lm_steps=lm_steps)
  steps = candidates[int(pick)]
  metrics = _judge(outputs, ref)
  disagreement = metrics.pop("disagreement")
  metrics["fit_disagreement"] = float(losses[int(pick)])
  metrics["n_params"] = family.n_params(d=d, loops=steps[-1])
  plain = {p.name: np.asarray(values[p.name])[:steps[-1]]
           if p.kind == "schedule" else np.asarray(values[p.name])
           for p in family.parameters}
  if family.derived is not None:
    plain.update({k: np.asarray(v)
                  for k, v in family.derived(values, steps[-1]).items()})
  equivalent = () if family.equivalent is None else tuple(
      _plain(family.equivalent(plain, steps)))
  per_layer = tuple(int(s) for s in np.diff((0,) + steps))
  return Fit(family.name, per_layer, plain, disagreement, equivalent, metrics,
             float(lam))


def fit(model: Model, family: Family, fit_tasks: ridge.Task, *,
        iterations=1, test_tasks: ridge.Task | None = None, lam=0.0,
        key: Array | None = None, restarts: int = 8, adam_steps: int = 200,
        lm_steps: int = 30) -> Fit:
  """``family``'s parameters that reproduce ``model``'s predictions at every compared layer.

  Args:
    model: ``task -> [B, Q]`` or ``[S, B, Q]`` (rows ``1..S-1`` compared).
    family: an entry of :data:`FAMILIES`.
    fit_tasks: the tasks the parameters are fitted on.
    iterations: the family's iterations per compared layer: an int (the same
      for every layer) or one int per layer; for a final-only model, the
      total.
    test_tasks: the tasks the returned metrics are measured on (default the
      fit tasks: then nothing is held out).
    lam: the ridge strength the family runs at.
    key: of the random starts (default ``jax.random.key(0)``).
    restarts, adam_steps, lm_steps: random starts (vmapped), Adam steps, then
      Levenberg–Marquardt steps.

  Returns:
    the :class:`Fit`, its metrics on ``test_tasks``.
  """
  fn = "decompile.fit"
  if not isinstance(family, Family):
    raise TypeError(f"{fn}: family must be a decompile.Family (an entry of "
                    f"FAMILIES), got {type(family).__name__}.")
  _check_task(fn, "fit_tasks", fit_tasks)
  test_tasks = fit_tasks if test_tasks is None else test_tasks
  _check_task(fn, "test_tasks", test_tasks)
  key = jax.random.key(0) if key is None else key
  rows = jax.jit(lambda t: _model_rows(fn, model, t))(fit_tasks)
  steps = _steps(fn, iterations, rows.shape[0])
  ref = _reference(fn, model, test_tasks, jax.random.fold_in(key, 1))
  return _fit_family(family, rows, fit_tasks, [steps], ref, lam=lam, key=key,
                     restarts=restarts, adam_steps=adam_steps,
                     lm_steps=lm_steps)


@dataclasses.dataclass(frozen=True)
class Report:
  """What :func:`identify` found.

  Attributes:
    fits: every family fitted, ranked by held-out disagreement.
    best: the simplest fit (fewest free parameters, then lowest
      disagreement) within ``tol``; ``None``: no family within tolerance.
    ties: names of the other fits within ``tol`` with as few parameters.
    tol: the tolerance on the held-out disagreement.
  """

  fits: tuple[Fit, ...]
  best: Fit | None
  ties: tuple[str, ...]
  tol: float

  def as_dict(self) -> dict:
    return {"best": None if self.best is None else self.best.family,
            "ties": list(self.ties), "tol": self.tol,
            "fits": [f.as_dict() for f in self.fits]}


def identify(model: Model, fit_tasks: ridge.Task, test_tasks: ridge.Task, *,
             families: Sequence[str] | None = None, tol: float = 1e-3,
             lam=0.0, iterations: Sequence = (1, 2), key: Array | None = None,
             restarts: int = 8, adam_steps: int = 200, lm_steps: int = 30
             ) -> Report:
  """Fits every family to ``model`` on ``fit_tasks`` and ranks them on ``test_tasks``.

  Each family is fitted at each candidate of ``iterations`` (an int per
  layer, or a per-layer tuple); the candidate with the lowest fit-task loss is
  the family's (the smaller on a tie). Ranking and ``best`` use only the
  held-out tasks.

  Args:
    model: ``task -> [B, Q]`` or ``[S, B, Q]``.
    fit_tasks, test_tasks: disjoint task batches.
    families: names in :data:`FAMILIES` (default all).
    tol: the largest held-out disagreement ``D`` that counts as the same
      computation (``D`` is a squared relative error: 1e-3 is ~3% RMS).
    lam: the ridge strength the families run at.
    iterations: candidates of the iterations per layer.
    key, restarts, adam_steps, lm_steps: as :func:`fit`.
  """
  fn = "decompile.identify"
  _check_task(fn, "fit_tasks", fit_tasks)
  _check_task(fn, "test_tasks", test_tasks)
  names = list(FAMILIES) if families is None else list(families)
  unknown = sorted(set(names) - set(FAMILIES))
  if unknown or not names:
    raise ValueError(f"{fn}: families must be names of FAMILIES "
                     f"{sorted(FAMILIES)}, got {names}.")
  if not tol > 0:
    raise ValueError(f"{fn}: tol must be > 0, got {tol}.")
  key = jax.random.key(0) if key is None else key
  rows = jax.jit(lambda t: _model_rows(fn, model, t))(fit_tasks)
  candidates = [_steps(fn, k, rows.shape[0]) for k in iterations]
  ref = _reference(fn, model, test_tasks, jax.random.fold_in(key, 1))
  fits = [_fit_family(FAMILIES[name], rows, fit_tasks, candidates, ref,
                      lam=lam, key=key, restarts=restarts,
                      adam_steps=adam_steps, lm_steps=lm_steps)
          for name in names]
  fits.sort(key=lambda f: np.nan_to_num(f.disagreement, nan=np.inf))
  within = [f for f in fits if f.disagreement <= tol]
  if not within:
    return Report(tuple(fits), None, (), tol)
  fewest = min(f.n_params for f in within)
  simplest = [f for f in within if f.n_params == fewest]
  return Report(tuple(fits), simplest[0],
                tuple(f.family for f in simplest[1:]), tol)


# --- analyses -------------------------------------------------------------------


def similarity(layers_predict, reference, tasks: ridge.Task, *,
               target: Array | None = None) -> tuple[np.ndarray, np.ndarray]:
  r"""Fu et al. (2023)'s layer x iteration map: cosine similarity of residuals.

  .. math::
    S_{lt} = \cos\big(f_l - y^\star,\; g_t - y^\star\big),

  ``f_l`` the model's predictions after layer ``l``, ``g_t`` the reference
  algorithm's after iteration ``t``, each flattened over tasks and queries,
  ``y*`` the target (default the reference's last iterate: its converged
  answer, so that the map compares how far each still has to go).

  Args:
    layers_predict: ``task -> [S, B, Q]`` (or the array itself).
    reference: ``task -> [T + 1, B, Q]`` (e.g. :meth:`Fit.predict`,
      :func:`elsa.training.gd_step_predictions`), or the array.
    tasks: the tasks.
    target: ``[B, Q]``.

  Returns:
    ``(map [S, T + 1], argmax [S])``: the best-matching iteration per layer.
  """
  f = np.asarray(layers_predict(tasks) if callable(layers_predict)
                 else layers_predict, np.float64)
  g = np.asarray(reference(tasks) if callable(reference) else reference,
                 np.float64)
  if f.ndim != 3 or g.ndim != 3 or f.shape[1:] != g.shape[1:]:
    raise ValueError(f"decompile.similarity: expected [S, B, Q] and [T + 1, B, "
                     f"Q] predictions, got {f.shape} and {g.shape}.")
  y = g[-1] if target is None else np.asarray(target, np.float64)
  a = (f - y).reshape(f.shape[0], -1)
  b = (g - y).reshape(g.shape[0], -1)
  norm = lambda v: np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-300)
  cos = (a / norm(a)) @ (b / norm(b)).T
  return cos, np.argmax(cos, axis=1)


def weight_structure(model: nn.ElsaStack | ElsaParams, spec: training.TaskSpec
                     ) -> list[list[dict]]:
  r"""Ahn et al. (2023)'s structure of trained LSA blocks, per layer and component.

  An LSA component computes ``h_i -> h_i W_3 W_1^T \sum_j h_j^T h_j W_2``:
  the query-key product ``W_KQ = W_3 W_1^T`` ``[n, n]`` and the value
  projection ``W_PV = W_2`` ``[n, n]``. On both token layouts the inputs sit
  in columns ``0..d-1``; the prediction is written in column ``out`` (``y``
  for the concatenated tokens, ``p`` for the natural ones). GD has
  ``W_KQ[x, x] = c I`` and ``W_PV`` reading ``y`` only; a preconditioner makes
  ``W_KQ[x, x]`` a general matrix; GD++ adds ``W_PV[x, x] = -gamma I``.

  Returns, per layer and component: ``kq_scale`` (``c = tr / d`` of the
  ``x, x`` block), ``kq_identity_distance`` (``||K - c I||_F / ||K||_F``),
  ``pv_xx_scale``, ``pv_xx_identity_distance`` (the same for the ``x, x``
  block of ``W_PV``), ``pv_y_to_out`` (``W_PV[y, out]``) and
  ``pv_x_to_out_norm`` (``||W_PV[x, out]||``, 0 for GD).

  Raises:
    ValueError: the stack has biases (ELSA: bias paths the blocks do not
      show, so the blocks alone are not identifiable) or the wrong shape.
  """
  fn = "decompile.weight_structure"
  if isinstance(model, nn.ElsaStack):
    if model.use_bias:
      raise ValueError(f"{fn}: the stack has biases (ELSA); W_KQ and W_PV "
                       "identify an LSA layer only.")
    params = model.to_params()
  else:
    params = model
    if any(np.any(np.asarray(b) != 0) for b in (params.b1, params.b2,
                                                params.b3)):
      raise ValueError(f"{fn}: the parameters have nonzero biases (ELSA); "
                       "W_KQ and W_PV identify an LSA layer only.")
  form = spec.model_tokens()
  if params.w1.ndim != 4 or params.n != form.n:
    raise ValueError(f"{fn}: expected leaves [L, C, n, k] with n = {form.n}, "
                     f"got w1 {params.w1.shape}.")
  d = spec.d
  out = d if spec.tokens == "concatenated" else form.n - 1  # y, or p
  eye = np.eye(d)

  def scaled_identity(block):
    c = np.trace(block) / d
    size = np.linalg.norm(block)
    return float(c), float(np.linalg.norm(block - c * eye) / size
                           if size > 0 else 0.0)

  layers = []
  w1, w2, w3 = (np.asarray(a, np.float64) for a in (params.w1, params.w2,
                                                    params.w3))
  for l in range(w1.shape[0]):
    comps = []
    for c in range(w1.shape[1]):
      kq = w3[l, c] @ w1[l, c].T
      pv = w2[l, c]
      kq_c, kq_dist = scaled_identity(kq[:d, :d])
      pv_c, pv_dist = scaled_identity(pv[:d, :d])
      comps.append({"kq_scale": kq_c, "kq_identity_distance": kq_dist,
                    "pv_xx_scale": pv_c, "pv_xx_identity_distance": pv_dist,
                    "pv_y_to_out": float(pv[d, out]),
                    "pv_x_to_out_norm": float(np.linalg.norm(pv[:d, out]))})
    layers.append(comps)
  return layers
