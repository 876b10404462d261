#!/usr/bin/env bash
# The compiled core under AddressSanitizer and UndefinedBehaviorSanitizer: build it with
# -fsanitize=address,undefined in a scratch copy of the sources (the checkout's own build is
# left alone), then run the test suite, the frame fuzzing included, against that build.
#
#   tools/asan.sh                       # the whole suite
#   tools/asan.sh tests/test_fuzz_frames.py --fuzz-minutes 5
#
# Needs gcc (or a clang whose runtime gcc -print-file-name finds) with libasan and libubsan.
# CPython itself is not instrumented, so the sanitizer runtimes are preloaded; leak detection
# is off because CPython keeps memory alive at exit on purpose, and an allocation too large to
# satisfy returns NULL (a MemoryError, which the cores must handle) instead of aborting, as in
# CPython's own sanitizer builds. Crash signals are left to Python: the tests crash children on
# purpose (SIGSEGV in C code) and check the exit signal and faulthandler's native traceback.
# PYTHONMALLOC=malloc sends every Python allocation through the instrumented malloc, so an
# overrun of a frame's bytes object is caught too. Any finding fails the run and is printed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/framepipe-asan.XXXXXX")
status=0
report() {
    rc=$?
    # pytest captures stderr, and an abort loses it: the sanitizers write to log files.
    # (A refused huge allocation is only a warning: the cores must handle that NULL.)
    if grep -l -E "ERROR: AddressSanitizer|runtime error" "$work"/logs/*.* >/dev/null 2>&1; then
        echo "tools/asan.sh: sanitizer findings:" >&2
        grep -l -E "ERROR: AddressSanitizer|runtime error" "$work"/logs/*.* | xargs cat >&2
        status=1
    fi
    rm -rf "$work"
    [ "$rc" -ne 0 ] && exit "$rc"
    exit "$status"
}
trap report EXIT
cp -r "$root/src" "$root/csrc" "$root/setup.py" "$root/pyproject.toml" "$root/README.md" "$work/"
rm -f "$work"/src/framepipe/_core*.so "$work/src/framepipe/_core.c"

cd "$work"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    python setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }

preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
for lib in $preload; do
    [ -e "$lib" ] || { echo "tools/asan.sh: $lib not found (install the gcc sanitizer runtimes)" >&2; exit 1; }
done

mkdir -p "$work/logs"
cd "$root"
if [ "$#" -eq 0 ]; then
    set -- tests
fi
env LD_PRELOAD="$preload" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:detect_stack_use_after_return=1:handle_segv=0:handle_sigbus=0:handle_sigfpe=0:handle_sigill=0:handle_abort=0:log_path=$work/logs/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/logs/ubsan" \
    PYTHONMALLOC=malloc \
    PYTHONPATH="$work/src" \
    FRAMEPIPE_REQUIRE_EXTENSIONS=1 \
    python -m pytest -p no:cacheprovider -q "$@"
