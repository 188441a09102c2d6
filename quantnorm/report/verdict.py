"""The verdict a run report opens with: the recipe to ship under the run's acceptance policy, or
why none passes and the command that would find one.

The policy is the one the run was held to (``results["policy"]``: the accuracy thresholds of
``evaluate``'s flags; a run written before it was recorded falls back to its search's targets,
then to the defaults of that time, ``policy.UNRECORDED_POLICY``), judged by ``Policy.accuracy_failures``: the same test the search
and ``quantnorm gate`` apply. Among the recipes that pass, the one to ship is the fastest on the
CPU (p50 against FP32's at the largest batch measured), as the search's default pick is.
"""

from __future__ import annotations

import re
from dataclasses import replace

from .. import results as results_file
from ..errors import QuantnormError
from ..policy import UNRECORDED_POLICY, Policy
from ..results import STATUS_TRAINED, status_from_results
from .markdown import pct

# results["policy"] keys and the search section's names for the same thresholds
_THRESHOLDS = ("max_ppl_ratio", "max_kld", "max_kld_p99", "min_top1")
_SEARCH_TARGETS = {"max_ppl_ratio": "target_max_ppl_ratio", "max_kld": "target_max_kld",
                   "min_top1": "target_min_top1"}


def run_policy(results: dict) -> tuple[Policy, str]:
    """The accuracy policy the run was held to, and where it was read from."""
    recorded = results_file.section(results, "policy")
    if isinstance(recorded, dict):
        return replace(UNRECORDED_POLICY, **{k: recorded.get(k) for k in _THRESHOLDS if k in recorded}), "the run's"
    search = results_file.section(results, "search")
    if isinstance(search, dict) and any(t in search for t in _SEARCH_TARGETS.values()):
        return replace(UNRECORDED_POLICY, **{k: search.get(t) for k, t in _SEARCH_TARGETS.items() if t in search}), \
            "the search's"
    return UNRECORDED_POLICY, "the default"


def _goals(policy: Policy) -> str:
    parts = [f"PPL ratio <= {policy.max_ppl_ratio:g}" if policy.max_ppl_ratio is not None else None,
             f"KL <= {policy.max_kld:g}" if policy.max_kld is not None else None,
             f"KL p99 <= {policy.max_kld_p99:g}" if policy.max_kld_p99 is not None else None,
             f"top-1 >= {pct(policy.min_top1)}" if policy.min_top1 is not None else None]
    return ", ".join(p for p in parts if p)


def _numbers(r: results_file.Recipe) -> str:
    return (f"PPL ratio {r.metric('ppl_ratio'):.4f}, KL {r.metric('kld_mean'):.4g}, "
            f"top-1 {pct(r.metric('top1_agreement'))}")


def _speed(results: dict, name: str) -> str:
    ratio, batch = results_file.p50_ratio(results, name)
    parts = [] if ratio is None else [f"{ratio:.2f}x FP32's CPU latency at batch {batch}"]
    gen = results_file.generation_model(results, name)
    agreement = (gen.entry.get("agreement") or {}).get("identical_before_divergence") if gen else None
    if agreement is not None:
        parts.append(f"{pct(agreement)} of greedy tokens identical to FP32's")
    return "; ".join(parts)


def next_command(results: dict) -> str:
    """The run's own command with ``--recipes auto`` (the accuracy-aware search) in place of its recipes."""
    command = results.get("command") or "quantnorm evaluate"
    if re.search(r"--recipes[ =]\S+", command):
        return re.sub(r"--recipes[ =]\S+", "--recipes auto", command)
    return f"{command} --recipes auto"


def _no_pass(results: dict, scored: list, policy: Policy) -> list[str]:
    closest = min(scored, key=lambda r: len(policy.accuracy_failures(r.accuracy)) * 1e9 + (r.metric("kld_mean") or 1e9))
    why = "; ".join(policy.accuracy_failures(closest.accuracy))
    lines = [f"**No INT8 recipe of this run meets the policy.** The closest, `{closest.name}` ({_numbers(closest)}), "
             f"fails: {why}."]
    massive = results_file.massive_count(results)
    if massive:
        lines.append(f"The probe found {massive} massive activation(s): per-tensor scales (static and dynamic "
                     "recipes) spend their 8 bits on them; per-token, rotated and GPTQ recipes are the ones that survive.")
    search = results_file.section(results, "search")
    if isinstance(search, dict) and search.get("trials"):
        lines.append(f"The accuracy-aware search tried {len(search['trials'])} candidates and none passed: widen its "
                     "space (`--search-space`; `quantnorm recipes` lists them) or loosen the goals.")
    else:
        lines.append(f"Next: `{next_command(results)}` "
                     "(the accuracy-aware search picks the fastest recipe that meets the policy).")
    return lines


def _recipe_choice(results: dict) -> list[str]:
    """Why this run quantized with the recipes it did, when the probe chose them."""
    choice = results_file.section(results, "recipe_choice")
    if not choice or not choice.get("massive_total"):
        return []
    names = ", ".join(f"`{n}`" for n in choice.get("recipes") or ())
    return [f"No `--recipes` named and the probe found {choice['massive_total']} massive activation(s) in the FP32 "
            f"model ({choice.get('probe_windows')} windows), so this run quantized with the recipes that survive "
            f"them ({names}) instead of the default set, whose per-tensor scales spend their 8 bits on those values.",
            ""]


def _encoder(results: dict, scored: list) -> list[str]:
    """An encoder is scored by embedding agreement, which the policy's language-model thresholds do
    not judge: the most faithful recipe, with its numbers, instead of a verdict."""
    best = max(scored, key=lambda r: r.metric("cosine_mean"))
    speed = _speed(results, best.name)
    nn = best.metric("nn_agreement")
    return ["No verdict: the acceptance policy's thresholds are language-model metrics (PPL ratio, KL, top-1), and "
            "this encoder is scored by embedding agreement.",
            f"Most faithful: `{best.name}`, cosine mean {best.metric('cosine_mean'):.4f}"
            + (f", nearest-neighbour agreement {pct(nn)}" if nn is not None else "") + (f"; {speed}" if speed else "") + "."]


def _untrained(results: dict) -> str | None:
    """Why a model trained here has no verdict (it did not learn), or None."""
    train = results.get("train")
    if not isinstance(train, dict) or train.get("pretrained") is True:
        return None
    try:
        status = status_from_results(train, results.get("data")).status
    except QuantnormError:
        return None   # the training status line says it is unknown; the recipes are still judged
    if status == STATUS_TRAINED:
        return None
    return (f"**No verdict: the model is {status}**: it did not learn, so its INT8 numbers say nothing about "
            "deployment (a collapsed model is not \"robust to INT8\"). Train it longer or at another learning rate.")


def verdict(results: dict) -> list[str]:
    """``## Verdict``: the recipe to ship, or why none passes and what to run next."""
    untrained = _untrained(results)
    if untrained:
        return ["## Verdict", "", untrained, ""]
    policy, where = run_policy(results)
    scored = [r for r in results_file.recipes(results) if r.ok and r.accuracy]
    L = ["## Verdict", "", f"Policy ({where}): {_goals(policy)}.", ""] + _recipe_choice(results)
    if not scored:
        return L + ["**No INT8 model was scored in this run**: every recipe is broken or not applicable "
                    "(the recipe table says why).", ""]
    if all(r.metric("kld_mean") is None and r.metric("cosine_mean") is not None for r in scored):
        return L[:2] + _encoder(results, scored) + [""]
    passing = [r for r in scored if policy.accepts_accuracy(r.accuracy)]
    if not passing:
        return L + _no_pass(results, scored, policy) + [""]

    def cost(r):
        ratio, _ = results_file.p50_ratio(results, r.name)
        return (ratio is None, ratio if ratio is not None else 0.0)

    ship = min(passing, key=cost)
    speed = _speed(results, ship.name)
    L.append(f"**Ship `{ship.name}`**: {_numbers(ship)}{'; ' + speed if speed else ''}.")
    others = [r.name for r in passing if r is not ship]
    if others:
        L.append(f"Also within the policy: {', '.join(f'`{n}`' for n in others)}.")
    return L + [""]
