"""The README documents every setting, exactly as the settings table defines it."""

from __future__ import annotations

from pathlib import Path

from runtime.settings import SETTINGS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_setting_is_documented_with_its_default():
    table = README.split("<!-- settings-table -->")[1].split("<!-- /settings-table -->")[0]
    for setting in SETTINGS:
        default = "~/.cache/scorefn" if setting.name == "cache_dir" else setting.default
        assert f"| `{setting.env}` | `{default}` | {setting.help} |" in table, setting.env


def test_readme_shows_the_two_commands():
    assert "make serve" in README and "make test" in README
