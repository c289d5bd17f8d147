"""report.html: self-contained (nothing fetched from elsewhere, every image a data: URI) and
holding what the brief lists: a header (command line, date, device, versions), summary with
spread, plots, per config status/error, breakdown, flash routes, kernel categories and relative
links to its trace and snapshot timeline."""

import html
import html.parser
import json
import re
import shutil
import subprocess

import pytest
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


def long_noted_page(tmp_path) -> str:
    """report.html of a run whose notes are long lines: epsilon's, a busy machine's."""
    results = [dict(r) for r in RESULTS]
    results[0]["clipping"] = {"rule": "flat"}  # a DP config of the causal LM: epsilon null, why
    write_run(tmp_path, results)
    load = {"at_start": {"cpus": 2, "load": 3.5}, "at_end": {"cpus": 2, "load": 3.0}}
    (tmp_path / "run.json").write_text(json.dumps({"command": ["x"], "machine_load": load}))
    report.write_summary(str(tmp_path), report.load_results(str(tmp_path)))
    return (tmp_path / "report.html").read_text()


def test_report_html_wraps_its_notes_and_scrolls_wide_tables_in_their_box(tmp_path):
    text = long_noted_page(tmp_path)
    notes = re.findall(r"<pre>(.*?)</pre>", text, re.DOTALL)
    assert any(len(line) > 150 for note in notes for line in note.splitlines())  # a long line
    style = text.split("<style>", 1)[1].split("</style>", 1)[0]
    assert re.search(r"pre \{[^}]*white-space: pre-wrap", style)  # ... wraps
    assert re.search(r"div\.wide \{[^}]*overflow-x: auto", style)
    assert text.count("<table>") == text.count('<div class="wide"><table>') > 0


# Each browser that may be installed: how it takes a headless screenshot of a page.
WINDOW = (1000, 700)
CHROME = lambda exe, png, url: [exe, "--headless", "--no-sandbox", "--disable-gpu",
                                f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={png}",
                                url]  # fmt: skip
FIREFOX = lambda exe, png, url: [exe, "--headless", "--window-size", f"{WINDOW[0]},{WINDOW[1]}",
                                 "--screenshot", png, url]  # fmt: skip
BROWSERS = {
    **dict.fromkeys(("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome",
                     "google-chrome-stable", "chrome"), CHROME),
    **dict.fromkeys(("firefox", "firefox-esr"), FIREFOX),
}  # fmt: skip
INSTALLED = next(((shutil.which(b), how) for b, how in BROWSERS.items() if shutil.which(b)), None)
# Marks the page's top left corner once it has loaded: green when nothing runs off the page to
# the right, red when something does.
PROBE = """<script>
window.addEventListener("load", () => {
  const root = document.documentElement;
  const mark = document.createElement("div");
  mark.style.cssText = "position:fixed;left:0;top:0;width:40px;height:40px;z-index:99999;"
    + "background:" + (root.scrollWidth > root.clientWidth + 1 ? "#ff0000" : "#00ff00");
  document.body.appendChild(mark);
});
</script>"""


@pytest.mark.skipif(INSTALLED is None, reason="no chromium, chrome or firefox installed")
def test_nothing_runs_off_report_html_in_a_browser(tmp_path):
    """The page with its long notes, shown by a headless browser in a 1000-pixel window."""
    import matplotlib.image

    text = long_noted_page(tmp_path)
    probed = tmp_path / "probed.html"
    probed.write_text(text.replace("</body>", PROBE + "</body>"))
    exe, how = INSTALLED
    screenshot = tmp_path / "page.png"
    shown = subprocess.run(how(exe, str(screenshot), probed.as_uri()), capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert screenshot.exists(), shown.stderr[-2000:]
    red, green, _ = matplotlib.image.imread(screenshot)[10, 10][:3]
    assert (round(red), round(green)) == (0, 1), "something runs off the page to the right"
