#!/bin/bash
# A minimal Debian 12 tree: by default one that boots systemd as PID 1 under systemd-nspawn, for the
# PID 1 tests; with a package list (comma-separated) the root of the appliance image.
# The mirror is the one apt already uses on this machine.
set -euo pipefail
target=${1:?usage: debootstrap-root.sh TARGET [PACKAGES]}
mirror=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | head -1)
if [ -z "$mirror" ]; then
    mirror=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -1)
fi
packages=${2:-systemd,systemd-sysv,dbus,python3,python3-systemd,python3-cffi-backend,python3-cryptography,python3-venv,libgomp1}
rm -rf "$target.partial"
debootstrap --variant=minbase --include="$packages" bookworm "$target.partial" "$mirror"
mv "$target.partial" "$target"
