#!/usr/bin/env bash
# Fails when regenerating proto/gen from proto/*.proto changes anything: generated code is
# committed and never edited by hand.
set -euo pipefail
cd "$(dirname "$0")/../.."
before=$(git status --porcelain=v1 --untracked-files=all -- proto/gen)
(cd proto && npx buf generate)
after=$(git status --porcelain=v1 --untracked-files=all -- proto/gen)
if [[ "$before" != "$after" ]] || ! git diff --quiet -- proto/gen; then
  echo "gen-check: proto/gen is stale; run 'npm run gen' and commit the result" >&2
  git status --short -- proto/gen >&2
  exit 1
fi
echo "gen-check: proto/gen is current"
