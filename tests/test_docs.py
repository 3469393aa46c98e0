"""The documentation site builds with `mkdocs build --strict`, and documents every setting and every error code.

After datasette's documentation tests (every setting documented): here the settings and errors pages are generated
from `runtime/settings.py` and `handler/errors.py` by `docs/hooks.py`, so these tests read the built HTML, where a
table that was not generated, or a marker dropped from its page, shows. The strict build itself fails on a broken
link or anchor between pages, and on an error code without its line in `docs/hooks.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from handler.errors import ERRORS
from runtime.settings import SETTINGS

REPO = Path(__file__).resolve().parent.parent


class _Tables(HTMLParser):
    """The rows of every table in a page, each a list of its cells' text (whitespace collapsed)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _rows(page: Path) -> list[list[str]]:
    parser = _Tables()
    parser.feed(page.read_text())
    return parser.rows


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it (this venv's mkdocs, --strict), into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life notice (docs/development.md)
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_the_site_builds_strict(site: Path) -> None:
    for page in ("index.html", "settings/index.html", "errors/index.html", "api/score/index.html"):
        assert (site / page).is_file(), page


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.env)
def test_every_setting_is_documented_with_its_default(site: Path, setting) -> None:
    rows = {row[0]: row for row in _rows(site / "settings" / "index.html") if row and row[0].startswith(("SCOREFN_",
                                                                                                        "PORT"))}
    assert setting.env in rows, f"{setting.env} is not on the settings page"
    default = "~/.cache/scorefn" if setting.name == "cache_dir" else setting.default
    assert rows[setting.env][1] == (default or "(empty)")
    assert rows[setting.env][2] == " ".join(setting.help.replace("`", "").split())  # shown literally


def test_every_error_code_is_documented_with_its_status_and_type(site: Path) -> None:
    shown: dict[str, tuple[str, str]] = {}
    for row in _rows(site / "errors" / "index.html")[1:]:
        status, codes, kinds = row[0], row[1].split(", "), row[2].split(", ")
        statuses = status.split(" / ")
        for i, code in enumerate(codes):  # one status / type for the row, or one per code in the codes' order
            assert code not in shown, f"{code} is on the errors page twice"
            shown[code] = (statuses[i if len(statuses) > 1 else 0], kinds[i if len(kinds) > 1 else 0])
    assert set(shown) == set(ERRORS)
    for code, spec in ERRORS.items():
        assert shown[code] == (str(spec.status), spec.type), code


def test_where_things_are_names_every_package_and_only_those(site: Path) -> None:
    """docs/how-it-works/where-things-are.md's table: one row per package of the project, each one that exists."""
    rows = _rows(site / "how-it-works" / "where-things-are" / "index.html")
    named = {row[0] for row in rows[1:] if row}
    packages = {init.parent.relative_to(REPO).as_posix() for top in ("handler", "runtime", "loadtests")
                for init in (REPO / top).rglob("__init__.py")}
    assert named == packages, f"named but absent: {sorted(named - packages)}; absent from the page: " \
                              f"{sorted(packages - named)}"
