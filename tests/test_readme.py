"""The README's layout table names every module of the three packages (a module added without a line there fails)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layout_table_names_every_module():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout") :].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `"))
    modules = [p for pkg in ("theworld", "precompute", "train") for p in (ROOT / pkg).rglob("*.py")]
    assert len(modules) > 50
    missing = [str(p.relative_to(ROOT)) for p in modules if p.name != "__init__.py" and f"`{p.name}`" not in table]
    assert not missing, f"README.md's layout table does not name {missing}"
