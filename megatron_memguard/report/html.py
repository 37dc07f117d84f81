"""Self-contained HTML pages: one file, inline SVG figures and CSS, no scripts, nothing fetched.

Tables carry the exact numbers behind each cell as ``data-value`` attributes (bytes, ratios), so a
page can be checked (or scraped) without parsing the formatted text.
"""
from __future__ import annotations

import html
import io
import re
from typing import Any, Iterable, Sequence

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em auto; max-width: 1400px;
       color: #1a1a1a; padding: 0 1em; }
h1 { font-size: 1.35em; margin-bottom: 0.2em; }
h2 { font-size: 1.1em; margin-top: 1.6em; }
p.sub { color: #555; margin-top: 0; white-space: pre-line; }
figure { margin: 1em 0; }
figure svg { max-width: 100%; height: auto; }
figcaption { color: #444; font-size: 0.9em; margin-top: 0.3em; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.5em 0; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; }
th { background: #f3f3f3; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.fits { color: #1b7f2a; font-weight: 600; } .tight { color: #b36b00; font-weight: 600; }
.over, .will-not-fit { color: #c0392b; font-weight: 600; } .muted { color: #777; }
ul.notes { color: #444; font-size: 0.9em; }
"""


def esc(text: Any) -> str:
    return html.escape("" if text is None else str(text), quote=True)


def svg_of(fig: Any) -> str:
    """The figure as an inline ``<svg>`` element (text as paths: no fonts needed to view it)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    s = buf.getvalue()
    i = s.find("<svg")
    return s[i:] if i >= 0 else s


class Cell:
    """A table cell: the text shown, the exact value behind it, a CSS class."""

    __slots__ = ("text", "value", "cls", "num")

    def __init__(self, text: Any, value: Any = None, cls: str = "", num: bool = True):
        self.text, self.value, self.cls, self.num = text, value, cls, num


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], table_id: str = "") -> str:
    """An HTML table; cells are strings (text columns) or ``Cell`` (numbers with their exact value)."""
    out = [f'<table{f" id={chr(34)}{esc(table_id)}{chr(34)}" if table_id else ""}>', "<thead><tr>"]
    out += [f"<th>{esc(h)}</th>" for h in header]
    out.append("</tr></thead><tbody>")
    for r in rows:
        out.append("<tr>")
        for c in r:
            if isinstance(c, Cell):
                cls = " ".join(x for x in ("num" if c.num else "", c.cls) if x)
                val = "" if c.value is None else f' data-value="{esc(c.value)}"'
                out.append(f'<td{f" class={chr(34)}{cls}{chr(34)}" if cls else ""}{val}>{esc(c.text)}</td>')
            else:
                out.append(f"<td>{esc(c)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def page(title: str, body: Sequence[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def figure(fig: Any, caption: str = "") -> str:
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f"<figure>{svg_of(fig)}{cap}</figure>"


def notes(items: Sequence[str]) -> str:
    if not items:
        return ""
    return "<ul class=\"notes\">" + "".join(f"<li>{esc(n)}</li>" for n in items) + "</ul>"


def css_class(verdict: str) -> str:
    return re.sub(r"[^a-z]+", "-", verdict.lower()).strip("-")


def is_offline(doc: str) -> bool:
    """True when the page loads nothing: no scripts, stylesheets, images or fonts from elsewhere."""
    low = doc.lower()
    if re.search(r"<script\b", low) or re.search(r"<link\b", low) or "@import" in low:
        return False
    for m in re.finditer(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", low):
        if not m.group(1).startswith(("#", "data:")):
            return False
    return "url(http" not in low
