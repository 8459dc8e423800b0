"""Code generation: the ELSA components of each planned layer.

Each term becomes one component that keeps exactly its term of the eight-term
expansion of ``(hW3 + B3)(hW1 + B1)^T(hW2 + B2)``; the selectors and
placements are fixed 0/1 matrices (numpy, built once) and the term's
coefficient scales one leaf, so runtime scalars stay traced and the fixed
leaves are shared by every scalar value of a sweep. Components then merge:

* the *column mix* ``h -> h D`` (:func:`elsa.constructions.linear` with
  ``P = I``) carries inputs and unassigned states, moves pinned inputs home,
  and takes every term ``c * A @ Q`` whose target sits on ``A``'s tokens (a
  skip ``(1 - eta lam) w``, a copy ``eta lam y -> r``). ``D`` acts on whole
  columns, so where blocks on different tokens share columns and need
  different mixes (a carried block and an assigned one, a moved input and
  the block it leaves), ``D`` serves the larger token group and a
  *correction* on the other's tokens (``rows_linear``, one component) adds
  the difference;
* the constants (:func:`elsa.constructions.constant`);
* the other terms, one component each, then summed where the output is
  linear: it is ``(hW3 + B3)(hW1 + B1)^T(hW2 + B2)``, linear in each factor,
  so components equal in two factors add in the third (equal first and
  second factors: the ``W2``/``B2`` parts add, ``X^T r`` into ``w`` and into
  ``v``; equal second and third: the first factors join, ``X X^T r`` on the
  example rows and ``Xq X^T r`` on the query rows become one ``W3``). A
  component equal in all three to one written for another block on other
  tokens of the same columns computes both at once and is kept once.

:func:`apply` evaluates a layer's components on numpy tokens, which is how
:mod:`elsa.programs.compact` verifies every layer of a layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from elsa.attention import ElsaParams
from elsa.programs.language import Classified, Scalar
from elsa.programs.layout import Layout, Placement, Step

# The three factors of a component, each a (weight, bias) pair of leaves.
_FIRST, _SECOND, _THIRD = ("w3", "b3"), ("w1", "b1"), ("w2", "b2")


def _columns(n: int, cols) -> np.ndarray:
  """``[n, len(cols)]``: ``h @ S`` reads the columns ``cols``."""
  out = np.zeros((n, len(cols)))
  out[list(cols), np.arange(len(cols))] = 1
  return out


def _on_rows(m: int, rows, block: np.ndarray) -> np.ndarray:
  """``[m, block.shape[1]]``, ``block`` on the token rows ``rows``, zero elsewhere."""
  out = np.zeros((m, block.shape[1]))
  out[list(rows)] = block
  return out


def _grid(rows, cols) -> tuple:
  """``np.ix_(rows, cols)`` for sequences of ints, without its type checks
  (the compaction builds every layer of every candidate layout)."""
  return (np.array(rows, dtype=np.intp).reshape(-1, 1),
          np.array(cols, dtype=np.intp))


def _in_cells(shape, rows, cols, block: np.ndarray) -> np.ndarray:
  out = np.zeros(shape)
  out[_grid(rows, cols)] = block
  return out


@dataclasses.dataclass
class Component:
  """One component: fixed leaves plus ``sum_i coef_i * base_i`` in one leaf.

  ``kind`` ``"mix"`` and ``"constant"`` build their leaves from the summed
  matrix through :mod:`elsa.constructions`; every other kind is
  ``ElsaParams`` with ``fixed`` leaves and the sum in leaf ``scaled``, plus
  ``extra`` sums ``(leaf, base, coefficient)`` in other leaves: the layer's
  constant in ``B2`` where a product hosts it (:func:`_host_constant`), the
  coefficients in the first factor where products differing only there and
  in their coefficients merge (:func:`_merged`).
  ``targets``: the blocks whose terms it computes.
  """
  kind: str
  k: int = 0
  fixed: dict = dataclasses.field(default_factory=dict)
  scaled: str = ""
  parts: list = dataclasses.field(default_factory=list)  # (base, Scalar)
  base: Any = None  # the part without a coefficient (mix: the carries)
  targets: frozenset = frozenset()
  extra: list = dataclasses.field(default_factory=list)  # (leaf, base, Scalar)

  def total(self, values: Mapping, dtype=None):
    """The summed leaf: jax arrays of ``dtype``, or numpy if ``dtype`` is None."""
    cast = np.asarray if dtype is None else (lambda a: jnp.asarray(a, dtype))
    total = None if self.base is None else cast(self.base)
    for base, coef in self.parts:
      term = cast(coef.value(values)) * cast(base)
      total = term if total is None else total + term
    return total

  def leaves(self, m: int, n: int):
    """``(k, fixed, leaf, embed)``: inner width, the fixed leaves, the leaf
    that holds the summed matrix and how it is placed there (numpy).

    The mix ``h -> h D`` is :func:`elsa.constructions.linear`'s ``P = I``
    route (``(h W3)(B1^T B2)`` with ``B2 = [D; 0]`` when ``m >= n``, else
    ``B3 B1^T (h W2)`` with ``W2 = D``), a constant ``c`` is
    :func:`elsa.constructions.constant`'s (``B3 B1^T B2``, ``c`` in ``B3``
    or ``B2``): both are linear in the summed matrix, like every other kind.
    """
    same = lambda a: a
    if self.fixed or self.kind not in ("mix", "constant"):
      return self.k, dict(self.fixed), self.scaled, same
    if self.kind == "mix":
      if m >= n:
        return (n, dict(w3=np.eye(n), b1=np.eye(m, n)), "b2",
                lambda a: np.concatenate([a, np.zeros((m - n, n))]))
      return m, dict(b3=np.eye(m), b1=np.eye(m)), "w2", same
    if self.kind == "constant":
      if n <= m:
        return n, dict(b1=np.eye(m, n), b2=np.eye(m, n)), "b3", same
      return m, dict(b3=np.eye(m), b1=np.eye(m)), "b2", same

  def summed_parts(self) -> dict:
    """``{coefficient text: summed base}``: the scaled leaf as data."""
    out = {}
    for base, coef in self.parts:
      out[coef.text] = out.get(coef.text, 0) + np.asarray(base)
    return out


def apply(parts: list[Component], h: np.ndarray, values: Mapping
          ) -> np.ndarray:
  """One layer on numpy tokens ``h [m, n]``, float runtime scalars
  ``values``: the leaves :class:`LayerTable` builds, in the ELSA formula."""
  m, n = h.shape
  out = np.zeros_like(h)
  for c in parts:
    k, leaves, scaled, embed = c.leaves(m, n)
    leaves[scaled] = embed(c.total(values))
    for leaf, base, coef in c.extra:
      leaves[leaf] = leaves.get(leaf, 0) + coef.value(values) * base

    def factor(pair):
      w, b = (leaves.get(leaf) for leaf in pair)
      value = np.zeros((m, w.shape[1] if w is not None else b.shape[1]))
      value = value + (0 if w is None else h @ w)
      return value + (0 if b is None else b)

    first, second, third = (factor(p) for p in (_FIRST, _SECOND, _THIRD))
    out += first @ (second.T @ third)
  return out


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


# --- the column mix -------------------------------------------------------------


class _Mix:
  """A linear combination ``sum_text coef * base`` of ``[n, n]`` matrices."""

  def __init__(self, n: int):
    self.n, self.coefs, self.bases = n, {}, {}

  def add(self, coef: Scalar, rows, cols, block: np.ndarray) -> None:
    if coef.text not in self.bases:
      self.coefs[coef.text] = coef
      self.bases[coef.text] = np.zeros((self.n, self.n))
    self.bases[coef.text][_grid(rows, cols)] += block


def _present(step: Step, n: int, zero) -> dict:
  """``{rows: present}`` per token group: the columns that may be nonzero on
  those rows before the layer (a mask; blocks in ``zero`` left out)."""
  groups = {p.rows: np.zeros(n, bool)
            for where in (step.before, step.after) for p in where.values()}
  for name, p in step.before.items():
    if name not in zero:
      groups[p.rows][list(p.cols)] = True
  return groups


def _mix_wanted(step: Step, m: int, n: int) -> list:
  """``[(rows, present, wanted)]`` per token group, largest first: the
  columns that may be nonzero on those rows before the layer (``present``,
  :func:`_present` of every block) and the mix ``wanted`` there (rows of
  ``present``)."""
  before, after = step.before, step.after
  assigned = {block.name for block, _ in step.stage.assignments}
  groups = {rows: [present, _Mix(n)]
            for rows, present in _present(step, n, frozenset()).items()}
  for name, p in after.items():
    if name in assigned:
      continue
    old = before[name]
    groups[old.rows][1].add(Scalar.of(1), old.cols, p.cols,
                            np.eye(len(p.cols)))
  for block, c in step.terms:
    if _in_mix(c, block, before, after):
      source = before[c.blocks[0][0].name]
      target = after[block.name]
      groups[target.rows][1].add(c.coef, source.cols, target.cols,
                                 _eye_or(c.Q, len(source.cols)))
  order = sorted(groups, key=lambda rows: (-len(rows), rows))
  return [(rows, *groups[rows]) for rows in order]


def _in_mix(c: Classified, block, before, after) -> bool:
  """A copy ``c * A @ Q`` onto ``A``'s own tokens: one column of ``D``."""
  return (c.kind == "copy" and c.P is None
          and before[c.blocks[0][0].name].rows == after[block.name].rows)


def _column_mix(step: Step, m: int, n: int, zero) -> list[Component]:
  """The column mix and the corrections on the token groups it cannot serve.

  Groups in order of size (largest first) fix the entries of ``D`` on the
  columns present on their rows; a later group that agrees with what is
  fixed (if need be only once its blocks in ``zero``, known to be zero
  before the layer, are left out) fixes its own too, one that does not gets
  a correction ``rows_linear`` on its rows. Where that leaves corrections,
  the groups also try fixing only their blocks not known to be zero first,
  and the mix with fewer corrections is kept.
  """
  wanted = _mix_wanted(step, m, n)
  wanted_zero = _present(step, n, zero)
  mix, corrections = _fix_mix(wanted, wanted_zero, n, zero_first=False)
  if corrections:
    # A larger group that leaves its zero blocks' columns free may spare a
    # smaller one its correction (Newton's M rows, M still zero, beside the
    # query rows carrying U in the same columns).
    other = _fix_mix(wanted, wanted_zero, n, zero_first=True)
    if len(other[1]) < len(corrections):
      mix, corrections = other
  out = []
  for rows, _, want in corrections:
    # Only the columns that may be nonzero: a block known to be zero on
    # these rows needs no cancelling (Newton's U, assigned where the
    # queries leave).
    live = wanted_zero[rows]
    parts = []
    for text in sorted(set(want.bases) | set(mix.bases)):
      diff = (want.bases.get(text, 0) - mix.bases.get(text, 0)) * live[:, None]
      if np.any(diff):
        parts.append((diff, want.coefs.get(text) or mix.coefs[text]))
    if parts:
      eye = np.eye(len(rows))
      out.append(Component("copy", k=len(rows), scaled="w2", parts=parts,
                           fixed=dict(b1=_on_rows(m, rows, eye),
                                      b3=_on_rows(m, rows, eye))))
  carries = mix.bases.pop("1", np.zeros((n, n)))
  return [Component("mix", base=carries, parts=[
      (base, mix.coefs[t]) for t, base in mix.bases.items()])] + out


def _fix_mix(wanted, wanted_zero, n: int, zero_first: bool):
  """``(mix, corrections)``: the groups in order fix ``D`` where they agree
  with it, on the columns present on their rows, or (first if
  ``zero_first``) only those of their blocks not known to be zero."""
  mix, fixed = _Mix(n), np.zeros((n, n), bool)
  corrections = []
  for rows, present, want in wanted:
    masks = (present, wanted_zero[rows])
    for mask in masks[::-1] if zero_first else masks:
      if _agrees(mix, fixed, want, mask):
        for text, base in want.bases.items():
          mix.coefs.setdefault(text, want.coefs[text])
          mix.bases.setdefault(text, np.zeros((n, n)))
        for text, base in mix.bases.items():
          new = want.bases.get(text, np.zeros((n, n)))
          base[mask] = new[mask]
        fixed[mask] = True
        break
    else:
      corrections.append((rows, present, want))
  return mix, corrections


def _agrees(mix: _Mix, fixed: np.ndarray, want: _Mix, present) -> bool:
  """Whether ``want`` equals ``mix`` on the fixed entries of the rows ``present``."""
  mask = fixed & present[:, None]
  for text in set(mix.bases) | set(want.bases):
    a = mix.bases.get(text)
    b = want.bases.get(text)
    a = np.zeros_like(mask, float) if a is None else a
    b = np.zeros_like(mask, float) if b is None else b
    if not np.array_equal(a[mask], b[mask]):
      return False
  return True


# --- the layer --------------------------------------------------------------------


def components(step: Step, layout: Layout, zero=frozenset(), *,
               merge: bool = True) -> list[Component]:
  """The components of one planned layer: the column mix first, then the
  constant, the products and the corrections.

  ``zero``: blocks known to be zero before the layer (zero-initialised states
  not yet written), whose cells the column mix may leave to other blocks.
  ``merge=False``: every term its own component and the constants one of
  their own (no merging, no hosting): the compiler's last resort, where a
  merged layer fails the layer check (:func:`elsa.programs.compact.compact`).
  """
  m, n = layout.m, layout.n
  before, after = step.before, step.after
  mix = _column_mix(step, m, n, zero)
  constant = Component("constant")
  seen = np.zeros((m, n), bool)  # the cells that may be nonzero before it
  for rows, present in _present(step, n, zero).items():
    seen[list(rows)] |= present
  out = []
  for block, c in step.terms:
    target = after[block.name]
    if c.kind == "constant":
      constant.parts.append((_in_cells((m, n), target.rows, target.cols, c.P),
                             c.coef))
      continue
    if _in_mix(c, block, before, after):
      continue
    part = _product(c, target, before, m, n)
    part.targets = frozenset([block.name])
    out.append(part)
  rest = _merged(out + mix[1:]) if merge else out + mix[1:]
  if constant.parts and merge:
    # A product hosts the constant in r inner columns of its own; the mix
    # would widen to n + r, and with it every component of the stack.
    if _host_constant(rest, constant, seen, m, n):
      constant.parts = []
    else:
      folded = _with_constant(mix[0], constant, m, n)
      if folded:
        mix[0], constant.parts = folded, []
  return mix[:1] + ([constant] if constant.parts else []) + rest


def _host_constant(parts: list[Component], constant: Component,
                   seen: np.ndarray, m: int, n: int) -> bool:
  """Adds the layer's constant ``c`` to one of ``parts``; whether it could.

  With ``R`` the ``r`` rows where ``c`` is nonzero and ``Z`` ``r`` rows where
  the component's keys and values are zero (``seen``, the cells that may be
  nonzero before the layer, is empty in the columns ``W1`` and ``W2`` read,
  and ``B1`` is zero), ``r`` new inner columns get ``B3 = S_R``, ``B1 =
  S_Z`` and ``W3 = W1 = 0``, and ``B2 = S_Z c_R``. They add ``S_R (h W2 +
  B2)[Z] = S_R c_R = c``; the old ones add ``(h W3 + B3)(h W1 + B1)[Z]^T
  c_R = 0``. ``forms.Newton`` gets ``[lam I | alpha I]`` into its
  Gram component this way.
  """
  rows = np.flatnonzero(np.any([np.any(b != 0, axis=1)
                                for b, _ in constant.parts], axis=0))
  for part in parts:
    if part.scaled != "w2" or "b2" in part.fixed or part.extra:
      continue
    read = np.any([np.any(np.asarray(b) != 0, axis=1) for b, _ in part.parts]
                  + [np.zeros(n, bool)], axis=0)
    if "w1" in part.fixed:
      read |= np.any(part.fixed["w1"] != 0, axis=1)
    busy = np.any(seen[:, read], axis=1)
    if "b1" in part.fixed:
      busy |= np.any(part.fixed["b1"] != 0, axis=1)
    free = np.flatnonzero(~busy)
    if len(free) < len(rows):
      continue
    k, r = part.k, len(rows)
    shapes = dict(w1=n, w3=n, b1=m, b3=m)
    for leaf, size in shapes.items():
      old = part.fixed.get(leaf, np.zeros((size, k)))
      part.fixed[leaf] = np.concatenate([old, np.zeros((size, r))], axis=1)
    part.fixed["b3"][rows, k + np.arange(r)] = 1
    part.fixed["b1"][free[:r], k + np.arange(r)] = 1
    for base, coef in constant.parts:
      b2 = np.zeros((m, n))
      b2[free[:r]] = np.asarray(base)[rows]
      part.extra.append(("b2", b2, coef))
    part.k = k + r
    return True
  return False


def _with_constant(mix: Component, constant: Component, m: int,
                   n: int) -> Component | None:
  """The column mix that also adds the layer's constant ``c``, or ``None``.

  With ``R`` the rows where ``c`` is nonzero and ``k = n + |R|``:
  ``W3 = [I_n | 0]``, ``B3 = [0 | S_R]``, ``B1 = I_{m,k}``, ``B2 = [D; c_R;
  0]``, so ``(h W3 + B3) B1^T B2 = h D + S_R c_R = h D + c`` for every ``h``
  (``W1 = W2 = 0``: no cross term). Needs ``m >= n + |R|``.
  """
  rows = np.flatnonzero(np.any([np.any(b != 0, axis=1)
                                for b, _ in constant.parts], axis=0))
  k = n + len(rows)
  if m < k:
    return None
  w3, b3 = np.zeros((n, k)), np.zeros((m, k))
  w3[:, :n] = np.eye(n)
  b3[rows, n + np.arange(len(rows))] = 1

  def mixed(a):
    out = np.zeros((m, n))
    out[:n] = a
    return out

  def constant_rows(a):
    out = np.zeros((m, n))
    out[n:k] = np.asarray(a)[rows]
    return out

  return Component("mix", k=k, fixed=dict(w3=w3, b3=b3, b1=np.eye(m, k)),
                   scaled="b2", base=mixed(mix.base),
                   parts=[(mixed(b), c) for b, c in mix.parts]
                   + [(constant_rows(b), c) for b, c in constant.parts])


def _key(c: Component, leaves) -> tuple:
  """The fixed ``leaves`` of ``c`` (and its inner width) as a hashable key."""
  return (c.k,) + tuple((leaf, c.fixed[leaf].tobytes()) for leaf in leaves
                        if leaf in c.fixed)


def _parts_key(c: Component) -> tuple:
  """The scaled leaf as a hashable key: its name and its summed parts."""
  return (c.scaled,) + tuple(sorted(
      (text, base.tobytes()) for text, base in c.summed_parts().items()))


def _merged(parts: list[Component]) -> list[Component]:
  """Components summed where their output is linear (module doc).

  First, a component equal in every leaf to one written for another block
  is dropped (the kept one computes both: they share columns, so it reads
  each block's left factor on its own tokens). Then components equal in the
  second and third factors join their first: ``W3`` are 0/1 column selectors
  and join as a union (a column read for two blocks is read once, on each
  block's tokens), ``B3`` place rows and add; components equal in the second
  factor and in the third up to its coefficient join with the coefficients
  moved to the first (:func:`_rescaled`); last, components equal in the
  first and second factors add their third (``W2`` or ``B2``).
  """
  kept = {}
  for part in parts:
    key = (_key(part, _FIRST + _SECOND), _parts_key(part))
    same = kept.get(key)
    if same is not None and part.targets and same.targets and not (
        same.targets & part.targets):
      same.targets |= part.targets
    else:
      kept[key if same is None else (key, id(part))] = part
  joined = {}
  for part in kept.values():
    key = (_key(part, _SECOND), _parts_key(part))
    same = joined.get(key)
    if same is not None and same.targets & part.targets:
      # The same term twice for one block: a union of equal selectors would
      # count it once; the parts add below instead.
      joined[key, id(part)] = part
      continue
    if same is None:
      joined[key] = part
      continue
    if "w3" in part.fixed:
      same.fixed["w3"] = (np.maximum(same.fixed["w3"], part.fixed["w3"])
                          if "w3" in same.fixed else part.fixed["w3"])
      same.kind = part.kind
    if "b3" in part.fixed:
      same.fixed["b3"] = same.fixed.get("b3", 0) + part.fixed["b3"]
    same.targets |= part.targets
  summed = {}
  for part in _rescaled(list(joined.values())):
    # Every fixed leaf equal, the scaled one in any factor: the parts add
    # (a rescaled component scales its first factor, so its third, ``W2``,
    # must be equal too).
    key = (part.scaled, _key(part, _FIRST + _SECOND + _THIRD)
           ) if not part.extra else id(part)
    same = summed.get(key)
    if same is None:
      summed[key] = part
    else:
      same.parts.extend(part.parts)
      same.targets |= part.targets
  return list(summed.values())


def _rescaled(parts: list[Component]) -> list[Component]:
  """Components equal in the second factor whose third factors differ only in
  their coefficient, merged with the coefficients moved to the first factor.

  The output is linear in each factor, so ``sum_i F_i K^T (c_i V) = (sum_i
  c_i F_i) K^T V``: the merged ``W2`` is the shared unscaled ``V`` weight and
  ``W3``/``B3`` carry the coefficients (Newton's ``w_0 = (alpha/N) X^T y`` on
  the M rows and ``p_0 = (1/N) U X^T y`` on the query rows, one component as
  in ``forms.Newton``).
  """
  groups = {}
  for part in parts:
    summed = part.summed_parts()
    if (part.scaled == "w2" and part.base is None and not part.extra
        and len(summed) == 1 and "w2" not in part.fixed):
      (base,) = summed.values()
      key = (_key(part, _SECOND), np.asarray(base).tobytes())
    else:
      key = id(part)
    groups.setdefault(key, []).append(part)
  out = []
  for group in groups.values():
    if len(group) == 1:
      out += group
      continue
    (base,) = group[0].summed_parts().values()
    terms = [(leaf, p.fixed[leaf], p.parts[0][1]) for p in group
             for leaf in _FIRST if leaf in p.fixed]
    scaled = terms[0][0]
    fixed = {leaf: group[0].fixed[leaf] for leaf in _SECOND
             if leaf in group[0].fixed}
    out.append(Component(
        group[0].kind, k=group[0].k, fixed={**fixed, "w2": np.asarray(base)},
        scaled=scaled, parts=[(b, c) for leaf, b, c in terms if leaf == scaled],
        extra=[t for t in terms if t[0] != scaled],
        targets=frozenset().union(*(p.targets for p in group))))
  return out


_SHAPES = {"w1": "nk", "w3": "nk", "w2": "nn", "b1": "mk", "b3": "mk",
           "b2": "mn"}


@dataclasses.dataclass
class LayerTable:
  """One layer's leaves as data: ``fixed + sum_t coef_t * bases[t]``.

  ``fixed`` and every ``bases[t]`` are ``ElsaParams`` of numpy arrays
  ``[C, ...]`` (inner width ``k``, padded with zeros: exact); ``coefs[t]``
  the runtime-scalar coefficient of basis ``t``. Building a stack is then a
  handful of array operations per layer, however many terms it has, and
  the coefficients may be traced or carry a leading axis (one value per
  loop iteration).
  """
  fixed: ElsaParams
  coefs: list
  bases: list

  def at(self, values: Mapping, batch: tuple, dtype) -> ElsaParams:
    """Leaves ``[*batch, C, ...]`` for scalar ``values`` of shape ``batch``.

    ``dtype=None``: numpy float64 (concrete values, one transfer per leaf
    later instead of a dispatch per operation); else jax arrays of ``dtype``
    (the values may be traced).
    """
    xp = np if dtype is None else jnp
    cast = (lambda a: np.asarray(a, np.float64)) if dtype is None else (
        lambda a: jnp.asarray(a, dtype))
    out = [xp.broadcast_to(cast(a), (*batch, *a.shape)) for a in self.fixed]
    if self.coefs:
      c = xp.stack([xp.broadcast_to(cast(s.value(values)), batch)
                    for s in self.coefs], axis=-1)
      out = [o + xp.tensordot(c, cast(np.stack(b)), axes=1)
             for o, b in zip(out, zip(*self.bases))]
    return ElsaParams(*out)


def table(parts: list[Component], *, m: int, n: int, C: int,
          k: int) -> LayerTable:
  """The :class:`LayerTable` of one layer's components, padded to ``C``
  components of inner width ``k``."""
  size = dict(m=m, n=n, k=k)

  def zeros():
    return {leaf: np.zeros((C, *(size[a] for a in dims)))
            for leaf, dims in _SHAPES.items()}

  def put(leaves, i, leaf, value):
    leaves[leaf][i, :, :value.shape[1]] += value

  fixed, bases, coefs = zeros(), {}, {}
  for i, c in enumerate(parts):
    _, leaves, scaled, embed = c.leaves(m, n)
    for leaf, value in leaves.items():
      put(fixed, i, leaf, value)
    if c.base is not None:
      put(fixed, i, scaled, embed(np.asarray(c.base)))
    scaled_parts = [(scaled, embed(np.asarray(b)), coef) for b, coef in c.parts]
    for leaf, base, coef in scaled_parts + c.extra:
      if coef.text not in bases:
        bases[coef.text], coefs[coef.text] = zeros(), coef
      put(bases[coef.text], i, leaf, np.asarray(base))
  order = sorted(bases)
  params = lambda d: ElsaParams(**d)
  return LayerTable(params(fixed), [coefs[t] for t in order],
                    [params(bases[t]) for t in order])
