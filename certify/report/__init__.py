"""The report: ``certify report`` (Markdown and terminal text, ``markdown``; its reach sections,
``reach_sections``; the static HTML site, ``html``, with its figures, ``plots``) and ``certify diff``
(``diff``). ``rows`` is the data the renderers read. ``html`` is imported on use only: it loads
matplotlib."""

SITE_DIR = "html"   # the HTML site's folder under the reports folder

from certify.report.markdown import (coverage_markdown, op_markdown, render_all, report_extras,
                                     terminal_report, write_reports)
from certify.report.rows import (Row, _measured, build_rows, counts, list_tier_text, op_summary,
                                 project_guards, project_mutants, project_rows)

__all__ = ["SITE_DIR", "Row", "_measured", "build_rows", "counts", "coverage_markdown", "list_tier_text",
           "op_markdown", "op_summary", "project_guards", "project_mutants", "project_rows", "render_all",
           "report_extras", "terminal_report", "write_reports"]
