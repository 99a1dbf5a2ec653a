#!/usr/bin/env bash
# Copies this machine's GoogleTest and nlohmann-json (Debian packages) into .deps/prefix, a
# CMake prefix to carry to a machine that cannot install packages (the GPU machine), and what
# `msa serve` needs there:
#   - cpp-httplib as the upstream header-only httplib.h of Debian's source package of the
#     installed libcpp-httplib-dev (with Debian's patches applied): Debian's binary package is
#     a split header plus a shared library linked to OpenSSL, zlib and brotli, which the GPU
#     machine's image may lack; the header-only form compiles there with nothing else;
#   - PCRE2 and libunistring (headers and static libraries), so the tokenizer, and with it
#     the chat endpoint, builds there too (src/CMakeLists.txt finds them in the prefix);
#   - libpng, libjpeg-turbo and zlib (headers and static libraries) for image input.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=.deps/prefix
lib=/usr/lib/x86_64-linux-gnu
rm -rf "$prefix"
mkdir -p "$prefix/include" "$prefix/lib/x86_64-linux-gnu"
cp -r /usr/include/gtest /usr/include/gmock /usr/include/nlohmann "$prefix/include/"
cp "$lib"/libgtest*.a "$lib"/libgmock*.a "$prefix/lib/x86_64-linux-gnu/"
mkdir -p "$prefix/lib/x86_64-linux-gnu/cmake"
cp -r "$lib/cmake/GTest" "$prefix/lib/x86_64-linux-gnu/cmake/"

# The tokenizer's libraries (libpcre2-dev, libunistring-dev), static: nothing to install there.
cp /usr/include/pcre2.h "$prefix/include/"
cp /usr/include/uni*.h "$prefix/include/"
rm -f "$prefix/include/unistd.h"  # glibc's, not libunistring's
cp -r /usr/include/unistring "$prefix/include/"
cp "$lib/libpcre2-8.a" "$lib/libunistring.a" "$prefix/lib/x86_64-linux-gnu/"

# The image decoders of the media input (libpng, libjpeg-turbo, and zlib under libpng), static:
# `msa run --image` there without the -dev packages. FFmpeg is not packed (a build without it
# still takes images and folders of frames).
cp -L /usr/include/png.h /usr/include/pngconf.h /usr/include/pnglibconf.h /usr/include/jpeglib.h \
  /usr/include/jmorecfg.h /usr/include/jerror.h /usr/include/x86_64-linux-gnu/jconfig.h \
  /usr/include/zlib.h /usr/include/zconf.h "$prefix/include/"
cp "$lib/libpng16.a" "$lib/libjpeg.a" "$lib/libz.a" "$prefix/lib/x86_64-linux-gnu/"
ln -s libpng16.a "$prefix/lib/x86_64-linux-gnu/libpng.a"

# cpp-httplib's header-only form from Debian's source package (deb-src through a private apt
# configuration in a temporary folder: the machine's sources stay as they are).
version="$(dpkg-query -W -f='${Version}' libcpp-httplib-dev 2>/dev/null || true)"
if [ -z "$version" ]; then
  echo "pack_deps: libcpp-httplib-dev is not installed (scripts/install_deps.sh installs it)" >&2
  exit 1
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
codename="$(. /etc/os-release && echo "$VERSION_CODENAME")"
cat > "$tmp/sources.list" <<EOF
deb-src http://deb.debian.org/debian $codename main
deb-src http://deb.debian.org/debian-security $codename-security main
deb-src http://deb.debian.org/debian $codename-updates main
EOF
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/src"
apt_options=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
apt-get "${apt_options[@]}" update -qq
(cd "$tmp/src" && apt-get "${apt_options[@]}" source --download-only -qq "cpp-httplib=$version")
mkdir -p "$tmp/tree"
tar -xf "$tmp"/src/cpp-httplib_*.orig.tar.* -C "$tmp/tree" --strip-components=1
tar -xf "$tmp"/src/cpp-httplib_*.debian.tar.* -C "$tmp/tree"
if [ -f "$tmp/tree/debian/patches/series" ]; then
  while read -r patch; do
    case "$patch" in ''|'#'*) continue ;; esac
    patch -d "$tmp/tree" -p1 -s < "$tmp/tree/debian/patches/$patch"
  done < "$tmp/tree/debian/patches/series"
fi
grep -q '^inline bool Server::listen_after_bind' "$tmp/tree/httplib.h" || {
  echo "pack_deps: $tmp/tree/httplib.h is not the header-only cpp-httplib" >&2
  exit 1
}
cp "$tmp/tree/httplib.h" "$prefix/include/httplib.h"
cp "$tmp/tree/LICENSE" "$prefix/include/httplib.LICENSE"
echo "packed $(du -sh "$prefix" | cut -f1) into $prefix (cpp-httplib $version header-only)"
