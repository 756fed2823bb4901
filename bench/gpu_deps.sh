#!/usr/bin/env bash
# What the lent device's image lacks, packed here into .whl/ (git-ignored through
# .git/info/exclude) for the device tool to carry (64 MiB at most): pydantic's wheels, and
# ucxx-cu12 with its libraries installed for CPython 3.12 and packed as one tar.xz (the wheels
# alone are ~68 MB; without UCX's static archives and with its duplicate .so copies as links,
# ~21 MB). On the device, bench/gpu_check.py's docstring gives the one call that unpacks both.
#
#     bash bench/gpu_deps.sh        # run here, with the registry; needs pip and tar
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
rm -rf "$out"  # (no stale versions beside the new ones: the device installs .whl/*.whl)
mkdir -p "$out"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
pick=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64)
python3 -m pip download -q "${pick[@]}" -d "$out" pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# ucxx-cu12 0.52 and what it imports (numpy comes with the image's torch).
python3 -m pip download -q "${pick[@]}" -d "$tmp/wheels" ucxx-cu12==0.52.0 \
    libucxx-cu12==0.52.0 libucx-cu12==1.21.0 librmm-cu12==26.10.0 rmm-cu12==26.10.0 \
    rapids-logger==0.3.0 cuda-core==1.2.2 cuda-bindings==12.9.10 cuda-pathfinder==1.9.1 \
    nvidia-ml-py==13.615.71
python3 -m pip install -q --no-index "${pick[@]}" --no-compile --target "$tmp/site" \
    "$tmp"/wheels/*.whl
find "$tmp/site" \( -name '*.a' -o -name '*.la' \) -delete
python3 - "$tmp/site" <<'EOF'
"""Identical shared-library copies in one folder (pip writes a wheel's symlinks as copies)
become links to the copy named by its soname (libfoo.so.0)."""
import hashlib, os, sys
from collections import defaultdict

groups = defaultdict(list)
for root, _, files in os.walk(sys.argv[1]):
    for name in files:
        path = os.path.join(root, name)
        if ".so" in name and not os.path.islink(path):
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
            groups[(root, digest)].append(name)
for (root, _), names in groups.items():
    if len(names) > 1:
        keep = min(names, key=lambda n: (not n.endswith(".so.0"), len(n)))
        for name in names:
            if name != keep:
                os.remove(os.path.join(root, name))
                os.symlink(keep, os.path.join(root, name))
EOF
tar -cJf "$out/ucxx-site-cp312.tar.xz" -C "$tmp/site" .
du -sh "$out"
