#!/bin/sh
# Install Debian packages with apt-get, as root or with password-less sudo. Exits 0 when
# apt-get succeeded, 1 when it is missing, not permitted, or failed. Usage: apt-install.sh PKG...
command -v apt-get >/dev/null 2>&1 || exit 1
if [ "$(id -u)" = 0 ]; then
    sudo=""
elif sudo -n true 2>/dev/null; then
    sudo="sudo -n"
else
    exit 1
fi
# shellcheck disable=SC2086
$sudo apt-get install -y -qq "$@" >/dev/null ||
    { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq "$@" >/dev/null; }
