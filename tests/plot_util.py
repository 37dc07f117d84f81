"""Checks on rendered figures and pages: decoded image size and content, text overlap, HTML tables."""
from __future__ import annotations

import itertools
from html.parser import HTMLParser


def decode_png(path):
    """(height, width, channels) array of a PNG, decoded by matplotlib."""
    from matplotlib.image import imread
    return imread(path)


def ink_fraction(img) -> float:
    """Share of pixels that are not (near) white: 0 for a blank image."""
    rgb = img[..., :3]
    if rgb.dtype.kind in "ui":
        rgb = rgb / 255.0
    return float(((rgb < 0.94).any(axis=-1)).mean())


def renderer_of(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    fig.draw(canvas.get_renderer())
    return canvas.get_renderer()


def extents(texts, renderer):
    return [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_visible() and t.get_text().strip()]


def overlaps(boxes, pad: float = 0.0):
    """Pairs of named boxes that intersect (``pad`` pixels of tolerance)."""
    out = []
    for (na, a), (nb, b) in itertools.combinations(boxes, 2):
        if a.x0 + pad < b.x1 and b.x0 + pad < a.x1 and a.y0 + pad < b.y1 and b.y0 + pad < a.y1:
            out.append((na, nb))
    return out


def inside(box, outer, pad: float = 0.5) -> bool:
    return box.x0 >= outer.x0 - pad and box.y0 >= outer.y0 - pad and box.x1 <= outer.x1 + pad and box.y1 <= outer.y1 + pad


class _Tables(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str | None]]]] = {}
        self.headers: dict[str, list[str]] = {}
        self._id = None
        self._row = None
        self._cell = None
        self._in_head = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._id = a.get("id", f"table{len(self.tables)}")
            self.tables[self._id] = []
            self.headers[self._id] = []
        elif tag == "thead":
            self._in_head = True
        elif tag == "tr" and self._id is not None and not self._in_head:
            self._row = []
        elif tag in ("td", "th") and self._id is not None:
            self._cell = ["", a.get("data-value")]

    def handle_endtag(self, tag):
        if tag == "table":
            self._id = None
        elif tag == "thead":
            self._in_head = False
        elif tag == "tr" and self._row is not None:
            self.tables[self._id].append(self._row)
            self._row = None
        elif tag in ("td", "th") and self._cell is not None:
            if tag == "th":
                self.headers[self._id].append(self._cell[0])
            elif self._row is not None:
                self._row.append((self._cell[0], self._cell[1]))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[0] += data


def html_tables(doc: str):
    """{table id: (header, rows)}, each row a list of (text, data-value or None)."""
    p = _Tables()
    p.feed(doc)
    return {k: (p.headers[k], v) for k, v in p.tables.items()}
