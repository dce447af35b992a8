"""The HTML report as a page: self-contained, real tables, one colour per meaning, headline first, a timeline of
one step; and what a browser shows of it (headless Chromium's screenshot of the stored H200 trace's report).

Chromium is Debian's package (``apt-get install -y chromium``; nox's tests(core) installs it where missing, as root): a
missing browser fails the screenshot test, it is not skipped."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from primus.core.profile.analyze import analyze_run
from primus.core.profile.report import CATEGORIES, COLORS, MOE_CATEGORIES, SHARES, html_page

TRACE = Path(__file__).parent / "data" / "h200_llama3.2-1b_torchtitan.trace.json.gz"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("page") / "report.html"
    run = analyze_run([TRACE])
    path.write_text(html_page(run, "Step time breakdown: llama3.2-1b on torchtitan"))
    return run, path.read_text(), path


def test_one_colour_per_meaning():
    assert set(COLORS) == {*SHARES, *CATEGORIES}
    assert len(set(COLORS.values())) == len(COLORS)  # compute is not GEMM's blue, idle not "other"'s grey...
    for a, b in (
        ("compute", "gemm"),
        ("overlapped communication", "elementwise"),
        ("exposed communication", "communication"),
    ):
        assert COLORS[a] != COLORS[b]


def test_page_is_self_contained_with_tables_and_headline_first(report):
    run, page, _ = report
    assert page.startswith("<!doctype html>") and page.count("<table>") >= 4
    assert "<script" not in page and not re.search(r"""(src|href)=|@import|url\(""", page)
    # the only URL is the SVG namespace, which no browser fetches
    assert set(re.findall(r"https?://[^\"' ]+", page)) == {"http://www.w3.org/2000/svg"}
    # headline numbers come before the first table, in this order
    first_table = page.index("<table>")
    positions = [page.index(f'<div class="k">{k}</div>') for k in ("step time", "MFU", "exposed communication", "idle")]
    assert positions == sorted(positions) and positions[-1] < first_table
    assert '<div class="v">169.0 ms</div>' in page and '<div class="v">44.2%</div>' in page
    # the run's summary, top kernels with their category, the timeline of one step
    for text in ('<td class="l">model</td><td class="l">llama3.2-1b</td>', "NVIDIA H200", "Top kernels (rank 0)"):
        assert text in page
    assert "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN" in page and "rank 0 · one step, 169.0 ms" in page
    assert ">stream 7</text>" in page and ">time shares</text>" in page
    # each category's colour is drawn in the timeline (a <rect> of that fill) for the categories this step has
    for cat in ("gemm", "attention", "norm", "elementwise", "optimizer", "memory", "compute"):
        assert f'fill="{COLORS[cat]}"><title>' in page, cat
    assert "HolisticTraceAnalysis" in page.split("<h2>", 1)[0]  # which engine produced the numbers, on top


def _png_pixels(path: Path) -> set[tuple[int, int, int]]:
    """The distinct RGB colours of a PNG: PIL where installed, else a small decoder (8-bit RGB/RGBA, zlib)."""
    try:
        from PIL import Image

        with Image.open(path) as im:
            return {px[:3] for _, px in im.convert("RGB").getcolors(maxcolors=1 << 24)}
    except ImportError:
        pass
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, _, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), (depth, ctype)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, prev, colours = zlib.decompress(idat), width * bpp, bytearray(width * bpp), set()
    for y in range(len(raw) // (stride + 1)):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        colours.update(bytes(line[i : i + 3]) for i in range(0, stride, bpp))
        prev = line
    return {tuple(c) for c in colours}


def test_browser_screenshot(report, tmp_path):
    """Headless Chromium renders the report: a full picture, and every meaning's colour is on screen."""
    _, page, path = report
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.fail("chromium is not installed: apt-get install -y chromium (nox -s 'tests(core)' installs it as root)")
    shot = tmp_path / "report.png"
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",  # as root (CI)
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        path.resolve().as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 20_000, done.stderr[-2000:]
    colours = _png_pixels(shot)
    assert len(colours) > 200  # text, bars, tables: not a blank or an error page
    # every meaning's colour (the mixture-of-experts categories show only in an MoE run's report: not this one)
    want = {k: tuple(int(v[i : i + 2], 16) for i in (1, 3, 5)) for k, v in COLORS.items() if k not in MOE_CATEGORIES}
    missing = {k: v for k, v in want.items() if v not in colours}
    assert not missing, f"colours not on screen: {missing}"
    assert "<table>" in page
