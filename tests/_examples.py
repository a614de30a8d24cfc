"""The Python examples of a documentation page: its fenced blocks, each ``python`` block
with the output shown after it, and a run of them in one namespace (tests/test_docs.py runs
every page's; tests/test_jax_guide.py runs the JAX guide's and checks what they made)."""

from __future__ import annotations

import contextlib
import io
import re
import warnings

import pytest

FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```\n", re.S | re.M)


def fences(text: str) -> list[tuple[str, str, int, int]]:
    """(language, body, start, end) of each fenced code block, in order."""
    return [(m["lang"], m["body"], m.start(), m.end()) for m in FENCE.finditer(text)]


def examples(text: str) -> list[tuple[str, str | None]]:
    """Each ``python`` block with the ``text`` block that follows it directly (its printed
    output), or ``None`` where none follows."""
    blocks, pairs = fences(text), []
    for i, (lang, body, _, end) in enumerate(blocks):
        if lang != "python":
            continue
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        shown = (nxt[1] if nxt and nxt[0] == "text" and not text[end:nxt[2]].strip()
                 else None)
        pairs.append((body, shown))
    return pairs


def run_examples(pairs, name: str) -> list[dict]:
    """Runs the blocks in order in one namespace; each printed output must be the one shown,
    and no block warns (an example that warns teaches the warning). Returns a shallow copy
    of the namespace after each block."""
    for module in sorted({m for code, _ in pairs
                          for m in re.findall(r"^(?:from|import) (\w+)", code, re.M)}):
        pytest.importorskip(module)
    scope, after = {"__name__": "__docs__"}, []
    for i, (code, shown) in enumerate(pairs, start=1):
        with contextlib.redirect_stdout(io.StringIO()) as out, warnings.catch_warnings():
            warnings.simplefilter("error")
            exec(compile(code, f"{name}, example {i}", "exec"), scope)
        if shown is not None:
            printed = out.getvalue().strip()
            assert printed == shown.strip(), f"{name}, example {i} printed:\n{printed}"
        after.append(dict(scope))
    return after
