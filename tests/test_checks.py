"""Config checks (experiments/checks.py): one line naming the field and the range."""

import ml_collections
import pytest

from experiments import checks


def _config(**fields):
  return ml_collections.ConfigDict(dict(dict(depth=3, lam=0.1), **fields))


def test_config_checks_name_the_field_and_the_range():
  config = _config(steps=0, tol=float("nan"), lams=(), etas=(0.1, -1.0),
                   flag=True, mode="x", grid=(0.1, 0.2, 0.1), big=2 ** 63)
  cases = [
      (lambda: checks.check_int(config, "steps"),
       r"^config\.steps must be an int >= 1, got 0\.$"),
      (lambda: checks.check_int(config, "flag"), "an int >= 1, got True"),
      (lambda: checks.check_float(config, "tol", low=0, high=1,
                                  low_open=True),
       r"config\.tol must be a finite number in \(0, 1\], got nan"),
      (lambda: checks.check_items(config, "lams"),
       r"config\.lams must be a non-empty tuple \(--config\.lams=0\.1 or "
       r"--config\.lams='\(0\.1, 0\.2\)'\), got \(\)\.$"),
      (lambda: checks.check_items(config, "etas", low=0, low_open=True),
       r"config\.etas\[1\] must be a finite number > 0, got -1\.0"),
      (lambda: checks.check_choice(config, "mode", ("a", "b")),
       r"config\.mode must be one of \['a', 'b'\], got 'x'"),
      (lambda: checks.check_fits(1e18, fields="d and n_train"),
       r"config: d and n_train need about .* GiB"),
      (lambda: checks.check_items(config, "grid", low=0),
       r"config\.grid\[2\] repeats config\.grid\[0\] \(0\.1\); list each "
       "value once"),
      (lambda: checks.check_seed(config, "big"),
       r"config\.big must be an int in \[0, 9223372036854775807\], got "
       r"9223372036854775808\."),
  ]
  for check, message in cases:
    with pytest.raises(checks.ConfigError, match=message):
      check()
  assert issubclass(checks.ConfigError, ValueError)
  assert checks.check_int(config, "depth") == 3


def test_a_tuple_field_of_the_wrong_type_names_the_tuple_forms():
  """What the command line gives for ``--config.lams=abc`` (a string where a
  tuple belongs) or ``--config.etas='(0.1, "x")'``: the message shows both
  ways to write the field."""
  config = _config(lams="abc", etas=(0.1, "x"), forms=3)
  for field, kwargs, message in [
      ("lams", {}, r"^config\.lams must be a non-empty tuple \(--config\.lams"
                   r"=0\.1 or --config\.lams='\(0\.1, 0\.2\)'\), got 'abc'\.$"),
      ("etas", {}, r"^config\.etas\[1\] must be a number, got 'x' \(a tuple "
                   r"of numbers: --config\.etas=0\.1 or "),
      ("forms", {"choices": ("natural", "designed")},
       r"--config\.forms=natural or --config\.forms=\"\('natural', "
       r"'designed'\)\"\), got 3\.$")]:
    with pytest.raises(checks.ConfigError, match=message) as err:
      checks.check_items(config, field, **kwargs)
    assert "\n" not in str(err.value) and "\\" not in str(err.value)
