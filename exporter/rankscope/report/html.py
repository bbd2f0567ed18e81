"""The report as one self-contained HTML file: inline CSS, images as base64 PNG, no script, no network.

The page is a header of facts, a table of contents and one `<section id=...>` per
part, each made of blocks (paragraphs, figures, tables, notes). Every text is
escaped here; callers pass plain strings.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Figure", "Note", "Paragraph", "Section", "Table", "render_page"]


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Note:
    """A grey remark: what is missing and why."""

    text: str


@dataclass(frozen=True)
class Figure:
    png: bytes
    alt: str
    caption: str = ""


@dataclass(frozen=True)
class Table:
    headers: Sequence[str]
    rows: Sequence[Sequence[str]]
    caption: str = ""


Block = Paragraph | Note | Figure | Table


@dataclass
class Section:
    id: str
    title: str
    blocks: list[Block] = field(default_factory=list)


_CSS = """
:root { color-scheme: light; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #1d1d1f;
       margin: 0; background: #fafafa; }
main { max-width: 1260px; margin: 0 auto; padding: 12px 10px 40px; }
header { background: #1d3557; color: #fff; padding: 14px 10px; }
header .inner { max-width: 1260px; margin: 0 auto; }
header h1 { margin: 0 0 4px; font-size: 22px; }
header p { margin: 0; opacity: .85; }
nav { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd; z-index: 1; }
nav .inner { max-width: 1260px; margin: 0 auto; padding: 6px 10px; }
nav a { margin-right: 16px; color: #1d3557; text-decoration: none; font-weight: 600; }
section { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px 14px 14px; margin: 14px 0; }
h2 { font-size: 19px; margin: 6px 0 8px; color: #1d3557; }
figure { margin: 10px 0; }
figure img { display: block; max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 13px; margin-top: 2px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13.5px; }
th, td { border-bottom: 1px solid #e6e6e6; padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { color: #444; }
caption { text-align: left; color: #555; font-size: 13px; padding-bottom: 3px; }
.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 2px 18px; }
.facts div { padding: 2px 0; border-bottom: 1px dotted #ddd; }
.facts b { display: inline-block; min-width: 160px; color: #444; font-weight: 600; }
.note { color: #666; font-style: italic; }
.verdict { font-size: 16px; }
"""


def _block(block: Block) -> str:
    if isinstance(block, Paragraph):
        return f"<p>{html.escape(block.text)}</p>"
    if isinstance(block, Note):
        return f'<p class="note">{html.escape(block.text)}</p>'
    if isinstance(block, Figure):
        data = base64.b64encode(block.png).decode("ascii")
        caption = f"<figcaption>{html.escape(block.caption)}</figcaption>" if block.caption else ""
        return f'<figure><img alt="{html.escape(block.alt)}" src="data:image/png;base64,{data}">{caption}</figure>'
    if isinstance(block, Table):
        head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block.rows)
        caption = f"<caption>{html.escape(block.caption)}</caption>" if block.caption else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    raise TypeError(f"not a report block: {block!r}")


def render_page(title: str, subtitle: str, facts: Sequence[tuple[str, str]], sections: Sequence[Section]) -> str:
    """The whole page as one string."""
    nav = "".join(f'<a href="#{html.escape(s.id)}">{html.escape(s.title)}</a>' for s in sections)
    fact_list = "".join(f"<div><b>{html.escape(k)}</b> {html.escape(v)}</div>" for k, v in facts)
    body = "".join(
        f'<section id="{html.escape(s.id)}"><h2>{html.escape(s.title)}</h2>'
        + "".join(_block(b) for b in s.blocks)
        + "</section>"
        for s in sections
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, '
        f'initial-scale=1"><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>'
        f'<header><div class="inner"><h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p></div></header>'
        f'<nav><div class="inner">{nav}</div></nav>'
        f'<main><section id="facts"><h2>The run</h2><div class="facts">{fact_list}</div></section>{body}</main>'
        "</body></html>\n"
    )
