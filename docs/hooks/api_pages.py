"""MkDocs hook: the API reference page of every module named in the navigation.

A navigation entry ``api/<module>.md`` with no file behind it becomes a page that renders
``<module>`` from its docstrings with mkdocstrings, so documenting one more module is one
line in ``mkdocs.yml``. The page is titled with the module's import name (``gsgd_core.rules``),
in the navigation and the browser alike: MkDocs would make "Gsgd core.rules" of the file name.
"""

from __future__ import annotations

import re

from mkdocs.structure.files import File, Files

API_PAGE = re.compile(r"^api/(?P<module>[A-Za-z_][\w.]*)\.md$")


def nav_paths(nav) -> list[str]:
    """Every page path in a (nested) ``nav`` configuration, in order."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_paths(value)]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_paths(item)]
    return []


def api_modules(nav) -> list[str]:
    """The modules whose reference pages the navigation names, in order."""
    return [m.group("module") for p in nav_paths(nav)
            if (m := API_PAGE.match(p)) and m.group("module") != "index"]


def index_source(modules: list[str]) -> str:
    """The reference's front page: one link per module, in the navigation's order."""
    lines = ["# API reference", "",
             "Generated from the docstrings (numpydoc style) of every public name, that is every",
             "name in each module's ``__all__``.", ""]
    lines += [f"- [`{m}`]({m}.md)" for m in modules]
    return "\n".join(lines) + "\n"


def module_source(module: str) -> str:
    """The page of ``module``: its title, then its docstrings."""
    return f"---\ntitle: {module}\n---\n\n::: {module}\n"


def on_files(files: Files, config) -> Files:
    modules = api_modules(config["nav"])
    pages = {f"api/{m}.md": module_source(m) for m in modules}
    if "api/index.md" in nav_paths(config["nav"]):
        pages["api/index.md"] = index_source(modules)
    for uri, content in pages.items():
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, content=content))
    return files
