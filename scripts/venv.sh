# Sourced by the scripts: use the active virtual environment, else the one scripts/setup.sh made.
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
