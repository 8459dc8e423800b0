r"""The spectral description: a fit-free account of every linear, rotation-equivariant predictor.

A predictor that is linear in ``y``, linear in ``x_q`` and equivariant to
rotations of the inputs is a matrix function of the data (Cayley–Hamilton):

.. math::
  \hat y_q = x_q^\top g(A)\, b, \qquad A = X^\top X / N, \quad b = X^\top y / N,

with ``g`` a polynomial, the *filter*. GD at step ``eta`` on the ridge
objective of strength ``lam`` has ``g_t(\lambda) = (1 - (1 - \eta(\lambda +
lam))^t) / (\lambda + lam)``, ridge itself ``1 / (\lambda + lam)``. Its
*residual polynomial*

.. math::
  r(\lambda) = 1 - (\lambda + lam)\, g(\lambda)

is ``prod_i (1 - eta_i (lambda + lam))`` for GD at a schedule ``eta_i``: its
real roots ``rho_i`` are the steps ``eta_i = 1 / (rho_i + lam)``; complex
roots say that no real GD schedule computes the filter (momentum, Chebyshev
and Newton–Schulz with enough layers have real roots; a trained stack need
not).

:func:`spectral` fits ``g_l`` at every exposed layer ``l`` by linear least
squares on the Krylov features ``x_q^T T_k(\hat A) b`` (``k = 0..K``, ``T_k``
the Chebyshev polynomials of ``A`` scaled from the fit tasks' spectrum range
``[lo, hi]`` to ``[-1, 1]``: a basis whose features stay well conditioned
where ``A^k`` would not), computed through each task's eigendecomposition
``A = V diag(lambda) V^T``. Nothing is iterated or compiled. Extra terms
trained models are known to use, each switchable:

* ``"y_energy"``: ``(y^T y / N) x_q^T T_k(\hat A) b`` (noise-adaptive
  rescaling, Vladymyrov et al. 2024);
* ``"start"``: ``x_q^T T_k(\hat A) c`` with a fitted ``c [d]`` per ``k``
  (a non-zero start, as for non-zero-mean priors);
* ``"query_key"``: ``(x_q^T x_q / N) x_q^T T_k(\hat A) b``, the first-order
  effect of the query's own token among the keys (unmasked layouts).

The *explained-share ladder* gives the held-out ``D`` (pooled relative squared
error, as :func:`elsa.decompile.identify`) of nested descriptions
(:data:`RUNGS`): GD at one step size, one or two steps per layer (``gd``), or
doubling its steps every layer, ``2^l`` after layer ``l`` as Newton–Schulz
(``gd_doubling``); GD at one step and its own ridge strength ``lam > 0``
(``gd_lam``, with ``lam_identified``: whether ``D`` moves with ``lam``); GD
at a schedule (``gd_schedule``); the polynomial (``polynomial``), and with
the extras (``polynomial+extras``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from numpy.polynomial import chebyshev as cheb
from scipy import optimize

from elsa import _validate, ridge
from elsa.decompile import _fitting
from elsa.decompile._models import Model

EXTRAS = ("y_energy", "start", "query_key")
# The explained-share ladder's rungs, from the fewest parameters up.
RUNGS = ("gd", "gd_doubling", "gd_lam", "gd_schedule", "polynomial",
         "polynomial+extras")
# Chebyshev coefficients of g below this fraction of the largest are zero when
# the roots are taken: a layer that computes a lower degree than K fits the
# higher coefficients to rounding, whose roots would be spurious.
TRIM = 1e-9
# Reading a GD schedule off the roots of r: a root of multiplicity m (as
# constant-step GD's r = (1 - eta mu)^t has) splits into a complex cluster of
# relative size eps^(1/m) when the coefficients carry a relative error eps
# (about 0.1 at m = 8). So roots within a radius of CLUSTERS of each other
# (relative) are taken as one root of multiplicity m at their mean (which
# rounding leaves accurate), from the largest radius down; the first reading
# whose product reproduces r to AGREE on the spectrum's range is the schedule
# (distinct roots merged by too large a radius do not reproduce it).
CLUSTERS = (0.0, 0.01, 0.03, 0.1, 0.3)
AGREE = 1e-6


@dataclasses.dataclass(frozen=True)
class _Data:
  """A task batch in the eigenbasis of each task's ``A`` (float64)."""

  evals: np.ndarray     # [B, d]: eigenvalues of A = X^T X / N
  weights: np.ndarray   # [B, Q, d]: (x_q^T v_i)(v_i^T b)
  query: np.ndarray     # [B, Q, d]: x_q^T v_i
  vectors: np.ndarray   # [B, d, d]: v_i in the columns
  y_energy: np.ndarray  # [B]: y^T y / N
  q_energy: np.ndarray  # [B, Q]: x_q^T x_q / N


def _data(task: ridge.Task) -> _Data:
  x, y, xq = (np.asarray(a, np.float64) for a in (task.x, task.y,
                                                    task.x_query))
  n = x.shape[1]
  evals, vectors = np.linalg.eigh(np.einsum("bni,bnj->bij", x, x) / n)
  b = np.einsum("bnd,bn->bd", x, y) / n
  query = np.einsum("bqd,bdi->bqi", xq, vectors)
  weights = query * np.einsum("bdi,bd->bi", vectors, b)[:, None, :]
  return _Data(evals, weights, query, vectors, np.sum(y * y, axis=1) / n,
               np.sum(xq * xq, axis=2) / n)


def _chebyshev_values(s: np.ndarray, degree: int) -> np.ndarray:
  """``T_k(s)`` for ``k = 0..degree``: ``[..., degree + 1]``."""
  out = [np.ones_like(s), s]
  for _ in range(degree - 1):
    out.append(2 * s * out[-1] - out[-2])
  return np.stack(out[:degree + 1], axis=-1)


def _features(data: _Data, lo: float, hi: float, degree: int,
              extras: Sequence[str]) -> tuple[np.ndarray, list[tuple]]:
  """The design matrix ``[B, Q, P]`` and its column groups ``[(name, slice)]``."""
  scaled = (2 * data.evals - (hi + lo)) / (hi - lo)
  T = _chebyshev_values(scaled, degree)                     # [B, d, K + 1]
  krylov = np.einsum("bqi,bik->bqk", data.weights, T)       # [B, Q, K + 1]
  columns, groups, at = [krylov], [("polynomial", degree + 1)], 0
  for name in extras:
    if name == "y_energy":
      columns.append(data.y_energy[:, None, None] * krylov)
    elif name == "query_key":
      columns.append(data.q_energy[..., None] * krylov)
    else:  # start: x_q^T T_k(A) e_j, for every k and coordinate j
      start = np.einsum("bqi,bik,bji->bqkj", data.query, T, data.vectors)
      columns.append(start.reshape(*start.shape[:2], -1))
    groups.append((name, columns[-1].shape[-1]))
  slices = []
  for name, size in groups:
    slices.append((name, slice(at, at + size)))
    at += size
  return np.concatenate(columns, axis=-1), slices


def _disagreement(f: np.ndarray, g: np.ndarray) -> tuple[float, list]:
  """Pooled ``D`` and ``D`` per layer of predictions ``[S, B, Q]``."""
  per_layer = np.mean((f - g) ** 2, axis=(1, 2)) / np.mean(g ** 2, axis=(1, 2))
  return float(np.mean((f - g) ** 2) / np.mean(g ** 2)), per_layer.tolist()


def _gd_filter(mu: np.ndarray, etas: np.ndarray) -> np.ndarray:
  """``(1 - prod_j (1 - eta_j mu)) / mu`` after each step: ``[T, *mu.shape]``."""
  residual = np.cumprod(1 - etas[:, None] * mu.ravel()[None], axis=0)
  return ((1 - residual) / mu.ravel()[None]).reshape(len(etas), *mu.shape)


def _gd_rows(data: _Data, etas, lam, steps: Sequence[int]) -> np.ndarray:
  """GD's predictions after ``steps[l]`` steps (cumulative counts), one row per layer."""
  filt = _gd_filter(data.evals + lam, np.asarray(etas, np.float64))
  return np.einsum("bqi,sbi->sbq", data.weights, filt[np.asarray(steps) - 1])


def _step_counts(rung: str, layers: int) -> list[tuple[int, ...]]:
  """The candidate GD step counts after each layer ``1..layers`` of a rung:
  one or two steps per layer, or doubling (``2^l``: Newton–Schulz's layer
  ``l`` is GD's step ``2^l``)."""
  if rung == "gd_doubling":
    return [tuple(2 ** l for l in range(1, layers + 1))]
  return [tuple(k * l for l in range(1, layers + 1)) for k in (1, 2)]


# gd_lam's ridge strength is identified where D moves with it: the
# derivative of the relative residual in log lam at the fit has norm above
# this. After one GD step from zero lam does not enter at all, and far above
# the spectrum it hardly does (the fit may then run away at no cost in D).
LAM_SEEN = 1e-6


def _fit_gd(fit: _Data, target: np.ndarray, lam: float, hi: float, *,
            counts: Sequence[tuple[int, ...]], free_lam: bool = False,
            schedule: np.ndarray | None = None) -> dict:
  """Least squares over GD's steps (and its ridge strength): ``{eta, lam,
  lam_identified, steps, loss}``, the best over the candidate step ``counts``.

  Constant steps (and ``lam``) start from the best point of a log grid; a
  schedule starts from ``schedule`` (the constant fit); then
  Levenberg–Marquardt on ``log eta`` (and ``log lam``: ``lam > 0``, with no
  upper bound, which would cut off a ``lam`` the data identify).
  """
  scale = np.sqrt(np.sum(target ** 2))
  best = None
  for steps in map(tuple, counts):
    total = steps[-1]

    def residual(v):
      v = np.clip(v, -50, 50)  # exp stays finite; such steps lose anyway
      etas = (np.exp(v[:total]) if schedule is not None
              else np.full(total, np.exp(v[0])))
      lam_v = np.exp(v[-1]) if free_lam else lam
      with np.errstate(all="ignore"):
        r = ((_gd_rows(fit, etas, lam_v, steps) - target) / scale).ravel()
      return np.where(np.isfinite(r), r, 1e10)

    if schedule is not None:
      if schedule.size != total:
        continue
      v0 = np.log(schedule)
    else:
      lams = np.geomspace(1e-3, 10, 9) * hi if free_lam else [lam]
      grid = [np.asarray([np.log(f / (hi + l))] + (
          [np.log(l)] if free_lam else [])) for f in np.geomspace(0.05, 1.9, 12)
              for l in lams]
      v0 = min(grid, key=lambda v: np.sum(residual(v) ** 2))
    sol = optimize.least_squares(residual, v0, method="lm", xtol=1e-15,
                                 ftol=1e-15, gtol=1e-15, max_nfev=400)
    loss = float(np.sum(sol.fun ** 2))
    if best is None or loss < best["loss"]:
      n = total if schedule is not None else 1
      x = np.clip(sol.x, -50, 50)
      best = {"eta": np.exp(x[:n]),
              "lam": float(np.exp(x[-1])) if free_lam else lam,
              "steps": steps, "loss": loss}
      if free_lam:
        best["lam_identified"] = bool(np.linalg.norm(
            optimize.approx_fprime(x[-1:], lambda u: residual(
                np.append(x[:-1], u)))) > LAM_SEEN)
  return best


@dataclasses.dataclass(frozen=True)
class Spectral:
  r"""What :func:`spectral` found.

  Attributes:
    coefficients: ``[layers, P]``: the filter's Chebyshev coefficients
      ``[:, :degree + 1]`` (``g_l(lambda) = sum_k c_lk T_k(s(lambda))``,
      ``s`` mapping ``[lo, hi]`` to ``[-1, 1]``), then the extras' in the
      order of ``extras`` (``start``: ``[degree + 1, d]`` flattened).
    degree: ``K``.
    extras: the extra terms fitted.
    lo, hi: the spectrum range of ``A`` over the fit tasks (the basis').
    lam: the ridge strength ``r`` and the ladder refer to.
    disagreement: held-out ``D`` of the full description (pooled).
    disagreement_per_layer: the same per layer.
    shares: ``{term: [layers]}``: each term's share of the fitted
      predictions' energy on the test tasks (``polynomial`` and each extra;
      cross terms make them sum to about, not exactly, 1).
    ladder: ``{rung: {"disagreement", "per_layer", params}}``: held-out ``D``
      of each rung of :data:`RUNGS` (the GD rungs with ``eta``, ``lam``,
      ``steps``: GD's step count after each layer, and ``per_layer_steps``:
      its steps per layer, ``None`` if not constant).
    max_residual: ``[layers]``: ``max |r_l|`` over the test tasks'
      eigenvalues.
    chebyshev_optimum: ``[layers]``: ``1 / T_m((b + a) / (b - a))``, the
      smallest ``max |r|`` any degree-``m`` polynomial with ``r = 1`` at
      ``lambda + lam = 0`` reaches on ``[a, b]``, the test spectrum's range
      shifted by ``lam``, ``m`` the degree of ``r_l``.
  """

  coefficients: np.ndarray
  degree: int
  extras: tuple[str, ...]
  lo: float
  hi: float
  lam: float
  disagreement: float
  disagreement_per_layer: list
  shares: dict
  ladder: dict
  max_residual: np.ndarray
  chebyshev_optimum: np.ndarray

  def polynomial(self, layer: int) -> cheb.Chebyshev:
    """``g_layer`` as a numpy Chebyshev series in ``lambda`` (trimmed, :data:`TRIM`)."""
    c = self.coefficients[layer, :self.degree + 1]
    c = np.where(np.abs(c) > TRIM * np.max(np.abs(c)), c, 0.0)
    return cheb.Chebyshev(np.trim_zeros(c, "b") if np.any(c) else [0.0],
                          domain=[self.lo, self.hi])

  def _residual_polynomial(self, layer: int) -> cheb.Chebyshev:
    g = self.polynomial(layer)
    lam = cheb.Chebyshev.identity(domain=[self.lo, self.hi]) + self.lam
    return 1 - lam * g

  def filter(self, eigenvalues) -> np.ndarray:
    """``g_l(lambda)`` ``[layers, G]`` on a grid ``[G]`` of eigenvalues of ``A``."""
    grid = np.asarray(eigenvalues, np.float64)
    return np.stack([self.polynomial(l)(grid)
                     for l in range(self.coefficients.shape[0])])

  def residual(self, eigenvalues) -> np.ndarray:
    """``r_l(lambda) = 1 - (lambda + lam) g_l(lambda)`` ``[layers, G]``."""
    grid = np.asarray(eigenvalues, np.float64)
    return 1 - (grid + self.lam) * self.filter(grid)

  @property
  def roots(self) -> list[np.ndarray]:
    """Per layer, the roots of ``r_l`` (complex; real ones have imaginary part 0)."""
    return [self._residual_polynomial(l).roots()
            for l in range(self.coefficients.shape[0])]

  @property
  def schedules(self) -> list[np.ndarray | None]:
    """Per layer, the GD schedule ``eta_i = 1 / (root_i + lam)`` (ascending
    roots; the order of the steps is not identifiable) if a real one computes
    the layer's filter (see :data:`CLUSTERS`, :data:`AGREE`), else ``None``:
    its roots are complex, and no real GD schedule does."""
    return [self._schedule(layer) for layer in range(len(self.coefficients))]

  def _schedule(self, layer: int) -> np.ndarray | None:
    roots = sorted(self.roots[layer], key=lambda z: (z.real, z.imag))
    grid = np.linspace(self.lo, self.hi, 65)
    found = self.residual(grid)[layer]
    for radius in CLUSTERS[::-1]:  # the most merged reading that agrees
      clusters = []
      for z in roots:
        if clusters and abs(z - np.mean(clusters[-1])) <= radius * abs(z):
          clusters[-1].append(z)
        else:
          clusters.append([z])
      merged = np.asarray([np.mean(c).real for c in clusters
                           for _ in c])
      rebuilt = np.prod(1 - (grid[:, None] + self.lam) / (merged + self.lam),
                        axis=1)
      if np.max(np.abs(found - rebuilt)) <= AGREE * max(1.0, np.max(np.abs(
          found))):
        return 1 / (np.sort(merged) + self.lam)
    return None

  @property
  def monomial(self) -> list[np.ndarray]:
    """Per layer, ``g_l``'s coefficients in powers ``lambda^0, lambda^1, ...``."""
    return [self.polynomial(l).convert(kind=np.polynomial.Polynomial).coef
            for l in range(self.coefficients.shape[0])]

  def as_dict(self) -> dict:
    """JSON-ready (complex roots as ``[re, im]`` pairs)."""
    return _fitting._plain({
        "coefficients": self.coefficients, "degree": self.degree,
        "extras": list(self.extras), "lo": self.lo, "hi": self.hi,
        "lam": self.lam, "disagreement": self.disagreement,
        "disagreement_per_layer": self.disagreement_per_layer,
        "shares": self.shares, "ladder": self.ladder,
        "monomial": self.monomial,
        "roots": [np.stack([r.real, r.imag], -1) for r in self.roots],
        "schedules": self.schedules,
        "max_residual": self.max_residual,
        "chebyshev_optimum": self.chebyshev_optimum})


def _chebyshev_optimum(degree: int, a: float, b: float) -> float:
  sigma = (b + a) / (b - a)
  return float(1 / np.cosh(degree * np.arccosh(sigma))) if degree else 1.0


def spectral(model: Model, fit_tasks: ridge.Task, test_tasks: ridge.Task, *,
             degree: int = 4, extras: Sequence[str] = ("y_energy", "start"),
             lam=0.0) -> Spectral:
  r"""The filter ``g_l`` every exposed layer computes, fitted by linear least squares.

  Args:
    model: ``task -> [B, Q]`` or ``[S, B, Q]`` (rows ``1..S-1``), in the
      tasks' dtype.
    fit_tasks, test_tasks: task batches of one ``d`` and dtype (float32 or
      float64); ``D``, the shares and the ladder are on ``test_tasks``.
    degree: ``K >= 0``, the filter's degree (``g`` of degree ``K``, ``r`` of
      ``K + 1``); at most 32.
    extras: names of :data:`EXTRAS`, each fitted beside the polynomial.
    lam: the tasks' ridge strength, ``>= 0``: where ``r`` and the GD rungs
      place it.

  Returns:
    the :class:`Spectral` description (float64).

  Raises:
    TypeError, ValueError: as :func:`elsa.decompile.identify`; an unknown
      extra.
  """
  fn = "decompile.spectral"
  _fitting._check_pair(fn, fit_tasks, test_tasks)
  degree = _validate.int_between(fn, "degree", degree, low=0, high=32)
  _validate.at_least(fn, "lam", lam, low=0, strict=False)
  if isinstance(extras, str) or any(e not in EXTRAS for e in extras) or len(
      set(extras)) != len(extras):
    raise ValueError(f"{fn}: extras must be distinct names of {EXTRAS}, got "
                     f"{extras!r}.")
  lam = float(lam)
  # One compilation of the model for both task sets.
  rows = jax.jit(lambda a, b: (_fitting._model_rows(fn, model, a),
                               _fitting._model_rows(fn, model, b)),
                 compiler_options=_fitting.QUICK_COMPILE)
  target, held = rows(fit_tasks, test_tasks)
  target = _fitting._comparable_rows(fn, "fit_tasks", target).astype(
      np.float64)
  held = _fitting._comparable_rows(fn, "test_tasks", held).astype(np.float64)
  fit, test = _data(fit_tasks), _data(test_tasks)
  lo, hi = float(np.min(fit.evals)), float(np.max(fit.evals))
  if not hi > lo:
    raise ValueError(f"{fn}: the fit tasks' A = X^T X / N has one eigenvalue "
                     f"({lo:g}): no filter can be fitted.")
  layers = target.shape[0]

  def solve(names):
    f_fit, groups = _features(fit, lo, hi, degree, names)
    f_test, _ = _features(test, lo, hi, degree, names)
    a = f_fit.reshape(-1, f_fit.shape[-1])
    norms = np.maximum(np.linalg.norm(a, axis=0), 1e-300)
    coef = np.linalg.lstsq(a / norms, target.reshape(layers, -1).T,
                           rcond=None)[0].T / norms     # [S, P]
    pred = np.einsum("bqp,sp->sbq", f_test, coef)
    return coef, groups, f_test, pred

  ladder = {}
  coef, groups, f_test, pred = solve(())
  ladder["polynomial"] = dict(zip(("disagreement", "per_layer"),
                                  _disagreement(pred, held)))
  if extras:
    coef, groups, f_test, pred = solve(tuple(extras))
    ladder["polynomial+extras"] = dict(zip(("disagreement", "per_layer"),
                                           _disagreement(pred, held)))
  energy = np.maximum(np.mean(pred ** 2, axis=(1, 2)), np.finfo(float).tiny)
  shares = {name: (np.mean(np.einsum("bqp,sp->sbq", f_test[..., cols],
                                     coef[:, cols]) ** 2, axis=(1, 2))
                   / energy).tolist() for name, cols in groups}
  for rung in ("gd", "gd_doubling", "gd_lam"):
    found = _fit_gd(fit, target, lam, hi, counts=_step_counts(rung, layers),
                    free_lam=rung == "gd_lam")
    ladder[rung] = _rung(test, held, found)
  constant = ladder["gd"]
  found = _fit_gd(fit, target, lam, hi, counts=[constant["steps"]],
                  schedule=np.full(constant["steps"][-1], constant["eta"][0]))
  ladder["gd_schedule"] = _rung(test, held, found)
  ladder = {k: ladder[k] for k in RUNGS if k in ladder}
  full = ladder["polynomial+extras" if extras else "polynomial"]
  out = Spectral(coef, degree, tuple(extras), lo, hi, lam,
                 full["disagreement"], full["per_layer"], shares, ladder,
                 np.zeros(layers), np.zeros(layers))
  a, b = float(np.min(test.evals)) + lam, float(np.max(test.evals)) + lam
  max_r = np.max(np.abs(out.residual(test.evals.ravel())), axis=1)
  optimum = np.asarray([_chebyshev_optimum(
      out._residual_polynomial(l).degree(), a, b) for l in range(layers)])
  return dataclasses.replace(out, max_residual=max_r,
                             chebyshev_optimum=optimum)


def _rung(test: _Data, held: np.ndarray, found: dict) -> dict:
  steps = found["steps"]
  etas = (found["eta"] if found["eta"].size > 1
          else np.full(steps[-1], found["eta"][0]))
  d, per_layer = _disagreement(_gd_rows(test, etas, found["lam"], steps), held)
  uniform = len(set(np.diff((0,) + steps))) == 1
  out = {"disagreement": d, "per_layer": per_layer,
         "eta": found["eta"], "lam": found["lam"], "steps": list(steps),
         "per_layer_steps": steps[0] if uniform else None}
  if "lam_identified" in found:
    out["lam_identified"] = found["lam_identified"]
  return out
