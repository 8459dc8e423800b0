"""Installs the `elsa` package, distributed as `elsa-attention`: `pip install -e '.[test]'`.

The version is `elsa.__version__`, read from elsa/__init__.py without
importing the package (which needs jax); pyproject.toml holds the build-system
table only.
"""

import os
import re

from setuptools import find_packages, setup

_HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
  with open(os.path.join(_HERE, "elsa", "__init__.py"), encoding="utf-8") as f:
    return re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)


setup(
    # `elsa` on the package index is an unrelated project; the import name
    # stays `elsa`.
    name="elsa-attention",
    version=_version(),
    description="Extended linear self-attention (ELSA): exact constructions, "
                "gradient descent and Newton-Schulz as attention stacks, in JAX.",
    long_description=open(os.path.join(_HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["elsa", "elsa.*"]),
    python_requires=">=3.11",
    # Plain `jax`, never `jax[cpu]`: the same install must keep a GPU or TPU
    # jaxlib that is already present (Colab).
    install_requires=[
        "jax>=0.4.35",
        "flax>=0.10",
        "optax>=0.2.3",
        "chex>=0.1.87",
        "absl-py>=2.1",
        "ml_collections>=0.1.1",
        "matplotlib>=3.8",
        "orbax-checkpoint>=0.6",
        # TensorBoard event files without TensorFlow (experiments.tracking).
        "tensorboardX>=2.6",
        "scikit-learn>=1.3",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "numpy>=1.26",
            "nbformat>=5.9",
            "nbclient>=0.10",
            "ipykernel>=6.29",
            # tests/test_package.py builds the wheel offline (no build
            # isolation) with these (setuptools < 70.1 needs `wheel`; a
            # Python 3.12 venv has no setuptools).
            "setuptools>=64",
            "wheel>=0.42",
        ],
        # The documentation site (docs/, tests/test_docs.py): the versions it
        # was built with, warnings as errors.
        "docs": [
            "sphinx==9.0.4",
            "myst-nb==1.4.0",
            "myst-parser==5.2.0",
            "sphinx-book-theme==1.4.0",
            "pydata-sphinx-theme==0.20.0",
        ],
    },
)
