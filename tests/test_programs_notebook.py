"""Executes experiments/programs.ipynb headlessly on a tiny size, so it cannot rot.

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
NOTEBOOK = os.path.join(REPO, "experiments", "programs.ipynb")
KERNEL = "elsa-test-python"


def _kernel_for_this_interpreter(folder):
  spec = os.path.join(folder, "kernels", KERNEL)
  os.makedirs(spec)
  with open(os.path.join(spec, "kernel.json"), "w", encoding="utf-8") as f:
    json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                        "{connection_file}"],
               "display_name": "elsa tests", "language": "python"}, f)


def test_notebook_compiles_heavy_ball_and_matches_its_interpreter(
    tmp_path, monkeypatch):
  _kernel_for_this_interpreter(str(tmp_path / "jupyter"))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("PYTHONPATH", REPO)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1
  params[0].source = ('N, D = 8, 3\nKAPPA = 10.0\nLOOPS = 60\n'
                      'REPO_URL = "unused"\n')
  client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=240,
                                   resources={"metadata": {"path": REPO}})
  client.execute()  # raises CellExecutionError on any failing cell

  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 1
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
