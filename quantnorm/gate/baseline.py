"""The gate against a baseline: a candidate run's numbers compared with a baseline run's of the same
model (``quantnorm gate CANDIDATE --baseline BASELINE``), recipe by recipe.

A regression beyond the policy's tolerances (``[gate.baseline]``, quantnorm.policy.BaselinePolicy)
fails: the PPL ratio, the KL mean, the top-1 agreement, the generation agreement (when both runs
measured it), the model file's size; latency by the noise rule (quantnorm.gate.noise). A number
fails only when it moved the wrong way by more than both its absolute and its relative tolerance
(for an agreement the relative one is of its disagreement), so a KL that doubled fails even while it
stays under the policy's threshold.

Recipes: each recipe the baseline evaluated (or, with ``recipes = [...]``, each listed one) is
compared. One the candidate lacks, or that was ok and is now broken, fails; one broken in both is
skipped; a recipe only the candidate has is listed as new.

Refused (GateError, exit 2, never a pass): a baseline of another model (architecture, placement,
norm, sizes, parameter count or source kind differ), of another results schema_version, a baseline
without recipes. The inputs module refuses the same file given as both.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..policy import BASELINE_CHECKS, Policy, Tolerance
from ..results import OK, Recipe, generation_model, recipes, source_kind
from .noise import latency_changes
from .verdict import FAIL, NEW, PASS, SKIPPED, BaselineVerdict, Change, GateError

# model keys that say which model a run is: a baseline that differs in one is another model
IDENTITY_KEYS = ("architecture", "kind", "placement", "norm", "n_layers", "d_model", "n_heads", "vocab_size",
                 "n_params")
# generation.models[].agreement's share of greedy tokens identical to FP32's before the first
# divergence (what the policy's min_gen_agreement checks)
GENERATION_AGREEMENT_KEY = "identical_before_divergence"
_AGREEMENTS = ("top1_agreement", "generation_agreement")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def model_identity(results: dict) -> dict[str, Any]:
    """The run's model as the gate pairs runs: its source kind and IDENTITY_KEYS of ``model``."""
    model = results.get("model") if isinstance(results.get("model"), dict) else {}
    return {"source": source_kind(results), **{k: model[k] for k in IDENTITY_KEYS if k in model}}


def pairing_key(results: dict) -> str:
    """The model and, for a model trained here, how it was trained (seed, steps, ...): what pairs a
    sweep's cells with the baseline sweep's."""
    train = results.get("train") if isinstance(results.get("train"), dict) else {}
    config = train.get("config") if isinstance(train.get("config"), dict) else {}
    return json.dumps({**model_identity(results), "train": config}, sort_keys=True, default=str)


def check_comparable(baseline: dict, candidate: dict, base_src: str, cand_src: str) -> None:
    """GateError (exit 2) unless the two runs can be compared: one results schema, one model, a
    baseline that evaluated at least one recipe."""
    vb, vc = baseline.get("schema_version"), candidate.get("schema_version")
    if vb != vc:
        raise GateError(f"baseline {base_src} is results schema {vb}, candidate {cand_src} schema {vc}: "
                        f"re-evaluate the baseline with the candidate's quantnorm")
    ib, ic = model_identity(baseline), model_identity(candidate)
    differ = [f"{k} {ib.get(k)!r} vs {ic.get(k)!r}" for k in dict.fromkeys([*ib, *ic])
              if k in ib and k in ic and ib[k] != ic[k]]
    if differ:
        raise GateError(f"baseline {base_src} is another model than candidate {cand_src} "
                        f"({'; '.join(differ)}): give a baseline run of the same model")
    if not recipes(baseline):
        raise GateError(f"baseline {base_src} lists no recipe: there is nothing to compare the candidate with")


def _agreement_value(results: dict, recipe: Recipe, metric: str) -> Any:
    if metric != "generation_agreement":
        return recipe.metric(metric)
    model = generation_model(results, recipe.name)
    agreement = model.agreement if model is not None and isinstance(model.agreement, dict) else {}
    return agreement.get(GENERATION_AGREEMENT_KEY)


def _size(results: dict, recipe: Recipe) -> Any:
    size = recipe.entry.get("size_bytes")
    if _number(size):
        return size
    sizes = results.get("file_sizes_bytes")
    return sizes.get(recipe.name) if isinstance(sizes, dict) else None


def _value(results: dict, recipe: Recipe, metric: str) -> Any:
    return _size(results, recipe) if metric == "size_bytes" else _agreement_value(results, recipe, metric)


def compare_number(recipe: str, metric: str, base: float, cand: float, tol: Tolerance) -> Change:
    """One number by its two tolerances: the change the wrong way fails when beyond both ``abs`` and
    ``rel`` x the baseline's value (of its disagreement, 1 - value, for an agreement)."""
    worse_when_higher = BASELINE_CHECKS[metric][1] == "higher"
    delta = cand - base
    worsening = delta if worse_when_higher else -delta
    agreement = metric in _AGREEMENTS
    ref = (1.0 - base) if agreement else abs(base)
    limit = f"+{tol.abs:g} and +{tol.rel * 100:g}%" + (" of the disagreement" if agreement else "")
    if metric == "size_bytes":
        change = f"{delta:+,.0f} B"
    else:
        change = f"{delta:+.4g}"
    if ref > 0:
        rel = (1.0 - cand) / ref - 1.0 if agreement else delta / ref
        change += f" ({'disagreement ' if agreement else ''}{rel * 100:+.3g}%)"
    failed = worsening > tol.abs and worsening > tol.rel * ref
    reason = f"worse by {worsening:.4g}: beyond both tolerances" if failed else ""
    return Change(recipe, metric, float(base), float(cand), change, limit, FAIL if failed else PASS, reason)


def _number_changes(baseline: dict, candidate: dict, rb: Recipe, rc: Recipe, policy: Policy) -> list[Change]:
    out = []
    for metric in BASELINE_CHECKS:
        if metric == "latency":
            continue
        tol = policy.baseline.tolerance(metric)
        b, c = _value(baseline, rb, metric), _value(candidate, rc, metric)
        limit = f"+{tol.abs:g} and +{tol.rel * 100:g}%"
        if not _number(b):
            # a number neither run has (an encoder's PPL ratio) is not a row, except the one that
            # says generation was not compared
            if _number(c) or metric == "generation_agreement":
                note = "the baseline has no such number" if _number(c) else "neither run measured it"
                out.append(Change(rb.name, metric, None, c if _number(c) else None, "–", limit, SKIPPED, note))
            continue
        if not _number(c):
            out.append(Change(rb.name, metric, float(b), None, "–", limit, FAIL,
                              "missing: the baseline measured it, the candidate did not"))
            continue
        out.append(compare_number(rb.name, metric, b, c, tol))
    return out


def _recipe_changes(baseline: dict, candidate: dict, name: str, policy: Policy) -> list[Change]:
    """One recipe of the baseline: dropped, now broken, broken in both, or compared number by number."""
    rb = next(r for r in recipes(baseline) if r.name == name)
    rc = next((r for r in recipes(candidate) if r.name == name), None)
    if rc is None:
        return [Change(name, "recipe", None, None, "dropped", "present", FAIL,
                       "the baseline evaluated this recipe; the candidate does not have it")]
    if not rb.ok:
        verdict, note = (PASS, f"fixed: the baseline's was {rb.status}") if rc.ok else \
            (SKIPPED, f"not usable in either run (baseline {rb.status}; candidate {rc.status})")
        return [Change(name, "status", None, None, f"{rb.status} -> {rc.status}", OK, verdict, note)]
    if not rc.ok:
        return [Change(name, "status", None, None, f"{OK} -> {rc.status}", OK, FAIL,
                       f"now {rc.status} (ok in the baseline)")]
    return _number_changes(baseline, candidate, rb, rc, policy)


def compare_runs(baseline: dict, candidate: dict, policy: Policy, base_src: str = "baseline",
                 cand_src: str = "candidate") -> BaselineVerdict:
    """The candidate against the baseline under ``policy``; GateError when they cannot be compared."""
    check_comparable(baseline, candidate, base_src, cand_src)
    base_names = [r.name for r in recipes(baseline)]
    cand_names = [r.name for r in recipes(candidate)]
    if policy.recipes:
        compared = [n for n in policy.recipes if n in base_names]
        changes = [Change(n, "recipe", None, None, "–", "in the baseline", SKIPPED,
                          "listed by the policy but not in the baseline: nothing to compare")
                   for n in policy.recipes if n not in base_names]
    else:
        compared, changes = base_names, []
    for name in compared:
        changes += _recipe_changes(baseline, candidate, name, policy)
    for name in cand_names:
        if name not in base_names:
            changes.append(Change(name, "recipe", None, None, "new", "–", NEW, "new recipe: not in the baseline"))
    # latency of the recipes usable in both runs (a dropped or broken one has already failed above)
    usable = {r.name for r in recipes(candidate) if r.ok} & {r.name for r in recipes(baseline) if r.ok}
    changes += latency_changes(baseline, candidate, [n for n in compared if n in usable], policy)
    return BaselineVerdict(candidate=cand_src, baseline=base_src, changes=tuple(changes))


def unpaired(source: str, side: str) -> BaselineVerdict:
    """A run of one side of two sweeps with no run of the same model on the other side: a baseline
    run the candidate lacks fails; a candidate run the baseline lacks is listed."""
    if side == "baseline":
        change = Change(None, "run", None, None, "dropped", "present", FAIL,
                        "the baseline has a run of this model; the candidate has none")
        return BaselineVerdict(candidate="(none)", baseline=source, changes=(change,))
    change = Change(None, "run", None, None, "new", "–", NEW, "new run: the baseline has no run of this model")
    return BaselineVerdict(candidate=source, baseline="(none)", changes=(change,))
