"""Executes experiments/colab.ipynb headlessly on the tiny config, so it cannot rot.

The kernel is this interpreter (a kernelspec written into a temporary
JUPYTER_PATH), not whatever ``python`` a global kernelspec would find.
"""

import json
import os
import sys

import nbclient
import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "experiments", "colab.ipynb")
KERNEL = "elsa-test-python"


def _kernel_for_this_interpreter(folder):
  spec = os.path.join(folder, "kernels", KERNEL)
  os.makedirs(spec)
  with open(os.path.join(spec, "kernel.json"), "w", encoding="utf-8") as f:
    json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                        "{connection_file}"],
               "display_name": "elsa tests", "language": "python"}, f)


def test_notebook_runs_tiny_sweep_and_shows_figures(tmp_path, monkeypatch):
  _kernel_for_this_interpreter(str(tmp_path / "jupyter"))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("PYTHONPATH", REPO)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  workdir = str(tmp_path / "run")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1
  params[0].source = (f'CONFIG_ARG = "tiny"\nOVERRIDES = {{"depth": 3}}\n'
                      f'WORKDIR = {workdir!r}\nREPO_URL = "unused"\n')
  client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=240,
                                   resources={"metadata": {"path": REPO}})
  client.execute()  # raises CellExecutionError on any failing cell

  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 5
  text = "".join(o.get("text", "") for o in outputs)
  assert "max_rel_err over stable cells" in text  # the summary table
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  assert {r["depth"] for r in results["records"]} == {1, 2, 3}
  assert results["max_rel_err"] < 2e-6
