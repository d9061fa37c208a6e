#!/usr/bin/env bash
# Smoke test of the built app (not part of `make test`: it needs `make package` first, minutes on 2 cores).
#   packaging/smoke_test.sh [APP_DIR]          (default dist/clover-desk)
# Runs the bundle headless and checks, each within a time limit:
#   1. the window: CLOVER_DESK_SMOKE=1 makes the app print a marker once its main window is shown, then exit 0;
#   2. the engine worker as the window starts it (`clover-desk -m clover_desk.worker.process`): "ready", then "bye";
#   3. the engine: make-tiny, then generate 8 tokens on the CPU (torch, tokenizers, safetensors in the bundle);
#   4. QtWebEngine: `preview --screenshot` renders a page (QtWebEngineProcess, its .pak resources, locales, ICU);
#   5. `doctor` runs (its findings are printed, not judged: they depend on the machine);
#   6. with no C compiler (CC pointing nowhere) `doctor` finds and loads a prebuilt CPU kernel library;
# then prints the bundle's size. Exit 0: all passed; 1: a check failed (its output is shown); 2: no app to test.
set -uo pipefail
cd "$(dirname "$0")/.."
APP_DIR=${1:-dist/clover-desk}
EXE="$APP_DIR/clover-desk"
if [ ! -x "$EXE" ]; then
    echo "smoke_test.sh: no built app at $EXE: run  make package  first" >&2
    exit 2
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export QT_QPA_PLATFORM=offscreen CLOVER_DESK_HOME="$TMP/home"
if [ "$(id -u)" = 0 ]; then export QTWEBENGINE_DISABLE_SANDBOX=1; fi  # Chromium's sandbox refuses to run as root
FAILED=0

# check NAME LIMIT_S GREP_PATTERN COMMAND...: run COMMAND (stdout+stderr to a log), pass when it exits 0 in time and
# its output matches GREP_PATTERN (extended regex)
check() {
    local name=$1 limit=$2 pattern=$3
    shift 3
    local log="$TMP/$(echo "$name" | tr -c 'a-z0-9\n' '_').log" t0=$SECONDS rc
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && grep -Eq "$pattern" "$log"; then
        printf 'PASS  %-44s %4d s\n' "$name" $((SECONDS - t0))
    else
        printf 'FAIL  %-44s %4d s (exit %d%s)\n' "$name" $((SECONDS - t0)) $rc "$([ $rc -eq 124 ] && echo ', timed out')"
        tail -n 25 "$log" | sed 's/^/      /'
        FAILED=1
    fi
}

check "window shown (CLOVER_DESK_SMOKE=1)" 180 "clover-desk smoke: main window shown" \
    env CLOVER_DESK_SMOKE=1 "$EXE"
grep -h "smoke: main window shown" "$TMP"/window*.log 2>/dev/null | sed 's/^/      /'

check "engine worker starts and stops" 180 '"event": ?"bye"' \
    sh -c "printf '{\"cmd\": \"shutdown\"}\n' | \"$EXE\" -m clover_desk.worker.process"

check "make-tiny (demo model)" 180 "wrote a tiny" "$EXE" make-tiny "$TMP/tiny"
check "generate 8 tokens on the CPU" 240 '"event": ?"finished"' \
    "$EXE" generate --model "$TMP/tiny" --prompt "Hello" --max-new-tokens 8 --device cpu --json

cat >"$TMP/page.html" <<'HTML'
<!DOCTYPE html><html><body style="background:#46c98b"><h1>Clover Desk smoke test</h1></body></html>
HTML
check "preview renders a page (QtWebEngine)" 180 "" \
    "$EXE" preview "$TMP/page.html" --screenshot "$TMP/shot.png" --wait-ms 300
if [ -s "$TMP/shot.png" ]; then
    echo "      screenshot: $(stat -c %s "$TMP/shot.png") bytes"
else
    echo "FAIL  preview wrote no screenshot"
    FAILED=1
fi

check "doctor runs" 120 "torch " sh -c "\"$EXE\" doctor; [ \$? -le 1 ]"
sed 's/^/      /' "$TMP"/doctor*.log
check "CPU kernels without a C compiler: prebuilt" 120 "CPU kernels +prebuilt quant_cpu-" \
    sh -c "CC=/nonexistent-cc \"$EXE\" doctor; [ \$? -le 1 ]"
grep -h "CPU kernels" "$TMP"/*kernels_without*.log | sed 's/^/      /'

echo "bundle $APP_DIR: $(du -sh "$APP_DIR" | cut -f1) in $(find "$APP_DIR" -type f | wc -l) files" \
    "(torch $(du -sh "$APP_DIR/_internal/torch" 2>/dev/null | cut -f1)," \
    "PySide6 $(du -sh "$APP_DIR/_internal/PySide6" 2>/dev/null | cut -f1))"
if [ $FAILED -ne 0 ]; then
    echo "smoke test FAILED"
    exit 1
fi
echo "smoke test passed"
