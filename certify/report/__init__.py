"""The report: ``certify report`` (Markdown and terminal text, ``markdown``; its reach sections,
``reach_sections``) and ``certify diff`` (``diff``). ``rows`` is the data the renderers read."""

from certify.report.markdown import (coverage_markdown, op_markdown, render_all, report_extras,
                                     terminal_report, write_reports)
from certify.report.rows import (Row, _measured, build_rows, counts, list_tier_text, op_summary,
                                 project_guards, project_rows)

__all__ = ["Row", "_measured", "build_rows", "counts", "coverage_markdown", "list_tier_text",
           "op_markdown", "op_summary", "project_guards", "project_rows", "render_all",
           "report_extras", "terminal_report", "write_reports"]
