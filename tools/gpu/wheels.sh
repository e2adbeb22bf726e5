#!/usr/bin/env bash
# Fills .whl/ with exactly the wheels the GPU machine lacks for tools/gpu/e2e.sh and tools/gpu/check.sh
# (issue 43), FFmpeg's shared libraries for torchcodec among them (av, below), and weighs what a device call carries.
#
#     bash tools/gpu/wheels.sh              # fetch what is missing, drop what is not listed, check, print sizes
#     bash tools/gpu/wheels.sh --dry-run    # only print what it would fetch and drop
#
# The device call (carry .whl and the speech set's fsc/ and done.json, the list this script prints last) is
#
#     source tools/gpu/env.sh && ...        # e.g. && PYTHON=python3 bash tools/gpu/e2e.sh
#
# tools/gpu/env.sh installs .whl/*.whl into /tmp/site, sets PYTHONPATH, links FFmpeg's libraries from the
# av wheel where the image has no FFmpeg, and runs tools/gpu/env_check.py (about 30 s: versions, imports,
# where FFmpeg's libraries come from, torchcodec's decode, a bf16 matmul).
#
# The machine's image ('cuda': Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0,
# sentence-transformers 6.0.1, huggingface_hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0, accelerate 1.15.0,
# numpy 2.5.2, pyarrow, pandas, xxhash, fsspec, timm, pytorch-lightning, ...; the device tool's KINDS.md) has no
# network, so what it lacks travels as wheels: cp312 / abi3 / pure Python, manylinux x86_64 up to glibc 2.28
# (what its torch wheel needs). Versions are requirements/lock.txt's, except torchcodec: the lock's 0.17.0 goes
# with the lock's torch 2.14; torchcodec's compatibility table (its README) pairs 0.11 with torch 2.11.
# Not carried, as the image's versions meet every carried wheel's Requires-Dist: huggingface_hub (transformers
# 5.24 needs >=1.31), tokenizers (>=0.23.1,<0.24), safetensors (>=0.8.0), fsspec (datasets: <=2026.9.0, no
# later release exists), regex (>=2025.10.22, which the image's transformers 5.17 needs too).
# Not carried, with reason: hydra-core (lightly's requirement; only lightly.cli and lightly.embedding import it,
# the benchmarks import lightly.loss; its antlr4 4.9.3 has no wheel).
#
# FFmpeg: torchcodec 0.11.1's libtorchcodec_core<N>.so (N = 4..8) needs libavutil, libavcodec, libavformat,
# libavdevice, libavfilter, libswscale and libswresample of FFmpeg N (readelf -d: libavcodec.so.58/59/60/61/62).
# The image has none; Debian's packages of them weigh 82-125 MiB with what they pull in. PyAV's manylinux wheel
# bundles all seven, auditwheel-renamed (av.libs/libavcodec-08752d0c.so.61.3.100, ...) with their own codec,
# TLS and XML libraries, needing nothing outside glibc, libgcc_s, libstdc++ and zlib. av 13.0.0 is the smallest cp312
# wheel of any av release with an FFmpeg that torchcodec 0.11 supports (FFmpeg 7.0: libavcodec.so.61; 32.7 MiB,
# 21.8 of them av.libs; 13.1.0 bundles the same libraries; av 12.x: FFmpeg 6.1, 33.1-33.4 MiB; 14-15: FFmpeg 7.1,
# 38-38.2 MiB; 16-18: FFmpeg 8.0, 33.7-39.3 MiB; 19: libavcodec.so.63, which 0.11 has no core library for).
# Nothing imports av: the wheel travels repacked as av-13.0.0+ffmpeglibs-py3-none-*.whl, av.libs/ and av's
# licence alone, LZMA-compressed (16.1 MiB; pip reads it, Info-ZIP's unzip does not). The full wheel would fit
# only without transformers 5.24 (59.6 of 60 MiB).
# tools/gpu/env.sh links the SONAMEs torchcodec asks for (libavcodec.so.61 -> av.libs/libavcodec-*.so.61.3.100)
# and every other av.libs file under its own name into one folder on LD_LIBRARY_PATH: the bundled libraries
# carry no RPATH of their own (only av's extension modules do), so their dependencies must be on the search path.
#
# Size: the device tool carries at most 64 MiB; the repo's tracked and untracked-not-ignored files, .whl/ and the
# speech set (.e2e/speech/*/fsc and done.json: e2e.sh reads fsc/ alone; voxceleb1/ holds hard links to
# fsc's files, which a copy may carry twice, so it stays behind) must stay under LIMIT_MIB (60).
# Environment: PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "error: unknown argument '$1' (usage: bash tools/gpu/wheels.sh [--dry-run])" >&2; exit 2 ;;
esac
LIMIT_MIB=60
E2E_RESERVE_MIB=15  # the speech set's fsc/ (14.0 MiB) where .e2e/ is not made yet

# NAME takes requirements/lock.txt's version; NAME==VERSION overrides it; NAME==VERSION+ffmpeglibs is fetched
# as NAME==VERSION and repacked to its *.libs/ folder alone (repack_libs below).
WHEELS=(
  open_clip_torch ftfy wcwidth webdataset braceexpand  # open_clip and open_clip_train's imports
  datasets dill multiprocess                           # datasets (pyarrow, pandas, xxhash, fsspec: the image's)
  sentence-transformers transformers                   # the lock's (the image has 6.0.1 and 5.17.0)
  soundfile cffi pycparser                             # soundfile's wheel bundles libsndfile; cffi is not in the image
  torchcodec==0.11.1                                   # pairs with torch 2.11 (torchcodec's README table)
  av==13.0.0+ffmpeglibs                                # FFmpeg 7.0's libraries for torchcodec (above)
  lightly inf-cl                                       # benchmarks/losses.py's references
)
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }  # a wheel file name's spelling of a project
lock_version() {
  local v
  v=$(grep -iE "^$(norm "$1" | sed 's/_/[-_.]/g')==" requirements/lock.txt | head -1 | cut -d= -f3)
  [ -n "$v" ] || { echo "error: $1 has no pin in requirements/lock.txt" >&2; exit 2; }
  echo "$v"
}
PIP_DOWNLOAD=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pip's own config here may name local wheel folders that do not exist: their warnings are noise
quiet_pip() { "$PY" "${PIP_DOWNLOAD[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; }

# repack_libs SRC.whl DIR LABEL: DIR/NAME-VERSION+LABEL-py3-none-PLATFORMS.whl holding SRC's NAME.libs/ (LZMA)
# and a dist-info with SRC's METADATA (version VERSION+LABEL) and licence files; no Python code, no extension.
repack_libs() {
  "$PY" - "$@" <<'EOF'
import base64, hashlib, re, sys, zipfile
from pathlib import Path

src, out_dir, label = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
with zipfile.ZipFile(src) as z:
    infos = [i for i in z.infolist() if not i.is_dir()]
    wheel_file = next(i.filename for i in infos if i.filename.count("/") == 1
                      and i.filename.endswith(".dist-info/WHEEL"))
    old = wheel_file.split("/")[0]
    name, version = old[: -len(".dist-info")].rsplit("-", 1)
    new_version, new = f"{version}+{label}", f"{name}-{version}+{label}.dist-info"
    tags = [l.split(":", 1)[1].strip() for l in z.read(wheel_file).decode().splitlines() if l.startswith("Tag:")]
    platforms = list(dict.fromkeys(t.split("-")[2] for t in tags))
    meta = z.read(f"{old}/METADATA").decode()
    meta = re.sub(r"(?m)^Version: .*$", f"Version: {new_version}", meta, count=1)
    meta = re.sub(r"(?m)^Summary: .*$", f"Summary: {name}.libs/ of {src.name} alone (no Python package): "
                  "tools/gpu/wheels.sh", meta, count=1)
    licences = re.findall(r"(?m)^License-File: (.+)$", meta)
    entries = [(i, z.read(i), zipfile.ZIP_LZMA) for i in infos if i.filename.startswith(f"{name}.libs/")]
    entries += [(zipfile.ZipInfo(f"{new}/METADATA"), meta.encode(), zipfile.ZIP_DEFLATED)]
    entries += [(zipfile.ZipInfo(f"{new}/{f}"), z.read(f"{old}/{f}"), zipfile.ZIP_DEFLATED)
                for f in licences if f"{old}/{f}" in z.namelist()]
    wheel = "".join(["Wheel-Version: 1.0\n", f"Generator: tools/gpu/wheels.sh from {src.name}\n",
                     "Root-Is-Purelib: false\n"] + [f"Tag: py3-none-{p}\n" for p in platforms])
    entries += [(zipfile.ZipInfo(f"{new}/WHEEL"), wheel.encode(), zipfile.ZIP_DEFLATED)]
if not any(e[0].filename.startswith(f"{name}.libs/") for e in entries):
    sys.exit(f"error: {src.name} has no {name}.libs/")
record = "".join(f"{i.filename},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                 f"{len(d)}\n" for i, d, _ in entries) + f"{new}/RECORD,,\n"
entries += [(zipfile.ZipInfo(f"{new}/RECORD"), record.encode(), zipfile.ZIP_DEFLATED)]
out = out_dir / f"{name}-{new_version}-py3-none-{'.'.join(platforms)}.whl"
tmp = out.with_suffix(".part")
with zipfile.ZipFile(tmp, "w") as w:
    for info, data, method in entries:
        entry = zipfile.ZipInfo(info.filename, date_time=(2020, 1, 1, 0, 0, 0))
        entry.external_attr = info.external_attr or 0o644 << 16
        entry.compress_type = method
        w.writestr(entry, data)
tmp.rename(out)
mib = lambda path: f"{path.stat().st_size / 2**20:.1f} MiB"
print(f"repacked {src.name} ({mib(src)}) -> {out.name} ({mib(out)})")
EOF
}

[ "$DRY" = 1 ] || mkdir -p .whl
declare -A WANT=()  # normalized name -> version
SPECS=()
for w in "${WHEELS[@]}"; do
  name=${w%%==*}
  if [ "$w" = "$name" ]; then ver=$(lock_version "$name"); else ver=${w#*==}; fi
  WANT[$(norm "$name")]=$ver
  SPECS+=("$name==$ver")
done

# Drop wheels not listed, or of another version (two versions of one package stop the install).
for f in .whl/*.whl; do
  [ -e "$f" ] || continue
  base=$(basename "$f")
  n=$(norm "${base%%-*}"); v=$(echo "$base" | cut -d- -f2)
  if [ "${WANT[$n]:-}" != "$v" ]; then
    if [ "$DRY" = 1 ]; then echo "would remove $base (not listed)"; else rm -f "$f" && echo "removed $base"; fi
  fi
done

declare -A HAVE=()
for f in .whl/*.whl; do
  if [ -e "$f" ]; then base=$(basename "$f"); HAVE[$(norm "${base%%-*}")]=$(echo "$base" | cut -d- -f2); fi
done
MISSING=(); REPACK=()
for s in "${SPECS[@]}"; do
  if [ "${HAVE[$(norm "${s%%==*}")]:-}" = "${s#*==}" ]; then echo "have  $s"
  elif [[ $s == *+ffmpeglibs ]]; then REPACK+=("$s"); echo "fetch $s (${s%+*}, repacked)"
  else MISSING+=("$s"); echo "fetch $s"; fi
done

if [ "$DRY" = 0 ] && [ "${#MISSING[@]}" -gt 0 ]; then
  quiet_pip -d .whl "${MISSING[@]}"
fi
if [ "$DRY" = 0 ]; then
  for s in ${REPACK[@]+"${REPACK[@]}"}; do
    tmp=$(mktemp -d)
    quiet_pip -d "$tmp" "${s%+*}"
    src=$(ls "$tmp"/*.whl)
    repack_libs "$src" .whl "${s##*+}"
    rm -rf "$tmp"
  done
fi

[ "$DRY" = 1 ] && exit 0

# ---------------------------------------------------------------------------------------------- list, check, size
echo "== .whl/"
ls -l .whl/*.whl | awk '{printf "%9.2f MiB  %s\n", $5/1048576, $NF}'
n=$(ls .whl/*.whl | wc -l)
[ "$n" -eq "${#SPECS[@]}" ] || { echo "error: .whl/ holds $n wheels, ${#SPECS[@]} listed" >&2; exit 1; }
echo "== requirements of the carried wheels, against each other and the image's package list"
checked=0
"$PY" tools/gpu/env_check.py --wheels .whl || checked=$?

echo "== what a device call carries (limit $LIMIT_MIB MiB of the device tool's 64)"
bytes() { xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s+=$1} END{print s+0}'; }  # sum over NUL-separated paths
mib() { awk -v b="$1" 'BEGIN{printf "%.1f", b/1048576}'; }
tracked=$(git ls-files -z | bytes)
untracked=$(git ls-files -z --others --exclude-standard | bytes)
wheels=$(find .whl -name '*.whl' -print0 | bytes)
CARRY=(.whl)
speech=$(ls -d .e2e/speech/speech_commands_*-small 2>/dev/null | tail -1 || true)
if [ -n "$speech" ] && [ -f "$speech/done.json" ]; then
  CARRY+=("$speech/fsc" "$speech/done.json")
  e2e=$(find "$speech/fsc" "$speech/done.json" -type f -print0 | bytes)
  e2e_line="$(mib "$e2e") MiB ($speech/fsc and done.json)"
else
  e2e=$((E2E_RESERVE_MIB * 1048576))
  e2e_line="$E2E_RESERVE_MIB MiB reserved (no speech set in .e2e/ yet: bash tools/gpu/e2e.sh --prepare makes it)"
fi
git check-ignore -q .e2e || echo "note: .e2e/ is not ignored, so all of it travels (voxceleb1/ too), carried or not"
total=$((tracked + untracked + wheels + e2e))
echo "repo: $(mib "$tracked") MiB tracked + $(mib "$untracked") MiB untracked;" \
     ".whl/: $(mib "$wheels") MiB ($n wheels); .e2e/: $e2e_line"
echo "total: $(mib "$total") MiB"
printf 'carry: ['; printf '"%s", ' "${CARRY[@]}" | sed 's/, $//'; echo ']'
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "error: $(mib "$total") MiB would travel, over $LIMIT_MIB MiB" >&2
  exit 1
fi
if [ "$checked" != 0 ]; then
  echo "error: a carried wheel's requirement is met neither by another carried wheel nor by the image (above)" >&2
  exit 1
fi
