"""Compact layouts: columns shared where no term can see it, the first loop
iteration moving the pinned inputs, every layer verified.

:func:`elsa.programs.layout.solve` gives every unpinned block columns of its
own and a pinned input that breaks a term a relocation layer; both are
always exact. :func:`compact` then makes the layout smaller while every
layer stays exact:

* **shared columns**: blocks on disjoint tokens take the same columns (the
  predictions ``p`` on the example and query rows and ``w`` on its rows, in
  one column, as ``forms.Natural`` lays them out), each share
  kept only if no layer needs more components;
* **the first iteration moves the inputs**: a relocation layer followed by a
  loop becomes the loop's first iteration, as a layer of its own doing the
  move too, when that layer is exact on the tokens as encoded (a query still
  in ``X``'s columns enters ``X``'s token sums, harmlessly when what it meets
  there is a state still at zero).

**Verification.** Every layer of every candidate is checked by
:func:`check`: the generated components (:mod:`elsa.programs.codegen`)
applied to tokens holding independent random values in every cell that may
be nonzero before the layer (blocks known to be zero, states not yet
assigned, hold zeros) must give, in every cell, what the program's
assignments give: the new blocks at their places and zero elsewhere. Both
sides are polynomials in those values, so a random point where they agree
to rounding is one where they agree identically, except with probability
zero (Schwartz–Zippel); the term-level conditions of
:func:`elsa.programs.layout.violations` are the special case of one term.
States whose zeros a layer uses are listed (``Layout.zero_start``) and
``encode`` takes no start value for them.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from elsa.programs import codegen
from elsa.programs.language import Program, Stage
from elsa.programs.layout import Layout, Placement, Step, placed

# Relative tolerance of the random-point check: rounding of products of
# order-one values is ~1e-15, a wrong cell is off by order one.
_TOL = 1e-9

# The column-sharing search builds and plans at most this many candidate
# layouts per compile (each one: every layer generated, or the widest until
# one exceeds the current width, and checked); past it the best layout found
# so far is taken. Without a bound the greedy search with its one-share
# look-ahead is quartic in the number of column classes: small programs of
# many one-column blocks took minutes. docs/guides/programs.md, "Bounded
# compile time", gives the measured times.
SHARE_BUDGET = 64


class _Budget:
  """Candidate layouts left to the column-sharing search."""

  def __init__(self, candidates: int):
    self.left = candidates

  def spend(self) -> bool:
    """Takes one candidate; ``False`` once none is left."""
    if self.left <= 0:
      return False
    self.left -= 1
    return True


def zero_sets(prog: Program, steps: list[Step]) -> list[frozenset]:
  """States known to be zero before each step: not assigned by an earlier
  step (nor, in a loop past its first iteration, by any loop)."""
  looped = {b.name for s in steps if s.stage.repeat and not s.first_iteration
            for b, _ in s.stage.assignments}
  unwritten = {b.name for b in prog.states}
  out = []
  for s in steps:
    repeated = s.stage.repeat and not s.first_iteration
    out.append(frozenset(unwritten - (looped if repeated else set())))
    unwritten -= {b.name for b, _ in s.stage.assignments}
  return out


def _zeros(prog: Program, steps: list[Step]) -> list[frozenset]:
  """The zeros a layer may use: the states not yet assigned that are assigned
  before any layer reads them (their start value reaches no block), and, in
  the first loop iteration, those the program says start at zero (``init=0``
  or ``Program(states_start_at_zero=True)``). So every state whose start
  value matters keeps cells of its own until its first assignment, and
  ``encode`` takes a start value for it (a warm start)."""
  first_write, first_read = {}, {}
  for i, s in enumerate(steps):
    for block, expr in s.stage.assignments:
      first_write.setdefault(block.name, i)
      for t in expr.terms:
        for f in t.factors:
          if f.block is not None:
            first_read.setdefault(f.block.name, i)
  unread = {name for name, i in first_write.items()
            if first_read.get(name, len(steps)) > i}
  declared = {b.name for b in prog.states if b.starts_at_zero}
  return [zero & (unread | declared) if s.first_iteration else zero & unread
          for s, zero in zip(steps, zero_sets(prog, steps))]


def check(prog: Program, step: Step, parts, layout: Layout, zero,
          seed: int = 0) -> list[str]:
  """Where the components ``parts`` of ``step`` are wrong: ``[]`` if exact.

  Returns the names of the blocks (or ``"a cell of no block"``) whose cells
  the layer gets wrong on random tokens (module doc); ``zero``: the states
  known to be zero before the layer.
  """
  rng = np.random.default_rng(seed)
  m, n = layout.m, layout.n
  values = {}
  for name, b in prog.blocks.items():
    value = np.zeros(b.shape) if name in zero else rng.normal(size=b.shape)
    values[name] = (value + value.T) / 2 if b.symmetric else value
  scalars = {name: rng.uniform(0.5, 1.5) for name in prog.scalars}
  h = np.zeros((m, n))
  for name, p in step.before.items():
    if name not in zero:
      h[codegen._grid(p.rows, p.cols)] = values[name]
  new = {**values, **step.stage.values(values, scalars)}
  want = np.zeros((m, n))
  owner = np.full((m, n), "a cell of no block", dtype=object)
  for name, p in step.after.items():
    want[codegen._grid(p.rows, p.cols)] = new[name]
    owner[codegen._grid(p.rows, p.cols)] = name
  got = codegen.apply(parts, h, scalars)
  scale = max(1.0, np.abs(want).max(), np.abs(got).max())
  wrong = np.abs(got - want) > _TOL * scale
  return sorted(set(owner[wrong]))


def _steps(steps: list[Step], start: dict, home: dict) -> list[Step]:
  """``steps`` with their placements from ``start`` and ``home``."""
  return [placed(s, start if i == 0 else home, home)
          for i, s in enumerate(steps)]


def _plan(prog, layout, steps, zeros, width=None, order=None, merge=True):
  """Components of every step; ``None`` if a layer is not exact or (with
  ``width``) takes more components than that. ``zeros``: :func:`_zeros` of
  ``steps`` (placements do not change it); ``merge``: as in
  :func:`elsa.programs.codegen.components`.

  ``order``: the steps to generate first (the widest of the current plans,
  the likeliest to exceed ``width``): a layer over ``width`` rejects the
  layout before the other layers are generated or any layer is checked.
  """
  out = [None] * len(steps)
  for i in order or range(len(steps)):
    out[i] = codegen.components(steps[i], layout, zeros[i], merge=merge)
    if width is not None and len(out[i]) > width:
      return None
  for step, parts, zero in zip(steps, out, zeros):
    if check(prog, step, parts, layout, zero):
      return None
  return out


def _cost(plans) -> int:
  """Components of the widest layer: ``elsa_stack`` pads every layer to it."""
  return max(len(p) for p in plans)


def _total(plans) -> tuple[int, int]:
  """Components of the widest layer, then of all layers."""
  return _cost(plans), sum(len(p) for p in plans)


def _cells_overlap(where: dict) -> bool:
  """Whether two placements of ``where`` share a cell: a column and a row."""
  rows_of = {}  # column -> the rows placed in it so far
  for p in where.values():
    for c in set(p.cols):
      seen = rows_of.setdefault(c, set())
      if not seen.isdisjoint(p.rows):
        return True
      seen.update(p.rows)
  return False


def _share(layout: Layout, a: tuple, b: tuple) -> Layout | None:
  """``layout`` with the blocks in columns ``b`` moved to columns ``a``;
  ``None`` if two blocks would then share a cell."""
  swap = lambda p: Placement(p.rows, a) if p.cols == b else p
  start = {k: swap(p) if not _pinned(layout, k) else p
           for k, p in layout.start.items()}
  home = {k: swap(p) if k in layout.moved or not _pinned(layout, k) else p
          for k, p in layout.home.items()}
  if _cells_overlap(start) or _cells_overlap(home):
    return None
  return dataclasses.replace(layout, start=start, home=home)


def _pinned(layout: Layout, name: str) -> bool:
  return name in layout.pinned


def _share_columns(prog, layout, steps, plans, budget: _Budget):
  """Greedy: share the widest columns first, keep a share only if every
  layer stays exact and none gets more components. In each round the first
  share that saves components is kept; if none does, the first after which
  a further share saves some, else the first that costs none (at d = 1 every
  block of Newton–Schulz is one column wide: `A`/`p` comes first in column
  order and saves nothing, `w`/`p` saves nothing alone but lets `M`/`U`
  save the loop layer two components). Each candidate layout planned takes
  one of ``budget``; once it is spent, the layout kept so far is the
  answer (every layout kept was verified)."""
  zeros = _zeros(prog, steps)
  while True:
    current = (layout, steps, plans)
    candidates = []
    for found in _shares(prog, current, zeros, budget):
      if _total(found[2]) < _total(plans):
        candidates = [found]
        break
      candidates.append(found)
    if not candidates:
      return layout, steps, plans
    layout, steps, plans = next(
        (c for c in candidates if len(candidates) > 1 and any(
            _total(after[2]) < _total(plans) for after in _shares(
                prog, c, zeros, budget))), candidates[0])


def _shares(prog, current, zeros, budget: _Budget):
  """The layouts one share away from ``current = (layout, steps, plans)``
  that stay exact without more components: ``(layout, steps, plans)``; none
  once ``budget`` is spent."""
  layout, steps, plans = current
  # Rows per column class at home: of every block (rows_at) and of the
  # blocks a share moves (moving_rows). A share that moves a block onto
  # rows a block in the new columns holds puts both on one cell, which
  # _share refuses: refused here before the layout is built (most pairs,
  # e.g. states on the same tokens).
  rows_at, moving_rows = {}, {}
  for k, p in layout.home.items():
    rows_at.setdefault(p.cols, set()).update(p.rows)
    if k in layout.moved or not _pinned(layout, k):
      moving_rows.setdefault(p.cols, set()).update(p.rows)
  classes = sorted(moving_rows, key=lambda c: (-len(c), c))
  widest = sorted(range(len(plans)), key=lambda i: -len(plans[i]))
  for a, b in itertools.combinations(classes, 2):
    if len(a) != len(b) or not rows_at[a].isdisjoint(moving_rows[b]):
      continue
    shared = _share(layout, a, b)
    if shared is None:
      continue
    if not budget.spend():
      return
    new_steps = _steps(steps, shared.start, shared.home)
    new_plans = _plan(prog, shared, new_steps, zeros, width=_cost(plans),
                      order=widest)
    if new_plans is not None:
      yield shared, new_steps, new_plans


def _peel(prog, layout, steps, stages, plans):
  """The relocation layer folded into the first iteration of a loop that
  follows it, if that layer is exact on the tokens as encoded."""
  if not (layout.relocation_layers and len(stages) > 1 and stages[1].repeat
          and stages[1].part == (1, 1)):
    return layout, steps, stages, plans
  loop = steps[1]
  first = placed(dataclasses.replace(loop, moves=steps[0].moves,
                                     first_iteration=True), layout.start,
                 layout.home)
  new_steps = [first] + steps[1:]
  peeled = dataclasses.replace(layout, relocation_layers=0, peeled=True)
  new_plans = _plan(prog, peeled, new_steps, _zeros(prog, new_steps))
  if new_plans is None:
    return layout, steps, stages, plans
  return peeled, new_steps, stages[1:], new_plans


def _renumbered(layout: Layout) -> Layout:
  """Columns after the pinned ones renumbered without gaps."""
  pinned_cols = {c for k, p in layout.start.items() if _pinned(layout, k)
                 for c in p.cols}
  top = max(pinned_cols, default=-1)
  used = sorted({c for where in (layout.start, layout.home)
                 for p in where.values() for c in p.cols if c > top})
  new = {c: top + 1 + i for i, c in enumerate(used)}
  move = lambda p: Placement(p.rows, tuple(new.get(c, c) for c in p.cols))
  return dataclasses.replace(
      layout, n=top + 1 + len(used),
      start={k: move(p) for k, p in layout.start.items()},
      home={k: move(p) for k, p in layout.home.items()})


def compact(prog: Program, layout: Layout, steps: list[Step],
            stages: list[Stage], *, budget: int | None = None):
  """The compact layout of a solved program (module doc).

  Every layer of the layout returned passed :func:`check`. Where the merged
  components of the solved (plain) layout fail it, every term keeps a
  component of its own there (``codegen.components(merge=False)``); where
  the compact layout fails it, the plain layout is kept. Either is noted in
  ``Layout.fallback`` (``print(compiled)`` shows it). ``budget``: candidate
  layouts the column-sharing search may plan (:data:`SHARE_BUDGET`).

  Returns ``(layout, steps, stages, parts)``: ``parts`` the components of
  every step; ``stages`` without the relocation stage if the first loop
  iteration took it over.

  Raises:
    ValueError: not even one component per term is exact on the plain
      layout (a bug of the compiler: the message names the layer and the
      blocks).
  """
  budget = SHARE_BUDGET if budget is None else budget
  zeros = _zeros(prog, steps)
  plans = _plan(prog, layout, steps, zeros)
  if plans is None:
    plans = _plan(prog, layout, steps, zeros, merge=False)
    if plans is None:
      for step, zero in zip(steps, zeros):
        wrong = check(prog, step, codegen.components(step, layout, zero,
                                                     merge=False), layout, zero)
        if wrong:
          raise ValueError(f"programs: the layer of {step.stage.label} is not "
                           f"exact on the cells of {wrong}, even with one "
                           "component per term; please report this program.")
    note = ("plain layout, one component per term: the merged components "
            "failed the layer check")
    return _finished(prog, dataclasses.replace(layout, fallback=note), steps,
                     stages, plans)
  plain = (layout, steps, stages, plans)
  spent = _Budget(budget)
  layout, steps, plans = _share_columns(prog, layout, steps, plans, spent)
  layout, steps, stages, plans = _peel(prog, layout, steps, stages, plans)
  if layout.peeled:  # the first iteration may allow shares the move did not
    layout, steps, plans = _share_columns(prog, layout, steps, plans, spent)
  layout = _renumbered(layout)
  steps = _steps(steps, layout.start, layout.home)
  zeros = _zeros(prog, steps)
  plans = [codegen.components(s, layout, z) for s, z in zip(steps, zeros)]
  if any(check(prog, s, p, layout, z)
         for s, p, z in zip(steps, plans, zeros)):
    layout, steps, stages, plans = plain
    layout = dataclasses.replace(
        layout, fallback="plain layout: no compact layout passed the layer "
        "check")
  elif spent.left <= 0:
    layout = dataclasses.replace(
        layout, fallback=f"the column-sharing search stopped at its budget "
        f"of {budget} candidate layouts; the best layout found is used")
  return _finished(prog, layout, steps, stages, plans)


def _finished(prog, layout, steps, stages, plans):
  """``compact``'s result, with the states whose zeros a layer uses."""
  return (dataclasses.replace(layout, zero_start=_zero_start(
      prog, layout, steps, plans)), steps, stages, plans)


def _zero_start(prog, layout, steps, plans) -> tuple[str, ...]:
  """States without ``init`` whose zeros some layer uses: with a random
  value in place of the zero, the layer is no longer exact."""
  zeros = _zeros(prog, steps)
  out = []
  for state in prog.states:
    if state.init is not None:
      continue
    for step, parts, zero in zip(steps, plans, zeros):
      if state.name in zero and check(prog, step, parts, layout,
                                      zero - {state.name}):
        out.append(state.name)
        break
  return tuple(out)
