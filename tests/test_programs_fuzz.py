"""The compiler on random programs: never wrong, never stuck, in bounded time.

Issue 34's red-team set as a hypothesis strategy: small programs over two or
three token groups (blocks of 1 to 3 rows and columns, so many one-column
blocks), symmetric states proven by their updates, warm starts given to
``encode``, states declared ``init=0``, ``init`` expressions, terms of every
kind and terms that need a rewrite (hoisting, splitting), pinned inputs that
share columns (so that inputs move, in a layer of their own or in the first
loop iteration), layers before and after the loop. Every program must
compile (a fallback layout at worst) and equal, at every layer and in every
state, a float64 numpy interpreter of the program.

Cheap by construction: a program is drawn from one integer seed, so the 200
programs are one hypothesis example (derandomized: the same programs every
run); each is compiled and its parameters built in numpy, and all 200 stacks
run in one jitted, vmapped ``elsa_stack`` call (zero-padded to common sizes:
a zero row, column, component or inner column adds nothing, so padding is
exact). Compile times over the same seeds: :func:`compile_times`.
"""

import time

import jax
import numpy as np
from hypothesis import given, settings, strategies as st

import elsa
from elsa import programs
from helpers import rel_norm

FUZZ_PROGRAMS = 200
F64_RTOL = 1e-10
ROWS = (1, 2, 3)
WIDTHS = (1, 2, 3)


class _Builder:
  """Random terms over a program's blocks, from one numpy generator."""

  def __init__(self, rng, prog):
    self.rng, self.prog = rng, prog
    s, t = prog.scalar("s"), prog.scalar("t")
    self.coefs = [0.3, -0.25, 0.2 * s, 0.3 * t, 0.1 * s * t]

  def pick(self, seq):
    return seq[self.rng.integers(len(seq))] if seq else None

  def coef(self):
    return self.pick(self.coefs)

  def const(self, rows, cols):
    return programs.constant(self.rng.normal(size=(rows, cols))
                             / np.sqrt(rows * cols))

  def term(self, kind, target, blocks):
    """A term of ``kind`` landing in shape ``target``, or ``None`` if the
    blocks have no operands of matching shapes."""
    tr, tc = target
    c = self.coef()
    if kind in ("constant", "copy", "transpose"):
      return self._copy(kind, c, target, blocks)
    # The queries Xq only copied: a term summing or landing across Xn and Xq
    # would join the two pinned groups of rows, which no layout allows.
    blocks = [b for b in blocks if b.block.name != "Xq"]
    rows = lambda r: [b for b in blocks if b.shape[0] == r]
    cols = lambda c: [b for b in blocks if b.shape[1] == c]
    if kind == "gram":
      b = self.pick(blocks)
      d = self.pick(rows(b.shape[0]))
      return c * (self.const(tr, b.shape[1]) @ b.T @ d
                  @ self.const(d.shape[1], tc))
    a = self.pick(rows(tr))
    if a is None:
      return None
    if kind == "product2":
      b = self.pick(rows(a.shape[1]))
      return None if b is None else c * (a @ b @ self.const(b.shape[1], tc))
    if kind == "product3":
      b = self.pick(cols(a.shape[1]))
      d = None if b is None else self.pick(rows(b.shape[0]))
      return None if d is None else c * (a @ b.T @ d
                                         @ self.const(d.shape[1], tc))
    if kind == "hoist":  # X.T @ X @ v: the Gram of an input, hoisted
      x = self.pick([b for b in cols(tr) if b.block.kind == "input"])
      v = self.pick(rows(tr))
      return None if x is None or v is None else c * (
          x.T @ x @ v @ self.const(v.shape[1], tc))
    if kind == "split":  # three blocks in a row: a helper layer
      b = self.pick(rows(a.shape[1]))
      d = None if b is None else self.pick(rows(b.shape[1]))
      return None if d is None else c * (a @ b @ d @ self.const(d.shape[1], tc))
    raise AssertionError(kind)

  def _copy(self, kind, c, target, blocks):
    tr, tc = target
    if kind == "constant":
      return c * self.const(tr, tc)
    a = self.pick(blocks)
    if kind == "copy":
      if a.shape == target and self.rng.random() < 0.5:
        return c * a
      return c * (self.const(tr, a.shape[0]) @ a @ self.const(a.shape[1], tc))
    return c * (self.const(tr, a.shape[1]) @ a.T @ self.const(a.shape[0], tc))

  def symmetric_term(self, target, blocks, sym_blocks):
    """A symmetric term ``[k, k]``: ``S S S``, ``B^T B``, ``P S P^T``, ``I``."""
    k = target[0]
    c = self.coef()
    options = ["eye"]
    if any(b.shape[1] == k for b in blocks):
      options.append("gram")
    options += ["cube", "sandwich"] if sym_blocks else []
    option = self.pick(options)
    if option == "eye":
      return c * programs.eye(k)
    if option == "gram":
      b = self.pick([b for b in blocks if b.shape[1] == k])
      return c * (b.T @ b)
    s = self.pick(sym_blocks)
    if option == "cube" and s.shape[0] == k:
      return c * (s @ s @ s)
    p = self.const(k, s.shape[0])
    return c * (p @ s @ p.T)


KINDS = ("constant", "copy", "transpose", "gram", "product2", "product3",
         "hoist", "split")


def make_program(seed: int, max_states: int = 6):
  """A random program from ``seed``: ``(prog, blocks, scalars, loops)``, the
  blocks every input and every warm start ``encode`` and ``run`` take; 2 to
  ``max_states`` states."""
  rng = np.random.default_rng(seed)
  prog = programs.Program()
  b = _Builder(rng, prog)
  group_rows = sorted(rng.choice(ROWS, size=rng.integers(2, 4),
                                 replace=False).tolist())
  inputs = [prog.input(f"X{i}", (r, b.pick(WIDTHS)))
            for i, r in enumerate(group_rows)]
  if rng.random() < 0.3:  # natural tokens: two inputs in the same columns
    a, q, j = b.pick(ROWS), b.pick(ROWS), b.pick(WIDTHS)
    inputs.append(prog.input("Xn", (a, j), at=(range(a), range(j))))
    inputs.append(prog.input("Xq", (q, j), at=(range(a, a + q), range(j))))
  sym_blocks = []
  if rng.random() < 0.4:
    k = b.pick(ROWS)
    sym_blocks.append(prog.input("Bs", (k, k), symmetric=True))
    inputs.append(sym_blocks[-1])
  states, starts = [], {}
  for i in range(rng.integers(2, max_states + 1)):
    how = b.pick(["symmetric", "warm", "init", "zero"])
    if how == "symmetric":
      k = b.pick(group_rows)
      grams = [x for x in inputs if x.shape[1] == k]
      init = b.pick([None, 0, programs.eye(k)]
                    + ([(lambda x: x.T @ x)(b.pick(grams))] if grams else []))
      s = prog.state(f"S{i}", (k, k), init=init, symmetric=True)
      sym_blocks.append(s)
      if init is None:
        starts[s] = "symmetric"
    else:
      shape = (b.pick(group_rows), b.pick(WIDTHS))
      init = {"warm": None, "zero": 0}.get(how)
      if how == "init":
        init = b.term(b.pick(["constant", "copy", "transpose", "gram"]), shape,
                      inputs)
      s = prog.state(f"S{i}", shape, init=init)
      if how == "warm":
        starts[s] = "general"
    states.append(s)
  blocks = inputs + states

  def update(state, extra_terms):
    expr = b.pick([0.5, 0.8, -0.3]) * state
    for _ in range(extra_terms):
      if state.block.symmetric:
        expr = expr + b.symmetric_term(state.shape, blocks, sym_blocks)
        continue
      term = None
      while term is None:
        term = b.term(b.pick(KINDS), state.shape, blocks)
      expr = expr + term
    return expr

  if rng.random() < 0.3:
    target = b.pick(states)
    prog.layer({target: update(target, 1)})
  prog.loop({s: update(s, int(rng.integers(1, 3))) for s in states})
  if rng.random() < 0.3:
    target = b.pick(states)
    prog.layer({target: update(target, 1)})

  values = {}
  for x in inputs + list(starts):
    v = rng.normal(size=x.shape) / 2
    values[x.block.name] = (v + v.T) / 2 if x.block.symmetric else v
  scalars = {"s": rng.uniform(-1, 1), "t": rng.uniform(-1, 1)}
  return prog, values, scalars, int(rng.integers(2, 4))


fuzz_programs = st.integers(0, 2 ** 32 - 1).map(make_program)


# --- the reference: the program in float64 numpy --------------------------------


def _value(expr, values, scalars):
  total = np.zeros(expr.shape)
  for term in expr.terms:
    out = None
    for f in term.factors:
      x = f.const if f.block is None else values[f.block.name]
      x = x.T if f.block is not None and f.transposed else x
      out = x if out is None else out @ x
    total = total + term.coef.value(scalars) * out
  return total


def numpy_run(compiled, loops, blocks, scalars):
  """Every state of the program before the first layer and after every layer
  of the stack (``[layers + 1, rows, cols]``), in numpy: the program's
  stages applied in order, each over the layers the compiler gave it (its
  value changes at the last), as ``programs.run`` does."""
  prog = compiled.program
  values = {b.name: np.asarray(blocks.get(b.name, np.zeros(b.shape)), float)
            for b in prog.blocks.values()}
  out = [dict(values)]
  for unit in compiled._units:  # pylint: disable=protected-access
    for _ in range(loops if unit.repeat else 1):
      out += [dict(values)] * (unit.layers - 1)
      if unit.source is not None:
        values = {**values, **{b.name: _value(e, values, scalars)
                               for b, e in unit.source.assignments}}
      out.append(dict(values))
  return {b.name: np.stack([o[b.name] for o in out]) for b in prog.states}


def _read(compiled, hs, name):
  """``compiled.read`` in numpy (an eager jax gather compiles per shape)."""
  rows, cols = compiled.layout[name]
  return np.asarray(hs)[..., np.array(rows)[:, None], np.array(cols)]


def numpy_stack(params, h0):
  """``elsa_stack(params, h0, return_all=True)`` in float64 numpy, from the
  formula ``sum_c (h W3 + B3)((h W1 + B1)^T (h W2 + B2))``: no XLA program to
  compile for each small test."""
  p = [np.asarray(a, np.float64) for a in params]
  hs = [np.asarray(h0, np.float64)]
  for layer in range(p[0].shape[0]):
    w1, w2, w3, b1, b2, b3 = (a[layer] for a in p)
    h = hs[-1]
    hs.append(sum((h @ w3[c] + b3[c]) @ ((h @ w1[c] + b1[c]).T
                                         @ (h @ w2[c] + b2[c]))
                  for c in range(w1.shape[0])))
  return np.stack(hs)


def assert_stack_equals_numpy_run(compiled, loops, blocks, scalars=None):
  """The compiled stack (in numpy) equals :func:`numpy_run` in every state
  at every layer."""
  scalars = scalars or {}
  hs = numpy_stack(compiled.params(loops=loops, **scalars),
                   compiled.encode(**blocks))
  for name, want in numpy_run(compiled, loops, blocks, scalars).items():
    got = _read(compiled, hs, name)
    for t in range(want.shape[0]):
      assert rel_norm(got[t], want[t]) <= F64_RTOL, (name, t)


@jax.jit
def _stacks(params, h0):
  return jax.vmap(lambda p, h: elsa.elsa_stack(p, h, return_all=True))(
      params, h0)


def _padded(arrays, shape):
  return np.stack([np.pad(a, [(0, s - n) for s, n in zip(shape, a.shape)])
                   for a in arrays])


def run_stacks(cases):
  """``[(params, h0)]`` of different sizes: every stack's states, one call."""
  params = [jax.tree.map(np.asarray, p) for p, _ in cases]
  leaves = list(zip(*params))
  shapes = [np.max([a.shape for a in leaf], axis=0) for leaf in leaves]
  padded = elsa.ElsaParams(*(_padded(leaf, s) for leaf, s in
                             zip(leaves, shapes)))
  m, n = shapes[5][2], shapes[2][2]  # b3 [L, C, m, k], w3 [L, C, n, k]
  h0 = _padded([np.asarray(h) for _, h in cases], (m, n))
  return np.asarray(_stacks(padded, h0))


@settings(max_examples=1, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 2 ** 32 - 1), min_size=FUZZ_PROGRAMS,
                max_size=FUZZ_PROGRAMS, unique=True))
def test_random_programs_compile_and_equal_the_interpreter_at_every_layer(
    seeds):
  cases, checks = [], []
  for seed in seeds:
    prog, blocks, scalars, loops = make_program(seed)
    compiled = programs.compile(prog)
    assert "please report" not in str(compiled)
    cases.append((compiled.params(loops=loops, **scalars),
                  compiled.encode(**blocks)))
    checks.append((seed, compiled, numpy_run(compiled, loops, blocks,
                                             scalars)))
  hs_all = run_stacks(cases)
  for (seed, compiled, ref), hs in zip(checks, hs_all):
    layers = next(iter(ref.values())).shape[0]
    hs = hs[:layers, :compiled.m, :compiled.n]
    for name, want in ref.items():
      assert np.isfinite(want).all() and np.abs(want).max() < 1e6, (seed, name)
      got = _read(compiled, hs, name)
      for t in range(layers):
        assert rel_norm(got[t], want[t]) <= F64_RTOL, (
            f"make_program({seed}): {name} at layer {t}", str(compiled))


def test_the_fuzz_draws_what_it_claims():
  """The generator is not vacuous: over its first programs there are
  symmetric states, warm starts, init=0 states, several token groups,
  one-column blocks, rewrites and moved pinned inputs (first iterations
  that move them are ``test_programs.py``'s natural programs')."""
  seen = set()
  for seed in range(60):
    prog, blocks, _, _ = make_program(seed)
    compiled = programs.compile(prog)
    seen.update(f"symmetric {b.kind}" for b in prog.blocks.values()
                if b.symmetric)
    seen.update("warm start" for name in blocks if name.startswith("S"))
    seen.update("init=0" for b in prog.states if b.starts_at_zero)
    seen.update("one column" for b in prog.blocks.values() if b.shape[1] == 1)
    if len({tuple(rows) for rows, _ in compiled.layout.values()}) >= 2:
      seen.add("groups>=2")
    seen.update(r.split(":")[0] for r in compiled.rewrites)
    layout = compiled._layout  # pylint: disable=protected-access
    if layout.moved:
      seen.add("moved")
  assert seen >= {"symmetric input", "symmetric state", "warm start", "init=0",
                  "one column", "groups>=2", "split", "hoisted loop-invariant "
                  "product", "moved"}, seen


def compile_times(seeds=range(FUZZ_PROGRAMS), max_states: int = 6):
  """``[(seconds, seed, m)]``: building and compiling each fuzz program."""
  out = []
  for seed in seeds:
    start = time.perf_counter()
    prog, _, _, _ = make_program(seed, max_states)
    compiled = programs.compile(prog)
    out.append((time.perf_counter() - start, seed, compiled.m))
  return out


def report(seeds=range(FUZZ_PROGRAMS), max_states: int = 6):
  """Prints the median, 99th percentile and worst compile time (the command
  and figures: docs/guides/programs.md, "Bounded compile time")."""
  times = compile_times(seeds, max_states)
  t = np.array([s for s, _, _ in times])
  worst = max(times)
  print(f"{len(t)} programs of 2 to {max_states} states, tokens <= "
        f"{max(m for _, _, m in times)}: median {np.median(t):.3f} s, 99th "
        f"percentile {np.percentile(t, 99):.3f} s, worst {worst[0]:.3f} s "
        f"(seed {worst[1]}, {worst[2]} tokens)")
