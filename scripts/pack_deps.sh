#!/usr/bin/env bash
# Copies this machine's GoogleTest and nlohmann-json (Debian packages) into .deps/prefix, a
# CMake prefix to carry to a machine that cannot install packages (the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=.deps/prefix
rm -rf "$prefix"
mkdir -p "$prefix/include" "$prefix/lib/x86_64-linux-gnu"
cp -r /usr/include/gtest /usr/include/gmock /usr/include/nlohmann "$prefix/include/"
cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a \
  "$prefix/lib/x86_64-linux-gnu/"
mkdir -p "$prefix/lib/x86_64-linux-gnu/cmake"
cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$prefix/lib/x86_64-linux-gnu/cmake/"
echo "packed $(du -sh "$prefix" | cut -f1) into $prefix"
