"""The documentation: the site builds with warnings as errors, its API reference names every
public object, every Python example on its pages runs and prints what the page shows, and
every results page says when and on what machine it was measured."""

import ast
import doctest
import html
import importlib
import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
from _examples import examples, fences, run_examples

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")) if DOCS.is_dir() else []
# The packages whose every public name the reference must document.
PUBLIC = ["gsgd_core", "gsgd_backends", "gsgd_adapters.torch", "gsgd_adapters.jax",
          "gsgd_adapters.optax",
          "gsgd_adapters.cupy"]
# ``py`` blocks are whole scripts that another test runs (several processes, a launcher):
# the page shows the file word for word.
RUN_ELSEWHERE = {"fsdp_example.py": "test_fsdp.py"}
# Pages of measurements: each names its date and its machine.
# The modules with a reference page (docs/hooks/api_pages.py makes one per ``api/`` entry).
REFERENCE = re.findall(r"^\s*- api/([\w.]+)\.md$", (ROOT / "mkdocs.yml").read_text(), re.M)
RESULTS = ["results.md", "step_overhead.md", "step_overhead_gpu.md", "fsdp.md", "plain_cnn.md",
           "plain_cnn_full.md", "skeleton_recipe.md"]


# Pages whose examples another test runs with these checks, and checks what they made.
RUN_BY = {"guide/jax.md": "test_jax_guide.py"}


@pytest.mark.parametrize("page", [p for p in PAGES if examples((DOCS / p).read_text())
                                  and p not in RUN_BY])
def test_every_python_example_runs_and_prints_what_the_page_shows(page, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    run_examples(examples((DOCS / page).read_text()), page)


def doctests(module: str) -> list[doctest.DocTest]:
    """The ``Examples`` of a reference page: its module's docstring and those of its public
    names (defined in the module or in the submodules that it re-exports from), with their
    methods'."""
    imported = importlib.import_module(module)
    finder, found = doctest.DocTestFinder(), {}
    for name, obj in [(module, imported)] + [(f"{module}.{n}", getattr(imported, n))
                                             for n in public_names(module)]:
        for test in finder.find(obj, name, module=False, globs={}):
            found.setdefault((test.filename, test.lineno), test)
    return [t for t in found.values() if t.examples]


@pytest.mark.parametrize("module", [m for m in REFERENCE if m != "index"])
def test_every_docstring_example_runs_and_prints_what_it_shows(module, tmp_path, monkeypatch):
    """Each ``Examples`` section of the reference runs as a doctest, without a warning."""
    pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for test in doctests(module):
            runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()


def test_pages_left_to_another_test_are_run_there():
    """Each page of ``RUN_BY`` is run by the test named."""
    for page, test in RUN_BY.items():
        assert f'"{page}"' in (ROOT / "tests" / test).read_text(), (page, test)


@pytest.mark.parametrize("page", PAGES)
def test_every_other_python_block_is_a_script_another_test_runs(page):
    """``python`` blocks run here; a ``py`` block must be a script that another test runs,
    and no Python hides under another name, a bare fence or an indented one."""
    text = (DOCS / page).read_text()
    assert not re.search(r"^[ \t]+```", text, re.M), f"{page}: an indented fence"
    for lang, body, _, _ in fences(text):
        if lang == "py":
            runs = [f for f in RUN_ELSEWHERE if (DOCS / f).read_text() == body]
            assert runs, f"{page}: a py block that is no script in RUN_ELSEWHERE"
            assert runs[0] in (ROOT / "tests" / RUN_ELSEWHERE[runs[0]]).read_text()
        assert lang not in ("", "python3", "pycon", "ipython"), f"{page}: a {lang or 'bare'} block"


def _hooks():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("api_pages", DOCS / "hooks" / "api_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once with warnings as errors (``mkdocs build --strict``)."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module)
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    for page in PAGES:
        html = page[:-3] + ".html" if page.endswith("index.md") else page[:-3] + "/index.html"
        assert (site / html).is_file(), page


def test_every_public_package_has_a_reference_page():
    modules = _hooks().api_modules(_nav())
    assert [m for m in PUBLIC if m not in modules] == []


def public_names(module: str) -> list[str]:
    """The module's ``__all__``, read from its source (as the reference is: the adapters'
    frameworks need not be installed to check their pages)."""
    source = pathlib.Path(importlib.util.find_spec(module).origin).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_reference_names_every_public_object(site):
    for name in _hooks().api_modules(_nav()):
        html = (site / "api" / name / "index.html").read_text()
        ids = set(re.findall(r'id="([^"]+)"', html))
        missing = [n for n in public_names(name) if f"{name}.{n}" not in ids]
        assert missing == [], f"{name}: no reference entry for {missing}"


@pytest.mark.parametrize("page", RESULTS)
def test_results_pages_say_when_and_on_what_machine(page):
    text = (DOCS / page).read_text()
    assert re.search(r"^Measured \d{4}-\d{2}-\d{2} on .*\d+ cores?", text, re.M), page


def _report():
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the checkout
    try:
        from benchmarks import report
    finally:
        sys.path.remove(str(ROOT))
    return report


def test_the_main_job_writes_when_and_where_on_its_results_page():
    page = _report().markdown([], "# G-SGD on digits")
    assert re.search(r"^Measured \d{4}-\d{2}-\d{2} on .*\d+ cores?\.$", page, re.M)


def test_reference_reads_as_markdown(site):
    """No reST role, ``::`` marker or escaped space of the docstrings reaches the rendered
    reference."""
    for page in (site / "api").rglob("index.html"):
        text = re.sub(r"<[^>]+>", "", page.read_text())
        assert not re.search(r":(?:func|class|meth|attr|mod|data|exc):|\S::\s|\\ ", text), page


def text_of(fragment: str) -> str:
    """The text a reader sees in an HTML fragment: its tags dropped, its entities read."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def prose(page: str) -> str:
    """The text of a page's article outside ``<pre>`` and ``<code>``: what reads as prose."""
    article = re.search(r"<article\b.*?</article>", page, re.S)[0]
    return text_of(re.sub(r"<(pre|code)\b.*?</\1>", " ", article, flags=re.S))


# Python outside a code block: a doctest prompt, an import, a statement or a print starting a
# line (a docstring's indented example that the docstring parser read as a paragraph).
CODE_IN_PROSE = re.compile(r">>>|^\s*(?:from [\w.]+ import \w|import \w|print\(|[\w.]+ = [\w.]+\()",
                           re.M)


def description_tables(page: str) -> list[list[str]]:
    """The description column of each table of the page that has one (the reference's
    parameters, returns, raises...), one text per row."""
    tables = []
    for table in re.findall(r"<table>.*?</table>", page, re.S):
        head = [text_of(h).strip() for h in re.findall(r"<th>(.*?)</th>", table, re.S)]
        if "Description" in head:
            column = head.index("Description")
            rows = re.findall(r"<tr\b[^>]*>(.*?)</tr>", table.split("</thead>")[-1], re.S)
            tables.append([" ".join(text_of(re.findall(r"<td\b[^>]*>(.*?)</td>", row, re.S)[column])
                                    .split()) for row in rows])
    return tables


def test_docstring_examples_render_as_code(site):
    """No Python of a docstring reaches a page outside a code block: an indented example
    that the docstring parser reads as prose runs together into one paragraph."""
    for page in sorted(site.rglob("*.html")):
        if "<article" in (text := page.read_text()):
            found = CODE_IN_PROSE.search(prose(text))
            assert found is None, f"{page.relative_to(site)}: {found and found.string[found.start():found.start() + 80]!r}"


def test_parameter_tables_describe_each_row_on_its_own(site):
    """Every row of a reference table has a description, and no two rows share one: a text
    written once for a group of parameters, copied into each row, says nothing of what each
    one does (and a description written where numpydoc reads the type leaves its row empty)."""
    for page in sorted((site / "api").rglob("index.html")):
        for rows in description_tables(page.read_text()):
            where = f"{page.relative_to(site)}: {rows}"
            assert all(rows), f"a row without a description in {where}"
            repeated = {d for d in rows if rows.count(d) > 1}
            assert not repeated, f"{page.relative_to(site)}: {sorted(repeated)[0][:80]!r}"


def test_reference_pages_are_titled_with_import_names(site):
    """Each module's page, its browser title and its navigation entry read the module's
    import name (``gsgd_core.reference``), as the reader types it."""
    yaml = pytest.importorskip("yaml")
    name = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["site_name"]
    front = (site / "index.html").read_text()
    for module in _hooks().api_modules(_nav()):
        page = (site / "api" / module / "index.html").read_text()
        assert text_of(re.search(r"<title>(.*?)</title>", page)[1]) == f"{module} - {name}"
        assert text_of(re.search(r"<h1\b.*?</h1>", page, re.S)[0]).strip(" ¶\n") == module
        link = re.search(rf'<a href="api/{re.escape(module)}/".*?</a>', front, re.S)[0]
        assert text_of(link).strip() == module, (module, text_of(link).strip())


def test_readme_links_point_into_the_checkout():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_the_readme_excerpt_keeps_every_verdict_and_its_outcome():
    """The README's short excerpt has one entry per verdict of docs/results.md, in order,
    with the verdict's place and outcome."""
    report = _report()
    summary = (DOCS / "results.md").read_text()
    bullets = [ln[2:] for ln in summary.splitlines() if report.VERDICT.match(ln)]
    rows = [r for r in report.readme_excerpt(summary).splitlines() if r.startswith("| **")]
    entries = [e for r in rows for e in r.split(" | ")[1].removesuffix(" |").split("; ")]
    assert len(entries) == len(bullets) > 0
    for bullet, entry in zip(bullets, entries):
        where, rest = bullet.split(": ", 1)
        outcome = re.search(r"wins|loses|ties|unstable on \d+/\d+ seeds|only stable", rest)[0]
        assert outcome in entry, (bullet, entry)
        assert where == "overall" or entry.startswith(f"{where}: "), (bullet, entry)


def test_grouped_parameters_get_an_entry_each():
    """``lr, momentum`` in a parameters section becomes two entries (griffe would give the
    second the first's type and default); a shared return entry keeps its names and takes
    its text as the description; other sections are left as written."""
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("griffe_rest",
                                                  DOCS / "hooks" / "griffe_rest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = ("Step.\n\nParameters\n----------\nlr, momentum\n    As SGD.\nx, y : float\n"
            "    Two.\n\nReturns\n-------\na, b : arrays\n\nNotes\n-----\nc, d : e\n")
    assert module.markdown(text) == (
        "Step.\n\nParameters\n----------\nlr\n    As SGD.\nmomentum\n    As SGD.\n"
        "x : float\n    Two.\n\ny : float\n    Two.\n\nReturns\n-------\na, b\n    arrays\n\n"
        "Notes\n-----\nc, d : e\n")


def test_the_mutation_tables_fit_the_page(site):
    """The results page of the mutation runs has a row per module: its cells are short
    (numbers and the module's path), so that the table fits the page's width, and the
    run times are listed after it."""
    page = (site / "mutation" / "index.html").read_text()
    tables = re.findall(r"<table>.*?</table>", page, re.S)
    cells = [text_of(c).strip() for t in tables
             for c in re.findall(r"<t[hd]\b[^>]*>(.*?)</t[hd]>", t, re.S)]
    assert tables and cells
    assert max(map(len, cells)) <= 32, max(cells, key=len)
