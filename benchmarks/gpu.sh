#!/usr/bin/env bash
# GPU numbers in one command: installs the GPU libraries (from a folder of wheels or the
# registry), then runs the one pipeline, `quantnorm evaluate`, with the GPU providers: a small zoo
# model trained here, its FP32 export, the FP16 variant and INT8 recipes (the TensorRT-style
# signed symmetric one among them), accuracy against FP32 and latency on the CPU, CUDA and
# TensorRT providers, written to reports/gpu/ (results.json, report.md, plots/).
#
#   bash benchmarks/gpu.sh [--wheels DIR | --online | --no-install] [quantnorm evaluate flags...]
#   bash benchmarks/gpu.sh --download DIR [--python-version 3.11]   # on a machine with a registry
#
# --wheels DIR   install offline: pip install --no-index --find-links DIR (parts made by
#                --download, NAME.whl.part-aa ..., are joined and checked against NAME.whl.sha256)
# --online       install from the registry
# (neither)      install from the registry only when a GPU is visible and onnxruntime lacks the
#                CUDA provider; pip gives up after one try when there is no registry
# --no-install   never install; use what is importable
# --download DIR fill DIR with every wheel the GPU run needs (not torch: the GPU machine has one),
#                split those over 60 MiB into parts for transfers limited to 64 MiB, and exit
#                (GPU_DOWNLOAD=minimal: the onnxruntime-gpu and TensorRT wheels alone, no dependencies)
# --split DIR    only the splitting, for a folder filled by hand
#
# Any other flag goes to `quantnorm evaluate` after the defaults below (click keeps the last value
# of a flag, so `--steps 400` or `--out DIR` replace the default; `--model PATH` evaluates a real
# checkpoint with the same providers and variants).
#
# Only what is missing is installed, into .gpu-site/ (first on PYTHONPATH): the preinstalled
# PyTorch and CUDA libraries are reused, a preinstalled CPU onnxruntime is shadowed, not removed.
# A package that cannot be installed is reported and skipped: its provider's rows read
# "not measured: <why>", and the rest is still measured. Without a GPU every CUDA and TensorRT
# row says "not measured: no CUDA device" and the script exits 0.
set -uo pipefail
export PIP_ROOT_USER_ACTION=ignore  # root is the norm on GPU nodes; the target folder is ours

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SITE="$(realpath -m "${GPU_SITE:-$REPO/.gpu-site}")"
ORT_GPU="${ORT_GPU_SPEC:-onnxruntime-gpu[cuda,cudnn]==1.31.1}"
# ORT 1.31.1's TensorRT provider links libnvinfer.so.10 and libnvonnxparser.so.10 (readelf -d
# libonnxruntime_providers_tensorrt.so): TensorRT 10, not 11. The -libs wheel carries them; the
# `tensorrt-cu13` package is only a wrapper around it and the Python bindings, which ORT does not use.
TRT_PKGS=("${TRT_SPEC:-tensorrt-cu13-libs>=10.13,<11}")
# GPU_TENSORRT=0: neither download nor install TensorRT (its wheels are over a gigabyte); the
# TensorRT rows then read "not measured: <why>".
[[ "${GPU_TENSORRT:-1}" == 0 ]] && TRT_PKGS=()
# Transfers to the GPU machine are limited to 64 MiB per file: bigger wheels travel as parts.
PART_SIZE="${GPU_PART_SIZE:-60M}"
SPLIT_OVER="${GPU_SPLIT_OVER:-$((60 * 1024 * 1024))}"

# The run: 74 s on an H200 with 16 cores (2026-12-04; under 2 minutes on 2 CPU cores alone); 150 steps train
# a pre/rms model well below the unigram baseline, so its accuracy figures mean something.
EVALUATE_DEFAULTS=(--placement pre --norm rms --steps 150 --out reports/gpu
                   --recipes fp16,static-minmax-matmul-symact,dynamic --providers cpu,cuda,tensorrt
                   --batches 1,8,32 --iters 50)
mode=auto wheels="" download="" split_dir="" pyver="" args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) wheels="$(realpath -m "$2")"; mode=offline; shift 2 ;;
    --online) mode=online; shift ;;
    --no-install) mode=none; shift ;;
    --download) download="$(realpath -m "$2")"; shift 2 ;;
    --split) split_dir="$(realpath -m "$2")"; shift 2 ;;
    --python-version) pyver="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; echo
               echo "Defaults handed to quantnorm evaluate: ${EVALUATE_DEFAULTS[*]}"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done

# What quantnorm imports besides torch (preinstalled on the GPU machine; a registry would pull a
# multi-GB build) and onnxruntime (the GPU build comes next), with pyproject.toml's version ranges.
project_deps() {
  "$PY" - "$REPO/pyproject.toml" <<'EOF'
import re, sys
needed = {"onnx", "onnxscript", "numpy", "scipy", "click", "safetensors", "tqdm", "matplotlib",
          "neural-compressor", "py-cpuinfo", "psutil", "prettytable", "pydantic"}
text = open(sys.argv[1], encoding="utf-8").read()
block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
for spec in re.findall(r'"([^"]+)"', block):
    if re.split(r"[ <>=!~;\[]", spec, maxsplit=1)[0].lower() in needed:
        print(spec)
EOF
}

# NAME.whl (over SPLIT_OVER bytes) -> NAME.whl.sha256 + NAME.whl.part-aa, -ab, ...
split_big() {
  local whl
  for whl in "$1"/*.whl; do
    [[ -e "$whl" ]] || continue
    if [[ $(stat -c %s "$whl") -gt $SPLIT_OVER ]]; then
      (cd "$1" && sha256sum "$(basename "$whl")" > "$(basename "$whl").sha256") \
        && split -b "$PART_SIZE" "$whl" "$whl.part-" && rm "$whl"
    fi
  done
}

# NAME.whl.part-* -> NAME.whl, checked against NAME.whl.sha256 (removed when it does not match)
join_parts() {
  local first whl
  for first in "$1"/*.whl.part-aa; do
    [[ -e "$first" ]] || continue
    whl="${first%.part-aa}"
    [[ -f "$whl" ]] || { cat "$whl".part-* > "$whl.tmp" && mv "$whl.tmp" "$whl"; }
    if [[ -f "$whl.sha256" ]] && ! (cd "$1" && sha256sum -c --quiet "$(basename "$whl").sha256"); then
      echo "gpu.sh: $whl does not match its checksum (a part is missing or damaged); removing it" >&2
      rm -f "$whl"
    fi
  done
}

if [[ -n "$split_dir" ]]; then
  split_big "$split_dir"
  exit 0
fi

if [[ -n "$download" ]]; then
  mkdir -p "$download"
  plat=()
  if [[ -n "$pyver" ]]; then
    plat=(--python-version "$pyver" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --implementation cp)
  fi
  mapfile -t deps < <(project_deps)
  nodeps=()
  # GPU_DOWNLOAD=minimal: the named wheels alone, none of their dependencies, for a GPU machine
  # that has numpy, protobuf, onnx, CUDA 13 and cuDNN 9 already (a CUDA 13 PyTorch image does).
  [[ "${GPU_DOWNLOAD:-full}" == minimal ]] && { nodeps=(--no-deps); deps=(); }
  set -e
  "$PY" -m pip download --only-binary=:all: "${plat[@]}" "${nodeps[@]}" -d "$download" "$ORT_GPU"
  [[ ${#TRT_PKGS[@]} -eq 0 ]] \
    || "$PY" -m pip download --only-binary=:all: "${plat[@]}" "${nodeps[@]}" -d "$download" "${TRT_PKGS[@]}" \
    || echo "gpu.sh: TensorRT wheels not downloaded: the TensorRT rows will read not measured" >&2
  [[ ${#deps[@]} -eq 0 ]] || "$PY" -m pip download --only-binary=:all: "${plat[@]}" -d "$download" "${deps[@]}"
  set +e
  split_big "$download"
  echo "gpu.sh: $download holds $(ls "$download" | wc -l) files, $(du -sh "$download" | cut -f1); copy it to the GPU machine and run: bash benchmarks/gpu.sh --wheels DIR"
  exit 0
fi

gpu_visible() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; }
has_cuda_ep() {
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null
}

if [[ "$mode" == auto ]]; then
  if gpu_visible && ! has_cuda_ep; then mode=online; else mode=none; fi
fi

# Install what is missing into a target folder ($SITE) put first on PYTHONPATH: pip resolves
# against the interpreter's own packages (a dry run reports what is missing), and only that is
# installed, without dependencies. So the preinstalled PyTorch and CUDA libraries are reused, a
# preinstalled CPU onnxruntime is shadowed (not removed), and nothing outside $SITE changes;
# this works the same when python3 is itself a virtual environment.
missing() {
  "$PY" -m pip install -q --disable-pip-version-check "${PIP_SRC[@]}" --dry-run --report - "$@" | "$PY" -c '
import json, sys
for item in json.load(sys.stdin).get("install", []):
    meta = item["metadata"]
    print(meta["name"] + "==" + meta["version"])'
}
install_missing() {  # label, specs...
  local label="$1" need
  shift
  if ! need="$(PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" missing "$@")"; then
    failed+=("$label"); return
  fi
  [[ -z "$need" ]] && return
  mapfile -t need <<< "$need"
  "$PY" -m pip install -q --disable-pip-version-check "${PIP_SRC[@]}" --no-deps --upgrade --no-compile \
    --target "$SITE" "${need[@]}" || failed+=("$label")
}

failed=()
if [[ "$mode" != none ]]; then
  if [[ "$mode" == offline ]]; then
    [[ -d "$wheels" ]] || { echo "gpu.sh: --wheels $wheels is not a directory" >&2; exit 2; }
    join_parts "$wheels"
    PIP_SRC=(--no-index --find-links "$wheels")
  else
    PIP_SRC=(--retries 0 --timeout 15)
  fi
  mkdir -p "$SITE"
  # One package set at a time: what fails is named and skipped, the rest is still installed.
  mapfile -t deps < <(project_deps)
  install_missing "the benchmark's Python dependencies (${deps[*]})" "${deps[@]}"
  install_missing "$ORT_GPU" "$ORT_GPU"
  [[ ${#TRT_PKGS[@]} -eq 0 ]] || install_missing "${TRT_PKGS[*]}" "${TRT_PKGS[@]}"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# The CUDA, cuDNN and TensorRT libraries that pip wheels put under site-packages: on the loader
# path before onnxruntime starts (its providers dlopen them by soname).
libdirs="$("$PY" - <<'EOF'
import glob, os, site, sys
# Every folder on the path: site-packages, dist-packages and .gpu-site alike.
roots = [p for p in sys.path if p and os.path.isdir(p)] + site.getsitepackages()
dirs = []
for root in dict.fromkeys(roots):
    dirs += glob.glob(os.path.join(root, "nvidia", "*", "lib")) + glob.glob(os.path.join(root, "nvidia", "cu*", "lib"))
    dirs += glob.glob(os.path.join(root, "tensorrt_libs")) + glob.glob(os.path.join(root, "tensorrt_cu*_libs"))
print(":".join(d for d in dict.fromkeys(dirs) if os.path.isdir(d)))
EOF
)"
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

for f in "${failed[@]}"; do
  echo "gpu.sh: could not install $f (the providers that need it will read not measured)" >&2
done
cd "$REPO"
exec "$PY" -m quantnorm.cli evaluate "${EVALUATE_DEFAULTS[@]}" "${args[@]}"
