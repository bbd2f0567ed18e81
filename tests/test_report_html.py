"""rankscope.report.html: one self-contained page, every text escaped."""

from __future__ import annotations

import base64
import re

from rankscope.report.html import Figure, Note, Paragraph, Section, Table, render_page


def test_the_page_embeds_its_images_and_escapes_every_text() -> None:
    png = b"\x89PNG\r\n\x1a\n fake"
    page = render_page(
        "report <1>",
        "from a & b",
        [("run_id", "<script>alert(1)</script>")],
        [
            Section("training", "Training", [Paragraph("loss < 1"), Figure(png, 'alt "x"', "caption")]),
            Section("incidents", "Incidents", [Table(["a"], [["<b>"]], "t"), Note("nothing")]),
        ],
    )
    assert page.startswith("<!DOCTYPE html>") and "<script>" not in page
    assert "&lt;script&gt;" in page and "loss &lt; 1" in page and "report &lt;1&gt;" in page
    (data,) = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert base64.b64decode(data) == png
    assert re.findall(r'<section id="([a-z]+)">', page) == ["facts", "training", "incidents"]
    assert '<a href="#training">Training</a>' in page
    # Nothing to fetch: no external reference of any kind.
    assert not re.search(r'(src|href)="(?!data:|#)', page) and "@import" not in page and "url(" not in page
