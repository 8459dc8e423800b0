"""Matrix programs: the compiled stack against the reference interpreter, the hand-built forms, and every refusal.

The compiler is trusted through one comparison (Tracr's lesson, STYLE.md):
``compiled.read(hs, name)`` equals ``programs.run(prog, ...)[name]`` at every
layer, on random inputs, for hand-written programs and for random programs
that mix every kind of term. Two compiled programs are also checked against
the forms written by hand (``elsa.forms.Natural``, ``elsa.forms.Newton``)
and against plain GD.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import elsa
from elsa import programs, ridge

F64_RTOL = 1e-10
F32_EPS = float(np.finfo(np.float32).eps)
KINDS = {"mix", "constant", "copy", "transpose", "gram", "product2",
         "product3"}


def rel(got, want):
  """``|got - want| / |want|`` (Frobenius); 0 when both are exactly zero."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.linalg.norm(got - want)
  return err / np.linalg.norm(want) if err else 0.0


def assert_every_layer(compiled, hs, ref, rtol, skip_layers=()):
  """``compiled.read(hs, name)[t] == ref[name][t]`` for every block and layer ``t``.

  A moved pinned input is at home from its move on; ``skip_layers`` maps a
  name to the leading layers to skip for it.
  """
  for name, want in ref.items():
    got = compiled.read(hs, name)
    assert got.shape == want.shape, name
    for t in range(dict(skip_layers).get(name, 0), want.shape[0]):
      assert rel(got[t], want[t]) <= rtol, (name, t, rel(got[t], want[t]))


# --- the DESIGN.md example ---------------------------------------------------


def design_example(N, d, L, x, yv):
  """The example of DESIGN.md, "Matrix programs", verbatim; returns its locals."""
  from elsa import programs

  prog = programs.Program()
  X = prog.input("X", (N, d))                 # data: a block of the encoded tokens
  y = prog.input("y", (N, 1))
  w = prog.state("w", (d, 1))                 # starts at zero, or at the value given to encode()
  r = prog.state("r", (N, 1), init=y)         # starts at an input, or at an expression of inputs (set-up layers compute it)
  lam, eta = prog.scalar("lam"), prog.scalar("eta")   # runtime scalars: traced values, or [loops] schedules
  prog.loop({                                 # one layer, repeated; assignments within a layer are simultaneous
      w: (1 - eta * lam) * w + (eta / N) * (X.T @ r),
      r: (1 - eta * lam) * r + (eta * lam) * y - (eta / N) * (X @ (X.T @ r)),
  })                                          # prog.layer({...}) adds one layer applied once; layers run in the order added

  compiled = programs.compile(prog)           # solves the token layout
  compiled.m, compiled.n                      # token count, feature count
  compiled.layout                             # {name: (rows, cols)} as data; print(compiled) shows it as a table
  h0 = compiled.encode(X=x, y=yv)             # [..., m, n]; blocks not given start as their init
  params = compiled.params(loops=L, lam=0.1, eta=0.05)   # ElsaParams [setup_layers + L, C, ...]; scalars may be traced
  hs = elsa.elsa_stack(params, h0, return_all=True)
  compiled.read(hs, "w")                      # [setup_layers + L + 1, ..., d, 1]: the block at every layer
  programs.run(prog, loops=L, X=x, y=yv, lam=0.1, eta=0.05)   # reference interpreter: {name: [setup_layers + L + 1, ..., rows, cols]}
  return locals()


def regression(seed, batch, N, d, dtype=np.float64):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(*batch, N, d)).astype(dtype)
  yv = rng.normal(size=(*batch, N, 1)).astype(dtype)
  return x, yv


# (N, d) with N > d, N < d and d = 1; the first also with a batch axis.
DESIGN_SHAPES = [((), 12, 3), ((), 5, 7), ((), 30, 1), ((4,), 12, 3)]


@pytest.mark.parametrize("batch,N,d", DESIGN_SHAPES)
def test_design_example_equals_run_and_gd(batch, N, d):
  L = 20
  x, yv = regression(N + d, batch, N, d)
  ex = design_example(N, d, L, x, yv)
  compiled, hs = ex["compiled"], ex["hs"]
  assert compiled.setup_layers == 1  # the init r = y
  assert hs.shape == (compiled.setup_layers + L + 1, *batch, compiled.m,
                      compiled.n)
  ref = programs.run(ex["prog"], loops=L, X=x, y=yv, lam=0.1, eta=0.05)
  assert_every_layer(compiled, hs, ref, F64_RTOL)
  # The program is ridge GD (w) with its residual (r) kept as a state.
  gd = ridge.gd(jnp.asarray(x), jnp.asarray(yv), lam=0.1, eta=0.05, steps=L)
  assert rel(compiled.read(hs, "w")[compiled.setup_layers:], gd) < F64_RTOL


def test_design_example_with_a_schedule():
  N, d, L = 12, 3, 15
  x, yv = regression(1, (), N, d)
  compiled, prog = (lambda ex: (ex["compiled"], ex["prog"]))(
      design_example(N, d, 1, x, yv))
  etas = np.linspace(0.08, 0.01, L)
  hs = elsa.elsa_stack(compiled.params(loops=L, lam=0.2, eta=etas),
                       compiled.encode(X=x, y=yv), return_all=True)
  ref = programs.run(prog, loops=L, X=x, y=yv, lam=0.2, eta=etas)
  assert_every_layer(compiled, hs, ref, F64_RTOL)
  gd = ridge.gd(x, yv, lam=0.2, eta=etas, steps=L)
  assert rel(compiled.read(hs, "w")[1:], gd) < F64_RTOL


def test_jit_traced_scalars_compile_once_and_vmap_over_a_grid():
  N, d, L = 12, 3, 10
  x, yv = regression(2, (), N, d)
  ex = design_example(N, d, 1, x, yv)
  compiled, prog, h0 = ex["compiled"], ex["prog"], ex["h0"]
  traces = {"jit": 0, "grid": 0}

  def final_w(lam, eta, counter):
    traces[counter] += 1
    params = compiled.params(loops=L, lam=lam, eta=eta)
    return compiled.read(elsa.elsa_stack(params, h0), "w")

  def reference(lam, eta):
    return programs.run(prog, loops=L, X=x, y=yv, lam=lam, eta=eta)["w"][-1]

  one = jax.jit(lambda lam, eta: final_w(lam, eta, "jit"))
  for lam, eta in ((0.0, 0.1), (0.3, 0.02)):
    got = one(jnp.float64(lam), jnp.float64(eta))
    assert rel(got, reference(lam, eta)) < F64_RTOL
  assert traces["jit"] == 1

  grid = jax.jit(jax.vmap(lambda lam, eta: final_w(lam, eta, "grid")))
  lams, etas = (jnp.asarray(a.ravel()) for a in np.meshgrid(
      [0.0, 0.1, 1.0], [0.01, 0.05, 0.1]))
  for shift in (0.0, 0.5):  # new values, same shapes: no new trace
    got = grid(lams + shift, etas)
    assert got.shape == (9, d, 1)
    assert rel(got, jax.vmap(reference)(lams + shift, etas)) < F64_RTOL
  assert traces["grid"] == 1
