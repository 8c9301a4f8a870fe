#!/usr/bin/env bash
# Fails when regenerating proto/gen from proto/*.proto changes anything: generated code is
# committed and never edited by hand. Compared with proto/gen as it is before generating
# (not with the last commit), so it also passes after `npm run gen` on an uncommitted proto change.
set -euo pipefail
cd "$(dirname "$0")/../.."
snapshot() {
  git status --porcelain=v1 --untracked-files=all -- proto/gen
  git diff -- proto/gen
  git ls-files --others --exclude-standard -z -- proto/gen | xargs -0 -r cat
}
before=$(snapshot | sha256sum)
(cd proto && npx buf generate)
after=$(snapshot | sha256sum)
if [[ "$before" != "$after" ]]; then
  echo "gen-check: proto/gen is stale; run 'npm run gen' and commit the result" >&2
  git status --short -- proto/gen >&2
  exit 1
fi
echo "gen-check: proto/gen is current"
