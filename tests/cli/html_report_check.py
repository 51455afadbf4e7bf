#!/usr/bin/env python3
"""Checks of `xfbench report` pages for tests/cli/html_report_test.sh; exit 0 when they hold, else 1
with one line per failed check.

  html_report_check.py page PAGE.html METRIC…   structure of the page as written
  html_report_check.py dom DOM.html             the DOM Chromium dumped after the page's script ran
  html_report_check.py sorted DOM.html COLUMN   the first table with the header COLUMN sorted by it, ascending
  html_report_check.py pixels SHOT.png PAGE.html  a screenshot shows a sortable table and a plot
"""
import html.parser
import re
import struct
import sys
import zlib

failures = []


def check(condition, message):
    if not condition:
        failures.append(message)


class Page(html.parser.HTMLParser):
    """Elements with their attributes, and the text of every cell by table."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.elements = []  # (tag, attributes dict)
        self.tables = []  # {"attrs", "header": [th texts], "rows": [[(text, attrs)]]}
        self.text = []  # every text node, references decoded
        self._cell = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if tag == "table":
            self.tables.append({"attrs": attrs, "header": [], "rows": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th") and self.tables:
            self._cell = [tag, "", attrs]

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            kind, text, attrs = self._cell
            table = self.tables[-1]
            if kind == "th" and attrs.get("scope") == "col":
                table["header"].append(text.strip())
            elif table["rows"]:
                table["rows"][-1].append((text.strip(), attrs))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell[1] += data

    def having(self, tag, **wanted):
        return [a for t, a in self.elements if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in wanted.items())]


def page(path, *metrics):
    text = open(path, encoding="utf-8").read()
    doc = Page(text)
    check(text.startswith("<!DOCTYPE html>"), "no HTML5 doctype")
    sortable = doc.having("table", data_sortable="true")
    check(len(sortable) >= len(metrics), f"{len(sortable)} sortable tables, want at least {len(metrics)}")
    shown = {a.get("data-metric") for t, a in doc.elements if t == "div" and "data-metric" in a}
    for metric in metrics:
        check(metric in shown, f"no table of metric {metric} (have {sorted(shown)})")
    check(len(doc.having("figure", **{"class": "xr-plot"})) >= 1, "no plot figure")
    check(re.search(r'<figure class="xr-plot">\s*<svg ', text) is not None, "no <svg> inline in a plot figure")
    # Self-contained: nothing the browser could fetch.
    for tag, attrs in doc.elements:
        for name in ("src", "href", "srcset", "xlink:href", "action", "data"):
            value = attrs.get(name)
            check(value is None or value.startswith("#"), f"<{tag} {name}={value!r}> refers outside the page")
        check(tag not in ("link", "iframe", "object", "embed", "img"), f"<{tag}> element")
    for needle in ("url(", "@import", "@font-face"):
        check(needle not in text, f"{needle} in the page")
    # A URL may appear only as data of the report, escaped: in text or a title or data-* attribute.
    markup = re.sub(r">[^<]*<", "><", text)
    markup = re.sub(r'\s(title|data-[a-z-]+)="[^"]*"', "", markup)
    check(re.search(r"https?://", markup) is None, "a URL in the markup: " + str(re.findall(r".{40}https?://.{20}", markup)))
    check(len(doc.having("meta", http_equiv="Content-Security-Policy")) == 1, "no Content-Security-Policy")
    for table in sortable:
        check(table.get("class") in ("xr-table", "xr-warnings", "xr-points"), f"unknown table class {table}")
    numeric = [cell for t in doc.tables for row in t["rows"] for cell in row if "data-value" in cell[1]]
    check(numeric, "no numeric cell carries data-value")
    for text_, attrs in numeric:
        try:
            float(attrs["data-value"])
        except ValueError:
            failures.append(f"data-value {attrs['data-value']!r} is not a number")


def dom(path):
    text = open(path, encoding="utf-8").read()
    doc = Page(text)
    sortable = doc.having("table", data_sortable="true")
    ready = doc.having("table", data_sortable="true", data_sort_ready="true")
    check(sortable and len(ready) == len(sortable), f"the script set up {len(ready)} of {len(sortable)} sortable tables")
    check(doc.having("svg"), "no <svg> in the DOM")
    check(doc.having("g", **{"class": "series"}), "no plotted series in the DOM")
    headers = [a for t, a in doc.elements if t == "th" and a.get("scope") == "col"]
    check(headers and all(a.get("tabindex") == "0" for a in headers), "headers not focusable after the script ran")


def sorted_check(path, column):
    doc = Page(open(path, encoding="utf-8").read())
    table = next((t for t in doc.tables if t["attrs"].get("data-sortable") == "true" and column in t["header"]), None)
    if table is None or column not in table["header"]:
        failures.append(f"no sortable table with a column {column}")
        return
    i = table["header"].index(column)
    cells = [row[i] for row in table["rows"] if len(row) > i]
    keys = [float(a["data-value"]) if "data-value" in a else None for _, a in cells]
    present = [k for k in keys if k is not None]
    check(present == sorted(present), f"column {column} not ascending: {keys}")
    check(keys[: len(present)] == present, f"cells without a value are not last: {keys}")
    check(len(present) >= 2, f"too few values to show an order: {keys}")


def png_pixels(path):
    """(width, height, channels, rows of bytes) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    at, idat, header = 8, b"", None
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace:
        raise ValueError(f"unsupported PNG: depth {depth} colour type {colour} interlace {interlace}")
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    previous = bytearray(stride)
    rows = []
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for x in range(stride):
            a = line[x - channels] if x >= channels else 0
            b = previous[x]
            c = previous[x - channels] if x >= channels else 0
            if kind == 1:
                line[x] = (line[x] + a) & 255
            elif kind == 2:
                line[x] = (line[x] + b) & 255
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        previous = line
    return width, height, channels, rows


def count_colour(shot, rgb):
    width, height, channels, rows = shot
    wanted = bytes(rgb)
    return sum(1 for row in rows for x in range(0, width * channels, channels) if row[x:x + 3] == wanted)


def hex_rgb(colour):
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def pixels(png, page_path):
    text = open(page_path, encoding="utf-8").read()
    header = re.search(r"table\[data-sortable\] thead th\{background:(#[0-9a-f]{6})", text)
    series = re.search(r'<g class="series"[^>]* fill="(#[0-9a-fA-F]{6})"', text)
    if not header or not series:
        failures.append("the page names no header background or filled series colour")
        return
    shot = png_pixels(png)
    width, height = shot[0], shot[1]
    header_pixels = count_colour(shot, hex_rgb(header.group(1)))
    series_pixels = count_colour(shot, hex_rgb(series.group(1)))
    white = count_colour(shot, (255, 255, 255))
    # A header row of a few columns is thousands of pixels; a series' markers some dozens.
    check(header_pixels >= 2000, f"{header_pixels} pixels of the table header colour {header.group(1)}")
    check(series_pixels >= 40, f"{series_pixels} pixels of the first series' colour {series.group(1)}")
    check(white < width * height, "the screenshot is blank")


def main():
    command, args = sys.argv[1], sys.argv[2:]
    {"page": page, "dom": dom, "sorted": sorted_check, "pixels": pixels}[command](*args)
    for failure in failures:
        print(f"{command}: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
