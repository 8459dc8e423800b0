"""The layout solver: every block of a program placed on token rows and feature columns.

The rules follow from what each kind of term needs (docs/guides/programs.md,
"Layout rules"):

* **Tokens.** ``B.T @ C`` (``gram``, ``product3``) sums over tokens, so ``B``
  and ``C`` sit on the same rows, in the same order. ``A @ ...``
  (``product2``, ``product3``) lands in the rows of ``A``, so its target sits
  on ``A``'s rows. These constraints join blocks into *token groups*
  (union-find); a group has one row count and one list of rows. Groups get
  disjoint rows: pinned inputs (``at=``) fix theirs, the rest follow in order
  of declaration.
* **Columns.** Every block gets columns of its own, so a block's columns are
  zero on every other row: ``A @ ...`` needs that of ``A`` (else other rows'
  values would be multiplied into the output), and a token sum needs that of
  ``B`` or ``C`` (else other tokens would enter the sum). Pinned inputs may
  share columns (the natural tokens ``(x_i, y_i)``, ``(x_q, 0)`` put ``x_i``
  and ``x_q`` in the same ones); where that breaks a term, the compiler moves
  a pinned input to columns of its own, in the first set-up layer if that
  layer's own terms allow it, else in a layer of its own ahead of it.

Every condition is checked on the cells that may be nonzero before each
layer (:func:`violations`); a program that cannot be laid out raises
``ValueError`` naming the blocks and the term. This layout is always exact;
:mod:`elsa.programs.compact` then shares columns between blocks on disjoint
tokens and folds the relocation into a loop's first iteration, verifying
every layer whole.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from elsa import _validate
from elsa.programs.language import Block, Classified, Program, Stage, classify


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a block sits: its token rows and feature columns, in order."""
  rows: tuple[int, ...]
  cols: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Step:
  """One layer of the stack: a program stage, and the pinned inputs it moves.

  ``before``/``after``: where every block sits when the layer reads its input
  and when it writes its output. ``first_iteration``: the first iteration of
  a loop, as a layer of its own (it also moves the pinned inputs home).
  ``gone_before``/``gone_after``: dropped inputs (``Layout.dropped``) no
  longer on the tokens before/after the layer.
  """
  stage: Stage
  terms: tuple[tuple[Block, Classified], ...]
  moves: tuple[Block, ...]
  before: dict
  after: dict
  first_iteration: bool = False
  gone_before: frozenset = frozenset()
  gone_after: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class Layout:
  """A solved layout: sizes, where each block starts and lives, the layer plan.

  Attributes:
    m, n: token count and feature count.
    start: ``{name: Placement}`` in the encoded tokens.
    home: ``{name: Placement}`` after the relocation (equal to ``start``
      except for moved pinned inputs).
    moved: names of the pinned inputs moved to columns of their own.
    relocation_layers: 1 if the move takes a layer of its own, else 0.
    groups: token groups, ``[(rows, [block names])]``.
    pinned: names of the inputs pinned with ``at=``.
    dropped: pinned inputs cleared from the tokens after the last layer that
      reads them (they would break a later term); ``read`` gives zeros for
      them from then on.
    peeled: the move shares the first loop iteration, a layer of its own.
    zero_start: states whose cells the layout uses while they are zero
      (before their first assignment), so ``encode`` takes no start value
      for them.
    fallback: why the layout is not the compact one, or the search stopped
      early (``""`` if neither): ``print(compiled)`` says it.
  """
  m: int
  n: int
  start: dict
  home: dict
  moved: tuple[str, ...]
  relocation_layers: int
  groups: tuple
  pinned: tuple[str, ...] = ()
  dropped: tuple[str, ...] = ()
  peeled: bool = False
  zero_start: tuple[str, ...] = ()
  fallback: str = ""

  def as_data(self) -> dict:
    """``{name: (rows, cols)}`` of every block's home, as plain lists."""
    return {name: (list(p.rows), list(p.cols)) for name, p in self.home.items()}


# --- token groups ---------------------------------------------------------------


def _stage_terms(stage: Stage) -> list[tuple[Block, Classified]]:
  where = lambda b: f"{stage.label}, {b.name} = ..."
  return [(block, classify(term, where(block)))
          for block, expr in stage.assignments for term in expr.terms]


class _Groups:
  """Union-find over block names, remembering why two blocks were joined."""

  def __init__(self, blocks):
    self.parent = {b.name: b.name for b in blocks}
    self.rows = {b.name: b.shape[0] for b in blocks}
    self.why = {}

  def find(self, a):
    while self.parent[a] != a:
      a = self.parent[a]
    return a

  def join(self, a: Block, b: Block, why: str):
    ra, rb = self.find(a.name), self.find(b.name)
    if ra == rb:
      return
    if self.rows[ra] != self.rows[rb]:
      raise ValueError(
          f"programs: {why} puts {a.name} ({a.shape[0]} rows) and {b.name} "
          f"({b.shape[0]} rows) on the same tokens"
          f"{self._history(ra, rb)}, but their row counts differ.")
    self.parent[rb] = ra
    self.why[rb] = why

  def _history(self, *roots):
    reasons = [self.why[r] for r in self.why if self.find(r) in roots]
    return f" (already joined by {'; '.join(reasons)})" if reasons else ""


def _join_rule(target: Block, c: Classified):
  """The pairs of blocks a term puts on the same tokens, with the reason."""
  blocks = [b for b, _ in c.blocks]
  if c.kind == "gram":
    yield blocks[0], blocks[1], "a sum over tokens pairs B and C"
  if c.kind == "product3":
    yield blocks[1], blocks[2], "a sum over tokens pairs B and C"
  if c.kind in ("product2", "product3"):
    yield target, blocks[0], "a product lands in its left factor's rows"


def _token_groups(prog: Program, stages) -> _Groups:
  groups = _Groups(prog.blocks.values())
  pinned_inputs = [b for b in prog.inputs if b.at is not None]
  for a in pinned_inputs:
    for b in pinned_inputs:
      if a.at[0] == b.at[0]:
        groups.join(a, b, "pins to the same rows")
  terms = [(stage, target, c) for stage in stages
           for target, c in _stage_terms(stage)]
  for stage, target, c in terms:
    for a, b, why in _join_rule(target, c):
      groups.join(a, b, f"the term `{c.text}` ({stage.label}, {target.name} "
                  f"= ...: {why})")
  # Then share tokens wherever the row counts allow: every block owns its
  # columns, so blocks of different groups on the same rows never meet in a
  # term, and fewer rows make a smaller stack. Copies go first, so that a
  # copy onto its source's tokens joins the layer's column mix (codegen).
  def pinned(root):
    return any(b.at for b in prog.blocks.values()
               if groups.find(b.name) == root)

  copies = [(target, c.blocks[0][0], f"the copy `{c.text}` ({stage.label})")
            for stage, target, c in terms if c.kind == "copy" and c.P is None]
  blocks = list(prog.blocks.values())
  rest = [(a, b, "equal row counts") for a in blocks for b in blocks]
  for a, b, why in copies + rest:
    ra, rb = groups.find(a.name), groups.find(b.name)
    if (ra != rb and groups.rows[ra] == groups.rows[rb]
        and not (pinned(ra) and pinned(rb))
        and (why != "equal row counts" or not (pinned(ra) or pinned(rb)))):
      groups.join(a, b, why)
  return groups


def _assign_rows(prog: Program, groups: _Groups) -> tuple[dict, dict]:
  """Rows of every group (pinned ones fixed, the others after them, disjoint):
  ``{block name: rows}`` and ``{rows: [block names]}``."""
  members = {}
  for b in prog.blocks.values():
    members.setdefault(groups.find(b.name), []).append(b)
  rows, used = {}, {}
  for root, blocks in members.items():
    pinned = {b.at[0] for b in blocks if b.at is not None}
    if len(pinned) > 1:
      names = [b.name for b in blocks if b.at is not None]
      raise ValueError(f"programs: the pinned inputs {names} share tokens (a "
                       "term sums or lands across them) but are pinned to "
                       f"different rows {sorted(pinned)}.")
    if pinned:
      rows[root] = pinned.pop()
      for r in rows[root]:
        if r in used and used[r] != root:
          raise ValueError(f"programs: row {r} is pinned for two token groups "
                           f"({[b.name for b in blocks]} and "
                           f"{[b.name for b in members[used[r]]]}).")
        used[r] = root
  next_row = max(used, default=-1) + 1
  for root, blocks in members.items():
    if root not in rows:
      count = blocks[0].shape[0]
      rows[root] = tuple(range(next_row, next_row + count))
      next_row += count
  return {b.name: rows[groups.find(b.name)] for b in prog.blocks.values()}, {
      rows[root]: [b.name for b in blocks] for root, blocks in members.items()}


# --- the conditions -----------------------------------------------------------


def _owners(where: dict, m: int, n: int) -> np.ndarray:
  """``[m, n]`` lists of the blocks that may be nonzero in each cell."""
  owners = np.empty((m, n), dtype=object)
  for i in range(m):
    for j in range(n):
      owners[i, j] = []
  for name, p in where.items():
    for r in p.rows:
      for c in p.cols:
        owners[r, c].append(name)
  return owners


def violations(c: Classified, where: dict, owners: np.ndarray) -> list[str]:
  """Why term ``c`` would be wrong on tokens laid out as ``where``: ``[]`` if exact.

  Each reason names the blocks whose cells break the term's condition.
  """
  reasons = []
  m = owners.shape[0]
  names = [b.name for b, _ in c.blocks]

  def outside(rows):
    return [r for r in range(m) if r not in set(rows)]

  def cells(rows, cols):
    return sorted({o for r in rows for col in cols for o in owners[r, col]})

  if c.kind in ("product2", "product3"):
    a = where[names[0]]
    others = cells(outside(a.rows), a.cols)
    if others:
      reasons.append(f"{names[0]} is the left factor, so its columns must be "
                     f"zero on other tokens, but {others} have cells there")
  if c.kind in ("gram", "product3"):
    b, cc = (where[names[0]], where[names[1]]) if c.kind == "gram" else (
        where[names[1]], where[names[2]])
    clash = set()
    for r in outside(b.rows):
      left, right = cells([r], b.cols), cells([r], cc.cols)
      if left and right:
        clash.update(left + right)
    if clash:
      pair = names[:2] if c.kind == "gram" else names[1:]
      reasons.append(f"the sum over the tokens of {pair[0]} and {pair[1]} "
                     f"would take in other tokens where {sorted(clash)} have "
                     "cells in both of their columns")
  return reasons


# --- solving ------------------------------------------------------------------


# Bytes the solver holds per cell of the tokens at least: a Python list per
# cell (its owners: an 8-byte pointer and a 56-byte empty list), besides the
# float64 tokens of the layer check.
_CELL_BYTES = 64 + 8


def _fits(prog: Program) -> None:
  """``ValueError`` before anything of size ``m x n`` is built if the
  solver's per-cell tables cannot fit the devices' memory: ``m`` is at least
  the most rows of a block (or the last pinned row), ``n`` at least the
  columns of the unpinned blocks (each owns its columns)."""
  m = max([b.shape[0] for b in prog.blocks.values()]
          + [1 + max(b.at[0]) for b in prog.blocks.values() if b.at])
  n = max(1, sum(b.shape[1] for b in prog.blocks.values() if b.at is None))
  _validate.fits_memory("programs.compile", _CELL_BYTES * m * n,
                        {"tokens m >=": m, "features n >=": n})


def solve(prog: Program, stages) -> tuple[Layout, list[Step], list[Stage]]:
  """Places every block of ``prog`` and plans its layers ``stages``.

  ``stages``: one per layer (a loop body once), every term one component
  (:func:`elsa.programs.rewrite.plan` makes them so).

  Returns:
    the :class:`Layout`, one :class:`Step` per distinct layer (a loop body is
    one step), and the program's stage list with the relocation stage (if
    any) in front, in stack order.

  Raises:
    ValueError: the blocks cannot be placed so that every term is exact.
  """
  if not prog.states:
    raise ValueError("programs: the program declares no state.")
  _fits(prog)
  stages = list(stages)
  if not stages:
    raise ValueError("programs: the program has no layer; add prog.layer or "
                     "prog.loop.")
  groups = _token_groups(prog, stages)
  rows, group_table = _assign_rows(prog, groups)

  # Columns: pinned inputs where they are pinned, every other block its own.
  start = {}
  pinned_cols = [c for b in prog.inputs if b.at for c in b.at[1]]
  next_col = max(pinned_cols, default=-1) + 1
  for b in prog.blocks.values():
    if b.at is not None:
      start[b.name] = Placement(b.at[0], b.at[1])
    else:
      start[b.name] = Placement(rows[b.name],
                                tuple(range(next_col, next_col + b.shape[1])))
      next_col += b.shape[1]
  m = 1 + max(r for p in start.values() for r in p.rows)

  # A pinned input no later stage reads leaves the tokens after its last
  # reader (its cells cleared) where it would break a later term: dropped,
  # not moved. Then pinned inputs move out of shared columns until every
  # term is exact, each time the one that clears the most offences (the
  # smallest on a tie, then the last declared: the queries, not the examples).
  last_read = {}  # the last stage whose input holds the block
  for i, stage in enumerate(stages):
    for _, c in _stage_terms(stage):
      for b, _ in c.blocks:
        # A loop reads it again in its next iteration: the stage after the
        # loop clears it.
        last_read[b.name] = i + stage.repeat
  home, moved, dropped = dict(start), [], set()

  def n_cols(where):
    return 1 + max(c for p in where.values() for c in p.cols)

  def live(where, i, gone):
    return {k: p for k, p in where.items()
            if not (k in gone and last_read[k] < i)}

  def offences(where, gone):
    total = 0
    for i, stage in enumerate(stages):
      here = live(where, i, gone)
      owners = _owners(here, m, n_cols(where))
      total += sum(len(violations(c, here, owners))
                   for _, c in _stage_terms(stage))
    return total

  pinned = [b for b in prog.inputs if b.at is not None]
  for b in pinned:
    if (last_read.get(b.name, len(stages)) < len(stages) - 1
        and offences(home, dropped | {b.name}) < offences(home, dropped)):
      dropped.add(b.name)
  while offences(home, dropped):
    def moved_to(b, where):
      out = dict(where)
      width = n_cols(where)
      out[b.name] = Placement(where[b.name].rows,
                              tuple(range(width, width + b.shape[1])))
      return out
    candidates = [b for b in pinned if b.name not in moved]
    if not candidates:
      for i, stage in enumerate(stages):
        here = live(home, i, dropped)
        owners = _owners(here, m, n_cols(home))
        for target, c in _stage_terms(stage):
          reasons = violations(c, here, owners)
          if reasons:
            raise ValueError(
                f"programs: in {stage.label}, {target.name} = ...: the term "
                f"`{c.text}` cannot be laid out exactly: {'; '.join(reasons)}.")
    best = min(candidates, key=lambda b: (offences(moved_to(b, home), dropped),
                                          b.shape[0] * b.shape[1],
                                          -pinned.index(b)))
    home = moved_to(best, home)
    moved.append(best.name)
  n = n_cols(home)

  # The move shares the first layer when that layer is applied once and its
  # own terms are exact on the tokens as encoded.
  relocation_layers = 0
  if moved:
    first = stages[0]
    start_owners = _owners(start, m, n)
    if first.repeat or any(violations(c, start, start_owners)
                           for _, c in _stage_terms(first)):
      relocation_layers = 1
      stages = [Stage((), False, "relocation")] + stages

  moves = tuple(prog.blocks[name] for name in moved)
  shift = relocation_layers  # stage i of the program is step i + shift
  gone = lambda i: frozenset(k for k in dropped if last_read[k] + shift < i)
  steps = []
  for i, stage in enumerate(stages):
    step = Step(stage, tuple(_stage_terms(stage)), moves if i == 0 else (),
                {}, {}, gone_before=gone(i), gone_after=gone(i + 1))
    steps.append(placed(step, start if i == 0 else home, home))
  layout = Layout(m=m, n=n, start=start, home=home, moved=tuple(moved),
                  relocation_layers=relocation_layers,
                  groups=tuple(group_table.items()),
                  pinned=tuple(b.name for b in pinned),
                  dropped=tuple(sorted(dropped)))
  return layout, steps, stages


def placed(step: Step, before: dict, after: dict) -> Step:
  """``step`` reading its tokens laid out as ``before`` and writing them as
  ``after``, without the inputs it finds or leaves dropped."""
  without = lambda where, gone: {k: p for k, p in where.items()
                                 if k not in gone}
  return dataclasses.replace(step, before=without(before, step.gone_before),
                             after=without(after, step.gone_after))


def table(layout: Layout, prog: Program) -> str:
  """The layout as a text table: token groups by column blocks (blocks on
  other tokens of the same columns share a column heading)."""
  by_cols = {}
  for name, p in layout.home.items():
    by_cols.setdefault(p.cols, []).append(name)
  col_blocks = sorted(by_cols.items())
  pinned_start = {name: p for name, p in layout.start.items()
                  if layout.home[name] != p}
  header = ["rows \\ cols"] + [
      f"{'/'.join(names)} {_span(cols)}" for cols, names in col_blocks]
  lines = [header]
  for rows, names in layout.groups:
    line = [f"{'/'.join(names)} {_span(rows)}"]
    for _, here in col_blocks:
      line.append("/".join(n for n in here if n in names) or ".")
    lines.append(line)
  widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
  fmt = lambda row: " | ".join(s.ljust(w) for s, w in zip(row, widths))
  out = [fmt(lines[0]), "-+-".join("-" * w for w in widths)]
  out += [fmt(row) for row in lines[1:]]
  out.append(f"m = {layout.m} tokens, n = {layout.n} features")
  shared = [names for _, names in col_blocks if len(names) > 1]
  if shared:
    out.append("shared columns (blocks on other tokens): "
               + ", ".join("/".join(names) for names in shared))
  where = ("first iteration of the loop" if layout.peeled else
           "first (relocation) layer" if layout.relocation_layers else
           "first layer")
  for name, p in pinned_start.items():
    out.append(f"{name} is encoded at rows {_span(p.rows)}, cols "
               f"{_span(p.cols)} and moved home by the {where}")
  for name in layout.dropped:
    out.append(f"{name} is cleared from the tokens after the last layer "
               "that reads it")
  if layout.zero_start:
    verb = "starts" if len(layout.zero_start) == 1 else "start"
    out.append(f"{', '.join(layout.zero_start)} {verb} at zero (the layout "
               "uses its cells until first assigned; encode takes no start "
               "value)")
  if layout.fallback:
    out.append(f"layout: {layout.fallback}")
  return "\n".join(out)


def _span(idx) -> str:
  idx = list(idx)
  if idx == list(range(idx[0], idx[0] + len(idx))):
    return f"[{idx[0]}:{idx[-1] + 1}]" if len(idx) > 1 else f"[{idx[0]}]"
  return str(idx)
