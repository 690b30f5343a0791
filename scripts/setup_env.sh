# Sourced (from the repository root, under `set -e`) by run_demo.sh and run_tests.sh: sets
# $PY, a Python that runs tritonep; any failure stops the caller.
#   source scripts/setup_env.sh        $PY: torch, triton, numpy, tritonep
#   source scripts/setup_env.sh test   the same plus pytest, hypothesis, ruff, and also
#                                      $PY_INTERPRETER: the Python for the interpreter tests
# $PY_AS_IS is 1 when an existing interpreter is used as it is (1 and 2 below), else 0.
#
# Which Python, first match wins:
#   1. PYTHON=/path/to/python: that interpreter as it is; nothing is installed, tritonep is
#      imported from this checkout (PYTHONPATH). Both $PY and $PY_INTERPRETER. It needs torch
#      and numpy, and for tests pytest and hypothesis (ruff too, or run_tests.sh skips lint).
#   2. python3 with a CUDA torch that sees a GPU (the GPU machines, which have no network):
#      python3 as it is, as in 1.
#   3. Otherwise our own virtual environments, which do not see the machine's packages:
#        .venv              torch==2.13.0 (CPU build), triton==3.6.0, numpy (current release)
#        .venv-interpreter  the same with numpy<2.4 (tests only, see below)
#      plus pytest, hypothesis, ruff==0.17.6 and tritonep (editable). They are reused while
#      their pins hold; with CI=true or TRITONEP_FRESH_ENV=1 they are deleted and rebuilt from
#      nothing, so a green CI run means a new machine works.
#
# Why two environments: Triton 3.6's interpreter (TRITON_INTERPRET=1, how the NVLink kernels
# run in CPU tests) converts 1-element arrays to Python ints in a way numpy >= 2.4 forbids,
# so any kernel loop with runtime bounds fails (triton-lang/triton#9171, fixed upstream after
# 3.6). Users have numpy 2.4, so the package and the main suite are tested with it; only the
# interpreter tests run against numpy<2.4. Drop .venv-interpreter with a Triton that has the fix.

_want_test=${1:-}
# torch pinned: this exact CPU build lies on the CPU machines' local wheel store; an unpinned
# torch would pull a multi-GB CUDA build from PyPI. ruff pinned: its rules change between
# releases and CI must lint like developers do.
_requirements="torch==2.13.0 triton==3.6.0"
[ "$_want_test" = test ] && _requirements="$_requirements pytest hypothesis ruff==0.17.6"
_fresh=0
{ [ "${CI:-}" = true ] || [ "${TRITONEP_FRESH_ENV:-}" = 1 ]; } && _fresh=1
_base_python=$(command -v python3 || command -v python || true)

# _importable PYTHON MODULE...: prints the modules that PYTHON cannot import.
_importable() {
    local python=$1 module
    shift
    for module in "$@"; do
        "$python" -c "import $module" >/dev/null 2>&1 || printf '%s ' "$module"
    done
}

# _use_as_is PYTHON WHY: use an existing interpreter without installing anything.
_use_as_is() {
    local python=$1 why=$2 missing
    missing=$(_importable "$python" torch numpy)
    [ "$_want_test" = test ] && missing="$missing$(_importable "$python" pytest hypothesis)"
    if [ -n "$missing" ]; then
        echo "setup_env: $python ($why) lacks: ${missing% }; install them there" >&2
        return 1
    fi
    # Not installed there: import tritonep from this checkout (spawned rank processes too).
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PY=$python
    PY_INTERPRETER=$python
    PY_AS_IS=1
    echo "setup_env: using $python as is ($why): $(_versions "$python")" >&2
}

# _versions PYTHON: one line naming the versions that matter, for the logs.
_versions() {
    "$1" - <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "none"

print(f"python {sys.version.split()[0]}, torch {v('torch')}, numpy {v('numpy')}, triton {v('triton')}")
PYEOF
}

# _satisfied PYTHON REQUIREMENT...: true when every requirement is installed there. Any doubt
# (an unexpected error included) answers false, which only costs a pip install that finds
# everything in place.
_satisfied() {
    local python=$1
    shift
    "$python" - "$@" >/dev/null 2>&1 <<'PYEOF'
import sys
from importlib.metadata import version

from pip._vendor.packaging.requirements import Requirement

for text in sys.argv[1:]:
    requirement = Requirement(text)
    if not requirement.specifier.contains(version(requirement.name), prereleases=True):
        sys.exit(1)
PYEOF
}

# _make_venv DIR NUMPY_REQUIREMENT: builds, updates or reuses the venv DIR; sets _venv_python.
_make_venv() {
    # python by absolute path: the editable-install check below runs it from /.
    local dir=$1 numpy_requirement=$2 python=$PWD/$1/bin/python how=reusing
    # shellcheck disable=SC2206  # the requirements contain no spaces or globs
    local requirements=($_requirements "$numpy_requirement")
    if [ -e "$dir" ] && [ "$_fresh" = 1 ]; then
        echo "setup_env: deleting $dir (CI=true or TRITONEP_FRESH_ENV=1: built from nothing)" >&2
        rm -rf "$dir"
    elif [ -e "$dir" ] && { ! "$python" -c '' >/dev/null 2>&1 ||
            ! grep -qs '^include-system-site-packages = false' "$dir/pyvenv.cfg"; }; then
        # Broken (its base Python is gone), or made by an older setup_env.sh that let the
        # venv see the machine's packages.
        echo "setup_env: deleting $dir (broken, or it sees the machine's packages)" >&2
        rm -rf "$dir"
    fi
    if [ ! -e "$dir" ]; then
        how=created
        [ "$_fresh" = 1 ] && how="created fresh"
        echo "setup_env: creating $dir from $_base_python" >&2
        if [ -z "$_base_python" ] || ! "$_base_python" -m venv "$dir"; then
            echo "setup_env: cannot create $dir (on Debian/Ubuntu: apt-get install python3-venv);" \
                "or set PYTHON to an interpreter that has torch" >&2
            rm -rf "$dir"
            return 1
        fi
    fi
    if ! _satisfied "$python" "${requirements[@]}"; then
        echo "setup_env: $dir: pip install ${requirements[*]}" >&2
        [ "$how" = reusing ] && how=updated
        "$python" -m pip install -q --progress-bar off "${requirements[@]}" || return 1
    fi
    # tritonep in editable mode, unless this checkout is the one installed (checked from /,
    # where the current directory cannot shadow the installed package).
    local here installed isolation=--no-build-isolation
    here=$(pwd -P)
    # find_spec locates the package without importing it (and torch with it).
    installed=$(cd / && "$python" -c 'import importlib.util as u, os; s = u.find_spec("tritonep"); print(os.path.dirname(os.path.dirname(os.path.realpath(s.origin))))' 2>/dev/null || true)
    if [ "$installed" != "$here" ]; then
        echo "setup_env: $dir: pip install --no-deps -e ." >&2
        # The venv's own setuptools (>= 64 for editable installs from pyproject.toml) saves a
        # download; without one, pip fetches it into an isolated build environment.
        "$python" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 64)' \
            >/dev/null 2>&1 || isolation=
        "$python" -m pip install -q --progress-bar off --no-deps $isolation -e . || return 1
    fi
    echo "setup_env: $how $dir: $(_versions "$python")" >&2
    _venv_python=$python
}

if [ -n "${PYTHON:-}" ]; then
    _use_as_is "$PYTHON" "PYTHON is set"
elif [ -n "$_base_python" ] && "$_base_python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
        >/dev/null 2>&1; then
    _use_as_is "$_base_python" "its torch has CUDA and a GPU"
else
    _make_venv .venv numpy
    PY=$_venv_python
    PY_AS_IS=0
    if [ "$_want_test" = test ]; then
        _make_venv .venv-interpreter "numpy<2.4"
        PY_INTERPRETER=$_venv_python
    fi
fi
unset _want_test _requirements _fresh _base_python _venv_python
unset -f _importable _use_as_is _versions _satisfied _make_venv
