# The start of every device call that needs the carried wheels (issue 43). SOURCE it, from the repo's root:
#
#     source tools/gpu/env.sh && PYTHON=python3 bash tools/gpu/e2e.sh; cp docs/gpu/*/e2e.* $OUT/
#
# (carry .whl and the speech set: the list tools/gpu/wheels.sh prints last). It
#   1. installs .whl/*.whl into /tmp/site (pip, no index, no dependencies: tools/gpu/wheels.sh chose them),
#   2. exports PYTHONPATH=/tmp/site:$PWD (the carried wheels before the image's packages; contrastkit from here),
#   3. where the image has no complete FFmpeg (ldconfig -p), links FFmpeg's libraries from the carried av wheel's
#      av.libs/ into /tmp/ffmpeg-sonames under the SONAMEs torchcodec's core library asks for
#      (libavcodec.so.61 -> /tmp/site/av.libs/libavcodec-08752d0c.so.61.3.100, ...) and every other av.libs file
#      under its own name (the bundled libraries have no RPATH: libavformat finds libxml2-*.so there), and puts
#      that folder first on LD_LIBRARY_PATH,
#   4. runs tools/gpu/env_check.py (about 30 s) and returns its status.
# It returns (never exits) 1 on a failure, so `source tools/gpu/env.sh && ...` stops there, and a caller
# under `set -e` stops at a failed `source`. It sets no shell options.
# Environment: PYTHON (default python3), GPU_SITE (default /tmp/site), FFMPEG_FROM (auto, the default: av.libs
# only where the image has no FFmpeg; av: av.libs even so; system: never), GPU_ENV_CHECK_ARGS (for
# env_check.py, e.g. --no-cuda), GPU_ENV_PIP_ARGS (added to pip install: a rehearsal on a machine with another
# Python names the device's, e.g. --python-version 3.12 --implementation cp --only-binary=:all: --platform ...).

if ! (return 0 2>/dev/null); then
  echo "tools/gpu/env.sh: source it (source tools/gpu/env.sh && ...): run as a program, its exports are lost" >&2
  exit 2
fi

_gpu_env_ffmpeg_system() {  # prints "FFmpeg N" for each major whose seven libraries ldconfig knows
  local cache line major so ok lib
  cache=$( { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null) || cache=
  for line in "4 56 58 58 58 7 5 3" "5 57 59 59 59 8 6 4" "6 58 60 60 60 9 7 4" "7 59 61 61 61 10 8 5" \
              "8 60 62 62 62 11 9 6"; do
    set -- $line; major=$1; shift; ok=1
    for lib in avutil avcodec avformat avdevice avfilter swscale swresample; do
      so=$1; shift
      case $cache in *"lib$lib.so.$so "*) ;; *) ok=0 ;; esac
    done
    [ "$ok" = 1 ] && echo "FFmpeg $major"
  done
  return 0
}

_gpu_env_link_av() {  # _gpu_env_link_av AVLIBS LINKS: the links of step 3; prints the SONAMEs linked
  local libs=$1 links=$2 f base name so found=
  rm -rf "$links" && mkdir -p "$links" || return 1
  for f in "$libs"/*; do
    [ -f "$f" ] || continue
    base=${f##*/}
    ln -s "$f" "$links/$base" || return 1
    case $base in
      libavutil-*.so.*|libavcodec-*.so.*|libavformat-*.so.*|libavdevice-*.so.*|libavfilter-*.so.*|\
      libswscale-*.so.*|libswresample-*.so.*)
        name=${base%%-*}; so=${base#*.so.}; so=${so%%.*}
        ln -s "$f" "$links/$name.so.$so" || return 1
        found+=" $name.so.$so" ;;
    esac
  done
  set -- $found
  if [ "$#" != 7 ]; then
    echo "gpu_env: error: $libs holds $# of FFmpeg's seven libraries:${found:- none}" >&2
    return 1
  fi
  echo "$found"
}

_gpu_env() {
  local py=${PYTHON:-python3} site=${GPU_SITE:-/tmp/site} links=/tmp/ffmpeg-sonames from=${FFMPEG_FROM:-auto}
  local system linked
  if [ ! -f tools/gpu/env.sh ]; then
    echo "gpu_env: error: source it from the repo's root (tools/gpu/env.sh not found in $PWD)" >&2
    return 1
  fi
  case $from in
    auto|av|system) ;;
    *) echo "gpu_env: error: FFMPEG_FROM=$from (auto, av or system)" >&2; return 1 ;;
  esac
  if compgen -G ".whl/*.whl" >/dev/null; then
    # shellcheck disable=SC2086  # GPU_ENV_PIP_ARGS: words on purpose
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        ${GPU_ENV_PIP_ARGS:-} .whl/*.whl || { echo "gpu_env: error: pip could not install .whl/*.whl" >&2; return 1; }
    echo "gpu_env: $(ls .whl/*.whl | wc -l) wheels installed into $site"
  else
    echo "gpu_env: no .whl/*.whl (carry .whl): nothing installed"
  fi
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

  system=$(_gpu_env_ffmpeg_system | paste -sd, -)
  if [ "$from" = system ] || { [ "$from" = auto ] && [ -n "$system" ]; }; then
    echo "gpu_env: FFmpeg from the system (${system:-none found by ldconfig}; FFMPEG_FROM=$from)"
  elif [ -d "$site/av.libs" ]; then
    linked=$(_gpu_env_link_av "$site/av.libs" "$links") || return 1
    export LD_LIBRARY_PATH="$links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu_env: FFmpeg from $site/av.libs through $links (first on LD_LIBRARY_PATH):$linked" \
         "(the system's: ${system:-none})"
  else
    echo "gpu_env: warning: no $site/av.libs (carry .whl with the av wheel): torchcodec finds only the" \
         "system's FFmpeg (${system:-none})" >&2
  fi
  # shellcheck disable=SC2086
  "$py" tools/gpu/env_check.py ${GPU_ENV_CHECK_ARGS:-}
}

_gpu_env
return $?
