#!/usr/bin/env bash
# The aarch64 cross compiler and qemu-user that tests/test_kernel_isas.py builds and runs the ARM kernels with,
# from Debian's packages: installed when missing, where this machine has apt-get and root; otherwise it says why
# not and exits 0 (the test then skips, naming the packages). Bounded in time: CI runs it beside its main install.
set -uo pipefail
packages=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null; then
    echo "cross tools: already installed"; exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "cross tools: not installed (needs apt-get and root: apt-get install ${packages[*]})"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
install() { timeout 300 apt-get install -y -q --no-install-recommends "${packages[@]}"; }
if install || { timeout 120 apt-get update -q && install; }; then
    echo "cross tools: installed ($(aarch64-linux-gnu-gcc -dumpversion), $(qemu-aarch64 --version | head -1))"
else
    echo "cross tools: apt-get could not install ${packages[*]}; the aarch64 kernel check will skip"
fi
exit 0
