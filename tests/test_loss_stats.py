"""Per-prompt loss statistics (experiments/loss_stats.py): the median's
standard error against its sampling spread, summaries on known answers."""

import numpy as np
import pytest

from experiments import loss_stats


@pytest.mark.parametrize("draw,want", [
    # sqrt(pi / 2) s / sqrt(n) for normal draws; 1 / (2 f(m) sqrt(n)) with
    # f(m) = 1 for uniform ones, and for exponential ones f(ln 2) = 1/2.
    (lambda rng, n: 3.0 * rng.standard_normal(n), 3.0 * np.sqrt(np.pi / 2)),
    (lambda rng, n: rng.uniform(size=n), 0.5),
    (lambda rng, n: rng.exponential(size=n), 1.0),
])
def test_median_se_is_the_sampling_spread_of_the_median(draw, want):
  # The estimate, from one sample of n: its own noise is about
  # 1 / sqrt(2 z sqrt(n)) = 5% here, so a wrong factor (2, z) cannot pass.
  n = 40_000
  rng = np.random.default_rng(7)
  assert loss_stats.median_se(draw(rng, n)) == pytest.approx(
      want / np.sqrt(n), rel=0.15)
  # What the medians of 400 samples of 2000 spread by, against the mean
  # estimate over those samples.
  samples = [draw(rng, 2000) for _ in range(400)]
  assert np.std([np.median(x) for x in samples], ddof=1) == pytest.approx(
      np.mean([loss_stats.median_se(x) for x in samples]), rel=0.1)


def test_loss_and_paired_summaries_known_answers():
  # Mean, its standard error, median and the worst 1%'s share of the total.
  s = loss_stats.loss_summary([1.0, 2.0, 3.0, 4.0, 100.0])
  assert s == pytest.approx({"mean": 22.0, "se": np.sqrt(7610 / 4 / 5),
                             "median": 3.0, "median_se": s["median_se"],
                             "worst_share": 100 / 110}, rel=1e-12)
  # n = 3: the median's z-interval (quantiles 1/2 -+ 1.96 / (2 sqrt(3)),
  # clipped) is the whole sample, so the se is its range over 2 z.
  assert loss_stats.median_se([2.0, 1.0, 30.0]) == pytest.approx(
      29 / 3.92, rel=1e-12)
  # 1% of 200 prompts is the two worst: half of this mean.
  s = loss_stats.loss_summary([1.0] * 198 + [99.0, 101.0])
  assert s["worst_share"] == pytest.approx(200 / 398, rel=1e-12)
  assert s["median"] == 1.0
  # Paired: the statistics of a - b, prompt by prompt.
  s = loss_stats.paired_summary([1.0, 2.0, 3.0, 10.0], [0.0, 0.0, 6.0, 10.0])
  assert s == pytest.approx({"mean": 0.0, "se": np.sqrt(14 / 3 / 4),
                             "median": 0.5,
                             "median_se": loss_stats.median_se([1, 2, -3, 0])},
                            abs=1e-12)
  # Pairing removes the prompts' shared difficulty.
  base = np.arange(1.0, 101.0) ** 2
  s = loss_stats.paired_summary(base + 0.1 * (-1.0) ** np.arange(100), base)
  assert s["mean"] == pytest.approx(0.0, abs=1e-12)
  assert s["se"] == pytest.approx(0.1 / np.sqrt(100) * np.sqrt(100 / 99),
                                  rel=1e-9)
