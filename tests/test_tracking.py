"""The train driver's TensorBoard events, read back from the files."""

import glob
import os
import struct

import numpy as np
import orbax.checkpoint as ocp
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.proto import plugin_hparams_pb2

from experiments import train
from experiments import train_setup
from experiments import tracking
from experiments.configs import train as train_config


def _events(folder: str) -> list:
  """Every event in the TFRecord event files under ``folder`` (the format:
  length, its CRC, the serialised event, its CRC)."""
  events = []
  for path in sorted(glob.glob(os.path.join(folder, "**", "events.out.*"),
                               recursive=True)):
    with open(path, "rb") as f:
      while header := f.read(8):
        (length,) = struct.unpack("<Q", header)
        f.read(4)
        events.append(event_pb2.Event.FromString(f.read(length)))
        f.read(4)
  return events


def _scalars(events) -> dict[str, dict[int, float]]:
  """``{tag: {step: value}}``; every (tag, step) must be written once."""
  found = {}
  for event in events:
    for value in event.summary.value:
      if value.HasField("simple_value"):
        steps = found.setdefault(value.tag, {})
        assert event.step not in steps, (value.tag, event.step)
        steps[event.step] = value.simple_value
  return found


def test_train_writes_losses_learning_rate_and_hparams(tmp_path,
                                                       monkeypatch):
  """Killed as step 20's checkpoint is saved (steps 10-19 tracked, their
  checkpoint lost, the event file ending in a truncated record), then
  resumed from step 10: the events hold every step once (TB2/TB3)."""
  config = train_config.get_config("tiny")
  config.models = ("lsa_trained",)
  config.depths = (1,)
  config.steps, config.warmup_steps, config.log_every = 20, 5, 10
  config.checkpoint_every = 10
  config.n_test, config.eval_chunk, config.eta_grid = 32, 32, 5
  del config.shifts["x_laplace"]
  workdir = str(tmp_path)
  save = ocp.CheckpointManager.save

  def killed_at_20(self, step, *args, **kwargs):
    if step == 20:
      raise KeyboardInterrupt
    return save(self, step, *args, **kwargs)

  with monkeypatch.context() as patch:
    patch.setattr(ocp.CheckpointManager, "save", killed_at_20)
    with pytest.raises(KeyboardInterrupt):
      train.run(config, workdir)
  (path,) = glob.glob(os.path.join(workdir, tracking.FOLDER, "*", "events.*"))
  assert sorted(_scalars(_events(os.path.dirname(path)))[
      "train/lsa_trained/L1/lr_0.01_init_scale_0.03/loss"]) == list(range(20))
  with open(path, "ab") as f:
    f.write(b"\x10\x00\x00")  # a record cut short by the kill
  results = train.run(config, workdir)
  events = _events(os.path.join(workdir, tracking.FOLDER))
  scalars = _scalars(events)
  for (lr, scale), val_loss in zip(train_setup.grid(config),
                                   results["tuning"]["lsa_trained"][0][
                                       "val_loss"]):
    point = f"lsa_trained/L1/lr_{lr:g}_init_scale_{scale:g}"
    loss = scalars[f"train/{point}/loss"]
    assert sorted(loss) == list(range(config.steps))
    # Every step's loss; the chosen point's window means are results.json's.
    if lr == results["tuning"]["lsa_trained"][0]["learning_rate"]:
      means = np.asarray([loss[i] for i in range(config.steps)]).reshape(
          -1, config.log_every).mean(axis=1)
      np.testing.assert_allclose(means, results["train_loss"]["lsa_trained"][0],
                                 rtol=1e-6)
    rate = scalars[f"train/{point}/learning_rate"]
    assert rate[0] == 0.0  # warmup from 0
    assert rate[config.warmup_steps] == np.float32(lr)  # the peak
    assert rate[config.steps - 1] < lr
    np.testing.assert_allclose(scalars[f"validation/{point}/loss"][
        config.steps], val_loss, rtol=1e-6)
  for name, losses in results["test_loss"].items():
    np.testing.assert_allclose(scalars[f"test/{name}/loss"][1], losses[0],
                               rtol=1e-6)
  # The config as hyper-parameters, beside the final test losses.
  infos = [plugin_hparams_pb2.HParamsPluginData.FromString(
      value.metadata.plugin_data.content) for event in events
           for value in event.summary.value
           if value.tag == "_hparams_/session_start_info"]
  (info,) = infos
  hparams = info.session_start_info.hparams
  assert hparams["steps"].number_value == config.steps
  assert hparams["tokens"].string_value == config.tokens
  assert hparams["learning_rates"].string_value == "[0.003, 0.01]"
  assert hparams["shifts.x_scale_x2.x_scale"].number_value == 2.0
  np.testing.assert_allclose(
      scalars["test/lsa_trained/loss_at_L1"][0],
      results["test_loss"]["lsa_trained"][0], rtol=1e-6)
