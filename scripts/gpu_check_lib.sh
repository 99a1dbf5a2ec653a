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
# device_info OUT: the GPU's name, driver and memory, shown and kept in OUT/device.txt.
device_info() {
  step "device"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$1/device.txt"
}
# configure_gpu_build LOG: configures build-gpu (CUDA on, the packed deps), output in LOG.
configure_gpu_build() {
  cmake -S . -B build-gpu -G Ninja -DMSA_CUDA=ON -DMSA_NATIVE=OFF "${prefix_args[@]}" > "$1" 2>&1 ||
    { tail -30 "$1"; exit 1; }
}
# build_gpu_targets LOG TARGET...: builds the targets in build-gpu, output appended to LOG.
build_gpu_targets() {
  local log=$1
  shift
  ninja -C build-gpu -j "$(nproc)" "$@" >> "$log" 2>&1 || { grep -E "error|Error" -A3 "$log" | head -60; exit 1; }
}
