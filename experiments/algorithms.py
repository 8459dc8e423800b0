r"""The race to the ridge solution in layers: every program of :mod:`elsa.algorithms` as an ELSA stack.

  python -m experiments.algorithms --workdir=runs/algorithms

For each condition number ``kappa`` of ``A = X^T X / N + lam I`` (tasks with
eigenvalues of ``A`` log-spaced in ``[1/kappa, 1]``, drawn as
:func:`experiments.newton.spectrum_tasks` draws them) and each algorithm of
``config.algorithms``, the compiled stack (:func:`elsa.programs.compile` of the
program, run by :func:`elsa.elsa_layer` layer after layer) is run until
``||w - w*|| / ||w*|| <= tol`` (float64) or ``<= tol_float32`` (float32), and
its count is the index of that state: *total layers*, set-up layers included.
Beside it:

* the reference interpreter's count (:func:`elsa.programs.run`, the same
  program on plain arrays), run to at most ``config.interpreter_loops`` loops
  (by default the layer budget, so every count the stack reaches is checked);
* the compiled size ``m, n, C`` and set-up layers, and the time per layer.

Step sizes are the best fixed ones for each task's eigenvalue bounds
(:func:`elsa.algorithms.eigen_bounds`, computed outside the stack in float64
and passed as runtime scalars): GD ``eta = 2 / (mu + L)``; heavy ball and
Nesterov their optimal ``(eta, beta)``; Chebyshev its schedule; Newton–Schulz
and the third-order iteration ``alpha = 2 / (mu + L)``. ``w*`` is
:func:`elsa.ridge.solve` in float64.

One compile per algorithm and dtype: the layer loop is a ``lax.while_loop``
over the loop layer (the schedule indexed by the layer), vmapped over the
tasks, with the error evaluated inside it; it stops when every task is below
the tolerance or at the budget (``layer_budget`` total layers for the
first-order methods in float64, ``layer_budget_float32`` in float32,
``depth`` loops for Newton–Schulz and the third-order iterations), so no
state stack is stored. Each kappa is saved as
``partial_kappa<i>.json`` when done (tied to the config by its hash, verified
on resume); then ``results.json`` and ``figures/algorithm_layers.png``
(:func:`experiments.plotting.algorithm_layers`), in ``--workdir``, claimed as
every driver claims it (:func:`experiments.workdirs.claim_workdir`).
``results['layers_to_tol'][algorithm][kappa]`` is the float64 count (the
largest over the kappa's tasks; ``None`` past the budget), ``floor`` the
smallest error reached (the worst task's; at most ``tol`` where reached, as
the run stops there), ``sizes`` and ``seconds_per_layer`` per algorithm. Matmuls run at
full precision (``jax.default_matmul_precision("highest")``);
``jax_enable_x64`` is on during :func:`run` and restored after it.
"""

from __future__ import annotations

import time

from absl import app
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import elsa
from elsa import algorithms as algorithms_lib
from elsa import programs
from elsa import ridge
from experiments import checks
from experiments import cli
from experiments import distributed
from experiments import metrics
from experiments import newton
from experiments import plotting
from experiments import workdirs

# Runs to the layer budget; the others run config.depth loops.
FIRST_ORDER = ("gd", "heavy_ball", "nesterov", "chebyshev")
DTYPES = ("float64", "float32")
# Log-spaced layers at which the median error curve is kept in results.json.
CURVE_POINTS = 60


def kappa_key(kappa: float) -> str:
  """The JSON key of a kappa: ``10``, ``1000``, ``1e+06``."""
  return f"{float(kappa):g}"


def build_program(name: str, config) -> programs.Program:
  """The program ``name`` of :data:`elsa.algorithms.ALGORITHMS` for the config's task shape."""
  return algorithms_lib.ALGORITHMS[name](n_train=config.n_train, d=config.d,
                                         n_query=config.n_query, n_out=1)


def step_scalars(name: str, mu_min: np.ndarray, mu_max: np.ndarray, *,
                 lam: float, loops: int) -> tuple[dict, dict]:
  """Best fixed steps per task: ``(scalars {name: [B]}, schedules {name: [B, loops]})``."""
  lam = np.full_like(mu_min, lam)
  if name == "gd":
    return dict(lam=lam, eta=np.asarray(algorithms_lib.gd_step(mu_min,
                                                               mu_max))), {}
  if name in ("heavy_ball", "nesterov"):
    fn = (algorithms_lib.heavy_ball_parameters if name == "heavy_ball"
          else algorithms_lib.nesterov_parameters)
    eta, beta = fn(jnp.asarray(mu_min), jnp.asarray(mu_max))
    return dict(lam=lam, eta=np.asarray(eta), beta=np.asarray(beta)), {}
  if name == "chebyshev":
    eta, beta = jax.vmap(lambda a, b: algorithms_lib.chebyshev_schedule(
        a, b, loops))(jnp.asarray(mu_min), jnp.asarray(mu_max))
    return dict(lam=lam), dict(eta=np.asarray(eta), beta=np.asarray(beta))
  if name in ("newton_schulz", "third_order", "third_order_residual"):
    return dict(lam=lam, alpha=np.asarray(algorithms_lib.gd_step(mu_min,
                                                                 mu_max))), {}
  raise ValueError(f"step_scalars: unknown algorithm {name!r}.")


def _layer_of(params, index: int):
  return jax.tree_util.tree_map(lambda a: a[index], params)


def stack_errors(compiled: programs.Compiled, *, budget: int, dtype,
                 on_trace=None, mesh=None):
  """A jitted ``(x, y, xq, w_star, scalars, schedules, tol) -> errors [B, budget + 1]``.

  Runs the compiled stack, vmapped over the tasks: its set-up layers, then its
  loop layers (``Compiled.params(loops=2)`` at each loop's scalars: the first
  iteration's layer, which may also move the pinned inputs home, then the
  layer of every later iteration) in a
  ``lax.while_loop`` that stops when every task's ``w`` is within ``tol`` of
  ``w_star`` or after ``budget`` total layers. ``errors[:, t]`` is
  ``||w_t - w*|| / ||w*||`` (float64) of state ``t``, NaN past the stop. The
  read-out layer (``p = Xq @ w``) changes no ``w`` and is not run. With a
  ``mesh`` the errors come back replicated on it (the tasks split over it
  by :func:`experiments.distributed.put_tasks`).
  """
  setup = compiled.setup_layers
  loops = budget - setup
  if loops < 1:
    raise ValueError(f"stack_errors: budget {budget} leaves no loop after the "
                     f"{setup} set-up layers.")

  def loop_layers(params):
    # Iteration 0 may be a layer of its own (the compiler folds the move of
    # the pinned inputs into it); every later iteration is the second one.
    return _layer_of(params, setup), _layer_of(params, setup + 1)

  def iteration(t, layers):
    return jax.tree.map(lambda first, later: jnp.where(t == 0, first, later),
                        *layers)

  def one(x, y, xq, w_star, scalars, schedules, tol):
    blocks = dict(X=x, y=y) | (dict(Xq=xq) if "Xq" in
                                compiled.program.blocks else {})
    h0 = compiled.encode(dtype=dtype, **blocks)
    first = {**scalars, **{k: v[0] for k, v in schedules.items()}}
    params = compiled.params(loops=2, dtype=dtype, **first)
    error = lambda h: metrics.relative_error(
        compiled.read(h, "w").astype(jnp.float64).reshape(-1),
        w_star.reshape(-1))
    hs = elsa.elsa_stack(_layer_of(params, slice(0, setup)), h0,
                         return_all=True) if setup else h0[None]
    errors = jnp.full((budget + 1,), jnp.nan, jnp.float64)
    errors = errors.at[:setup + 1].set(jax.vmap(error)(hs))
    fixed = None if schedules else loop_layers(params)

    def cond(carry):
      t, _, err, _ = carry
      return (t < loops) & ~(err <= tol)

    def body(carry):
      t, h, _, errs = carry
      layers = fixed if fixed is not None else loop_layers(compiled.params(
          loops=2, dtype=dtype,
          **scalars, **{k: v[t] for k, v in schedules.items()}))
      h = elsa.elsa_layer(iteration(t, layers), h)
      err = error(h)
      return t + 1, h, err, errs.at[setup + 1 + t].set(err)

    _, _, _, errors = jax.lax.while_loop(
        cond, body, (jnp.int32(0), hs[-1], errors[setup], errors))
    return errors

  def batch(*args):
    if on_trace is not None:
      on_trace()
    return jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, None))(*args)

  return _jit_on(batch, mesh)


def _jit_on(batch, mesh):
  return jax.jit(batch, out_shardings=None if mesh is None
                 else distributed.replicated(mesh))


def interpreter_errors(prog: programs.Program, *, loops: int, dtype,
                       on_trace=None, mesh=None):
  """A jitted ``(x, y, xq, w_star, scalars, schedules) -> errors [B, setup + loops + 1]``.

  ``||w_t - w*|| / ||w*||`` of :func:`elsa.programs.run` (the reference
  interpreter, the same program on plain arrays) at every layer up to the
  last loop, vmapped over the tasks. ``loops`` is static: one compile per
  program and dtype. ``mesh``: as :func:`stack_errors`.
  """

  def one(x, y, xq, w_star, scalars, schedules):
    blocks = dict(X=x, y=y) | (dict(Xq=xq) if "Xq" in prog.blocks else {})
    sched = {k: v[:loops] for k, v in schedules.items()}
    ws = programs.run(prog, loops=loops, dtype=dtype, **blocks, **scalars,
                      **sched)["w"]
    ws = ws.astype(jnp.float64).reshape(ws.shape[0], -1)
    # Up to the last loop: the read-out layer changes no w.
    return metrics.relative_error(ws, w_star.reshape(1, -1))[:-_after_loops(
        prog) or None]

  def batch(*args):
    if on_trace is not None:
      on_trace()
    return jax.vmap(one)(*args)

  return _jit_on(batch, mesh)


def _after_loops(prog: programs.Program) -> int:
  """Layers after the last loop (the read-out)."""
  last = max((i for i, s in enumerate(prog.stages) if s.repeat), default=-1)
  return len(prog.stages) - 1 - last


def first_below(errors: np.ndarray, tol: float) -> list[int | None]:
  """Per row, the first index whose error is ``<= tol`` (``None``: never)."""
  out = []
  for row in errors:
    hits = np.nonzero(row <= tol)[0]
    out.append(int(hits[0]) if hits.size else None)
  return out


def _worst(counts: list) -> int | None:
  """The layers every task needs: the largest count, ``None`` if one never got there."""
  return None if any(c is None for c in counts) else max(counts)


def _curve(errors: np.ndarray) -> dict:
  """The median error over tasks at log-spaced layers (NaN where none ran)."""
  ran = np.nonzero(np.isfinite(errors).any(axis=0))[0]
  last = int(ran[-1]) if ran.size else 0
  layers = np.unique(np.round(np.geomspace(1, last + 1, CURVE_POINTS)) - 1
                     ).astype(int)
  with np.errstate(all="ignore"):
    median = np.nanmedian(np.where(np.isfinite(errors), errors, np.nan)
                          [:, layers], axis=0) if errors.size else []
  return dict(layers=layers.tolist(), median=np.asarray(median).tolist())


def _compiled(runner: dict, key: str, args) -> tuple:
  """``runner[key]`` compiled for ``args`` (once; later kappas reuse it), and
  the seconds the compile took (0 when reused)."""
  if key + "_exe" in runner:
    return runner[key + "_exe"], 0.0
  start = time.perf_counter()
  runner[key + "_exe"] = runner[key].lower(*args).compile()
  return runner[key + "_exe"], time.perf_counter() - start


def _measure(name: str, dtype: str, config, data: dict, runner: dict) -> dict:
  """Compiled and interpreted counts of one algorithm, dtype and kappa, the
  tasks split over ``runner["mesh"]``."""
  tol = config.tol if dtype == "float64" else config.tol_float32
  cast = lambda a: np.asarray(a, jnp.dtype(dtype))
  setup, mesh = runner["setup"], runner["mesh"]
  scalars, schedules = data["steps"][name]
  args = distributed.put_tasks(
      (cast(data["x"]), cast(data["y"]), cast(data["xq"]),
       np.asarray(data["w_star"]), {k: cast(v) for k, v in scalars.items()},
       {k: cast(v) for k, v in schedules.items()}), mesh)
  tol_arg = distributed.put(np.float64(tol), distributed.replicated(mesh))
  count = len(data["x"])
  stack, compile_stack = _compiled(runner, "stack", (*args, tol_arg))
  start = time.perf_counter()
  errors = distributed.take_tasks(jax.block_until_ready(stack(*args, tol_arg)),
                                  count)
  elapsed = time.perf_counter() - start
  interpreter, compile_interpreter = _compiled(runner, "interpreter", args)
  interp = distributed.take_tasks(interpreter(*args), count)
  counts = first_below(errors, tol)
  layers_run = int(np.isfinite(errors).sum(axis=1).max()) - 1
  finite_min = lambda e: float(np.nanmin(e)) if np.isfinite(e).any() else None
  return {
      "layers": counts,
      "layers_run": layers_run,
      "floor": [finite_min(row[setup + 1:]) for row in errors],
      "final": [float(row[np.isfinite(row)][-1]) if np.isfinite(row).any()
                else None for row in errors],
      "interpreter_layers": first_below(interp, tol),
      "interpreter_layers_run": interp.shape[1] - 1,
      "seconds": elapsed,
      "seconds_per_layer": elapsed / max(layers_run, 1),
      "compile_seconds": compile_stack,
      "interpreter_compile_seconds": compile_interpreter,
      "curve": _curve(errors),
  }


def _kappa_data(config, kappa: float, rng: np.random.Generator) -> dict:
  """One kappa's tasks, solution and best steps (float64 numpy)."""
  x, y, xq = newton.spectrum_tasks(
      rng, kappa=kappa, count=config.tasks_per_kappa, n_train=config.n_train,
      d=config.d, n_query=config.n_query, lam=config.lam, noise=config.noise)
  y = y[..., None]  # n_out = 1: y [B, N, 1]
  w_star = np.asarray(ridge.solve(jnp.asarray(x), jnp.asarray(y),
                                  lam=config.lam))
  mu_min, mu_max = (np.asarray(v) for v in algorithms_lib.eigen_bounds(
      jnp.asarray(x), lam=config.lam))
  steps = {name: step_scalars(name, mu_min, mu_max, lam=config.lam,
                              loops=_budget(name, config))
           for name in config.algorithms}
  return dict(x=x, y=y, xq=xq, w_star=w_star, mu_min=mu_min, mu_max=mu_max,
              steps=steps)


def _budget(name: str, config) -> int:
  """Loops a schedule must cover: the most the stack may run in any dtype."""
  return (max(config.layer_budget, config.layer_budget_float32)
          if name in FIRST_ORDER else config.depth)


def make_runners(config, *, on_trace=None) -> dict:
  """Per algorithm: its program, compiled stack and sizes, and per dtype the
  jitted stack runner (:func:`stack_errors`) and interpreter
  (:func:`interpreter_errors`), on a mesh of every device (tasks split over
  it); each is compiled at its first use."""
  mesh = distributed.mesh()
  runners = {}
  for name in config.algorithms:
    prog = build_program(name, config)
    compiled = programs.compile(prog)
    setup = compiled.setup_layers
    budgets = {dtype: _layer_budget(name, dtype, config, setup)
               for dtype in DTYPES}
    loops = {dtype: min(config.interpreter_loops, budgets[dtype] - setup)
             for dtype in DTYPES}
    runners[name] = dict(
        size=dict(m=compiled.m, n=compiled.n, C=compiled.width,
                  setup_layers=setup, layer_budget=budgets,
                  interpreter_loops=loops, components=compiled.components),
        **{dtype: dict(
            stack=stack_errors(compiled, budget=budgets[dtype],
                               dtype=jnp.dtype(dtype), on_trace=on_trace,
                               mesh=mesh),
            interpreter=interpreter_errors(prog, loops=loops[dtype],
                                           dtype=jnp.dtype(dtype),
                                           on_trace=on_trace, mesh=mesh),
            setup=setup, mesh=mesh) for dtype in DTYPES})
  return runners


def _layer_budget(name: str, dtype: str, config, setup: int) -> int:
  """Total layers the stack of ``name`` may run in ``dtype``."""
  if name not in FIRST_ORDER:
    return setup + config.depth
  return config.layer_budget if dtype == "float64" else (
      config.layer_budget_float32)


def _kappa_result(config, kappa: float, rng: np.random.Generator,
                  runners: dict) -> dict:
  """Every algorithm's counts for one condition number."""
  data = _kappa_data(config, kappa, rng)
  out = {"kappa": kappa,
         "kappa_measured": (data["mu_max"] / data["mu_min"]).tolist(),
         "algorithms": {}}
  for name in config.algorithms:
    r = runners[name]
    out["algorithms"][name] = {
        dtype: _measure(name, dtype, config, data, r[dtype])
        for dtype in DTYPES}
  return out


def summary(per_kappa: list[dict], runners_sizes: dict, config) -> dict:
  """The tables of ``results.json``: counts per algorithm and kappa, sizes, times."""
  out = {"layers_to_tol": {}, "layers_to_tol_float32": {},
         "interpreter_layers_to_tol": {},
         "interpreter_layers_to_tol_float32": {}, "floor": {},
         "floor_float32": {}, "seconds_per_layer": {}, "sizes": runners_sizes}
  for name in config.algorithms:
    for key in out:
      if key not in ("sizes", "seconds_per_layer"):
        out[key][name] = {}
    out["seconds_per_layer"][name] = {}
    for dtype in DTYPES:
      tail = "" if dtype == "float64" else "_float32"
      times = []
      for r in per_kappa:
        k, m = kappa_key(r["kappa"]), r["algorithms"][name][dtype]
        out["layers_to_tol" + tail][name][k] = _worst(m["layers"])
        out["interpreter_layers_to_tol" + tail][name][k] = _worst(
            m["interpreter_layers"])
        floors = [f for f in m["floor"] if f is not None]
        out["floor" + tail][name][k] = max(floors) if floors else None
        times.append(m["seconds_per_layer"])
      out["seconds_per_layer"][name][dtype] = float(np.median(times))
  return out


def markdown_table(results: dict) -> str:
  """Layers to tol per algorithm x kappa, ``compiled / interpreter``, float64 then float32; sizes and times.

  A count past the budget shows the best error reached instead, ``— (2.5e-05)``;
  an interpreter count ``—`` was not checked (past ``interpreter_loops``).
  """
  config = results["config"]
  kappas = [kappa_key(k) for k in config["kappas"]]
  fmt = lambda v: "—" if v is None else str(v)
  lines = []
  for tail, label in (("", f"float64, tol {config['tol']:g}"),
                      ("_float32", f"float32, tol {config['tol_float32']:g}")):
    lines.append(f"{label}: total layers, compiled / interpreter")
    lines.append("| algorithm | setup | " + " | ".join(
        f"kappa {k}" for k in kappas) + " |")
    lines.append("|" + "---|" * (len(kappas) + 2))
    for name in config["algorithms"]:
      cells = []
      for k in kappas:
        count = results["layers_to_tol" + tail][name][k]
        floor = results["floor" + tail][name][k]
        stack = fmt(count) if count is not None or floor is None else (
            f"— ({floor:.1e})")
        interp = results["interpreter_layers_to_tol" + tail][name][k]
        cells.append(f"{stack} / {fmt(interp)}")
      lines.append(f"| {name} | {results['sizes'][name]['setup_layers']} | "
                   + " | ".join(cells) + " |")
    lines.append("")
  lines.append("| algorithm | m | n | C | s/layer f64 | s/layer f32 |")
  lines.append("|---|---|---|---|---|---|")
  for name in config["algorithms"]:
    s, t = results["sizes"][name], results["seconds_per_layer"][name]
    lines.append(f"| {name} | {s['m']} | {s['n']} | {s['C']} | "
                 f"{t['float64']:.2e} | {t['float32']:.2e} |")
  return "\n".join(lines)


def validate(config: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, in one line naming the field.

  Raises:
    experiments.checks.ConfigError: a field outside its range, a NaN or inf,
      an unknown algorithm, an empty tuple, or a budget with no loop.
  """
  checks.check_seed(config)
  checks.check_items(config, "algorithms",
                     choices=tuple(algorithms_lib.ALGORITHMS))
  kappas = checks.check_items(config, "kappas", low=1)
  for field in ("d", "n_query", "tasks_per_kappa"):
    checks.check_int(config, field)
  # Layer counts index int32 arrays (the layer loop's counter, the error
  # buffer); set-up layers are added to them.
  for field, low in (("depth", 1), ("interpreter_loops", 1),
                     ("layer_budget", 3), ("layer_budget_float32", 3)):
    checks.check_int(config, field, low=low, high=_MAX_LAYERS)
  checks.check_int(config, "n_train", low=config.d)
  checks.check_float(config, "lam", low=0, high=1 / max(kappas),
                     high_open=True)
  checks.check_float(config, "noise", low=0)
  for field in ("tol", "tol_float32"):
    checks.check_float(config, field, low=0, high=1, low_open=True,
                       high_open=True)
  checks.check_fits(bytes_needed(config), fields=(
      "tasks_per_kappa, n_train, d, n_query, depth, layer_budget, "
      "layer_budget_float32 and interpreter_loops"))


_MAX_LAYERS = 2 ** 30


def bytes_needed(config) -> int:
  """About what a run holds at once, in float64: per algorithm and task, the
  error buffer over its layer budget (a few copies), its step schedules, and
  the interpreter's value of every block after every layer it runs."""
  total = 0
  for name in config.algorithms:
    blocks = sum(rows * cols for rows, cols in (
        b.shape for b in build_program(name, config).blocks.values()))
    budget = max(_layer_budget(name, dtype, config, 0) for dtype in DTYPES)
    interpreted = min(config.interpreter_loops, budget) + 1
    total += 3 * budget + 2 * _budget(name, config) + interpreted * blocks
  return 8 * config.tasks_per_kappa * total


def _per_kappa(config, wd: workdirs.Workdir, runners: dict) -> list[dict]:
  """Every kappa's result: loaded if an earlier run saved it, else computed and saved."""
  return newton.per_kappa(
      config, wd, lambda kappa, rng: _kappa_result(config, kappa, rng, runners),
      name="algorithms")


def _race(config, wd: workdirs.Workdir) -> dict:
  """The results dict of the race (every kappa resumed or computed)."""
  runners = make_runners(config)
  sizes = {name: r["size"] for name, r in runners.items()}
  per_kappa = _per_kappa(config, wd, runners)
  return {"config": checks.config_dict(config),
          **summary(per_kappa, sizes, config), "per_kappa": per_kappa}


def run(config, workdir: str, *, overwrite: bool = False) -> dict:
  """Runs the race into ``workdir`` and returns the results dict.

  Checks the config, claims the workdir (``overwrite`` first deletes what an
  earlier run of this driver wrote there), then skips the work if
  ``results.json`` exists, and resumes from the ``partial_kappa<i>.json``
  files if not. ``jax_enable_x64`` is on inside, restored after.

  Raises:
    experiments.checks.ConfigError: the config cannot run (nothing written).
    experiments.workdirs.WorkdirInUse: another run holds ``workdir``, or it
      holds a different config and ``overwrite`` is off.
    experiments.workdirs.CorruptOutput: a saved file is damaged, altered or of
      another config.
  """
  distributed.agree("validate", validate, config)
  with jax.enable_x64(True), distributed.claim_workdir(
      workdir, config, overwrite=overwrite) as wd:
    results = wd.results(lambda: _race(config, wd), name="algorithms")
    wd.save_figure(plotting.algorithm_layers(results),
                   "figures/algorithm_layers.png")
  logging.info("algorithms summary:\n%s", markdown_table(results))
  return results


def main(argv):
  distributed.run_main(argv, "algorithms", run)


if __name__ == "__main__":
  cli.define_flags("algorithms")
  distributed.define_flags()
  app.run(main)
