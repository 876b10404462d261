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
# CPython's own sanitizer builds. PYTHONMALLOC=malloc sends
# every Python allocation through the instrumented malloc, so an overrun of a frame's bytes
# object is caught too. Any finding aborts the process and fails the run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/framepipe-asan.XXXXXX")
report() {
    # pytest captures stderr, and an abort loses it: the sanitizers write to log files.
    if ls "$work"/logs/*.* >/dev/null 2>&1; then
        echo "tools/asan.sh: sanitizer findings:" >&2
        cat "$work"/logs/*.* >&2
    fi
    rm -rf "$work"
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
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:detect_stack_use_after_return=1:log_path=$work/logs/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/logs/ubsan" \
    PYTHONMALLOC=malloc \
    PYTHONPATH="$work/src" \
    FRAMEPIPE_REQUIRE_EXTENSIONS=1 \
    python -m pytest -p no:cacheprovider -q "$@"
