"""Which FP32 model a recipe quantizes: the plain export, a smoothed one or a rotated one.

The one dispatch for every source. A source hands over how it makes each transformed export (a
``smooth(alpha, path)`` and a ``rotate(form)`` callable, the fold rules already bound), or the
reason it cannot (no torch module behind an ONNX export, no rotation form for this model); each
export is made on first use and shared by the recipe loop and the search. The pipeline records a
refusal as "not applicable: why" and runs the other recipes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError, ExportError, QuantizeError
from ..fileio import release_memory

# A transformed export that failed (an exporter error, a parity gate it did not pass) fails the same
# way for every later recipe of that form or alpha: it is tried once and its error given again.
# A refusal (ConfigError) is not kept: it costs nothing and names the recipe that asked.
_KEPT_FAILURES = (ExportError, QuantizeError)

SMOOTHED_ONNX_FILE = "model.fp32.smoothquant.onnx"


class FP32Variants:
    """The transformed FP32 exports of one run: ``exports`` (SmoothQuant, per alpha) and ``rotated``
    (per rotation form), each an object with a ``path`` and ``to_dict(run_dir)``.

    ``smooth(alpha, path)`` / ``rotate(recipe)`` (one export per ``recipe.rotation`` form) make one;
    ``refuse(recipe)`` names why a recipe does not apply at all (None: it may);
    None refuses those recipes with the sentence ``no_smooth`` / ``no_rotate`` (``{recipe}``: the
    recipe's name). ``rotate`` may itself refuse a form (ConfigError). An export that failed is
    not tried again: later recipes of its form or alpha get its error.
    """

    def __init__(self, out_dir: Path, *, smooth: Callable | None = None, rotate: Callable | None = None,
                 refuse: Callable | None = None, suffix: str = "",
                 no_smooth: str = "recipe {recipe}: this source makes no smoothed export",
                 no_rotate: str = "recipe {recipe}: this source makes no rotated export (rotation lives in the "
                                  "checkpoint and zoo sources' transforms, quantnorm.transforms.rotation)"):
        self.out_dir = Path(out_dir)
        self._smooth, self._rotate, self._refuse = smooth, rotate, refuse
        self.no_smooth, self.no_rotate = no_smooth, no_rotate
        self.suffix = suffix   # before ".onnx" in the smoothed files' names (".past": the with-past graphs)
        self.exports: dict[float, object] = {}
        self.rotated: dict[str, object] = {}
        self._failed: dict[tuple[str, object], Exception] = {}

    def _made_once(self, key: tuple[str, object], make: Callable[[], object]) -> object:
        if key in self._failed:
            raise self._failed[key]
        try:
            return make()
        except _KEPT_FAILURES as exc:
            self._failed[key] = exc
            raise
        finally:
            # the exporter's graphs hold the transformed weights in reference cycles: freed before
            # the quantizer loads the file (Gemma 3's with-past rotated graph: 1.7 GB)
            release_memory()

    def get(self, alpha: float):
        """The smoothed export for ``alpha``, made on first use (the first alpha takes the plain file name)."""
        if self._smooth is None:
            raise ConfigError(self.no_smooth.format(recipe=f"smoothquant@{alpha:g}"))
        alpha = float(alpha)
        if alpha not in self.exports:
            name = SMOOTHED_ONNX_FILE if not self.exports else SMOOTHED_ONNX_FILE.replace(".onnx", f".a{alpha:g}.onnx")
            name = name.replace(".onnx", f"{self.suffix}.onnx")
            self.exports[alpha] = self._made_once(("smooth", alpha), lambda: self._smooth(alpha, self.out_dir / name))
        return self.exports[alpha]

    def fp32_for(self, recipe, default: Path) -> Path:
        """The FP32 model ``recipe`` quantizes: the rotated export for a rotation recipe, the smoothed
        one for a SmoothQuant recipe, else ``default``. ConfigError: this run cannot make it (or
        ``refuse(recipe)`` gave the reason it does not apply to this model)."""
        why = self._refuse(recipe) if self._refuse is not None else None
        if why is not None:
            raise ConfigError(why)
        form = getattr(recipe, "rotation", None)
        if form is not None:
            if self._rotate is None:
                raise ConfigError(self.no_rotate.format(recipe=recipe.name))
            if form not in self.rotated:
                self.rotated[form] = self._made_once(("rotate", form), lambda: self._rotate(recipe))
            return self.rotated[form].path
        alpha = getattr(recipe, "smoothquant_alpha", None)
        if alpha is None:
            return default
        if self._smooth is None:
            raise ConfigError(self.no_smooth.format(recipe=recipe.name))
        return self.get(alpha).path
