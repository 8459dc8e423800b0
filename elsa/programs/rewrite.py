"""Rewrites: a program whose terms are not one component each, made into one whose terms are.

Every term goes through :func:`elsa.programs.language.plan_term`: a term one
component computes is kept as it is; any other gets *helper blocks*, partial
products kept as states of their own:

* **hoisting** (loop-invariant code motion): a product of inputs and
  constants (``X.T @ X`` in ``X.T @ X @ w``, ``P @ X.T @ X``) is computed
  once, by the set-up layer that computes the ``init`` expressions (one
  extra set-up layer if the program has none);
* **transposed inputs**: an input read transposed where one component needs
  it the other way (``A.T`` in ``X @ A @ X`` with ``A`` not symmetric, ``X @
  A.T``) is kept transposed, computed by the same set-up layer;
* **splitting**: a partial product that reads states (``A @ A`` in ``A @ A @
  A``) is computed by an extra layer of its stage, so a loop takes two (or
  more) layers per iteration. The program's blocks change only in the
  stage's last layer, which reads the old values and the helpers, so the
  assignments stay simultaneous, and ``loops`` still counts iterations.

A program that needs none of these is returned as it is (same blocks, same
layers). :class:`Plan` records what was done, for ``print(compiled)``, and
how many layers each stage of the program takes, for ``programs.run``.
"""

from __future__ import annotations

import dataclasses

from elsa.programs.language import Expr, Helper, HelperBlocks, Program, Stage, plan_term


@dataclasses.dataclass(frozen=True)
class Unit:
  """Consecutive layers of the stack that compute one stage of the program.

  ``source``: that stage (``None``: layers that change no block of the
  program, the relocation or a set-up layer of hoisted products only);
  ``layers``: how many layers (per iteration if ``repeat``).
  """
  source: Stage | None
  layers: int
  repeat: bool


@dataclasses.dataclass(frozen=True)
class Plan:
  """A rewritten program.

  Attributes:
    program: the program's blocks plus the helper blocks.
    stages: every layer's stage in stack order (a loop of ``k`` layers per
      iteration is ``k`` consecutive stages with ``part = (j, k)``).
    units: the program's stages, each as the layers that compute it.
    notes: one line per rewrite, with the layers it costs.
  """
  program: Program
  stages: tuple[Stage, ...]
  units: tuple[Unit, ...]
  notes: tuple[str, ...]


def _assign(helper: Helper):
  definition = helper.definition()
  return helper.block, Expr(helper.block.shape, (definition,))


def plan(prog: Program) -> Plan:
  """The rewritten program of ``prog`` (module doc).

  Raises:
    ValueError: a term that no rewrite makes one component (the message
      names the statement and the term).
  """
  helpers = HelperBlocks()
  init = prog.init_stage()
  source = ([init] if init else []) + list(prog.stages)
  hoisted: dict[str, Helper] = {}
  planned = []
  for stage in source:
    by_depth: dict[int, dict[str, Helper]] = {}
    assignments = []
    for block, expr in stage.assignments:
      terms = []
      for term in expr.terms:
        tp = plan_term(term, f"{stage.label}, {block.name} = ...", helpers,
                       hoist=stage is not init)
        terms.append(tp.term)
        for h in tp.helpers:
          if h.invariant:
            hoisted[h.block.name] = h
          else:
            by_depth.setdefault(h.depth, {})[h.block.name] = h
      assignments.append((block, Expr(expr.shape, tuple(terms))))
    planned.append((stage, assignments, by_depth))

  if not hoisted and not any(by_depth for _, _, by_depth in planned):
    return Plan(prog, tuple(source), tuple(
        Unit(s, 1, s.repeat) for s in source), ())

  program = prog.snapshot()
  every = {h.block.name: h.block for _, _, by_depth in planned
           for level in by_depth.values() for h in level.values()}
  every.update({name: h.block for name, h in hoisted.items()})
  program.blocks.update(every)

  stages, units, notes = [], [], []
  set_up = tuple(_assign(h) for h in hoisted.values())
  if set_up and init is None:
    stages.append(Stage(set_up, False, "set-up"))
    units.append(Unit(None, 1, False))
  for stage, assignments, by_depth in planned:
    k = 1 + max(by_depth, default=0)
    for j in range(1, k + 1):
      if j < k:
        layer = tuple(_assign(h) for h in by_depth.get(j, {}).values())
      else:
        layer = tuple(assignments) + (set_up if stage is init else ())
      label = stage.label if k == 1 else f"{stage.label} (layer {j} of {k})"
      stages.append(Stage(layer, stage.repeat, label, part=(j, k)))
    units.append(Unit(stage, k, stage.repeat))
    if k > 1:
      made = "; ".join(f"layer {j}: {h.block.name} = {h.definition().text()}"
                       for j in sorted(by_depth)
                       for h in by_depth[j].values())
      per = "per iteration" if stage.repeat else "instead of 1"
      notes.append(f"split: {stage.label} takes {k} layers {per} "
                   f"(+{k - 1}); {made}")
  where = ("the init layer (+0 layers)" if init is not None
           else "a set-up layer of its own (+1 layer, shared by all)")
  for h in hoisted.values():
    what = ("transposed input" if len(h.factors) == 1
            else "loop-invariant product")
    notes.append(f"hoisted {what}: {h.block.name} = {h.definition().text()}, "
                 f"computed once by {where}")
  return Plan(program, tuple(stages), tuple(units), tuple(notes))
