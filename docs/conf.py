"""Sphinx configuration of the docs site: MyST Markdown, the furo theme, and the
references generated from the code (docs/_ext/relay_reference.py).

Build it with `./dev docs` (warnings are errors). The site works offline: no fonts,
scripts or styles from elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

from relay import __version__

# The references' generator, a local extension (docs/_ext/relay_reference.py).
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

project = "pg-outbox-relay"
author = "the pg-outbox-relay authors"
copyright = "the pg-outbox-relay authors"
version = release = __version__

extensions = [
    "myst_parser",
    "relay_reference",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# --- MyST ---
myst_enable_extensions = [
    "colon_fence",  # ::: fences for directives, beside ``` ones
    "deflist",
    "fieldlist",
    "attrs_inline",
    "strikethrough",
]
# Anchors for headings down to ####, so pages can link to [x](other.md#a-heading).
myst_heading_anchors = 4

# --- HTML ---
html_theme = "furo"
html_title = f"pg-outbox-relay {release}"
html_static_path: list[str] = []
html_copy_source = False
html_show_sourcelink = False
html_theme_options = {
    # furo's defaults load nothing from elsewhere; keep it so (no footer icons that
    # fetch, no announcement scripts).
    "navigation_with_keys": True,
    "top_of_page_buttons": [],
    "footer_icons": [],
}
# No math extension is on: a page with math would load MathJax from a CDN, and
# tests/test_docs.py fails on any script, style or font from elsewhere.
