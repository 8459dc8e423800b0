r"""python -m experiments.decompile --workdir=runs/decompile

Decompiles the models a ``train`` run trained (``config.train``, the train
driver's config; its workdir is ``config.train_workdir``, or else a finished
run of that config at ``<workdir>/train`` or beside ``<workdir>`` (``runs/train``
for ``runs/decompile``), reused; with none, it is trained at
``<workdir>/train`` first): every family of
``elsa.decompile.FAMILIES`` is fitted to every model at every depth and ranked
on held-out tasks. The defaults are the settings of the figures in
docs/guides/decompile.md.

Variants (``--config=experiments/configs/decompile.py:NAME``):

* ``tiny``: after ``train.py:tiny`` (tests and Colab; it reuses that run): the
  paper's pair (trained ELSA and LSA), two families (GD and heavy ball), few
  tasks and optimiser steps.
* ``vonoswald``: the models of ``train.py:vonoswald`` (von Oswald et al.'s
  setting, depths 1, 2, 3), reusing its workdir if
  ``--config.train_workdir`` points to it.
"""

import ml_collections

from experiments import checks
from experiments.configs import train as train_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The default run, or the variant ``arg`` (``tiny``, ``vonoswald``)."""
  arg = checks.variant("decompile", arg, ("tiny", "vonoswald"))
  config = ml_collections.ConfigDict()
  config.seed = 0
  # The training run whose models are decompiled (the same config the train
  # driver takes) and its workdir (None: <workdir>/train).
  config.train = train_config.get_config(arg)
  config.train_workdir = ml_collections.config_dict.placeholder(str)
  # Which of config.train.models to decompile (empty: all).
  config.models = ()
  # Tasks of config.train's distribution: the fit on n_fit, every metric and
  # the ranking on n_test others (each a multiple of the local device count).
  config.n_fit = 64
  config.n_test = 128
  # Families (names of elsa.decompile.FAMILIES; empty: all), the held-out
  # disagreement that counts as the same computation, the candidate
  # iterations per layer, and the optimiser (random starts, Adam steps,
  # Levenberg-Marquardt steps).
  config.families = ()
  config.tol = 1e-3
  config.iterations = (1, 2)
  config.restarts = 4
  config.adam_steps = 0
  config.lm_steps = 20
  # The similarity map holds every layer against GD steps 0..this, at the
  # train run's validation-chosen step size.
  config.similarity_steps = 12
  # elsa.decompile.spectral at every model and depth: the filter's degree K
  # and the extra terms (names of elsa.decompile.EXTRAS; "query_key" is for
  # layouts whose query token is among the keys).
  config.spectral_degree = 4
  config.spectral_extras = ("y_energy", "start")
  # Its tasks (fit, held out): it is cheap (one model evaluation and a least
  # squares), and the extras have (K + 1) (d + 2) coefficients: on n_fit = 64
  # single-query tasks they would fit noise.
  config.spectral_n_fit = 2048
  config.spectral_n_test = 2048
  if arg == "vonoswald":
    config.spectral_extras = ("y_energy", "start", "query_key")
  if arg == "tiny":
    config.n_fit = 64
    config.n_test = 64
    config.models = ("elsa_trained", "lsa_trained")
    config.families = ("gd", "heavy_ball")
    config.restarts = 2
    config.lm_steps = 10
    config.similarity_steps = 4
    config.spectral_n_fit = 256
    config.spectral_n_test = 256
  return config
