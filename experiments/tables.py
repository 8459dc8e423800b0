"""A family run's results as Markdown: the table the tasks guide and the
driver's log show (models, GD and references against the best reference,
with paired standard errors)."""

from __future__ import annotations

import numpy as np


def family_table(results: dict, *, scale: float = 1.0) -> str:
  """A family run's ``results.json`` as Markdown: per model and GD and
  depth ``mean / median (mean paired difference to the best reference ±
  its se)``, with ``[worst 1%: S]`` where the worst 1% of prompts make
  more than half of the mean; the references (each at every depth) and
  the paired model-to-model differences ``mean ± se (median ± se)``. Every
  loss times ``scale`` (the driver's: ``1 / family.error_scale(d)``,
  Garg et al.'s normalisation, so that predicting zero scores about 1)."""
  depths, best = results["depths"], results["best_reference"]
  num = lambda v, fmt: "—" if v is None or not np.isfinite(v) else format(
      v * scale, fmt)

  def cell(name: str, i: int) -> str:
    text = (f"{num(results['test_loss'][name][i], '.4g')} / "
            f"{num(results['test_loss_median'][name][i], '.3g')}")
    if name != best:
      diff = results["vs_best_reference"][name]
      text += (f" ({num(diff['mean'][i], '+.3g')} ± "
               f"{num(diff['se'][i], '.2g')})")
    share = results["test_loss_worst_share"][name][i]
    if share is not None and share > 0.5:
      text += f" [worst 1%: {share:.0%}]"
    return text

  head = "| | " + " | ".join(f"L = {d}" for d in depths) + " |"
  lines = [head, "|---" * (len(depths) + 1) + "|"]
  for name in results["test_loss"]:
    if name not in results["references"]:
      lines.append(f"| {name} | " + " | ".join(
          cell(name, i) for i in range(len(depths))) + " |")
  lines.append("")
  lines.append(f"References (mean / median, minus {best} ± se): " + "; ".join(
      f"{name} {cell(name, 0)}" for name in results["references"]) + ".")
  if results.get("paired"):
    lines += ["", "| paired difference | " + " | ".join(
        f"L = {d}" for d in depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for pair, diff in results["paired"].items():
      lines.append(f"| {pair} | " + " | ".join(
          f"{num(diff['mean'][i], '+.3g')} ± {num(diff['se'][i], '.2g')} "
          f"({num(diff['median'][i], '+.3g')} ± "
          f"{num(diff['median_se'][i], '.2g')})" for i in range(len(depths)))
                   + " |")
  return "\n".join(lines)




def prefix_columns(n_points: int, d: int) -> list[int]:
  """The numbers of examples a prefix table shows: 0, 1, d/2, d - 1, d,
  d + 1, 2d and N - 1 (the ones inside the prompt): the start, the
  interpolation threshold of least squares and the end."""
  wanted = {0, 1, d // 2, d - 1, d, d + 1, 2 * d, n_points - 1}
  return sorted(i for i in wanted if 0 <= i < n_points)


def prefix_table(models: dict, references: dict, *, n_points: int, d: int,
                 metric: str = "error", tuning: dict | None = None) -> str:
  """Markdown: one row per model and reference, ``mean ± se`` of ``metric``
  at the numbers of examples of :func:`prefix_columns`. ``models`` and
  ``references``: ``{name: {metric: {"curve": [N], "se": [N], ...}}}``
  (:mod:`experiments.prefix_protocol`); a model's standard error is over its
  seeds, a reference's over the prompts (those on fewer prompts than the
  others are marked with their number). ``tuning``: ``{model: {
  "learning_rate", "n_diverged", "points"}}``, shown beside the model."""
  columns = prefix_columns(n_points, d)
  num = lambda v: "—" if v is None or not np.isfinite(v) else f"{v:.3g}"

  def row(name: str, curves: dict) -> str:
    c = curves.get(metric)
    cells = (["—"] * len(columns) if c is None else
             [f"{num(c['curve'][i])} ± {num(c['se'][i])}" for i in columns])
    return f"| {name} | " + " | ".join(cells) + " |"

  lines = ["| examples in context | " + " | ".join(map(str, columns)) + " |",
           "|---" * (len(columns) + 1) + "|"]
  for name, curves in models.items():
    label = name
    if tuning and name in tuning:
      t = tuning[name]
      lr = t["learning_rate"]
      label += (f" (lr {lr:g}" if lr is not None else " (every lr diverged"
                ) + f", {t['n_diverged']}/{t['points']} diverged)"
    lines.append(row(label, curves))
  # The references fitted one prompt at a time on the host see fewer prompts.
  prompts = {n: c.get(metric, {}).get("prompts") for n, c in references.items()}
  most = max((p for p in prompts.values() if p), default=None)
  for name, curves in references.items():
    few = prompts[name] and prompts[name] < most
    lines.append(row(f"{name} [{prompts[name]} prompts]" if few else name,
                     curves))
  return "\n".join(lines)
