"""Reports: results.json -> Markdown and PNG plots.

- :mod:`.run`: the report of one run (``write_report``), its sections chosen from a table by
  source kind; :mod:`.sections` (every run's and a zoo run's sections) and :mod:`.checkpoint`
  (a pretrained checkpoint's: Hugging Face, GGUF, ONNX export) hold them.
- :mod:`.comparison`: the sweep report (``write_comparison``) and the findings file
  (``write_findings``), from :mod:`.sweep` (the cells as read back), :mod:`.stats` (estimates and
  tests over seeds) and :mod:`.findings` (the claims, a table of functions).
- :mod:`.markdown` and :mod:`.plots`: the Markdown and PNG helpers all of them use.

Everything here reads results (quantnorm.results); nothing imports the pipeline, training,
quantization or a model source.
"""

from .comparison import write_comparison, write_findings
from .run import write_report

__all__ = ["write_comparison", "write_findings", "write_report"]
