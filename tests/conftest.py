"""Test-wide settings: float64 available everywhere (each test names its
dtype), and property tests that draw the same examples on every run."""

import jax
from hypothesis import settings

jax.config.update("jax_enable_x64", True)

settings.register_profile("elsa", derandomize=True, deadline=None)
settings.load_profile("elsa")
