#!/bin/sh
# Make sure the system packages that building mysqlclient (the `mysql` extra) needs are here:
# pkg-config, the MariaDB/MySQL client headers (default-libmysqlclient-dev) and a C compiler
# (build-essential). Installs the missing ones with apt-get when it can (as root, or with
# password-less sudo); otherwise says which to install and exits 1.

have() {
    command -v pkg-config >/dev/null 2>&1 &&
        { pkg-config --exists mysqlclient || pkg-config --exists libmariadb; } &&
        command -v cc >/dev/null 2>&1
}

have && exit 0

packages="pkg-config default-libmysqlclient-dev build-essential"
echo "mysql-build-deps: installing $packages"
# shellcheck disable=SC2086
"$(dirname "$0")/apt-install.sh" $packages && have && exit 0
echo "mysql-build-deps: building mysqlclient needs $packages (apt-get install $packages)" >&2
exit 1
