"""The report: ``certify report`` (Markdown and terminal, ``markdown``; the static site, ``html``),
``certify diff`` (``diff``). ``rows`` is the data every renderer reads."""

from certify.report.markdown import (coverage_markdown, op_markdown, render_all, report_extras,
                                     terminal_report, write_reports)
from certify.report.rows import (Row, _measured, build_rows, counts, list_tier_text, op_summary,
                                 project_guards, project_rows)

__all__ = ["Row", "_measured", "build_rows", "counts", "coverage_markdown", "list_tier_text",
           "op_markdown", "op_summary", "project_guards", "project_rows", "render_all",
           "report_extras", "terminal_report", "write_reports"]
