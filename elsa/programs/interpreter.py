"""``run``: the reference semantics of a matrix program, on plain arrays.

Independent of attention and of the token layout: every layer evaluates each
assignment's terms with ``jnp.matmul`` at the highest precision, all from the
old values (assignments are simultaneous); loops run under ``lax.scan``. The
compiled stack is trusted through one comparison: ``compiled.read(hs, name)``
equals ``run(...)[name]`` at every layer.

The only thing ``run`` takes from the compiler is how many layers of the
stack each stage of the program takes (a relocation layer that moves pinned
inputs apart, or a set-up layer of hoisted products, changes no block of the
program; a stage split over k layers changes them in its last), so that both
count layers alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from elsa.attention import Array
from elsa.programs.compiler import (Schedule, _check_values, _dtype,
                                    _no_layers, _no_start_value,
                                    _runtime_scalars, _solve)
from elsa.programs.language import Program, Stage

def _apply(stage: Stage, values: dict, scalars: dict, dtype) -> dict:
  """One layer: every block, the assigned ones new, from the old values."""
  return {**values, **stage.values(values, scalars, xp=jnp, dtype=dtype)}


def run(prog: Program, *, loops: int, dtype=None, **kwargs) -> dict[str, Array]:
  """Runs ``prog`` on arrays: ``{name: [layers + 1, ..., rows, cols]}`` for every block.

  Args:
    prog: the program.
    loops: iterations of every ``prog.loop`` (int >= 0).
    dtype: of the computation; default the common dtype of the arrays given.
    **kwargs: every input by name (``[..., rows, cols]``, leading axes
      broadcast), optionally states' start values (states without ``init``),
      and every runtime scalar (a scalar, or a ``[loops]`` schedule).

  Returns:
    each block's value before the first layer and after every layer (the
    same count as ``elsa_stack(compiled.params(loops=...), ...,
    return_all=True)``), leading batch axes after the layer axis.
  """
  fn = "programs.run"
  if isinstance(loops, bool) or not isinstance(loops, (int, np.integer)) or (
      loops < 0):
    raise ValueError(f"{fn}: loops must be an int >= 0, got {loops!r}.")
  _, layout, _, stages, units, _ = _solve(prog)
  _no_layers(stages, loops, fn, layout.peeled)
  scalars = {k: v for k, v in kwargs.items() if k in prog.scalars}
  blocks = {k: v for k, v in kwargs.items() if k not in prog.scalars}
  unknown = sorted(set(blocks) - set(prog.blocks))
  missing = sorted(b.name for b in prog.inputs if b.name not in blocks)
  if unknown or missing:
    raise ValueError(f"{fn}: inputs {missing} are missing and {unknown} are "
                     "neither blocks nor scalars of the program.")
  dtype = _dtype(dtype, list(blocks.values()) + list(scalars.values()), fn)
  scalars = _runtime_scalars(prog, stages, scalars, loops, dtype, fn)
  arrays = {k: jnp.asarray(v, dtype) for k, v in blocks.items()}
  for name, a in arrays.items():
    if a.ndim < 2 or a.shape[-2:] != prog.blocks[name].shape:
      raise ValueError(f"{fn}: {name} must have shape [..., "
                       f"{prog.blocks[name].shape}], got {a.shape}.")
    if prog.blocks[name].init is not None:
      raise ValueError(f"{fn}: {name} has an init expression; do not pass it.")
    _no_start_value(prog, name, fn)
  _check_values(prog, arrays, fn, finite=False)
  batch = jnp.broadcast_shapes(*(a.shape[:-2] for a in arrays.values()))
  if loops > 1 and batch and batch[-1] == loops:
    ambiguous = sorted(k for k, v in kwargs.items() if k in prog.scalars
                       and not isinstance(v, Schedule) and np.ndim(v) == 1)
    if ambiguous:
      raise ValueError(
          f"{fn}: {ambiguous} have shape ({loops},), which is both a schedule "
          f"for loops={loops} and a batch like the blocks' {batch}. Pass "
          "programs.schedule(values) for a schedule, or vmap over a batch of "
          "scalar values.")
  values = {b.name: (jnp.broadcast_to(arrays[b.name], (*batch, *b.shape))
                     if b.name in arrays else jnp.zeros((*batch, *b.shape),
                                                        dtype))
            for b in prog.blocks.values()}

  # Each unit appends a [layers, ...] chunk per block: one value per layer
  # applied once, the scan's stacked states for a loop; one concatenate at
  # the end keeps the cost linear in ``loops``. A stage the compiler spread
  # over k layers changes the program's blocks in its last one: the first
  # k - 1 repeat the old values.
  chunks = [{k: v[None] for k, v in values.items()}]
  current = values
  once = {k: v for k, v in scalars.items() if v.ndim == 0}

  def layers(unit, old, new):
    return {k: jnp.concatenate([jnp.broadcast_to(
        old[k], (unit.layers - 1, *old[k].shape)), new[k][None]])
            for k in new}

  for unit in units:
    if not unit.repeat:
      new = current if unit.source is None else _apply(unit.source, current,
                                                       once, dtype)
      chunks.append(layers(unit, current, new))
      current = new
      continue
    if not loops:
      continue
    per_loop = {k: jnp.broadcast_to(v, (loops,)) for k, v in scalars.items()}

    def body(state, scalar_t, unit=unit):
      new = _apply(unit.source, state, scalar_t, dtype)
      return new, layers(unit, state, new)

    current, states = jax.lax.scan(body, current, per_loop, length=loops)
    chunks.append({k: v.reshape(-1, *v.shape[2:]) for k, v in states.items()})
  return {name: jnp.concatenate([c[name] for c in chunks])
          for name in prog.blocks}
