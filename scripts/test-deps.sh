#!/bin/sh
# System packages the tests use beyond the services: libfaketime, which gives a worker process a
# clock that is wrong on purpose (tests/test_clock_skew.py). Installs it with apt-get when it
# can (as root, or with password-less sudo); otherwise says what to install and exits 1.

have() {
    ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1
}

have && exit 0

if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        sudo=""
    elif sudo -n true 2>/dev/null; then
        sudo="sudo -n"
    else
        sudo="unavailable"
    fi
    if [ "$sudo" != unavailable ]; then
        echo "test-deps: installing faketime"
        $sudo apt-get install -y -qq faketime >/dev/null ||
            { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq faketime >/dev/null; }
        have && exit 0
    fi
fi
echo "test-deps: the clock-skew tests need libfaketime (apt-get install faketime)" >&2
exit 1
