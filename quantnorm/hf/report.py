"""Kept until quantnorm.hf.evaluate imports the one run report (quantnorm.report.write_report,
which picks a checkpoint's sections by its source kind) itself; remove with issue 13 item 1."""

from ..report import write_report as write_hf_report

__all__ = ["write_hf_report"]
