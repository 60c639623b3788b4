"""Make the screenshots of docs/UI.md from the demo's repository.

    forkpoint demo --dir /tmp/fp-demo && python docs/ui_screenshots.py /tmp/fp-demo/repo
"""

import os
import shutil
import sys
import threading

import forkpoint as fp
from forkpoint.cli.webui import serve

OUT = os.path.join(os.path.dirname(__file__), "images")


def main(url: str) -> None:
    from playwright.sync_api import sync_playwright

    server = serve(fp.Repo(url), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(base + "/")
        page.wait_for_selector("body[data-ready='1']")
        page.click("circle.node >> nth=8")
        page.wait_for_selector("#detail-metrics")
        page.screenshot(path=os.path.join(OUT, "ui-lineage.png"))
        page.click("button[data-view='metrics']")
        page.wait_for_selector("polyline.series")
        page.check("#log-y")
        page.wait_for_timeout(300)
        page.screenshot(path=os.path.join(OUT, "ui-metrics.png"))
        page.click("button[data-view='diff']")
        page.fill("#diff-a", "main")
        page.fill("#diff-b", "lr-sweep")
        page.fill("#diff-atol", "1e-6")
        page.click("#diff-run")
        page.wait_for_function("() => document.getElementById('divergence').textContent.length > 0")
        page.screenshot(path=os.path.join(OUT, "ui-diff.png"))
        page.click("button[data-view='usage']")
        page.wait_for_selector("#usage-table tbody tr")
        page.screenshot(path=os.path.join(OUT, "ui-usage.png"))
        browser.close()
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
