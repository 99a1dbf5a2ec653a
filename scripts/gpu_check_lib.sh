# Shared set-up of the scripts/gpu_*_check.sh scripts, sourced from the repository root:
# the CMake argument for the packed dependencies (MSA_DEPS_PREFIX, default .deps/prefix when
# it exists: the device machine has no registry access), the step banner, and the results
# folder as an absolute path (the scripts cd around).
prefix="${MSA_DEPS_PREFIX:-}"
[ -z "$prefix" ] && [ -d .deps/prefix ] && prefix=.deps/prefix
prefix_args=()
[ -n "$prefix" ] && prefix_args=(-DCMAKE_PREFIX_PATH="$(realpath "$prefix")")
step() { echo; echo "=== $* ($(date +%T)) ==="; }
# results_dir DIR: makes DIR and prints its absolute path.
results_dir() { mkdir -p "$1" && (cd "$1" && pwd); }
