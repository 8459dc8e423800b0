"""Installs the `elsa` package: `pip install -e '.[test]'`."""

from setuptools import find_packages, setup

setup(
    name="elsa",
    version="0.1.0",
    description="Extended linear self-attention (ELSA): exact constructions, "
                "gradient descent and Newton-Schulz as attention stacks, in JAX.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["elsa", "elsa.*"]),
    python_requires=">=3.10",
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
        ],
    },
)
