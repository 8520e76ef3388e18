"""The docs site builds with warnings as errors and loads nothing from elsewhere.

Not a unit test: it runs Sphinx over the whole site (seconds), so `./dev test --unit`
leaves it to the full suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def test_the_site_builds_with_warnings_as_errors_and_works_offline(tmp_path: Path) -> None:
    out = tmp_path / "html"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(DOCS),
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    pages = list(out.rglob("*.html"))
    assert {"index.html", "settings.html", "cli.html", "metrics.html", "changelog.html"} <= {
        p.name for p in pages
    }
    settings_page = (out / "reference" / "settings.html").read_text(encoding="utf-8")
    assert "RELAY_BATCH_SIZE" in settings_page and "RELAY_CONSOLE_TOKEN_FILE" in settings_page
    assert "relay_messages_total" in (out / "reference" / "metrics.html").read_text("utf-8")
    # Nothing fetched from elsewhere: no script, style sheet, font or image by URL.
    remote = re.compile(
        r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=[\"'](?:https?:)?//", re.IGNORECASE
    )
    for page in pages:
        found = remote.findall(page.read_text(encoding="utf-8"))
        assert not found, f"{page.relative_to(out)} loads {found}"
    css_remote = re.compile(r"url\(\s*[\"']?(?:https?:)?//|@import\s+[\"']?(?:https?:)?//")
    for sheet in out.rglob("*.css"):
        assert not css_remote.search(sheet.read_text(encoding="utf-8")), sheet.relative_to(out)
