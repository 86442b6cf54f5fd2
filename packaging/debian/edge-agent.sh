#!/bin/sh
# /usr/bin/edge-agent from the Debian package: runs the virtualenv its postinst built.
venv=/opt/edge-agent/venv
if [ ! -x "$venv/bin/edge-agent" ]; then
    echo "edge-agent: $venv is missing or incomplete; rebuild it with: sudo /usr/libexec/edge-agent/build-venv" >&2
    exit 69
fi
exec "$venv/bin/edge-agent" "$@"
