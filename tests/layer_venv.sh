# Sourced by tests/run_bridge.sh and tests/run_releases.sh (run from the repository root).
# layer_over_venv312 VENV: make VENV (if missing) from .venv312's Python and append .venv312's site-packages
# after VENV's own through a .pth file, so what is installed in VENV shadows .venv312 and torch is neither
# downloaded nor copied.
layer_over_venv312() {
    local venv=$1 base_site site
    if [ ! -x .venv312/bin/python ]; then
        echo "tests: .venv312 is missing (tests/run.sh makes it)" >&2
        exit 1
    fi
    base_site=$(.venv312/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ ! -x "$venv/bin/python" ]; then
        .venv312/bin/python -m venv "$venv"
    fi
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$base_site')" > "$site/_memguard_venv312.pth"
}

# MEMGUARD_LAYER_STEP: "install" (install only), "test" (run the tests only) or unset (both).
layer_step_check() {
    case "${MEMGUARD_LAYER_STEP:-}" in
        ""|install|test) ;;
        *) echo "tests: MEMGUARD_LAYER_STEP is '${MEMGUARD_LAYER_STEP}'; it must be install, test or unset (both)" >&2
           exit 2 ;;
    esac
}
# layer_step STEP: true when this run does STEP (install or test)
layer_step() { [ -z "${MEMGUARD_LAYER_STEP:-}" ] || [ "$MEMGUARD_LAYER_STEP" = "$1" ]; }
