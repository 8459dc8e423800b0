"""Executes the notebooks under experiments/ headlessly on tiny sizes, so they cannot rot.

The kernel is this interpreter (a kernelspec written into a temporary
JUPYTER_PATH), not whatever ``python`` a global kernelspec would find.
"""

import json
import os
import re
import sys

import nbclient
import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = "elsa-test-python"


def _execute(name: str, parameters: str, tmp_path, monkeypatch) -> list:
  """Runs ``experiments/<name>`` with its ``parameters`` cell replaced; returns
  the outputs of every code cell (raises CellExecutionError on a failing cell)."""
  spec = tmp_path / "jupyter" / "kernels" / KERNEL
  os.makedirs(spec)
  with open(spec / "kernel.json", "w", encoding="utf-8") as f:
    json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                        "{connection_file}"],
               "display_name": "elsa tests", "language": "python"}, f)
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("PYTHONPATH", REPO)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(os.path.join(REPO, "experiments", name), as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1
  params[0].source = parameters
  nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=240,
                          resources={"metadata": {"path": REPO}}).execute()
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def _images(outputs) -> list:
  return [o for o in outputs if "image/png" in o.get("data", {})]


def test_colab_runs_tiny_sweep_and_shows_figures(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  outputs = _execute(
      "colab.ipynb", f'CONFIG_ARG = "tiny"\nOVERRIDES = {{"depth": 3}}\n'
      f'WORKDIR = {workdir!r}\nREPO_URL = "unused"\n', tmp_path, monkeypatch)
  assert len(_images(outputs)) == 5
  text = "".join(o.get("text", "") for o in outputs)
  assert "max_rel_err over stable cells" in text  # the summary table
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  assert {r["depth"] for r in results["records"]} == {1, 2, 3}
  assert results["max_rel_err"] < 2e-6


def test_programs_compiles_heavy_ball_and_matches_its_interpreter(
    tmp_path, monkeypatch):
  outputs = _execute(
      "programs.ipynb", 'N, D = 8, 3\nKAPPA = 10.0\nLOOPS = 60\n'
      'REPO_URL = "unused"\n', tmp_path, monkeypatch)
  assert len(_images(outputs)) == 1
  text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                 for o in outputs)
  assert "rows \\ cols" in text and "m = " in text  # print(compiled)
  gap = float(re.search(r"max \|stack - interpreter\| over the first \d+ "
                        r"layers \(relative\): (\S+)", text).group(1))
  assert gap <= 1e-12
  # Heavy ball reaches 1e-10 at kappa 10 within the 60 loops; GD does not.
  counts = dict(re.findall(r"^(heavy ball, ELSA stack|GD \(best step\), ELSA "
                           r"stack)\s+layers to 1e-10: (.+)$", text, re.M))
  assert counts["heavy ball, ELSA stack"].isdigit()
  assert counts["GD (best step), ELSA stack"].startswith("not within")
  assert "refused: programs:" in text and "divides by a block" in text
