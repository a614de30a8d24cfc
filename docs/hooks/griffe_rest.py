"""Griffe extension: the docstrings' reST spellings, read as the Markdown that mkdocstrings
renders.

The docstrings follow numpydoc, whose prose is reST: cross-reference roles
(``:func:`gsgd_core.icr```), literal blocks introduced by ``::`` and the escaped space that
joins a role to its suffix (``:class:`Rule`\\ s``). Markdown has none of them, so a role
becomes a code span of its target (the last component for ``~target``), ``::`` ends its
sentence with one colon (the indented block after it is already a code block), and an
escaped space is dropped.
numpydoc also lets parameters share an entry (``lr, momentum : float``); griffe would give
them all the first one's type and default, so each gets an entry of its own. A shared return
entry (``weights, biases : new arrays``) keeps its names, with its text as the description.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
AFTER_TEXT = re.compile(r"(?<=\S)::[ \t]*$", re.M)     # "values::" -> "values:"
ALONE = re.compile(r"^[ \t]*::[ \t]*\n", re.M)          # a line of its own: dropped
ESCAPED_SPACE = re.compile(r"\\ ")                       # "``Rule``\ s" -> "``Rule``s"
GROUPED = re.compile(r"^(?P<names>\w+(?:, \w+)+)(?P<type>\s*:.*)?$")
PARAMETER_SECTIONS = ("Parameters", "Other Parameters")
RETURN_SECTIONS = ("Returns", "Yields")


def split_grouped_parameters(text: str) -> str:
    """Each entry ``a, b : type`` of a parameters section as one entry per name, each with
    the shared type and description; in a returns section, ``a, b : text`` as the entry
    ``a, b`` described by ``text``."""
    lines, out, section, i = text.split("\n"), [], None, 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and set(lines[i + 1].strip()) == {"-"}:
            section = line.strip()
        match = GROUPED.match(line) if section in PARAMETER_SECTIONS + RETURN_SECTIONS else None
        if match and section in RETURN_SECTIONS:
            names, _, described = line.partition(" : ")
            out += [names] + ([f"    {described}"] if described else [])
            i += 1
            continue
        if not match:
            out.append(line)
            i += 1
            continue
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][:1] in " \t"):
            end += 1
        for name in match["names"].split(", "):
            out += [name + (match["type"] or "")] + lines[i + 1:end]
        i = end
    return "\n".join(out)


def markdown(text: str) -> str:
    """``text`` with its reST roles and literal-block markers written as Markdown, and its
    grouped parameters split."""
    text = ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    text = ESCAPED_SPACE.sub("", text)
    return split_grouped_parameters(ALONE.sub("", AFTER_TEXT.sub(":", text)))


class ReSTAsMarkdown(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
