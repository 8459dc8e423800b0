"""Every shell command that README.md, docs/getting_started.md and the guides
show, read out of the pages, so that a new one cannot be left untested.

A command is a line of a ```bash, ```sh or ```console block (backslash
continuations joined, trailing ``# comments`` dropped, ``&&`` and ``;``
chains split, a ``for`` loop's body taken as its commands), or an inline code
span of the prose that begins with ``python -m experiments.`` or
``python3 -m``. :data:`_TABLE` classifies each: the quick ones RUN as written,
as a user runs them (a fresh process without the suite's 64-bit mode, cache
or device count, in a fresh directory that holds nothing but ``experiments``
so the pages' relative ``--config`` paths resolve and ``runs/`` lands there);
the long ones are CHECKED without doing the work (the module exists; a
driver's flags parse through its own ``cli.define_flags``, so its ``--config``
file and variant load and every ``--config.FIELD=VALUE`` applies, ``--workdir``
is given, and the driver's ``validate`` accepts the config); the rest are
SKIPPED with the test that covers them. A command the table does not classify
fails, naming the page.
"""

import functools
import glob
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from unittest import mock

from absl import flags
from ml_collections import config_flags
import pytest
# Without the suite's 64-bit mode, compilation cache and device count, as the
# decompile driver's end-to-end test runs it.
from test_decompile_driver import _as_a_user

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("README.md", "docs/getting_started.md", "docs/guides/*.md")

RUN, CHECK, SKIP = "run", "check", "skip"
# (pattern searched in the command, as shlex.join writes it; what is done;
# why). The first match classifies a command.
_TABLE = (
    (r"^(python3 -m venv|pip install|\. \.venv/bin/activate)( |$)", SKIP,
     "tests/test_package.py installs the wheel"),
    (r"^python -m pytest ", SKIP, "the test suite itself"),
    (r"^python -m sphinx ", SKIP,
     "tests/test_docs.py builds the site with the same flags"),
    (r"benchmark\.py:ab ", SKIP,
     "a measurement at commit 8afb572; the page says the variant is removed"),
    (r"^python -m experiments\.sweep --workdir=runs/sweep$", RUN,
     "the README's main job, 17 s"),
    (r"runs/scale_", CHECK,
     "the scaling measurement: minutes at each device count"),
    (r" --distributed( |$)", CHECK, "a job of several processes or hosts"),
    (r"^python -m experiments\.\w+ --config=experiments/configs/\w+\.py:"
     r"(tiny|quick) ", RUN, "tiny sizes: seconds"),
    (r"^python -m experiments\.(sweep|newton|algorithms|train|decompile|"
     r"benchmark) ", CHECK, "a full run: minutes to hours"),
    (r"^python -m experiments\.decompile_(tasks|trained) runs/", CHECK,
     "reads the trained stacks of a full training run"),
    (r"^python -m experiments\.decompile_(timing|ground_truth)( |$)", CHECK,
     "a measurement of minutes"),
    (r"^python -c ", RUN, "seconds of library code"),
)
# Placeholders the pages write: a directory of the reader's choice, the shell
# variables of a loop over device counts and of one host's process id.
# DIR is the README's tiny decompile workdir: one command, run once, beside
# its finished train run.
_PLACEHOLDERS = {"=DIR": "=runs/tiny_stacks/decompile", "$n": "2", "$I": "0"}
_SHELL = re.compile(r"```(?:bash|sh|console|shell)\n(.*?)```", re.S)
_SPAN = re.compile(r"`((?:[A-Z_]+=\S* )*python3? -m [^`]+)`")


def _split(text: str) -> list[list[str]]:
  """The simple commands of one logical shell line: chains split, a loop's
  header and ``done`` dropped, leading ``VAR=value`` assignments kept."""
  lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  commands, current = [], []
  for token in lexer:
    if token in ("&&", ";", "||", "|"):
      commands.append(current)
      current = []
    else:
      current.append(token)
  commands.append(current)
  out = []
  for command in commands:
    if command[:1] == ["do"]:
      command = command[1:]
    if command and command[0] not in ("for", "done"):
      out.append(command)
  return out


def _block_lines(block: str):
  """Logical lines of a shell block: continuations joined, and a line whose
  quote is still open joined with the next (a ``python -c`` program)."""
  pending = ""
  for line in block.splitlines():
    if line.startswith("$ ") and not pending:
      line = line[2:]
    pending += line
    if pending.endswith("\\"):
      pending = pending[:-1]
      continue
    try:
      shlex.split(pending, comments=True)
    except ValueError:  # an open quote
      pending += "\n"
      continue
    if pending.strip():
      yield pending
    pending = ""
  assert not pending.strip(), f"an unterminated shell line: {pending!r}"


def documented_commands() -> dict[str, str]:
  """Each command the pages show (``shlex.join`` of its words, a leading
  ``VAR=value`` kept), first page it appears on."""
  found = {}
  for pattern in PAGES:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      with open(path, encoding="utf-8") as f:
        text = f.read()
      page = os.path.relpath(path, ROOT)
      lines = [line for block in _SHELL.findall(text)
               for line in _block_lines(block)]
      prose = re.sub(r"```.*?```", "", text, flags=re.S)
      lines += [" ".join(span.split()) for span in _SPAN.findall(prose)
                if re.match(r"([A-Z_]+=\S* )*(python -m experiments\.|python3 -m)",
                            " ".join(span.split()))]
      for line in lines:
        for words in _split(line):
          found.setdefault(shlex.join(_filled(words)), page)
  return found


def _filled(words: list[str]) -> list[str]:
  for placeholder, value in _PLACEHOLDERS.items():
    words = [w.replace(placeholder, value) for w in words]
  return words


def _words(command: str) -> tuple[dict, list[str]]:
  """A command's ``VAR=value`` environment and its words, a launcher
  (``srun ...``) dropped."""
  words = shlex.split(command)
  env = {}
  while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
    key, value = words.pop(0).split("=", 1)
    env[key] = value
  if words[0] == "srun":
    words = words[words.index("python"):]
  return env, words


def classify(command: str) -> tuple[str, str]:
  _, words = _words(command)
  for pattern, kind, reason in _TABLE:
    if re.search(pattern, shlex.join(words)):
      return kind, reason
  raise LookupError(command)


_COMMANDS = documented_commands()


def _sort_key(command):
  # Train before decompile, so the decompile driver finds the finished train
  # run beside its workdir (runs/train for runs/decompile) and trains none.
  return ("experiments.decompile " in command, command)


def _run_groups() -> list[tuple[str, ...]]:
  """The RUN commands, those whose workdirs share a folder below ``runs/``
  (a train run and the decompile run beside it) in one group, in order: one
  test each, so that no test process splits a pair."""
  groups = {}
  for command in sorted(_by_kind(RUN), key=_sort_key):
    workdir = [w for w in _words(command)[1] if w.startswith("--workdir=")]
    root = os.path.dirname(workdir[0].split("=", 1)[1]) if workdir else ""
    groups.setdefault(root if root not in ("", "runs") else command,
                      []).append(command)
  return [tuple(group) for group in groups.values()]


def test_pages_show_commands_and_every_one_is_classified():
  assert "python -m experiments.sweep --workdir=runs/sweep" in _COMMANDS
  unclassified = []
  for command, page in _COMMANDS.items():
    try:
      classify(command)
    except LookupError:
      unclassified.append(f"{page}: {command}")
  assert not unclassified, (
      "commands the pages show that tests/test_commands.py does not classify: "
      "add each to its _TABLE (run, check or skip, with the reason): "
      + "; ".join(unclassified))


def _by_kind(kind):
  return sorted(c for c in _COMMANDS if _classified(c) == kind)


def _classified(command):
  try:
    return classify(command)[0]
  except LookupError:
    return None


def _id(command):
  return _COMMANDS[command].rsplit("/", 1)[-1] + ":" + " ".join(
      _words(command)[1][2:])[:60]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
  """A fresh directory as a user's clone looks to the commands: only
  ``experiments`` (its configs at the pages' relative paths); ``runs/``
  is written here, shared by all commands."""
  path = tmp_path_factory.mktemp("user")
  os.symlink(os.path.join(ROOT, "experiments"), path / "experiments")
  return str(path)


@pytest.mark.parametrize("commands", _run_groups(),
                         ids=lambda group: " then ".join(map(_id, group)))
def test_quick_commands_run_as_written(commands, user_dir):
  for command in commands:
    _run_as_a_user(command, user_dir)


def _run_as_a_user(command, user_dir):
  env, words = _words(command)
  assert words[0] == "python", command
  start = time.perf_counter()
  env = {**_as_a_user(os.environ), "PYTHONPATH": ROOT, **env}
  proc = subprocess.run([sys.executable, *words[1:]], cwd=user_dir, env=env,
                        capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, (
      f"{_COMMANDS[command]}: `{command}` failed:\n{proc.stderr[-3000:]}")
  seconds = time.perf_counter() - start
  print(f"{seconds:.1f} s: {command}")
  if words[2] == "experiments.decompile":  # after train, in the same root
    assert "reusing the finished train run" in proc.stderr, proc.stderr[-2000:]


def _parse_driver_flags(module_name: str, argv: list[str]):
  """``argv`` parsed by the flags ``module_name``'s ``__main__`` block defines
  (its ``cli.define_flags`` and, if called, ``distributed.define_flags``), in
  a fresh ``FlagValues``: the config with every override applied."""
  from experiments import cli, distributed  # pylint: disable=g-import-not-at-top
  with open(importlib.util.find_spec(module_name).origin, encoding="utf-8") as f:
    main_block = f.read().split('if __name__ == "__main__":', 1)[1]
  name = re.search(r'cli\.define_flags\("(\w+)"\)', main_block).group(1)
  values = flags.FlagValues()

  def into_values(define):
    return functools.partial(define, flag_values=values)

  with mock.patch.multiple(
      flags, FLAGS=values, DEFINE_bool=into_values(flags.DEFINE_bool),
      DEFINE_string=into_values(flags.DEFINE_string),
      DEFINE_integer=into_values(flags.DEFINE_integer)), mock.patch.object(
          config_flags, "DEFINE_config_file",
          into_values(config_flags.DEFINE_config_file)), mock.patch.object(
              sys, "argv", [module_name, *argv]):  # overrides come from it
    cli.define_flags(name)
    if "distributed.define_flags()" in main_block:
      distributed.define_flags()
    values([module_name, *argv])
  return values


@pytest.mark.parametrize("command", _by_kind(CHECK), ids=_id)
def test_long_command_is_valid(command, monkeypatch):
  _, words = _words(command)
  assert words[:2] == ["python", "-m"], command
  module_name, argv = words[2], words[3:]
  spec = importlib.util.find_spec(module_name)
  assert spec, f"{_COMMANDS[command]}: no module {module_name}"
  with open(spec.origin, encoding="utf-8") as f:
    if "cli.define_flags(" not in f.read():
      return  # a script of positional arguments: that it exists
  module = importlib.import_module(module_name)
  monkeypatch.chdir(ROOT)  # the pages' relative --config paths
  values = _parse_driver_flags(module_name, argv)
  assert values.workdir, command
  module.validate(values.config)  # every driver checks its config first
