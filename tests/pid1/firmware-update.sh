#!/bin/bash
# Runs inside the booted container: firmware-only updates through `appliance update`, with systemctl
# restarting the real unit. Writes key=value lines to /out/result.txt.
out=/out/result.txt
: > "$out"
put() { echo "$1=$2" >> "$out"; }
appliance() { PYTHONPATH=/opt/appliance /opt/appliance/.venv/bin/python -m appliance "$@"; }
serving() { appliance status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["firmware"]["version"])'; }

systemctl start appliance.socket appliance.service
# What appliance-selftest.service does at boot: the bundle installed at build time commits.
appliance image selftest --timeout 60 > /tmp/selftest.log 2>&1
put boot_selftest $?
put boot_committed "$(grep -c 'firmware voice-vad-1.0.0-.* committed' /tmp/selftest.log)"

started=$(date +%s%N)
appliance update /media/newer --timeout 60 > /tmp/update.log 2>&1
put update_rc $?
put update_ms $(( ($(date +%s%N) - started) / 1000000 ))
put after_update "$(serving)"
put store_after_update "$(appliance firmware store | head -1)"

appliance update /media/broken --timeout 60 > /tmp/broken.log 2>&1
put broken_rc $?
put broken_rolled_back "$(grep -c 'failed its self-test.*rolled back: voice-vad-1.1.0-.* serves again' /tmp/broken.log)"
put after_broken "$(serving)"
put active_after_broken "$(systemctl is-active appliance.service)"

appliance firmware rollback --timeout 60 > /tmp/rollback.log 2>&1
put rollback_rc $?
put after_rollback "$(serving)"
put releases "$(ls /var/lib/appliance/firmware/releases | wc -l)"

# A power cut during a trial leaves a bad bundle current, on trial; the boot self-test fails and
# appliance-rollback.service (its OnFailure) returns to the previous firmware and tests again.
appliance firmware install /media/broken
systemctl restart appliance.service
put boot_trial_start $?
systemctl start appliance-selftest.service
recovered() { [ "$(systemctl is-active appliance-selftest.service)" = active ] && ! appliance firmware store | grep -q trial; }
deadline=$((SECONDS + 90))
until recovered; do [ $SECONDS -ge $deadline ] && break; sleep 0.5; done
recovered
put recovered $?
put after_recovery "$(serving)"
put store_after_recovery "$(appliance firmware store | head -1)"
put recover_logged "$(journalctl -b -u appliance-rollback.service --no-pager | grep -c 'firmware voice-vad-1.2.0-.* failed its self-test; back on voice-vad-1.0.0-')"
cat /tmp/update.log /tmp/broken.log /tmp/rollback.log | tr '\n' ' ' | sed 's/^/log=/' >> "$out"; echo >> "$out"
put done yes
systemctl poweroff
