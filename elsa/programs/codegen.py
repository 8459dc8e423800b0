"""Code generation: the ELSA components of each planned layer.

Each term becomes one component that keeps exactly its term of the eight-term
expansion of ``(hW3 + B3)(hW1 + B1)^T(hW2 + B2)``; the selectors and
placements are fixed 0/1 matrices (numpy, built once) and the term's
coefficient scales one leaf, so runtime scalars stay traced and the fixed
leaves are shared by every scalar value of a sweep. Two families merge into
one component per layer:

* the *column mix* ``h -> h D`` (:func:`elsa.constructions.linear` with
  ``P = I``): carries inputs and unassigned states, and every term
  ``c * A @ Q`` whose target sits on ``A``'s tokens and whose ``A`` owns its
  columns (a skip ``(1 - eta lam) w``, a copy ``eta lam y -> r``);
* the constants (:func:`elsa.constructions.constant`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from elsa import constructions
from elsa.attention import ElsaParams
from elsa.programs.language import Classified, Scalar
from elsa.programs.layout import Layout, Placement, Step


def _columns(n: int, cols) -> np.ndarray:
  """``[n, len(cols)]``: ``h @ S`` reads the columns ``cols``."""
  return np.eye(n)[:, list(cols)]


def _on_rows(m: int, rows, block: np.ndarray) -> np.ndarray:
  """``[m, block.shape[1]]``, ``block`` on the token rows ``rows``, zero elsewhere."""
  out = np.zeros((m, block.shape[1]))
  out[list(rows)] = block
  return out


def _in_cells(shape, rows, cols, block: np.ndarray) -> np.ndarray:
  out = np.zeros(shape)
  out[np.ix_(list(rows), list(cols))] = block
  return out


@dataclasses.dataclass
class Component:
  """One component: fixed leaves plus ``sum_i coef_i * base_i`` in one leaf.

  ``kind`` ``"mix"`` and ``"constant"`` build their leaves from the summed
  matrix through :mod:`elsa.constructions`; every other kind is
  ``ElsaParams`` with ``fixed`` leaves and the sum in leaf ``scaled``.
  """
  kind: str
  k: int = 0
  fixed: dict = dataclasses.field(default_factory=dict)
  scaled: str = ""
  parts: list = dataclasses.field(default_factory=list)  # (base, Scalar)
  base: Any = None  # the part without a coefficient (mix: the carries)

  def params(self, values: Mapping, *, m: int, n: int, dtype) -> ElsaParams:
    total = None if self.base is None else jnp.asarray(self.base, dtype)
    for base, coef in self.parts:
      term = jnp.asarray(coef.value(values), dtype) * jnp.asarray(base, dtype)
      total = term if total is None else total + term
    if self.kind == "mix":
      return constructions.linear(None, total, m=m)
    if self.kind == "constant":
      return constructions.constant(total, n)
    p = ElsaParams.zeros(m=m, n=n, k=self.k, dtype=dtype)
    fixed = {leaf: jnp.asarray(a, dtype) for leaf, a in self.fixed.items()}
    return p._replace(**fixed, **{self.scaled: total})


def _eye_or(matrix, size: int) -> np.ndarray:
  return np.eye(size) if matrix is None else np.asarray(matrix)


def _product(c: Classified, target: Placement, before: dict, m: int,
             n: int) -> Component:
  """The component of one term of kind copy, transpose, gram, product2/3."""
  where = [before[b.name] for b, _ in c.blocks]
  out_rows, out_cols = target.rows, target.cols
  if c.kind == "copy":
    (a,) = where
    P, Q = _eye_or(c.P, len(a.rows)), _eye_or(c.Q, len(a.cols))
    return Component("copy", k=len(a.rows), scaled="w2",
                     fixed=dict(b1=_on_rows(m, a.rows, np.eye(len(a.rows))),
                                b3=_on_rows(m, out_rows, P)),
                     parts=[(_in_cells((n, n), a.cols, out_cols, Q), c.coef)])
  if c.kind == "transpose":
    (a,) = where
    P, Q = _eye_or(c.P, len(a.cols)), _eye_or(c.Q, len(a.rows))
    return Component("transpose", k=len(a.cols), scaled="b2",
                     fixed=dict(w1=_columns(n, a.cols),
                                b3=_on_rows(m, out_rows, P)),
                     parts=[(_in_cells((m, n), a.rows, out_cols, Q), c.coef)])
  if c.kind == "gram":
    b, cc = where
    P, Q = _eye_or(c.P, len(b.cols)), _eye_or(c.Q, len(cc.cols))
    return Component("gram", k=len(b.cols), scaled="w2",
                     fixed=dict(w1=_columns(n, b.cols),
                                b3=_on_rows(m, out_rows, P)),
                     parts=[(_in_cells((n, n), cc.cols, out_cols, Q), c.coef)])
  if c.kind == "product2":
    a, b = where
    Q = _eye_or(c.Q, len(b.cols))
    return Component("product2", k=len(a.cols), scaled="w2",
                     fixed=dict(w3=_columns(n, a.cols),
                                b1=_on_rows(m, b.rows, np.eye(len(b.rows)))),
                     parts=[(_in_cells((n, n), b.cols, out_cols, Q), c.coef)])
  if c.kind == "product3":
    a, b, cc = where
    Q = _eye_or(c.Q, len(cc.cols))
    return Component("product3", k=len(a.cols), scaled="w2",
                     fixed=dict(w3=_columns(n, a.cols), w1=_columns(n, b.cols)),
                     parts=[(_in_cells((n, n), cc.cols, out_cols, Q), c.coef)])
  raise AssertionError(c.kind)


def _owns_columns(p: Placement, name: str, before: dict) -> bool:
  """Whether no other block has a cell in ``p``'s columns on other rows."""
  rows = set(p.rows)
  return not any(o != name and set(q.cols) & set(p.cols) and set(q.rows) - rows
                 for o, q in before.items())


def components(step: Step, layout: Layout) -> list[Component]:
  """The components of one planned layer: the column mix first, then the rest."""
  m, n = layout.m, layout.n
  before, after = step.before, step.after
  carry = np.zeros((n, n))
  assigned = {block.name for block, _ in step.stage.assignments}
  moved = {b.name for b in step.moves}
  for name, p in before.items():
    if name not in assigned and name not in moved:
      carry[p.cols, p.cols] = 1  # set, not add: pinned inputs share columns
  mix = Component("mix", base=carry)
  constant = Component("constant")
  out = []
  for block in step.moves:
    # rows_linear on the moved input's tokens: copy to its home, and cancel
    # what the carry keeps in the columns it shared.
    old, new = before[block.name], after[block.name]
    cancel = np.diag(carry)[list(old.cols)][:, None] * np.eye(len(old.cols))
    q = _in_cells((n, n), old.cols, new.cols, np.eye(len(old.cols)))
    q -= _in_cells((n, n), old.cols, old.cols, cancel)
    out.append(Component("copy", k=len(old.rows), scaled="w2",
                         fixed=dict(b1=_on_rows(m, old.rows,
                                                np.eye(len(old.rows))),
                                    b3=_on_rows(m, old.rows,
                                                np.eye(len(old.rows)))),
                         parts=[(q, Scalar.of(1))]))
  for block, c in step.terms:
    target = after[block.name]
    if c.kind == "constant":
      constant.parts.append((_in_cells((m, n), target.rows, target.cols, c.P),
                             c.coef))
      continue
    if c.kind == "copy" and c.P is None:
      source = before[c.blocks[0][0].name]
      if (source.rows == target.rows
          and _owns_columns(source, c.blocks[0][0].name, before)):
        Q = _eye_or(c.Q, len(source.cols))
        mix.parts.append((_in_cells((n, n), source.cols, target.cols, Q),
                          c.coef))
        continue
    out.append(_product(c, target, before, m, n))
  return [mix] + ([constant] if constant.parts else []) + _merged(out)


def _merged(parts: list[Component]) -> list[Component]:
  """Components that differ only in their scaled leaf, summed into one.

  The output of a component is linear in its scaled leaf (``W2`` or ``B2``),
  so terms that read the same blocks through the same selectors (``X^T r``
  into ``w`` and into ``v``; ``X X^T r`` and ``X X^T u``) add exactly.
  """
  out = []
  for part in parts:
    for kept in out:
      if (kept.kind == part.kind and kept.scaled == part.scaled
          and kept.fixed.keys() == part.fixed.keys()
          and all(np.array_equal(kept.fixed[k], part.fixed[k])
                  for k in kept.fixed)):
        kept.parts.extend(part.parts)
        break
    else:
      out.append(part)
  return out


def layer_params(parts: list[Component], values: Mapping, *, m: int, n: int,
                 dtype) -> ElsaParams:
  """One layer's ``ElsaParams``, leaves ``[C, ...]``."""
  return constructions.layer(*(c.params(values, m=m, n=n, dtype=dtype)
                               for c in parts))
