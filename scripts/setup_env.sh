#!/usr/bin/env bash
# Create or refresh the project virtualenv (.venv, Python 3.11) with the CPU build of torch.
#
#   bash scripts/setup_env.sh        # everything the tests and benchmarks need (scripts/test.sh):
#                                    # every extra, Horovod built from source, azurite
#   bash scripts/setup_env.sh demo   # what the demo needs (scripts/demo.sh): torch, Lightning, the package
#
# Idempotent: a stamp per profile in .venv records a hash of the files that decide what gets
# installed; when it matches (the full profile's stamp also serves the demo), installing is skipped
# and only the quick sanity checks at the bottom run, so a re-run takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${1:-full}
case $PROFILE in
    full) EXTRAS=lightning,s3,test,bench,docs ;;
    demo) EXTRAS=lightning ;;
    *) echo "setup_env: unknown profile '$PROFILE' (full or demo)" >&2; exit 2 ;;
esac
TORCH_VERSION=2.13.0   # the CPU wheel this machine holds in /opt/wheels
VENV=.venv
PY=$VENV/bin/python
STAMP=$VENV/.setup-stamp-$PROFILE
FULL_STAMP=$VENV/.setup-stamp-full
CONSTRAINTS=$VENV/constraints.txt

# pip runs quietly; also drop the harmless "Location ... is ignored" warnings
# that this machine's pip.conf (an extra index that lacks most projects)
# prints once per package.
pip() {
    "$PY" -m pip --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

if [[ ! -x $PY ]]; then
    echo "setup_env: creating $VENV with python3.11"
    python3.11 -m venv "$VENV"
fi

want=$(cat pyproject.toml setup.cfg scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" && "$(cat "$FULL_STAMP" 2>/dev/null)" != "$want" ]]; then
    rm -f "$STAMP"
    echo "setup_env: installing into $VENV (about a minute when fresh)"
    pip install -q --upgrade pip

    # torch first, on its own: pip then finds it already satisfied and never
    # resolves torch from PyPI, whose default build is the CUDA one (nvidia-*).
    pip install -q "torch==$TORCH_VERSION"
    # ...and keep it pinned while the rest resolves, so no dependency can swap it.
    echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
    pip install -q -c "$CONSTRAINTS" -e ".[$EXTRAS]"

    # moto[server] (through boto3) accepts newer botocore releases than
    # aiobotocore (s3fs) does. The joint resolve above normally gets this
    # right, but a botocore left over from an earlier install can slip
    # through: if it is outside aiobotocore's declared range, add that range
    # as a constraint and resolve again so pip moves botocore and boto3 together.
    botocore_req=$("$PY" - <<'EOF'
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement

try:
    lines = requires("aiobotocore") or []
except PackageNotFoundError:  # the demo profile installs no S3 client
    lines = []
for line in lines:
    req = Requirement(line)
    if req.name == "botocore" and req.marker is None:
        if not req.specifier.contains(version("botocore"), prereleases=True):
            print(f"botocore{req.specifier}")
EOF
)
    if [[ -n $botocore_req ]]; then
        echo "setup_env: aligning botocore with aiobotocore: $botocore_req"
        echo "$botocore_req" >> "$CONSTRAINTS"
        pip install -q -c "$CONSTRAINTS" -e ".[$EXTRAS]"
    fi
fi

if [[ $PROFILE == full ]]; then
    # Horovod (the horovod_ckpt front end and its tests) has no wheel that builds
    # against this torch: scripts/install_horovod.sh builds one (about five minutes
    # on a fresh machine), caches it under ~/.cache/ckpt-suite and installs it. It
    # is idempotent and returns in seconds when horovod.torch already imports, so
    # it runs every time (a venv refreshed by hand is repaired too).
    VENV=$VENV bash scripts/install_horovod.sh

    # azurite (Azure's blob emulator, from the npm registry) for the storage conformance
    # tests: into $VENV/azurite, with Node.js from Debian if it is missing. Idempotent,
    # quiet, and instant when present, so it runs every time too.
    VENV=$VENV bash scripts/install_azurite.sh
fi

# Sanity checks, run every time (cheap).
"$PY" -m pip --disable-pip-version-check check
torch_version=$("$PY" -c "import torch; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(), torch.__version__; print(torch.__version__)")
if "$PY" -m pip --disable-pip-version-check list --format=freeze | grep -i '^nvidia-'; then
    echo "setup_env: CUDA packages (nvidia-*) are installed; this project must use CPU torch" >&2
    exit 1
fi

echo "$want" > "$STAMP"
echo "setup_env: $VENV ready for the $PROFILE profile (torch $torch_version)"
