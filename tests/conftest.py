"""Test-wide settings: float64 available everywhere; each test names its dtype."""

import jax

jax.config.update("jax_enable_x64", True)
