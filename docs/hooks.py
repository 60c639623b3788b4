"""mkdocs hook: the site's home page is the repository's README (one source for both), with
its links into docs/ made relative to the site."""

from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def on_page_read_source(page, config):
    """The README's text for index.md; None (read the file) for every other page."""
    if page.file.src_uri != "index.md":
        return None
    return README.read_text().replace("](docs/", "](")
