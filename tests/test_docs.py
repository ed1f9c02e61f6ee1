"""The docs site's architecture page is the project's living inventory: it names every
module of ``src/`` under its folder, and no module that is not there (a page that
falls behind a change fails here, in the same commit): each row says what its module
holds, quoting only names the module holds, every file the page names is there, and
the page's tree names every folder of ``tests/``; the benchmarks page has a row for
every script of ``benchmarks/``, and says which ``make bench`` leaves out. ``make docs``
builds the site with ``mkdocs build --strict``: a broken link or an anchor that is
not there fails it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PAGE = ROOT / "docs" / "architecture.md"


def _modules_in_src() -> set[tuple[str, str]]:
    return {
        (str(p.parent.relative_to(SRC)), p.name)
        for p in SRC.glob("*/**/*.py")
        if p.parent.name != "__pycache__" and not p.parent.name.endswith(".egg-info")
    }


def _rows_on_the_page() -> dict[tuple[str, str], str]:
    """Each module row of the page, (folder, module) -> its description."""
    rows = {}
    folder = None
    for line in PAGE.read_text().splitlines():
        heading = re.fullmatch(r"### `([\w/]+)/`", line)
        if heading:
            folder = heading.group(1)
            continue
        row = re.match(r"\| `([\w]+\.py)` \|(.*)\|$", line)
        if row and folder is not None:
            rows[(folder, row.group(1))] = row.group(2).strip()
    return rows


def _modules_on_the_page() -> set[tuple[str, str]]:
    return set(_rows_on_the_page())


def test_the_architecture_page_names_every_module_of_src_and_no_other() -> None:
    in_src, on_page = _modules_in_src(), _modules_on_the_page()
    missing = sorted(f"{d}/{n}" for d, n in in_src - on_page)
    gone = sorted(f"{d}/{n}" for d, n in on_page - in_src)
    assert not missing, f"modules the architecture page does not name: {missing}"
    assert not gone, f"modules the architecture page names that src/ lacks: {gone}"


def test_the_page_is_read_at_all() -> None:
    assert ("runtime_core/workers", "interface.py") in _modules_on_the_page()
    assert len(_modules_on_the_page()) > 100


def test_each_module_row_says_what_the_module_holds() -> None:
    """A row says what its module holds: not nothing, and not only the name of the
    module's folder or package (``__main__.py`` rows were empty, ``__init__.py`` ones
    the package's name)."""
    bare = sorted(
        f"{folder}/{module}: {said!r}"
        for (folder, module), said in _rows_on_the_page().items()
        if said.strip("`") in ("", folder, folder.rsplit("/", 1)[-1])
    )
    assert not bare, f"architecture rows that say nothing of their module: {bare}"


def _tree_block() -> str:
    """The page's block of the tree beside ``src/`` (its ``## Tests, benchmarks, docs``)."""
    section = PAGE.read_text().partition("## Tests, benchmarks, docs")[2]
    return section.partition("```text\n")[2].partition("```")[0]


def test_the_tree_names_every_folder_of_tests() -> None:
    """Each folder of ``tests/`` is named in the tree (``<package>`` stands for the
    packages' own): ``tests/fuzz/``, behind ``make fuzz``, was not."""
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    folders = {
        p.name
        for p in (ROOT / "tests").iterdir()
        if p.is_dir() and p.name not in packages and not p.name.startswith(("_", "."))
    }
    block = _tree_block()
    assert "tests/<package>/" in block and "tests/support/" in block, block
    unnamed = sorted(name for name in folders if f"tests/{name}/" not in block)
    assert not unnamed, f"folders of tests/ the architecture page's tree does not name: {unnamed}"


def test_the_benchmarks_page_lists_every_script() -> None:
    """docs/index.md says the benchmarks page lists every script: each of
    ``benchmarks/`` has a row of its table."""
    table = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) > 20, scripts
    missing = [name for name in scripts if f"| `benchmarks/{name}` |" not in table]
    assert not missing, f"benchmarks/ scripts with no row in docs/benchmarks.md: {missing}"


def _make_bench_scripts() -> set[str]:
    """The scripts the Makefile's ``bench`` target runs."""
    recipe = (ROOT / "Makefile").read_text().partition("\nbench:")[2].partition("\n\n")[0]
    return set(re.findall(r"benchmarks/([\w]+\.(?:py|sh))", recipe))


def _scripts_make_bench_leaves_out() -> set[str]:
    """The scripts the benchmarks page says ``make bench`` leaves out (its paragraph
    below the table, up to the first ``;``: the scripts after it run there)."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    paragraph = page.partition("`make bench` runs them all but")[2].partition("\n\n")[0]
    return set(re.findall(r"`([\w]+\.(?:py|sh))`", paragraph.partition(";")[0]))


def test_make_bench_runs_every_script_but_those_the_page_leaves_out() -> None:
    """Each script of ``benchmarks/`` is either run by ``make bench`` or named by the
    benchmarks page as left out, never both: the page's list of those left out lacked
    ``gpu_check.sh`` (and its first lines said ``make bench`` ran every script)."""
    scripts = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    run, left_out = _make_bench_scripts(), _scripts_make_bench_leaves_out()
    assert len(run) > 20 and len(left_out) > 5, (run, left_out)
    assert not run - scripts, f"make bench runs scripts benchmarks/ lacks: {sorted(run - scripts)}"
    assert not run & left_out, f"said to be left out, but make bench runs: {sorted(run & left_out)}"
    unsaid = sorted(scripts - run - left_out)
    assert not unsaid, f"make bench leaves out, and docs/benchmarks.md does not say so: {unsaid}"


def _source_files() -> list[Path]:
    return [p for p in SRC.rglob("*") if p.is_file() and p.suffix in (".py", ".c", ".h", ".cu")]


def _names_a_file(named: str, sources: list[Path]) -> bool:
    """Whether ``named`` (``process/launcher.py``, ``csrc/pool.c``, ``tests/x.py``) is a
    file of the checkout: from the root, or the end of a path under ``src/``."""
    return (ROOT / named).is_file() or any(p.as_posix().endswith("/" + named) for p in sources)


def test_every_file_the_page_names_is_there() -> None:
    """Every ``.py``, ``.c`` and ``.h`` file the page names in backticks (its parts, a
    token's path, the rows) is a file of the checkout: a module renamed or removed
    leaves no path to it behind."""
    sources = _source_files()
    named = set(re.findall(r"`([\w/]+\.(?:py|c|h|cu))`", PAGE.read_text()))
    assert len(named) > 100, named
    gone = sorted(name for name in named if not _names_a_file(name, sources))
    assert not gone, f"files the architecture page names that are not there: {gone}"


def test_each_row_names_only_what_its_module_holds() -> None:
    """The names a row quotes (``ChainClose``, ``exit_with``, ``run_command``, ...) are
    in its module's source (a file it names is a file of the checkout): a name
    renamed or moved out leaves the row that quotes it false."""
    sources = _source_files()
    stale = []
    for (folder, module), said in _rows_on_the_page().items():
        text = (SRC / folder / module).read_text()
        for quoted in re.findall(r"``?([^`]+?)``?", said):
            if re.fullmatch(r"[\w/]+\.(?:py|c|h|cu)", quoted):
                if not _names_a_file(quoted, sources):
                    stale.append(f"{folder}/{module}: {quoted}")
                continue
            for name in re.findall(r"\b[A-Za-z_]\w{2,}(?:\.\w+)*", quoted):
                if not re.search(rf"\b{re.escape(name.rsplit('.', 1)[-1])}\b", text):
                    stale.append(f"{folder}/{module}: {name} (in {quoted!r})")
    assert not stale, f"names rows quote that their modules do not hold: {stale}"


def test_the_tree_names_every_c_program_of_benchmarks() -> None:
    """Each file of ``benchmarks/csrc/`` is named in the tree: it said the folder held
    the C loop of ``cpu_x8_loop.py``, and ``read_probe.c`` (``cpu_decode.py``'s and
    ``cpu_step_products.py``'s read bandwidth) was not named."""
    programs = sorted(p.name for p in (ROOT / "benchmarks" / "csrc").iterdir() if p.is_file())
    assert programs, "benchmarks/csrc/ holds no file"
    unnamed = [name for name in programs if name not in _tree_block()]
    assert not unnamed, f"files of benchmarks/csrc/ the architecture page does not name: {unnamed}"


def _metrics_served() -> set[str]:
    """Every metric family and sample name ``GET /metrics`` serves, a stage's series
    and the recovery counters included (``serve.metrics`` over values of its own)."""
    from runtime_cupy.serve.metrics import Metrics, RecoveryMetrics
    from runtime_cupy.serve.recovery import Recoveries

    metrics = Metrics(
        queued=lambda: 0,
        started=lambda: (0, 0),
        ready=lambda: True,
        restarts=lambda: 0,
        kv=lambda: ((0, 1, 2),),
        batches=lambda: {0: {1: 1}},
    )
    metrics.registry.register(RecoveryMetrics(Recoveries))
    families = list(metrics.registry.collect())
    return {f.name for f in families} | {s.name for f in families for s in f.samples}


def test_every_metric_the_docs_name_is_served() -> None:
    """Each ``gguf_pipeline_*`` name of README.md and docs/ is a metric family or a
    series ``/metrics`` serves: a metric renamed leaves no dashboard query in the docs
    that finds nothing."""
    served = _metrics_served()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {name for page in pages for name in re.findall(r"gguf_pipeline_\w+", page.read_text())}
    assert len(named) > 5, named
    assert not named - served, (
        f"metrics the docs name that /metrics lacks: {sorted(named - served)}"
    )


def test_the_planners_page_lists_every_rejection_code() -> None:
    """docs/planner.md's table of rejection codes holds every ``code`` a rejection
    carries and no other (the base's ``rejected`` aside, which no rejection is)."""
    from runplan import PlanRejection, rejections

    codes = {
        cls.code
        for cls in vars(rejections).values()
        if isinstance(cls, type) and issubclass(cls, PlanRejection) and cls is not PlanRejection
    }
    page = (ROOT / "docs" / "planner.md").read_text().partition("## Rejection codes")[2]
    table = set(re.findall(r"\| `(\w+)` \|$", page.partition("\n## ")[0], re.M))
    assert len(codes) > 10, codes
    assert codes == table, (
        f"codes the page lacks: {sorted(codes - table)}; "
        f"codes no rejection has: {sorted(table - codes)}"
    )
