"""One job on many processes: the ``--distributed`` flags, the device mesh, who writes.

Every driver runs the same command on one process or on many (JAX's
multi-controller runtime: one process per host, each driving its local
devices; every process runs the same program on global arrays). With
``--distributed`` the driver first calls :func:`jax.distributed.initialize`:
under SLURM (``srun``) or another environment JAX detects, with no more flags;
elsewhere with ``--coordinator_address=HOST:PORT --num_processes=N
--process_id=I`` on each process.

The contract every driver keeps through this module:

* **One job.** Before anything else, every process posts its driver, its
  ``--workdir`` (as given) and its config (canonical) in the key-value store
  and compares them with every other process's (:func:`agree_on_job`): a
  process given another config, workdir or driver stops every process with
  the same line naming what differs, before anything is claimed.
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
* **Nothing hangs.** A process that has not joined within ``--join_timeout``
  seconds, or whose heartbeats stop for ``--heartbeat_timeout`` seconds (it
  died, or process 0, which runs the coordination service, is gone), ends
  every other process within that time. JAX's coordination client ends a
  process with a C++ abort then (its Python callback cannot be used: jaxlib
  cannot convert the status it passes), so each process runs under a small
  parent (:func:`_supervise`) that turns that abort into the driver's line
  saying what happened and how to resume.
* **Sharding.** Work is split over :func:`jax.devices` (every device of every
  process) along a 1-D or 2-D :class:`jax.sharding.Mesh`; host arrays
  (identical on every process) become global arrays through :func:`put`,
  results come back replicated (:func:`to_host`).

A single process (no ``--distributed``) goes through the same functions,
which then do nothing more than the one-process run did.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import signal
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

from experiments import checks
from experiments import cli
from experiments import workdirs

# The refusals a driver reports in one line (cli.run_main); an agreed one is
# raised again, as the same type, on every process.
_REFUSALS = {cls.__name__: cls for cls in (checks.ConfigError,
                                           workdirs.WorkdirInUse,
                                           workdirs.CorruptOutput)}
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
  flags.DEFINE_integer("join_timeout", 300,
                       "With --distributed: seconds every process waits for "
                       "all to join the job; then each that is waiting stops "
                       "with a line saying so.", lower_bound=1)
  flags.DEFINE_integer("heartbeat_timeout", 100,
                       "With --distributed: a process silent this many "
                       "seconds (dead, or process 0's coordination service "
                       "gone) stops every other process with a line saying "
                       "so.", lower_bound=1)


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

  A refusal (:class:`experiments.checks.ConfigError`, ``WorkdirInUse``,
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


def _job_fields(job: dict) -> dict:
  """A job as flat fields: ``driver``, ``workdir`` and ``config.<field>``."""
  return {"driver": job["driver"], "workdir": job["workdir"],
          **{f"config.{k}": v for k, v in job["config"].items()}}


def agree_on_job(name: str, config: ml_collections.ConfigDict,
                 workdir: str) -> None:
  """Every process runs the same driver, workdir and config, or none does.

  Each process posts its job (the driver ``name``, ``workdir`` as given: the
  same command on every host; the canonical config) and reads every
  other's, so each compares the same posts and all raise the same refusal.
  Nothing happens with one process.

  Raises:
    checks.ConfigError: naming the first process whose job differs from
      process 0's and the fields that differ (their values on both).
  """
  client = _client()
  if client is None:
    return
  key = f"elsa/job/{next(_steps)}"
  mine = {"driver": name, "workdir": workdir,
          "config": checks.config_dict(config)}
  client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(mine))
  jobs = [_job_fields(json.loads(client.blocking_key_value_get(
      f"{key}/{process}", _AGREE_TIMEOUT_MS)))
          for process in range(jax.process_count())]
  for process, job in enumerate(jobs[1:], start=1):
    differ = sorted(k for k in set(job) | set(jobs[0])
                    if job.get(k) != jobs[0].get(k))
    if differ:
      shown = "; ".join(f"{k} ({jobs[0].get(k)!r} on process 0, "
                        f"{job.get(k)!r} on process {process})"
                        for k in differ[:3])
      more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
      raise checks.ConfigError(
          f"the processes were given different jobs: process {process} "
          f"differs from process 0 in {shown}{more}. Give every process the "
          "same command (only --process_id differs); nothing was written.")


class SharedWorkdir(workdirs.Workdir):
  """The workdir as every process of a job sees it: process 0's.

  A JSON output read is process 0's reading, sent to the others
  (:func:`from_process_0`; a damaged file or another config's is refused on
  every process), so every process takes the same path through a resumed
  run; writes happen on process 0 alone (elsewhere they do nothing).
  """

  def read_json(self, name: str) -> dict | None:
    return from_process_0(f"read {name}",
                          lambda: workdirs.Workdir.read_json(self, name))

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
                  overwrite: bool = False) -> Iterator[workdirs.Workdir]:
  """:func:`experiments.workdirs.claim_workdir` by process 0, for every process.

  Every process leaves only when process 0 holds the workdir (its deletions
  under ``overwrite`` done, ``config.json`` written), or raises the refusal
  process 0 got. With several processes every one gets a
  :class:`SharedWorkdir`: process 0's reads, process 0's writes.
  """
  with contextlib.ExitStack() as stack:
    claim = lambda: stack.enter_context(workdirs.claim_workdir(
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


def _die_with_parent() -> None:
  """Asks Linux to kill this process when its parent ends (the supervisor,
  killed as a preempted host is): no orphan keeps the job's devices."""
  with contextlib.suppress(Exception):
    # prctl(PR_SET_PDEATHSIG, SIGKILL)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
  if os.getppid() == 1:  # the parent was gone before the request
    os._exit(1)  # pylint: disable=protected-access


def _supervise(name: str) -> int:
  """Forks; the child returns (a pipe's write end: :func:`run_main` writes
  to it once the job is joined) and runs the job. The parent only waits and
  reports how the child ended, then exits the same way.

  JAX's coordination client ends a process with ``abort()`` (a C++ trace)
  when the job did not form within ``initialization_timeout``, when the
  service reports a peer without heartbeats, or when the service (process 0)
  is gone. The parent turns that into the driver's one line.
  """
  joined_read, joined_write = os.pipe()
  child = os.fork()
  if child == 0:
    os.close(joined_read)
    _die_with_parent()
    return joined_write
  os.close(joined_write)
  # Ctrl-C reaches the child as well (one process group); a scheduler's
  # SIGTERM sent to this process alone is passed on.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, lambda signum, _: os.kill(child, signum))
  _, status = os.waitpid(child, 0)
  joined = bool(os.read(joined_read, 1))
  if os.WIFEXITED(status):
    os._exit(os.WEXITSTATUS(status))  # pylint: disable=protected-access
  killed_by = os.WTERMSIG(status)
  if killed_by != signal.SIGABRT:  # killed from outside: end the same way
    with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler
      signal.signal(killed_by, signal.SIG_DFL)
    os.kill(os.getpid(), killed_by)
    os._exit(128 + killed_by)  # pylint: disable=protected-access
  _stop(name, joined=joined)


def _stop(name: str, *, joined: bool) -> None:
  """Ends this process with the driver's line for a job that did not form
  (``joined`` false) or lost a process, and how to resume."""
  me = flags.FLAGS.process_id
  who = "this process" if me is None else f"process {me}"
  if not joined:
    what = (f"not every process joined the job within --join_timeout="
            f"{flags.FLAGS.join_timeout} s. Start all "
            f"{flags.FLAGS.num_processes or 'of its'} processes with the same "
            "--coordinator_address and --num_processes, each with its own "
            "--process_id (or through the scheduler)")
  else:
    what = (f"{who} lost the job: another process died or sent no heartbeat "
            f"for --heartbeat_timeout={flags.FLAGS.heartbeat_timeout} s, or "
            "process 0, which runs the coordination service, is gone (the "
            "lines above name it). Once every process can run, start them all")
  print(f"{name}: stopped: {what}; the same command then resumes the run "
        "from the files in --workdir.", file=sys.stderr, flush=True)
  os._exit(1)  # pylint: disable=protected-access


def _peer_gone(err: BaseException) -> bool:
  """A collective failed because a peer process is gone: on CPU, Gloo
  reports the dead peer's closed connection before the heartbeats run out,
  when the kill finds this process inside a collective: the connection
  closed, or reset if the peer died with data unread."""
  return (isinstance(err, jax.errors.JaxRuntimeError)
          and ("closed by peer" in str(err)
               or "reset by peer" in str(err)))


def run_main(argv, name: str, run, **kwargs):
  """:func:`experiments.cli.run_main`, first initialising ``jax.distributed``
  under ``--distributed`` (every process then agrees on the job,
  :func:`agree_on_job`); then a failure on one process stops every process
  promptly (an agreed refusal ends each with its one-line message), and a
  process that never joins or dies is reported by the others in bounded time
  (``--join_timeout``, ``--heartbeat_timeout``)."""
  global _agreed_failure
  if not flags.FLAGS.distributed:
    return cli.run_main(argv, name, run, **kwargs)
  joined = _supervise(name)
  cli.quiet_libraries()  # before the backends start: their probe is INFO
  jax.distributed.initialize(
      coordinator_address=flags.FLAGS.coordinator_address,
      num_processes=flags.FLAGS.num_processes,
      process_id=flags.FLAGS.process_id,
      initialization_timeout=flags.FLAGS.join_timeout,
      heartbeat_timeout_seconds=flags.FLAGS.heartbeat_timeout)
  os.write(joined, b"j")
  os.close(joined)
  logging.info("%s: process %d of %d, %d local of %d devices", name,
               jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  _watch_for_failures(name)
  _agreed_failure = False
  try:
    try:
      agree_on_job(name, flags.FLAGS.config, flags.FLAGS.workdir)
    except checks.ConfigError as refusal:
      _agreed_failure = True
      raise SystemExit(f"{name}: {refusal}") from None
    return cli.run_main(argv, name, run, **kwargs)
  except BaseException as err:  # pylint: disable=broad-except
    if _agreed_failure or (isinstance(err, SystemExit) and not err.code):
      raise  # every process ends the same way: a normal exit
    if _peer_gone(err):
      _stop(name, joined=True)
    _announce_failure(name, err)


# --- sharding --------------------------------------------------------------


def mesh(shape: Sequence[int] | None = None,
         axis_names: Sequence[str] = ("batch",)) -> Mesh:
  """A mesh over every device of every process (``shape``, whose product is
  the device count; default all on one axis)."""
  devices = np.array(jax.devices())
  return Mesh(devices.reshape(shape or devices.shape), tuple(axis_names))


def batch_sharding() -> Callable[[jax.Array], jax.Array]:
  """A function that splits an array's leading (batch) axis over this
  process's devices, inside a jitted program (``with_sharding_constraint``;
  under ``vmap`` the mapped axis stays whole); the identity on one device."""
  devices = jax.local_devices()
  if len(devices) == 1:
    return lambda x: x
  split = NamedSharding(Mesh(np.array(devices), ("batch",)),
                        PartitionSpec("batch"))
  return lambda x: jax.lax.with_sharding_constraint(x, split)


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
