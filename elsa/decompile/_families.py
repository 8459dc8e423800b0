"""The families: parameterised algorithms of :mod:`elsa.algorithms` (and two
written here, with a block input or a data transform), each evaluated through
the reference interpreter :func:`elsa.programs.run`."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elsa import algorithms, programs, ridge
from elsa.attention import Array

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

  def start(self, key: Array, mu: Array, d: int, loops: int,
            step: Array | float = 1.0) -> Array:
    """A random unconstrained start ``u``.

    ``step``: the step size the data suggest, in units of ``1 / mu``. A
    positive ``"step"`` parameter's log-uniform range ``init`` is moved by
    the factor that makes it contain ``step`` where it lies outside (a
    non-positive or non-finite ``step`` moves nothing): Levenberg–Marquardt
    in ``u = log(value)`` moves about one unit of ``u`` per step when far
    above the target, so from ``init`` alone a step of ``1e-8 / mu`` is
    out of reach of its default 20 steps.
    """
    low, high = self.init
    shape = self._shape(d, loops)
    k_level, k_jitter = jax.random.split(key)
    if self.positive:
      level = jax.random.uniform(k_level, (), mu.dtype, math.log(low),
                                 math.log(high))
      if self.unit == "step":
        step = jnp.asarray(step, mu.dtype)
        usable = jnp.isfinite(step) & (step > 0)
        step = jnp.where(usable, step, 1.0)
        level += jnp.where(usable, jnp.log(step / jnp.clip(step, low, high)),
                           0.0)
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
    ridge strength of ``A = X^T X / N + lam I`` (a family with a ``lam``
    parameter runs at its own).
    """
    n_train, d = task.x.shape[-2:]
    lam = jnp.asarray(lam, task.x.dtype)
    prog = _program(self, n_train, d, task.x_query.shape[-2])
    # A family with its own ridge strength (gd_lam) overrides lam.
    scalars = {"lam": lam, **self.run_args(values, loops)}
    out = programs.run(prog, loops=loops, X=task.x, y=task.y[..., None],
                       Xq=task.x_query, **scalars)
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
  return [{"family": "gd_lam", "params": {"eta": eta, "lam": "the tasks'"}},
          {"family": "gd_schedule", "params": {"eta": "constant"}},
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
      Family("gd_lam", "w' = w - eta ((X^T X / N + lam I) w - b), lam fitted",
             (step, Parameter("lam", unit="eigen", init=(0.01, 1.0))),
             algorithms.ridge_gd,
             lambda v, loops: {"eta": v["eta"], "lam": v["lam"]}),
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


# Their order is the order of simplicity that decides exact ties (fits equal
# to rounding, e.g. every converged solver of the closed-form ridge
# predictor): plain GD first, then GD with one more freedom (its own ridge
# strength, a schedule, a preconditioner, a data transform, momentum), then
# the higher-order methods.
FAMILIES: dict[str, Family] = _families()
