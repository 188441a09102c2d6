"""The run report's engines section: quantnorm's models beside what a user would deploy instead.

One table per run: FP32 and every recipe that ran (``results["recipes"]``, with its generation
agreement and batch-1 CPU decode speed from ``results["generation"]`` and its file size), each
split deployment (``--prefill-recipe``: the worse of its two graphs' accuracy) and one-row
deployment (``P+one-row``: P's accuracy), then each
format of each other engine (``results["engines"]``, read through ``results.engine_rows``: made
from the same checkpoint, scored on the same windows against the same FP32 baseline, with the same
threads). Whether a row meets the accuracy goal is the run's own acceptance policy
(``verdict.run_policy``, judged by ``Policy.accuracy_failures``, as the verdict, the search and the
gate judge).

Below the table, the two picks a user asks for: the most accurate row at FP32's generation speed
or faster, and the fastest row within the accuracy goal; then the Pareto front (lower KL, more
generation tokens/s) and the rows an engine could not measure, with why. The plot
(``plots/engines.png``) draws the same points. A run without the engines section gets no lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .. import results as results_file
from ..measure.sessions import CPU
from ..policy import ACCURACY_LIMITS, Policy
from ..runs import PLOTS_DIR
from .markdown import fmt, pct, table
from .plots import plot_accuracy_speed
from .verdict import run_policy

QUANTNORM = "quantnorm"
PLOT_FILE = "engines.png"
PLOT_TITLE = "KL mean against generation tokens/s"


@dataclass(frozen=True)
class Row:
    """One line of the table: a quantnorm model (FP32 or a recipe) or one engine format."""

    engine: str
    version: str | None
    format: str
    status: str
    accuracy: dict
    agreement: float | None = None
    prompt_tok_s: float | None = None
    gen_tok_s: float | None = None
    size_bytes: int | None = None
    reference: bool = False   # quantnorm's FP32: the baseline every row is scored against
    # what one generation step reads whole: a with-past graph's step profile's weight bytes; an
    # engine's file (llama.cpp's tied head reads the token table whole); None when not known
    step_bytes: int | None = None

    @property
    def streamed_gb_s(self) -> float | None:
        """The rate a generation step reads its weights at: step bytes x generation tokens/s."""
        return self.step_bytes * self.gen_tok_s / 1e9 if self.step_bytes and self.gen_tok_s else None

    @property
    def ok(self) -> bool:
        return self.status == results_file.OK

    @property
    def label(self) -> str:
        return self.format if self.engine == QUANTNORM else f"{self.engine} {self.format}"

    @property
    def kld(self) -> float | None:
        value = self.accuracy.get("kld_mean")
        return float(value) if _finite(value) else None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _decode_b1(results: dict, name: str) -> dict:
    """The model's measured CPU decode row at batch 1 ({} when there is none)."""
    model = results_file.generation_model(results, name)
    rows = [r for r in (model.decode if model else []) if r.get("provider") == CPU and r.get("batch") == 1
            and r.get("status") == results_file.MEASURED]
    return rows[-1] if rows else {}


def _step_bytes(decode: dict) -> int | None:
    return (decode.get("step_profile") or {}).get("weight_bytes")


def quantnorm_rows(results: dict) -> list[Row]:
    """FP32, then each recipe that ran, in the run's order."""
    fp32 = _decode_b1(results, results_file.FP32_VARIANT)
    rows = [Row(QUANTNORM, None, results_file.FP32_VARIANT, results_file.OK,
                {"ppl_ratio": 1.0, "kld_mean": 0.0, "top1_agreement": 1.0}, None, fp32.get("prompt_tokens_per_s"),
                fp32.get("gen_tokens_per_s"), results_file.file_size(results, results_file.FP32_VARIANT),
                reference=True, step_bytes=_step_bytes(fp32))]
    for r in results_file.recipes(results):
        if not r.ok or not r.accuracy:
            continue
        gen = results_file.generation_model(results, r.name)
        agreement = (gen.agreement or {}).get("identical_before_divergence") if gen else None
        decode = _decode_b1(results, r.name)
        rows.append(Row(QUANTNORM, None, r.name, r.status, r.accuracy, agreement, decode.get("prompt_tokens_per_s"),
                        decode.get("gen_tokens_per_s"), results_file.file_size(results, r.name),
                        step_bytes=_step_bytes(decode)))
    return rows + _split_rows(results, {r.format: r for r in rows})


def _split_rows(results: dict, by_name: dict[str, Row]) -> list[Row]:
    """A row per ok deployment of two graphs: a split (``--prefill-recipe``) with its two graphs'
    whole-window accuracy, each metric the worse of the two (its tokens come from both); a
    ``P+one-row`` with P's (the one-row rounding is scored through the cache: cache check,
    agreement). Both files' size, its own agreement and speed."""
    rows = []
    for m in results_file.generation_models(results):
        accuracy = _deployment_accuracy(m.entry, by_name) if m.ok else None
        if accuracy is None:
            continue
        decode = _decode_b1(results, m.name)
        rows.append(Row(QUANTNORM, None, m.name, m.status, accuracy, (m.agreement or {}).get("identical_before_divergence"),
                        decode.get("prompt_tokens_per_s"), decode.get("gen_tokens_per_s"), m.entry.get("size_bytes"),
                        step_bytes=_step_bytes(decode)))
    return rows


def _deployment_accuracy(entry: dict, by_name: dict[str, Row]) -> dict | None:
    """The whole-window accuracy a split or one-row deployment is scored with (see ``_split_rows``);
    None for any other entry, or one whose recipes the run lacks."""
    one_row, pair = entry.get("one_row"), entry.get("split")
    if isinstance(one_row, dict):
        return by_name[one_row["recipe"]].accuracy if one_row.get("recipe") in by_name else None
    if not isinstance(pair, dict) or not {pair.get("tokens"), pair.get("prompt")} <= set(by_name):
        return None
    a, b = by_name[pair["tokens"]].accuracy, by_name[pair["prompt"]].accuracy
    return {metric: (min if op == ">=" else max)(a[metric], b[metric]) for _, metric, op in ACCURACY_LIMITS
            if _finite(a.get(metric)) and _finite(b.get(metric))}


def engine_rows(results: dict) -> list[Row]:
    out = []
    for e in results_file.engine_rows(results):
        speed, agreement = e.get("speed") or {}, e.get("agreement") or {}
        out.append(Row(str(e.get("engine")), e.get("version"), str(e.get("format")), str(e.get("status")),
                       e.get("accuracy") or {}, agreement.get("identical_before_divergence"),
                       speed.get("prompt_tok_s"), speed.get("gen_tok_s"), e.get("size_bytes"),
                       step_bytes=e.get("size_bytes")))
    return out


def meets_goal(row: Row, policy: Policy) -> bool:
    return row.ok and bool(row.accuracy) and policy.accepts_accuracy(row.accuracy)


def pareto_front(rows: list[Row]) -> list[Row]:
    """The rows no other row beats on both lower KL and more generation tokens/s (FP32, the
    reference, left out: it defines KL 0), from the fastest to the most accurate."""
    candidates = [r for r in rows if r.ok and not r.reference and r.kld is not None and _finite(r.gen_tok_s)]
    front: list[Row] = []
    for r in sorted(candidates, key=lambda r: (-r.gen_tok_s, r.kld)):
        if not front or r.kld < front[-1].kld:
            front.append(r)
    return front


def most_accurate_at_speed(rows: list[Row], floor: float | None) -> Row | None:
    """The lowest KL among the rows (FP32 left out) whose generation tokens/s reach ``floor``."""
    if floor is None:
        return None
    fast = [r for r in rows if r.ok and not r.reference and r.kld is not None and _finite(r.gen_tok_s)
            and r.gen_tok_s >= floor]
    return min(fast, key=lambda r: (r.kld, abs((r.accuracy.get("ppl_ratio") or 1.0) - 1.0)), default=None)


def fastest_within_goal(rows: list[Row], policy: Policy) -> Row | None:
    """The most generation tokens/s among the rows the policy accepts (FP32 included: when it is
    the answer, no quantized model is both faster and within the goal)."""
    good = [r for r in rows if meets_goal(r, policy) and _finite(r.gen_tok_s)]
    return max(good, key=lambda r: r.gen_tok_s, default=None)


def _goal_text(policy: Policy) -> str:
    parts = [f"{metric} {op} {getattr(policy, key):g}" for key, metric, op in ACCURACY_LIMITS
             if getattr(policy, key) is not None]
    return ", ".join(parts) or "no accuracy threshold"


def _size(size) -> str:
    return fmt(size / 1e6, ".2f", " MB") if _finite(size) else "–"


def _cells(row: Row, policy: Policy) -> list:
    engine = QUANTNORM if row.engine == QUANTNORM else f"{row.engine} {row.version or ''}".strip()
    a = row.accuracy
    if row.reference:
        goal = "reference"
    else:
        failures = policy.accuracy_failures(a)
        goal = "yes" if not failures else "no: " + "; ".join(failures)
    return [engine, f"`{row.format}`", fmt(a.get("ppl_ratio"), ".4f"), fmt(a.get("kld_mean"), ".4g"),
            pct(a.get("top1_agreement")), "reference" if row.reference else pct(row.agreement),
            fmt(row.prompt_tok_s, ",.0f"), fmt(row.gen_tok_s, ",.1f"), _size(row.size_bytes), goal]


def _numbers(row: Row) -> str:
    a = row.accuracy
    agreement = "" if row.reference else f"generation agreement {pct(row.agreement)}, "
    return (f"`{row.label}`: KL {fmt(a.get('kld_mean'), '.4g')}, PPL ratio {fmt(a.get('ppl_ratio'), '.4f')}, "
            f"top-1 {pct(a.get('top1_agreement'))}, {agreement}{fmt(row.gen_tok_s, ',.1f')} generation tok/s, "
            f"{fmt(row.prompt_tok_s, ',.0f')} prompt tok/s, {_size(row.size_bytes)}")


def _picks(rows: list[Row], policy: Policy) -> list[str]:
    fp32 = next(r for r in rows if r.reference)
    floor = fp32.gen_tok_s if _finite(fp32.gen_tok_s) else None
    accurate, fastest = most_accurate_at_speed(rows, floor), fastest_within_goal(rows, policy)
    if floor is None:
        first = "FP32's generation speed was not measured, so there is no speed floor."
    elif accurate is None:
        first = f"none: no model generates at FP32's {floor:,.1f} tok/s or faster."
    else:
        first = _numbers(accurate) + "."
    second = "none meets the goal." if fastest is None else _numbers(fastest) + (
        " (FP32 itself: no quantized model is both faster and within the goal)." if fastest.reference else ".")
    front = pareto_front(rows)
    return [f"- **Most accurate at FP32's generation speed or faster** (KL mean): {first}",
            f"- **Fastest within the accuracy goal** (generation tok/s): {second}",
            "- **Pareto front** (no other row has both a lower KL and more generation tok/s): "
            + (", ".join(f"`{r.label}`" for r in front) if front else "none (no row has both a KL and a speed)") + "."]


# issue goal against llama.cpp on the same CPU, threads and tokens (README, Other engines): at a KL no
# higher than Q8_0's, generation at least Q8_0's tokens/s and prompt at least twice its tokens/s
GOAL_GEN_VS_Q8 = 1.0
GOAL_PROMPT_VS_Q8 = 2.0


def _ratio_text(mine: float | None, theirs: float | None, goal: float | None = None) -> str:
    if not (_finite(mine) and _finite(theirs)) or not theirs:
        return "not measured"
    ratio = mine / theirs
    text = f"{mine:,.1f} against {theirs:,.1f} tok/s = {ratio:.2f}x"
    if goal is None:
        return text
    return text + (f" (goal {goal:g}x: met)" if ratio >= goal else
                   f" (goal {goal:g}x: missed by {100 * (1 - ratio / goal):.0f}%)")


@dataclass(frozen=True)
class VersusLlamaCpp:
    """quantnorm's best row at llama.cpp Q8_0's KL or lower (None: no recipe is as accurate): the one
    that meets the most speed goals (of one, the generation goal first), then the fastest generation; against Q8_0
    (and Q4_K_M when measured), as ratios of tokens/s measured in the same run."""

    q8: Row
    q4: Row | None
    ours: Row | None

    def ratio(self, other: Row | None, key: str) -> float | None:
        mine, theirs = (getattr(self.ours, key) if self.ours else None), (getattr(other, key) if other else None)
        return mine / theirs if _finite(mine) and _finite(theirs) and theirs else None

    @property
    def gen_met(self) -> bool:
        ratio = self.ratio(self.q8, "gen_tok_s")
        return ratio is not None and ratio >= GOAL_GEN_VS_Q8

    @property
    def prompt_met(self) -> bool:
        ratio = self.ratio(self.q8, "prompt_tok_s")
        return ratio is not None and ratio >= GOAL_PROMPT_VS_Q8


def versus_llamacpp(rows: list[Row]) -> VersusLlamaCpp | None:
    """None without a measured llama.cpp Q8_0 row with a KL."""
    by_format = {r.format: r for r in rows if r.engine == "llamacpp" and r.ok}
    q8 = by_format.get("Q8_0")
    if q8 is None or q8.kld is None:
        return None
    ours = [r for r in rows if r.engine == QUANTNORM and not r.reference and r.ok and r.kld is not None
            and r.kld <= q8.kld and _finite(r.gen_tok_s)]
    q4 = by_format.get("Q4_K_M")
    # the row that meets the most goals (the generation goal first among rows meeting one), then the fastest
    versus = [VersusLlamaCpp(q8, q4, r) for r in ours]
    return max(versus, key=lambda v: (v.gen_met + v.prompt_met, v.gen_met, v.ours.gen_tok_s),
               default=VersusLlamaCpp(q8, q4, None))


def llamacpp_goal(rows: list[Row]) -> list[str]:
    """The lines of :func:`versus_llamacpp`; [] without a measured Q8_0 row."""
    v = versus_llamacpp(rows)
    if v is None:
        return []
    if v.ours is None:
        return [f"- **Against llama.cpp Q8_0** (KL {v.q8.kld:.4f}): no quantnorm recipe in this run is as accurate."]
    best, q8, q4 = v.ours, v.q8, v.q4
    L = [f"- **Against llama.cpp Q8_0**, same CPU, threads and tokens, in this run: `{best.format}` (of the quantnorm "
         f"rows at Q8_0's KL or lower, the one meeting the most goals, then the fastest: {best.kld:.4f} against {q8.kld:.4f}): generation "
         f"{_ratio_text(best.gen_tok_s, q8.gen_tok_s, GOAL_GEN_VS_Q8)}; prompt "
         f"{_ratio_text(best.prompt_tok_s, q8.prompt_tok_s, GOAL_PROMPT_VS_Q8)}."]
    if q4 is not None:
        L.append(f"- **Against llama.cpp Q4_K_M** (KL {fmt(q4.kld, '.4f')}): generation "
                 f"{_ratio_text(best.gen_tok_s, q4.gen_tok_s)}; prompt {_ratio_text(best.prompt_tok_s, q4.prompt_tok_s)}.")
    return L


def plot_points(rows: list[Row]) -> list[tuple[str, str, float, float]]:
    """(label, group, generation tok/s, KL) of each row the plot draws: every scored row with a speed
    but FP32 (its KL is 0 on a log axis; its speed is the vertical line)."""
    return [(r.label, r.engine, float(r.gen_tok_s), r.kld) for r in rows
            if r.ok and not r.reference and r.kld is not None and _finite(r.gen_tok_s)]


def engines(results: dict) -> list[str]:
    """``## Other engines``: the table, the picks, what was not measured, the plot's link."""
    section = results_file.section(results, "engines")
    if section is None:
        return []
    L = ["", "## Other engines, same checkpoint", ""]
    others = engine_rows(results)
    if section.get("status") != results_file.OK and not others:
        return L + [f"Other engines: {section.get('status')}.", ""]
    policy, where = run_policy(results)
    rows = quantnorm_rows(results) + [r for r in others if r.ok]
    L += ["What a user would deploy instead, beside quantnorm's own models: each engine's formats made from "
          "the same checkpoint, scored on the same token windows against the same FP32 baseline by quantnorm's "
          "metrics, with the same threads. Generation agreement: the share of greedy tokens identical to FP32's "
          "before the first that differs. Speed: one prompt at once, then one token per step, batch 1 on the "
          f"CPU. Accuracy goal ({where} policy): {_goal_text(policy)}.", "",
          *table(["engine", "format or recipe", "PPL ratio", "KL mean", "top-1", "generation agreement",
                  "prompt tok/s", "generation tok/s", "size", "meets the goal"], [_cells(r, policy) for r in rows]),
          "", *_picks(rows, policy), *llamacpp_goal(rows), ""]
    missing = [r for r in others if not r.ok]
    if missing:
        L += ["Not measured or broken:", ""] + [f"- `{r.label}`: {r.status}" for r in missing] + [""]
    settings = _settings_rows(results)
    if settings:
        L += ["Engine settings:", ""] + [f"- `{r.label}` ({r.engine} {r.version}): {_settings(e)}"
                                         for r, e in settings] + [""]
    if plot_points(rows):
        L += [f"Plot: [{PLOT_TITLE}]({PLOTS_DIR}/{PLOT_FILE}).", ""]
    return L


def _settings_rows(results: dict) -> list[tuple[Row, dict]]:
    return [(row, e.get("settings") or {}) for row, e in zip(engine_rows(results), results_file.engine_rows(results))
            if row.ok]


def _settings(settings: dict) -> str:
    return ", ".join(f"{k} `{v}`" for k, v in settings.items()) or "none recorded"


def plot(run_dir: Path, results: dict, out_dir: Path) -> dict[str, str]:
    """The KL-against-speed plot: {title: relative path}, or {} for a run without engines."""
    if results_file.section(results, "engines") is None:
        return {}
    rows = quantnorm_rows(results) + [r for r in engine_rows(results) if r.ok]
    points = plot_points(rows)
    if not points:
        return {}
    policy, _ = run_policy(results)
    fp32 = rows[0].gen_tok_s
    path = plot_accuracy_speed(points, [r.label for r in pareto_front(rows)], out_dir / PLOT_FILE,
                               f"{PLOT_TITLE} (batch 1, CPU)", goal_kld=policy.max_kld,
                               fp32_tok_s=fp32 if _finite(fp32) else None)
    return {PLOT_TITLE: str(path.relative_to(run_dir))}
