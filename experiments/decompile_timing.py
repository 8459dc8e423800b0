"""Wall and CPU seconds of ``decompile.identify`` (every family) and ``decompile.spectral``.

python -m experiments.decompile_timing SHAPES SETTINGS DEPTH

``SHAPES``: ``tiny`` (N = 8, d = 2) or ``default`` (N = 16, d = 4), one query,
lam = 0.05, the train driver's tiny and default tasks; ``SETTINGS``:
``defaults`` (identify's) or ``driver`` (the decompile driver's: 4 restarts,
no Adam, 20 Levenberg-Marquardt steps). The model: an untrained masked LSA
stack with a residual of ``DEPTH`` layers (float32, ``decompile.from_model``),
64 fit and 128 held-out float64 tasks, as the driver. A first call (compiling)
and a further call with the same shapes, each with the seconds per family
(the families run on threads, so these overlap and add up to more than the
wall time); then ``spectral`` twice. Run it in a plain shell: the test suite's
settings (XLA backend level 0, a compilation cache) change the figures.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from elsa import decompile, training
from elsa.decompile import _fitting


def main(shapes: str = "default", settings: str = "defaults",
         depth: str = "4") -> None:
  jax.config.update("jax_enable_x64", True)
  spec = (training.TaskSpec(n_train=8, d=2, n_query=1, lam=0.05)
          if shapes == "tiny" else
          training.TaskSpec(n_train=16, d=4, n_query=1, lam=0.05))
  kwargs = ({} if settings == "defaults"
            else dict(restarts=4, adam_steps=0, lm_steps=20))
  model = training.init_model(jax.random.key(0), spec, depth=int(depth),
                              use_bias=False, residual=True, context_only=True,
                              skip_init=False, dtype=jnp.float32)
  predict = decompile.from_model(model, spec)
  fit = training.sample_tasks(jax.random.key(1), spec, batch=64,
                              dtype=np.float64)
  test = training.sample_tasks(jax.random.key(2), spec, batch=128,
                               dtype=np.float64)
  seconds = {}
  fit_family = _fitting._fit_family  # pylint: disable=protected-access

  def timed(family, *args, **kw):
    tic = time.perf_counter()
    out = fit_family(family, *args, **kw)
    seconds[family.name] = time.perf_counter() - tic
    return out
  _fitting._fit_family = timed  # pylint: disable=protected-access
  with jax.default_matmul_precision("highest"):
    for call in ("first", "repeat"):
      seconds.clear()
      tic, cpu = time.perf_counter(), time.process_time()
      decompile.identify(predict, fit, test, lam=spec.lam, **kwargs)
      print(f"identify {shapes} {settings} L={depth} {call}: "
            f"{time.perf_counter() - tic:.1f} s wall, "
            f"{time.process_time() - cpu:.1f} s CPU; per family "
            + " ".join(f"{k} {v:.1f}" for k, v in seconds.items()),
            flush=True)
    for call in ("first", "repeat"):
      tic = time.perf_counter()
      decompile.spectral(predict, fit, test, lam=spec.lam)
      print(f"spectral {call}: {time.perf_counter() - tic:.2f} s", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
