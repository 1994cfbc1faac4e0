#!/bin/sh
# Test harness, injected into test copies of the image only (never into `make image`'s output):
# reports the boot on the console and drives `appliance update` from a disk the host attaches
# (serial update-good, update-kill, update-power: an image; update-firmware: a firmware bundle;
# update-serve: stay up for the host's QUIC calls; update-rollback: `appliance firmware rollback`, no
# media content), since the box has no remote shell.
appliance=/opt/appliance/.venv/bin/appliance
entries=$(ls /boot/efi/loader/entries | tr '\n' ' ')
echo "test-driver: appliance.service $(systemctl is-active appliance.service)"
# the daemon's own account (its log is the journal, not the console): the last lines where it failed
if ! systemctl -q is-active appliance.service; then
    journalctl -u appliance.service -n 20 --no-pager -o cat | sed 's/^/test-driver: journal /'
fi
echo "test-driver: booted entries: $entries"
$appliance status > /run/status.txt
head -1 /run/status.txt | sed 's/^/test-driver: status /'
grep -E '^(worker|quic|conncache)' /run/status.txt | sed 's/^/test-driver: status /'
dev=$(ls /dev/disk/by-id/virtio-update-* 2>/dev/null | head -1)
if [ -z "$dev" ]; then
    echo "test-driver: idle, powering off"
    systemctl poweroff
    exit 0
fi
mode=${dev##*-}
store() {
    $appliance firmware store | sed 's/^/test-driver: store /'
    df -m --output=used,size /data | tail -1 | awk '{print "test-driver: data partition: " $1 " MiB used of " $2}'
}
case "$mode" in
serve)  # the host calls the API over QUIC, pinning the certificate made at first boot
    echo "test-driver: certificate $(base64 -w0 /var/lib/appliance/tls/cert.pem)"
    # the daemon's account of the host's calls, on the console where the test reads it
    journalctl -f -n 0 -u appliance.service --no-pager -o short-monotonic | sed -u 's/^/test-driver: journal /' &
    echo "test-driver: serving"
    exec sleep infinity ;;
rollback)
    $appliance firmware rollback
    echo "test-driver: firmware rollback exit $?"
    $appliance status | head -1 | sed 's/^/test-driver: status after rollback /'
    store
    systemctl poweroff
    exit 0 ;;
esac
mkdir -p /run/update-media
mount -o ro "$dev" /run/update-media
updater="$appliance update /run/update-media/image"
case "$mode" in
good|power)
    $updater
    echo "test-driver: update exit $?"
    systemctl reboot ;;
firmware)  # timed: copy, verify, restart on trial, self-test, commit
    started=$(date +%s.%N)
    $appliance update /run/update-media/bundle
    rc=$?
    echo "test-driver: firmware update exit $rc after $(echo "$(date +%s.%N) $started" | awk '{printf "%.1f", $1 - $2}') s"
    store
    systemctl reboot ;;
kill)
    $updater > /run/update.log 2>&1 &
    pid=$!
    until grep -q "write slot .: [4-9][0-9]%" /run/update.log; do sleep 0.2; done
    kill -9 "$pid"
    echo "test-driver: killed the update at $(tail -1 /run/update.log)"
    systemctl reboot ;;
esac
