#!/usr/bin/env bash
# The compiled core under AddressSanitizer and UndefinedBehaviorSanitizer: build it with
# -fsanitize=address,undefined in a scratch copy of the sources (the checkout's own build is
# left alone), then run the test suite against that build, the frame fuzzing and its corpus of
# regression cases included. Any sanitizer finding fails the run and is printed.
#
#   tools/asan.sh                                          # the whole suite
#   tools/asan.sh tests/test_fuzz_frames.py --fuzz-minutes 5   # fuzz for longer
#
# Environment: PYTHON (default: the python on PATH, which needs setuptools and Cython 3),
# ASAN_TIMEOUT (seconds for the pytest run, default 2700: a hang fails instead of waiting).
#
# Needs gcc with libasan and libubsan (Debian: gcc; the runtimes come with it).
#
# How the interpreter is run:
# - CPython itself is not instrumented, so the sanitizer runtimes are preloaded. Leak detection
#   is off (CPython keeps memory alive at exit on purpose), and an allocation too large to
#   satisfy returns NULL (a MemoryError, which the cores must handle) instead of aborting, as
#   in CPython's own sanitizer builds.
# - PYTHONMALLOC=malloc sends every Python allocation through the instrumented malloc, so an
#   overrun of a frame's bytes object is caught too.
# - Crash signals are left to Python: the tests crash children on purpose (SIGSEGV in C code)
#   and check the exit signal and faulthandler's native traceback, in the parent and in the
#   child's stderr (copied there by framepipe._fault_echo, built instrumented here too).
# - tools/asan_forksafe.c is preloaded first. gcc 12's libasan takes no lock around fork(), so
#   a fork while another thread is inside its allocator or thread registry leaves the child
#   blocked forever on that lock (a worker that never starts: tools/asan_fork_repro.py shows it
#   without framepipe). The shim makes fork() wait until no thread is inside them. Newer
#   sanitizer runtimes (compiler-rt's pthread_atfork handlers) do this themselves.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
# The interpreter itself, not a wrapper script (a pyenv shim is bash: it must not run with the
# runtimes preloaded).
python=$("$python" -c 'import sys; print(sys.executable)')
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

asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
for lib in "$asan" "$ubsan"; do
    [ -e "$lib" ] || { echo "tools/asan.sh: $lib not found (install the gcc sanitizer runtimes)" >&2; exit 1; }
done

cp -r "$root/src" "$root/csrc" "$root/setup.py" "$root/pyproject.toml" "$root/README.md" "$work/"
rm -f "$work"/src/framepipe/_core*.so "$work"/src/framepipe/_fault_echo*.so \
    "$work/src/framepipe/_core.c"

cd "$work"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    "$python" setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }
gcc -O2 -Wall -shared -fPIC -o "$work/asan_forksafe.so" "$root/tools/asan_forksafe.c" "$asan" \
    || exit 1
nm -D "$work"/src/framepipe/_core*.so >"$work/symbols.txt"
if ! grep -q __asan_report "$work/symbols.txt"; then
    echo "tools/asan.sh: the scratch build of framepipe._core is not instrumented" >&2
    exit 1
fi

mkdir -p "$work/logs"
cd "$root"
if [ "$#" -eq 0 ]; then
    # Four tests are left out of the default run. Each asks that two events come within a margin
    # of 50 to 100 ms, and under the sanitizers (2-3x slower) on a loaded 2-core machine they
    # sometimes do not (each failed in one or two of three full runs here), never with a
    # sanitizer finding. The plain suite keeps both.
    # - test_forkserver_exit_codes_survive_many_deaths: a watched writer's death must show
    #   within the core's DEATH_GRACE (100 ms) of its EOF, else the read raises EOFError
    #   instead of WriterDied (the core's EOF-versus-death race);
    # - test_root_cause_without_error_files_is_the_first_death: the group must stop rank 1
    #   within 50 ms of rank 0's death, before rank 1 exits by itself;
    # - test_order_kept_while_batches_turn_slow_and_fast_again: it asks the loader to judge
    #   items that load at once as fast, which they are not under the sanitizers;
    # - test_rss_stays_flat_over_many_small_and_some_16_mib_messages: ASan's quarantine keeps
    #   up to 256 MB of freed memory by design, so RSS is not flat under it.
    # Left out too: the suites whose subject is not the compiled core but a tool above it
    # (mypy's types, the docs' examples, torch's elastic agent, joblib's and dask's own
    # machinery); they run in the plain suite.
    set -- tests \
        --ignore tests/test_typing.py --ignore tests/test_docs.py --ignore tests/test_run.py \
        --ignore tests/test_joblib.py --ignore tests/test_executor_swap.py \
        --deselect tests/test_faults.py::test_forkserver_exit_codes_survive_many_deaths \
        --deselect tests/test_workers_group.py::test_root_cause_without_error_files_is_the_first_death \
        --deselect tests/test_loader.py::test_order_kept_while_batches_turn_slow_and_fast_again \
        --deselect tests/test_fault_matrix.py::test_rss_stays_flat_over_many_small_and_some_16_mib_messages
fi
run() {
    env LD_PRELOAD="$work/asan_forksafe.so $asan $ubsan" \
        ASAN_OPTIONS="detect_leaks=0:verify_asan_link_order=0:abort_on_error=1:allocator_may_return_null=1:detect_stack_use_after_return=1:handle_segv=0:handle_sigbus=0:handle_sigfpe=0:handle_sigill=0:handle_abort=0:log_path=$work/logs/asan" \
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/logs/ubsan" \
        PYTHONMALLOC=malloc \
        PYTHONPATH="$work/src" \
        FRAMEPIPE_REQUIRE_EXTENSIONS=1 \
        "$@"
}
# The run must use the instrumented build, not an installed framepipe.
run "$python" -c "import importlib, sys; c = importlib.import_module('framepipe._core'); sys.exit(not c.__file__.startswith('$work/'))" \
    || { echo "tools/asan.sh: framepipe._core does not come from the scratch build" >&2; exit 1; }
# The sanitizers slow everything down 2-3x, and a few tests have margins of tens of
# milliseconds between two events. A test that fails is run once more; one that passes then was
# slowed past its margin (it is named above, for the record). One that fails twice fails the
# run, and so does any sanitizer finding, whether or not a test failed with it.
pytest_run() {
    run timeout -k 30 "${ASAN_TIMEOUT:-2700}" "$python" -m pytest -o cache_dir="$work/cache" \
        -q "$@"
}
rc=0
pytest_run "$@" || rc=$?
if [ "$rc" -eq 1 ]; then
    echo "tools/asan.sh: running the failed tests once more" >&2
    rc=0
    pytest_run --last-failed --last-failed-no-failures none "$@" || rc=$?
fi
if [ "$rc" -eq 124 ]; then
    echo "tools/asan.sh: the run took longer than ASAN_TIMEOUT=${ASAN_TIMEOUT:-2700} s" >&2
fi
exit "$rc"
