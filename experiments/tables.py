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


