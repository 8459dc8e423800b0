"""Test-wide settings: float64 available everywhere (each test names its
dtype), property tests that draw the same examples on every run, and the
``variant`` fixture."""

import jax
import pytest
from hypothesis import settings

jax.config.update("jax_enable_x64", True)

settings.register_profile("elsa", derandomize=True, deadline=None)
settings.load_profile("elsa")


@pytest.fixture(params=["eager", "jit"])
def variant(request):
  """A test runs once calling the function directly and once under
  :func:`jax.jit` (what ``chex.variants`` gives an absltest case)."""
  return (lambda fn: fn) if request.param == "eager" else jax.jit
