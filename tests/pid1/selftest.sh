#!/bin/bash
# Runs inside the booted container as a oneshot unit; writes key=value lines to /out/result.txt.
out=/out/result.txt
: > "$out"
put() { echo "$1=$2" >> "$out"; }
prop() { systemctl show -p "$1" --value appliance.service; }
wait_for() {  # wait_for SECONDS COMMAND...
    local deadline=$((SECONDS + $1)); shift
    until "$@"; do [ $SECONDS -ge $deadline ] && return 1; sleep 0.2; done
}
call() { python3 /selftest/call.py "$1"; }

systemctl start appliance.socket appliance.service
put start_rc $?
put active "$(systemctl is-active appliance.service)"
put health "$(call /v2/health/ready)"
put infer "$(call infer)"
# QUIC on the daemon's UDP sockets, with the certificate made at first start
quic_call() { PYTHONPATH=/opt/appliance /opt/appliance/.venv/bin/python -m appliance call "$@" \
    --quic 127.0.0.1:4433 --cafile /var/lib/appliance/tls/cert.pem; }
put quic_health "$(quic_call health | python3 -c 'import json,sys; print("ready" if json.load(sys.stdin)["ready"] else "not")')"
put quic_listening "$(journalctl -b -u appliance.service --no-pager | grep -c 'HTTP/3 on UDP port 4433')"
put tls_key_mode "$(stat -c %a:%U /var/lib/appliance/tls/key.pem)"
put status_text "$(prop StatusText)"
pid=$(prop MainPID)
put uid "$(stat -c %U /proc/$pid)"
put socket_mode "$(stat -c %a:%G /run/appliance/api.sock)"
put journal_firmware "$(journalctl -u appliance.service -o json --no-pager | grep -c '"FIRMWARE":"voice-vad 1.0.0"')"

# a hung engine: the watchdog (WatchdogSec=2 in the test drop-in) must restart the daemon
touch /run/appliance-hang
call infer-async
restarted_once() { [ "$(prop NRestarts)" -ge 1 ]; }
is_active() { [ "$(systemctl is-active appliance.service)" = active ]; }
wait_for 30 restarted_once
put restarted $?
rm -f /run/appliance-hang
put restarts "$(prop NRestarts)"
put watchdog_logged "$(journalctl -u appliance.service --no-pager | grep -ci 'watchdog timeout')"
wait_for 60 is_active
put active_after_hang "$(systemctl is-active appliance.service)"
put health_after_hang "$(call /v2/health/ready)"
put new_pid "$([ "$(prop MainPID)" != "$pid" ] && echo yes || echo no)"

systemctl stop appliance.service
put stop_result "$(prop Result)"
put stop_status "$(prop ExecMainStatus)"
put done yes
systemctl poweroff
