"""Input forms: how a ridge task (x, y, queries, w) is laid out as ELSA tokens.

* :class:`Designed`: our layout; one GD step is one layer of two components;
  any start ``w0``.
* :class:`Natural`: the naturally enumerated tokens ``(x_i, y_i)``, ``(x_q,
  0)`` plus zero-initialised extras; one GD step per layer from ``w0 = 0``.

Both share the API of :class:`GDForm`: ``m``, ``n``, ``encode``,
``decode_w``, ``decode_pred``, ``decode_train_pred``, ``gd_params``.
"""

from elsa.forms._base import GDForm
from elsa.forms.designed import Designed
from elsa.forms.natural import Natural
from elsa.forms.newton import Newton

__all__ = ["Designed", "GDForm", "Natural", "Newton"]
