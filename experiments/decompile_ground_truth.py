"""The field's metrics on compiled stacks, whose algorithm is known exactly.

python -m experiments.decompile_ground_truth

For each stack (L = 3 layers, d = 4, N = 16, one query, lam = 0.05, float64):
Fu et al.'s similarity argmax against GD steps 0..16 at the reference step
0.5 / mu_max; the one-step-per-layer GD fit's held-out D, von Oswald et al.'s
sensitivity cosine and Akyurek et al.'s ILWD against the stack; and the
spectral description's ladder (its GD rungs, gd_doubling among them, and the
polynomial) and residual roots.
"""

import time

import jax
import numpy as np

from elsa import algorithms, decompile, programs, ridge, training

jax.config.update("jax_enable_x64", True)
N, D, Q, LAM, L = 16, 4, 1, 0.05, 3


def tasks(seed, batch):
  return ridge.sample_tasks(jax.random.key(seed), batch=batch, n_train=N, d=D,
                            n_query=Q, noise=0.3, dtype=np.float64)


def main():
  fit_tasks, test_tasks = tasks(1, 64), tasks(2, 128)
  lo, hi = (float(np.mean(b)) for b in algorithms.eigen_bounds(fit_tasks.x,
                                                               lam=LAM))
  step = 0.5 / hi
  compile_ = lambda prog: programs.compile(prog(n_train=N, d=D, n_query=Q))
  eta_c, beta_c = algorithms.chebyshev_schedule(lo, hi, L)
  stacks = {
      "gd": (compile_(algorithms.ridge_gd), dict(eta=step),
             "GD steps 1, 2, 3"),
      "newton_schulz": (compile_(algorithms.newton_schulz), dict(alpha=step),
                        "GD steps 2, 4, 8"),
      "third_order": (compile_(algorithms.third_order), dict(alpha=step),
                      "GD steps 2, 5, 14"),
      "chebyshev": (compile_(algorithms.heavy_ball),
                    dict(eta=eta_c, beta=beta_c),
                    "Chebyshev nodes of [mu_min, mu_max]"),
      "gd_plus_plus": (compile_(decompile.gd_plus_plus_program),
                       dict(eta=step, gamma=0.2 / hi), "GD++ (not GD)"),
  }
  reference = lambda t: training.gd_step_predictions(t, lam=LAM, eta=step,
                                                     steps=16)
  rows = []
  for name, (compiled, scalars, truth) in stacks.items():
    model = decompile.from_compiled(compiled, loops=L, lam=LAM, **scalars)
    _, argmax = decompile.similarity(model, reference, test_tasks)
    gd = decompile.fit(model, decompile.FAMILIES["gd"], fit_tasks,
                       iterations=1, test_tasks=test_tasks, lam=LAM,
                       restarts=4, adam_steps=100, lm_steps=20)
    tic = time.perf_counter()
    spec = decompile.spectral(model, fit_tasks, test_tasks,
                              degree=13 if name == "third_order" else 7,
                              extras=(), lam=LAM)
    seconds = time.perf_counter() - tic
    ladder = {k: v["disagreement"] for k, v in spec.ladder.items()}
    roots = spec.roots[-1]
    complex_share = float(np.mean(np.abs(roots.imag) > 1e-3 * np.abs(roots)))
    rows.append((name, truth, argmax[1:].tolist(), gd.disagreement,
                 gd.metrics["sensitivity_cosine"], gd.metrics["ilwd"],
                 ladder, len(roots), complex_share,
                 [None if s is None else np.round(s * hi, 4).tolist()
                  for s in spec.schedules], seconds))
  print("| stack | truth | Fu argmax (layers 1..3) | GD fit D | sensitivity "
        "cosine vs GD | ILWD vs GD | spectral: D gd / gd_doubling / "
        "gd_schedule / polynomial | roots of r_3 (complex share) | schedules x mu_max |")
  print("|---|---|---|---|---|---|---|---|---|")
  for (name, truth, am, d, cos, ilwd, ladder, nroots, cshare, sched,
       seconds) in rows:
    print(f"| {name} | {truth} | {am} | {d:.2e} | {cos:.6f} | {ilwd:.2e} | "
          f"{ladder['gd']:.1e} / {ladder['gd_doubling']:.1e} / "
          f"{ladder['gd_schedule']:.1e} / "
          f"{ladder['polynomial']:.1e} | {nroots} ({cshare:.2f}) | {sched} |")
  print("spectral seconds:", [round(r[-1], 3) for r in rows])


if __name__ == "__main__":
  main()
