# Sourced (not run) by the scripts that build a cached virtual environment (setup_vllm_cpu.sh,
# ensure_env_torch211.sh): the stamp check that skips a build already done, and the venv's creation.

# venv_current VENV STAMP WANT CHECK: VENV's python exists, its stamp file STAMP holds WANT and it passes the
# python snippet CHECK (exit status 0: nothing to do).
venv_current() {
    [ -x "$1/bin/python" ] && [ "$(cat "$2" 2>/dev/null)" = "$3" ] && "$1/bin/python" -c "$4" >/dev/null 2>&1
}

# venv_create VENV WHAT: create VENV (said on stderr as "creating WHAT VENV") unless it has a python already.
venv_create() {
    if [ ! -x "$1/bin/python" ]; then
        echo "creating $2 $1" >&2
        python3 -m venv "$1" >&2
    fi
}
