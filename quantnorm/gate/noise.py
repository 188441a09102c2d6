"""Latency against a baseline, judged against its own noise, and whether two runs' timings can be
compared at all.

The noise rule: a latency regression (candidate p50 above the baseline's) fails only when it is
larger than the spread both runs measured, the baseline's p90 - p50 plus the candidate's (each
run's p50 may sit anywhere its own jitter puts it), and larger than the policy's latency tolerances
(``[gate.baseline] latency = { abs = ms, rel = share }``). Two evaluations of one model on one
machine differ in p50 by less than that, so they pass; a model slower by more than both runs'
jitter fails.

Timings from different hardware are not comparable: another CPU model, other ISA flags (VNNI or
AMX change which INT8 kernels run), another thread count, or (for a GPU provider) another GPU; and a
row the baseline measured that the candidate did not measure on that provider. Such a check is
"not comparable: why", neither pass nor fail, unless the policy requires the same hardware (then it
fails with the same reason).
"""

from __future__ import annotations

import math
from typing import Any

from ..measure.sessions import CPU, short_provider
from ..policy import Policy, Tolerance
from ..results import FP32_VARIANT, MEASURED, generation_model, latency_rows, section
from .verdict import FAIL, NOT_COMPARABLE, PASS, SKIPPED, Change


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flags(hardware: dict) -> set[str]:
    flags = hardware.get("cpu_flags")
    return {str(f) for f in flags} if isinstance(flags, list) else set()


def hardware_differences(baseline: dict, candidate: dict, provider: str) -> list[str]:
    """Why two runs' timings on ``provider`` cannot be compared ([] when they can): the CPU model (and
    family, where both record it), its ISA flags, the thread count, and for a GPU provider the GPU,
    each as recorded in ``hardware``."""
    hb, hc = section(baseline, "hardware"), section(candidate, "hardware")
    if hb is None or hc is None:
        return [f"the {'baseline' if hb is None else 'candidate'} records no hardware"]
    out = []
    if hb.get("cpu") != hc.get("cpu"):
        out.append(f"CPU differs ({hb.get('cpu')} vs {hc.get('cpu')})")
    elif hb.get("cpu_id") and hc.get("cpu_id") and hb["cpu_id"] != hc["cpu_id"]:
        # one model name, two generations (a cloud's "AMD EPYC"); runs older than the field compare by name
        out.append(f"CPU family differs ({hb['cpu_id']} vs {hc['cpu_id']})")
    fb, fc = _flags(hb), _flags(hc)
    if fb != fc:
        sides = [f"only the baseline has {', '.join(sorted(fb - fc))}" if fb - fc else "",
                 f"only the candidate has {', '.join(sorted(fc - fb))}" if fc - fb else ""]
        out.append(f"ISA flags differ ({'; '.join(s for s in sides if s)})")
    if hb.get("threads") != hc.get("threads"):
        out.append(f"threads differ ({hb.get('threads')} vs {hc.get('threads')})")
    if provider != CPU and hb.get("gpu") != hc.get("gpu"):
        out.append(f"GPU differs ({hb.get('gpu')} vs {hc.get('gpu')})")
    return out


def _row_label(kind: str, row: dict) -> str:
    per_token = " (per token)" if kind == "decode" else ""
    return f"{kind} {short_provider(str(row.get('provider')))} b={row.get('batch')}{per_token}"


def _not_comparable(recipe: str | None, label: str, b50: Any, why: str, policy: Policy, tol: str) -> Change:
    verdict = FAIL if policy.baseline.require_same_hardware else NOT_COMPARABLE
    note = f"not comparable: {why}" + ("; the policy requires the same hardware" if verdict == FAIL else "")
    return Change(recipe, label, b50 if _number(b50) else None, None, "–", tol, verdict, note)


# (p50, p90) keys of a prefill latency row and of a generation decode row (per generated token)
PREFILL_KEYS, DECODE_KEYS = ("p50_ms", "p90_ms"), ("token_ms_p50", "token_ms_p90")


def noise_change(recipe: str | None, label: str, base: dict, cand: dict, tol: Tolerance,
                 keys: tuple[str, str] = PREFILL_KEYS) -> Change:
    """One measured row of each run (same provider, variant, batch and lengths) by the noise rule:
    candidate p50 - baseline p50 fails when beyond max(noise, abs, rel x baseline p50), the noise
    being the two rows' p90 - p50 added. ``keys``: the rows' p50 and p90 fields."""
    k50, k90 = keys
    b50, c50 = base.get(k50), cand.get(k50)
    limit = f"noise, +{tol.abs:g} ms, +{tol.rel * 100:g}%"
    if not (_number(b50) and _number(c50)) or b50 <= 0:
        return Change(recipe, label, b50 if _number(b50) else None, c50 if _number(c50) else None, "–", limit,
                      SKIPPED, f"no {k50} on both sides")
    spreads = [r[k90] - r[k50] for r in (base, cand) if _number(r.get(k90))]
    if len(spreads) < 2:
        return Change(recipe, label, b50, c50, "–", limit, NOT_COMPARABLE,
                      f"not comparable: no {k90} on both sides to measure the noise with")
    noise = sum(max(0.0, spread) for spread in spreads)
    allowed = max(noise, tol.abs, tol.rel * b50)
    delta = c50 - b50
    change = f"{delta:+.3g} ms ({delta / b50:+.1%})"
    limit = f"noise {noise:.3g} ms, +{tol.abs:g} ms, +{tol.rel * 100:g}%"
    if delta > allowed:
        return Change(recipe, label, b50, c50, change, limit, FAIL,
                      f"{delta:.3g} ms slower: beyond the noise (both runs' p90 - p50: {noise:.3g} ms) and the tolerance")
    note = "within the noise" if delta > 0 else ""
    return Change(recipe, label, b50, c50, change, limit, PASS, note)


def _compare_rows(recipe: str | None, kind: str, base_rows: list[dict], cand_rows: list[dict],
                  baseline: dict, candidate: dict, policy: Policy) -> list[Change]:
    """Each measured baseline row against the candidate's row of the same key (a decode row: its
    per-token time; gen tokens/s is its inverse, so a slower generation fails here)."""
    keys50 = DECODE_KEYS if kind == "decode" else PREFILL_KEYS
    tol = policy.baseline.tolerance("latency")
    limit = f"noise, +{tol.abs:g} ms, +{tol.rel * 100:g}%"
    keys = ("provider", "variant", "batch", "seq", "prompt_tokens", "new_tokens")
    by_key = {tuple(r.get(k) for k in keys): r for r in cand_rows}
    out = []
    for row in base_rows:
        if row.get("status") != MEASURED:
            continue
        label = _row_label(kind, row)
        provider = str(row.get("provider"))
        why = hardware_differences(baseline, candidate, provider)
        other = by_key.get(tuple(row.get(k) for k in keys))
        if other is None or other.get("status") != MEASURED:
            status = "no such row" if other is None else other.get("status")
            why = [f"the candidate did not measure it on {short_provider(provider)} ({status})", *why]
        elif _number(row.get("threads")) and _number(other.get("threads")) and row["threads"] != other["threads"]:
            why.append(f"threads differ ({row['threads']} vs {other['threads']})")
        if why:
            out.append(_not_comparable(recipe, label, row.get(keys50[0]), "; ".join(why), policy, limit))
        else:
            out.append(noise_change(recipe, label, row, other, tol, keys50))
    return out


def latency_changes(baseline: dict, candidate: dict, recipes: list[str], policy: Policy) -> list[Change]:
    """Prefill latency rows of FP32 and of ``recipes`` (those both runs evaluated), then the
    generation section's decode rows where both runs have them."""
    out: list[Change] = []
    for variant in (FP32_VARIANT, *recipes):
        recipe = variant  # "fp32" for the FP32 model's rows
        base_rows = [r.row for r in latency_rows(baseline, variant=variant)]
        cand_rows = [r.row for r in latency_rows(candidate, variant=variant)]
        out += _compare_rows(recipe, "latency", base_rows, cand_rows, baseline, candidate, policy)
        gb, gc = generation_model(baseline, variant), generation_model(candidate, variant)
        if gb is not None and gc is not None and gb.decode:
            out += _compare_rows(recipe, "decode", gb.decode, gc.decode, baseline, candidate, policy)
    return out
