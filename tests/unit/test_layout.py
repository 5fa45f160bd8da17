"""The README's layout table is the map of the package: every module and folder is in it,
in its folder's rows, and nothing it names is missing from the tree."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
PKG = REPO / "ascend_store"


def _table() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in section.splitlines() if ln.startswith("| ")]


def _folder_rows() -> dict[str, str]:
    """Each package folder's rows, from its `ascend_store/<folder>/` row to the next one."""
    rows: dict[str, str] = {}
    current = None
    for ln in _table():
        m = re.match(r"\| `ascend_store/([a-z_]+)/`", ln)
        if m:
            current = m.group(1)
        elif not ln.startswith("| &nbsp;"):
            current = None
        if current:
            rows[current] = rows.get(current, "") + ln
    return rows


def test_every_module_is_in_its_folders_rows():
    rows = _folder_rows()
    assert set(rows) == {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    missing = []
    for py in PKG.rglob("*.py"):
        rel = py.relative_to(PKG)
        if py.name == "__init__.py" or len(rel.parts) == 1:
            continue
        inside = "/".join(rel.parts[1:])  # its path inside its folder
        if f"`{py.name}`" not in rows[rel.parts[0]] and f"`{inside}`" not in rows[rel.parts[0]]:
            missing.append(str(rel))
    assert not missing, f"modules missing from the README's layout table: {missing}"


def test_every_file_the_table_names_exists():
    rows = _folder_rows()
    for folder, text in rows.items():
        for name in re.findall(r"`([a-z_/]+\.py)`", text):
            hits = list((PKG / folder).rglob(name.rsplit("/", 1)[-1]))
            assert hits, f"the README names {folder}/{name}, which is not in the tree"
    assert (PKG / "connector.py").exists() and "`ascend_store/connector.py`" in "\n".join(_table())
