#!/usr/bin/env bash
# The proxy against real vLLM on the CPU with real Mooncake KV transfer: builds (or reuses) the
# environment, then runs integration/test_real_vllm.py, whose fixture starts a prefill, a decode
# and the proxy and stops them all at the end, then the routing, migration, differential and
# models modules, each with servers of its own (module fixtures, in this order: one cluster up
# at a time).
#
# If the environment cannot be built (a registry unreachable), this says so loudly and exits 0,
# so a developer without it runs the rest; REAL_VLLM_REQUIRED=1 (CI sets it) makes that a
# failure. Once built, any failure fails.
set -uo pipefail
cd "$(dirname "$0")/.."

skip() {
    printf '\n%s\n!!! REAL-VLLM INTEGRATION SUITE NOT RUN: %s\n%s\n\n' \
        '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!' "$1" \
        '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!' >&2
    [ "${REAL_VLLM_REQUIRED:-0}" = 1 ] && exit 1
    exit 0
}

root=$(bash integration/setup_env.sh | tail -n 1) && [ -d "$root/venv" ] \
    || skip "the vLLM/Mooncake environment could not be set up (see above)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-integration.txt \
    2>&1 | grep -v '^WARNING: Location'
[ "${PIPESTATUS[0]}" = 0 ] || skip "requirements-integration.txt could not be installed"

VLLM_ENV_ROOT=$root exec .venv/bin/python -m pytest \
    integration/test_real_vllm.py integration/test_real_vllm_routing.py \
    integration/test_real_vllm_migration.py integration/test_real_vllm_differential.py \
    integration/test_real_vllm_models.py integration/test_real_vllm_local_prefill.py \
    integration/test_real_vllm_transfer_proof.py \
    -v -p no:cacheprovider -o asyncio_mode=strict "$@"
