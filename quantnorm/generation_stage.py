"""The generation stage of ``evaluate``: every recipe as deployed to generate.

For a causal model source (``source.with_past(cfg)``; an encoder says why it has none):

1. the FP32 model exported with a KV cache (``quantnorm.generation.with_past``, parity against
   PyTorch's own cache fatal), and the cache proof on it: evaluation windows scored through the
   cache (prefill half, then a token at a time) against the whole-window FP32 graph;
2. each recipe that is ok in the run quantized again on the with-past graph, from the same
   transformed FP32 model (its rotated or smoothed with-past export) and the same calibration
   windows (fed as a prompt after an empty cache), the cache itself left float; a recipe that
   cannot apply says "not applicable: why", a broken one "broken: ..."; the cache proof is
   recorded for each (its graph through the cache against the same graph scored whole: exact for
   per-token and static recipes; per-tensor dynamic scales differ between a prompt and one row,
   so there it measures that difference);
   with ``--prefill-recipe P``, each weight-only recipe W is also deployed split (``split_entries``):
   the prompt through P's with-past graph, the new tokens through W's, one cache between them,
   an entry ``W+prefill-P`` with its own cache proof; each per-token recipe P is also deployed
   with its one-row token graph (``one_row_entries``, ``generation.one_row``): the prompts and any
   step of several rows through P's graph, a step of one row through the token graph, an entry
   ``P+one-row`` with its own cache proof; then the FP32 with-past graph's residual adds are fused
   with their norms, as the weight-only and one-row graphs' are (``_fuse_fp32_norms``), and its
   cache proof taken again;
3. decode speed (``generation.speed``) of FP32 and every ok recipe (and split pair), per provider and batch
   (at batch 1 with a profile of the one-token step: kernel time per op type, the weight bytes it reads), and
   generation agreement with FP32's greedy generations (``generation.agreement``).

The section it returns is ``results["generation"]`` (read back by ``results.generation_models``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

from .errors import ConfigError, ExportError, QuantnormError
from .fileio import release_memory
from .generation.agreement import agreement_prompts, fp32_continuation, generation_agreement
from .generation.decode import DecodeSession, check_cache
from .generation.one_row import write_one_row_graph
from .generation.qkv_packing import pack_products_file
from .generation.speed import PROFILED_STEPS, decode_lengths, decode_speed
from .measure.sessions import TENSORRT, SessionSpec, normalize_provider
from .quantize import GPTQCodes, PreprocessCache, quantize
from .runs import PAST_SUFFIX, past_file, past_onnx_file

CACHE_CHECK_WINDOWS = 4
CACHE_TOLERANCE = 1e-4
TENSORRT_NOTE = ("not measured: the decode loop runs on the CPU and CUDA providers (a TensorRT engine is built "
                 "for a range of shapes, and a growing cache passes through them all)")


def generation_section(source, cfg, *, run_dir: Path, fp32_path: Path, recipes: dict, int8_paths: dict[str, Path],
                       vnni: bool, stage: Callable, gptq_codes: GPTQCodes | None = None) -> dict:
    """``results["generation"]``. ``recipes``: name -> the Recipe each ok recipe of the run was
    quantized with (the search's pick under its ``auto:`` name); ``int8_paths``: their
    whole-window models (only their names are read: the with-past ones are quantized here);
    ``gptq_codes``: the GPTQ codes the whole-window recipes solved, read again here (same weights,
    same calibration windows) instead of solving them a second time."""
    try:
        past = source.with_past(cfg)
    except ConfigError as exc:
        return {"status": f"not applicable: {exc}"}
    data = source.data
    fp32_past = run_dir / past_onnx_file("fp32")
    with stage("generation:export"):
        try:
            exported = past.export(fp32_past)
        except ConfigError as exc:   # a cache this export cannot carry (linear attention, an old transformers)
            past.release()
            return {"status": f"not applicable: {exc}"}
    # The torch weights are let go until a transformed with-past export reloads them: the cache
    # proof and the quantizer of the plain graph read files (Gemma 3: 1.1 GB held for nothing).
    past.release()
    release_memory()
    max_length = DecodeSession(fp32_past, threads=cfg.threads, shared_cache=False).layout.max_length
    data = _within(data, max_length)
    prompt_tokens, new_tokens = decode_lengths(max_length, cfg.gen_prompt_tokens, cfg.gen_new_tokens)
    prompts, agreement_new = agreement_prompts(data.eval_inputs, max_length, n=cfg.agreement_prompts,
                                               new_tokens=cfg.agreement_new_tokens)
    with stage("generation:cache_check"):
        models = [{"name": "fp32", "status": "ok", "path": fp32_past.name, "size_bytes": fp32_past.stat().st_size,
                   "cache_check": _cache_check(fp32_past, data.eval_inputs, fp32_path, cfg)}]
    if not models[0]["cache_check"]["ok"]:
        raise ExportError(f"the with-past FP32 export fails the cache proof: NLL through the cache "
                          f"{models[0]['cache_check']['nll_cached']:.6g} vs whole windows "
                          f"{models[0]['cache_check']['nll_whole']:.6g} (relative tolerance {CACHE_TOLERANCE:g})")
    # One pre-processing of each with-past FP32 model, and one calibration per method, shared by
    # the recipes (as the whole-window recipes share theirs): each is tens of seconds on Gemma 3.
    # GPTQ codes come from the whole-window solve (the same weights on the same windows).
    with stage("generation:quantize"), PreprocessCache(gptq_codes) as preprocessed:
        models += [_quantize_past(past.variants, name, recipe, fp32_past, data, cfg, run_dir, vnni, preprocessed)
                   for name, recipe in recipes.items() if name in int8_paths]
    past.release()
    release_memory()
    with stage("generation:fp32_norms"):
        _fuse_fp32_norms(models[0], fp32_past, fp32_path, data.eval_inputs, cfg)
    with stage("generation:one_row"):
        models += one_row_entries(models, recipes, data.eval_inputs, cfg, run_dir)
    if cfg.gen_prefill_recipe is not None:
        with stage("generation:split"):
            models += split_entries(models, recipes, cfg.gen_prefill_recipe, data.eval_inputs, cfg, run_dir)
    with stage("generation:agreement"):
        reference = fp32_continuation(fp32_past, prompts, agreement_new, threads=cfg.threads)
        for entry in _bar(models[1:], "generation agreement", cfg):
            if entry["status"] == "ok":
                entry["agreement"] = generation_agreement(run_dir / entry["path"], reference, threads=cfg.threads,
                                                          prompt_path=_prompt_path(entry, run_dir))
    with stage("generation:decode"):
        timed_prompts = speed_prompts(data.eval_inputs, prompt_tokens, max(cfg.gen_batches))
        for entry in _bar(models, "decode speed", cfg):
            if entry["status"] == "ok":
                entry["decode"] = _decode_rows(run_dir / entry["path"], timed_prompts, new_tokens, cfg,
                                               _prompt_path(entry, run_dir))
    return {"status": "measured", "export": exported.to_dict(run_dir),
            "settings": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "batches": list(cfg.gen_batches),
                         "rounds": cfg.gen_rounds, "max_length": max_length,
                         "agreement_prompts": int(len(prompts)), "agreement_prompt_tokens": int(prompts.shape[1]),
                         "agreement_new_tokens": agreement_new, "cache": "float32, in ONNX Runtime between "
                         "steps (I/O binding; where only GroupQueryAttention reads and writes it, one buffer "
                         "the operator appends to in place, else a fresh present each step: each decode "
                         "row's cache says which)", "threads": cfg.threads},
            "models": models}


def _within(data, max_length: int | None) -> SimpleNamespace:
    """The evaluation and calibration windows cut to what the with-past graph is exact for (a
    sliding-window model states window - 1): its calibration and cache proof read no further."""
    cut = slice(None) if max_length is None else slice(0, max_length)
    return SimpleNamespace(eval_inputs=np.asarray(data.eval_inputs)[:, cut],
                           calib_inputs=np.asarray(data.calib_inputs)[:, cut])


def _bar(items: list, what: str, cfg):
    return tqdm(items, desc=what, unit="model", disable=not cfg.progress, leave=False)


def _cache_check(path: Path, eval_inputs: np.ndarray, whole: Path | None, cfg, prompt_model: Path | None = None) -> dict:
    """The cache proof on the first evaluation windows: prefill half (on ``prompt_model`` where a
    split deployment gives one), then one token at a time, against ``whole`` (the FP32
    whole-window graph) or, None, the same graph scored whole."""
    windows = np.asarray(eval_inputs)[:CACHE_CHECK_WINDOWS]
    return check_cache(path, windows, max(1, windows.shape[1] // 2), whole=whole, tolerance=CACHE_TOLERANCE,
                       threads=cfg.threads, prompt_model=prompt_model).to_dict()


def _quantize_past(variants, name: str, recipe, fp32_past: Path, data, cfg, run_dir: Path, vnni: bool,
                   preprocessed: PreprocessCache) -> dict:
    """One recipe on the with-past graph: ``generation.models`` entry (without speed and agreement)."""
    started = time.perf_counter()
    try:
        source_past = variants.fp32_for(recipe, fp32_past)
    except ConfigError as exc:
        return {"name": name, "status": f"not applicable: {exc}"}
    except QuantnormError as exc:   # a transformed with-past export that fails its parity gate
        return {"name": name, "status": f"broken: {' '.join(str(exc).split())[:300]}"}
    # diagnostics off: the entry records no settings
    q = quantize(source_past, recipe, data.calib_inputs, run_dir / past_onnx_file(name), vnni=vnni,
                 probe_inputs=data.eval_inputs[:2], diagnostics=False, preprocessed=preprocessed)
    release_memory()
    entry: dict = {"name": name, "status": q.status, "quantized_from": source_past.name,
                   "seconds": round(time.perf_counter() - started, 2)}
    if "matmuls" in q.settings.get("gptq", {}):   # per-token GPTQ (weight-only GPTQ is solved on this graph)
        entry["gptq"] = {"matmuls": q.settings["gptq"]["matmuls"],
                         "codes_reused": q.settings["gptq"].get("codes_reused", 0)}
    if q.status != "ok" or q.path is None:
        return {**entry, "problems": q.problems}
    # only weight-only and per-token graphs have products to pack: the others are not read back in
    # whole for nothing. A per-token graph's other shared inputs and its residual norms are fused
    # in its one-row graph, where they pay; a weight-only graph runs every step itself.
    weight_only = recipe.mode == "weight-only"
    packed = pack_products_file(q.path, shared=weight_only, residual_norms=weight_only) \
        if recipe.mode in ("weight-only", "pertoken") else {"qkv_layers": 0, "shared_groups": 0, "residual_norms": 0}
    entry["packed_qkv_layers"], entry["packed_shared_groups"] = packed["qkv_layers"], packed["shared_groups"]
    entry["fused_residual_norms"] = packed["residual_norms"]
    # the same graph scored whole: the cache's exactness, apart from what the recipe itself changes
    return {**entry, "path": q.path.name, "size_bytes": q.path.stat().st_size,
            "cache_check": _cache_check(q.path, data.eval_inputs, None, cfg)}


def _fuse_fp32_norms(entry: dict, fp32_past: Path, fp32_path: Path, eval_inputs: np.ndarray, cfg) -> None:
    """FP32's with-past graph as the INT8 graphs run theirs: each residual add fused with the RMSNorm
    that reads it, in place, once every recipe's quantizer has read the exported pattern (the rows
    against FP32 would otherwise compare a graph with some 2% more to do a step). The fused kernel
    is not bit for bit, so its cache proof is taken again on the graph as it now runs."""
    fused = pack_products_file(fp32_past, shared=False, residual_norms=True)["residual_norms"]
    entry["fused_residual_norms"] = fused
    if fused:
        entry.update(size_bytes=fp32_past.stat().st_size, cache_check=_cache_check(fp32_past, eval_inputs, fp32_path, cfg))
        if not entry["cache_check"]["ok"]:
            raise ExportError(f"the with-past FP32 graph with its {fused} residual norms fused fails the cache proof "
                              f"(relative NLL difference {entry['cache_check']['relative_diff']:.3g}, tolerance "
                              f"{CACHE_TOLERANCE:g}): the fusion (quantnorm.generation.residual_norms) is wrong here")


def split_name(tokens: str, prompt: str) -> str:
    """The name of a split deployment's row: the weight-only recipe that generates, and the prompt's."""
    return f"{tokens}+prefill-{prompt}"


def split_entries(models: list[dict], recipes: dict, prompt: str, eval_inputs: np.ndarray, cfg,
                  run_dir: Path) -> list[dict]:
    """A ``generation.models`` entry per weight-only recipe of the run, deployed split with the
    ``prompt`` recipe's graph running the prefill (``DecodeSession(prompt_model=...)``); its
    ``path`` is the token graph, ``prompt_path`` the prompt graph, ``size_bytes`` both files.
    A prompt recipe or weight-only recipe the run lacks gives an entry that says so."""
    by_name = {m["name"]: m for m in models}
    tokens = [name for name, recipe in recipes.items() if recipe.mode == "weight-only" and name in by_name]
    if not tokens:
        return [{"name": split_name("weight-only", prompt), "status": "not applicable: the run has no weight-only "
                 "recipe to generate with (add one to --recipes, e.g. rotated-wo-int8-b128-acc4-gptq)"}]
    first = by_name.get(prompt)
    if first is None or first["status"] != "ok":
        why = "is not among the run's recipes" if first is None else f"has no with-past graph ({first['status']})"
        return [{"name": split_name(name, prompt), "status": f"not applicable: the prompt recipe {prompt} {why}"}
                for name in tokens]
    out = []
    for name in tokens:
        entry = {"name": split_name(name, prompt), "split": {"tokens": name, "prompt": prompt}}
        second = by_name[name]
        if second["status"] != "ok":
            out.append({**entry, "status": f"not applicable: {name} has no with-past graph ({second['status']})"})
            continue
        if recipes[name].value_cache != recipes[prompt].value_cache:
            out.append({**entry, "status": f"not applicable: {name}'s cache holds {recipes[name].value_cache}, "
                        f"{prompt}'s {recipes[prompt].value_cache}: one cache cannot serve both graphs (generate "
                        f"with a block-rotated-wo-... recipe to pair it with {prompt})"})
            continue
        # the prefill on the prompt graph, then a token at a time on the token graph, against the
        # token graph's own whole windows: what writing the cache with the other graph costs
        check = _cache_check(run_dir / second["path"], eval_inputs, None, cfg, prompt_model=run_dir / first["path"])
        out.append({**entry, "status": "ok", "path": second["path"], "prompt_path": first["path"],
                    "size_bytes": second["size_bytes"] + first["size_bytes"], "cache_check": check})
    return out


ONE_ROW_SUFFIX = "+one-row"


def one_row_file(past_path: str) -> str:
    """The one-row token graph's file beside a with-past graph's: ``model.int8.X.past.onnx`` ->
    ``model.int8.X.one-row.past.onnx``."""
    return past_file(past_path.removesuffix(PAST_SUFFIX + ".onnx") + ".one-row.onnx")


def one_row_entries(models: list[dict], recipes: dict, eval_inputs: np.ndarray, cfg, run_dir: Path) -> list[dict]:
    """A ``generation.models`` entry ``P+one-row`` per per-token recipe P with a with-past graph:
    P deployed with its one-row token graph (``generation.one_row``); ``path`` is that graph,
    ``prompt_path`` P's, ``size_bytes`` both files, ``one_row`` the rewrite's counts and P."""
    out = []
    for entry in models:
        recipe = recipes.get(entry["name"])
        if recipe is None or recipe.mode != "pertoken" or entry["status"] != "ok":
            continue
        name = entry["name"] + ONE_ROW_SUFFIX
        path = run_dir / one_row_file(entry["path"])
        done = write_one_row_graph(run_dir / entry["path"], path)
        if not done["products"]:
            out.append({"name": name, "status": "not applicable: its with-past graph has no per-token product "
                        "with int8 weights and no weight zero point to rewrite (the unsigned 8-bit grid keeps "
                        "P's graph for every step)"})
            continue
        # the prompt on P's graph, each later token on the one-row graph, against P's graph scored
        # whole: what rounding one row P's way and ORT's way apart costs
        check = _cache_check(path, eval_inputs, None, cfg, prompt_model=run_dir / entry["path"])
        out.append({"name": name, "status": "ok", "path": path.name, "prompt_path": entry["path"],
                    "size_bytes": path.stat().st_size + entry["size_bytes"], "one_row": {"recipe": entry["name"], **done},
                    "cache_check": check})
    return out


def _prompt_path(entry: dict, run_dir: Path) -> Path | None:
    return run_dir / entry["prompt_path"] if entry.get("prompt_path") else None


def speed_prompts(eval_inputs: np.ndarray, prompt_tokens: int, batch: int) -> np.ndarray:
    """``batch`` prompts of ``prompt_tokens`` tokens: evaluation text, windows joined end to end
    when one window is shorter than the prompt, rows cycling through the windows."""
    tokens = np.asarray(eval_inputs, dtype=np.int64).reshape(-1)
    need = prompt_tokens * batch
    tokens = np.resize(tokens, max(need, tokens.size))
    return np.ascontiguousarray(tokens[:need].reshape(batch, prompt_tokens))


def _decode_rows(path: Path, prompts: np.ndarray, new_tokens: int, cfg, prompt_path: Path | None = None) -> list[dict]:
    rows = []
    for provider in cfg.provider_list():
        for batch in cfg.gen_batches:
            if normalize_provider(provider) == TENSORRT:
                rows.append({"provider": TENSORRT, "batch": batch, "status": TENSORRT_NOTE})
                continue
            spec = SessionSpec(provider=normalize_provider(provider), threads=cfg.threads,
                               graph_optimization_level=cfg.graph_optimization_level)
            # batch 1 also says where a step's time goes (the report's table of it)
            rows.append(decode_speed(path, prompts[:batch], new_tokens=new_tokens, spec=spec, rounds=cfg.gen_rounds,
                                     prompt_path=prompt_path, profile_steps=PROFILED_STEPS if batch == 1 else 0))
    return rows
