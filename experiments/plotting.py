"""Figures of the sweep and of the training run, drawn from their ``results.json``.

Every function returns a ``matplotlib.figure.Figure`` built without pyplot, so
it works headless, in a notebook and under any backend without switching it;
save it with :func:`experiments.workdirs.save_figure`.

Sweep figures take the record list. Diverged cells (``eta`` past the GD
stability limit) never enter an error curve: the heatmap shows them greyed
out and labelled, the curves leave them out and say how many.

Training figures take the results dict of ``experiments.train``; the Newton
figure the results dict of ``experiments.newton`` and its summary rows.
"""

from __future__ import annotations

from matplotlib.figure import Figure
import numpy as np

# log-scale axes cannot show an exact zero; it is drawn at this floor.
_LOG_FLOOR = 1e-18


def _cells(records: list[dict], form: str) -> dict[tuple, list[dict]]:
  """Records of ``form`` grouped by (lam, eta), each list sorted by depth."""
  cells = {}
  for r in records:
    if r["form"] == form:
      cells.setdefault((r["lam"], r["eta"]), []).append(r)
  return {k: sorted(v, key=lambda r: r["depth"]) for k, v in sorted(cells.items())}


def _series(cell: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  depth = np.array([r["depth"] for r in cell])
  value = np.array([np.nan if r[key] is None else r[key] for r in cell])
  return depth, np.maximum(value, _LOG_FLOOR)


def _style(cells: dict, lam: float, eta: float) -> dict:
  """Colour by lam, line style by eta, so a grid of any size stays readable."""
  lams = sorted({l for l, _ in cells})
  etas = sorted({e for _, e in cells})
  styles = ("-", "--", ":", "-.")
  return dict(color=f"C{lams.index(lam) % 10}",
              linestyle=styles[etas.index(eta) % len(styles)],
              label=f"λ={lam:g}, η={eta:g}")


def _diverged_note(cells: dict) -> str:
  count = sum(cell[0]["diverged"] for cell in cells.values())
  return f" ({count} diverged cells left out)" if count else ""


def error_vs_depth(records: list[dict], *, form: str) -> Figure:
  """Max over tasks of ``||w_elsa - w_gd|| / ||w_gd||`` vs depth, a line per stable (lam, eta)."""
  cells = _cells(records, form)
  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  for (lam, eta), cell in cells.items():
    if not cell[0]["diverged"]:
      ax.plot(*_series(cell, "max_rel_err"), **_style(cells, lam, eta))
  ax.set_yscale("log")
  ax.set_xlabel("depth L (layers = GD steps)")
  ax.set_ylabel("max relative error, ELSA vs GD")
  ax.set_title(f"{form}: L layers vs L GD steps{_diverged_note(cells)}")
  ax.legend(fontsize="x-small", ncol=2)
  return fig


def convergence(records: list[dict], *, form: str) -> Figure:
  """Median relative distance to the ridge solution vs depth: ELSA (left) beside GD (right)."""
  cells = _cells(records, form)
  fig = Figure(figsize=(10, 4), layout="constrained")
  axes = fig.subplots(1, 2, sharey=True)
  for ax, key, who in ((axes[0], "elsa_to_ridge", "ELSA stack"),
                       (axes[1], "gd_to_ridge", "plain GD")):
    for (lam, eta), cell in cells.items():
      if not cell[0]["diverged"]:
        ax.plot(*_series(cell, key), **_style(cells, lam, eta))
    ax.set_yscale("log")
    ax.set_xlabel("depth L")
    ax.set_title(f"{who}")
  axes[0].set_ylabel("median ||w_L - w*|| / ||w*||")
  axes[1].legend(fontsize="x-small", ncol=2)
  fig.suptitle(f"{form}: convergence to the ridge solution{_diverged_note(cells)}")
  return fig


def final_error_heatmap(records: list[dict], *, forms: list[str]) -> Figure:
  """log10 of the final-depth max ELSA-vs-GD error over (lam, eta), a panel per form."""
  fig = Figure(figsize=(5.5 * len(forms), 4), layout="constrained")
  axes = np.atleast_1d(fig.subplots(1, len(forms), squeeze=False)[0])
  for ax, form in zip(axes, forms):
    cells = _cells(records, form)
    lams = sorted({lam for lam, _ in cells})
    etas = sorted({eta for _, eta in cells})
    grid = np.full((len(lams), len(etas)), np.nan)
    for (lam, eta), cell in cells.items():
      last = cell[-1]
      i, j = lams.index(lam), etas.index(eta)
      if last["diverged"]:
        ax.text(j, i, "diverged", ha="center", va="center", fontsize=8)
      else:
        grid[i, j] = np.log10(max(last["max_rel_err"], _LOG_FLOOR))
        ax.text(j, i, f"{last['max_rel_err']:.1e}", ha="center", va="center",
                fontsize=7, color="white")
    ax.set_facecolor("lightgrey")  # diverged cells stay NaN: drawn grey
    image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax, label="log10 max relative error")
    ax.set_xticks(range(len(etas)), [f"{e:g}" for e in etas])
    ax.set_yticks(range(len(lams)), [f"{l:g}" for l in lams])
    ax.set_xlabel("η")
    ax.set_ylabel("λ")
    depth = max((cell[-1]["depth"] for cell in cells.values()), default=0)
    ax.set_title(f"{form}: ELSA vs GD at depth {depth}")
  return fig


# Training (experiments/train.py).

_TRAINED_STYLE = {"elsa_trained": "-", "lsa_trained": "--",
                  "lsa_residual_trained": "-."}


def _trained(results: dict) -> list[str]:
  return list(results.get("models", results["train_loss"]))


def _floats(values) -> np.ndarray:
  """JSON numbers as floats, ``None`` (non-finite) as NaN, floored for log axes."""
  return np.maximum(np.asarray(values, dtype=float), _LOG_FLOOR)


def train_loss(results: dict) -> Figure:
  """Training MSE against step (means over ``log_every`` steps) at each model's chosen grid point, a line per model and depth."""
  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  for i, (name, curves) in enumerate(results["train_loss"].items()):
    for j, (depth, curve) in enumerate(zip(results["depths"], curves)):
      ax.plot(curve, label=f"{name} L={depth}", color=f"C{j}",
              linestyle=_TRAINED_STYLE.get(name, ("-", "--", ":")[i % 3]))
  ax.set(xlabel="step (mean over chunks)", ylabel="train MSE", yscale="log",
         title="Training loss (chosen grid point)")
  ax.legend(fontsize=6, ncol=2)
  return fig


def test_loss_vs_depth(results: dict) -> Figure:
  """In-distribution test MSE against depth, with 95% bars (1.96 standard errors)."""
  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  for name, losses in results["test_loss"].items():
    ax.errorbar(results["depths"], np.asarray(losses, dtype=float),
                yerr=1.96 * np.asarray(results["test_loss_se"][name],
                                       dtype=float),
                marker="o", capsize=3, label=name,
                linestyle=":" if name == "bayes_optimal" else "-")
  ax.set(xlabel="depth L (layers = GD steps)", ylabel="test MSE",
         yscale="log", title="Test loss vs depth (in distribution)")
  ax.legend(fontsize=7)
  return fig


def trained_vs_gd(results: dict) -> Figure:
  """Input sensitivities ``d pred / d x_q`` of each trained model against GD at its depth: cosine similarity (left) and relative L2 distance (right)."""
  fig = Figure(figsize=(10, 4), layout="constrained")
  axes = fig.subplots(1, 2)
  depths = results["depths"]
  for ax, key, scale in zip(axes, ("sensitivity_cosine", "sensitivity_rel_l2"),
                            ("linear", "log")):
    for name in _trained(results):
      ax.plot(depths, np.asarray(results["trained_vs_gd"][name][key],
                                 dtype=float), "o-", label=name)
    ax.set(xlabel="depth L", ylabel=key, yscale=scale,
           title=f"trained vs GD (chosen eta): {key}")
  axes[0].axhline(1.0, color="grey", linewidth=0.5)
  axes[0].legend(fontsize=7)
  return fig


def layer_predictions(results: dict) -> Figure:
  """The query prediction decoded after every layer of each trained stack, a column per depth.

  Top: test MSE of the layer-``t`` prediction, beside GD step ``t`` and the
  Bayes-optimal predictor. Bottom: its MSE to GD step ``t`` and to the Bayes
  prediction (von Oswald et al. 2023, Fig. 2's per-layer comparison).
  """
  depths = results["depths"]
  fig = Figure(figsize=(4 * len(depths), 7), layout="constrained")
  axes = fig.subplots(2, len(depths), squeeze=False)
  layers = results["layers"]
  for j, depth in enumerate(depths):
    top, bottom = axes[0, j], axes[1, j]
    t = np.arange(depth + 1)
    top.plot(t, _floats(layers["gd_steps"][j]["test_loss"]), "k.--",
             label="GD step t")
    top.axhline(_floats(results["test_loss"]["bayes_optimal"][j]),
                color="grey", linestyle=":", label="Bayes-optimal")
    for i, name in enumerate(_trained(results)):
      entry = layers[name][j]
      if entry is None:  # every grid point diverged
        continue
      style = _TRAINED_STYLE.get(name, "-")
      top.plot(t, _floats(entry["test_loss"]), "o" + style, color=f"C{i}",
               label=name)
      # From layer 1: at layer 0 both predict 0 (distance 0 to GD step 0).
      bottom.plot(t[1:], _floats(entry["mse_to_gd_step"][1:]), "o" + style,
                  color=f"C{i}", label=f"{name} to GD step t")
      bottom.plot(t[1:], _floats(entry["mse_to_bayes"][1:]), "x:",
                  color=f"C{i}", label=f"{name} to Bayes")
    top.set(yscale="log", xlabel="layer t", ylabel="test MSE of layer t",
            title=f"L={depth}: prediction after each layer", xticks=t)
    bottom.set(yscale="log", xlabel="layer t", xticks=t,
               ylabel="MSE between predictions")
  axes[0, 0].legend(fontsize=6)
  axes[1, 0].legend(fontsize=6)
  return fig


def shifted_test_loss(results: dict) -> Figure:
  """Test MSE of trained models, GD and ridge under every shift, a panel per depth."""
  depths, shifts = results["depths"], list(results["shifted"])
  fig = Figure(figsize=(4 * len(depths), 4), layout="constrained")
  axes = fig.subplots(1, len(depths), squeeze=False)[0]
  for ax, i in zip(axes, range(len(depths))):
    for model in (*_trained(results), "gd_best_eta", "ridge"):
      ax.plot(shifts, _floats([results["shifted"][s]["test_loss"][model][i]
                               for s in shifts]), "o-", label=model)
    ax.set(yscale="log", title=f"L={depths[i]}: test MSE under shift")
    ax.tick_params(axis="x", rotation=70, labelsize=6)
  axes[0].legend(fontsize=7)
  return fig


def family_test_loss(results: dict) -> Figure:
  """A family run (``train.py`` with ``config.task`` a family of
  :mod:`elsa.tasks`): test MSE against depth, models and GD with 95% bars,
  every reference a horizontal line."""
  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  depths = results["depths"]
  styles = iter([(c, ls) for ls in ("--", "-.", ":") for c in (
      "black", "grey", "tab:olive", "tab:cyan", "tab:brown", "tab:pink")])
  for name, loss in results["test_loss"].items():
    loss = np.asarray(loss, dtype=float)
    if name in results["references"]:
      color, linestyle = next(styles)
      ax.axhline(loss[0], linestyle=linestyle, linewidth=1, color=color,
                 label=name)
      continue
    ax.errorbar(depths, loss, yerr=1.96 * np.asarray(
        results["test_loss_se"][name], dtype=float), marker="o", capsize=3,
                label=name)
  ax.set(xlabel="depth L", ylabel="test MSE", yscale="log", xticks=depths,
         title=f"{results['task']}: test loss vs depth")
  ax.legend(fontsize=7)
  return fig


def train_figures(results: dict) -> dict[str, Figure]:
  """Every figure of a train run's ``results``, by file name (no suffix): a
  family run's training and test loss, or the ridge run's five."""
  if "task" in results:  # a family of elsa.tasks
    return {"train_loss": train_loss(results),
            "test_loss_vs_depth": family_test_loss(results)}
  return {"train_loss": train_loss(results),
          "test_loss_vs_depth": test_loss_vs_depth(results),
          "trained_vs_gd": trained_vs_gd(results),
          "layer_predictions": layer_predictions(results),
          "shifted_test_loss": shifted_test_loss(results)}


# Newton-Schulz against GD (experiments/newton.py).


def newton_layers(results: dict, rows: list[dict]) -> Figure:
  """Layers vs kappa (left) and the median Newton error per layer (right).

  ``rows``: ``experiments.newton.summary_rows(results)``, medians per kappa.
  """
  kappas = [r["kappa"] for r in rows]
  fig = Figure(figsize=(11, 4))
  left, right = fig.subplots(1, 2)
  for key, label in (("newton_f64_safe", "ELSA-Newton, alpha=1/||A||_F (f64)"),
                     ("newton_f64_best", "ELSA-Newton, best alpha (f64)"),
                     ("newton_f32_safe", "ELSA-Newton f32 (tol_float32)"),
                     ("elsa_gd_best", "ELSA-GD, eta=2/(mu_min+mu_max)"),
                     ("gd_plain", "GD, eta=1/mu_max")):
    pts = [(k, r[key]) for k, r in zip(kappas, rows) if r[key] is not None]
    if pts:
      left.plot(*zip(*pts), marker="o", label=label)
  left.set(xscale="log", yscale="log", xlabel="kappa(A)",
           ylabel=f"layers to rel. error {results['config']['tol']:g}")
  left.legend(fontsize=7)
  for i, r in enumerate(results["per_kappa"]):
    for dtype, style in (("float64", "-"), ("float32", ":")):
      curve = r[f"newton_{dtype}_safe_curve"]
      right.plot(range(len(curve)), curve, style, color=f"C{i}",
                 label=f"kappa={r['kappa']:g} {dtype}")
  right.set(yscale="log", xlabel="layer", ylabel="median ||w - w*|| / ||w*||")
  right.legend(fontsize=6, ncol=2)
  return fig


# The algorithm library raced to the ridge solution (experiments/algorithms.py).


def algorithm_layers(results: dict) -> Figure:
  """Total layers to tol vs kappa, log-log, a line per algorithm (left); median error per layer at the largest kappa (right).

  Float64 counts are solid, float32 (``tol_float32``) dashed; a count past
  the layer budget is left out of its line (the legend says how many).
  """
  config = results["config"]
  kappas = [float(k) for k in config["kappas"]]
  fig = Figure(figsize=(11, 4))
  left, right = fig.subplots(1, 2)
  for i, name in enumerate(config["algorithms"]):
    for tail, style in (("", "-"), ("_float32", "--")):
      counts = results["layers_to_tol" + tail][name]
      pts = [(k, counts[f"{k:g}"]) for k in kappas
             if counts[f"{k:g}"] is not None]
      missing = len(kappas) - len(pts)
      label = f"{name}{' f32' if tail else ''}" + (
          f" ({missing} past budget)" if missing else "")
      if pts:
        left.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=label)
  left.set(xscale="log", yscale="log", xlabel="kappa(A)",
           ylabel="total layers to ||w - w*|| / ||w*|| <= tol",
           title=f"f64, tol {config['tol']:g} (solid); f32, tol "
           f"{config['tol_float32']:g} (dashed)")
  left.legend(fontsize=6, ncol=2)
  last = results["per_kappa"][-1]
  for i, name in enumerate(config["algorithms"]):
    for dtype, style in (("float64", "-"), ("float32", ":")):
      curve = last["algorithms"][name][dtype]["curve"]
      layers = np.asarray(curve["layers"]) + 1  # log axis: layer t at t + 1
      median = np.array([np.nan if v is None else max(v, _LOG_FLOOR)
                         for v in curve["median"]])
      right.plot(layers, median, style, color=f"C{i}",
                 label=f"{name} {dtype}")
  right.set(xscale="log", yscale="log", xlabel="layer + 1",
            ylabel="median ||w - w*|| / ||w*||",
            title=f"kappa = {last['kappa']:g}")
  right.legend(fontsize=6, ncol=2)
  return fig


# The field's protocol (experiments/prefix_protocol.py).


def error_vs_examples(title: str, models: dict, references: dict, *,
                      metric: str = "error") -> Figure:
  """Garg et al.'s figure 2: ``metric`` against the number of in-context
  examples, each model a solid line with its standard-error band (over
  seeds), each reference a thinner dashed line (the error axis stops at 1.2
  times the models' highest point, or 1.25). ``models`` and
  ``references``: ``{name: {metric: {"curve": [N], "se": [N]}}}``."""
  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  top = 1.25  # 1.0 is predicting zero
  for name, curves in models.items():
    if metric not in curves:
      continue
    curve, se = (_floats(curves[metric][k]) for k in ("curve", "se"))
    top = max(top, 1.2 * float(np.nanmax(curve, initial=0)))
    i = np.arange(len(curve))
    (line,) = ax.plot(i, curve, linewidth=2, label=name)
    ax.fill_between(i, curve - se, curve + se, color=line.get_color(),
                    alpha=0.25, linewidth=0)
  styles = iter([(c, ls) for ls in ("--", "-.", ":") for c in (
      "black", "grey", "tab:olive", "tab:cyan", "tab:brown", "tab:pink",
      "tab:purple")])
  for name, curves in references.items():
    if metric in curves:
      color, linestyle = next(styles)
      ax.plot(_floats(curves[metric]["curve"]), linestyle=linestyle,
              linewidth=1, color=color, label=name)
  label = ("normalised squared error" if metric == "error" else metric)
  ax.set(xlabel="in-context examples", ylabel=label, title=title)
  if metric == "error":  # least squares' peak at d examples would flatten all
    ax.set_ylim(0, top)
  ax.legend(fontsize=7, ncol=2)
  return fig
