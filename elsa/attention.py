"""The ELSA primitive: extended linear self-attention and its stacks.

For an input ``h`` of ``m`` tokens (rows) by ``n`` features (columns), one
ELSA component with parameters ``p`` computes

    elsa(p, h) = (h W3 + B3) (h W1 + B1)^T (h W2 + B2)          [m, v]

with ``W1, W3: [n, k]``, ``W2: [n, v]`` and position-dependent biases
``B1, B3: [m, k]``, ``B2: [m, v]`` (one row per token). Without biases this is
the linear self-attention (LSA) of the paper, a homogeneous cubic in ``h``.

The product is evaluated right to left, ``Q @ (K^T @ V)``: the ``[m, m]``
attention matrix ``Q K^T`` is never formed. Cost per batch element is
``O(m n (k + v) + m k v)`` and memory ``O(m (k + v) + k v)``.

:func:`elsa`, :func:`lsa`, :func:`elsa_layer` and :func:`elsa_stack` take a
``key_mask``, the tokens that enter ``K^T V``, and ``causal=True``, row ``i``
reading the tokens ``j <= i`` only (by chunks, in ``O(m)`` memory).
Parameters laid out for ``M`` tokens run on any prefix of ``m <= M`` tokens
(the first ``m`` bias rows). :func:`prune` turns a concrete
(constructed, sparse) stack into a :class:`PrunedStack` that computes the
same layers without multiplying its zeros.

Reference: Hagiwara, "An extension of linear self-attention for in-context
learning", arXiv:2503.23814 (2025).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from elsa import _validate
# The library's default dtype; elsa.attention.float_dtype is kept for callers.
from elsa._validate import float_dtype

Array = jax.Array


class ElsaParams(NamedTuple):
  """Parameters of ELSA components (a pytree).

  For one component: ``w1, w3: [n, k]``, ``w2: [n, v]``, ``b1, b3: [m, k]``,
  ``b2: [m, v]``. A layer of ``C`` summed components carries a leading axis
  ``[C, ...]`` on every leaf; a stack of ``L`` layers carries ``[L, C, ...]``.
  """

  #: Key weights ``[n, k]``; the keys of ``h`` ``[m, n]`` are ``h @ w1 + b1[:m]``.
  #: A layer's leaf is ``[C, n, k]``, a stack's ``[L, C, n, k]``.
  w1: Array
  #: Value weights ``[n, v]``; the values are ``h @ w2 + b2[:m]``.
  #: A layer's leaf is ``[C, n, v]``, a stack's ``[L, C, n, v]``.
  w2: Array
  #: Query weights ``[n, k]``; the queries are ``h @ w3 + b3[:m]``.
  #: A layer's leaf is ``[C, n, k]``, a stack's ``[L, C, n, k]``.
  w3: Array
  #: Key position biases ``[M, k]``, one row per token; ``M`` is the token
  #: count the parameters are laid out for (:attr:`m`), and an input of
  #: ``m <= M`` tokens uses the first ``m`` rows. A layer's leaf is
  #: ``[C, M, k]``, a stack's ``[L, C, M, k]``.
  b1: Array
  #: Value position biases ``[M, v]``, one row per token; an input of
  #: ``m <= M`` tokens uses the first ``m`` rows. A layer's leaf is
  #: ``[C, M, v]``, a stack's ``[L, C, M, v]``.
  b2: Array
  #: Query position biases ``[M, k]``, one row per token; an input of
  #: ``m <= M`` tokens uses the first ``m`` rows. A layer's leaf is
  #: ``[C, M, k]``, a stack's ``[L, C, M, k]``.
  b3: Array

  @property
  def m(self) -> int:
    """Token count the biases are laid out for."""
    return self.b1.shape[-2]

  @property
  def n(self) -> int:
    """Feature count of the input."""
    return self.w1.shape[-2]

  @property
  def k(self) -> int:
    """Inner (query/key) width."""
    return self.w1.shape[-1]

  @property
  def v(self) -> int:
    """Value width, the feature count of the output."""
    return self.w2.shape[-1]

  @staticmethod
  def _shapes(fn: str, *, m, n, k, v, lead, dtype
              ) -> tuple[tuple[tuple[int, ...], ...], jnp.dtype]:
    """The leaf shapes ``[*lead, ...]`` in field order and the dtype, checked:
    sizes are ints ``>= 1``, the dtype floating, and the leaves must fit in
    the devices' memory (:mod:`elsa._validate`)."""
    m, n, k = (_validate.int_at_least(fn, name, value, low=1)
               for name, value in (("m", m), ("n", n), ("k", k)))
    v = n if v is None else _validate.int_at_least(fn, "v", v, low=1)
    if not isinstance(lead, (tuple, list)):
      raise TypeError(f"{fn}: lead must be a tuple of ints >= 1, got "
                      f"{lead!r}.")
    lead = tuple(_validate.int_at_least(fn, f"lead[{i}]", size, low=1)
                 for i, size in enumerate(lead))
    dtype = _validate.floating_dtype(fn, dtype)
    shapes = tuple((*lead, *shape) for shape in (
        (n, k), (n, v), (n, k), (m, k), (m, v), (m, k)))
    _validate.fits_memory(fn, _validate.array_bytes(dtype, *shapes),
                          dict(m=m, n=n, k=k, v=v, lead=lead))
    return shapes, dtype

  @classmethod
  def zeros(cls, *, m: int, n: int, k: int, v: int | None = None,
            lead: tuple[int, ...] = (), dtype=None) -> ElsaParams:
    """All-zero parameters with leaves ``[*lead, ...]`` (``v`` defaults to ``n``).

    ``m, n, k, v`` and every entry of ``lead`` are ints ``>= 1``; ``dtype``:
    floating dtype of every leaf (default: JAX's default float). Raises
    ``TypeError``/``ValueError`` otherwise, and ``ValueError`` for leaves
    that cannot fit in the devices' memory, before allocating.
    """
    shapes, dtype = cls._shapes("ElsaParams.zeros", m=m, n=n, k=k, v=v,
                                lead=lead, dtype=dtype)
    return cls(*(jnp.zeros(shape, dtype) for shape in shapes))

  @classmethod
  def init(cls, key: Array, *, m: int, n: int, k: int, v: int | None = None,
           lead: tuple[int, ...] = (), scale: float | None = None,
           bias_scale: float | None = None, dtype=None) -> ElsaParams:
    """Random normal parameters with leaves ``[*lead, ...]``.

    Args:
      key: a ``jax.random`` key; the same key gives the same parameters.
      m, n, k, v: token count, feature count, inner width, value width
        (``v`` defaults to ``n``); ints ``>= 1``.
      lead: leading axes, e.g. ``(L, C)`` for a stack; ints ``>= 1``.
      scale: standard deviation of the weights, finite and ``>= 0``;
        default ``n ** -0.5``.
      bias_scale: standard deviation of the biases; default ``scale``.
      dtype: floating dtype of every leaf (default: JAX's default float).

    Raises:
      TypeError, ValueError: as :meth:`zeros`, and for a concrete scale that
        is negative or not finite.
    """
    fn = "ElsaParams.init"
    shapes, dtype = cls._shapes(fn, m=m, n=n, k=k, v=v, lead=lead,
                                dtype=dtype)
    scale = n ** -0.5 if scale is None else scale
    bias_scale = scale if bias_scale is None else bias_scale
    _validate.at_least(fn, "scale", scale, low=0, strict=False)
    _validate.at_least(fn, "bias_scale", bias_scale, low=0, strict=False)
    keys = jax.random.split(key, len(shapes))
    stds = (scale, scale, scale, bias_scale, bias_scale, bias_scale)
    return cls(*(std * jax.random.normal(kk, shape, dtype)
                 for kk, shape, std in zip(keys, shapes, stds)))


_NAMES = ElsaParams._fields
_BIASES = ("b1", "b2", "b3")


def _check(p: ElsaParams, h: Array, *, lead: tuple[str, ...], fn: str,
           names: tuple[str, ...] = _NAMES) -> ElsaParams:
  """Validates shapes and dtypes at trace time; ``lead`` names the leading axes.

  Only the leaves in ``names`` are checked (:func:`lsa` ignores the biases,
  so it checks only the weights). Returns ``p`` for ``h``: biases laid out
  for ``M >= m`` tokens are cut to their first ``m`` rows (positions), so
  parameters laid out for ``M`` tokens run on every prefix; ``m > M`` is
  refused.
  """
  if not isinstance(p, ElsaParams):
    raise TypeError(f"{fn}: p must be an ElsaParams, got {type(p).__name__}.")
  _validate.floating(fn, "h", h)
  if jnp.ndim(h) < 2:
    raise ValueError(f"{fn}: h must have shape [..., m, n] (rank >= 2), got "
                     f"shape {jnp.shape(h)}.")
  rank = len(lead) + 2
  leaves = [(name, getattr(p, name)) for name in names]
  for name, leaf in leaves:
    if jnp.ndim(leaf) != rank:
      axes = ", ".join((*lead, "rows", "cols"))
      raise ValueError(f"{fn}: p.{name} must have rank {rank} [{axes}], got "
                       f"shape {jnp.shape(leaf)}.")
    _validate.same_dtype(fn, f"p.{name}", leaf, "h", h)
  m, n = jnp.shape(h)[-2:]
  k, v = p.w1.shape[-1], p.w2.shape[-1]
  lead_shape = p.w1.shape[:-2]
  biases = [name for name in names if name in _BIASES]
  if biases:
    laid_out = max(jnp.shape(getattr(p, name))[-2] for name in biases)
    if laid_out < m:
      raise ValueError(
          f"{fn}: p is laid out for m={laid_out} tokens (the rows of its "
          f"biases) but h of shape {jnp.shape(h)} has {m}; a stack runs on "
          f"prefixes of m <= {laid_out} tokens only, so build p for m={m} "
          f"(or more), or give h at most {laid_out} tokens.")
  else:
    laid_out = m
  expected = dict(w1=(n, k), w2=(n, v), w3=(n, k), b1=(laid_out, k),
                  b2=(laid_out, v), b3=(laid_out, k))
  for name, leaf in leaves:
    want = (*lead_shape, *expected[name])
    if jnp.shape(leaf) != want:
      raise ValueError(
          f"{fn}: p.{name} must have shape {want} for h of shape "
          f"{jnp.shape(h)} (m={laid_out}, n={n}, k={k}, v={v}), got "
          f"{jnp.shape(leaf)}.")
  if laid_out == m:
    return p
  return p._replace(**{name: getattr(p, name)[..., :m, :] for name in biases})


def _key_mask(key_mask, h: Array, fn: str) -> tuple[Array, Array | None]:
  """Checks ``key_mask [..., m]`` against ``h [..., m, n]``; returns both
  broadcast to their common batch axes, the mask in the dtype of ``h``
  (``None`` stays ``None``)."""
  if key_mask is None:
    return h, None
  dtype = jnp.result_type(key_mask)
  if dtype != jnp.bool_ and dtype != jnp.result_type(h):
    raise TypeError(f"{fn}: key_mask must be bool or have the dtype of h "
                    f"({jnp.result_type(h)}), got {dtype}.")
  m = jnp.shape(h)[-2]
  shape = jnp.shape(key_mask)
  if len(shape) < 1 or shape[-1] != m:
    raise ValueError(f"{fn}: key_mask must have shape [..., m] with m={m} "
                     f"(the tokens of h {jnp.shape(h)}), got shape {shape}.")
  if len(shape) >= 2 and len(shape) > jnp.ndim(h) - 1 and shape[-2] == m:
    # [..., m, m] with more axes than h has batch axes: a per-query mask
    # (causal, say), which would otherwise broadcast as m masks of the keys.
    raise ValueError(
        f"{fn}: key_mask of shape {shape} looks like a per-query [m, m] mask "
        f"for h {jnp.shape(h)}; key_mask is one mask per item over the keys, "
        "[..., m] with batch axes of h. For 'row i reads tokens j <= i' pass "
        "causal=True (it composes with a key_mask [..., m]).")
  try:
    batch = jnp.broadcast_shapes(jnp.shape(h)[:-2], shape[:-1])
  except ValueError:
    raise ValueError(f"{fn}: the batch axes of key_mask {shape} (all but the "
                     f"last) must broadcast with those of h {jnp.shape(h)} "
                     "(all but the last 2).") from None
  h = jnp.broadcast_to(h, (*batch, *jnp.shape(h)[-2:]))
  return h, jnp.broadcast_to(key_mask, (*batch, m)).astype(h.dtype)


def _masked(keys: Array, key_mask: Array | None) -> Array:
  """``diag(mask) K``: the keys ``[..., m, k]`` of masked-out tokens set to 0."""
  return keys if key_mask is None else keys * key_mask[..., None]


def _attend(q: Array, k: Array, v: Array, precision) -> Array:
  """``q @ (k^T @ v)`` over the last two axes, never forming ``q @ k^T``."""
  kv = jnp.einsum("...mk,...mv->...kv", k, v, precision=precision)
  return jnp.einsum("...mk,...kv->...mv", q, kv, precision=precision)


# Default causal chunk, measured: the causal elsa forward (jit, float32,
# n = k = v = 32) on this shared 2-core CPU at m = 4096 took 2.0 / 1.8 / 1.9 /
# 2.5 / 3.9 ms at chunk = 32 / 64 / 128 / 256 / 512 (twice, the same order);
# at m = 16384 the runs were noisy (7.7-29 ms), no chunk consistently ahead.
# Fewer scan steps against a larger [chunk, chunk] block each: 64.
DEFAULT_CHUNK = 64


def _chunk(fn: str, chunk) -> int:
  """``chunk`` checked: ``None`` is :data:`DEFAULT_CHUNK`, else an int ``>= 1``."""
  if chunk is None:
    return DEFAULT_CHUNK
  return _validate.int_at_least(fn, "chunk", chunk, low=1)


def _causal_attend(q: Array, k: Array, v: Array, chunk: int,
                   precision) -> Array:
  """Causal attention summed over components: row ``i`` is
  ``sum_c q_ci sum_{j <= i} k_cj^T v_cj``.

  ``q, k: [C, ..., m, k]``, ``v: [C, ..., m, v]`` (a leading component axis,
  summed over); returns ``[..., m, v]``. ``lax.scan`` over chunks of
  ``chunk`` tokens carries the running state ``S = sum_c K_c^T V_c`` of the
  earlier chunks, ``[C, ..., k, v]``: a chunk's output is its masked
  ``[chunk, chunk]`` product ``tril(Q K^T) V`` plus ``Q S``, so no ``[m, m]``
  array is formed and memory is ``O(m (k + v) + (m / chunk) k v)`` with the
  gradient. ``m`` not a multiple of ``chunk``: zero keys and values pad the
  last chunk (they add nothing to any sum) and the padded rows are dropped.
  """
  ein = functools.partial(jnp.einsum, precision=precision)
  m = q.shape[-2]
  size = min(chunk, m)
  count = -(-m // size)
  pad = count * size - m

  def chunks(x):  # [C, ..., m, d] -> [count, C, ..., size, d]
    if pad:
      x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)])
    x = x.reshape(*x.shape[:-2], count, size, x.shape[-1])
    return jnp.moveaxis(x, -3, 0)

  tril = jnp.tril(jnp.ones((size, size), bool))

  dtype = jnp.result_type(q, k, v)
  # Half-precision inputs: the running sums accumulate in float32 (a sum
  # over m tokens in bfloat16 keeps 8 bits of it); the output is cast back.
  acc = jnp.promote_types(dtype, jnp.float32)

  def step(state, block):
    qb, kb, vb = block
    scores = jnp.where(tril, ein("c...ik,c...jk->c...ij", qb, kb), 0)
    out = (ein("c...ij,c...jv->...iv", scores, vb, preferred_element_type=acc)
           + ein("c...ik,c...kv->...iv", qb.astype(acc), state))
    return (state + ein("c...jk,c...jv->c...kv", kb, vb,
                        preferred_element_type=acc), out.astype(dtype))

  state = jnp.zeros((*k.shape[:-2], k.shape[-1], v.shape[-1]), acc)
  _, out = jax.lax.scan(step, state, (chunks(q), chunks(k), chunks(v)))
  out = jnp.moveaxis(out, 0, -3)  # [..., count, size, v]
  return out.reshape(*out.shape[:-3], count * size, out.shape[-1])[..., :m, :]


def _elsa(p: ElsaParams, h: Array, precision, key_mask=None,
          causal: bool = False, chunk: int = DEFAULT_CHUNK) -> Array:
  """``(h W3 + B3) S`` as ``h (W3 S) + B3 S`` with ``S = K^T V``.

  The re-association never materialises ``Q = h W3 + B3``: one fewer
  ``[m, k]`` array written and read again (and one fewer elementwise pass),
  the same FLOPs up to the ``[n, k] @ [k, v]`` product ``W3 S``. Causal, each
  row has its own ``S`` (:func:`_causal_attend`), so ``Q`` is formed.
  """
  mm = lambda a, b: jnp.matmul(a, b, precision=precision)
  keys = _masked(mm(h, p.w1) + p.b1, key_mask)
  values = mm(h, p.w2) + p.b2
  if causal:
    return _causal_attend((mm(h, p.w3) + p.b3)[None], keys[None],
                          values[None], chunk, precision)
  kv = jnp.einsum("...mk,...mv->...kv", keys, values, precision=precision)
  return mm(h, mm(p.w3, kv)) + mm(p.b3, kv)


def elsa(p: ElsaParams, h: Array, *, key_mask=None, causal: bool = False,
         chunk: int | None = None, precision=None) -> Array:
  r"""One ELSA component: :math:`(hW_3 + B_3)(hW_1 + B_1)^\top(hW_2 + B_2)`.

  Args:
    p: parameters of one component, ``w1, w3: [n, k]``, ``w2: [n, v]``,
      ``b1, b3: [M, k]``, ``b2: [M, v]`` laid out for ``M >= m`` tokens: the
      bias rows are positions, and ``h`` of ``m < M`` tokens (a prefix) uses
      the first ``m`` rows. ``m > M`` is refused.
    h: input tokens ``[..., m, n]``; leading axes are batch and broadcast.
    key_mask: ``None`` (every token enters the key/value sum) or ``[..., m]``,
      bool or in the dtype of ``h``: the sum becomes
      :math:`K^\top \mathrm{diag}(\mathrm{mask})\, V`, so a token with mask
      0 reads (its query row is computed) but is not read. Excluding the
      query tokens is the masked LSA of von Oswald et al. (2023) and Ahn et
      al. (2023); no bias can do it, since ``diag(mask) (h W1 + B1)`` is not
      affine in ``h`` with a fixed ``W1``. Leading axes broadcast with those
      of ``h``.
    causal: if true, row ``i`` attends only to the tokens ``j <= i``:
      :math:`(hW_3 + B_3)_i \sum_{j \le i} (hW_1 + B_1)_j^\top (hW_2 + B_2)_j`
      (composed with ``key_mask``: a key enters where both allow).
      Evaluated by chunks of ``chunk`` tokens, a ``lax.scan`` carrying the
      running ``[k, v]`` sum of the earlier chunks: memory ``O(m)``, never
      an ``[m, m]`` array beyond one ``[chunk, chunk]`` block.
    chunk: tokens per chunk under ``causal``, an int ``>= 1`` (``None``:
      :data:`DEFAULT_CHUNK`, measured); ignored otherwise. Any ``m``: the
      last chunk is padded with keys that enter no sum.
    precision: passed to every matmul (``jax.lax.Precision``). At the
      default, float32 matmuls on TPU and Ampere-or-newer GPUs run in
      bfloat16/TF32; on TPU and Ampere-or-newer GPUs use
      ``precision='highest'`` for float32-exact products (CPU is always
      exact).

  Returns:
    ``[..., m, v]``, in the dtype of ``h``.

  Raises:
    ValueError: a shape or rank of ``p`` does not match ``h``, ``h`` has
      more tokens than ``p`` is laid out for, or ``key_mask`` is not
      ``[..., m]`` (a per-query ``[m, m]`` mask names ``causal=True``).
    TypeError: a dtype is not floating or ``p`` and ``h`` disagree.

  Example:
    >>> p = ElsaParams.init(jax.random.key(0), m=5, n=3, k=2)
    >>> elsa(p, jnp.ones((5, 3))).shape
    (5, 3)
  """
  p = _check(p, h, lead=(), fn="elsa")
  chunk = _chunk("elsa", chunk)
  h, key_mask = _key_mask(key_mask, h, "elsa")
  return _elsa(p, h, precision, key_mask, causal, chunk)


def lsa(p: ElsaParams, h: Array, *, key_mask=None, causal: bool = False,
        chunk: int | None = None, precision=None) -> Array:
  r"""Linear self-attention, the bias-free baseline: :math:`(hW_3)(hW_1)^\top(hW_2)`.

  Takes the same ``p`` as :func:`elsa` and ignores its biases: they are
  neither used nor checked, so parameters laid out for another token count
  ``m`` work. It is a homogeneous cubic: ``lsa(p, c * h) == c**3 * lsa(p, h)``.

  Args:
    p: as for :func:`elsa`; ``b1, b2, b3`` are not used (any shape).
    h: ``[..., m, n]``.
    key_mask, causal, chunk: as for :func:`elsa`.
    precision: passed to every matmul.

  Returns:
    ``[..., m, v]``.
  """
  _check(p, h, lead=(), fn="lsa", names=("w1", "w2", "w3"))
  chunk = _chunk("lsa", chunk)
  h, key_mask = _key_mask(key_mask, h, "lsa")
  mm = lambda a, b: jnp.matmul(a, b, precision=precision)
  q, k, v = mm(h, p.w3), _masked(mm(h, p.w1), key_mask), mm(h, p.w2)
  if causal:
    return _causal_attend(q[None], k[None], v[None], chunk, precision)
  return _attend(q, k, v, precision)


# Stacks of at most this many layers are unrolled (elsa_stack and
# elsa.nn.residual_stack): XLA:CPU runs the rolled loop of a training step,
# which writes each layer's saved values into the loop's stacked buffers and
# reads them back, slower (docs/guides/speed.md, "The training step");
# deeper stacks stay rolled, so compile time stays flat in L.
UNROLLED_DEPTH = 4

# Per-item K^T V at most this many multiply-adds (m k v) keeps tokens before
# components and is contracted per item (_small_token_contraction); above it,
# one dot per component (docs/guides/speed.md, "The sweep kernel").
_SMALL_CONTRACTION = 2 ** 15


def _small_token_contraction(keys: Array, values: Array, precision,
                             layout: str | None = None) -> Array:
  """``S = K^T V`` per item and component: ``[..., C, k, v]`` from
  ``keys [..., m, C, k]`` and ``values [..., m, C, v]``.

  ``layout``: ``"dot"`` (a batched dot over items and components) or
  ``"multiply_sum"`` (elementwise products summed over tokens, in the dtype of
  the inputs). ``None`` is the dot, in every dtype: XLA:CPU runs it faster
  than the multiply-and-sum in float64, as fast forward in float32, and its
  gradient faster (docs/guides/speed.md, "The sweep kernel"); for
  float32-exact products on TPU and GPU pass ``precision="highest"``, as for
  every matmul here.
  """
  if layout is None or layout == "dot":
    return jnp.einsum("...mck,...mcv->...ckv", keys, values,
                      precision=precision)
  if layout != "multiply_sum":
    raise ValueError(f"_small_token_contraction: unknown layout {layout!r}.")
  return jnp.sum(keys[..., :, None] * values[..., None, :], axis=-4)


def _layer(p: ElsaParams, h: Array, precision, coeffs=None,
           key_mask=None, causal: bool = False,
           chunk: int = DEFAULT_CHUNK) -> Array:
  """``sum_c elsa(p_c, h) diag(a_c)`` as ``h (sum_c W3_c S_c) + sum_c B3_c S_c``,
  ``S_c = K_c^T V_c diag(a_c)``; ``a_c = 1`` when ``coeffs`` is ``None``.

  Summing the ``[n, v]`` and ``[m, v]`` pieces over components first leaves
  one ``[m, n] @ [n, v]`` product per layer instead of one per component.
  ``coeffs``: ``None`` or ``[*batch, C, v]`` (or ``[*batch, C, 1]``) with
  ``batch`` the batch axes of ``h``; it scales the smallest per-item piece,
  ``S_c: [k, v]``. ``key_mask``: ``None`` or ``[*batch, m]`` in the dtype of
  ``h`` (:func:`elsa`).

  Two layouts of the same sums: small items (``m k v`` up to
  ``_SMALL_CONTRACTION``) keep tokens before components, ``[..., m, C, k]``,
  and contract tokens per item (:func:`_small_token_contraction`); large
  ones put components first, ``[C, ..., m, k]``, so that ``K^T V`` is one
  dot per component. ``causal``: components first, and
  :func:`_causal_attend` sums them chunk by chunk (``a_c`` scales the
  values, ``Q K^T V diag(a) = Q K^T (V diag(a))``).
  """
  ein = functools.partial(jnp.einsum, precision=precision)
  m, k, v = jnp.shape(h)[-2], p.w1.shape[-1], p.w2.shape[-1]
  if causal:
    per_component = lambda b: b.reshape(b.shape[:1] + (1,) * (jnp.ndim(h) - 2)
                                        + b.shape[1:])
    project = lambda w, b: ein("...mn,cnk->c...mk", h, w) + per_component(b)
    values = project(p.w2, p.b2)
    if coeffs is not None:  # [..., C, v] -> [C, ..., 1, v]
      values = values * jnp.moveaxis(coeffs, -2, 0)[..., None, :]
    return _causal_attend(project(p.w3, p.b3),
                          _masked(project(p.w1, p.b1), key_mask), values,
                          chunk, precision)
  if m * k * v <= _SMALL_CONTRACTION:
    # [C, m, .] -> [m, C, .] lines up with [..., m, C, .].
    keys = ein("...mn,cnk->...mck", h, p.w1) + jnp.moveaxis(p.b1, 0, 1)
    if key_mask is not None:
      keys = keys * key_mask[..., None, None]
    values = ein("...mn,cnv->...mcv", h, p.w2) + jnp.moveaxis(p.b2, 0, 1)
    s = _small_token_contraction(keys, values, precision)
  else:
    # Biases [C, m, .] line up with [C, ..., m, .] as [C, 1.., m, .].
    per_component = lambda b: b.reshape(b.shape[:1] + (1,) * (jnp.ndim(h) - 2)
                                        + b.shape[1:])
    keys = _masked(ein("...mn,cnk->c...mk", h, p.w1) + per_component(p.b1),
                   key_mask)
    values = ein("...mn,cnv->c...mv", h, p.w2) + per_component(p.b2)
    s = jnp.moveaxis(ein("c...mk,c...mv->c...kv", keys, values), 0, -3)
  if coeffs is not None:
    s = s * coeffs[..., None, :]  # [..., C, k, v] times [..., C, 1, v]
  return (ein("...mn,...nv->...mv", h, ein("cnk,...ckv->...nv", p.w3, s))
          + ein("cmk,...ckv->...mv", p.b3, s))


def _check_square(p: ElsaParams, h: Array, fn: str) -> None:
  if p.w2.shape[-1] != jnp.shape(h)[-1]:
    raise ValueError(
        f"{fn}: a layer maps h to a state of the same shape, so p.w2 must have "
        f"v == n == {jnp.shape(h)[-1]} columns, got p.w2 of shape "
        f"{jnp.shape(p.w2)}.")


def _coefficients(coeffs, p: ElsaParams, h: Array, *, lead: tuple[str, ...],
                  fn: str) -> tuple[Array, Array | None]:
  """Checks ``coeffs [..., *lead, v or 1]`` against ``p`` and ``h``; broadcasts both.

  Returns ``h`` as ``[*batch, m, n]`` and ``coeffs`` as ``[*lead[:-1],
  *batch, C, v or 1]`` (the layer axis first, for ``lax.scan``), ``batch``
  the broadcast of the batch axes of ``h`` and of ``coeffs``; ``coeffs``
  unchanged when ``None``.
  """
  if coeffs is None:
    return h, None
  want = p.w1.shape[:len(lead)]
  v = p.w2.shape[-1]
  names = ", ".join(f"{axis}={size}" for axis, size in zip(lead, want))
  if not hasattr(coeffs, "dtype"):  # Python numbers take the dtype of h.
    coeffs = jnp.asarray(coeffs, jnp.result_type(h))
  if jnp.result_type(coeffs) != jnp.result_type(h):
    raise TypeError(f"{fn}: coeffs has dtype {jnp.result_type(coeffs)} but h "
                    f"has dtype {jnp.result_type(h)}; cast one of them "
                    "explicitly.")
  shape, tail = jnp.shape(coeffs), len(lead) + 1
  if (len(shape) < tail or shape[len(shape) - tail:-1] != want
      or shape[-1] not in (1, v)):
    raise ValueError(
        f"{fn}: coeffs must have shape [..., {', '.join(lead)}, v] = [..., "
        f"{names}, {v}] (per output column) or [..., {names}, 1] (one scalar "
        f"per component), the leading axes of p, got shape {shape}.")
  try:
    batch = jnp.broadcast_shapes(jnp.shape(h)[:-2],
                                 shape[:len(shape) - tail])
  except ValueError:
    raise ValueError(f"{fn}: the batch axes of coeffs {shape} (all but the "
                     f"last {tail}) must broadcast with those of h "
                     f"{jnp.shape(h)} (all but the last 2).") from None
  h = jnp.broadcast_to(h, (*batch, *jnp.shape(h)[-2:]))
  coeffs = jnp.broadcast_to(coeffs, (*batch, *want, shape[-1]))
  # [*batch, (L,) C, v] -> [(L,) *batch, C, v]
  layer_axes = range(len(lead) - 1)
  return h, jnp.moveaxis(coeffs, [len(batch) + i for i in layer_axes],
                         list(layer_axes))


def elsa_layer(p: ElsaParams, h: Array, *, coeffs=None, key_mask=None,
               causal: bool = False, chunk: int | None = None,
               precision=None) -> Array:
  r"""One ELSA layer: the sum of ``C`` components, :math:`\sum_c \mathrm{elsa}(p_c, h)\, \mathrm{diag}(a_c)`.

  There is no implicit residual: a skip connection is itself a component
  (see :func:`elsa.constructions.identity`).

  Args:
    p: leaves with a leading component axis ``[C, ...]``, and ``v == n``.
    h: ``[..., m, n]``.
    coeffs: ``None`` (every ``a_c = 1``), or per-item coefficients in the
      dtype of ``h``: ``[..., C, v]`` scales output column ``j`` of component
      ``c`` by ``a[..., c, j]``, ``[..., C, 1]`` the whole component. The
      leading axes broadcast with those of ``h``. They let one shared ``p``
      serve items that differ only in runtime scalars (a step size, a ridge
      strength): the projections run once over all items as one matmul, and
      ``a_c`` scales ``S_c = K_c^\top V_c``, which is exact
      (:math:`Q K^\top V \mathrm{diag}(a) = Q (K^\top V \mathrm{diag}(a))`).
    key_mask: ``None`` or ``[..., m]``: the tokens that enter every
      component's key/value sum (see :func:`elsa`).
    causal, chunk: row ``i`` of every component attends to ``j <= i``
      only, by chunks (see :func:`elsa`).
    precision: passed to every matmul.

  Returns:
    ``[..., m, n]``, the leading axes broadcast from ``h`` and ``coeffs``.

  Raises:
    ValueError: a shape does not match (``coeffs`` must end in ``C, v`` or
      ``C, 1``; its leading axes must broadcast with those of ``h``).
    TypeError: a dtype is not floating or differs from that of ``h``.
  """
  p = _check(p, h, lead=("C",), fn="elsa_layer")
  _check_square(p, h, "elsa_layer")
  chunk = _chunk("elsa_layer", chunk)
  h, coeffs = _coefficients(coeffs, p, h, lead=("C",), fn="elsa_layer")
  h, key_mask = _key_mask(key_mask, h, "elsa_layer")
  if key_mask is not None and coeffs is not None:
    coeffs = jnp.broadcast_to(coeffs, (*h.shape[:-2], *coeffs.shape[-2:]))
  return _layer(p, h, precision, coeffs, key_mask=key_mask, causal=causal,
                chunk=chunk)


def elsa_stack(p: ElsaParams, h: Array, *, return_all: bool = False,
               coeffs=None, key_mask=None, causal: bool = False,
               chunk: int | None = None, precision=None) -> Array:
  """``L`` ELSA layers applied in order by ``lax.scan`` (compile time flat in ``L``;
  unrolled up to ``UNROLLED_DEPTH = 4`` layers).

  Args:
    p: leaves with leading axes ``[L, C, ...]`` and ``v == n``.
    h: ``[..., m, n]``, the state before the first layer.
    return_all: if true, return every state ``h_0 = h, h_1, ..., h_L``.
    coeffs: ``None`` or ``[..., L, C, v]`` (or ``[..., L, C, 1]``): layer
      ``t`` is ``elsa_layer(p[t], h, coeffs=coeffs[..., t, :, :])`` (see
      :func:`elsa_layer`). With ``p`` a fixed basis of components and the
      runtime scalars in ``coeffs`` (e.g.
      :meth:`elsa.forms.GDForm.gd_basis` and ``gd_coefficients``), a batch
      of items with different scalars shares one ``p``.
    key_mask: ``None`` or ``[..., m]``: the tokens that enter the key/value
      sums of every layer (see :func:`elsa`).
    causal, chunk: every layer causal, by chunks (see :func:`elsa`).
    precision: passed to every matmul.

  Returns:
    ``[..., m, n]``, the state after layer ``L``; or ``[L + 1, ..., m, n]``
    with ``return_all``. The leading axes broadcast from ``h`` and
    ``coeffs``.

  Raises:
    ValueError: a shape does not match (``coeffs`` must end in ``L, C, v``
      or ``L, C, 1``; its leading axes must broadcast with those of ``h``).
    TypeError: a dtype is not floating or differs from that of ``h``.
  """
  p = _check(p, h, lead=("L", "C"), fn="elsa_stack")
  _check_square(p, h, "elsa_stack")
  chunk = _chunk("elsa_stack", chunk)
  h, coeffs = _coefficients(coeffs, p, h, lead=("L", "C"), fn="elsa_stack")
  h, key_mask = _key_mask(key_mask, h, "elsa_stack")
  if key_mask is not None and coeffs is not None:
    coeffs = jnp.broadcast_to(coeffs, (coeffs.shape[0], *h.shape[:-2],
                                       *coeffs.shape[-2:]))

  def step(state, layer):
    layer_params, layer_coeffs = layer
    new = _layer(layer_params, state, precision, layer_coeffs,
                 key_mask=key_mask, causal=causal, chunk=chunk)
    return new, (new if return_all else None)

  last, states = jax.lax.scan(step, h, (p, coeffs),
                              unroll=p.w1.shape[0] <= UNROLLED_DEPTH)
  if not return_all:
    return last
  return jnp.concatenate([h[None], states], axis=0)


# --- a stack with its exact-zero work removed --------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Segment:
  """Layers ``[start, stop)`` of a :class:`PrunedStack`, which share one zero pattern.

  ``dynamic``: ``(c, inner, value)`` per component whose keys or values read
  ``h``: its index and its kept inner and value columns (numpy ints). The
  other components with a nonzero output have keys and values that do not
  read ``h``: ``skips`` (indices) are scaled skips (``G`` diagonal, ``E =
  0``), ``constant`` the rest. ``arrays``: the per-layer arrays, leading axis
  ``stop - start``: one pruned ``ElsaParams`` per dynamic component, the
  skips' diagonals ``[Cs, n]``, then ``G [Cc, n, v]`` and ``E [Cc, m, v]``.
  """

  start: int
  stop: int
  dynamic: tuple[tuple[int, np.ndarray, np.ndarray], ...]
  skips: np.ndarray
  constant: np.ndarray
  arrays: tuple


def _prune_segment(p: ElsaParams, start: int, stop: int) -> _Segment:
  """:class:`_Segment` of layers ``[start, stop)`` of concrete ``p``."""
  p = ElsaParams(*(np.asarray(a[start:stop]) for a in p))
  nz = lambda a, axes: np.any(a != 0, axis=axes)
  dynamic, dynamic_arrays = [], []
  constant = []
  for c in range(p.w1.shape[1]):
    q = ElsaParams(*(a[:, c] for a in p))  # leaves [layers, ...]
    if not (nz(q.w1, None) or nz(q.w2, None)):
      constant.append(c)
      continue
    # Inner columns with a key part and a query part; value columns with a
    # value part (over every layer of the segment).
    inner = np.flatnonzero((nz(q.w1, (0, 1)) | nz(q.b1, (0, 1)))
                           & (nz(q.w3, (0, 1)) | nz(q.b3, (0, 1))))
    value = np.flatnonzero(nz(q.w2, (0, 1)) | nz(q.b2, (0, 1)))
    if inner.size and value.size:
      dynamic.append((c, inner, value))
      dynamic_arrays.append(ElsaParams(
          w1=q.w1[..., inner], w2=q.w2[..., value], w3=q.w3[..., inner],
          b1=q.b1[..., inner], b2=q.b2[..., value], b3=q.b3[..., inner]))
  highest = functools.partial(jnp.einsum, precision="highest")
  const = ElsaParams(*(a[:, constant] for a in p))
  s = highest("lcmk,lcmv->lckv", const.b1, const.b2)  # S = B1^T B2
  g = np.asarray(highest("lcnk,lckv->lcnv", const.w3, s))
  e = np.asarray(highest("lcmk,lckv->lcmv", const.b3, s))
  constant = np.asarray(constant, int)
  kept = nz(g, (0, 2, 3)) | nz(e, (0, 2, 3))
  off_diagonal = g * (1 - np.eye(g.shape[-2], dtype=g.dtype))
  skip = kept & ~nz(e, (0, 2, 3)) & ~nz(off_diagonal, (0, 2, 3))
  general = kept & ~skip
  return _Segment(start, stop, tuple(dynamic), constant[skip],
                  constant[general],
                  tuple(jax.tree.map(jnp.asarray, dynamic_arrays))
                  + (jnp.asarray(np.diagonal(g[:, skip], axis1=-2, axis2=-1)),
                     jnp.asarray(g[:, general]), jnp.asarray(e[:, general])))


@dataclasses.dataclass(frozen=True, eq=False)
class PrunedStack:
  r"""A stack of concrete parameters with the work its zeros do taken out.

  Built by :func:`prune`; ``pruned(h, coeffs=a)`` equals
  ``elsa_stack(p, h, coeffs=a)`` for finite ``h`` (the dropped terms are
  exact zeros; only the order of the sums that remain changes). The layers
  are cut into runs that share one zero pattern; in each run, a component
  whose ``W1`` and ``W2`` are zero has keys and values that do not read
  ``h``: its :math:`S = B_1^\top B_2` is folded once into :math:`G = W_3 S`
  and :math:`E = B_3 S`, and a component that is a scaled skip (``G``
  diagonal, ``E = 0``) costs one elementwise product. Every other component
  keeps only its inner columns with both a key and a query part and its
  value columns with a value part (a gradient head reads ``d`` columns and
  writes one).

  Not a pytree: close over it (its index arrays are static) rather than
  passing it through ``jit``.
  """

  segments: tuple[_Segment, ...]
  m: int
  n: int
  components: int
  dtype: jnp.dtype

  @property
  def depth(self) -> int:
    return self.segments[-1].stop

  def _layer(self, segment: _Segment, arrays, h: Array, coeffs: Array,
             precision) -> Array:
    """One layer of ``segment`` on ``h [..., m, n]``; ``coeffs [..., C, v or 1]``."""
    ein = functools.partial(jnp.einsum, precision=precision)
    a = coeffs
    per_column = lambda index: jnp.broadcast_to(
        a[..., index, :], (*a.shape[:-2], len(index), self.n))
    diag, g, e = arrays[len(segment.dynamic):]
    out = jnp.zeros(jnp.shape(h), h.dtype)
    if len(segment.skips):
      out = h * ein("cn,...cn->...n", diag, per_column(segment.skips))[
          ..., None, :]
    if len(segment.constant):
      a_const = per_column(segment.constant)
      out = out + (ein("...mn,...nv->...mv", h,
                       ein("cnv,...cv->...nv", g, a_const))
                   + ein("cmv,...cv->...mv", e, a_const))
    for (c, _, value), q in zip(segment.dynamic, arrays):
      keys = ein("...mn,nk->...mk", h, q.w1) + q.b1
      values = ein("...mn,nv->...mv", h, q.w2) + q.b2
      # A dot, as every product here: at widths of a few columns XLA:CPU
      # runs it faster than the multiply-and-sum of elsa_layer's small items.
      s = ein("...mk,...mv->...kv", keys, values)
      a_c = a[..., c, :] if a.shape[-1] == 1 else a[..., c, value]
      s = s * a_c[..., None, :]
      out = out.at[..., value].add(ein("...mn,...nv->...mv", h, q.w3 @ s)
                                   + ein("mk,...kv->...mv", q.b3, s))
    return out

  def scan(self, f, h: Array, *, coeffs=None, precision=None):
    """``lax.scan`` over the layers: ``(h_L, stacked f(h_t) for t = 1..L)``.

    ``h [..., m, n]``; ``coeffs`` ``None`` or ``[..., L, C, v or 1]`` as for
    :func:`elsa_stack`; ``f`` maps a state to what is kept of it (a pytree).
    """
    fn = "PrunedStack"
    if jnp.shape(h)[-2:] != (self.m, self.n):
      raise ValueError(f"{fn}: h must have shape [..., {self.m}, {self.n}], "
                       f"got {jnp.shape(h)}.")
    _validate.floating(fn, "h", h)
    if jnp.result_type(h) != self.dtype:
      raise TypeError(f"{fn}: h has dtype {jnp.result_type(h)} but the "
                      f"parameters have dtype {self.dtype}; cast one of them "
                      "explicitly.")
    if coeffs is None:
      coeffs = jnp.ones((self.depth, self.components, 1), self.dtype)
    shape = ElsaParams.zeros(m=self.m, n=self.n, k=1, lead=(
        self.depth, self.components), dtype=self.dtype)
    h, coeffs = _coefficients(coeffs, shape, h, lead=("L", "C"), fn=fn)
    coeffs = jnp.broadcast_to(coeffs, (self.depth, *jnp.shape(h)[:-2],
                                       *coeffs.shape[-2:]))
    kept = []
    for segment in self.segments:
      def step(state, layer, segment=segment):
        arrays, layer_coeffs = layer
        new = self._layer(segment, arrays, state, layer_coeffs, precision)
        return new, f(new)
      h, out = jax.lax.scan(step, h, (segment.arrays,
                                      coeffs[segment.start:segment.stop]))
      kept.append(out)
    return h, jax.tree.map(lambda *parts: jnp.concatenate(parts), *kept)

  def __call__(self, h: Array, *, coeffs=None, return_all: bool = False,
               precision=None) -> Array:
    """As :func:`elsa_stack`: the last state, or all ``L + 1`` with ``return_all``."""
    last, states = self.scan((lambda s: s) if return_all else (lambda s: None),
                             h, coeffs=coeffs, precision=precision)
    if not return_all:
      return last
    h = jnp.broadcast_to(h, states.shape[1:])
    return jnp.concatenate([h[None], states], axis=0)


def prune(p: ElsaParams) -> PrunedStack:
  """``p`` (concrete, leaves ``[L, C, ...]``, ``v == n``) as a :class:`PrunedStack`.

  Constructed stacks are sparse: a skip component's keys and values do not
  read ``h``, a gradient head reads a few columns and writes one.
  :func:`elsa_stack` multiplies those zeros for every item; the pruned stack
  computes the same layers without them, for a sweep of many items through
  one shared basis (their scalars in ``coeffs``).

  Raises:
    TypeError: ``p`` is not :class:`ElsaParams`, or a leaf is traced (prune
      outside ``jit`` and close over the result) or not floating.
    ValueError: a leaf is not of rank 4 or not finite (the pruned stack
      equals the dense one only for finite parameters: a dropped zero times
      an infinite entry is NaN in the dense stack); shapes as for
      :func:`elsa_stack`.
  """
  fn = "prune"
  if not isinstance(p, ElsaParams):
    raise TypeError(f"{fn}: p must be an ElsaParams with leaves [L, C, ...], "
                    f"got {type(p).__name__}.")
  if any(isinstance(leaf, jax.core.Tracer) for leaf in p):
    raise TypeError("prune: p must be concrete (call prune outside jit and "
                    "close over the PrunedStack); got a traced leaf.")
  for name, leaf in zip(_NAMES, p):
    _validate.floating(fn, f"p.{name}", leaf)
    if jnp.ndim(leaf) != 4:
      raise ValueError(f"{fn}: p.{name} must have rank 4 [L, C, rows, cols], "
                       f"got shape {jnp.shape(leaf)}.")
    _validate.finite(fn, f"p.{name}", leaf)
  m, n = p.b1.shape[-2], p.w1.shape[-2]
  h = jnp.zeros((m, n), jnp.result_type(p.w1))
  _check(p, h, lead=("L", "C"), fn="prune")
  _check_square(p, h, "prune")
  # Runs of consecutive layers with one zero pattern share a segment.
  pattern = lambda t: b"".join(np.packbits(np.asarray(a[t]) != 0).tobytes()
                               for a in p)
  cuts = [t for t in range(1, p.w1.shape[0]) if pattern(t) != pattern(t - 1)]
  bounds = list(zip([0, *cuts], [*cuts, p.w1.shape[0]]))
  return PrunedStack(tuple(_prune_segment(p, a, b) for a, b in bounds),
                     m=m, n=n, components=p.w1.shape[1],
                     dtype=jnp.result_type(p.w1))
