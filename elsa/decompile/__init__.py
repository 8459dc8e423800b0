r"""Which algorithm did a stack compute? The inverse of :func:`elsa.programs.compile`.

A *model* is a jax-traceable callable ``task -> predictions`` on a batch of
ridge tasks (:class:`elsa.ridge.Task`: ``x [B, N, d]``, ``y [B, N]``,
``x_query [B, Q, d]``), returning the final query predictions ``[B, Q]`` or
the prediction after every layer ``[S, B, Q]`` (row 0 the state before the
first layer, never compared: a trained stack's is its input, a compiled one's
its set-up), in the tasks' dtype: an array or any array-like
(``jnp.asarray``: a list of ``[B, Q]`` rows), not all zero (every
disagreement is relative to the predictions' norm). :func:`from_model` (an :class:`elsa.nn.ElsaStack` or any callable ``h
[B, m, n] -> states`` on a task layout's tokens) and :func:`from_compiled`
make models of what the library builds.

A *family* (:data:`FAMILIES`) is a parameterised algorithm: a matrix program
(those of :mod:`elsa.algorithms`, and two written here with a block input or a
data transform) with free parameters (step sizes, momentum, a schedule, a
preconditioner, GD++'s data transform), each with its transform (``exp`` for
the positive ones). Its predictions are those of the reference interpreter
:func:`elsa.programs.run`, so fitting differentiates through the program
itself. With ``k`` iterations per layer, model layer ``l`` (row ``l``) is held
against the family's iterate ``k l`` (or the cumulative counts of a per-layer
tuple).

:func:`fit` finds the family's parameters that make its predictions match the
model's at every exposed layer: the pooled relative squared error

.. math::
  D(\theta) = \frac{\sum_{l, b, q} (f_{lbq}(\theta) - g_{lbq})^2}
                   {\sum_{l, b, q} g_{lbq}^2},

``f`` the family's, ``g`` the model's predictions, minimised by
Levenberg–Marquardt on the residuals (after optional Adam steps, optax) from
``restarts`` random starts at once (``vmap``), jit-compiled once per family
and iteration count; the families are fitted on threads.
:func:`identify` fits every family and ranks them on HELD-OUT tasks by
``D``, reporting for each the squared prediction difference (SPD), the
implicit linear weight difference (ILWD: ``w`` least-squares fitted to the
predictions on probe queries, Akyürek et al. 2023), the cosine and relative L2
distance of the input sensitivities ``d pred / d x_q`` (von Oswald et al.
2023), each with its standard error over tasks; ``best`` is the simplest family
(fewest free parameters; exact ties, ``D <=`` :data:`EXACT`, in the order of
:data:`FAMILIES`) within ``tol``, ties and exact equivalences reported;
``closest`` always the nearest family, with how many times nearer it is than
the runner-up and than constant-step GD (what to read when ``best`` is
``None``).

:func:`spectral` is fit-free: the filter ``g_l`` with ``prediction = x_q^T
g_l(A) X^T y / N`` at every exposed layer by linear least squares, its
residual polynomial and roots (a GD schedule where they are real), and the
explained-share ladder (:data:`RUNGS`: GD, GD doubling its steps every
layer, GD at its own ridge strength, a GD schedule, the polynomial, the
polynomial with extra terms).

:func:`similarity` is Fu et al. (2023)'s layer x iteration cosine map;
:func:`weight_structure` Ahn et al. (2023)'s distance of the trained blocks
from a scaled identity.

Modules: ``_families`` (the families), ``_models`` (adapters),
``_fitting`` (fit, identify, the metrics), ``_spectral``, ``_analyses``.
"""

from elsa.decompile._analyses import similarity, weight_structure
from elsa.decompile._families import (FAMILIES, Family, Parameter,
                                      gd_plus_plus_program,
                                      preconditioned_gd_program)
from elsa.decompile._fitting import (EXACT, MAX_STEPS, TIE, Closest, Fit,
                                     Report, fit, identify)
from elsa.decompile._models import Model, from_compiled, from_model
from elsa.decompile._spectral import EXTRAS, RUNGS, Spectral, spectral

__all__ = ["EXACT", "EXTRAS", "FAMILIES", "MAX_STEPS", "Closest", "Family",
           "Fit", "Model", "Parameter", "RUNGS", "Report", "Spectral", "TIE",
           "fit", "from_compiled", "from_model", "gd_plus_plus_program",
           "identify",
           "preconditioned_gd_program", "similarity", "spectral",
           "weight_structure"]
