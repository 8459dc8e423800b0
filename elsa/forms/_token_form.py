"""What every input form shares: sizes, equality, checks, the compiled program.

A form lays a ridge task (``x: [N, d]``, ``y: [N, n_out]``, queries ``x_q:
[Q, d]``) out as ``m = N + Q + d`` tokens; the feature count ``n``, the
column blocks and the algorithm, a matrix program the compiler
(:mod:`elsa.programs`) turns into the stack, are the subclass's
(:class:`~elsa.forms.GDForm`, :class:`~elsa.forms.Newton`). The form reads
the compiled stack in its own column order.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from elsa import _validate
from elsa import programs
from elsa.attention import Array, ElsaParams
from elsa._validate import float_dtype


# Bytes the compiler holds per token cell at least (elsa.programs.layout).
_CELL_BYTES = 72


@functools.lru_cache(maxsize=None)
def _compile(form: "TokenForm") -> programs.Compiled:
  """The form's program compiled once per form (forms hash by value).

  Refused before the program is built (its pinned inputs list every row) if
  the compiler's ``m x n`` tables cannot fit the devices' memory.
  """
  _validate.fits_memory(
      type(form).__name__, _CELL_BYTES * form.m * form.n,
      {"n_train": form.n_train, "d": form.d, "n_query": form.n_query,
       "n_out": form.n_out, "m": form.m, "n": form.n})
  return programs.compile(form.program)


@functools.lru_cache(maxsize=None)
def _column_maps(form: "TokenForm") -> tuple[np.ndarray, np.ndarray]:
  """``(cols, index)``, once per form: the form column of each compiled column
  ``[compiled.n]``, and the compiled column of each form column ``[n]``
  (``compiled.n`` where there is none: the zero the gather pads with)."""
  compiled = form.compiled
  cols = np.full(compiled.n, -1)
  for name, (_, compiled_cols) in compiled.layout.items():
    cols[compiled_cols] = list(form._block_columns()[name])
  assert np.all(cols >= 0) and len(set(cols)) == len(cols), cols
  index = np.full(form.n, compiled.n)
  index[cols] = np.arange(compiled.n)
  return cols, index


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jitted(form: "TokenForm", method: str, static: tuple, *args):
  """``form.method(*args, **dict(static))`` compiled once per form, static
  keywords and shape: eager callers would otherwise compile each of the many
  small ops separately."""
  return getattr(form, method)(*args, **dict(static))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenForm:
  """Base of the input forms: the sizes and what does not depend on the columns.

  Subclasses name the token blocks (:meth:`_row_blocks`), set their column
  blocks (:meth:`_consecutive`), the feature count ``n``, the
  :attr:`program` and where its blocks sit (:meth:`_block_columns`), and
  ``_w_block`` and ``_pred_block``, ``(rows, cols)`` of the weights ``w``
  and of the query predictions (read by :meth:`decode_w`,
  :meth:`decode_pred`).

  Attributes:
    n_train, d, n_query, n_out: examples ``N``, input dimension ``d``,
      queries ``Q`` and target columns ``n_out``.
    m: token count ``N + Q + d``.
    program, compiled: the algorithm as a matrix program, and its compiled
      stack.

  A frozen dataclass: forms compare and hash by type and sizes, so they can
  be static arguments of :func:`jax.jit`.
  """

  n_train: int
  d: int
  n_query: int = 1
  n_out: int = 1

  def __post_init__(self):
    for arg, low in (("n_train", 1), ("d", 1), ("n_query", 0), ("n_out", 1)):
      self._set(**{arg: self._check_int(type(self).__name__, arg,
                                        getattr(self, arg), low=low)})
    self._set(**self._blocks())

  def _set(self, **attrs) -> None:
    # The sizes are checked and the row/column blocks derived once, when the
    # form is built; afterwards the form is immutable.
    for name, value in attrs.items():
      object.__setattr__(self, name, value)

  def _blocks(self) -> dict:
    """The subclass's row and column blocks, ``{attribute: slice or range}``,
    including ``_w_block`` and ``_pred_block``."""
    raise NotImplementedError

  @property
  def m(self) -> int:
    """Token count of a state, ``N + Q + d``."""
    return self.n_train + self.n_query + self.d

  @property
  def n(self) -> int:
    """Feature count of a state (set by the subclass)."""
    raise NotImplementedError

  def _row_blocks(self, block) -> list:
    """The token blocks ``[N examples | Q queries | d rows]``, each
    ``block(start, stop)`` (``slice`` or ``range``)."""
    return self._consecutive(block, self.n_train, self.n_query, self.d)

  @staticmethod
  def _consecutive(block, *sizes: int) -> list:
    """Blocks of ``sizes`` side by side from 0, each ``block(start, stop)``.

    ``block`` is ``slice`` or ``range``, e.g. ``(slice, 2, 3)`` gives
    ``[slice(0, 2), slice(2, 5)]``.
    """
    stops = list(itertools.accumulate(sizes))
    return [block(stop - size, stop) for size, stop in zip(sizes, stops)]

  def _jit(self, caller: str, method: str, *args, **static):
    """``self.method(*args, **static)`` under :func:`jax.jit`, ``self`` and the
    keywords ``static`` (hashable, e.g. a depth) static.

    What it returns is sized first (:func:`jax.eval_shape`, which traces
    into the same cache as the call) and refused, naming ``caller``, if it
    cannot fit the devices' memory: a huge depth would otherwise return at
    once and fail, or block, only when read.
    """
    call = functools.partial(_jitted, self, method,
                             tuple(sorted(static.items())))
    nbytes = sum(leaf.size * leaf.dtype.itemsize
                 for leaf in jax.tree.leaves(jax.eval_shape(call, *args)))
    shapes = [np.shape(a) for a in jax.tree.leaves(args)]
    _validate.fits_memory(self._name(caller), nbytes,
                          {**static, "argument shapes": shapes})
    return call(*args)

  # --- the compiled program ----------------------------------------------------

  @property
  def program(self) -> programs.Program:
    """The form's algorithm as a matrix program (:mod:`elsa.programs`), its
    inputs pinned to the tokens ``encode`` lays out (set by the subclass)."""
    raise NotImplementedError

  def _block_columns(self) -> dict:
    """``{block name: form columns}`` of every block of :attr:`program` at
    its home (set by the subclass)."""
    raise NotImplementedError

  @property
  def compiled(self) -> programs.Compiled:
    """``programs.compile(self.program)``, compiled once per form: the stack
    every parameter method of the form reads, in the compiler's column order
    (``print(form.compiled)`` shows it)."""
    return _compile(self)

  def _columns(self) -> np.ndarray:
    """``[compiled.n]``: the form column of each column of the compiled stack.

    The compiler orders columns its own way; the form keeps the order its
    attributes name. Columns the compiler left out (the query columns with
    ``n_query == 0``) stay zero in every state and parameter.
    """
    return _column_maps(self)[0]

  def _in_form_columns(self, a: Array, axis: int) -> Array:
    """``a`` with its ``axis`` of compiled columns laid out as the form's ``n``
    columns, zero where the compiler has none (a gather: numpy for concrete
    ``a``, jax.numpy for traced)."""
    xp = jnp if isinstance(a, jax.core.Tracer) else np
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, 1)
    # int32 in both of jax's integer modes: an int64 index becomes i32 under
    # 32-bit jax and i64 under 64-bit jax, and a gather traced in one mode
    # (a trained stack's, in 32 bits) then fails to lower when the same
    # function is traced again in the other (the decompiler's, in 64 bits).
    index = _column_maps(self)[1].astype(np.int32)
    return xp.take(xp.pad(a, pad), index, axis=axis)

  def _encode_blocks(self, **blocks) -> Array:
    """``compiled.encode`` of those ``blocks`` the program declares (no query
    blocks without queries), in the form's columns."""
    declared = self.compiled.program.blocks
    return self._from_compiled_state(self.compiled.encode(
        **{k: v for k, v in blocks.items() if k in declared}))

  def _from_compiled_state(self, h: Array) -> Array:
    """``[..., m, compiled.n] -> [..., m, n]``: the state in the form's columns."""
    return self._in_form_columns(h, -1)

  def _from_compiled_params(self, p: ElsaParams) -> ElsaParams:
    """The compiled stack's parameters acting on the form's columns.

    With ``S`` the ``[compiled.n, n]`` placement of the compiled columns,
    ``h_form = h S`` and ``h = h_form S^T``: the weights read ``S^T W``, the
    outputs ``W2 S`` and ``B2 S``, and every component's value is placed by
    ``S``.
    """
    rows = lambda a: self._in_form_columns(a, -2)
    cols = lambda a: self._in_form_columns(a, -1)
    traced = any(isinstance(a, jax.core.Tracer) for a in p)
    p = p if traced else ElsaParams(*(np.asarray(a) for a in p))
    dtype = p.w1.dtype
    out = p._replace(w1=rows(p.w1), w3=rows(p.w3), w2=cols(rows(p.w2)),
                     b2=cols(p.b2))
    return ElsaParams(*(jnp.asarray(a, dtype) for a in out))

  # --- decoding ---------------------------------------------------------------

  def decode_w(self, h) -> Array:
    """The weights ``w`` the state holds: ``[..., m, n] -> [..., d(, n_out)]``.

    Works on any leading axes, e.g. all states ``[L + 1, ..., m, n]`` of
    ``elsa_stack(..., return_all=True)``.
    """
    return self._out(self._read("decode_w", h, *self._w_block))

  def decode_pred(self, h) -> Array:
    """Query predictions ``x_q^T w``: ``[..., m, n] -> [..., Q(, n_out)]``."""
    return self._out(self._read("decode_pred", h, *self._pred_block))

  # --- validation -------------------------------------------------------------

  def _name(self, method: str) -> str:
    """How error messages name ``method``: ``"Designed.encode"``."""
    return f"{type(self).__name__}.{method}"

  @staticmethod
  def _shape_error(fn: str, arg: str, want: str, got) -> ValueError:
    return ValueError(f"{fn}: {arg} must have shape {want}, got {tuple(got)}.")

  @staticmethod
  def _check_int(fn: str, arg: str, value, *, low: int) -> int:
    """``value`` as an int ``>= low``: TypeError if not an int, ValueError if below."""
    return _validate.int_at_least(fn, arg, value, low=low)

  def _float_dtype(self, method: str, dtype, *values):
    """``dtype``; if ``None``, the result type of those ``values`` that are
    arrays (also tracers), else JAX's default float
    (:func:`elsa.attention.float_dtype`: float32, or float64 under
    ``jax_enable_x64``). TypeError unless floating."""
    if dtype is None:
      # Arrays (also tracers) carry a dtype; plain Python numbers do not.
      typed = [a for a in values if hasattr(a, "dtype")]
      dtype = jnp.result_type(*typed) if typed else float_dtype()
    dtype = float_dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"{self._name(method)}: dtype must be floating, got "
                      f"{dtype}.")
    return dtype

  def _scalar(self, method: str, arg: str, value, dtype) -> Array:
    """``value`` as a 0-d array of ``dtype``; ``ValueError`` if it has axes."""
    if np.ndim(value) != 0:
      raise ValueError(f"{self._name(method)}: {arg} must be a scalar, got "
                       f"shape {np.shape(value)}; vmap over it instead.")
    return jnp.asarray(value, dtype)

  def _in_range(self, method: str, arg: str, value, *, low: float,
                strict: bool) -> None:
    """``ValueError`` unless a concrete ``value`` is finite and ``>= low``
    (``> low`` if ``strict``) everywhere; traced values pass
    (:mod:`elsa._validate`)."""
    _validate.at_least(self._name(method), arg, value, low=low, strict=strict)

  def _scalars(self, method: str, dtype=None, **values) -> list[Array]:
    """``values`` as 0-d arrays of one floating dtype, in keyword order:
    ``dtype``, or by default as :meth:`_float_dtype` picks it from them."""
    dtype = self._float_dtype(method, dtype, *values.values())
    return [self._scalar(method, arg, value, dtype)
            for arg, value in values.items()]

  def _check_state(self, method: str, h) -> Array:
    """``h`` as an array of shape ``[..., m, n]``, else ``ValueError``."""
    h = jnp.asarray(h)
    if h.ndim < 2 or h.shape[-2:] != (self.m, self.n):
      raise self._shape_error(self._name(method), "h",
                              f"[..., m={self.m}, n={self.n}]", h.shape)
    return h

  def _read(self, method: str, h, rows, cols) -> Array:
    """The block ``h[..., rows, cols]`` of a checked state; ``rows`` and
    ``cols`` are contiguous blocks (``slice`` or ``range``)."""
    h = self._check_state(method, h)
    return h[..., rows.start:rows.stop, cols.start:cols.stop]

  def _out(self, block: Array) -> Array:
    """Drops the target axis of ``[..., *, n_out]`` when ``n_out == 1``."""
    return block[..., 0] if self.n_out == 1 else block

  def _check_inputs(self, x, y, x_query, w0=None):
    """Validates the task; returns ``x, y [..., N, n_out], x_query, w0 [..., d, n_out]``
    with ``x_query``/``w0`` broadcast to the batch shape of ``x`` (``w0`` may be
    ``None``)."""
    fn = self._name("encode")
    N, d, Q, n_out = self.n_train, self.d, self.n_query, self.n_out
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{fn}: x must have a floating dtype, got {x.dtype}.")
    if x.ndim < 2 or x.shape[-2:] != (N, d):
      raise self._shape_error(fn, "x", f"[..., N={N}, d={d}]", x.shape)
    batch = x.shape[:-2]

    def same_dtype(arg, a):
      a = jnp.asarray(a)
      if a.dtype != x.dtype:
        raise TypeError(f"{fn}: {arg} has dtype {a.dtype} but x has dtype "
                        f"{x.dtype}; cast one of them explicitly.")
      return a

    y = same_dtype("y", y)
    if n_out == 1 and y.shape == (*batch, N):
      y = y[..., None]
    if y.shape != (*batch, N, n_out):
      want = f"{(*batch, N)} or " if n_out == 1 else ""
      raise self._shape_error(fn, "y", f"{want}{(*batch, N, n_out)} (x has "
                              f"shape {x.shape}, n_out={n_out})", y.shape)

    def broadcast(arg, a, tail, want, given):
      # ``given``: the shape as passed, before a target axis was added.
      if a.ndim < len(tail) or a.shape[a.ndim - len(tail):] != tail:
        raise self._shape_error(fn, arg, want, given)
      try:
        return jnp.broadcast_to(a, (*batch, *tail))
      except ValueError:
        raise self._shape_error(fn, arg, f"{want} with leading axes "
                                f"broadcastable to x's {batch}",
                                given) from None

    if x_query is None:
      if Q:
        raise ValueError(f"{fn}: x_query is required with n_query={Q}; pass "
                         f"an array of shape [..., {Q}, {d}].")
      x_query = jnp.zeros((*batch, 0, d), x.dtype)
    x_query = same_dtype("x_query", x_query)
    x_query = broadcast("x_query", x_query, (Q, d), f"[..., Q={Q}, d={d}]",
                        x_query.shape)
    if w0 is not None:
      w0 = same_dtype("w0", w0)
      given = w0.shape
      # [..., d] gets its target axis; a w0 already ending in (d, 1) is
      # [..., d, n_out] (they differ only when d == 1).
      if (n_out == 1 and w0.ndim >= 1 and w0.shape[-1] == d
          and w0.shape[-2:] != (d, 1)):
        w0 = w0[..., None]
      w0 = broadcast("w0", w0, (d, n_out), f"[..., d={d}]" if n_out == 1
                     else f"[..., d={d}, n_out={n_out}]", given)
    return x, y, x_query, w0


def _component(p: ElsaParams, index) -> ElsaParams:
  """Entry ``index`` (an int or a tuple) of the leading axes of every leaf."""
  return jax.tree.map(lambda a: a[index], p)
