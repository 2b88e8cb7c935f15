"""The lock (`constraints.txt`) covers what the code imports, and this environment was installed from it.

`constraints.txt` pins every runtime and dev dependency (refresh: `uv pip compile pyproject.toml -o
constraints.txt --upgrade`, settings in pyproject's `[tool.uv]`); the README's two commands install
with `-c constraints.txt`. These tests fail when a new import has no pinned distribution, when
pyproject asks for something the lock does not pin (or pins outside the range), and when the
installed versions are not the pinned ones, so a suite run after a refresh proves the new set.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
PACKAGES = ("moeserve", "moe_runtime", "tracer", "server", "clients", "richconsole")
# Imported only where present, each behind an ImportError fallback (optional accelerator kernels).
OPTIONAL = {"flash_attn", "flashinfer", "triton"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock() -> dict[str, str]:
    """Name -> pinned version, for the lines whose markers hold on this interpreter and platform."""
    from packaging.markers import Marker

    pins = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;(.*))?$", line)
        if m and (m.group(3) is None or Marker(m.group(3)).evaluate()):
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def _first_party() -> set[str]:
    names = {p.name for p in ROOT.iterdir() if p.is_dir()}
    for folder in (ROOT, ROOT / "tests", ROOT / "tools"):
        names |= {p.stem for p in folder.glob("*.py")}
    return names


def _imports(folders: tuple[str, ...]) -> dict[str, str]:
    """Top-level third-party module -> one file importing it, over every import statement."""
    skip = set(sys.stdlib_module_names) | _first_party()
    found: dict[str, str] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in skip and top not in OPTIONAL:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _declared() -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return reqs


def test_every_import_is_a_pinned_distribution():
    pins = _lock()
    providers = md.packages_distributions()
    missing = []
    for module, where in sorted(_imports((*PACKAGES, "tests", "tools")).items()):
        dists = {_norm(d) for d in providers.get(module, [])}
        if not dists & pins.keys():
            provided = sorted(dists) or "nothing installed"
            missing.append(f"{module} (imported in {where}; provided by {provided})")
    assert not missing, "imports with no pinned distribution in constraints.txt: " + "; ".join(missing)


def test_the_package_imports_only_what_pyproject_declares():
    from packaging.requirements import Requirement

    declared = {_norm(Requirement(r).name) for r in _declared()}
    providers = md.packages_distributions()
    undeclared = []
    for module, where in sorted(_imports(PACKAGES).items()):
        dists = {_norm(d) for d in providers.get(module, [])}
        if dists and not dists & declared:
            undeclared.append(f"{module} (imported in {where}, from {sorted(dists)})")
    assert not undeclared, "declare these in pyproject.toml: " + "; ".join(undeclared)


def test_every_declared_requirement_is_pinned_inside_its_range():
    from packaging.requirements import Requirement

    pins = _lock()
    bad = []
    for text in _declared():
        req = Requirement(text)
        pin = pins.get(_norm(req.name))
        if pin is None:
            bad.append(f"{req.name}: not in constraints.txt")
        elif not req.specifier.contains(pin, prereleases=True):
            bad.append(f"{req.name}: pinned {pin}, pyproject asks {req.specifier}")
    assert not bad, "; ".join(bad)


def test_this_environment_is_installed_from_the_lock():
    pins = _lock()
    wrong = []
    for name, pin in sorted(pins.items()):
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            continue  # another platform's or an unused extra's requirement
        if have.split("+")[0] != pin:
            wrong.append(f"{name} {have} (lock: {pin})")
    reinstall = "reinstall with the README's command"
    assert not wrong, f"installed versions differ from constraints.txt ({reinstall}): " + ", ".join(wrong)
