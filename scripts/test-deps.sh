#!/bin/sh
# System packages the tests use beyond the services: libfaketime, which gives a worker process a
# clock that is wrong on purpose (tests/test_clock_skew.py). Installs it when it can; otherwise
# says what to install and exits 1.

have() {
    ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1
}

have && exit 0
echo "test-deps: installing faketime"
"$(dirname "$0")/apt-install.sh" faketime && have && exit 0
echo "test-deps: the clock-skew tests need libfaketime (apt-get install faketime)" >&2
exit 1
