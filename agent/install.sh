#!/bin/sh
# Install or update the idle-reaper human-activity collector on this machine. Idempotent: run it again
# after an update. Run as root, from anywhere; it installs the files next to it.
#
#   1. a system user without a login and without a home (the service runs as it);
#   2. the collector and its docs into /opt/idle-reaper/;
#   3. the systemd service and timer (every minute), enabled and started;
#   4. the CloudWatch agent's StatsD listener (127.0.0.1:8125), appended to the agent's configuration.
#
# Overridable for tests and unusual layouts: IDLE_REAPER_PREFIX, IDLE_REAPER_UNIT_DIR, CWAGENT_CTL.
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=${IDLE_REAPER_PREFIX:-/opt/idle-reaper}
UNIT_DIR=${IDLE_REAPER_UNIT_DIR:-/etc/systemd/system}
CWAGENT_CTL=${CWAGENT_CTL:-/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl}
SERVICE_USER=idle-reaper-activity

log() { echo "idle-reaper-activity install: $*"; }

# The collector needs the system python3, 3.9 or newer (Amazon Linux 2023, Ubuntu 22.04+).
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
    log "python3 3.9 or newer is required" >&2
    exit 1
fi

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
install -m 0644 "$HERE/idle-reaper-activity.service" "$UNIT_DIR/idle-reaper-activity.service"
install -m 0644 "$HERE/idle-reaper-activity.timer" "$UNIT_DIR/idle-reaper-activity.timer"

# A broken copy must fail here, not silently every minute.
python3 -I "$PREFIX/idle_reaper_activity.py" --print >/dev/null

systemctl daemon-reload
systemctl enable --now idle-reaper-activity.timer
log "timer enabled"

# append-config keeps the agent's other configuration (the GPU metrics) and stores this one under its
# file name, so running it again replaces it instead of adding a second copy.
if [ -x "$CWAGENT_CTL" ]; then
    "$CWAGENT_CTL" -a append-config -m ec2 -s -c "file:$PREFIX/cloudwatch-agent-activity.json"
    log "CloudWatch agent StatsD listener configured"
else
    log "no CloudWatch agent at $CWAGENT_CTL: the metric is not published until it is installed" >&2
fi
