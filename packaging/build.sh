#!/usr/bin/env bash
# Build Clover Desk as a one-folder app in dist/clover-desk/ (what goes in: packaging/clover-desk.spec; how to
# install and what a Windows or CUDA build needs: packaging/README.md). `make package` runs this.
#   PYTHON=path/to/python packaging/build.sh      (default .venv/bin/python, with the `packaging` extra installed)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if ! "$PYTHON" -c "import PyInstaller" 2>/dev/null; then
    echo "build.sh: PyInstaller is not installed for $PYTHON: run  $PYTHON -m pip install -e '.[packaging]'  (or make package)" >&2
    exit 2
fi
export QT_QPA_PLATFORM=offscreen  # the build imports the ui package to list its modules; no display needed
"$PYTHON" packaging/make_icons.py --check 2>/dev/null || "$PYTHON" packaging/make_icons.py >/dev/null

start=$(date +%s)
# the project as a wheel installs it (clover_desk with its engine and ui inside): what the spec analyses and bundles
rm -rf build/pyinstaller/site
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --target build/pyinstaller/site .
# the CPU kernels prebuilt for machines without a C compiler (engine/kernels/cpu_build.py): one library per
# instruction-set level (AVX-512 VNNI, AVX-VNNI, AVX2, x86-64) and the OpenMP runtime they link, beside them
"$PYTHON" - build/pyinstaller/site/clover_desk/engine/kernels <<'PY'
import sys
from pathlib import Path

from clover_desk.engine.kernels.cpu_build import prebuild

kernels = Path(sys.argv[1])
built = prebuild(kernels / "prebuilt", source=kernels / "csrc" / "quant_cpu.c")
print("prebuilt CPU kernels:", " ".join(p.name for p in built))
PY
"$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath dist --workpath build/pyinstaller packaging/clover-desk.spec

# desktop integration files beside the program, laid out as under /usr (packaging/README.md says where they go)
out=dist/clover-desk
install -Dm644 packaging/clover-desk.desktop "$out/share/applications/clover-desk.desktop"
install -Dm644 packaging/io.github.clover_desk.metainfo.xml "$out/share/metainfo/io.github.clover_desk.metainfo.xml"
for size in 16 32 48 64 128 256 512; do
    install -Dm644 "assets/icons/clover-desk-$size.png" "$out/share/icons/hicolor/${size}x${size}/apps/clover-desk.png"
done
install -Dm644 assets/icons/clover-desk.svg "$out/share/icons/hicolor/scalable/apps/clover-desk.svg"
echo "built $out in $(( $(date +%s) - start )) s, $(du -sh "$out" | cut -f1)"
