"""report.html: self-contained (nothing fetched from elsewhere, every image a data: URI) and
holding what the brief lists: summary with spread, plots, per config status/error, breakdown,
flash routes, kernel categories and relative links to its trace and snapshot timeline."""

import html.parser
import re

from test_report_summary import RESULTS, write_run

from report import summary as report

ROUTES = [{"name": "blocks.0.mlp.fc1", "T": 16, "d": 64, "p": 256, "route": "gram"}]


class Page(html.parser.HTMLParser):
    """Every tag's attributes and the page's text."""

    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def written_page(tmp_path):
    results = [dict(r) for r in RESULTS]
    results[0] |= {"flash_routes": ROUTES, "trace_file": "trace.pt.trace.json"}
    results[0]["step_times_ms"] = [29.0, 30.0, 36.0]
    write_run(tmp_path, results)
    (tmp_path / results[0]["config_dir"] / "trace.pt.trace.json").write_text("[]")
    (tmp_path / results[1]["config_dir"] / "memory_timeline.html").write_text("<html></html>")
    report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    text = (tmp_path / "report.html").read_text()
    page = Page()
    page.feed(text)
    return results, text, page


def test_report_html_requests_nothing_from_elsewhere(tmp_path):
    _, text, page = written_page(tmp_path)
    assert not [t for t, attrs in page.tags if t == "script" and "src" in attrs]
    assert not [t for t, attrs in page.tags if t == "link"]
    assert not re.search(r"url\(", text)
    for tag, attrs in page.tags:
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            assert not re.match(r"\s*(https?:)?//", value, re.IGNORECASE), (tag, value)
    images = [attrs["src"] for tag, attrs in page.tags if tag == "img"]
    pngs = sorted((tmp_path / "visualizations").glob("*.png"))
    assert len(images) == len(pngs) >= 2
    assert all(src.startswith("data:image/png;base64,") for src in images)


def test_report_html_holds_tables_configs_and_links(tmp_path):
    results, text, page = written_page(tmp_path)
    words = " ".join(page.text)
    assert "steps_ms" in words and "29.00-36.00" in words and "NOISY" in words
    assert "oom why" in words  # the oom config's error
    assert "blocks.0.mlp.fc1" in words and "gram" in words  # flash routes
    assert "Kernel time per category" in words and "norm_clip" in words
    assert "Breakdown at the peak" in words
    hrefs = {attrs["href"] for tag, attrs in page.tags if tag == "a"}
    assert hrefs == {
        f"{results[0]['config_dir']}/trace.pt.trace.json",
        f"{results[1]['config_dir']}/memory_timeline.html",
    }
    assert all((tmp_path / href).exists() for href in hrefs)
