#!/usr/bin/env bash
# Wheels for running artrl on the GPU machine (benchmarks/gpu_check.py there): its image has Python 3.12,
# a CUDA torch, accelerate, peft, tokenizers, huggingface-hub, jinja2, anyio, h11, click (see
# /work/.library/device/KINDS.md) but not the rest of artrl's packages, and it cannot download. This puts
# them in .whl/ (~25 MB: artrl itself, built from this checkout, and the versions this checkout's .venv
# runs) and bitsandbytes in .whl/qlora/ (~7 MB, for the 4-bit settings). Then, with `carry: [".whl"]`:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl .whl/qlora/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 &&
#   python3 benchmarks/gpu_check.py --settings side-by-side --json-out $OUT/gpu.json 2>&1 | tee $OUT/gpu.log
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)
missing=(transformers trl pydantic pydantic-core annotated-types typing-inspection openai httpx2 httpcore2
  jiter sniffio truststore fastapi starlette annotated-doc opentelemetry-api uvicorn tqdm orjson
  datasets dill multiprocess  # (trl.chat_template_utils imports datasets; it needs pyarrow >= 24)
  peft accelerate tokenizers huggingface_hub)  # (the image has these, at other versions: ours, to match)
specs=()
for name in "${missing[@]}"; do
  specs+=("$name==$($py -c "import importlib.metadata as m; print(m.version('$name'))")")
done
rm -rf .whl && mkdir -p .whl/qlora
$py -m pip download -q --no-deps "${platform[@]}" -d .whl "${specs[@]}"
$py -m pip download -q --no-deps "${platform[@]}" -d .whl/qlora bitsandbytes
# bitsandbytes ships a library per CUDA/ROCm/XPU version (129 MB unpacked, a 43 MB wheel): the image's torch is
# a CUDA 13 build, so only the cuda13x and CPU libraries are kept (7 MB), to fit the 64 MiB a call carries
$py - <<'EOF'
import glob, os, zipfile

def keep(name: str) -> bool:
    lib = name.startswith("bitsandbytes/libbitsandbytes_")
    return not lib or any(k in name for k in ("cuda130", "cuda132", "cpu"))

src = glob.glob(".whl/qlora/bitsandbytes-*.whl")[0]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if keep(info.filename):
            data = zin.read(info)
            if info.filename.endswith("/RECORD"):
                data = b"\n".join(r for r in data.split(b"\n") if keep(r.split(b",")[0].decode()))
            zout.writestr(info, data)
os.replace(src + ".tmp", src)
EOF
$py -m pip wheel -q --no-deps --no-build-isolation -w .whl .  # artrl itself (its metadata: artrl.__version__)
du -sh .whl .whl/qlora
