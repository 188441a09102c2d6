"""What ``quantnorm evaluate`` prints when it is done: one line per recipe, read off results.json."""

from __future__ import annotations

from pathlib import Path


def summary_lines(results: dict, run_dir: Path) -> str:
    lines = [f"{run_dir}: results.json and report.md written"]
    for r in results["recipes"]:
        a = r.get("accuracy")
        if a:
            lines.append(f"  {r['name']:<34} PPL ratio {a['ppl_ratio']:.4f}  KL mean {a['kld_mean']:.2e}  "
                         f"top-1 {100 * a['top1_agreement']:.2f}%")
        else:
            lines.append(f"  {r['name']:<34} {r['status']}")
    return "\n".join(lines)


def summary_lines_model(results: dict, run_dir: Path) -> str:
    m = results["model"]
    pc = m.get("placement_check", {})
    check = pc.get("label") or ("verified" if pc.get("verified") else "NOT verified")
    lines = [f"{run_dir}: results.json and report.md written",
             f"  {m['architecture']}: {m['placement']}/{m['norm']} ({check}), {m['n_params']:,} parameters"]
    for r in results["recipes"]:
        a = r.get("accuracy")
        if not a:
            lines.append(f"  {r['name']:<34} {r['status']}")
        elif "cosine_mean" in a:
            nn = a.get("nn_agreement")
            lines.append(f"  {r['name']:<34} cosine mean {a['cosine_mean']:.5f}  p1 {a['cosine_p1']:.5f}  "
                         f"NN agreement {'–' if nn is None else f'{100 * nn:.1f}%'}"
                         + (f"  MLM PPL ratio {a['ppl_ratio']:.4f}" if a.get("mlm") else ""))
        else:
            lines.append(f"  {r['name']:<34} PPL ratio {a['ppl_ratio']:.4f}  KL mean {a['kld_mean']:.2e}  "
                         f"top-1 {100 * a['top1_agreement']:.2f}% (token-level)")
    o = results.get("outliers")
    if o and o.get("summary", {}).get("largest_ratio"):
        lr = o["summary"]["largest_ratio"]
        lines.append(f"  largest residual max/median {lr['ratio']:.1f} at layer {lr['layer']}; massive entries: "
                     f"{o.get('massive_total', 0)}")
    return "\n".join(lines)
