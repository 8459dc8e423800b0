"""Input forms: how a ridge task (x, y, queries, w) is laid out as ELSA tokens.

* :class:`Designed`: our layout; one GD step is one layer of two components;
  any start ``w0``.
* :class:`Natural`: the naturally enumerated tokens ``(x_i, y_i)``, ``(x_q,
  0)`` plus zero-initialised extras; one GD step per layer from ``w0 = 0``.
* :class:`Newton`: the same natural tokens, two set-up layers, then one
  Newton–Schulz step per layer; the state after ``2 + t`` layers holds GD
  step ``2^t``.

Every form lays out ``m = N + Q + d`` tokens by ``n`` features and has
``encode``; from the base ``TokenForm`` (``elsa.forms._token_form``) all share
``m``, ``n``, ``decode_w``, ``decode_pred``, the input checks, value equality
and hashing (forms are static arguments of :func:`jax.jit`), and the
compiler: each form is a matrix program (``form.program``) compiled by
:mod:`elsa.programs` (``form.compiled``) and read in the form's column order.
:class:`GDForm` is the base of the two GD forms (``Designed``, ``Natural``),
which share one layout and add ``decode_train_pred`` and ``gd_params``;
``Newton`` has its own layout and ``newton_params``, ``decode_inverse``,
``decode_gram``.
"""

from elsa.forms._gd_form import GDForm
from elsa.forms.designed import Designed
from elsa.forms.natural import Natural
from elsa.forms.newton import Newton

__all__ = ["Designed", "GDForm", "Natural", "Newton"]
