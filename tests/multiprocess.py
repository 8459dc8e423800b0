"""Runs a driver as several processes of one ``jax.distributed`` job on localhost.

Each process is ``python -m experiments.<driver> ...`` on the CPU backend with
``devices`` forced host devices, cwd and ``PYTHONPATH`` the repo root. The
processes meet at a coordinator on ``127.0.0.1`` and a free port, given either
as the plain flags (``--coordinator_address``, ``--num_processes``,
``--process_id``) or, with ``slurm=True``, as the environment SLURM gives each
task (what ``jax.distributed.initialize()`` detects by itself). The whole job
is bounded by ``timeout`` seconds; when it runs out, or as soon as one process
fails, every process still running is killed (the job is dead anyway: its
peers would only wait for it).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Finished:
  """One process of a job: its exit code (``None``: killed) and output."""

  process_id: int
  returncode: int | None
  stdout: str
  stderr: str

  def report(self) -> str:
    return (f"--- process {self.process_id}, exit code {self.returncode} ---\n"
            f"stdout (tail):\n{self.stdout[-1500:]}\n"
            f"stderr (tail):\n{self.stderr[-4000:]}")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def environment(devices: int) -> dict[str, str]:
  """The environment of one process: CPU, ``devices`` host devices, the repo
  importable, the rest of this process's environment (``XLA_FLAGS`` too)."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "JAX_COORDINATOR"))}
  path = env.get("PYTHONPATH")
  # The run's other XLA flags (tests/conftest.py) are kept.
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO + (f":{path}" if path else
                                                    ""),
             XLA_FLAGS=" ".join(
                 [*flags, f"--xla_force_host_platform_device_count={devices}"]))
  return env


def run_single(driver: str, args: list[str], *, devices: int = 1,
               timeout: float = 120) -> Finished:
  """``driver`` as one ordinary process (no ``--distributed``)."""
  proc = subprocess.run([sys.executable, "-m", f"experiments.{driver}", *args],
                        cwd=REPO, env=environment(devices), capture_output=True,
                        text=True, timeout=timeout, check=False)
  return Finished(0, proc.returncode, proc.stdout, proc.stderr)


def launch(driver: str, args: list[str] | Callable[[int], list[str]], *,
           processes: int = 2, devices: int = 2, timeout: float = 120,
           slurm: bool = False, start: Sequence[int] | None = None,
           cwd: Callable[[int], str] | None = None,
           kill_when: tuple[int, Callable[[], bool]] | None = None
           ) -> list[Finished]:
  """Runs ``driver`` with ``--distributed`` as ``processes`` processes; waits for all.

  Args:
    args: the driver's other flags: the same for every process, or a
      function of the process id.
    devices: forced host devices per process.
    timeout: seconds for the whole job; then every process is killed.
    slurm: launch as ``srun`` would (SLURM_* environment, no coordinator
      flags) instead of with the coordinator flags.
    cwd: each process's working folder, a function of the process id
      (default the repo root).
    start: the process ids to start (default all): the others never join,
      as a host the scheduler never started; they are reported as killed.
    kill_when: ``(process_id, condition)``: kill that process (SIGKILL) as
      soon as ``condition()`` holds, as a preempted host dies.

  Returns:
    One :class:`Finished` per process started, by process id.
  """
  port = free_port()
  procs, logs = [], []
  started = range(processes) if start is None else start
  for pid in started:
    env = environment(devices)
    cmd = [sys.executable, "-m", f"experiments.{driver}",
           *(args(pid) if callable(args) else args), "--distributed"]
    if slurm:
      env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost",
                 SLURM_NTASKS=str(processes), SLURM_PROCID=str(pid),
                 SLURM_LOCALID=str(pid), SLURM_STEP_NUM_NODES="1",
                 JAX_COORDINATOR_PORT=str(port))
    else:
      cmd += [f"--coordinator_address=127.0.0.1:{port}",
              f"--num_processes={processes}", f"--process_id={pid}"]
    out = tempfile.TemporaryFile("w+")
    err = tempfile.TemporaryFile("w+")
    logs.append((out, err))
    procs.append(subprocess.Popen(cmd, cwd=cwd(pid) if cwd else REPO,
                                  env=env, stdout=out,
                                  stderr=err, text=True))
  deadline = time.monotonic() + timeout
  killed = set()
  try:
    while any(p.poll() is None for p in procs):
      failed = any(p.poll() not in (None, 0) for p in procs)
      if kill_when is not None and kill_when[1]():
        procs[kill_when[0]].kill()
        killed.add(kill_when[0])
        kill_when = None
      if failed or time.monotonic() > deadline:
        # Give the others a moment to report the failure themselves.
        grace = time.monotonic() + (15 if failed else 0)
        while (any(p.poll() is None for p in procs)
               and time.monotonic() < grace):
          time.sleep(0.1)
        break
      time.sleep(0.1)
  finally:
    for i, p in enumerate(procs):
      if p.poll() is None:
        p.kill()
        killed.add(i)
      p.wait()
  finished = []
  for position, (i, p, (out, err)) in enumerate(zip(started, procs, logs)):
    out.seek(0)
    err.seek(0)
    finished.append(Finished(i, None if position in killed else p.returncode,
                             out.read(), err.read()))
    out.close()
    err.close()
  return finished


def report(finished: list[Finished]) -> str:
  """Every process's exit code and output tails: the message of a failed assert."""
  return "\n".join(f.report() for f in finished)
