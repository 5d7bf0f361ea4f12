#!/usr/bin/env bash
# Build and install Horovod (PyTorch + Gloo, CPU, no MPI) into the project venv.
#
# Horovod 0.28.1, the latest release, does not build against torch >= 2.1 as
# published: its CMake files ask for C++14 and torch's headers need C++17. So
# this script takes the sdist from the package index, switches both
# CMakeLists.txt files to C++17, builds a wheel against the venv's own torch
# (--no-build-isolation, so no other torch is pulled in) and keeps the wheel
# in a cache keyed by the Python and torch versions.
#
# Idempotent: nothing happens when horovod.torch already imports in the venv;
# a cached wheel is installed in seconds; only a fresh machine builds (about
# five minutes on two cores).
#
#   VENV=.venv                    the virtualenv to install into
#   CKPT_SUITE_CACHE=~/.cache/ckpt-suite   where built wheels are kept
#   HOROVOD_BUILD_JOBS=$(nproc)   parallel compile jobs
#   HOROVOD_WITH_MPI=1, HOROVOD_GPU_OPERATIONS=NCCL   a cluster build (MPI and/or
#                                 NCCL must be installed); cached as its own flavour
set -euo pipefail
cd "$(dirname "$0")/.."

HOROVOD_VERSION=0.28.1
VENV=${VENV:-.venv}
PY=$VENV/bin/python
CONSTRAINTS=$VENV/constraints.txt
CACHE_ROOT=${CKPT_SUITE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ckpt-suite}

say() { echo "install_horovod: $*"; }
die() { echo "install_horovod: $*" >&2; exit 1; }
# pip quietly, without the harmless "Location ... is ignored" lines this machine's pip.conf causes
pip() {
    "$PY" -m pip --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
    return "${PIPESTATUS[0]}"
}

[[ -x $PY ]] || die "$PY not found; run scripts/setup_env.sh first"
constraint_args=()
[[ -f $CONSTRAINTS ]] && constraint_args=(-c "$CONSTRAINTS")

installed() {
    "$PY" - "$HOROVOD_VERSION" <<'EOF' >/dev/null 2>&1
import sys
import horovod
import horovod.torch as hvd  # fails when the torch extension was not built
assert horovod.__version__.split("+")[0] == sys.argv[1], horovod.__version__
assert hvd.gloo_built(), "built without Gloo"
EOF
}

check_build() {
    local out
    out=$("$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $out"
    grep -q '\[X\] PyTorch' <<<"$out" || die "Horovod was built without PyTorch:"$'\n'"$out"
    grep -q '\[X\] Gloo' <<<"$out" || die "Horovod was built without Gloo:"$'\n'"$out"
}

if installed; then
    say "horovod $HOROVOD_VERSION already installed (PyTorch, Gloo)"
    exit 0
fi

# Horovod's runtime dependencies; with --no-build-isolation its setup.py
# also needs them (setup_requires) before it builds.
pip install -q "${constraint_args[@]}" cloudpickle psutil pyyaml packaging 'cffi>=1.4.0' wheel

py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
# Gloo and PyTorch always; MPI and GPU operations only when asked for (a cluster).
build_env=(CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1)
flavour=
if [[ ${HOROVOD_WITH_MPI:-0} == 1 ]]; then
    build_env+=(HOROVOD_WITH_MPI=1)
    flavour+=-mpi
else
    build_env+=(HOROVOD_WITHOUT_MPI=1)
fi
if [[ -n ${HOROVOD_GPU_OPERATIONS:-} ]]; then
    build_env+=("HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS")
    flavour+=-$(tr '[:upper:]' '[:lower:]' <<<"$HOROVOD_GPU_OPERATIONS")
fi
cache=$CACHE_ROOT/wheels/horovod-$HOROVOD_VERSION-$py_tag-torch$torch_version$flavour
wheel=$(ls "$cache"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n 1 || true)

if [[ -z $wheel ]]; then
    command -v cmake >/dev/null || pip install -q "${constraint_args[@]}" 'cmake>=3.13'
    PATH=$(cd "$VENV/bin" && pwd):$PATH   # a pip-installed cmake lives there
    export PATH
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    say "building horovod $HOROVOD_VERSION${flavour} against torch $torch_version ($py_tag); a few minutes"
    pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work" \
        || die "could not download the horovod $HOROVOD_VERSION sdist"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src=$work/horovod-$HOROVOD_VERSION
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$src/$f" \
            || die "$f: 'set(CMAKE_CXX_STANDARD 14)' not found; the C++17 patch does not apply"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/$f"
        ! grep -q 'set(CMAKE_CXX_STANDARD 14)' "$src/$f" || die "$f: C++17 patch did not apply"
    done
    log=$work/build.log
    if ! env "${build_env[@]}" MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(nproc)}" \
            "$PY" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps \
            "${constraint_args[@]}" -w "$work/dist" "$src" >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        die "building the horovod wheel failed (last lines above)"
    fi
    built=$(ls "$work"/dist/horovod-*.whl | head -n 1)
    mkdir -p "$cache"
    cp "$built" "$cache/.partial.whl"
    mv "$cache/.partial.whl" "$cache/$(basename "$built")"   # atomic: no half wheel in the cache
    wheel=$cache/$(basename "$built")
    say "cached $wheel"
fi

pip install -q --no-deps --force-reinstall "$wheel"
installed || die "horovod.torch does not import after installing $wheel"
check_build
say "horovod $HOROVOD_VERSION installed (PyTorch, Gloo) from $wheel"
