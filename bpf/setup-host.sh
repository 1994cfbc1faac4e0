#!/bin/bash
# Make this machine able to load bpf/conncache.c with bcc (run as root; `make deps` runs it):
# kernel headers findable for the running kernel, and bpffs mounted for the pinned maps.
# A running kernel without a header package of its own (a cloud or VM kernel) gets the
# newest installed Debian headers: the BPF program uses only the stable UAPI (__sk_buff, IP headers).
# Safe to run again: each step says what it did, or that it was already done.
set -euo pipefail
shopt -s nullglob
say() { echo "bpf/setup-host.sh: $*"; }
fail() { echo "bpf/setup-host.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "must run as root (it links kernel headers and mounts bpffs)"

# The newest of a glob's matches (nullglob: an empty list when none match).
newest() { [ $# -gt 0 ] && printf '%s\n' "$@" | sort -V | tail -1 || true; }

modules=/lib/modules/$(uname -r)
if [ -e "$modules/build/include" ]; then
    say "kernel headers: $modules/build already there"
else
    build=$(newest /usr/src/linux-headers-*-amd64 /usr/src/linux-headers-*-arm64)
    common=$(newest /usr/src/linux-headers-*-common)
    if [ -z "$build" ] || [ -z "$common" ]; then
        fail "no Debian kernel headers under /usr/src for $(uname -r) (apt-get install linux-headers-$(dpkg --print-architecture))"
    fi
    mkdir -p "$modules"
    ln -sfn "$build" "$modules/build"
    ln -sfn "$common" "$modules/source"
    say "kernel headers: linked $modules/build -> $build, source -> $common"
fi

if mountpoint -q /sys/fs/bpf; then
    say "bpffs: already mounted on /sys/fs/bpf"
else
    mkdir -p /sys/fs/bpf 2>/dev/null || true
    mount -t bpf bpf /sys/fs/bpf || fail "cannot mount bpffs on /sys/fs/bpf (the eBPF connection cache will fall back to user space)"
    say "bpffs: mounted on /sys/fs/bpf"
fi
