"""`forkpoint log` draws every version's first parent where the manifests say it is."""

import re

import numpy as np
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forkpoint as fp
from forkpoint.cli.main import cli

ROW = re.compile(r"^([*| /]*?) ?([0-9a-f]{12})\b")


def drawn_parents(text: str) -> dict[str, str | None]:
    """Read the graph back by its documented rule: the version below a '*' in the same column,
    the version after a join row for each '/' lane, nothing for a lane that turns blank."""
    parents: dict[str, str | None] = {}
    open_lanes: dict[int, str] = {}
    joins: set[int] = set()
    for line in text.splitlines():
        match = ROW.match(line)
        cells = match.group(1) if match else line.rstrip()
        assert set(cells) <= set("*| /"), f"unexpected graph row {line!r}"

        def blank(j):
            return j >= len(cells) or cells[j] == " "

        if match is None:
            joins = {j for j, c in enumerate(cells) if c == "/"}
            assert joins and joins <= open_lanes.keys(), f"join row without lanes: {line!r}"
            for j in [j for j in open_lanes if j not in joins and blank(j)]:
                parents[open_lanes.pop(j)] = None
            continue
        vid = match.group(2)
        assert cells.count("*") == 1, line
        col = cells.index("*")
        for j in joins | ({col} & open_lanes.keys()):
            parents[open_lanes.pop(j)] = vid
        joins = set()
        for j in [j for j in open_lanes if blank(j)]:
            parents[open_lanes.pop(j)] = None
        open_lanes[col] = vid
    for vid in open_lanes.values():
        parents[vid] = None
    return parents


def log_text(url: str, *args) -> str:
    result = CliRunner().invoke(cli, ["log", "-r", url, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def check_graph(repo: fp.Repo, shown: set[str] | None = None) -> dict:
    text = log_text(repo.url)
    drawn = drawn_parents(text)
    versions = {}
    for name in [*repo.branches(), *repo.tags()]:
        for v in repo.log(name):
            versions[v.id[:12]] = v
    assert set(drawn) == set(versions), text
    for short, v in versions.items():
        expected = v.parents[0][:12] if v.parents else None
        assert drawn[short] == expected, f"{short} (step {v.step}) drawn on {drawn[short]}, parent {expected}\n{text}"
    return drawn


def test_a_fork_joins_at_the_version_it_was_forked_from(tmp_path):
    """The issue's case: fork exp at step 20, step 25 on both, step 30 on main."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    for step in (0, 5, 10, 15, 20):
        repo.save({"x": np.array([step])}, step=step)
    at20 = repo.resolve("main")
    repo.fork("main", "exp")
    repo.save({"x": np.array([25])}, step=25, branch="exp")
    repo.save({"x": np.array([25])}, step=25)
    repo.save({"x": np.array([30])}, step=30)
    drawn = check_graph(repo)
    text = log_text(repo.url)
    lines = text.splitlines()
    join = next(i for i, line in enumerate(lines) if line.startswith("|/"))
    assert at20[:12] in lines[join + 1] and "step 20" in lines[join + 1], text
    assert drawn[repo.resolve("exp")[:12]] == at20[:12]


actions = st.lists(st.tuples(st.sampled_from(["save", "save", "save", "fork", "tag", "prune", "delete"]),
                             st.integers(0, 1000), st.integers(0, 1000)), min_size=1, max_size=28)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions)
def test_any_fork_tree_is_drawn_with_each_versions_parent(tmp_path_factory, script):
    """Random fork trees: saves on any branch, forks of any (old) version, tags, pruned
    versions, deleted branches; every drawn parent is the manifest's first parent."""
    repo = fp.Repo(str(tmp_path_factory.mktemp("g") / "r"), create=True)
    repo.save({"x": np.array([0])}, step=0)
    made = 1
    for kind, a, b in script:
        branches = sorted(repo.branches())
        if not branches:
            break
        branch = branches[a % len(branches)]
        chain = repo.log(branch)
        if kind == "save":
            repo.save({"x": np.array([made])}, step=made, branch=branch)
            made += 1
        elif kind == "fork":
            old = chain[b % len(chain)]
            repo.fork(old.id, f"b{made}")
            made += 1
        elif kind == "tag":
            repo.tag(f"t{made}", chain[b % len(chain)].id)
            made += 1
        elif kind == "prune":
            repo.gc(keep=fp.Keep(last=1 + b % 3), branches=[branch], grace=0)
        elif kind == "delete" and len(branches) > 1:
            repo.delete_branch(branch)
    check_graph(repo)
    repo.close()
