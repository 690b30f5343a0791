# Sourced by run_demo.sh and run_tests.sh: make "$PY" a Python that can run tritonep.
#   source scripts/setup_env.sh          -> torch, numpy, triton, tritonep
#   source scripts/setup_env.sh test     -> the same plus pytest, hypothesis, ruff
# Installs only what is missing, so a machine's own torch (the GPU machines' CUDA build) is
# never replaced. Set PYTHON to choose the interpreter.

_want_test=${1:-}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python
    elif command -v python3 >/dev/null 2>&1; then PY=python3
    else PY=python
    fi
fi

# A distro Python that refuses pip installs (PEP 668), or one without pip, gets a venv that
# still sees the system's packages (so an existing torch is reused, not downloaded).
if ! "$PY" -m pip --version >/dev/null 2>&1 || "$PY" - <<'PYEOF'
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if managed and sys.prefix == sys.base_prefix else 1)
PYEOF
then
    echo "setup_env: creating .venv (this Python does not take pip installs)" >&2
    "$PY" -m venv --system-site-packages .venv
    PY=.venv/bin/python
    "$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip -q
fi

_pip() { PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --progress-bar off "$@"; }
_missing() {  # prints the requirements whose module does not import; args: module=requirement ...
    for pair in "$@"; do
        "$PY" -c "import ${pair%%=*}" >/dev/null 2>&1 || printf '%s\n' "${pair#*=}"
    done
}

# torch pinned: this exact CPU build lies on the machines' local wheel store; an unpinned torch
# would pull a multi-GB CUDA build from PyPI.
_reqs=$(_missing "torch=torch==2.13.0" "numpy=numpy<2.4" "triton=triton==3.6.0")
if [ "$_want_test" = test ]; then
    # ruff pinned: its rules change between releases and CI must lint like developers do.
    _reqs="$_reqs
$(_missing "pytest=pytest" "hypothesis=hypothesis" "ruff=ruff==0.17.6")"
fi
_reqs=$(printf '%s\n' "$_reqs" | sed '/^$/d')
if [ -n "$_reqs" ]; then
    echo "setup_env: installing $(echo "$_reqs" | tr '\n' ' ')" >&2
    # shellcheck disable=SC2086  # one requirement per line, none contains spaces
    _pip $(echo "$_reqs")
fi
# Editable install of this checkout, unless it is the one already installed (checked from /,
# where the current directory cannot shadow the installed package).
_here=$(pwd -P)
_installed=$(cd / && "$PY" -c 'import os, tritonep; print(os.path.dirname(os.path.dirname(os.path.realpath(tritonep.__file__))))' 2>/dev/null || true)
if [ "$_installed" != "$_here" ]; then
    echo "setup_env: pip install -e $_here" >&2
    # With setuptools >= 61 already here, build without isolation: no download, so this also
    # works on machines without network (the GPU machines).
    _isolation=--no-build-isolation
    "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 61)' \
        >/dev/null 2>&1 || _isolation=
    # Not fatal: run from the repository root, tritonep imports without being installed.
    _pip --no-deps $_isolation -e . || echo "setup_env: editable install failed; using the checkout" >&2
fi
unset _want_test _reqs _here _installed _isolation
