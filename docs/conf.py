"""Sphinx configuration of flexjax's documentation site: `make docs` builds it into build/docs."""

import flexjax

project = "flexjax"
author = "the flexjax authors"
copyright = "the flexjax authors"
release = version = flexjax.__version__

extensions = [
    "myst_nb",  # MyST markdown pages, .ipynb notebooks and MyST text notebooks (myst_parser included)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings are Google style
    "sphinx.ext.viewcode",
]

# notebooks/ is a link to the repository's notebooks; its generator script and data are not pages.
exclude_patterns = ["_build", "notebooks/data", "**.ipynb_checkpoints"]

# -- MyST ------------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence"]
# Anchors for headings down to ###, so `page.md#a-heading` links work here as on GitHub.
myst_heading_anchors = 3

# -- myst-nb ---------------------------------------------------------------------------------
# The notebooks are committed with their outputs (notebooks/make_notebooks.py runs them), and
# running them all at their committed sizes takes minutes: render them as stored. A page that
# draws its pictures at build time (masks_and_mods.md) asks for execution in its own front matter.
nb_execution_mode = "off"
nb_execution_timeout = 300
nb_execution_raise_on_error = True  # a cell that fails fails the build, not just a warning
nb_execution_show_tb = True
nb_merge_streams = True

# -- autodoc ---------------------------------------------------------------------------------
autodoc_default_options = {"members": True, "member-order": "bysource"}
# The docstrings state types and shapes; the annotations would spell ArrayLike out as a long Union.
autodoc_typehints = "none"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# -- HTML ------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "flexjax"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
