"""The documentation site: Sphinx reads the Markdown pages of docs/ with MyST.

`make docs` builds it with warnings as errors, so a broken link, a missing anchor or image, or a
page left out of the table of contents fails CI.
"""

from importlib import metadata

project = "fanout"
author = "the fanout authors"
copyright = "2026, the fanout authors"
try:
    release = version = metadata.version("django-batch-fanout")
except metadata.PackageNotFoundError:  # a checkout that is not installed
    release = version = ""

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# Headings get anchors as GitHub makes them, so `pools.md#partitioned-pools` works in both.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "fanout"
html_theme_options = {
    "description": "Durable, capacity-bounded fan-out for Django",
    "page_width": "1200px",  # the examples keep lines of up to 100 columns
    "body_max_width": "none",
    "sidebar_width": "220px",
    "code_font_size": "0.85em",
}
