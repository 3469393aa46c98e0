"""README.md is the front door: the two commands, one request per endpoint, and links into docs/ that resolve.

Every setting's documentation is checked on the built site (tests/test_docs.py).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_readme_shows_the_two_commands():
    assert "make serve" in README and "make test" in README


def test_readme_stays_a_front_door():
    """What a newcomer reads first; the rest belongs in docs/ (mkdocs builds and checks that, README it does not)."""
    assert len(README.encode()) <= 12_000, "README.md has grown: move the detail into a page under docs/"


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert links
    missing = [link for link in links if "://" not in link and not (REPO / link).exists()]
    assert not missing, missing
