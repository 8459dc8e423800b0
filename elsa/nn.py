"""Flax NNX modules around the pure ELSA functions, with an exact round trip to ``ElsaParams``.

Three modules, one per level of :mod:`elsa.attention`:

==============  =====================  ==============================
module          leaves                 computes
==============  =====================  ==============================
``Elsa``        ``[...]``              ``elsa.elsa(params, h)``
``ElsaLayer``   ``[C, ...]``           ``elsa.elsa_layer(params, h)``
``ElsaStack``   ``[L, C, ...]``        ``elsa.elsa_stack(params, h)``
==============  =====================  ==============================

and, for ELSA inside the models the field trains, :class:`MultiHeadElsa`
(heads with their own key and value widths, normalised by the keys that
enter, an output projection) and :class:`Transformer` (pre-LayerNorm blocks
whose attention is one switch: ``"elsa"``, ``"lsa"`` or ``"softmax"``).

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
* ``causal=True``: row ``i`` reads the tokens ``j <= i`` only, by chunks of
  ``chunk`` tokens (:func:`elsa.elsa`); one pass predicts every prefix.

Any prefix: a module laid out for ``m`` tokens runs on ``m' <= m`` tokens
with the first ``m'`` bias rows (and held ``key_mask`` entries).

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

from elsa import _validate
from elsa.attention import (DEFAULT_CHUNK, UNROLLED_DEPTH, Array,
                            ElsaParams, _causal_attend, elsa, elsa_layer,
                            elsa_stack, float_dtype, lsa)

_BIASES = ("b1", "b2", "b3")


class Frozen(nnx.Variable):
  """A parameter block held fixed in training (not an ``nnx.Param``)."""


class Mask(nnx.Variable):
  """A 0/1 structural mask (never trained): multiplied into a parameter block,
  or the tokens of the key/value sums (``key_mask``)."""


class ElsaBlock(nnx.Module):
  """The base of :class:`Elsa`, :class:`ElsaLayer` and :class:`ElsaStack`: holds
  ``ElsaParams`` leaves with ``len(lead_axes)`` leading axes, and the switches
  of the module docstring."""

  lead_axes: tuple[str, ...] = ()

  def _pure(self) -> Callable[[ElsaParams, Array], Array]:
    """The pure function this module computes with (its checks are the module's)."""
    raise NotImplementedError

  def __init__(self, params: ElsaParams, *, use_bias: bool = True,
               frozen: Iterable[str] = (), mask: ElsaParams | None = None,
               key_mask=None, causal: bool = False, chunk: int | None = None):
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
    self.causal = bool(causal)
    self.chunk = chunk
    self._dtype = jnp.result_type(params.w1)
    if key_mask is not None:
      self.key_mask = Mask(jnp.asarray(key_mask, self._dtype))
    _check_leaves(functools.partial(self._pure(), causal=self.causal,
                                    chunk=chunk), params, self._key_mask())
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

  def _key_mask(self, key_mask=None, m: int | None = None):
    """The call's ``key_mask``, else the held one (its first ``m`` tokens,
    for an input of ``m`` tokens: a prefix), else ``None``."""
    if key_mask is not None or not hasattr(self, "key_mask"):
      return key_mask
    return self.key_mask[...][..., :m]

  def _call(self, h: Array, key_mask, **extra) -> Array:
    """The pure function on the held parameters, ``h`` and the switches."""
    return self._pure()(self.to_params(), h,
                        key_mask=self._key_mask(key_mask, jnp.shape(h)[-2]),
                        causal=self.causal, chunk=self.chunk, **extra)

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


class Elsa(ElsaBlock):
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
    return self._call(h, key_mask)


class ElsaLayer(ElsaBlock):
  """A layer of ``C`` summed components, ``elsa.elsa_layer(p, h)``; leaves ``[C, ...]``."""

  lead_axes = ("C",)

  def _pure(self):
    return elsa_layer

  @classmethod
  def random(cls, rngs: nnx.Rngs, *, m: int, n: int, k: int,
             components: int, v: int | None = None,
             scale: float | None = None, bias_scale: float | None = None,
             dtype=None, **switches):
    """Random normal parameters with leaves ``[components, ...]``; a layer
    maps ``h`` to a state of its shape, so ``v`` (default ``n``) must be ``n``."""
    return cls(ElsaParams.init(rngs.params(), m=m, n=n, k=k, v=v,
                               lead=(components,), scale=scale,
                               bias_scale=bias_scale,
                               dtype=float_dtype(dtype)), **switches)

  def __call__(self, h: Array, *, key_mask=None) -> Array:
    """``h [..., m, n] -> [..., m, n]``; ``key_mask [..., m]`` as for :func:`elsa.elsa`."""
    return self._call(h, key_mask)


class ElsaStack(ElsaBlock):
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
             depth: int, v: int | None = None, tied: bool = False,
             scale: float | None = None, bias_scale: float | None = None,
             dtype=None, **switches):
    """Random normal parameters with leaves ``[depth (1 if tied), components, ...]``.

    ``v`` (default ``n``) must be ``n``, as for :meth:`ElsaLayer.random`.
    ``switches``: ``residual``, ``use_bias``, ``frozen``, ``mask``,
    ``key_mask``, ``causal``, ``chunk``.
    """
    lead = (1 if tied else depth, components)
    params = ElsaParams.init(rngs.params(), m=m, n=n, k=k, v=v, lead=lead,
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
    return self._call(h, key_mask, return_all=return_all, **extra)


def residual_stack(p: ElsaParams, h: Array, *, return_all: bool = False,
                   key_mask=None, causal: bool = False,
                   chunk: int | None = None, precision=None,
                   use_bias: bool = True, reverse_only: bool = False) -> Array:
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
    causal, chunk: row ``i`` of every layer reads the tokens ``j <= i``
      only, by chunks (:func:`elsa.elsa`).
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
      lambda p, h, mask: elsa_stack(p, h, key_mask=mask, causal=causal,
                                    chunk=chunk, precision=precision),
      jax.tree.map(abstract, p), abstract(h),
      None if key_mask is None else abstract(key_mask))
  if causal and reverse_only:
    raise ValueError("residual_stack: reverse_only is the non-causal "
                     "training step's kernel; pass causal=True alone.")
  chunk = DEFAULT_CHUNK if chunk is None else chunk
  h = jnp.broadcast_to(h, out.shape)
  m = out.shape[-2]
  if use_bias:  # the first m bias rows: a prefix of the layout
    p = p._replace(**{name: getattr(p, name)[..., :m, :]
                      for name in _BIASES})
  if key_mask is not None:
    key_mask = jnp.broadcast_to(key_mask, out.shape[:-1]).astype(h.dtype)
  weights = (p.w1, p.w2, p.w3)
  biases = (p.b1, p.b2, p.b3) if use_bias else (None,) * 3

  def step(state, layer):
    new = state + _residual_update(*layer, state, key_mask, precision,
                                   reverse_only, causal, chunk)
    return new, (new if return_all else None)

  last, states = jax.lax.scan(step, h, (weights, biases),
                              unroll=p.w1.shape[0] <= UNROLLED_DEPTH)
  if not return_all:
    return last
  return jnp.concatenate([h[None], states], axis=0)


def _residual_update(weights, biases, h: Array, key_mask, precision,
                     reverse_only: bool, causal: bool = False,
                     chunk: int = DEFAULT_CHUNK) -> Array:
  """``sum_c elsa(p_c, h) = sum_c Q_c S_c``, ``S_c = K_c^T diag(mask) V_c``;
  ``biases`` ``None`` leaves them out; ``causal``: the running sums of
  :func:`elsa.attention._causal_attend`, components first.

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
  if causal:  # [..., m, C, .] -> [C, ..., m, .]
    first = lambda a: jnp.moveaxis(a, -2, 0)
    return _causal_attend(first(queries), first(keys), first(values), chunk,
                          precision)
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


# --- heads and a transformer: ELSA inside the field's own models -------------

_NORMALIZE = ("keys", "none")


class MultiHeadElsa(nnx.Module):
  r"""``heads`` ELSA components side by side and an output projection: the attention layer of a model.

  Head ``j`` holds an :class:`elsa.ElsaParams` laid out for ``max_len``
  tokens (``w1, w3: [width, k]``, ``w2: [width, v]``, biases ``[max_len,
  k or v]``, held with a leading head axis ``[heads, ...]``) and computes
  :math:`o_j = \mathrm{elsa}(p_j, x) / c`, with ``c`` the number of keys
  that enter row ``i``'s sum (``i + 1`` under ``causal``, fewer where
  ``key_mask`` drops some; ``normalize="keys"``) or ``c = 1``
  (``normalize="none"``, the paper's exact scale). The output is
  :math:`[o_1, \dots, o_H] W_o + b_o`, ``W_o: [heads v, out_features]``.

  Args:
    width: feature count of the input ``x [..., m, width]``.
    heads: number of heads ``H``.
    k, v: key and value width per head (default ``width // heads``).
    out_features: output width (default ``width``).
    causal: row ``i`` reads the tokens ``j <= i`` only (default true: one
      pass predicts every prefix), by chunks of ``chunk`` (:func:`elsa.elsa`).
    use_bias: the position biases ``B1, B2, B3``; false is multi-head LSA.
    normalize: ``"keys"`` or ``"none"``, as above.
    max_len: the tokens the biases are laid out for; an input of ``m <=
      max_len`` tokens uses their first ``m`` rows.
    key_mask: ``None`` or ``[..., m]``, the tokens that enter the key/value
      sums (:func:`elsa.elsa`), held; one given at the call replaces it.
    dtype: the dtype of the computation (``None``: that of the input and
      parameters promoted, as Flax's modules); ``bfloat16`` or ``float16``
      computes in half precision, the causal running sums in float32.
    param_dtype: the dtype the parameters are held in.
    weight_init, bias_init, out_init: initialisers of ``W1, W2, W3``
      (``[width, .]`` per head), of the biases and of ``W_o``; the default
      biases are zero, so ``use_bias=True`` starts as LSA.
    precision: passed to every matmul.
    rngs: the ``params`` stream draws the initial parameters.
  """

  def __init__(self, width: int, *, heads: int, k: int | None = None,
               v: int | None = None, out_features: int | None = None,
               causal: bool = True, use_bias: bool = True,
               normalize: str = "keys", max_len: int, key_mask=None,
               chunk: int | None = None, dtype=None,
               param_dtype=jnp.float32,
               weight_init=nnx.initializers.lecun_normal(),
               bias_init=nnx.initializers.zeros_init(),
               out_init=nnx.initializers.lecun_normal(), precision=None,
               rngs: nnx.Rngs):
    fn = "MultiHeadElsa"
    width, heads, max_len = (
        _validate.int_at_least(fn, name, value, low=1) for name, value in
        (("width", width), ("heads", heads), ("max_len", max_len)))
    default = max(width // heads, 1)
    k = default if k is None else _validate.int_at_least(fn, "k", k, low=1)
    v = default if v is None else _validate.int_at_least(fn, "v", v, low=1)
    out_features = width if out_features is None else _validate.int_at_least(
        fn, "out_features", out_features, low=1)
    if normalize not in _NORMALIZE:
      raise ValueError(f"{fn}: normalize must be one of {_NORMALIZE}, got "
                       f"{normalize!r}.")
    param_dtype = _validate.floating_dtype(fn, param_dtype, "param_dtype")
    self.dtype = None if dtype is None else _validate.floating_dtype(fn, dtype)
    self.heads, self.k, self.v, self.max_len = heads, k, v, max_len
    self.causal, self.use_bias, self.normalize = bool(causal), use_bias, normalize
    self.chunk, self.precision = chunk, precision
    draw = lambda init, *shape: nnx.Param(
        init(rngs.params(), shape, param_dtype))
    self.w1 = draw(weight_init, heads, width, k)
    self.w2 = draw(weight_init, heads, width, v)
    self.w3 = draw(weight_init, heads, width, k)
    if use_bias:
      self.b1 = draw(bias_init, heads, max_len, k)
      self.b2 = draw(bias_init, heads, max_len, v)
      self.b3 = draw(bias_init, heads, max_len, k)
    self.out = nnx.Linear(heads * v, out_features, kernel_init=out_init,
                          dtype=dtype, param_dtype=param_dtype,
                          precision=precision, rngs=rngs)
    if key_mask is not None:
      self.key_mask = Mask(jnp.asarray(key_mask))

  def to_params(self) -> ElsaParams:
    """The heads' parameters, ``ElsaParams`` with leaves ``[heads, ...]``
    (zero biases without ``use_bias``); head ``j`` is ``tree.map(lambda a:
    a[j], ...)``. With :attr:`out` they are the whole layer
    (:meth:`from_params`)."""
    weights = [getattr(self, name)[...] for name in ("w1", "w2", "w3")]
    if self.use_bias:
      biases = [getattr(self, name)[...] for name in _BIASES]
    else:
      biases = [jnp.zeros((self.heads, self.max_len, w.shape[-1]), w.dtype)
                for w in (weights[0], weights[1], weights[2])]
    return ElsaParams(*weights, *biases)

  @classmethod
  def from_params(cls, params: ElsaParams, out_kernel: Array,
                  out_bias: Array | None = None, **switches) -> MultiHeadElsa:
    """The layer whose heads are ``params`` (leaves ``[heads, ...]``) and
    whose output projection is ``out_kernel [heads v, out_features]`` (and
    ``out_bias [out_features]``, default zero); ``switches`` as for
    ``__init__`` (``use_bias=False`` drops the biases)."""
    if not isinstance(params, ElsaParams):
      raise TypeError(f"MultiHeadElsa.from_params: params must be an "
                      f"ElsaParams, got {type(params).__name__}.")
    heads, width, k = params.w1.shape
    v = params.w2.shape[-1]
    out_kernel = jnp.asarray(out_kernel)
    layer = cls(width, heads=heads, k=k, v=v, max_len=params.b1.shape[-2],
                out_features=out_kernel.shape[-1],
                param_dtype=jnp.result_type(params.w1), rngs=nnx.Rngs(0),
                **switches)
    for name, leaf in zip(ElsaParams._fields, params):
      if hasattr(layer, name):
        getattr(layer, name)[...] = jnp.asarray(leaf)
    layer.out.kernel[...] = out_kernel
    layer.out.bias[...] = (jnp.zeros_like(layer.out.bias[...])
                           if out_bias is None else jnp.asarray(out_bias))
    return layer

  def __call__(self, x: Array, *, key_mask=None) -> Array:
    """``x [..., m, width] -> [..., m, out_features]``, ``m <= max_len``;
    ``key_mask [..., m]`` as for :func:`elsa.elsa` (replaces a held one)."""
    m = jnp.shape(x)[-2]
    if key_mask is None and hasattr(self, "key_mask"):
      key_mask = self.key_mask[...][..., :m]
    p = self.to_params()
    dtype = self.dtype or jnp.result_type(x, p.w1)
    p = jax.tree.map(lambda a: a.astype(dtype), p)
    x = jnp.asarray(x, dtype)
    if key_mask is not None and jnp.result_type(key_mask) != jnp.bool_:
      key_mask = jnp.asarray(key_mask, dtype)
    attend = elsa if self.use_bias else lsa
    heads = jax.vmap(lambda p: attend(
        p, x, key_mask=key_mask, causal=self.causal, chunk=self.chunk,
        precision=self.precision))(p)  # [H, ..., m, v]
    if self.normalize == "keys":
      heads = heads / _key_counts(key_mask, m, self.causal, dtype)[..., None]
    heads = jnp.moveaxis(heads, 0, -2)  # [..., m, H, v]
    return self.out(heads.reshape(*heads.shape[:-2], -1))


def _key_counts(key_mask, m: int, causal: bool, dtype) -> Array:
  """The number of keys in row ``i``'s sum, ``[..., m]``, at least 1 (a row
  that reads no key is zero either way)."""
  mask = (jnp.ones((m,), dtype) if key_mask is None
          else jnp.asarray(key_mask, dtype))
  counts = (jnp.cumsum(mask, axis=-1) if causal
            else jnp.broadcast_to(jnp.sum(mask, -1, keepdims=True),
                                  mask.shape))
  return jnp.maximum(counts, 1)


ATTENTION = ("elsa", "lsa", "softmax")


class TransformerBlock(nnx.Module):
  """A pre-LayerNorm block: ``x + attention(LN(x))``, then ``x + MLP(LN(x))``.

  ``attention``: ``"elsa"`` (:class:`MultiHeadElsa`), ``"lsa"`` (the same
  without its biases) or ``"softmax"`` (``flax.nnx.MultiHeadAttention``,
  under a causal mask when ``causal``); the rest is identical, so a
  comparison of attention kinds varies one argument. The MLP is ``width ->
  mlp_ratio width -> width`` with a GELU.
  """

  def __init__(self, width: int, *, heads: int, max_len: int,
               attention: str = "elsa", causal: bool = True,
               mlp_ratio: int = 4, k: int | None = None,
               normalize: str = "keys", chunk: int | None = None,
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if attention not in ATTENTION:
      raise ValueError(f"TransformerBlock: attention must be one of "
                       f"{ATTENTION}, got {attention!r}.")
    self.attention_kind, self.causal = attention, bool(causal)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm1 = nnx.LayerNorm(width, **common)
    self.norm2 = nnx.LayerNorm(width, **common)
    k = max(width // heads, 1) if k is None else k
    if attention == "softmax":
      self.attention = nnx.MultiHeadAttention(
          heads, width, qkv_features=heads * k, out_features=width,
          decode=False, **common)
    else:
      self.attention = MultiHeadElsa(
          width, heads=heads, k=k, v=k, causal=causal,
          use_bias=attention == "elsa", normalize=normalize, max_len=max_len,
          chunk=chunk, **common)
    self.mlp_in = nnx.Linear(width, mlp_ratio * width, **common)
    self.mlp_out = nnx.Linear(mlp_ratio * width, width, **common)

  def __call__(self, x: Array) -> Array:
    """``x [..., m, width] -> [..., m, width]``."""
    y = self.norm1(x)
    if self.attention_kind == "softmax":
      mask = nnx.make_causal_mask(y[..., 0]) if self.causal else None
      y = self.attention(y, mask=mask)
    else:
      y = self.attention(y)
    x = x + y
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class Transformer(nnx.Module):
  """A transformer for in-context learning: read-in, ``depth`` blocks, read-out.

  ``x [..., m, d_in] -> [..., m, d_out]``: a linear read-in to ``width``
  (plus a learned position embedding with ``positions=True``, GPT-2's),
  ``depth`` :class:`TransformerBlock` (pre-LayerNorm, attention, MLP,
  residual) held with a leading layer axis and applied by ``lax.scan``
  (compile time flat in depth), a final LayerNorm and a linear read-out.
  ``attention="elsa" | "lsa" | "softmax"`` is the one switch between
  architectures. On Garg et al.'s interleaved prompts
  (:func:`elsa.training.interleave`) one causal pass predicts every prefix
  (:func:`elsa.training.prefix_loss`); any prompt of ``m <= max_len``
  tokens runs.

  Args:
    d_in, d_out: token and output widths.
    width, depth, heads: model width, number of blocks, heads per block.
    max_len: the tokens the ELSA biases (and position embedding) are laid
      out for.
    attention: ``"elsa"``, ``"lsa"`` or ``"softmax"``.
    causal: every attention causal (default true).
    positions: a learned position embedding after the read-in (default
      false: the attention kinds then differ in nothing else, and ELSA's
      biases are the only position-dependent parameters).
    mlp_ratio, k, normalize, chunk: as for :class:`TransformerBlock` and
      :class:`MultiHeadElsa`.
    dtype, param_dtype: computation and parameter dtypes, as Flax's modules.
    rngs: the ``params`` stream draws the initial parameters.
  """

  def __init__(self, d_in: int, d_out: int, *, width: int = 64,
               depth: int = 2, heads: int = 2, max_len: int,
               attention: str = "elsa", causal: bool = True,
               positions: bool = False, mlp_ratio: int = 4,
               k: int | None = None, normalize: str = "keys",
               chunk: int | None = None, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    fn = "Transformer"
    d_in, d_out, width, depth, heads, max_len = (
        _validate.int_at_least(fn, name, value, low=1) for name, value in
        (("d_in", d_in), ("d_out", d_out), ("width", width), ("depth", depth),
         ("heads", heads), ("max_len", max_len)))
    if attention not in ATTENTION:
      raise ValueError(f"{fn}: attention must be one of {ATTENTION}, got "
                       f"{attention!r}.")
    self.attention, self.depth, self.max_len = attention, depth, max_len
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    # The read-in's bias starts at N(0, 1), not zero: a y token (0, ..., y)
    # reads in as y r, and the first LayerNorm of y r is sign(y) LN(r), the
    # label's magnitude gone. With an offset LN(y r + b) keeps it (PyTorch's
    # Linear, Garg et al.'s read-in, starts with a nonzero bias too). With a
    # zero bias the ELSA and LSA models sat at the zero predictor for 2k
    # steps of Adam at 1e-3 on linear regression (d = 5); with it all three
    # kinds learn (BUILD_NOTES, "The transformer").
    self.read_in = nnx.Linear(d_in, width,
                              bias_init=nnx.initializers.normal(1.0), **common)
    if positions:
      self.positions = nnx.Param(nnx.initializers.normal(0.02)(
          rngs.params(), (max_len, width), param_dtype))

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return TransformerBlock(
          width, heads=heads, max_len=max_len, attention=attention,
          causal=causal, mlp_ratio=mlp_ratio, k=k, normalize=normalize,
          chunk=chunk, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    self.blocks = blocks(rngs)
    self.norm = nnx.LayerNorm(width, **common)
    self.read_out = nnx.Linear(width, d_out, **common)

  def __call__(self, x: Array) -> Array:
    """``x [..., m, d_in] -> [..., m, d_out]``, ``m <= max_len``."""
    m = jnp.shape(x)[-2]
    if m > self.max_len:
      raise ValueError(f"Transformer: x has {m} tokens but the model is laid "
                       f"out for max_len={self.max_len}; build it with "
                       f"max_len >= {m}.")
    h = self.read_in(x)
    if hasattr(self, "positions"):
      h = h + self.positions[...][:m].astype(h.dtype)
    # A plain lax.scan over the blocks' state (leading layer axis), not
    # nnx.scan: the model then runs under jax.grad and jax.jit of a merged
    # split (the pure form the library's training code uses) as under nnx's
    # own transforms.
    graphdef, state = nnx.split(self.blocks)
    h, _ = jax.lax.scan(lambda h, layer: (nnx.merge(graphdef, layer)(h), None),
                        h, state)
    return self.read_out(self.norm(h))
