"""Sphinx configuration of the elsa documentation site.

Build it (warnings are errors; what tests/test_docs.py runs):

    pip install -e '.[docs]'
    python -m sphinx -W -b html docs docs/_build/html

Pages are MyST markdown; the two notebooks of experiments/ are pages through
myst-nb, rendered as stored (the test suite executes them, tests/test_notebooks.py,
so the build does not run them a second time); the API reference is autodoc over
the docstrings (Google style, through Napoleon).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import elsa  # pylint: disable=wrong-import-position

project = "elsa"
author = "The elsa developers"
copyright = "2025, The elsa developers"  # pylint: disable=redefined-builtin
version = release = elsa.__version__

# Where the repository is published: the "Open in Colab" badges of the notebook
# pages and the theme's repository button point here. setup.py, pyproject.toml,
# CITATION.cff and the README name no repository yet, so this owner/name is a
# placeholder: when the repository is published, set it here, the one place.
GITHUB_REPOSITORY = "elsa-attention/elsa"
GITHUB_BRANCH = "main"

extensions = [
    "myst_nb",                      # markdown pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",          # Google-style docstrings
    "sphinx.ext.mathjax",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}

# MyST: $...$ math in pages and notebooks, ::: fences, heading anchors for
# links of the form page.md#section.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# Notebooks are rendered with the outputs they hold; the suite executes them.
nb_execution_mode = "off"

# autodoc: members in source order, Google-style sections, type hints beside
# the arguments they annotate.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autosummary_generate = False  # summary tables only (docs/api/elsa.md), no stub pages
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = f"elsa {release}"
html_theme_options = {
    "repository_url": f"https://github.com/{GITHUB_REPOSITORY}",
    "repository_branch": GITHUB_BRANCH,
    "use_repository_button": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
# docs/_static/custom.css: wide code blocks scroll horizontally.
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# The notebook pages are copies of experiments/*.ipynb, made here at every build
# into docs/notebooks/ (ignored by git) with an "Open in Colab" badge under the
# title: the URL lives in one place and the notebooks stay as the suite runs them.
NOTEBOOKS = ("colab.ipynb", "programs.ipynb")
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"


def _copy_notebooks():
  os.makedirs(os.path.join(ROOT, "docs", "notebooks"), exist_ok=True)
  for name in NOTEBOOKS:
    with open(os.path.join(ROOT, "experiments", name), encoding="utf-8") as f:
      notebook = json.load(f)
    url = (f"https://colab.research.google.com/github/{GITHUB_REPOSITORY}/blob/"
           f"{GITHUB_BRANCH}/experiments/{name}")
    notebook["cells"].insert(1, {  # under the title cell
        "cell_type": "markdown", "metadata": {},
        "source": [f"[![Open in Colab]({COLAB_BADGE})]({url})"]})
    for i, cell in enumerate(notebook["cells"]):  # ids, as nbformat 4.5 asks
      cell.setdefault("id", f"cell-{i}")
    notebook["nbformat_minor"] = max(notebook.get("nbformat_minor", 0), 5)
    text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
    path = os.path.join(ROOT, "docs", "notebooks", name)
    old = None
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        old = f.read()
    if old != text:  # rewritten only when changed
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)


_copy_notebooks()


def _init_signature(app, what, name, obj, options, signature, return_annotation):
  """The signature of a class as its ``__init__`` declares it.

  flax.nnx.Module's metaclass defines ``__call__``, so autodoc renders every
  nnx class of elsa.nn as ``Elsa(*args, **kwargs)``; the arguments a user
  passes are those of ``__init__``, read here without ``self``.
  """
  del app, name, options, return_annotation
  if what != "class" or signature not in (None, "(*args, **kwargs)"):
    return None
  import inspect  # pylint: disable=import-outside-toplevel
  init = obj.__dict__.get("__init__") or getattr(obj, "__init__", None)
  if init is None or init is object.__init__:
    return None
  params = list(inspect.signature(init).parameters.values())[1:]
  return str(inspect.Signature(params)), None


def setup(app):
  app.connect("autodoc-process-signature", _init_signature)
