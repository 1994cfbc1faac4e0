#!/bin/bash
# Make this machine able to load bpf/conncache.c with bcc (run as root; `make deps` runs it):
# kernel headers findable for the running kernel, and bpffs mounted for the pinned maps.
# A running kernel without a header package of its own (a cloud or VM kernel) gets the
# newest installed Debian headers: the BPF program uses only the stable UAPI (__sk_buff, IP headers).
set -euo pipefail
modules=/lib/modules/$(uname -r)
if [ ! -e "$modules/build/include" ]; then
    build=$(ls -d /usr/src/linux-headers-*-amd64 /usr/src/linux-headers-*-arm64 2>/dev/null | sort -V | tail -1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
    if [ -z "$build" ] || [ -z "$common" ]; then
        echo "bpf/setup-host.sh: no kernel headers under /usr/src (apt-get install linux-headers-amd64)" >&2
        exit 1
    fi
    mkdir -p "$modules"
    ln -sfn "$build" "$modules/build"
    ln -sfn "$common" "$modules/source"
    echo "bpf/setup-host.sh: $modules/build -> $build, source -> $common"
fi
if ! mountpoint -q /sys/fs/bpf; then
    mount -t bpf bpf /sys/fs/bpf
    echo "bpf/setup-host.sh: mounted bpffs on /sys/fs/bpf"
fi
