# Sourced by the device checks (gpu_check.sh, amx_check.sh) from the repository root: fairseq
# and what it needs installed from the wheels carried in .whl/ where the machine lacks them
# (docs/gpu.md), and this checkout importable.
if ! python3 -c "import fairseq" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
