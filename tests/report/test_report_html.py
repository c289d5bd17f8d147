"""report.html: self-contained (nothing fetched from elsewhere, every image a data: URI) and
holding what the brief lists: a header (command line, date, device, versions), summary with
spread, plots, per config status/error, breakdown, flash routes, kernel categories and relative
links to its trace and snapshot timeline."""

import html
import html.parser
import json
import re

from test_report_summary import RESULTS, write_run

from dp_cost.report import summary as report

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


def header_rows(page_text: str) -> dict:
    """The header table's rows (label -> text), the first table of the page."""
    table = page_text.split('<table class="run">', 1)[1].split("</table>", 1)[0]
    cells = re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", table, re.DOTALL)
    return {label: html.unescape(re.sub(r"<[^>]+>", "", value)) for label, value in cells}


def test_report_html_opens_with_the_header_from_the_result_files(tmp_path):
    results = [dict(r) for r in RESULTS]
    results[0]["env"] = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.8.0", "opacus": "1.6.0"}
    results[0]["env"]["cuda"] = "12.8"
    write_run(tmp_path, results)
    report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    text = (tmp_path / "report.html").read_text()
    # the header comes before every other table and section
    assert text.index('<table class="run">') < text.index("<h2>")
    rows = header_rows(text)
    assert rows["command line"] == "not recorded"
    assert rows["date"].startswith("not recorded (newest result file modified 20")
    assert rows["device"] == "NVIDIA H100 80GB HBM3" and rows["CUDA"] == "12.8"
    assert (rows["torch"], rows["opacus"]) == ("2.8.0", "1.6.0")
    assert rows["Python"] == rows["toolkit git commit"] == "not recorded"


def test_report_html_header_from_run_json(tmp_path):
    results = [dict(r) for r in RESULTS]
    results[0]["env"] = {"device": "cpu", "torch": "2.13.0+cpu", "opacus": "1.6.0", "cuda": None}
    results[1]["env"] = {"device": "cpu", "torch": "2.12.0", "opacus": "1.6.0", "cuda": None}
    write_run(tmp_path, results)
    argv = ["python", "profiling_script.py", "--mode=test", "--run_name", "a <b>"]
    run = {
        "command": argv,
        "date": "2026-11-27T09:00:00+00:00",
        "versions": {"python": "3.11.7", "torch": "9.9", "git_commit": "0123abc (dirty)"},
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    text = (tmp_path / "report.html").read_text()
    assert "&lt;b&gt;" in text and "<b>'" not in text  # escaped
    rows = header_rows(text)
    assert rows["command line"] == "python profiling_script.py --mode=test --run_name 'a <b>'"
    assert rows["date"] == "2026-11-27T09:00:00+00:00"
    # what the workers recorded wins over the run-level file; two values are both shown
    assert rows["torch"] == "2.13.0+cpu / 2.12.0" and rows["device"] == "cpu"
    assert rows["CUDA"] == "none (a CPU run)"
    assert (rows["Python"], rows["toolkit git commit"]) == ("3.11.7", "0123abc (dirty)")
