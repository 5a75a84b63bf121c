#!/bin/sh
# Install or update the idle-reaper human-activity collector on this machine. Idempotent: run it again
# after an update. Run as root, from anywhere; it installs the files next to it.
#
#   1. a system user without a login and without a home (the service runs as it);
#   2. the collector and its docs into /opt/idle-reaper/;
#   3. the systemd service and timer (every minute), enabled and started; the service may reach loopback and this
#      machine's own addresses (as they are now: the daily run writes them again);
#   4. the CloudWatch agent's StatsD listener (127.0.0.1:8125), appended to the agent's configuration.
#
# A machine it cannot run on (no Python 3.9+ among the system interpreters, as on Amazon Linux 2 with its
# Python 3.7; or no systemd, as in a container) is not an error: it says so once, installs nothing and
# exits 0, so the daily association does not fail (and alert the admins) on it every day. Such a machine
# sends no activity metric, and `idle-reaper status` shows it as "no collector": judged on CPU/GPU alone.
#
# Overridable for tests and unusual layouts: IDLE_REAPER_PREFIX, IDLE_REAPER_UNIT_DIR, CWAGENT_CTL,
# IDLE_REAPER_PYTHONS (the interpreters to try, in order), IDLE_REAPER_STATE_DIR, IDLE_REAPER_SYSTEMD_DIR.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=${IDLE_REAPER_PREFIX:-/opt/idle-reaper}
UNIT_DIR=${IDLE_REAPER_UNIT_DIR:-/etc/systemd/system}
CWAGENT_CTL=${CWAGENT_CTL:-/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl}
# The unit runs the interpreter chosen here, by absolute path: never whichever python3 is first on PATH.
PYTHONS=${IDLE_REAPER_PYTHONS:-/usr/bin/python3 /usr/bin/python3.13 /usr/bin/python3.12 /usr/bin/python3.11 /usr/bin/python3.10 /usr/bin/python3.9}
STATE_DIR=${IDLE_REAPER_STATE_DIR:-/var/lib/idle-reaper}
SYSTEMD_DIR=${IDLE_REAPER_SYSTEMD_DIR:-/run/systemd/system}
SERVICE_USER=idle-reaper-activity

log() { echo "idle-reaper-activity install: $*"; }

# Not installed here, and why: said once (the association's output), then silent on later runs.
unsupported() {
    mkdir -p "$STATE_DIR"
    if [ "$(cat "$STATE_DIR/collector-unsupported" 2>/dev/null)" != "$1" ]; then
        echo "$1" > "$STATE_DIR/collector-unsupported"
        log "not installed: $1. This machine is judged on CPU/GPU alone (\"no collector\" in idle-reaper status)." >&2
    fi
    exit 0
}

PYTHON=""
for candidate in $PYTHONS; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
        PYTHON=$candidate
        break
    fi
done
[ -n "$PYTHON" ] || unsupported "no Python 3.9 or newer among $PYTHONS (Amazon Linux 2 ships 3.7)"
[ -d "$SYSTEMD_DIR" ] && command -v systemctl >/dev/null 2>&1 || unsupported "systemd is not running"
rm -f "$STATE_DIR/collector-unsupported"

if ! getent passwd "$SERVICE_USER" >/dev/null; then
    NOLOGIN=$(command -v nologin || echo /sbin/nologin)
    useradd --system --no-create-home --home-dir /nonexistent --shell "$NOLOGIN" "$SERVICE_USER"
    log "created system user $SERVICE_USER"
fi

install -d -m 0755 "$PREFIX"
install -m 0755 "$HERE/idle_reaper_activity.py" "$PREFIX/idle_reaper_activity.py"
install -m 0644 "$HERE/cloudwatch-agent-activity.json" "$PREFIX/cloudwatch-agent-activity.json"
install -m 0644 "$HERE/README.md" "$PREFIX/README.md"
install -d -m 0755 "$UNIT_DIR"
# The unit may reach this machine's own addresses besides loopback (a Jupyter server listening on one of them only):
# systemd cannot name them, the collector lists them (IPv4 and IPv6, neither loopback nor link-local).
ADDRESSES=$("$PYTHON" -I "$PREFIX/idle_reaper_activity.py" --own-addresses)
sed -e "s|/usr/bin/python3 -I|$PYTHON -I|" -e "s|^IPAddressAllow=localhost\$|IPAddressAllow=localhost${ADDRESSES:+ $ADDRESSES}|" \
    "$HERE/idle-reaper-activity.service" > "$UNIT_DIR/idle-reaper-activity.service"
chmod 0644 "$UNIT_DIR/idle-reaper-activity.service"
install -m 0644 "$HERE/idle-reaper-activity.timer" "$UNIT_DIR/idle-reaper-activity.timer"

# A broken copy must fail here, not silently every minute.
"$PYTHON" -I "$PREFIX/idle_reaper_activity.py" --print >/dev/null

systemctl daemon-reload
systemctl enable --now idle-reaper-activity.timer
log "timer enabled ($PYTHON)"

# append-config keeps the agent's other configuration (the GPU metrics) and stores this one under its
# file name, so running it again replaces it instead of adding a second copy.
if [ -x "$CWAGENT_CTL" ]; then
    "$CWAGENT_CTL" -a append-config -m ec2 -s -c "file:$PREFIX/cloudwatch-agent-activity.json"
    log "CloudWatch agent StatsD listener configured"
else
    log "no CloudWatch agent at $CWAGENT_CTL: the metric is not published until it is installed" >&2
fi
