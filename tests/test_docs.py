"""The docs against the code they describe: the README's layout table names every module."""

from __future__ import annotations

from conftest import ROOT


def test_the_readme_layout_names_every_module() -> None:
    """Each module of the package is named in the README's layout tables (by its file name or its
    path), with its role beside it; a module added without its line fails here."""
    readme = (ROOT / "README.md").read_text()
    modules = sorted(
        path
        for path in (ROOT / "appliance").rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts
    )
    unnamed = [
        str(path.relative_to(ROOT))
        for path in modules
        if f"`{path.name}`" not in readme and f"`{path.relative_to(ROOT)}`" not in readme
    ]
    assert not unnamed, f"the README's layout table does not name {unnamed}"
