"""The package's shape: the layer order of DESIGN.md holds, and the public face is the API only."""

import json
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

import forkpoint as fp
from forkpoint.engine.parallel import HelperThreads, parallel_map
import procs

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_imports_a_layer_above_its_own():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    out = procs.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, timeout=procs.CHILD_SECONDS)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "KEPT" in out.stdout


def test_no_unused_import_undefined_name_or_dead_local_in_the_tree():
    """pyflakes over the package, the tests and the benchmarks finds nothing."""
    out = procs.run([sys.executable, "-m", "pyflakes", "src", "tests", "benchmarks"], cwd=ROOT,
                    timeout=procs.CHILD_SECONDS)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout[-4000:] + out.stderr[-2000:]


def test_dir_shows_the_public_api_only():
    names = set(dir(fp))
    assert {"Repo", "Checkpointer", "Keep", "EverySteps", "EverySeconds", "YoungDaly", "tier", "dist"} <= names
    assert not names & {"engine", "format", "storage", "repo", "tiers", "state", "policy", "os"}
    assert all(hasattr(fp, name) for name in fp.__all__)


def test_helper_threads_map_in_order_and_raise_what_an_item_raised():
    assert parallel_map(lambda x: x * x, range(50)) == [x * x for x in range(50)]
    assert parallel_map(str, []) == []

    def boom(x):
        if x == 7:
            raise KeyError("item 7")
        return x

    with pytest.raises(KeyError, match="item 7"):
        parallel_map(boom, range(20))


def test_nested_maps_finish_when_every_helper_is_busy():
    helpers = HelperThreads(2)
    release = threading.Event()
    busy = threading.Thread(target=helpers.map, args=(lambda _: release.wait(30), range(3)), daemon=True)
    busy.start()  # both helpers and that caller now wait
    try:
        inner = helpers.map(lambda x: sum(helpers.map(lambda y: x * y, range(4))), range(3))
        assert inner == [0, 6, 12]  # done by this thread alone
    finally:
        release.set()
        busy.join(30)


def test_no_part_of_a_repository_hides_a_method_of_another():
    """Each name a Repo answers is defined by one of its parts (a second definition would be
    silently shadowed by the order of its bases)."""
    seen: dict[str, str] = {}
    for part in fp.Repo.__mro__[1:]:
        if part is object:
            continue
        for name, value in vars(part).items():
            if callable(value) and not name.startswith("__"):
                assert name not in seen, f"{name} is defined by both {seen[name]} and {part.__name__}"
                seen[name] = part.__name__


def test_benchmarks_run_by_name_from_one_entry_point():
    listing = procs.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, timeout=procs.CHILD_SECONDS)
    assert listing.returncode == 0 and "save_load" in listing.stdout and "compression" in listing.stdout
    usage = procs.run([sys.executable, "-m", "benchmarks", "save_load", "--help"], cwd=ROOT,
                      timeout=procs.CHILD_SECONDS)
    assert usage.returncode == 0 and "--repeats" in usage.stdout
    unknown = procs.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT, timeout=procs.CHILD_SECONDS)
    assert unknown.returncode == 2 and "no benchmark 'nope'" in unknown.stderr


def test_every_benchmark_is_listed_under_a_family_and_shares_the_harness_options():
    """The listing groups every script under one family of FAMILIES (none falls to "other"),
    and each benchmark's --help ends with the options they share."""
    listing = procs.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, timeout=procs.CHILD_SECONDS)
    scripts = {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks"))
               if f.endswith(".py") and f not in ("harness.py", "__main__.py")}
    assert "\nother:" not in listing.stdout
    assert all(f"  {name} " in listing.stdout for name in scripts)
    for name in ("save_load", "mmap_load", "codecs"):
        usage = procs.run([sys.executable, "-m", "benchmarks", name, "--help"], cwd=ROOT, timeout=procs.CHILD_SECONDS)
        assert usage.returncode == 0 and "options the benchmarks share" in usage.stdout and "--dir" in usage.stdout


def test_a_benchmark_runs_end_to_end_at_a_tiny_size_and_writes_its_figures(tmp_path):
    """save_load on a 1M-parameter state, one round, forkpoint and its reference peer: the
    table lists both, and the JSON holds each method's save and load times (no speed is
    asserted: that is the benchmark's job)."""
    out = tmp_path / "figures.json"
    run = procs.run([sys.executable, "-m", "benchmarks", "save_load", "--params-m", "1", "--repeats", "1",
                     "--only", "forkpoint", "--dir", str(tmp_path), "--json", str(out)], cwd=ROOT,
                    timeout=procs.CHILD_SECONDS)
    assert run.returncode == 0, run.stderr
    assert "| forkpoint |" in run.stdout and "| torch.distributed.checkpoint |" in run.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"forkpoint", "torch.distributed.checkpoint"}
    assert all(r["save_s"] > 0 and r["load_s"] > 0 for r in results.values())
    bad = procs.run([sys.executable, "-m", "benchmarks", "save_load", "--only", "nope"], cwd=ROOT,
                    timeout=procs.CHILD_SECONDS)
    assert bad.returncode == 2 and "unknown methods ['nope']" in bad.stderr


LONG_FILES: dict[str, str] = {}


def test_functions_and_files_stay_small():
    """No function over 60 lines, no file over 500 (but the ones LONG_FILES names, and why)."""
    import ast

    src = ROOT / "src" / "forkpoint"
    long_functions, long_files = [], []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(src).as_posix()
        if text.count("\n") > 500 and rel not in LONG_FILES:
            long_files.append(rel)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{rel}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long_functions and not long_files, (long_functions, long_files)


def test_tree_size_measures_two_revisions_and_names_a_bad_one():
    """tree_size reads the five directories at two revisions from git: HEAD against itself is
    +0%, with every directory's row; a revision git does not know is a usage error naming it."""
    same = procs.run([sys.executable, "-m", "benchmarks", "tree_size", "--base", "HEAD", "--rev", "HEAD"], cwd=ROOT,
                     timeout=procs.CHILD_SECONDS)
    assert same.returncode == 0, same.stderr
    assert "(+0%)" in same.stdout and all(f"| {d}/ |" in same.stdout for d in ("repo", "engine", "format", "tiers", "dist"))
    bad = procs.run([sys.executable, "-m", "benchmarks", "tree_size", "--base", "no-such-rev"], cwd=ROOT,
                    timeout=procs.CHILD_SECONDS)
    assert bad.returncode == 2 and "no-such-rev" in bad.stderr and "give a revision" in bad.stderr
