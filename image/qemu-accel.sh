#!/bin/bash
# Prints the qemu accelerator the image tests use: kvm where /dev/kvm really runs OVMF, else tcg.
# (Some nested hosts expose /dev/kvm but fail to emulate OVMF's first instructions.)
set -uo pipefail
code=/usr/share/OVMF/OVMF_CODE_4M.fd
if [ -w /dev/kvm ] && [ -r "$code" ]; then
    tmp=$(mktemp -d)
    cp /usr/share/OVMF/OVMF_VARS_4M.fd "$tmp/vars.fd"
    timeout 10 qemu-system-x86_64 -machine q35,accel=kvm -m 256 -display none -monitor none -nic none \
        -drive if=pflash,format=raw,readonly=on,file=$code -drive if=pflash,format=raw,file="$tmp/vars.fd" \
        -serial file:"$tmp/serial" >/dev/null 2>&1
    booted=$(grep -c BdsDxe "$tmp/serial" 2>/dev/null)
    rm -rf "$tmp"
    [ "${booted:-0}" -gt 0 ] && { echo kvm; exit 0; }
fi
echo tcg
