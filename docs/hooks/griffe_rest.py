"""Griffe extension: the docstrings' reST spellings, read as the Markdown that mkdocstrings
renders.

The docstrings follow numpydoc, whose prose is reST: cross-reference roles
(``:func:`gsgd_core.icr```) and literal blocks introduced by ``::``. Markdown has neither, so
a role becomes a code span of its target (the last component for ``~target``), and ``::``
ends its sentence with one colon (the indented block after it is already a code block).
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
AFTER_TEXT = re.compile(r"(?<=\S)::[ \t]*$", re.M)     # "values::" -> "values:"
ALONE = re.compile(r"^[ \t]*::[ \t]*\n", re.M)          # a line of its own: dropped


def markdown(text: str) -> str:
    """``text`` with its reST roles and literal-block markers written as Markdown."""
    text = ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    return ALONE.sub("", AFTER_TEXT.sub(":", text))


class ReSTAsMarkdown(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
