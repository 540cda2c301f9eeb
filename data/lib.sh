# shellcheck shell=bash disable=SC2034 # variables here are for the scripts that source this
# Shared by the pipeline scripts in data/ (sourced, not run).
#
# Settings come from a recipe in configs/ (CONFIG=configs/demo.conf by default); the environment
# overrides WORK (the work directory, data/work by default) and every recipe key but the arrays.
# Every step writes its outputs, then a done marker; a step whose marker exists is skipped.
# Outputs without a marker mean an earlier run was interrupted: the step says so and redoes them.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA="$ROOT/data"
CONFIG="${CONFIG:-$ROOT/configs/demo.conf}"
[[ -f "$CONFIG" ]] || { echo "error: recipe $CONFIG not found" >&2; exit 1; }
# shellcheck source=/dev/null
source "$CONFIG"
WORK="${WORK:-$ROOT/data/work}"
PYTHON="${PYTHON:-python}"
export PYTHONUNBUFFERED=1

log() { printf '[%s %s] %s\n' "$(date +%H:%M:%S)" "${STEP:-pipeline}" "$*"; }
die() { printf 'error%s: %s\n' "${STEP:+ in step $STEP}" "$*" >&2; exit 1; }

need_command() {
  command -v "$1" >/dev/null 2>&1 ||
    die "'$1' not found on PATH; activate the venv (make demo does) or run 'pip install -e .'"
}

# begin_step NAME OUTPUT...: returns 1 (skip) when NAME is done; otherwise removes the leftovers
# of an interrupted run (named OUTPUTs) so that the step starts clean, and returns 0.
begin_step() {
  STEP="$1"; shift
  if [[ -f "$WORK/done/$STEP" ]]; then
    log "done already ($(cat "$WORK/done/$STEP")), skipping"
    return 1
  fi
  local leftovers=()
  local path
  for path in "$@"; do [[ -e "$path" ]] && leftovers+=("$path"); done
  if ((${#leftovers[@]})); then
    log "an earlier run stopped before this step finished; redoing it (removing ${leftovers[*]})"
    rm -rf -- "${leftovers[@]}"
  fi
  log "starting"
  return 0
}

# finish_step SUMMARY: the marker that lets later runs skip the step.
finish_step() {
  mkdir -p "$WORK/done"
  printf '%s\n' "$1" >"$WORK/done/$STEP"
  log "done: $1"
}

# claim DIR ID PROOF: DIR holds the outputs of one set of inputs (ID); refuse to mix in another
# set once PROOF (a first finished output) exists. Before that, a new ID simply replaces the old.
claim() {
  mkdir -p "$1"
  if [[ -e "$3" && -f "$1/inputs.id" && "$(cat "$1/inputs.id")" != "$2" ]]; then
    die "$1 was made from
  $(cat "$1/inputs.id")
but this run asks for
  $2
Use another work directory (WORK=...) or delete $1."
  fi
  printf '%s\n' "$2" >"$1/inputs.id"
}

count_lines() { wc -l <"$1" | tr -d ' '; }
