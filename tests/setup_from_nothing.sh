#!/bin/bash
# Run inside a private mount namespace (`unshare --mount`): hide what an earlier setup left on this
# machine (kernel headers linked under /lib/modules, bpffs mounted), copy the working tree as a fresh
# clone would have it, and bring the daemon up with `make run` as a newcomer would.
# Usage: setup_from_nothing.sh SOURCE_TREE WORKDIR QUIC_PORT
set -euo pipefail
source_tree=$1 work=$2 port=$3

mount -t tmpfs empty /lib/modules
while mountpoint -q /sys/fs/bpf; do umount -l /sys/fs/bpf; done
echo "before: /lib/modules holds [$(ls -A /lib/modules)], bpffs mounted: no"

mkdir -p "$work/clone"
# what a clone of the working tree would hold: tracked and untracked-not-ignored files that exist
(cd "$source_tree" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | xargs -0 cp --parents -t "$work/clone")
cd "$work/clone"
sed "s/^port = 4433/port = $port/" etc/dev.toml > etc/fresh.toml

setsid make run CONFIG=etc/fresh.toml > "$work/make.log" 2>&1 &
make_pid=$!
trap 'kill -TERM -- -$make_pid 2>/dev/null; wait $make_pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    if ! kill -0 $make_pid 2>/dev/null; then echo "make run exited early"; exit 1; fi
    if .venv/bin/appliance call health >/dev/null 2>&1; then break; fi
    sleep 1
done
.venv/bin/appliance status --json > "$work/status.json"
echo "after: bpffs mounted: $(mountpoint -q /sys/fs/bpf && echo yes || echo no)"
