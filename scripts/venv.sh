# Sourced by the README's two commands (scripts/main_job.sh, scripts/test.sh): `phase` prints a step with the
# seconds since the script started; `install_venv SPEC` makes .venv (if needed) and installs the project as SPEC
# says (`.` or `.[dev]`, editable). Run from the repository root.
start=$SECONDS
phase() { echo "== [$(( SECONDS - start ))s] $*" >&2; }

install_venv() {
  phase "venv: .venv (python3 -m venv)"
  python3 -m venv .venv
  phase "pip: upgrade pip"
  .venv/bin/python -m pip install -q --upgrade pip
  phase "pip: install -e '$1' (pinned versions; slow the first time)"
  .venv/bin/python -m pip install -q -e "$1"
}

# "total N min S s" since the script started.
elapsed() { echo "$(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"; }
