"""The findings of a sweep: each claim of the literature (shared CLAIMS.md) as a function that
tests it on the sweep's cells, the table of those functions (:data:`CLAIMS`), and the findings
section and findings.json that present them.

The claim functions live by subject: ``claims_training`` (1, 2, 6, 8, 9, 12),
``claims_activations`` (3, 4, 5, 7, 10, 11, 13) and ``claims_generation`` (14, 15); what they are
built from is ``evidence``.

A claim function takes the trained view of the sweep (every effect is computed on trained cells
only) and the whole sweep (to say which arm of the design collapsed or diverged), splits the
claim into sub-tests over seeds (quantnorm.report.stats) and returns a :class:`Finding` with its
verdict. Tuning (best warm-up, best learning rate) chooses on the other seeds and measures on the
held-out one (:func:`held_out_best`), so the comparison is not biased by the choice.
"""

from __future__ import annotations

from collections.abc import Callable

from .claims_activations import (
    claim_collapse,
    claim_layer_friendlier,
    claim_massive,
    claim_outliers_predict,
    claim_perturbation,
    claim_residual_growth,
    claim_rotation,
    depth_exponent,
    depth_shape,
    log_reference_exponent,
)
from .claims_generation import claim_kl_predicts, claim_level4
from .claims_training import (
    claim_deepnorm,
    claim_grad_at_init,
    claim_peri_vs_pre,
    claim_post_best,
    claim_rms_speed,
    claim_warmup,
)
from .evidence import Finding, held_out_best, paired, strata
from .markdown import table
from .stats import estimate
from .sweep import Sweep, placements_in

__all__ = [
    "CLAIMS", "CLAIM_PLOTS", "FINDINGS_FILE", "FINDINGS_JSON", "Finding", "depth_exponent", "depth_shape",
    "findings", "findings_data", "findings_section", "held_out_best", "log_reference_exponent", "paired",
    "tuned_comparison",
]

FINDINGS_FILE = "findings.md"
FINDINGS_JSON = "findings.json"
# The claims in CLAIMS.md's order: each takes (trained view, whole sweep) and returns its Finding.
CLAIMS: tuple[Callable[[Sweep, Sweep], Finding], ...] = (
    claim_warmup,
    claim_grad_at_init,
    claim_perturbation,
    claim_residual_growth,
    claim_massive,
    claim_peri_vs_pre,
    claim_collapse,
    claim_deepnorm,
    claim_rms_speed,
    claim_layer_friendlier,
    claim_outliers_predict,
    claim_post_best,
    claim_rotation,
    claim_level4,
    claim_kl_predicts,
)


def findings(sweep: Sweep) -> list[Finding]:
    """The findings of every claim in :data:`CLAIMS`. Effects are computed on the trained cells only;
    the claims that read training outcomes (1, 8) also see the collapsed and diverged cells to say
    which arm failed."""
    trained = sweep.trained_view()
    return [claim(trained, sweep) for claim in CLAIMS]


def tuned_comparison(sweep: Sweep) -> list[dict]:
    """Placements at their own best learning rate, per (norm, depth, warm-up): for each seed the rate
    is chosen on the other seeds and the held-out seed's bits/byte is kept (:func:`held_out_best`).
    Trained cells only (pass the trained view)."""
    out = []
    bpb = lambda c: c.bits_per_byte  # noqa: E731
    for norm, depth, warmup in strata(sweep.cells, "norm", "depth", "warmup"):
        rows = []
        for p in placements_in(sweep, sweep.select(norm=norm, depth=depth, warmup=warmup)):
            held, chosen, best, insample = held_out_best(sweep.select(placement=p, norm=norm, depth=depth,
                                                                      warmup=warmup), lambda c: c.lr, bpb)
            rows.append({"placement": p, "best_lr": best, "chosen": chosen, "held_out": held,
                         "held_out_est": estimate(held.values()), "in_sample_est": estimate(insample.values())})
        out.append({"norm": norm, "depth": depth, "warmup": warmup, "rows": rows})
    return out


# which plot of make_plots (by title) illustrates which claim
CLAIM_PLOTS = {3: ("Perturbation sensitivity per depth",), 4: ("Residual-stream RMS per layer",),
               7: ("Cosine similarity of block output and input",)}


def findings_section(sweep: Sweep, plots: dict[str, str] | None = None,
                     found: list[Finding] | None = None) -> list[str]:
    """The Markdown lines of the findings section (``## Findings``): which cells are left out, one
    subsection per claim, a summary line and the table of the verdicts. ``plots`` (title ->
    path relative to the sweep directory, as quantnorm.report.comparison.make_plots returns them)
    adds the pictures to the claims they illustrate."""
    found = found if found is not None else findings(sweep)
    for item in found:
        item.plots = {t: (plots or {})[t] for t in CLAIM_PLOTS.get(item.number, ()) if t in (plots or {})}
    bad = sweep.not_trained
    L = ["## Findings", "",
         "Each claim of the literature (shared CLAIMS.md) as measured by this sweep. The seed is the unit of "
         "replication: a claim is split into sub-tests, one per setting of the other axes (norm, depth, warm-up, "
         "learning rate) and per half of the claim; each sub-test's values are one per seed (paired on the seed where "
         "the design pairs the arms), with a 95% t-interval and a p-value over n = seeds. The p-values of one claim's "
         "sub-tests are corrected together with Holm's step-down method (family-wise error 5%); the intervals shown "
         "are uncorrected. A sub-test holds here when its Holm-corrected p is below 0.05 in the claimed direction, "
         "does not hold here when it is below 0.05 the other way, is not significant otherwise, and is not tested "
         "with one seed or without data. A claim holds when every tested sub-test holds, does not hold when any "
         "does not hold, and is not significant otherwise. Small models on a CPU need not reproduce what large "
         "models show.", "",
         (f"{len(bad)} of {len(sweep.cells)} cells did not train (margin {sweep.collapse_margin:g} bits/byte below "
          f"the unigram baseline) and are left out of every effect: " +
          ", ".join(f"`{c.name}` ({c.status})" for c in bad) + ".") if bad else
         f"All {len(sweep.cells)} cells trained (margin {sweep.collapse_margin:g} bits/byte below the unigram "
         f"baseline).", ""]
    for item in found:
        L += item.render()
    L += ["Summary: " + "; ".join(f"claim {x.number}: {x.verdict}" for x in found) + ".", ""]
    L += table(["#", "claim", "verdict", "why"],
                [[x.number, x.claim, f"**{x.verdict}**", x.why.replace("|", "/")] for x in found]) + [""]
    return L


def findings_data(sweep: Sweep, found: list[Finding]) -> dict:
    """The machine-readable findings (``findings.json``): status of every cell, every verdict and sub-test."""
    data = {
        "sweep": sweep.path.name,
        "collapse_margin": sweep.collapse_margin,
        "unigram_bits_per_byte": sorted({c.unigram for c in sweep.cells if c.unigram is not None}),
        "cells": {c.name: {"status": c.status, "eval_bits_per_byte": c.bits_per_byte,
                           "status_derived": c.status_derived}
                  for c in sorted(sweep.cells, key=lambda c: c.name)},
        "claims": [{"number": f.number, "claim": f.claim, "verdict": f.verdict, "why": f.why,
                    "tests": [t.to_dict() for t in f.tests]} for f in found],
    }
    t = sweep.trained_view()
    if len(t.lrs) > 1:
        data["tuned_learning_rate"] = [
            {**{k: b[k] for k in ("norm", "depth", "warmup")},
             "placements": [{"placement": r["placement"], "best_lr": r["best_lr"],
                             "chosen_lr": {str(s): v for s, v in sorted(r["chosen"].items())},
                             "held_out_bits_per_byte": r["held_out_est"].to_dict(),
                             "in_sample_bits_per_byte": r["in_sample_est"].to_dict()} for r in b["rows"]]}
            for b in tuned_comparison(t)]
    return data
