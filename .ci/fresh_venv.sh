#!/usr/bin/env bash
# A newcomer's first minute, checked before the suite: a fresh virtual environment with only the
# base install (no test or bench extras), on a clean clone of what is committed (an untracked
# file cannot hide a missing one). In that venv:
#   1. the README's first command, read from README.md so the two cannot drift, exactly as written;
#   2. every other script in examples/;
#   3. dtorch built as a wheel and installed (not editable): every module of dtorch and
#      dtorch_launcher imports from site-packages, and every example runs from a folder outside
#      the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

first=$(awk '/^```bash/{f=1;next} /^```/{if(f){exit}} f' README.md | grep -v '^#' | head -1)
if [ -z "$first" ]; then
  echo "fresh venv: README.md has no command in its first \`\`\`bash block" >&2
  exit 1
fi
git clone -q . "$tmp/clone"
python3 -m venv "$tmp/venv"
# shellcheck disable=SC1091
. "$tmp/venv/bin/activate"

echo "[fresh venv] README's first command, in a clean clone: $first"
(cd "$tmp/clone" && bash -c "$first")

for example in "$tmp"/clone/examples/*.py; do
  name=examples/${example##*/}
  case "$first" in *"$name"*) continue ;; esac  # the README's command has just run it
  echo "[fresh venv] python3 $name"
  (cd "$tmp/clone" && python3 "$name")
done

echo "[fresh venv] the same venv, dtorch from a built wheel, run outside the source tree"
python3 -m pip wheel -q --no-deps -w "$tmp/dist" "$tmp/clone"
python3 -m pip uninstall -q -y dtorch
python3 -m pip install -q "$tmp"/dist/dtorch-*.whl
mkdir "$tmp/outside"
cp "$tmp"/clone/examples/*.py "$tmp/outside/"
cp -r "$tmp"/clone/examples/data "$tmp/outside/"   # train_llama.py's corpus ships beside it
cd "$tmp/outside"
python3 -I "$tmp/clone/scripts/import_every_module.py" "$tmp/clone"
for example in ./*.py; do
  echo "[fresh venv] (wheel, outside the tree) python3 ${example#./}"
  python3 "$example"
done
echo "[fresh venv] passed in $((SECONDS - started)) s"
