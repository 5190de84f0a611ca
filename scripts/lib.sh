# Shared helpers for the developer scripts. Source it from bash:
#
#     source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# ensure_venv      creates .venv (again when its python or pip no longer runs), installs the package
#                  with its [dev] extras when pyproject.toml changed, and puts .venv/bin first
#                  on PATH.
# ensure_services  finds or starts PostgreSQL, Redis and RabbitMQ (scripts/services.py) and
#                  exports CELERY_FENCE_DATABASE_URL, CELERY_FENCE_BROKER_URL and
#                  CELERY_FENCE_RABBITMQ_URL. PostgreSQL is always required; a missing broker
#                  is fatal under CI=true and a warning otherwise (the tests that need it skip).
# shellcheck shell=bash

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$REPO_ROOT/.venv"
VENV_STAMP="$VENV/.celery-fence-installed"

say() { printf '%s\n' "$*" >&2; }
die() {
    say "error: $*"
    exit 1
}

# The URL with any password replaced by ***, for printing.
redact() { printf '%s\n' "$1" | sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#; s#([?&](ssl)?password=)[^&]*#\1***#g'; }

# Whether the virtual environment at $1 has a python that runs, with pip.
venv_works() { "$1/bin/python" -m pip --version >/dev/null 2>&1; }

ensure_venv() {
    if [ -e "$VENV" ] && ! venv_works "$VENV"; then
        # A .venv whose interpreter is gone (Python upgraded or removed), or one a failed
        # `python3 -m venv` left without pip, is made again.
        say "$VENV has no working python and pip: recreating it"
        rm -rf "$VENV"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        command -v python3 >/dev/null || die "python3 not found: install Python 3.10 or newer"
        python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
            die "python3 is $(python3 -V 2>&1 | cut -d' ' -f2); celery-fence needs 3.10 or newer"
        say "creating $VENV"
        if ! python3 -m venv "$VENV"; then
            rm -rf "$VENV"
            die "python3 -m venv failed: install the venv module (apt-get install python3-venv)"
        fi
    fi
    if [ ! -f "$VENV_STAMP" ] || [ "$REPO_ROOT/pyproject.toml" -nt "$VENV_STAMP" ]; then
        say "installing celery-fence[dev] into $VENV (log: $VENV/pip.log)"
        if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
            -e "${REPO_ROOT}[dev]" >"$VENV/pip.log" 2>&1; then
            cat "$VENV/pip.log" >&2
            die "pip install -e '.[dev]' failed (see above)"
        fi
        touch "$VENV_STAMP"
    fi
    export PATH="$VENV/bin:$PATH"
}

# find_broker NAME VARIABLE: export VARIABLE as the broker's URL unless it is already set.
# Under CI=true a missing broker is fatal; locally services.py's warning is enough.
find_broker() {
    local name=$1 variable=$2 url status=0 require=""
    if [ -n "${!variable:-}" ]; then
        return 0
    fi
    if [ "${CI:-}" = true ]; then
        require=--require
    fi
    url=$(python3 "$REPO_ROOT/scripts/services.py" "$name" $require) || status=$?
    case $status in
    0) export "$variable=$url" ;;
    3) ;;
    *) die "$name is not available (see above)${require:+; under CI=true every service is required}" ;;
    esac
}

# PostgreSQL is always required: services.py uses CELERY_FENCE_DATABASE_URL when it is set
# (and fails when it does not answer), else finds or starts a local or throwaway server.
ensure_services() {
    local database_url
    database_url=$(python3 "$REPO_ROOT/scripts/services.py" postgres --require) ||
        die "PostgreSQL is required (see above)"
    export CELERY_FENCE_DATABASE_URL=$database_url
    find_broker redis CELERY_FENCE_BROKER_URL
    find_broker rabbitmq CELERY_FENCE_RABBITMQ_URL
}

# One line per service on stdout, passwords hidden.
describe_services() {
    local variable
    for variable in CELERY_FENCE_DATABASE_URL CELERY_FENCE_BROKER_URL CELERY_FENCE_RABBITMQ_URL; do
        if [ -n "${!variable:-}" ]; then
            printf '  %s=%s\n' "$variable" "$(redact "${!variable}")"
        else
            printf '  %s is not set: the tests that need it are skipped\n' "$variable"
        fi
    done
}
