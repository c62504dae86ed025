#!/usr/bin/env bash
# The test command: set up, lint and format check (ruff), then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate

# ruff checks the files git tracks: files git does not know (a scratch model of your own next to
# the examples) are excluded, as ruff already excludes what .gitignore names. Ruff still picks the
# file types (.py, pyproject.toml, Markdown code blocks). Outside a git checkout: the whole tree.
untracked=()
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  while IFS= read -r -d '' path; do
    path=$(printf '%s' "${path%/}" | sed 's/[][\\*?{}]/\\&/g; s/,/?/g')  # as a glob (',' splits ruff's list)
    untracked+=(--extend-exclude "$path")
  done < <(git ls-files -z --others --exclude-standard --directory)
fi
ruff check ${untracked[@]+"${untracked[@]}"} .
ruff format --check ${untracked[@]+"${untracked[@]}"} .
# two workers: on 2 cores the suite runs in about 3/4 of the time of one (the multi-rank tests wait on their
# ranks and subprocesses); work stealing hands a worker that runs dry the other's queued tests, so the
# long multi-rank fixtures do not leave one worker idle at the end; PYTEST_WORKERS=0 runs it in this
# process (e.g. for pdb)
# the suite's processes (workers, ranks, CLI subprocesses) share their captures through one folder of this
# run (planner.frontend.capture_cache): a model exported by one is not exported again by the next
captures=$(mktemp -d)
trap 'rm -rf "$captures"' EXIT
export PLANNER_CAPTURE_CACHE_DIR="$captures"
workers=${PYTEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  pytest -q "$@"
else
  pytest -q -n "$workers" --dist worksteal "$@"
fi
