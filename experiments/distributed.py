"""One job on many processes: the ``--distributed`` flags, the device mesh, who writes.

Every driver runs the same command on one process or on many (JAX's
multi-controller runtime: one process per host, each driving its local
devices; every process runs the same program on global arrays). With
``--distributed`` the driver first calls :func:`jax.distributed.initialize`:
under SLURM (``srun``) or another environment JAX detects, with no more flags;
elsewhere with ``--coordinator_address=HOST:PORT --num_processes=N
--process_id=I`` on each process.

The contract every driver keeps through this module:

* **Same decision everywhere, before any wait.** Config validation runs on
  every process and its outcome is exchanged (:func:`agree`) through the
  coordination service's key-value store, not a device collective: a config
  refused on one process (say one host has less memory) is refused on all,
  with the same one-line message naming the process, and nobody waits on a
  barrier for a process that has left.
* **Process 0 writes.** It alone claims the workdir
  (:func:`claim_workdir`, the lock, ``config.json``, ``--overwrite``'s
  deletions) and writes every output; the others wait for its claim, get its
  refusal if it was refused, and read only what it names as finished.
* **A failure stops the job at once.** A process that fails outside an
  agreed refusal posts its error in the key-value store and exits; every
  other process watches for that post (a thread polling twice a second) and
  exits with ``<driver>: stopped: process K failed: ...`` instead of waiting
  in a collective for a peer that is gone. Written files are atomic, so the
  same command resumes the run.
* **Sharding.** Work is split over :func:`jax.devices` (every device of every
  process) along a 1-D or 2-D :class:`jax.sharding.Mesh`; host arrays
  (identical on every process) become global arrays through :func:`put`,
  results come back replicated (:func:`to_host`).

A single process (no ``--distributed``) goes through the same functions,
which then do nothing more than the one-process run did.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
import traceback
from typing import Callable, Iterator, Sequence

from absl import flags
from absl import logging
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import ml_collections
import numpy as np

from experiments import common

# The refusals a driver reports in one line (common.run_main); an agreed one is
# raised again, as the same type, on every process.
_REFUSALS = {cls.__name__: cls for cls in (common.ConfigError,
                                           common.WorkdirInUse,
                                           common.CorruptOutput)}
_FAILED_KEY = "elsa/failed"
# How long a process waits for the others' outcome of a step (validation, the
# claim): a step every process runs at once, so a peer that has not posted
# in this time is gone.
_AGREE_TIMEOUT_MS = 10 * 60 * 1000
_steps = itertools.count()  # names each exchange (keys are set once)
_agreed_failure = False  # the last refusal was raised on every process


def define_flags() -> None:
  """``--distributed`` and the coordinator flags; called only under ``__main__``."""
  flags.DEFINE_bool(
      "distributed", False,
      "Run as one process of a multi-process job: call "
      "jax.distributed.initialize() first (SLURM and other clusters are "
      "detected; elsewhere give the three flags below).")
  flags.DEFINE_string("coordinator_address", None,
                      "With --distributed: HOST:PORT of process 0's "
                      "coordination service (the same on every process).")
  flags.DEFINE_integer("num_processes", None,
                       "With --distributed: how many processes the job has.")
  flags.DEFINE_integer("process_id", None,
                       "With --distributed: this process's index, 0 to "
                       "num_processes - 1.")


def _client():
  """The coordination service's client, or ``None`` (one process, not initialised)."""
  # Private in JAX but the one handle on the key-value store (orbax uses it
  # the same way); multihost_utils offers only device collectives.
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def is_writer() -> bool:
  """Whether this process writes outputs (process 0)."""
  return jax.process_index() == 0


def agree(step: str, check: Callable[..., object], *args):
  """Calls ``check(*args)`` on every process; all raise the same refusal, or none does.

  A refusal (:class:`experiments.common.ConfigError`, ``WorkdirInUse``,
  ``CorruptOutput``) on any process is raised on every process, as the same
  type, with the lowest failing process's message (prefixed ``process K:``
  when there are several processes). Other exceptions propagate where they
  happen (the failure watch stops the others). Returns ``check``'s value.
  """
  global _agreed_failure
  client = _client()
  try:
    value, mine = check(*args), None
  except tuple(_REFUSALS.values()) as err:
    if client is None:
      raise
    value, mine = None, err
  if client is None:
    return value
  key = f"elsa/agree/{next(_steps)}-{step}"
  client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(
      None if mine is None else [type(mine).__name__, str(mine)]))
  for process in range(jax.process_count()):
    outcome = json.loads(client.blocking_key_value_get(f"{key}/{process}",
                                                       _AGREE_TIMEOUT_MS))
    if outcome is not None:
      _agreed_failure = True
      kind, message = outcome
      raise _REFUSALS[kind](f"process {process}: {message}")
  return value


def from_process_0(step: str, read: Callable[[], object]):
  """``read()`` on process 0, its JSON value sent to every process through
  the key-value store (a refusal raised on every process)."""
  global _agreed_failure
  client = _client()
  if client is None:
    return read()
  key = f"elsa/from0/{next(_steps)}-{step}"
  if is_writer():
    try:
      value = read()
    except tuple(_REFUSALS.values()) as err:
      client.key_value_set(key, json.dumps([type(err).__name__, str(err)]))
      _agreed_failure = True
      raise
    client.key_value_set(key, json.dumps(["value", value]))
    return value
  kind, value = json.loads(client.blocking_key_value_get(key,
                                                         _AGREE_TIMEOUT_MS))
  if kind != "value":
    _agreed_failure = True
    raise _REFUSALS[kind](f"process 0: {value}")
  return value


class SharedWorkdir(common.Workdir):
  """The workdir as every process of a job sees it: process 0's.

  A JSON output read is process 0's reading, sent to the others
  (:func:`from_process_0`; a damaged file or another config's is refused on
  every process), so every process takes the same path through a resumed
  run; writes happen on process 0 alone (elsewhere they do nothing).
  """

  def read_json(self, name: str) -> dict | None:
    return from_process_0(f"read {name}",
                          lambda: common.Workdir.read_json(self, name))

  def own(self, name: str, *, tree: bool = False) -> None:
    if is_writer():
      super().own(name, tree=tree)

  def write_json(self, name: str, obj: dict) -> None:
    if is_writer():
      super().write_json(name, obj)

  def write_npz(self, name: str, arrays) -> None:
    if is_writer():
      super().write_npz(name, arrays)

  def save_figure(self, fig, name: str) -> None:
    if is_writer():
      super().save_figure(fig, name)
    else:
      import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
      plt.close(fig)


@contextlib.contextmanager
def claim_workdir(workdir: str, config: ml_collections.ConfigDict, *,
                  overwrite: bool = False) -> Iterator[common.Workdir]:
  """:func:`experiments.common.claim_workdir` by process 0, for every process.

  Every process leaves only when process 0 holds the workdir (its deletions
  under ``overwrite`` done, ``config.json`` written), or raises the refusal
  process 0 got. With several processes every one gets a
  :class:`SharedWorkdir`: process 0's reads, process 0's writes.
  """
  with contextlib.ExitStack() as stack:
    claim = lambda: stack.enter_context(common.claim_workdir(
        workdir, config, overwrite=overwrite))
    claimed = agree("claim", claim if is_writer() else lambda: None)
    yield (claimed if jax.process_count() == 1
           else SharedWorkdir(workdir, config))


def _watch_for_failures(name: str) -> None:
  """Starts a daemon thread that ends this process when another one fails."""
  client = _client()

  def watch():
    while True:
      time.sleep(0.5)
      try:
        failure = client.key_value_try_get(_FAILED_KEY)
      except Exception:  # pylint: disable=broad-except
        continue  # not posted (NOT_FOUND), or the service is shutting down
      print(f"{name}: stopped: {failure}", file=sys.stderr, flush=True)
      os._exit(1)  # pylint: disable=protected-access

  threading.Thread(target=watch, name="elsa-failure-watch",
                   daemon=True).start()


def _announce_failure(name: str, err: BaseException) -> None:
  """Posts this process's failure for the others, then ends this process.

  ``os._exit``: a normal exit would first wait (up to minutes) at the
  shutdown barrier of ``jax.distributed`` for peers that are stopping
  because of this very failure.
  """
  if isinstance(err, SystemExit):
    message = str(err.code)
  else:
    traceback.print_exc()
    message = f"{type(err).__name__}: {err}".splitlines()[0]
    print(f"{name}: {message}", file=sys.stderr)
  with contextlib.suppress(Exception):
    _client().key_value_set(
        _FAILED_KEY, f"process {jax.process_index()} failed: {message}")
  sys.stdout.flush()
  sys.stderr.flush()
  logging.flush()
  os._exit(1)  # pylint: disable=protected-access


def run_main(argv, name: str, run, **kwargs):
  """:func:`experiments.common.run_main`, first initialising ``jax.distributed``
  under ``--distributed``; then a failure on one process stops every process
  promptly (an agreed refusal ends each with its one-line message)."""
  global _agreed_failure
  if not flags.FLAGS.distributed:
    return common.run_main(argv, name, run, **kwargs)
  jax.distributed.initialize(
      coordinator_address=flags.FLAGS.coordinator_address,
      num_processes=flags.FLAGS.num_processes,
      process_id=flags.FLAGS.process_id)
  logging.info("%s: process %d of %d, %d local of %d devices", name,
               jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  _watch_for_failures(name)
  _agreed_failure = False
  try:
    return common.run_main(argv, name, run, **kwargs)
  except BaseException as err:  # pylint: disable=broad-except
    if _agreed_failure or (isinstance(err, SystemExit) and not err.code):
      raise  # every process ends the same way: a normal exit
    _announce_failure(name, err)


# --- sharding --------------------------------------------------------------


def mesh(shape: Sequence[int] | None = None,
         axis_names: Sequence[str] = ("batch",)) -> Mesh:
  """A mesh over every device of every process (``shape``, whose product is
  the device count; default all on one axis)."""
  devices = np.array(jax.devices())
  return Mesh(devices.reshape(shape or devices.shape), tuple(axis_names))


def put(array, sharding: NamedSharding) -> jax.Array:
  """A global array from the same host array on every process (each keeps
  only its devices' shards)."""
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array (what every process can read)."""
  return NamedSharding(mesh, PartitionSpec())


def put_tasks(tree, mesh: Mesh):
  """Host arrays with a leading task axis ``[B, ...]`` (the same on every
  process) as global arrays split over ``mesh``'s ``batch`` axis, padded to
  a multiple of its size with copies of task 0 (drop them with
  :func:`take_tasks`)."""
  split = NamedSharding(mesh, PartitionSpec("batch"))

  def place(array):
    array = np.asarray(array)
    pad = -array.shape[0] % mesh.size
    return put(np.concatenate([array, np.repeat(array[:1], pad, axis=0)]),
               split)

  return jax.tree.map(place, tree)


def take_tasks(tree, count: int):
  """Replicated outputs of :func:`put_tasks`' inputs as numpy, the first
  ``count`` tasks (the padding dropped)."""
  return jax.tree.map(lambda a: np.asarray(a)[:count], tree)


def to_host(tree):
  """The replicated arrays of ``tree`` as numpy, on every process."""
  return jax.tree.map(np.asarray, tree)
