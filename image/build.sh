#!/bin/bash
# `make image`: the appliance's UEFI disk image (ESP, root A, root B, data) from Debian 12 packages.
# No loop mounts: the root is a debootstrap tree (cached, keyed by image/packages.txt) turned into
# ext4 with `mkfs.ext4 -d`; the ESP is made with mtools; `appliance image assemble` writes the GPT.
# Usage: image/build.sh OUT_DIR BUNDLE_DIR SIGNING_KEY TRUSTED_KEYS_DIR VERSION
set -euo pipefail
out=${1:?usage: build.sh OUT BUNDLE KEY TRUSTED VERSION}; bundle=$2; key=$3; trusted=$4; version=$5
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
work=$repo/build/image
appliance=$repo/.venv/bin/appliance

# The build holds the debootstrap cache, a staged root, the two file systems and the sparse disk at once:
# about 5 GiB. Say so before debootstrap rather than fail half-way with ENOSPC inside mkfs.
mkdir -p "$work"
need_mib=5120
free_mib=$(df --output=avail -m "$work" | tail -1 | tr -d ' ')
if [ "$free_mib" -lt "$need_mib" ]; then
    echo "image/build.sh: $free_mib MiB free in $work, the image build needs $need_mib MiB" >&2
    exit 1
fi

packages=$(grep -v '^#' "$here/packages.txt" | paste -sd, -)
cache=$work/rootfs-$(sha256sum "$here/packages.txt" | cut -c1-12)
[ -d "$cache" ] || "$here/debootstrap-root.sh" "$cache" "$packages"

stage=$work/root
rm -rf "$stage" "$work/data"
cp -a "$cache" "$stage"
rm -rf "$stage"/var/cache/apt/* "$stage"/var/lib/apt/lists/* "$stage"/usr/share/doc/* "$stage"/usr/share/man/* \
    "$stage"/usr/share/locale/*

# The appliance, offline: wheels built here, installed in a chroot into a venv that sees python3-bpfcc
# and python3-systemd.
rm -rf "$work/wheels"
# setuptools builds the wheel from build/lib and never deletes there: a moved module would ship twice.
rm -rf "$repo/build/lib" "$repo"/build/bdist.*
"$repo/.venv/bin/pip" wheel -q "$repo[server]" -w "$work/wheels"
mv "$work/wheels" "$stage/tmp/wheels"
chroot "$stage" python3 -m venv --system-site-packages /opt/appliance/.venv
chroot "$stage" /opt/appliance/.venv/bin/pip install -q --no-index --no-cache-dir --find-links /tmp/wheels 'appliance[server]'
rm -rf "$stage/tmp/wheels"
# The engines' libraries load in the root as the daemon will load them (a wheel without its native library
# fails here, not on the box); the speech kind's phonemes come from the espeak-ng program.
chroot "$stage" /opt/appliance/.venv/bin/python -c 'import onnxruntime, ctranslate2, fxtranslate, sentencepiece, tokenizers, soundfile, soxr'
chroot "$stage" espeak-ng --version >/dev/null
cp "$repo/README.md" "$stage/opt/appliance/README.md"
cp -r "$repo/docs" "$stage/opt/appliance/docs"  # the pages the README links

# Units, user, config, trusted keys. The config overrides live on the data partition.
install -m 0644 "$repo"/image/{appliance.service,appliance.socket,appliance-selftest.service,appliance-rollback.service} \
    "$stage/etc/systemd/system/"
install -m 0644 "$repo/image/appliance.sysusers.conf" "$stage/usr/lib/sysusers.d/appliance.conf"
systemd-sysusers --root="$stage"
install -d "$stage/etc/appliance/trusted-keys" "$stage/data" "$stage/var/lib/appliance" "$stage/boot/efi"
install -m 0644 "$repo/image/appliance.toml" "$stage/etc/appliance/appliance.toml"
install -m 0644 "$trusted"/*.pub "$stage/etc/appliance/trusted-keys/"
ln -sfn /data/conf.d "$stage/etc/appliance/conf.d"
install -m 0644 "$repo/image/fstab" "$stage/etc/fstab"
echo appliance > "$stage/etc/hostname"
: > "$stage/etc/machine-id"   # made at first boot
systemctl --root="$stage" enable appliance.socket appliance.service appliance-selftest.service
# Stable kernel and initrd names for `appliance update`, which copies them to the ESP.
ln -f "$stage"/boot/vmlinuz-* "$stage/boot/vmlinuz"
ln -f "$stage"/boot/initrd.img-* "$stage/boot/initrd.img"

# The data partition: firmware store (releases/, current, previous), config overrides, the appliance's
# state. The bundle is installed on trial: the first boot's self-test commits it.
data=$work/data
install -d "$data/conf.d" "$data/appliance"
"$appliance" firmware install "$bundle" --store "$data/appliance/firmware" --trusted-keys "$trusted"
chroot "$stage" id -u appliance >/dev/null
owner=$(chroot "$stage" id -u appliance):$(chroot "$stage" id -g appliance)
chown -R "$owner" "$data/appliance"

rm -f "$work/root.img" "$work/data.img"
# The sizes are the layout's (appliance/box/layout.py), read rather than repeated.
read -r root_mib data_mib < <("$repo/.venv/bin/python" -c 'from appliance.box import layout as l; print(l.ROOT_MIB, l.DATA_MIB)')
mkfs.ext4 -q -L root -d "$stage" "$work/root.img" "${root_mib}M"
mkfs.ext4 -q -L data -d "$data" "$work/data.img" "${data_mib}M"
# The trees are in the file systems now: only the ESP's three files are kept for the disk written next.
rm -rf "$work/esp" && mkdir "$work/esp"
cp "$stage/usr/lib/systemd/boot/efi/systemd-bootx64.efi" "$stage/boot/vmlinuz" "$stage/boot/initrd.img" "$work/esp/"
rm -rf "$stage" "$data"
"$appliance" image assemble --out "$out" --root "$work/root.img" --data "$work/data.img" \
    --boot-efi "$work/esp/systemd-bootx64.efi" --kernel "$work/esp/vmlinuz" --initrd "$work/esp/initrd.img"
"$appliance" image sign "$out" --key "$key" --version "$version"
rm -f "$work/root.img" "$work/data.img"
