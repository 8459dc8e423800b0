"""Flax NNX modules around the pure ELSA functions, with an exact round trip to ``ElsaParams``.

Three modules, one per level of :mod:`elsa.attention`:

==============  =====================  ==============================
module          leaves                 computes
==============  =====================  ==============================
``Elsa``        ``[...]``              ``elsa.elsa(params, h)``
``ElsaLayer``   ``[C, ...]``           ``elsa.elsa_layer(params, h)``
``ElsaStack``   ``[L, C, ...]``        ``elsa.elsa_stack(params, h)``
==============  =====================  ==============================

The modules hold the six leaves of :class:`elsa.ElsaParams` as variables and
call the pure functions on them; there is no second copy of the formula. The
stack holds its parameters with a leading layer axis and the pure
:func:`elsa.elsa_stack` scans over it, so compile time stays flat in depth.

Structural choices are switches, not code paths:

* ``use_bias=False``: no biases are held; the module computes LSA (the biases
  it exports are zeros, and ``elsa`` with zero biases is ``lsa`` exactly).
* ``tied=True`` (stack only): one layer's parameters, looped ``depth`` times;
  gradients add up over the layers that share them.
* ``residual=True`` (stack only): each layer adds to the state instead of
  replacing it, ``h <- h + sum_c elsa(p_c, h)`` (:func:`residual_stack`); with
  ``use_bias=False`` this is the LSA of von Oswald et al. (2023), whose
  residual stream ELSA builds from a bias instead (a skip component).
* ``frozen``: names of leaves held as :class:`Frozen` variables, not
  :class:`flax.nnx.Param`, so an optimiser over ``nnx.Param`` leaves them be.
* ``mask``: an ``ElsaParams`` of 0/1 arrays (broadcast to the leaves, or
  ``None`` per leaf); masked entries are multiplied by zero in every call and
  in the export, so they are structurally zero and get zero gradient.
* ``key_mask``: ``[m]`` (or ``[..., m]``), the tokens that enter the
  key/value sums (:func:`elsa.elsa`); e.g. the examples only, so the queries
  read but are not read (von Oswald et al.'s ``include_query=False``). A
  ``key_mask`` given at the call replaces it.

Round trip: ``ElsaStack.from_params(p)(h) == elsa.elsa_stack(p, h)`` and
``ElsaStack.from_params(p).to_params() == p`` (bitwise), and likewise for the
other two modules. The leaves are checked when a module is built, by the
checks of the pure function it calls (on abstract shapes), so inconsistent
shapes or dtypes fail at construction with that function's message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from elsa.attention import (UNROLLED_DEPTH, Array, ElsaParams, elsa,
                            elsa_layer, elsa_stack, float_dtype, lsa)

_BIASES = ("b1", "b2", "b3")


class Frozen(nnx.Variable):
  """A parameter block held fixed in training (not an ``nnx.Param``)."""


class Mask(nnx.Variable):
  """A 0/1 structural mask (never trained): multiplied into a parameter block,
  or the tokens of the key/value sums (``key_mask``)."""


class _ElsaBlock(nnx.Module):
  """Holds ``ElsaParams`` leaves with ``len(lead_axes)`` leading axes; the switches."""

  lead_axes: tuple[str, ...] = ()

  def _pure(self) -> Callable[[ElsaParams, Array], Array]:
    """The pure function this module computes with (its checks are the module's)."""
    raise NotImplementedError

  def __init__(self, params: ElsaParams, *, use_bias: bool = True,
               frozen: Iterable[str] = (), mask: ElsaParams | None = None,
               key_mask=None):
    if not isinstance(params, ElsaParams):
      raise TypeError(f"{type(self).__name__}: params must be an ElsaParams, "
                      f"got {type(params).__name__}.")
    rank = len(self.lead_axes) + 2
    for name, leaf in zip(ElsaParams._fields, params):
      if jnp.ndim(leaf) != rank:
        axes = ", ".join((*self.lead_axes, "rows", "cols"))
        raise ValueError(f"{type(self).__name__}: params.{name} must have rank "
                         f"{rank} [{axes}], got shape {jnp.shape(leaf)}.")
    frozen = tuple(frozen)
    unknown = set(frozen) - set(ElsaParams._fields)
    if unknown:
      raise ValueError(f"{type(self).__name__}: frozen names {sorted(unknown)} "
                       f"are not leaves of ElsaParams {ElsaParams._fields}.")
    self.use_bias = use_bias
    self.frozen = frozen
    self._dtype = jnp.result_type(params.w1)
    if key_mask is not None:
      self.key_mask = Mask(jnp.asarray(key_mask, self._dtype))
    _check_leaves(self._pure(), params, self._key_mask())
    # A tuple, not a dict: static attributes must hash (jit static args).
    self._shapes = tuple(tuple(jnp.shape(leaf)) for leaf in params)
    for name, leaf in zip(ElsaParams._fields, params):
      if name in _BIASES and not use_bias:
        continue
      kind = Frozen if name in frozen else nnx.Param
      setattr(self, name, kind(jnp.asarray(leaf)))
    mask = ElsaParams(*([None] * 6)) if mask is None else mask
    for name, leaf in zip(ElsaParams._fields, mask):
      if leaf is not None:
        leaf = jnp.asarray(leaf, self._dtype)
        try:
          jnp.broadcast_shapes(jnp.shape(leaf), self._shape(name))
        except ValueError:
          raise ValueError(
              f"{type(self).__name__}: mask.{name} of shape {jnp.shape(leaf)} "
              f"does not broadcast to params.{name} of shape "
              f"{self._shape(name)}.") from None
        setattr(self, f"mask_{name}", Mask(leaf))

  def _key_mask(self, key_mask=None):
    """The call's ``key_mask``, else the held one, else ``None``."""
    if key_mask is not None or not hasattr(self, "key_mask"):
      return key_mask
    return self.key_mask[...]

  def _shape(self, name: str) -> tuple[int, ...]:
    return self._shapes[ElsaParams._fields.index(name)]

  def _leaf(self, name: str) -> Array:
    if name in _BIASES and not self.use_bias:
      return jnp.zeros(self._shape(name), self._dtype)
    value = getattr(self, name)[...]
    mask = getattr(self, f"mask_{name}", None)
    return value if mask is None else value * mask[...]

  def _held_params(self) -> ElsaParams:
    """The parameters as held (before any broadcast over tied layers)."""
    return ElsaParams(*(self._leaf(name) for name in ElsaParams._fields))

  def to_params(self) -> ElsaParams:
    """The parameters this module computes with, as ``ElsaParams`` (masks applied)."""
    return self._held_params()

  @classmethod
  def from_params(cls, params: ElsaParams, **switches):
    """The module that computes with ``params``; ``switches`` as for ``__init__``."""
    return cls(params, **switches)


class Elsa(_ElsaBlock):
  """One ELSA component, ``elsa.elsa(p, h)`` (or ``elsa.lsa`` with ``use_bias=False``).

  Args:
    params: leaves ``w1, w3: [n, k]``, ``w2: [n, v]``, ``b1, b3: [m, k]``,
      ``b2: [m, v]``.
    use_bias, frozen, mask, key_mask: switches, see the module docstring.
  """

  lead_axes = ()

  def _pure(self):
    return elsa if self.use_bias else lsa

  @classmethod
  def random(cls, rngs: nnx.Rngs, *, m: int, n: int, k: int,
             v: int | None = None, scale: float | None = None,
             bias_scale: float | None = None, dtype=None, **switches):
    """Random normal parameters (``ElsaParams.init``) drawn from ``rngs.params()``.

    ``dtype``: of every leaf; default JAX's default float (float32, or
    float64 under ``jax_enable_x64``), as for the other ``random``.
    """
    return cls(ElsaParams.init(rngs.params(), m=m, n=n, k=k, v=v, scale=scale,
                               bias_scale=bias_scale, dtype=float_dtype(dtype)),
               **switches)

  def __call__(self, h: Array, *, key_mask=None) -> Array:
    """``h [..., m, n] -> [..., m, v]``; ``key_mask [..., m]`` as for :func:`elsa.elsa`."""
    return self._pure()(self.to_params(), h,
                        key_mask=self._key_mask(key_mask))


class ElsaLayer(_ElsaBlock):
  """A layer of ``C`` summed components, ``elsa.elsa_layer(p, h)``; leaves ``[C, ...]``."""

  lead_axes = ("C",)

  def _pure(self):
    return elsa_layer

  @classmethod
  def random(cls, rngs: nnx.Rngs, *, m: int, n: int, k: int,
             components: int, scale: float | None = None,
             bias_scale: float | None = None, dtype=None, **switches):
    """Random normal parameters with leaves ``[components, ...]`` (``v == n``)."""
    return cls(ElsaParams.init(rngs.params(), m=m, n=n, k=k, lead=(components,),
                               scale=scale, bias_scale=bias_scale,
                               dtype=float_dtype(dtype)), **switches)

  def __call__(self, h: Array, *, key_mask=None) -> Array:
    """``h [..., m, n] -> [..., m, n]``; ``key_mask [..., m]`` as for :func:`elsa.elsa`."""
    return self._pure()(self.to_params(), h,
                        key_mask=self._key_mask(key_mask))


class ElsaStack(_ElsaBlock):
  """``L`` ELSA layers, ``elsa.elsa_stack(p, h)``; leaves ``[L, C, ...]``.

  With ``residual=True`` it computes :func:`residual_stack` instead.

  Args:
    params: leaves ``[L, C, ...]``. With ``tied``, leaves ``[1, C, ...]`` (or
      ``[L, C, ...]`` whose layers are all equal; the first is kept).
    tied: loop one layer's parameters ``depth`` times.
    depth: number of layers when ``tied`` (default: ``L`` of ``params``).
    residual: every layer adds its output to the state (a residual stream).
    use_bias, frozen, mask, key_mask: switches, see the module docstring.
      With ``tied`` the masks broadcast against the held ``[1, C, ...]``
      leaves.
  """

  lead_axes = ("L", "C")

  def __init__(self, params: ElsaParams, *, tied: bool = False,
               depth: int | None = None, residual: bool = False, **switches):
    if not tied and depth is not None and depth != params.w1.shape[0]:
      raise ValueError(f"ElsaStack: depth={depth} but params have "
                       f"L={params.w1.shape[0]} layers (depth is for tied=True).")
    depth = params.w1.shape[0] if depth is None else depth
    if tied:
      params = _first_layer(params)
    self.residual = residual  # read by _pure in the base's checks
    super().__init__(params, **switches)
    self.tied = tied
    self.depth = depth

  def _pure(self):
    if self.residual:
      return functools.partial(residual_stack, use_bias=self.use_bias)
    return elsa_stack

  @classmethod
  def random(cls, rngs: nnx.Rngs, *, m: int, n: int, k: int, components: int,
             depth: int, tied: bool = False, scale: float | None = None,
             bias_scale: float | None = None, dtype=None, **switches):
    """Random normal parameters with leaves ``[depth (1 if tied), components, ...]``.

    ``switches``: ``residual``, ``use_bias``, ``frozen``, ``mask``,
    ``key_mask``.
    """
    lead = (1 if tied else depth, components)
    params = ElsaParams.init(rngs.params(), m=m, n=n, k=k, lead=lead,
                             scale=scale, bias_scale=bias_scale,
                             dtype=float_dtype(dtype))
    return cls(params, tied=tied, depth=depth, **switches)

  def to_params(self) -> ElsaParams:
    """``ElsaParams`` with leaves ``[depth, C, ...]`` (tied layers repeated)."""
    held = self._held_params()
    if not self.tied:
      return held
    return jax.tree.map(
        lambda a: jnp.broadcast_to(a, (self.depth, *a.shape[1:])), held)

  def __call__(self, h: Array, *, return_all: bool = False,
               key_mask=None, reverse_only: bool = False) -> Array:
    """``h [..., m, n] -> [..., m, n]``, or all states ``[L + 1, ..., m, n]``;
    ``key_mask [..., m]``: the tokens of every key/value sum (:func:`elsa.elsa`);
    ``reverse_only``: as for :func:`residual_stack` (``residual=True`` only)."""
    if reverse_only and not self.residual:
      raise ValueError("ElsaStack: reverse_only applies to residual=True "
                       "stacks (elsa.elsa_stack keeps every transformation).")
    extra = dict(reverse_only=True) if reverse_only else {}
    return self._pure()(self.to_params(), h, return_all=return_all,
                        key_mask=self._key_mask(key_mask), **extra)


def residual_stack(p: ElsaParams, h: Array, *, return_all: bool = False,
                   key_mask=None, precision=None, use_bias: bool = True,
                   reverse_only: bool = False) -> Array:
  r"""``L`` ELSA layers with a residual stream: :math:`h_t = h_{t-1} + \sum_c \mathrm{elsa}(p_{t,c}, h_{t-1})`.

  The LSA of von Oswald et al. (2023) and Ahn et al. (2023) when the biases
  are zero: there the skip is part of the architecture, while
  :func:`elsa.elsa_stack` has none and ELSA builds it from a bias (a skip
  component, :func:`elsa.constructions.identity`). Layers run by
  ``lax.scan``, unrolled up to ``elsa.attention.UNROLLED_DEPTH = 4`` layers
  (compile time flat in ``L``).

  Args:
    p: leaves ``[L, C, ...]`` with ``v == n``, as for :func:`elsa.elsa_stack`.
    h: ``[..., m, n]``, the state before the first layer.
    return_all: if true, return every state ``h_0 = h, h_1, ..., h_L``.
    key_mask: ``None`` or ``[..., m]``, the tokens that enter the key/value
      sums (:func:`elsa.elsa`); the query tokens left out, this is the LSA of
      von Oswald et al. (their ``include_query=False``).
    precision: passed to every matmul.
    use_bias: if false, the biases are neither used nor checked (any shape),
      as for :func:`elsa.lsa`: the stack of ``lsa`` layers, computed without
      adding or multiplying zeros.
    reverse_only: if true, the two per-item products carry their own
      reverse-mode gradient (:func:`_item_matmul`), which XLA:CPU runs in its
      fast library: the training step's choice (docs/guides/speed.md, "The
      training step"). Forward mode (``jax.jvp``, ``jacfwd``,
      ``jax.hessian``) then does not apply;
      with the default every transformation does.

  Returns:
    ``[..., m, n]``, or ``[L + 1, ..., m, n]`` with ``return_all``.

  Raises:
    ValueError, TypeError: as :func:`elsa.elsa_stack` (its checks, run here).
  """
  abstract = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
  if not use_bias:
    # Biases laid out for these tokens, so that elsa_stack's checks pass
    # whatever p holds there (they are not used).
    p = p._replace(**{name: jax.ShapeDtypeStruct(
        (*p.w1.shape[:-2], jnp.shape(h)[-2], getattr(p, weight).shape[-1]),
        jnp.result_type(p.w1)) for name, weight in
        (("b1", "w1"), ("b2", "w2"), ("b3", "w3"))})
  # elsa_stack's checks, and the state's shape once key_mask's batch axes
  # have broadcast with those of h (the scan's carry keeps it).
  out = jax.eval_shape(
      lambda p, h, mask: elsa_stack(p, h, key_mask=mask, precision=precision),
      jax.tree.map(abstract, p), abstract(h),
      None if key_mask is None else abstract(key_mask))
  h = jnp.broadcast_to(h, out.shape)
  if key_mask is not None:
    key_mask = jnp.broadcast_to(key_mask, out.shape[:-1]).astype(h.dtype)
  weights = (p.w1, p.w2, p.w3)
  biases = (p.b1, p.b2, p.b3) if use_bias else (None,) * 3

  def step(state, layer):
    new = state + _residual_update(*layer, state, key_mask, precision,
                                   reverse_only)
    return new, (new if return_all else None)

  last, states = jax.lax.scan(step, h, (weights, biases),
                              unroll=p.w1.shape[0] <= UNROLLED_DEPTH)
  if not return_all:
    return last
  return jnp.concatenate([h[None], states], axis=0)


def _residual_update(weights, biases, h: Array, key_mask, precision,
                     reverse_only: bool) -> Array:
  """``sum_c elsa(p_c, h) = sum_c Q_c S_c``, ``S_c = K_c^T diag(mask) V_c``;
  ``biases`` ``None`` leaves them out.

  Tokens before components, ``[..., m, C, k]``: a projection is then one
  ``[items * m, n] @ [n, C k]`` dot whose output needs no transpose (with
  components before tokens XLA:CPU transposed every projection). With
  ``reverse_only`` the two per-item products are plain ``A @ B``
  (:func:`_item_matmul`): ``S = K^T V``
  from the keys transposed once, ``[..., C, k, m]``, and the sum over
  components and inner columns as one contraction over ``C k``,
  ``[m, C k] @ [C k, v]`` (docs/guides/speed.md, "The training step").
  """
  ein = functools.partial(jnp.einsum, precision=precision)
  def project(w, b):
    out = ein("...mn,cnk->...mck", h, w)
    return out if b is None else out + jnp.moveaxis(b, 0, 1)  # [m, C, .]
  keys, values, queries = (project(w, b) for w, b in zip(weights, biases))
  if key_mask is not None:
    values = values * key_mask[..., :, None, None]
  if not reverse_only:
    s = ein("...mck,...mcv->...ckv", keys, values)
    return ein("...mck,...ckv->...mv", queries, s)
  keys_t = _materialised(jnp.einsum("...mck->...ckm", keys))
  s = _item_matmul(keys_t, jnp.swapaxes(values, -3, -2), precision)
  return _item_matmul(queries.reshape(*queries.shape[:-2], -1),
                      s.reshape(*s.shape[:-3], -1, s.shape[-1]), precision)


def _materialised(a: Array) -> Array:
  """``a``, computed into its own buffer: XLA may not fold a transpose that
  made it into the dot that reads it (which would make that dot ``A^T B``)."""
  return jax.lax.optimization_barrier(a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _item_matmul(a: Array, b: Array, precision) -> Array:
  """``a @ b`` per item, ``[..., p, q] @ [..., q, r]``, whose gradient has no ``A^T B`` product.

  The gradients are ``g b^T`` and ``(a^T) g`` with ``a^T`` materialised
  (:func:`_materialised`): XLA:CPU runs small batched dots of the forms
  ``A B`` and ``A B^T`` in its fast library and the form ``A^T B``
  (contracting the rows of both, what the transpose of ``a @ b`` gives) outside
  it, at about half the rate on ``[2048, 11, 11]`` items
  (docs/guides/speed.md, "The training step"). Reverse mode and ``vmap``
  apply; forward mode (``jax.jvp``) does not (a ``custom_vjp``; a
  ``custom_jvp`` with the same products was transposed back to the slow
  form).
  """
  return jnp.matmul(a, b, precision=precision)


def _item_matmul_fwd(a, b, precision):
  return _item_matmul(a, b, precision), (a, b)


def _item_matmul_bwd(precision, saved, g):
  a, b = saved
  return (jnp.einsum("...pr,...qr->...pq", g, b, precision=precision),
          jnp.matmul(_materialised(jnp.swapaxes(a, -1, -2)), g,
                     precision=precision))


_item_matmul.defvjp(_item_matmul_fwd, _item_matmul_bwd)


def _check_leaves(fn: Callable[[ElsaParams, Array], Array],
                  params: ElsaParams, key_mask=None) -> None:
  """Runs ``fn``'s own checks on abstract ``params`` and ``h [m, n]`` (no compute).

  ``m`` and ``n`` are read from ``b1`` and ``w1``; any other leaf that does
  not fit them, or a dtype that differs, fails here as it would at the first
  call.
  """
  abstract = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
  h = jax.ShapeDtypeStruct((params.b1.shape[-2], params.w1.shape[-2]),
                           jnp.result_type(params.w1))
  jax.eval_shape(lambda p, h, mask: fn(p, h, key_mask=mask),
                 jax.tree.map(abstract, params), h,
                 None if key_mask is None else abstract(key_mask))


def _first_layer(params: ElsaParams) -> ElsaParams:
  """Leaves ``[1, C, ...]``; checks that concrete layers are all equal."""
  for name, leaf in zip(ElsaParams._fields, params):
    if isinstance(leaf, jax.core.Tracer):
      continue
    leaf = np.asarray(leaf)
    if not (leaf == leaf[:1]).all():
      raise ValueError(f"ElsaStack: tied=True but params.{name} differs across "
                       f"its {leaf.shape[0]} layers; pass one layer [1, C, ...].")
  return ElsaParams(*(leaf[:1] for leaf in params))
