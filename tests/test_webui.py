"""`forkpoint ui` (its JSON API and, in a real headless Chromium, its page) and `forkpoint plot`."""

import json
import os
import shutil
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from click.testing import CliRunner

import forkpoint as fp
from forkpoint.cli.main import cli
from forkpoint.cli.webui import serve

ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "test-artifacts", "ui")
HOSTILE = "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\">"


@pytest.fixture(scope="module")
def lineage(tmp_path_factory):
    """Three branches (two forks of main, one of an old version), a tag, a pruned version, a
    hostile message; metrics on every version."""
    url = str(tmp_path_factory.mktemp("ui") / "repo")
    repo = fp.Repo(url, create=True)
    for step in range(0, 50, 5):
        repo.save({"w": np.full(1000, step, dtype=np.float32), "b": np.ones(10)}, step=step,
                  metrics={"loss": 1 / (step + 1), "acc": step / 50})
    repo.fork("main~4", "lr-sweep")
    for step in range(30, 60, 5):
        repo.save({"w": np.full(1000, 2 * step, dtype=np.float32), "b": np.ones(10)}, step=step,
                  branch="lr-sweep", metrics={"loss": 0.8 / (step + 1)})
    repo.fork("main~7", "wd")
    for step in range(15, 35, 5):
        repo.save({"w": np.full(1000, 3 * step, dtype=np.float32), "b": np.ones(10)}, step=step,
                  branch="wd", metrics={"loss": 1.2 / (step + 1)}, message=HOSTILE)
    repo.tag("best", "lr-sweep~1")
    repo.gc(keep=fp.Keep(last=2), branches=["wd"], grace=0)
    return repo


@pytest.fixture(scope="module")
def server(lineage):
    srv = serve(fp.Repo(lineage.url), port=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def get(base, path):
    try:
        with urllib.request.urlopen(base + path) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


def api(base, path):
    status, kind, body = get(base, path)
    assert kind == "application/json", (path, kind)
    return status, json.loads(body)


def all_versions(repo) -> dict:
    out = {}
    for name in [*repo.branches(), *repo.tags()]:
        for v in repo.log(name):
            out[v.id] = v
    return out


def test_versions_are_paged_with_each_parent(server, lineage):
    expected = all_versions(lineage)
    seen = []
    offset = 0
    while True:
        status, page = api(server, f"/api/versions?offset={offset}&limit=7")
        assert status == 200 and page["total"] == len(expected)
        if not page["versions"]:
            break
        seen += page["versions"]
        offset += 7
    assert [r["id"] for r in seen] != [] and {r["id"] for r in seen} == set(expected)
    position = {r["id"]: i for i, r in enumerate(seen)}
    for row in seen:
        v = expected[row["id"]]
        assert row["parent"] == (v.parents[0] if v.parents else None)
        if row["parent"]:
            assert position[row["parent"]] > position[row["id"]], "newest first: a parent comes after"
    pruned = [r for r in seen if "pruned" in r["kinds"]]
    assert pruned and all(expected[r["id"]].pruned for r in pruned)
    assert next(r for r in seen if r["id"] == lineage.resolve("best"))["tags"] == ["best"]


def test_bad_requests_get_json_errors_and_nothing_outside_the_repository(server, lineage):
    for path in ("/api/version/nope", "/api/version/..%2F..%2Fetc%2Fpasswd", "/api/version/main~99",
                 "/api/diff?a=main&b=nope", "/api/divergence?a=main&b=best", "/api/nothing"):
        status, body = api(server, path)
        assert status == 404 and body["error"], path
    for path in ("/api/versions?limit=0", "/api/versions?offset=-1", "/api/versions?limit=x", "/api/diff?a=main"):
        status, body = api(server, path)
        assert status == 400 and body["error"], path
    for path in ("/../pyproject.toml", "/ui/app.js", "/%2e%2e/%2e%2e/etc/passwd", "/forkpoint.json"):
        status, _, body = get(server, path)
        assert status == 404 and b"forkpoint.json" not in body and b"root:" not in body, path
    request = urllib.request.Request(server + "/api/versions", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request)
    assert e.value.code == 405


def test_detail_diff_divergence_series_and_usage_match_the_repository(server, lineage):
    status, v = api(server, "/api/version/main~1")
    assert status == 200 and v["id"] == lineage.resolve("main~1") and v["metrics"]["loss"] == 1 / 41
    assert v["message"] == "" and {leaf["path"] for leaf in v["leaves"]} == {"w", "b"}
    _, wd = api(server, "/api/version/wd")
    assert wd["message"] == HOSTILE, "text comes back as it was saved; the page shows it as text"
    _, d = api(server, "/api/diff?a=main&b=lr-sweep")
    assert [(x["path"], x["status"]) for x in d["leaves"]] == [(x.path, x.status) for x in lineage.diff("main", "lr-sweep")]
    _, div = api(server, "/api/divergence?a=main&b=lr-sweep&atol=0")
    found = lineage.first_divergence("main", "lr-sweep")
    assert div["divergence"]["step"] == found.step
    _, series = api(server, "/api/series?metric=loss")
    for name in lineage.branches():
        chain = [v for v in reversed(lineage.log(name)) if "loss" in v.metrics]
        assert series["branches"][name]["points"] == [[v.step, v.metrics["loss"]] for v in chain]
    assert series["branches"]["lr-sweep"]["fork"]["step"] == 25
    assert series["branches"]["main"]["fork"] is None
    _, names = api(server, "/api/metrics")
    assert names["metrics"] == ["acc", "loss"]
    _, usage = api(server, "/api/du")
    assert set(usage["branches"]) == {"main", "lr-sweep", "wd"}


def test_the_server_writes_nothing(lineage, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(lineage.url, copy)

    def snapshot():
        return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
                for d, _, fs in os.walk(copy) for f in fs}

    before = snapshot()
    srv = serve(fp.Repo(copy), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    for path in ("/", "/app.js", "/api/versions", "/api/version/main", "/api/diff?a=main~1&b=main",
                 "/api/divergence?a=main&b=wd", "/api/series?metric=loss", "/api/du", "/api/repo"):
        assert get(base, path)[0] == 200, path
    srv.shutdown()
    srv.server_close()
    assert snapshot() == before


def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


def test_the_page_in_a_real_browser(server, lineage):
    """The page in headless Chromium: one node per version with its parent edge, a click shows
    the version's metrics, the diff view matches repo.diff, one curve per branch, no script
    from a message runs. Screenshots of each view go to test-artifacts/ui/."""
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    executable = _chromium()
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium (.ci/run does)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    os.makedirs(ARTIFACTS, exist_ok=True)
    expected = all_versions(lineage)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(server + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        nodes = page.eval_on_selector_all("circle.node", "els => els.map(e => e.dataset.id)")
        assert sorted(nodes) == sorted(expected)
        edges = page.eval_on_selector_all("path.edge", "els => els.map(e => [e.dataset.child, e.dataset.parent])")
        assert sorted(edges) == sorted([vid, v.parents[0]] for vid, v in expected.items() if v.parents)
        assert page.evaluate("window.__pwned") is None and dialogs == []
        assert HOSTILE in page.text_content("#dag"), "the hostile message is shown as text"
        target = lineage.resolve("main~2")
        page.click(f"circle.node[data-id='{target}']")
        page.wait_for_selector(f"#detail h2:text('{target}')")
        shown = dict(page.eval_on_selector_all("#detail-metrics tr.metric",
                                               "els => els.map(e => [e.dataset.name, e.querySelector('td').textContent])"))
        assert {k: float(x) for k, x in shown.items()} == lineage.version(target).metrics
        page.screenshot(path=os.path.join(ARTIFACTS, "lineage.png"), full_page=True)

        page.click("button[data-view='metrics']")
        page.wait_for_selector("polyline.series")
        assert page.input_value("#metric-select") == "loss", "a metric named loss is shown first"
        page.select_option("#metric-select", "acc")
        page.wait_for_function("() => document.querySelectorAll('polyline.series').length === 3 && "
                               "document.querySelector('polyline.series[data-branch=wd]').dataset.points === '3'")
        page.select_option("#metric-select", "loss")
        page.wait_for_function("() => document.querySelector('polyline.series[data-branch=wd]').dataset.points === '7'")
        curves = dict(page.eval_on_selector_all("polyline.series", "els => els.map(e => [e.dataset.branch, +e.dataset.points])"))
        assert curves == {name: sum(1 for v in lineage.log(name) if "loss" in v.metrics) for name in lineage.branches()}
        assert sorted(page.eval_on_selector_all("circle.fork-mark", "els => els.map(e => e.dataset.branch)")) == ["lr-sweep", "wd"]
        page.screenshot(path=os.path.join(ARTIFACTS, "metrics.png"), full_page=True)

        page.click("button[data-view='diff']")
        page.fill("#diff-a", "main")
        page.fill("#diff-b", "lr-sweep")
        page.click("#diff-run")
        page.wait_for_selector("#diff-table tbody tr")
        page.wait_for_function("() => document.getElementById('divergence').textContent.length > 0")
        rows = page.eval_on_selector_all("#diff-table tbody tr", "els => els.map(e => [e.dataset.path, e.dataset.status])")
        assert rows == [[d.path, d.status] for d in lineage.diff("main", "lr-sweep")]
        assert f"first differ at step {lineage.first_divergence('main', 'lr-sweep').step}" in page.inner_text("#divergence")
        page.screenshot(path=os.path.join(ARTIFACTS, "diff.png"), full_page=True)
        page.fill("#diff-b", "<b>nope</b>")
        page.click("#diff-run")
        page.wait_for_function("() => document.getElementById('diff-error').textContent.includes('nope')")
        page.screenshot(path=os.path.join(ARTIFACTS, "diff-error.png"), full_page=True)

        page.click("button[data-view='usage']")
        page.wait_for_selector("#usage-table tbody tr")
        assert sorted(page.eval_on_selector_all("#usage-table tbody tr", "els => els.map(e => e.dataset.branch)")) == \
            sorted(lineage.branches())
        page.screenshot(path=os.path.join(ARTIFACTS, "usage.png"), full_page=True)
        assert page.evaluate("window.__pwned") is None and dialogs == []
        browser.close()


def test_plot_writes_an_image_of_each_branchs_series(lineage, tmp_path):
    from forkpoint.cli.plot import plot_metric

    out = str(tmp_path / "loss.png")
    drawn = plot_metric(lineage, "loss", out)
    for name in lineage.branches():
        assert drawn[name] == [(v.step, v.metrics["loss"]) for v in reversed(lineage.log(name))]
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[2] in (3, 4)
    result = CliRunner().invoke(cli, ["plot", "loss", "-b", "main", "-b", "wd", "--out", str(tmp_path / "two.svg"),
                                      "-r", lineage.url])
    assert result.exit_code == 0 and "loss of main, wd" in result.output, result.output
    assert open(tmp_path / "two.svg").read().count("<path") > 2
    bad = CliRunner().invoke(cli, ["plot", "nosuch", "--out", str(tmp_path / "x.png"), "-r", lineage.url])
    assert bad.exit_code != 0 and "records metric 'nosuch'" in bad.output
    assert "numeric metrics recorded: acc, loss" in bad.output.replace("\n", " "), bad.output
    bad = CliRunner().invoke(cli, ["plot", "loss", "-b", "nope", "--out", str(tmp_path / "x.png"), "-r", lineage.url])
    assert bad.exit_code != 0 and "no branch 'nope'" in bad.output and not (tmp_path / "x.png").exists()


def test_repo_and_version_render_as_escaped_html(lineage):
    page = lineage._repr_html_()
    assert "branch lr-sweep" in page and "tag best" in page
    detail = lineage.version("wd")._repr_html_()
    assert "<script>" not in detail and "&lt;script&gt;" in detail
