"""``compile``: a matrix program as an exact ELSA stack, with its token layout.

Stages: :func:`elsa.programs.rewrite.plan` (each term one component, with
helper blocks where needed, or refused),
:func:`elsa.programs.layout.solve` (token groups, rows, columns,
relocation of pinned inputs), :func:`elsa.programs.compact.compact` (shared
columns, the relocation folded into a loop's first iteration, every layer
verified), :func:`elsa.programs.codegen.components` (the components of every
layer, as data: :class:`elsa.programs.codegen.LayerTable`). Each stage's output can be printed:
``print(compiled)`` shows the layout, ``compiled.components`` the component
kinds of every layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from elsa import _validate
from elsa.attention import Array, ElsaParams, float_dtype
from elsa.programs import codegen, compact, layout as layout_lib, rewrite
from elsa.programs.language import Program


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A runtime scalar's per-iteration values ``[loops]``, marked as such.

  A bare ``[loops]`` array is a schedule too; ``programs.run`` asks for the
  mark when its blocks carry a batch axis of length ``loops``, where the
  array could as well be meant as a batch of values (vmap over those).
  """
  values: Any


def schedule(values) -> Schedule:
  """Marks ``values [loops]`` as a per-iteration schedule (see :class:`Schedule`)."""
  return Schedule(values)


def _runtime_scalars(prog: Program, stages, scalars: dict, loops: int, dtype,
                     fn: str) -> dict:
  """Checked scalar values: ``0-d`` arrays, or ``[loops]`` schedules.

  Concrete values must be finite (a NaN or inf coefficient makes every
  block it touches NaN); traced ones are not checked.
  """
  missing = sorted(set(prog.scalars) - set(scalars))
  unknown = sorted(set(scalars) - set(prog.scalars))
  if missing or unknown:
    raise ValueError(f"{fn}: scalars {missing} are missing and {unknown} are "
                     f"not declared; the program's scalars are "
                     f"{sorted(prog.scalars)}.")
  once = {name for s in stages if not s.repeat for _, e in s.assignments
          for t in e.terms for name in t.coef.names}
  out = {}
  for name, value in scalars.items():
    marked = isinstance(value, Schedule)
    value = jnp.asarray(value.values if marked else value, dtype)
    if marked and value.ndim != 1:
      raise ValueError(f"{fn}: the schedule {name} must have shape "
                       f"({loops},), got {value.shape}.")
    if value.ndim == 1 and name in once:
      raise ValueError(f"{fn}: {name} is a schedule of shape {value.shape} but "
                       "a layer applied once (or an init) uses it; pass a "
                       "scalar, or a second scalar for the loop.")
    if value.shape not in ((), (loops,)):
      raise ValueError(f"{fn}: {name} must be a scalar or a schedule of shape "
                       f"({loops},) for loops={loops}, got shape {value.shape}; "
                       "vmap over it for a batch of values.")
    found = _validate.concrete(value)
    if found is not None and not np.all(np.isfinite(found)):
      raise ValueError(f"{fn}: {name} must be finite, got {found}.")
    out[name] = value
  return out


def _check_values(prog: Program, arrays: dict, fn: str, *,
                  finite: bool) -> None:
  """Checks concrete block values (traced ones pass): a block declared
  symmetric must be symmetric (to rounding), and with ``finite`` every entry
  finite.

  The stack keeps its blocks apart only in exact arithmetic: its column mixes
  multiply every block by 0 or 1, so one NaN or inf anywhere (``0 * inf``)
  makes every block of the stack NaN, even one the program never reads
  together with it. ``encode`` therefore refuses non-finite values;
  ``run`` evaluates them as IEEE arithmetic does.
  """
  for name, value in arrays.items():
    found = _validate.concrete(value)
    if found is None:
      continue
    if finite and not np.all(np.isfinite(found)):
      bad = np.argwhere(~np.isfinite(found))[0]
      raise ValueError(f"{fn}: {name} has a non-finite entry "
                       f"{found[tuple(bad)]} at {tuple(int(i) for i in bad)}; "
                       "the stack mixes the columns of every block, so one "
                       "NaN or inf would make every block NaN. Encode finite "
                       "values.")
    if prog.blocks[name].symmetric and found.size:
      gap = np.max(np.abs(found - np.swapaxes(found, -1, -2)))
      scale = np.max(np.abs(found))
      if gap > 1e3 * np.finfo(found.dtype).eps * scale:
        raise ValueError(f"{fn}: {name} is declared symmetric=True, but "
                         f"max |{name} - {name}^T| = {gap:.3g} (max |{name}| "
                         f"= {scale:.3g}); the stack reads it transposed where "
                         "the program does not. Pass a symmetric value or "
                         "declare it without symmetric=True.")


def _dtype(dtype, arrays, fn: str):
  """``dtype``, else the common dtype of the arrays given (schedules' values
  included), else the default float."""
  arrays = [a.values if isinstance(a, Schedule) else a for a in arrays]
  if dtype is None:
    typed = {jnp.result_type(a) for a in arrays if hasattr(a, "dtype")}
    if len(typed) > 1:
      raise TypeError(f"{fn}: the arrays given have dtypes "
                      f"{sorted(map(str, typed))}; cast them to one.")
    dtype = typed.pop() if typed else None
  dtype = float_dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{fn}: the dtype must be floating, got {dtype}.")
  return dtype


def _solve(prog: Program):
  """``prog`` rewritten, laid out, compacted and planned: ``(plan, layout,
  steps, stages, units, parts)``, ``stages`` one per distinct layer in stack
  order (the peeled first iteration of a loop is not one), ``units`` the
  program's stages as layers of the stack (the relocation first) and
  ``parts`` the components of every step."""
  plan = rewrite.plan(prog)
  layout, steps, stages = layout_lib.solve(plan.program, plan.stages)
  layout, steps, stages, parts = compact.compact(plan.program, layout, steps,
                                                 stages)
  units = ((rewrite.Unit(None, 1, False),) * layout.relocation_layers
           + plan.units)
  return plan, layout, steps, stages, units, parts


def _no_start_value(prog: Program, name: str, fn: str) -> None:
  """``ValueError`` if ``name`` is a state the program says starts at zero
  (``init=0``, or ``Program(states_start_at_zero=True)``)."""
  if prog.blocks[name].starts_at_zero:
    raise ValueError(f"{fn}: {name} starts at zero (declared init=0, or the "
                     "program's states_start_at_zero=True), so the layout may "
                     "use its cells before its first assignment; do not pass "
                     "it, or declare it without init=0 to give a start value.")


def _no_layers(stages, loops: int, fn: str, peeled: bool) -> None:
  """``ValueError`` if ``loops`` iterations leave the program without a layer,
  or without the first iteration that moves the pinned inputs home
  (``params`` and ``run`` refuse alike)."""
  if not any(not s.repeat for s in stages) and loops == 0:
    raise ValueError(f"{fn}: with loops=0 the program has no layer (it has "
                     "only loops); pass loops >= 1.")
  if peeled and loops == 0:
    raise ValueError(f"{fn}: the first iteration of the loop also moves the "
                     "pinned inputs home (no set-up layer is spent on it), so "
                     "loops=0 has no stack; pass loops >= 1.")


class Compiled:
  """A compiled program: its layout, and the encoder, parameters and reader of its stack.

  Attributes:
    m, n: token count and feature count of a state.
    layout: ``{name: (rows, cols)}``, where each block lives (lists of ints).
    setup_layers: layers before the first loop iteration (relocation, inits,
      ``prog.layer`` stages added before the first loop).
    relocation_layers: 1 if pinned inputs are moved in a layer of their own.
    components: the component kinds of each distinct layer, ``[[str]]``.
    rewrites, layers_per_iteration: what the compiler rewrote (below).

  Non-finite values: the stack keeps blocks apart only in finite arithmetic.
  A block that overflows to inf (or turns NaN) makes, one layer later, every
  cell of its token rows NaN (the column mix multiplies it by the zeros of
  ``D``: ``0 * inf``), inputs included, and the token sums of the layer
  after carry NaN to every row they write; ``run`` evaluates each block on
  its own, so its other blocks stay finite. Guarding every layer against
  it would cost an operation per cell per layer in ``elsa_stack``; it is not
  done. A NaN anywhere in the stack means some block overflowed: ``run``
  names which. ``encode`` refuses non-finite values for the same reason.
  """

  def __init__(self, prog: Program):
    # A snapshot: blocks or layers declared on ``prog`` later belong to the
    # next compile, not to this stack.
    self.program = prog.snapshot()
    (self._plan, self._layout, self._steps, self._stages, self._units,
     self._parts) = _solve(self.program)
    self.m, self.n = self._layout.m, self._layout.n
    self._layer_tables = None
    self._encoded_dtype = None  # the dtype of the last tokens encode made
    self.components = [[c.kind for c in parts] for parts in self._parts]
    first_loop = next((i for i, s in enumerate(self._stages) if s.repeat),
                      len(self._stages))
    self.setup_layers = first_loop
    self.relocation_layers = self._layout.relocation_layers

  @property
  def layout(self) -> dict:
    return self._layout.as_data()

  @property
  def width(self) -> int:
    """Components per layer ``C`` of the stack (the widest layer)."""
    return max(len(parts) for parts in self._parts)

  @property
  def rewrites(self) -> tuple[str, ...]:
    """What the compiler rewrote to make every term one component, one line
    each with the layers it costs (:mod:`elsa.programs.rewrite`)."""
    return self._plan.notes

  @property
  def layers_per_iteration(self) -> list[int]:
    """Layers each ``prog.loop`` takes per iteration (1 unless split)."""
    return [u.layers for u in self._units if u.repeat]

  def __str__(self) -> str:
    table = layout_lib.table(self._layout, self._plan.program)
    if not self.rewrites:
      return table
    return "\n".join([table, "rewrites:"] + [f"  {r}" for r in self.rewrites])

  def __repr__(self) -> str:
    return (f"Compiled(m={self.m}, n={self.n}, C={self.width}, "
            f"setup_layers={self.setup_layers})")

  def layers(self, loops: int) -> int:
    """Layers of the stack for ``loops`` iterations of every loop."""
    return sum(loops if s.repeat else 1 for s in self._stages)

  # --- encoding and reading ---------------------------------------------------

  def encode(self, *, dtype=None, **blocks) -> Array:
    """The initial tokens ``[..., m, n]`` from the inputs (and optional states).

    Every input is required; a state given here starts at that value instead
    of zero (a state with an ``init`` is computed by the set-up layer and may
    not be given). Leading axes of the blocks broadcast.

    Raises:
      ValueError: a block is missing, unknown, not allowed or mis-shaped; a
        concrete block has a NaN or inf (which the stack would spread to
        every block), or a block declared symmetric is not.
      TypeError: the blocks' dtypes differ or are not floating.
    """
    fn = "Compiled.encode"
    prog = self.program
    unknown = sorted(set(blocks) - set(prog.blocks))
    missing = sorted(b.name for b in prog.inputs if b.name not in blocks)
    if unknown or missing:
      raise ValueError(f"{fn}: inputs {missing} are missing and {unknown} are "
                       f"not blocks of the program; inputs: "
                       f"{[b.name for b in prog.inputs]}, states: "
                       f"{[b.name for b in prog.states]}.")
    for name in blocks:
      if prog.blocks[name].init is not None:
        raise ValueError(f"{fn}: {name} has an init expression, so the set-up "
                         "layer computes it; do not pass it.")
      _no_start_value(prog, name, fn)
      if name in self._layout.zero_start:
        raise ValueError(f"{fn}: {name} starts at zero: the compact layout "
                         "uses its cells until it is first assigned (print("
                         "compiled) shows it); do not pass it, or start it "
                         "with an init expression.")
    dtype = _dtype(dtype, blocks.values(), fn)
    self._encoded_dtype = dtype
    # Concrete blocks are laid out in numpy and transferred once: eager jax
    # operations would compile one small program per shape.
    xp = jnp if any(isinstance(v, jax.core.Tracer) for v in blocks.values()
                    ) else np
    arrays = {}
    for name, value in blocks.items():
      value = xp.asarray(value, dtype)
      shape = prog.blocks[name].shape
      if value.ndim < 2 or value.shape[-2:] != shape:
        raise ValueError(f"{fn}: {name} must have shape [..., {shape[0]}, "
                         f"{shape[1]}], got {value.shape}.")
      arrays[name] = value
    _check_values(prog, arrays, fn, finite=True)
    try:
      batch = jnp.broadcast_shapes(*(a.shape[:-2] for a in arrays.values()))
    except ValueError:
      raise ValueError(f"{fn}: the leading axes do not broadcast: "
                       f"{ {k: v.shape for k, v in arrays.items()} }.") from None
    h = xp.zeros((*batch, self.m, self.n), dtype)
    for name, value in arrays.items():
      p = self._layout.start[name]
      cells = (..., np.array(p.rows)[:, None], np.array(p.cols))
      value = xp.broadcast_to(value, (*batch, *value.shape[-2:]))
      if xp is np:
        h[cells] = value
      else:
        h = h.at[cells].set(value)
    return jnp.asarray(h)

  def read(self, h: Array, name: str) -> Array:
    """The block ``name`` at its home: ``[..., m, n] -> [..., rows, cols]``.

    Works on any leading axes, e.g. all states of ``elsa_stack(...,
    return_all=True)``. A moved pinned input is at home from the end of the
    first layer on; a pinned input cleared after its last reader (``print
    (compiled)`` says which) reads zero from then on.
    """
    if name not in self._layout.home:
      raise ValueError(f"Compiled.read: no block {name!r}; blocks: "
                       f"{sorted(self._layout.home)}.")
    h = jnp.asarray(h)
    if h.ndim < 2 or h.shape[-2:] != (self.m, self.n):
      raise ValueError(f"Compiled.read: h must have shape [..., {self.m}, "
                       f"{self.n}], got {h.shape}.")
    p = self._layout.home[name]
    return h[..., np.array(p.rows)[:, None], np.array(p.cols)]

  # --- parameters ------------------------------------------------------------

  def params(self, *, loops: int, dtype=None, **scalars) -> ElsaParams:
    """The stack: ``ElsaParams`` with leaves ``[layers(loops), C, ...]``.

    Args:
      loops: iterations of every ``prog.loop`` (a static int >= 0).
      dtype: of every leaf; it must be the dtype of the encoded tokens.
        Default: the dtype of the tokens :meth:`encode` last made (so float32
        tokens take Python-float scalars), else the scalars' dtype if arrays,
        else JAX's default float.
      **scalars: every runtime scalar of the program: a scalar (may be
        traced) or, for scalars used only in loops, a ``[loops]`` schedule.

    Raises:
      ValueError: a scalar is missing, unknown, mis-shaped or (if concrete)
        not finite; ``loops`` is not an int >= 0, or gives no layer, or the
        stack would not fit the devices' memory (refused before anything is
        allocated).
    """
    fn = "Compiled.params"
    if isinstance(loops, bool) or not isinstance(loops, (int, np.integer)) or (
        loops < 0):
      raise ValueError(f"{fn}: loops must be an int >= 0, got {loops!r}.")
    _no_layers(self._stages, loops, fn, self._layout.peeled)
    if dtype is None and self._encoded_dtype is not None:
      dtype = self._encoded_dtype
    dtype = _dtype(dtype, scalars.values(), fn)
    per_layer = sum(math.prod(a.shape) for a in self._tables()[0].fixed)
    _validate.fits_memory(
        fn, _validate.array_bytes(dtype, (self.layers(loops), per_layer)),
        {"loops": loops, "layers": self.layers(loops), "m": self.m,
         "n": self.n, "C": self.width})
    values = _runtime_scalars(self.program, self._stages, scalars, loops, dtype,
                              fn)
    # Concrete scalars: the leaves in numpy, one transfer per leaf at the
    # end (a jax dispatch per operation costs more than the whole stack).
    concrete = {k: _validate.concrete(v) for k, v in values.items()}
    on_host = all(v is not None for v in concrete.values())
    if on_host:
      values = {k: np.asarray(v, np.float64) for k, v in concrete.items()}
    xp, build_dtype = (np, None) if on_host else (jnp, dtype)
    once = {k: v for k, v in values.items() if v.ndim == 0}
    per_loop = {k: xp.broadcast_to(v, (loops,)) for k, v in values.items()}
    tables = self._tables()
    parts, first = [], 0
    for unit in self._units:
      if not unit.repeat:
        parts += [t.at(once, (1,), build_dtype)
                  for t in tables[first:first + unit.layers]]
        first += unit.layers
        continue
      rest, count = per_loop, loops
      if self._steps[first].first_iteration:
        # The first iteration is a layer of its own (it also moves the
        # pinned inputs home), at the first iteration's scalars; loops >= 1
        # (_no_layers).
        parts.append(tables[first].at(
            {k: v[:1] for k, v in per_loop.items()}, (1,), build_dtype))
        rest = {k: v[1:] for k, v in per_loop.items()}
        count, first = loops - 1, first + 1
      layers = [t.at(rest, (count,), build_dtype)
                for t in tables[first:first + unit.layers]]
      first += unit.layers
      if count:
        # Layer j of iteration t at row t * k + j: the layers of one
        # iteration run together, each at that iteration's scalars.
        parts.append(jax.tree.map(
            lambda *a: xp.stack(a, axis=1).reshape(-1, *a[0].shape[1:]),
            *layers))
    return jax.tree.map(lambda *a: jnp.asarray(xp.concatenate(a), dtype),
                        *parts)

  def _tables(self) -> list[codegen.LayerTable]:
    """Every step's leaves as data, padded to one ``C`` and ``k``."""
    if self._layer_tables is None:
      k = max(c.leaves(self.m, self.n)[0] for p in self._parts for c in p)
      self._layer_tables = [codegen.table(p, m=self.m, n=self.n, C=self.width,
                                          k=k) for p in self._parts]
    return self._layer_tables


def compile(prog: Program) -> Compiled:  # pylint: disable=redefined-builtin
  """Lays out ``prog`` and returns its :class:`Compiled` stack.

  Raises:
    ValueError: a term is not one ELSA component, or the blocks cannot be
      laid out so that every term is exact (the message names them).
  """
  if not isinstance(prog, Program):
    raise TypeError(f"programs.compile: expected a Program, got "
                    f"{type(prog).__name__}.")
  return Compiled(prog)
