"""How `forkpoint ui` copes with a long history: a repository of N versions (a main line with
a fork every 100 versions, each fork 20 versions long), then through the running server the
first /api/versions page (the lineage is laid out then), a later page (from the layout kept),
a version's detail and a metric's series, each the median of several requests; and the time
headless Chromium takes to show the first page (with --browser).

    python benchmarks/ui_lineage.py --versions 10000 --repeats 5 --browser
"""

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

import forkpoint as fp
from forkpoint.cli.webui import serve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def build(url: str, n: int) -> fp.Repo:
    repo = fp.Repo(url, create=True)
    forks, made = 0, 0
    while made < n:
        repo.save({"x": np.array([made])}, step=made, metrics={"loss": 1 / (made + 1)})
        made += 1
        if made % 100 == 0 and made < n:
            branch = f"fork{forks}"
            repo.fork("main", branch)
            for i in range(min(20, n - made)):
                repo.save({"x": np.array([-made])}, branch=branch, step=made + i, metrics={"loss": 0.5 / (made + i)})
                made += 1
            forks += 1
    return repo


def timed(url: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with urllib.request.urlopen(url) as r:
            r.read()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = harness.arguments(__doc__, repeats=5, directory=False)
    p.add_argument("--versions", type=int, default=10000)
    p.add_argument("--browser", action="store_true", help="also time the page in headless chromium")
    a = p.parse_args()
    where = tempfile.mkdtemp(prefix="ui-bench-")
    try:
        start = time.perf_counter()
        repo = build(f"{where}/repo", a.versions)
        print(f"built {a.versions} versions, {len(repo.branches())} branches in {time.perf_counter() - start:.1f} s")
        server = serve(fp.Repo(repo.url), port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        start = time.perf_counter()
        with urllib.request.urlopen(base + "/api/versions?limit=300") as r:
            r.read()
        print(f"first page (lays out the lineage): {time.perf_counter() - start:.3f} s")
        for name, path in (("a page of 300 later on", f"/api/versions?offset={a.versions // 2}&limit=300"),
                           ("a version's detail", "/api/version/main~50"),
                           ("the loss series of every branch", "/api/series?metric=loss")):
            print(f"{name}: median {timed(base + path, a.repeats):.3f} s of {a.repeats}")
        if a.browser:
            from playwright.sync_api import sync_playwright

            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
                times = []
                for _ in range(a.repeats):
                    page = browser.new_page()
                    start = time.perf_counter()
                    page.goto(base + "/")
                    page.wait_for_selector("body[data-ready='1']", timeout=120_000)
                    times.append(time.perf_counter() - start)
                    page.close()
                browser.close()
            print(f"page shown in chromium (first 300 versions): median {statistics.median(times):.3f} s of {a.repeats}")
        server.shutdown()
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
