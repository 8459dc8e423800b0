"""Figures of the sweep, drawn from its records (the dicts in ``results.json``).

Every function takes the record list and returns a ``matplotlib.figure.Figure``
built without pyplot, so it works headless, in a notebook and under any
backend; save it with :func:`experiments.common.save_figure`. Diverged cells
(``eta`` past the GD stability limit) never enter an error curve: the heatmap
shows them greyed out and labelled, the curves leave them out and say how many.
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
