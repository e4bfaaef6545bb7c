#!/usr/bin/env bash
# `make wheel-check`: nsa-diag as a new user gets it. Build the wheel of this tree, install it into a fresh
# venv outside the repository, and from another directory run `nsa-diag branch`, `nsa-diag matrix --list`,
# a shipped matrix by name (`matrix cpu-smoke --only cmp,nan`) and one case's replay.sh (run from yet
# another directory), checking each exit code. Offline: the fresh venv sees the dependencies (torch, ...)
# of $PYTHON's site-packages through a .pth file, so nothing is downloaded; that site-packages' own
# nsa-diag (an editable install) stays hidden, as a .pth file's folders have their .pth files ignored.
# Exit 0 when every step passed, 1 at the first that did not.
#   PYTHON: a Python with the dependencies installed (default .venv/bin/python)
#   WHEEL_CHECK_DIR: where the build, the venv and the runs go (default a new temporary folder, removed
#   at the end when every step passed)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
python=$(command -v "$python")
work=${WHEEL_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/nsa-diag-wheel-check.XXXXXX")}
mkdir -p "$work"
work=$(cd "$work" && pwd)
case "$work/" in "$PWD"/*) echo "wheel-check: $work is inside the repository" >&2; exit 2 ;; esac

fail() { echo "wheel-check: FAILED: $*" >&2; echo "wheel-check: its files are in $work" >&2; exit 1; }
step() {  # step NAME COMMAND...: run it, stop at a non-zero exit
  local name=$1; shift
  echo "=== $name: $*"
  "$@" || fail "$name (exit $?)"
}

# The build works on a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
mkdir -p "$work/tree"
cp -R pyproject.toml README.md src "$work/tree/"
step build "$python" -m pip wheel --no-deps --no-build-isolation --no-index -q -w "$work/dist" "$work/tree"
wheel=$(ls "$work"/dist/nsa_diag-*.whl)
listing=$("$python" -m zipfile -l "$wheel")  # not piped into grep -q: its early exit broke the pipe
grep -q 'nsa_diag/matrices/cpu-smoke.yaml' <<< "$listing" || fail "the wheel has no matrices"

venv=$work/venv
step venv "$python" -m venv --without-pip "$venv"
deps=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$deps" > "$site/nsa_diag_wheel_check_deps.pth"
step install "$python" -m pip --python "$venv/bin/python" install --no-deps --no-index -q "$wheel"

# From elsewhere, with nothing of the repository on the path: only the installed wheel can answer.
unset PYTHONPATH PYTHONHOME
export COLUMNS=160
mkdir -p "$work/user" "$work/other"
cd "$work/user"
nsa_diag=$venv/bin/nsa-diag
where=$("$venv/bin/python" -c 'import nsa_diag; print(nsa_diag.__file__)')
case "$where" in "$site"/*) ;; *) fail "nsa_diag imported from $where, not the installed wheel" ;; esac
step branch "$nsa_diag" branch --device cpu --out runs
step matrix-list "$nsa_diag" matrix --list
listed=$("$nsa_diag" matrix --list)
grep -q '^cpu-smoke ' <<< "$listed" || fail "matrix --list does not name cpu-smoke"
step matrix "$nsa_diag" matrix cpu-smoke --only cmp,nan --out runs
replay=$(ls "$work"/user/runs/*-branch/cases/sel/replay.sh)
cd "$work/other"
step replay "$replay"
[[ $(ls -d "$work"/user/runs/*-run 2>/dev/null | wc -l) -eq 1 ]] || fail "the replay wrote no run folder"
cd /
echo "wheel-check: ok ($wheel installed in $venv; branch, matrix --list, matrix cpu-smoke, replay.sh)"
[[ -n ${WHEEL_CHECK_DIR:-} ]] || rm -rf "$work"
