#!/usr/bin/env bash
# Make sure the database server (PostgreSQL or MariaDB/MySQL) and the Redis server that the
# tests use are reachable. Reads DATABASE_URL (default postgres://root@127.0.0.1:5432/test;
# mysql://root@127.0.0.1:3306/test for MariaDB) and REDIS_URL (default
# redis://127.0.0.1:6379/0). Starts a local server when one is installed but not running,
# creates the database named in the URL when it is missing, and exits 1 with a clear message
# when a service cannot be reached.
set -uo pipefail

DATABASE_URL=${DATABASE_URL:-postgres://root@127.0.0.1:5432/test}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}

fail() {
    echo "services: $*" >&2
    exit 1
}

is_local() {
    case "$1" in
        localhost | 127.* | ::1 | "") return 0 ;;
        *) return 1 ;;
    esac
}

# Split scheme://[user[:pass]@]host[:port][/path] into URL_HOST, URL_PORT, URL_PATH.
parse_url() {
    local rest=${1#*://}
    local hostport=${rest%%/*}
    URL_PATH=""
    [[ $rest == */* ]] && URL_PATH=${rest#*/}
    URL_PATH=${URL_PATH%%\?*}
    hostport=${hostport##*@}
    if [[ $hostport == \[*\]* ]]; then # [ipv6]:port
        URL_HOST=${hostport#[}
        URL_HOST=${URL_HOST%%]*}
        URL_PORT=${hostport##*]}
        URL_PORT=${URL_PORT#:}
    else
        URL_HOST=${hostport%%:*}
        URL_PORT=""
        [[ $hostport == *:* ]] && URL_PORT=${hostport##*:}
    fi
}

# Wait up to $1 seconds for the command in "$@" (after $1) to succeed.
wait_for() {
    local seconds=$1
    shift
    local i
    for ((i = 0; i < seconds * 4; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.25
    done
    return 1
}

# ---------------------------------------------------------------- PostgreSQL
check_postgres() {
    parse_url "$DATABASE_URL"
    local host=${URL_HOST:-127.0.0.1} port=${URL_PORT:-5432} dbname=${URL_PATH}
    local where="$host:$port"

    command -v pg_isready >/dev/null 2>&1 ||
        fail "pg_isready/psql not found: install the PostgreSQL client (apt-get install postgresql-client) or postgresql"

    if ! pg_isready -q -h "$host" -p "$port"; then
        if is_local "$host" && command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
            local version
            version=$(ls /etc/postgresql | sort -n | tail -n 1)
            echo "services: starting PostgreSQL $version (cluster main)"
            pg_ctlcluster --skip-systemctl-redirect "$version" main start ||
                echo "services: pg_ctlcluster could not start the cluster" >&2
            wait_for 20 pg_isready -q -h "$host" -p "$port" || true
        fi
    fi
    pg_isready -q -h "$host" -p "$port" ||
        fail "PostgreSQL is not reachable at $where and no local server could be started: install postgresql or set DATABASE_URL"

    local err
    if ! err=$(psql "$DATABASE_URL" -X -q -tA -c 'select 1' 2>&1 >/dev/null); then
        if [[ $err == *"does not exist"* && $err == *database* && -n $dbname ]]; then
            local admin_url=${DATABASE_URL%%\?*}
            admin_url=${admin_url%/*}/postgres
            echo "services: creating database $dbname"
            createdb --maintenance-db="$admin_url" "$dbname" ||
                fail "could not create database $dbname at $where: create it, or set DATABASE_URL to an existing database"
            err=$(psql "$DATABASE_URL" -X -q -tA -c 'select 1' 2>&1 >/dev/null) ||
                fail "PostgreSQL at $where refuses the connection: $err"
        else
            fail "PostgreSQL at $where refuses the connection for DATABASE_URL ($err): create the role (e.g. createuser -s \$USER as postgres) or set DATABASE_URL"
        fi
    fi
    echo "services: PostgreSQL ok at $where/$dbname"
}

# ------------------------------------------------------------- MariaDB/MySQL
# Split the user and password out of DATABASE_URL into URL_USER and URL_PASSWORD.
parse_userinfo() {
    local rest=${1#*://}
    local userinfo=""
    [[ ${rest%%/*} == *@* ]] && userinfo=${rest%%@*}
    URL_USER=${userinfo%%:*}
    URL_PASSWORD=""
    [[ $userinfo == *:* ]] && URL_PASSWORD=${userinfo#*:}
}

mysql_ping() {
    MYSQL_PWD=$URL_PASSWORD mysqladmin --protocol=tcp -h "$1" -P "$2" -u "${URL_USER:-root}" ping
}

check_mysql() {
    parse_url "$DATABASE_URL"
    parse_userinfo "$DATABASE_URL"
    local host=${URL_HOST:-127.0.0.1} port=${URL_PORT:-3306} dbname=${URL_PATH}
    local where="$host:$port"

    command -v mysqladmin >/dev/null 2>&1 ||
        fail "mysqladmin not found: install the MariaDB client (apt-get install mariadb-client) or mariadb-server"

    if ! mysql_ping "$host" "$port" >/dev/null 2>&1; then
        if is_local "$host" && [ -x /usr/sbin/mariadbd ] && command -v start-stop-daemon >/dev/null 2>&1; then
            echo "services: starting MariaDB"
            install -d -o mysql -g mysql /run/mysqld 2>/dev/null || true
            start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd ||
                echo "services: start-stop-daemon could not start mariadbd" >&2
            wait_for 30 mysql_ping "$host" "$port" || true
        fi
    fi
    mysql_ping "$host" "$port" >/dev/null 2>&1 ||
        fail "MariaDB/MySQL is not reachable at $where and no local server could be started: install mariadb-server or set DATABASE_URL"

    if [ -n "$dbname" ]; then
        MYSQL_PWD=$URL_PASSWORD mysql --protocol=tcp -h "$host" -P "$port" -u "${URL_USER:-root}" \
            -e "CREATE DATABASE IF NOT EXISTS \`$dbname\` CHARACTER SET utf8mb4" ||
            fail "could not create database $dbname at $where: create it, or set DATABASE_URL"
    fi
    echo "services: MariaDB/MySQL ok at $where/$dbname"
}

# --------------------------------------------------------------------- Redis
redis_ping() {
    [ "$(redis-cli -u "$REDIS_URL" ping 2>/dev/null)" = "PONG" ]
}

check_redis() {
    parse_url "$REDIS_URL"
    local host=${URL_HOST:-127.0.0.1} port=${URL_PORT:-6379}
    local where="$host:$port"

    command -v redis-cli >/dev/null 2>&1 ||
        fail "redis-cli not found: install redis (apt-get install redis-server, or redis-tools for the client only)"

    if ! redis_ping; then
        if is_local "$host" && command -v redis-server >/dev/null 2>&1; then
            echo "services: starting redis-server on 127.0.0.1:$port"
            redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no >/dev/null ||
                echo "services: redis-server could not be started" >&2
            wait_for 20 redis_ping || true
        fi
    fi
    redis_ping ||
        fail "Redis is not reachable at $where and no local server could be started: install redis-server or set REDIS_URL"
    echo "services: Redis ok at $where"
}

case "$DATABASE_URL" in
    postgres://* | postgresql://*) check_postgres ;;
    mysql://*) check_mysql ;;
    *) echo "services: DATABASE_URL is neither PostgreSQL nor MySQL; no database server to check" ;;
esac
check_redis
