r"""The matrix-program language: blocks, runtime scalars, expressions, layers and loops.

A :class:`Program` declares named matrices and updates them in layers:

* ``prog.input(name, shape)``: data, a block of the encoded tokens, never
  assigned;
* ``prog.state(name, shape, init=...)``: a block the layers update; it starts
  at zero, at a value given to ``encode``, or at ``init`` (an expression of
  inputs and scalars that the set-up layer computes);
* ``prog.scalar(name)``: a runtime scalar (a traced value or a ``[loops]``
  schedule, given when the parameters are built).

``prog.layer({target: expression, ...})`` is one layer applied once;
``prog.loop({...})`` one layer repeated ``loops`` times. Assignments within a
layer are simultaneous: every right-hand side reads the old values. A state a
layer does not assign keeps its value.

An expression is a sum of terms; a term is a scalar coefficient times a
product of factors (blocks, their transposes, constants). Products are
flattened, so parentheses do not matter: ``X @ (X.T @ r)`` is the term
``X X^T r``. :func:`classify` decides which product one ELSA component
computes (the eight-term expansion of :math:`(hW_3 + B_3)(hW_1 + B_1)^\top
(hW_2 + B_2)`, docs/guides/programs.md); :func:`plan_term` finds,
for any other product of blocks, the cheapest helper blocks (partial
products kept as blocks) that make it one component, and refuses what no
product of blocks computes with a message that names the statement and the
term. Nothing is approximated.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Mapping

import jax
import numpy as np

# --- runtime scalars ---------------------------------------------------------


class Scalar:
  """A polynomial (or ratio) of runtime scalars and numbers.

  ``Scalar`` objects combine with ``+ - * /`` and Python numbers; they are
  evaluated with :meth:`value` once the runtime values are known.
  """

  def __init__(self, fn: Callable[[Mapping[str, Any]], Any], names: frozenset,
               text: str):
    self._fn, self.names, self.text = fn, names, text

  def value(self, values: Mapping[str, Any]):
    """The coefficient for ``values`` (name -> scalar); numbers stay numbers."""
    return self._fn(values)

  def __repr__(self) -> str:
    return self.text

  @staticmethod
  def of(x) -> "Scalar":
    if isinstance(x, Scalar):
      return x
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
      return Scalar(lambda _, x=x: x, frozenset(), repr(x))
    raise TypeError(f"programs: {x!r} is not a scalar; coefficients are numbers "
                    "or runtime scalars (prog.scalar), not data-dependent "
                    "values. A coefficient computed with numpy or jax.numpy is "
                    "an array: pass float(c) for a constant, or declare a "
                    "runtime scalar and give its value to params/run.")

  def _combine(self, other, op, symbol, swap=False):
    try:
      other = Scalar.of(other)
    except TypeError:
      return NotImplemented
    a, b = (other, self) if swap else (self, other)
    return Scalar(lambda v: op(a.value(v), b.value(v)), a.names | b.names,
                  f"({a.text} {symbol} {b.text})")

  def __add__(self, o): return self._combine(o, lambda a, b: a + b, "+")
  def __radd__(self, o): return self._combine(o, lambda a, b: a + b, "+", True)
  def __sub__(self, o): return self._combine(o, lambda a, b: a - b, "-")
  def __rsub__(self, o): return self._combine(o, lambda a, b: a - b, "-", True)
  def __mul__(self, o):
    if isinstance(o, Expr):
      return NotImplemented
    return self._combine(o, lambda a, b: a * b, "*")
  def __rmul__(self, o): return self._combine(o, lambda a, b: a * b, "*", True)
  def __truediv__(self, o): return self._combine(o, lambda a, b: a / b, "/")
  def __rtruediv__(self, o):
    return self._combine(o, lambda a, b: a / b, "/", True)
  def __neg__(self): return Scalar(lambda v: -self.value(v), self.names,
                                   f"-{self.text}")


def _runtime_scalar(name: str) -> Scalar:
  return Scalar(lambda v: v[name], frozenset([name]), name)


# --- expressions --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
  """A declared input or state: ``shape = (rows, cols)``."""
  name: str
  shape: tuple[int, int]
  kind: str  # "input" or "state"
  symmetric: bool = False
  at: tuple[tuple[int, ...], tuple[int, ...]] | None = None
  init: "Expr | None" = None
  program: Any = None
  starts_at_zero: bool = False  # a state declared init=0: no start value


@dataclasses.dataclass(frozen=True)
class Factor:
  """A block (``transposed`` or not) or a constant matrix."""
  block: Block | None = None
  transposed: bool = False
  const: np.ndarray | None = None

  @property
  def shape(self) -> tuple[int, int]:
    if self.block is None:
      return self.const.shape
    r, c = self.block.shape
    return (c, r) if self.transposed else (r, c)

  def T(self) -> "Factor":
    if self.block is None:
      return Factor(const=self.const.T)
    return Factor(block=self.block, transposed=not self.transposed)

  def text(self) -> str:
    if self.block is None:
      return f"const{list(self.const.shape)}"
    return self.block.name + (".T" if self.transposed else "")


@dataclasses.dataclass(frozen=True)
class Term:
  """``coef * factors[0] @ factors[1] @ ...``."""
  coef: Scalar
  factors: tuple[Factor, ...]

  def text(self) -> str:
    product = " @ ".join(f.text() for f in self.factors)
    return product if self.coef.text == "1" else f"{self.coef.text} * {product}"


_REFUSE_ARRAY = ("programs: {name} is a symbolic block, not an array; ELSA "
                 "computes polynomials of its tokens (sums of products of at "
                 "most three blocks), so nonlinearities and numpy/jax functions "
                 "of blocks (norms, float(), jnp.*) cannot be compiled, and a "
                 "coefficient is a Python number or a runtime scalar "
                 "(prog.scalar), not a numpy/jax array.")


class Expr:
  """A sum of terms of one shape ``[rows, cols]``."""

  __array_priority__ = 1000

  def __init__(self, shape: tuple[int, int], terms: tuple[Term, ...]):
    self.shape, self.terms = tuple(shape), tuple(terms)

  def text(self) -> str:
    return " + ".join(t.text() for t in self.terms) or "0"

  def __repr__(self) -> str:
    return f"Expr{list(self.shape)}({self.text()})"

  @property
  def T(self) -> "Expr":
    return Expr(self.shape[::-1], tuple(
        Term(t.coef, tuple(f.T() for f in reversed(t.factors)))
        for t in self.terms))

  # + and -
  def _sum(self, other, sign: int, swap: bool = False):
    other = _as_expr(other, "+" if sign > 0 else "-")
    if other.shape != self.shape:
      raise ValueError(f"programs: cannot add shapes {list(self.shape)} and "
                       f"{list(other.shape)} ({self.text()} and "
                       f"{other.text()}).")
    first, second = (other, self) if swap else (self, other)
    second_terms = second.terms if sign > 0 else tuple(
        Term(-t.coef, t.factors) for t in second.terms)
    return Expr(self.shape, first.terms + second_terms)

  def __add__(self, o): return self._sum(o, 1)
  def __radd__(self, o): return self._sum(o, 1, swap=True)
  def __sub__(self, o): return self._sum(o, -1)
  def __rsub__(self, o): return (-self)._sum(o, 1, swap=True)
  def __neg__(self): return self * -1

  # scalar * and /
  def __mul__(self, s):
    if isinstance(s, Expr):
      raise TypeError(
          f"programs: {self.text()} * {s.text()} multiplies blocks elementwise "
          "(or by a data-dependent scalar), which no ELSA component computes; "
          "use @ for matrix products, and numbers or prog.scalar values as "
          "coefficients.")
    s = Scalar.of(s)
    return Expr(self.shape, tuple(Term(s * t.coef if t.coef.text != "1" else s,
                                       t.factors) for t in self.terms))

  __rmul__ = __mul__

  def __truediv__(self, s):
    if isinstance(s, Expr):
      raise TypeError(
          f"programs: {self.text()} / {s.text()} divides by a block: ELSA "
          "computes polynomials of its tokens, so ratios of data cannot be "
          "compiled. Compute the divisor outside the stack and pass it as a "
          "runtime scalar (prog.scalar).")
    return self * (1 / Scalar.of(s))

  def __rtruediv__(self, s):
    raise TypeError(f"programs: {s!r} / {self.text()} divides by a block, which "
                    "no ELSA component computes.")

  def __pow__(self, _):
    raise TypeError(f"programs: {self.text()} ** ... is not compilable; write "
                    "the product with @ (at most three block factors).")

  # @
  def __matmul__(self, other):
    other = _as_expr(other, "@")
    if self.shape[1] != other.shape[0]:
      raise ValueError(f"programs: cannot multiply {list(self.shape)} @ "
                       f"{list(other.shape)} ({self.text()} @ {other.text()}).")
    terms = tuple(Term(_coef_product(a.coef, b.coef), a.factors + b.factors)
                  for a in self.terms for b in other.terms)
    return Expr((self.shape[0], other.shape[1]), terms)

  def __rmatmul__(self, other):
    return _as_expr(other, "@") @ self

  # No nonlinearity: numpy and jax functions of an Expr are refused.
  def __array__(self, *args, **kwargs):
    raise TypeError(_REFUSE_ARRAY.format(name=self.text()))

  @property
  def __jax_array__(self):
    # A property, so that the refusal is raised where jax.numpy first looks
    # for the hook (functions under jit still name the type Expr).
    raise TypeError(_REFUSE_ARRAY.format(name=self.text()))

  def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
    # numpy scalars and matrices on the left of * / @ land here.
    if method == "__call__" and len(inputs) == 2 and not kwargs:
      a, b = inputs
      if ufunc is np.matmul:
        return _as_expr(a, "@") @ _as_expr(b, "@")
      if ufunc is np.multiply and np.ndim(a) == 0:
        return b * float(a)
    raise TypeError(_REFUSE_ARRAY.format(name=self.text()))

  def __bool__(self):
    raise TypeError(f"programs: {self.text()} has no truth value; programs have "
                    "no data-dependent control flow.")

  def _refuse_number(self, *_):
    raise TypeError(_REFUSE_ARRAY.format(name=self.text()))

  __float__ = __int__ = __complex__ = __index__ = _refuse_number


class BlockExpr(Expr):
  """The expression of one declared block; also a key of ``layer``/``loop``."""

  def __init__(self, block: Block):
    super().__init__(block.shape, (Term(Scalar.of(1), (Factor(block=block),)),))
    self.block = block

  __hash__ = object.__hash__


# A pytree without leaves: a jitted jax function (jnp.linalg.norm, jnp.sum)
# then meets the Expr itself in its body, where ``__jax_array__`` refuses it
# with the language's message, instead of failing to abstractify it.
for _cls in (Expr, BlockExpr):
  jax.tree_util.register_pytree_node(_cls, lambda e: ((), e), lambda e, _: e)


def _coef_product(a: Scalar, b: Scalar) -> Scalar:
  if a.text == "1":
    return b
  if b.text == "1":
    return a
  return a * b


def constant(value) -> Expr:
  """A constant matrix ``[rows, cols]`` (numbers, not data), as an expression."""
  value = np.asarray(value, dtype=np.float64)
  if value.ndim != 2:
    raise ValueError(f"programs.constant: needs a matrix [rows, cols], got "
                     f"shape {value.shape}.")
  return Expr(value.shape, (Term(Scalar.of(1), (Factor(const=value),)),))


def eye(k: int) -> Expr:
  """The identity ``[k, k]`` as a constant expression."""
  return constant(np.eye(k))


def _as_expr(x, op: str) -> Expr:
  if isinstance(x, Expr):
    return x
  if isinstance(x, Scalar) or isinstance(x, numbers.Number):
    raise TypeError(f"programs: cannot apply {op} to a block and the scalar "
                    f"{x!r}; a constant matrix is programs.constant(...) or "
                    "c * programs.eye(k).")
  if hasattr(x, "shape") and len(getattr(x, "shape")) == 2:
    return constant(np.asarray(x))
  raise TypeError(f"programs: cannot apply {op} to {type(x).__name__}.")


# --- symmetry --------------------------------------------------------------------


def _symmetry_key(f: Factor):
  """A factor up to transposition of a symmetric block (read either way)."""
  if f.block is None:
    return ("const", f.const.shape, np.ascontiguousarray(f.const).tobytes())
  return (f.block.name, f.transposed and not f.block.symmetric)


def asymmetric_terms(expr: Expr) -> list[str]:
  """The terms of ``expr`` that keep it from being provably symmetric: ``[]``
  if ``expr`` equals its transpose for every value of its blocks.

  A term is symmetric if its factors, reversed and transposed, are its
  factors (``X.T @ X``, ``S @ S @ S`` and ``P @ S @ P.T`` with ``S``
  symmetric, a symmetric constant); the others must come in pairs ``c * F``
  and ``c * F^T`` with the same coefficient (``c * (S @ A) + c * (A.T @
  S)``). Declared symmetric blocks count as symmetric: a program whose
  symmetric states start symmetric and are assigned only such expressions
  keeps them symmetric at every layer (induction over the layers). The test
  is sufficient, not necessary: an expression symmetric only through an
  identity of its values is not recognised.
  """
  count = {}
  keys = []
  for term in expr.terms:
    key = tuple(_symmetry_key(f) for f in term.factors)
    flipped = tuple(_symmetry_key(f.T()) for f in reversed(term.factors))
    keys.append((term, term.coef.text, key, flipped))
    count[term.coef.text, key] = count.get((term.coef.text, key), 0) + 1
  return [term.text() for term, coef, key, flipped in keys
          if key != flipped and count.get((coef, flipped), 0) != count[coef, key]]


def _check_symmetric_value(name: str, expr: Expr, where: str) -> None:
  """``ValueError`` unless ``expr``, the value of the symmetric block
  ``name`` in ``where``, is provably symmetric (:func:`asymmetric_terms`)."""
  bad = asymmetric_terms(expr)
  if bad:
    raise ValueError(
        f"programs: in {where}: {name} is declared symmetric=True, but "
        f"{'this term is' if len(bad) == 1 else 'these terms are'} not "
        f"symmetric: {', '.join(f'`{t}`' for t in bad)} (a term must equal its "
        "transpose, reading declared symmetric blocks either way, or come "
        "with its transpose at the same coefficient). The stack reads "
        f"{name} transposed where the program does not; write a symmetric "
        f"expression (`X.T @ X`, `S @ S @ S`, `B + B.T`) or declare {name} "
        "without symmetric=True.")


# --- what one component computes -----------------------------------------------

# The kinds of term, each one term of the eight-term expansion
# (docs/guides/programs.md, "Which products one component computes"):
#   constant   P                   B3 B1^T B2
#   copy       P @ A @ Q           B3 B1^T (h W2)          (A anywhere)
#   transpose  P @ A.T @ Q         B3 (h W1)^T B2
#   gram       P @ B.T @ C @ Q     B3 (h W1)^T (h W2)      (B, C on the same tokens)
#   product2   A @ B @ Q           (h W3) B1^T (h W2)      (lands in A's rows)
#   product3   A @ B.T @ C @ Q     (h W3)(h W1)^T (h W2)   (both conditions)
KINDS = ("constant", "copy", "transpose", "gram", "product2", "product3")


@dataclasses.dataclass(frozen=True)
class Classified:
  """A term in the normal form of its kind: ``coef * P @ blocks @ Q``.

  ``blocks`` are ``(block, transposed)`` in the orientation the component
  reads them (symmetric blocks may have been flipped); ``P`` and ``Q`` are
  constant matrices or ``None`` (identity).
  """
  kind: str
  coef: Scalar
  blocks: tuple[tuple[Block, bool], ...]
  P: np.ndarray | None
  Q: np.ndarray | None
  text: str


_PATTERNS = {  # transposed-flags of the blocks -> kind
    (): "constant", (False,): "copy", (True,): "transpose",
    (True, False): "gram", (False, False): "product2",
    (False, True, False): "product3"}


def _orientations(blocks):
  """Every orientation the blocks may be read in: a symmetric block either way."""
  options = [[(b, t)] + ([(b, not t)] if b.symmetric else []) for b, t in blocks]
  out = [[]]
  for choice in options:
    out = [o + [c] for o in out for c in choice]
  return out


def classify(term: Term, where: str) -> Classified:
  """The kind of ``term`` (one ELSA component), or an error saying why not.

  ``where`` names the statement in messages, e.g. ``"loop 1, r = ..."``.

  Raises:
    ValueError: the term is not a product one ELSA component computes.
  """
  factors = list(term.factors)
  text = term.text()

  def refuse(why: str):
    raise ValueError(f"programs: in {where}: the term `{text}` cannot be "
                     f"compiled: {why}")

  def take_consts(fs):
    out = None
    while fs and fs[0].block is None:
      out = fs.pop(0).const if out is None else out @ fs.pop(0).const
    return out

  P = take_consts(factors)
  factors.reverse()
  Q_rev = []
  while factors and factors[0].block is None:
    Q_rev.append(factors.pop(0).const)
  factors.reverse()
  Q = None
  for c in reversed(Q_rev):
    Q = c if Q is None else Q @ c
  if any(f.block is None for f in factors):
    refuse("a constant stands between two blocks; one component multiplies "
           "blocks directly. Keep the product on one side as its own state.")
  if len(factors) > 3:
    refuse(f"it multiplies {len(factors)} blocks and one ELSA component "
           "multiplies at most three. Keep a partial product (e.g. `X.T @ r`) "
           "as its own state, updated in the same layer.")
  if not factors:
    const = P if Q is None else (Q if P is None else P @ Q)
    return Classified("constant", term.coef, (), const, None, text)
  blocks = [(f.block, f.transposed) for f in factors]
  for orientation in _orientations(blocks):
    kind = _PATTERNS.get(tuple(t for _, t in orientation))
    if kind is None:
      continue
    if kind in ("product2", "product3") and P is not None:
      continue
    return Classified(kind, term.coef, tuple(orientation), P, Q, text)
  if len(blocks) == 3:
    refuse("of three blocks one component computes `A @ B.T @ C` (its middle "
           "factor transposed, the sum over B's and C's tokens). Declare the "
           "middle block symmetric=True if it is, or keep a partial product as "
           "its own state.")
  if P is not None:
    refuse("a product of two blocks lands in the rows of its left block, so no "
           "constant may stand to its left; keep `P @ A` as its own state.")
  refuse("of two blocks one component computes `A @ B` or `B.T @ C`; declare "
         "the transposed block symmetric=True if it is, or keep the transpose "
         "as its own state (`P @ A.T @ Q` is one component).")


# --- terms one component cannot compute: helper blocks ---------------------------

# The most helper blocks one term may use, and the most block factors a term
# may have for the compiler to look for them; beyond, the term is refused.
MAX_HELPERS = 4
MAX_FACTORS = 5


@dataclasses.dataclass(frozen=True)
class Helper:
  """A product kept as a block of its own, so that a term becomes one component.

  ``block`` holds ``factors`` multiplied (``factors`` reads blocks and
  helper blocks), transposed if ``stored_transposed``. A helper that reads
  inputs and constants only (``invariant``) is computed once by the set-up
  layer (loop-invariant code motion; a lone transposed input is the
  transposed-input rewrite); any other by layer ``depth`` of the extra
  layers its stage takes before its own (:mod:`elsa.programs.rewrite`).
  """
  block: Block
  factors: tuple[Factor, ...]
  stored_transposed: bool
  invariant: bool
  depth: int

  def definition(self) -> Term:
    """The term that computes the helper's block (one component)."""
    factors = self.factors
    if self.stored_transposed:
      factors = tuple(f.T() for f in reversed(factors))
    return Term(Scalar.of(1), factors)


@dataclasses.dataclass(frozen=True)
class TermPlan:
  """How one term is computed: ``term`` (one component) over ``helpers``."""
  term: Term
  helpers: tuple[Helper, ...]


def _factor_key(f: Factor):
  if f.block is None:
    return ("const", f.const.shape, f.const.tobytes())
  return (f.block.name, f.transposed)


def _is_symmetric(factors) -> bool:
  """Whether the product reads the same transposed (``X.T @ X``, ``A @ M @ A.T``
  with ``M`` symmetric)."""
  flipped = [f.T() for f in reversed(factors)]
  same = lambda a, b: (_factor_key(a) == _factor_key(b) or (
      a.block is not None and a.block is b.block and a.block.symmetric))
  return all(same(a, b) for a, b in zip(factors, flipped))


class HelperBlocks:
  """The helper blocks of one program, one per distinct product (by name)."""

  def __init__(self):
    self.blocks: dict[str, Block] = {}
    self.constants: dict = {}  # constants print by shape: numbered apart

  def get(self, factors, stored_transposed: bool) -> Block:
    held = [f.T() for f in reversed(factors)] if stored_transposed else factors

    def text(f):
      if f.block is not None:
        return f.text()
      number = self.constants.setdefault(_factor_key(f),
                                         len(self.constants) + 1)
      return f"const{number}{list(f.const.shape)}"

    name = f"({' @ '.join(text(f) for f in held)})"
    if name not in self.blocks:
      shape = (held[0].shape[0], held[-1].shape[1])
      self.blocks[name] = Block(name, shape, "state",
                                symmetric=_is_symmetric(list(held)))
    return self.blocks[name]


def _classifies(factors) -> bool:
  """Whether :func:`classify` accepts the product (its rules, without the
  messages)."""
  factors = list(factors)
  left = 0
  while left < len(factors) and factors[left].block is None:
    left += 1
  right = len(factors)
  while right > left and factors[right - 1].block is None:
    right -= 1
  blocks = factors[left:right]
  if any(f.block is None for f in blocks) or len(blocks) > 3:
    return False
  for orientation in _orientations([(f.block, f.transposed) for f in blocks]):
    kind = _PATTERNS.get(tuple(t for _, t in orientation))
    if kind is not None and not (kind in ("product2", "product3") and left):
      return True
  return not blocks


def plan_term(term: Term, where: str, helpers: HelperBlocks, *,
              hoist: bool) -> TermPlan:
  """The cheapest way to compute ``term`` with helper blocks, or an error.

  A term one component computes needs none. Otherwise contiguous runs of its
  factors are replaced by helper blocks (each one component, stored as the
  product or its transpose), at most :data:`MAX_HELPERS`; the cheapest plan
  has the fewest extra layers per stage, then the fewest helpers, then the
  smallest. With ``hoist``, runs of inputs and constants are invariant
  helpers (set-up layer); without it (the ``init`` stage) every helper is an
  extra layer.

  Raises:
    ValueError: no plan within :data:`MAX_HELPERS` helpers.
  """
  factors = tuple(term.factors)
  if _classifies(factors):
    return TermPlan(term, ())
  depth_of = {}  # helper block name -> Helper
  classified = {}

  def classifies(items) -> bool:
    key = tuple(_factor_key(f) for f in items)
    if key not in classified:
      classified[key] = _classifies(items)
    return classified[key]

  def fixed(f: Factor) -> bool:
    # Hoisted helpers read inputs and constants only: all of them are
    # computed by one set-up layer.
    return f.block is None or (hoist and f.block.kind == "input")

  def size(hs):
    return sum(h.block.shape[0] * h.block.shape[1] for h in hs)

  def cost(hs):
    return (max((h.depth for h in hs), default=0), len(hs), size(hs))

  best = None
  reached = {}  # items -> the cheapest helpers that reached them

  def search(items, hs):
    nonlocal best
    if best is not None and cost(hs) >= cost(best[1]):
      return
    key = tuple(_factor_key(f) for f in items)
    if key in reached and cost(reached[key]) <= cost(hs):
      return
    reached[key] = hs
    if classifies(items):
      best = (items, hs)
      return
    if len(hs) == limit:
      return
    for i in range(len(items)):
      for j in range(i + 1, len(items) + 1):
        run = items[i:j]
        blocks = [f for f in run if f.block is not None]
        if (not blocks or len(blocks) > 3
            or (j - i == len(items) and len(items) > 1)):
          continue
        for stored_transposed in (False, True):
          if len(run) == 1 and stored_transposed == run[0].transposed:
            continue  # a lone block helps only read the other way round
          if not classifies(run if not stored_transposed else
                            tuple(f.T() for f in reversed(run))):
            continue
          block = helpers.get(run, stored_transposed)
          if stored_transposed and block.symmetric:
            continue
          invariant = all(fixed(f) for f in run)
          inner = [depth_of[f.block.name].depth for f in run
                   if f.block is not None and f.block.name in depth_of]
          helper = Helper(block, run, stored_transposed, invariant,
                          0 if invariant else 1 + max(inner, default=0))
          depth_of[block.name] = helper
          new = items[:i] + (Factor(block=block,
                                    transposed=stored_transposed),) + items[j:]
          search(new, hs + (helper,))

  # Iterative deepening on the number of helpers: the first plan found is
  # nearly the cheapest; one more helper is tried only to save a layer.
  if sum(f.block is not None for f in factors) <= MAX_FACTORS:
    for limit in range(1, MAX_HELPERS + 1):
      found = best
      reached.clear()
      search(factors, ())
      if best is not None and (found is not None or cost(best[1])[0] == 0):
        break
  if best is None:
    raise ValueError(
        f"programs: in {where}: the term `{term.text()}` cannot be compiled: "
        f"one ELSA component multiplies at most three blocks "
        f"(`A @ B.T @ C`), and the compiler keeps partial products as "
        f"blocks of their own only for terms of at most {MAX_FACTORS} blocks, "
        f"at most {MAX_HELPERS} of them. Keep a partial product of this term "
        "as a state of your own, updated by a layer before this one.")
  items, hs = best
  # Keep only helpers the final term or another kept helper reads.
  needed, todo = {}, [f.block.name for f in items if f.block is not None]
  by_name = {h.block.name: h for h in hs}
  while todo:
    name = todo.pop()
    if name in by_name and name not in needed:
      needed[name] = by_name[name]
      todo += [f.block.name for f in by_name[name].factors
               if f.block is not None]
  return TermPlan(Term(term.coef, items),
                  tuple(h for h in hs if h.block.name in needed))


# --- programs -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stage:
  """A layer applied once (``repeat=False``) or the body of a loop.

  ``part = (j, k)``: layer ``j`` of the ``k`` that a rewritten stage takes
  (:mod:`elsa.programs.rewrite`); ``(1, 1)`` for a stage as written.
  """
  assignments: tuple[tuple[Block, Expr], ...]
  repeat: bool
  label: str
  part: tuple[int, int] = (1, 1)

  def values(self, old: Mapping[str, Any], scalars: Mapping[str, Any], *,
             xp=np, dtype=None) -> dict:
    """The new value of every block the stage assigns, all from the ``old``
    values (assignments are simultaneous): ``sum_t coef_t * F_1 @ F_2 @ ...``.

    ``xp``: ``jax.numpy`` (:func:`elsa.programs.run`, matmuls at the highest
    precision, constants and coefficients in ``dtype``) or ``numpy`` (the
    compiler's layer check, :func:`elsa.programs.compact.check`).
    """
    matmul = (np.matmul if xp is np else
              lambda a, b: xp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))

    def term_value(term):
      out = None
      for f in term.factors:
        if f.block is None:
          x = xp.asarray(f.const, dtype)
        else:
          x = old[f.block.name]
          x = xp.swapaxes(x, -1, -2) if f.transposed else x
        out = x if out is None else matmul(out, x)
      return xp.asarray(term.coef.value(scalars), dtype) * out

    new = {}
    for block, expr in self.assignments:
      total = xp.zeros_like(old[block.name], dtype)
      for term in expr.terms:
        total = total + term_value(term)
      new[block.name] = total
    return new


# Keyword arguments of Compiled.encode/params and programs.run, beside which
# blocks and scalars are passed by name.
RESERVED_NAMES = frozenset({"dtype", "loops", "prog", "self"})


class Program:
  """A matrix program: inputs, states, runtime scalars and layers (module doc)."""

  def __init__(self, *, states_start_at_zero: bool = False):
    """``states_start_at_zero=True``: every state without an ``init`` starts
    at zero, as if declared ``init=0`` (the user's opt-in to the compact
    layouts that use a state's cells before its first assignment; ``encode``
    and ``run`` then take no start value for any state)."""
    if not isinstance(states_start_at_zero, bool):
      raise TypeError("programs.Program: states_start_at_zero must be a bool, "
                      f"got {states_start_at_zero!r}.")
    self.states_start_at_zero = states_start_at_zero
    self.blocks: dict[str, Block] = {}
    self.scalars: dict[str, Scalar] = {}
    self.stages: list[Stage] = []

  def _name(self, name: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
      raise ValueError(f"programs: names are identifiers, got {name!r}.")
    if name in RESERVED_NAMES:
      raise ValueError(f"programs: the name {name!r} is a keyword argument of "
                       "encode, params or run (blocks and scalars are passed "
                       f"by name there); reserved: {sorted(RESERVED_NAMES)}.")
    if name in self.blocks or name in self.scalars:
      raise ValueError(f"programs: the name {name!r} is already declared.")
    return name

  @staticmethod
  def _shape(name: str, shape) -> tuple[int, int]:
    if (len(tuple(shape)) != 2 or any(isinstance(s, bool) or not isinstance(
        s, (int, np.integer)) or s < 1 for s in shape)):
      raise ValueError(f"programs: {name} needs a shape (rows, cols) of "
                       f"positive ints, got {shape!r}.")
    return tuple(int(s) for s in shape)

  def input(self, name: str, shape, *, at=None, symmetric: bool = False
            ) -> BlockExpr:
    """A data block ``[rows, cols]`` of the encoded tokens; never assigned.

    ``at=(rows, cols)`` pins it to those token rows and feature columns (e.g.
    the naturally enumerated tokens); otherwise the compiler places it.
    """
    name, shape = self._name(name), self._shape(name, shape)
    if at is not None:
      at = tuple(tuple(int(i) for i in ax) for ax in at)
      if len(at) != 2 or (len(at[0]), len(at[1])) != shape:
        raise ValueError(f"programs: input {name} of shape {list(shape)} needs "
                         f"at=(rows, cols) of lengths {shape}, got {at!r}.")
      for ax, label in zip(at, ("rows", "cols")):
        if len(set(ax)) != len(ax) or min(ax) < 0:
          raise ValueError(f"programs: input {name}: at {label} must be "
                           f"distinct non-negative ints, got {list(ax)}.")
      for other in self.inputs:
        if other.at is not None:
          shared = [(r, c) for r in at[0] if r in other.at[0]
                    for c in at[1] if c in other.at[1]]
          if shared:
            raise ValueError(f"programs: input {name} is pinned to cells that "
                             f"input {other.name} holds (row, col) "
                             f"{shared[:3]}{' ...' if len(shared) > 3 else ''}"
                             "; pinned inputs may share rows or columns, not "
                             "cells.")
    self._check_symmetric(name, shape, symmetric)
    block = Block(name, shape, "input", symmetric, at, program=self)
    self.blocks[name] = block
    return BlockExpr(block)

  def state(self, name: str, shape, *, init=None, symmetric: bool = False
            ) -> BlockExpr:
    """A block the layers update, ``[rows, cols]``.

    ``init``: ``None`` (zero, or the value given to ``encode``: the state
    keeps cells of its own until its first assignment), ``0`` (it starts at
    zero and takes no start value, so the compiler may use its cells until
    then: a smaller layout where a first loop iteration also moves the
    pinned inputs), or an expression of inputs and scalars, computed by the
    set-up layer.
    ``symmetric=True`` is a promise the compiler relies on (it reads the
    state either way round), so it is proven: the ``init`` here and every
    assignment to the state must be symmetric expressions
    (:func:`asymmetric_terms`), else ``ValueError`` names the statement; a
    start value given to ``encode`` or ``run`` is checked on its values.
    """
    name, shape = self._name(name), self._shape(name, shape)
    self._check_symmetric(name, shape, symmetric)
    zero = self.states_start_at_zero and init is None
    if (isinstance(init, numbers.Number) and not isinstance(init, bool)
        and init == 0):
      zero, init = True, None
    if init is not None:
      if not isinstance(init, Expr):
        raise TypeError(f"programs: init of {name} must be an expression of "
                        f"inputs, 0 or None, got {type(init).__name__}.")
      if init.shape != shape:
        raise ValueError(f"programs: init of {name} has shape "
                         f"{list(init.shape)}, but {name} is {list(shape)}.")
      self._check_terms(init, f"init of {name}", inputs_only=True)
      if symmetric:
        _check_symmetric_value(name, init, f"init of {name}")
    block = Block(name, shape, "state", symmetric, init=init, program=self,
                  starts_at_zero=zero)
    self.blocks[name] = block
    return BlockExpr(block)

  def _check_terms(self, expr: Expr, where: str, *, inputs_only=False):
    """Every term of ``expr`` reads blocks of this program (only inputs if
    ``inputs_only``) and is one component (:func:`classify`)."""
    for term in expr.terms:
      for f in term.factors:
        if f.block is not None and f.block.program is not self:
          raise ValueError(f"programs: {where} reads {f.block.name}, a block "
                           "of another program.")
        if inputs_only and f.block is not None and f.block.kind != "input":
          raise ValueError(f"programs: {where} reads the state "
                           f"{f.block.name}; an init reads inputs and scalars "
                           "only (assign states in prog.layer).")
      plan_term(term, where, HelperBlocks(), hoist=not inputs_only)

  @staticmethod
  def _check_symmetric(name, shape, symmetric):
    if symmetric and shape[0] != shape[1]:
      raise ValueError(f"programs: {name} is declared symmetric but has shape "
                       f"{list(shape)}.")

  def scalar(self, name: str) -> Scalar:
    """A runtime scalar: a value (may be traced) or a ``[loops]`` schedule."""
    self.scalars[self._name(name)] = s = _runtime_scalar(name)
    return s

  def layer(self, assignments: Mapping) -> None:
    """One layer, applied once, at this point of the program."""
    self._stage(assignments, repeat=False)

  def loop(self, assignments: Mapping) -> None:
    """One layer, repeated ``loops`` times, at this point of the program."""
    self._stage(assignments, repeat=True)

  def _stage(self, assignments: Mapping, *, repeat: bool) -> None:
    index = 1 + sum(s.repeat == repeat for s in self.stages)
    label = f"{'loop' if repeat else 'layer'} {index}"
    if not isinstance(assignments, Mapping):
      raise TypeError(f"programs: {label} takes a dict {{state: expression}}, "
                      f"got {type(assignments).__name__}.")
    out = []
    for target, expr in assignments.items():
      if not isinstance(target, BlockExpr) or target.block.program is not self:
        raise TypeError(f"programs: {label}: assignment targets are states of "
                        f"this program, got {target!r}.")
      block = target.block
      if block.kind != "state":
        raise ValueError(f"programs: {label}: {block.name} is an input; only "
                         "states are assigned.")
      if isinstance(expr, numbers.Number) and expr == 0:
        expr = Expr(block.shape, ())
      if not isinstance(expr, Expr):
        raise TypeError(f"programs: {label}, {block.name} = ...: the right-hand "
                        f"side must be an expression, got {type(expr).__name__}.")
      if expr.shape != block.shape:
        raise ValueError(f"programs: {label}, {block.name} = {expr.text()}: "
                         f"shape {list(expr.shape)} but {block.name} is "
                         f"{list(block.shape)}.")
      self._check_terms(expr, f"{label}, {block.name} = ...")
      if block.symmetric:
        _check_symmetric_value(block.name, expr, f"{label}, {block.name} = ...")
      out.append((block, expr))
    self.stages.append(Stage(tuple(out), repeat, label))

  def snapshot(self) -> "Program":
    """A copy with the blocks, scalars and layers declared so far; later
    declarations on either do not reach the other. (Blocks and layers are
    immutable, so the copy shares them.)"""
    copy = Program(states_start_at_zero=self.states_start_at_zero)
    copy.blocks, copy.scalars = dict(self.blocks), dict(self.scalars)
    copy.stages = list(self.stages)
    return copy

  # --- derived views ----------------------------------------------------------

  @property
  def inputs(self) -> list[Block]:
    return [b for b in self.blocks.values() if b.kind == "input"]

  @property
  def states(self) -> list[Block]:
    return [b for b in self.blocks.values() if b.kind == "state"]

  def init_stage(self) -> Stage | None:
    """The set-up layer computing every ``init``, or ``None`` if there is none."""
    inits = tuple((b, b.init) for b in self.states if b.init is not None)
    return Stage(inits, False, "init") if inits else None
