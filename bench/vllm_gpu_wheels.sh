#!/usr/bin/env bash
# vLLM onto the lent GPU machine, which has no network and takes at most 64 MiB a call.
#
# vllm 0.25.1 is the newest release whose wheel pins torch==2.11.0, the GPU machine's torch
# (2.11.0+cu130; the wheel's kernels link libcudart.so.13). Its wheel is 250 MB (606 MB
# unpacked), so:
#   here:  bash bench/vllm_gpu_wheels.sh prepare
#          downloads vLLM and the dependencies that machine lacks, unpacks vLLM and leaves out
#          what a Hopper GPU serving a dense model never loads (FlashAttention 2's kernels,
#          190 MB: Hopper runs FlashAttention 3; the MoE kernels; the Rust front end; the
#          DeepGEMM and SM100 sources), packs the rest with the wheels of
#          ../shared/tools/device-wheels style (Ray, math-verify: .whl/) into one stream, and
#          splits it into parts under .vgpu/p0, .vgpu/p1, ... (git-ignored), one per call.
#   there: bash bench/vllm_gpu_wheels.sh receive     (in each call, carrying one .vgpu/pN)
#          keeps the carried part in /tmp/vgpu; the calls must follow each other while the
#          machine stays warm (about 30 s), or the parts already there are gone.
#   there: bash bench/vllm_gpu_wheels.sh install     (after the last part)
#          joins the parts, unpacks vLLM into /tmp/site, installs the wheels there with
#          `--no-index --no-deps`, imports vllm and lists the requirements still missing.
#          Then: export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
# Left out on purpose (vLLM imports them lazily, for features reprorl does not use): FlashInfer,
# TileLang, CUTLASS DSL, the video and audio codecs, fastsafetensors, the OpenAI server's
# MCP/OpenTelemetry/Anthropic parts. What the machine already had is listed in docs/vllm.md.
set -euo pipefail
VLLM_VERSION=0.25.1
PART_MIB=${PART_MIB:-48}
cache=${VGPU_CACHE:-/tmp/vgpu-cache}
dest=.vgpu

download() {  # pip download for that machine: Python 3.12, x86-64, no resolver (its packages are not ours)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any -d "$1" "${@:2}"
}

# vLLM's requirements that the GPU machine's image lacks and that serving a dense model imports
# (pins as vLLM 0.25.1 gives them; the image's own packages are used for the rest).
DEPS=(cachetools blake3 "fastapi<0.137.0,>=0.133.0" "starlette>=1.0.1" "openai>=2.0.0,<3" "pydantic>=2.12.0"
      pydantic-core annotated-types typing-inspection typing_extensions annotated-doc
      prometheus-fastapi-instrumentator lm-format-enforcer==0.11.3 interegular "llguidance<1.8.0,>=1.7.0"
      outlines_core==0.2.14 diskcache==5.6.3 lark==1.2.2 "xgrammar<1.0.0,>=0.2.1" "apache-tvm-ffi>=0.1.11"
      partial-json-parser pyzmq msgspec "mistral_common>=1.11.5" pydantic-extra-types depyf==0.20.0 astor dill
      watchfiles python-json-logger pybase64 cbor2 ijson setproctitle openai-harmony distro jiter sniffio
      compressed-tensors==0.17.0 loguru)

prepare() {
  [ -d .whl ] || { echo "prepare: no .whl/ (Ray and math-verify); make it first (see docs/vllm.md)" >&2; exit 1; }
  mkdir -p "$cache/deps"
  [ -f "$cache/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl" ] || download "$cache" "vllm==$VLLM_VERSION"
  download "$cache/deps" "${DEPS[@]}"
  # pydantic pins its core exactly: the download above takes the newest of each, so check.
  local core; core=$(unzip -p "$cache"/deps/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
  ls "$cache/deps/pydantic_core-$core-"*.whl > /dev/null || { rm -f "$cache"/deps/pydantic_core-*; download "$cache/deps" "pydantic-core==$core"; }
  # One copy of each wheel that .whl/ has too (two versions stop the install there).
  for w in .whl/*.whl; do rm -f "$cache/deps/$(basename "$w" | cut -d- -f1)"-*.whl; done
  if [ ! -f "$cache/vllm-trim.tar.xz" ]; then
    rm -rf "$cache/site" && mkdir -p "$cache/site"
    unzip -q "$cache"/vllm-$VLLM_VERSION-*.whl -d "$cache/site"
    rm -f "$cache"/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$cache"/site/vllm/_moe_C_stable_libtorch.abi3.so \
          "$cache"/site/vllm/vllm-rs
    rm -rf "$cache"/site/vllm/third_party/fmha_sm100 "$cache"/site/vllm/third_party/deep_gemm
    tar -C "$cache/site" -cf - . | xz -6 -T0 > "$cache/vllm-trim.tar.xz.tmp"
    mv "$cache/vllm-trim.tar.xz.tmp" "$cache/vllm-trim.tar.xz"
  fi
  rm -rf "$dest" && mkdir -p "$dest"
  if [ -d .git ] && ! grep -qx "/$dest/" .git/info/exclude 2>/dev/null; then echo "/$dest/" >> .git/info/exclude; fi
  mkdir -p "$cache/bundle/wheels" && rm -f "$cache"/bundle/wheels/*
  cp "$cache"/deps/*.whl .whl/*.whl "$cache/bundle/wheels/"
  cp "$cache/vllm-trim.tar.xz" "$cache/bundle/"
  tar -C "$cache/bundle" -cf - . | split -b "${PART_MIB}M" -d -a 1 - "$dest/part-"
  for part in "$dest"/part-*; do n=${part##*-}; mkdir -p "$dest/p$n"; mv "$part" "$dest/p$n/"; done
  cat "$dest"/p*/part-* | sha256sum | cut -d' ' -f1 > "$dest/p0/bundle.sha256"
  du -sh "$dest"/p*
  echo "carry .vgpu/p0, .vgpu/p1, ... one a call, each running: bash bench/vllm_gpu_wheels.sh receive"
}

receive() {
  mkdir -p /tmp/vgpu
  cp "$dest"/p*/* /tmp/vgpu/ 2>/dev/null || true
  ls -la /tmp/vgpu
}

install() {
  local parts=(/tmp/vgpu/part-*)
  echo "install: ${#parts[@]} parts"
  [ "$(cat /tmp/vgpu/part-* | sha256sum | cut -d' ' -f1)" = "$(cat /tmp/vgpu/bundle.sha256)" ] \
    || { echo "install: the parts do not add up to the bundle (one missing?)" >&2; exit 1; }
  mkdir -p /tmp/vgpu/bundle /tmp/site
  cat /tmp/vgpu/part-* | tar -C /tmp/vgpu/bundle -xf -
  xz -dc /tmp/vgpu/bundle/vllm-trim.tar.xz | tar -C /tmp/site -xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/vgpu/bundle/wheels/*.whl 2>&1 | grep -v "WARNING: Running pip as" || true
  touch /tmp/site/.done
  PYTHONPATH=/tmp/site python3 - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
import vllm
print("vllm", vllm.__version__, "imported from", vllm.__file__)
missing = []
for line in md.requires("vllm") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(req.name)
        continue
    if have not in req.specifier and req.specifier:
        missing.append(f"{req.name} (have {have}, want {req.specifier})")
print("requirements missing or off:", ", ".join(missing) or "none")
PY
}

"${1:?usage: bench/vllm_gpu_wheels.sh prepare|receive|install}"
