"""Models of what the library builds: ``task -> predictions after every layer``."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from elsa import _validate, nn, programs, ridge, training
from elsa.attention import Array, ElsaParams, elsa_stack

Model = Callable[[ridge.Task], Array]

def from_model(model: nn.ElsaStack | Callable[[Array], Array],
               spec: training.TaskSpec) -> Model:
  """A stack on the tokens of ``spec`` as a model: ``task -> [L + 1, B, Q]`` or ``[B, Q]``.

  ``model`` is an :class:`elsa.nn.ElsaStack` or any callable ``model(h) ->
  states`` on the ELSA input layout ``h [B, m, n]`` of ``spec``'s tokens (an
  ``nnx.Module``, a function of :func:`elsa.elsa_stack`) returning every
  state ``[L + 1, B, m, n]`` (``h`` first) or the last ``[B, m, n]``.

  Row ``l`` is the prediction slot decoded after layer ``l``
  (:func:`elsa.training.layer_predictions`; row 0 the input, 0); a callable
  returning the last state gives its final predictions ``[B, Q]`` only. An
  ``ElsaStack`` reads tasks cast to its dtype; a callable the tasks as they
  are. The predictions are cast back to the tasks' dtype.

  Raises:
    TypeError: ``model`` is not callable.
    ValueError: the stack's token shape is not ``spec``'s layout's (for a
      callable: the states it returns, when called).
  """
  fn = "decompile.from_model"
  form = spec.model_tokens()
  if not isinstance(model, nn.ElsaStack):
    if not callable(model):
      raise TypeError(f"{fn}: model must be an nn.ElsaStack or a callable h "
                      f"[B, m, n] -> states, got {type(model).__name__}.")
    return _from_callable(fn, model, form, spec.tokens)
  params = model.to_params()
  if (params.m, params.n) != (form.m, form.n):
    raise ValueError(f"{fn}: the stack reads [m, n] = "
                     f"{[params.m, params.n]} tokens but the {spec.tokens} "
                     f"layout of spec has {[form.m, form.n]}.")
  dtype = params.w1.dtype

  def predict(task: ridge.Task) -> Array:
    cast = task._replace(x=task.x.astype(dtype), y=task.y.astype(dtype),
                         x_query=task.x_query.astype(dtype))
    return training.layer_predictions(model, form, cast).astype(task.x.dtype)
  return predict


def _from_callable(fn: str, model: Callable[[Array], Array], form,
                   tokens: str) -> Model:
  """:func:`from_model` of a callable ``h [B, m, n] -> [L + 1, B, m, n]`` or ``[B, m, n]``."""

  def predict(task: ridge.Task) -> Array:
    h0 = form.encode(task.x, task.y, x_query=task.x_query)
    states = jnp.asarray(model(h0))
    if states.shape[-3:] != h0.shape or states.ndim not in (3, 4):
      raise ValueError(f"{fn}: the model returned states of shape "
                       f"{tuple(states.shape)}; on the {tokens} layout's "
                       f"tokens {tuple(h0.shape)} it must return every state "
                       f"[L + 1, B, m, n] or the last [B, m, n].")
    return form.decode_pred(states).astype(task.x.dtype)
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
