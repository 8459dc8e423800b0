"""Matrix programs compiled into exact ELSA stacks.

Write an algorithm as simultaneous matrix assignments; :func:`compile` lays
the blocks out as tokens and emits the stack; :func:`run` is the reference
semantics the stack is checked against::

  prog = programs.Program()
  X = prog.input("X", (N, d))
  y = prog.input("y", (N, 1))
  w = prog.state("w", (d, 1))
  r = prog.state("r", (N, 1), init=y)
  lam, eta = prog.scalar("lam"), prog.scalar("eta")
  prog.loop({
      w: (1 - eta * lam) * w + (eta / N) * (X.T @ r),
      r: (1 - eta * lam) * r + (eta * lam) * y - (eta / N) * (X @ (X.T @ r)),
  })
  compiled = programs.compile(prog)
  hs = elsa.elsa_stack(compiled.params(loops=L, lam=0.1, eta=0.05),
                       compiled.encode(X=x, y=yv), return_all=True)
  compiled.read(hs, "w")  # == programs.run(prog, loops=L, X=x, y=yv, ...)["w"]

Modules, one stage each: :mod:`~elsa.programs.language` (the language and
which terms one component computes), :mod:`~elsa.programs.interpreter`
(``run``), :mod:`~elsa.programs.rewrite` (helper blocks for the other
products: hoisting, transposed inputs, split layers),
:mod:`~elsa.programs.layout` (the layout solver),
:mod:`~elsa.programs.codegen` (components), :mod:`~elsa.programs.compiler`
(``compile``, ``Compiled``). docs/guides/programs.md derives the rules.
"""

from elsa.programs.compiler import Compiled, Schedule, compile, schedule  # pylint: disable=redefined-builtin
from elsa.programs.interpreter import run
from elsa.programs.language import Expr, Program, Scalar, constant, eye

__all__ = ["Compiled", "Expr", "Program", "Scalar", "Schedule", "compile",
           "constant", "eye", "run", "schedule"]
