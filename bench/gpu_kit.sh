#!/usr/bin/env bash
# The wheels a GPU machine without a network needs for bench/gpu_session.sh, downloaded here into .whl/ (git-ignored).
#
# The project's borrowed test GPUs (docs/development/benchmarks.md) reach no package registry. Their image holds
# Python 3.12, a CUDA torch, transformers, huggingface_hub, safetensors, accelerate, numpy, pyarrow, typer, rich and
# pytest, but not diffusers, pydantic or torchao. A command takes at most 64 MiB of files, the working tree included. So this script downloads, for
# CPython 3.12 on manylinux x86-64, the wheels of the packages below at the versions installed in this checkout's
# .venv (those `make test` ran with), and builds solrl's own wheel: about 16 MiB together.
#
#   make gpu-kit            # or: bench/gpu_kit.sh
#
# Transformer Engine does not fit one command: its CUDA 13 core wheel is 181 MiB (transformer_engine_cu13 2.16.1), and
# its PyTorch extension is a source distribution compiled against the installed torch. With TE=VERSION this script
# also packs it for a few commands in a row (bench/te_kit.py): the core's library xz-compressed and cut into parts in
# .te/ (git-ignored), the extension's source built there while the parts travel. .te/CALLS.md lists the calls.
#
#   TE=2.16.1 make gpu-kit   # 2.16 is the first with NVFP4's row-scaled activations; about 2 minutes (xz -9)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# What the image lacks (diffusers, pydantic and its parts, torchao) and what solrl needs newer than the image may
# hold (typing-extensions for pydantic; peft at the version the tests ran with).
PACKAGES=(diffusers pydantic pydantic-core annotated-types typing-inspection typing-extensions torchao peft)
LIMIT_MIB=40

pins=()
for name in "${PACKAGES[@]}"; do
  version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") \
    || { echo "gpu_kit: $name is not installed in $PYTHON's environment (make install first)" >&2; exit 1; }
  pins+=("$name==$version")
done

rm -rf .whl && mkdir -p .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl .

size_mib=$(( $(du -sb .whl | cut -f1) / 1048576 ))
ls -1 .whl
echo "gpu_kit: ${#pins[@]} wheels and solrl's in .whl/, ${size_mib} MiB (a GPU command takes 64 MiB with the tree)"
if (( size_mib > LIMIT_MIB )); then
  echo "gpu_kit: .whl/ is over ${LIMIT_MIB} MiB" >&2
  exit 1
fi

[ -n "${TE:-}" ] || exit 0
te_download=$(mktemp -d)
trap 'rm -rf "$te_download"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$te_download" "transformer_engine_cu13==$TE" "transformer_engine==$TE"
# The extension's source from PyPI's simple index, its hash checked (pip download would run its setup.py, which
# needs a CUDA torch).
"$PYTHON" - "$TE" "$te_download" <<'PY'
import hashlib, re, sys, urllib.parse, urllib.request
version, folder = sys.argv[1:]
index = "https://pypi.org/simple/transformer-engine-torch/"
name = f"transformer_engine_torch-{version}.tar.gz"
page = urllib.request.urlopen(index).read().decode()
found = re.search(rf'href="([^"#]*/{re.escape(name)})#sha256=([0-9a-f]+)"', page)
if not found:
    sys.exit(f"gpu_kit: no {name} in {index}")
data = urllib.request.urlopen(urllib.parse.urljoin(index, found[1])).read()
if hashlib.sha256(data).hexdigest() != found[2]:
    sys.exit(f"gpu_kit: {name} does not match the index's sha256")
open(f"{folder}/{name}", "wb").write(data)
PY
"$PYTHON" bench/te_kit.py pack --core "$te_download"/transformer_engine_cu13-*.whl \
  --meta "$te_download"/transformer_engine-*.whl --sdist "$te_download"/transformer_engine_torch-*.tar.gz
